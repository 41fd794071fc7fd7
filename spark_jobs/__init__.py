"""Spark jobs of the apply stage.

* :mod:`spark_jobs.session` builds the local Spark session (one per process).
* :mod:`spark_jobs.source` is the Python Data Source ``cdclog`` that streams log-store records
  (embedded or Kafka) into Structured Streaming, with offsets checkpointed by Spark.
* :mod:`spark_jobs.apply` is the apply job: micro-batches of records are parsed, dead letters are
  set aside, and every sink (:mod:`sinks`) applies the batch; runnable as
  ``spark-submit cdc/cli/spark_submit.py`` or through ``cdc apply``.
"""
