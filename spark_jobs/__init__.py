"""Spark jobs of the apply stage.

* :mod:`spark_jobs.session` builds the local Spark session (one per process).
* :mod:`spark_jobs.source` is the Python Data Source ``cdclog`` that streams log-store records
  (embedded or Kafka) into Structured Streaming, with offsets checkpointed by Spark.
* :mod:`spark_jobs.apply` is the apply job, the Spark glue: each micro-batch's records go to
  :mod:`spark_jobs.applier` (the Spark-free :class:`~spark_jobs.applier.BatchApplier`: parse, dead
  letters set aside, every sink of :mod:`sinks` applies the batch), then the driver commits
  (:mod:`spark_jobs.ledger`); the query's life is :mod:`spark_jobs.lifecycle`, stalls
  :mod:`spark_jobs.watchdog`. Runnable as ``spark-submit cdc/cli/spark_submit.py`` or through
  ``cdc apply``.
"""
