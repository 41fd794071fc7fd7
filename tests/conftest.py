# Fixtures live in plugin modules under tests/plugins; this file only lists them.
pytest_plugins = [
    "tests.plugins.bytecode",
    "tests.plugins.markers",
    "tests.plugins.postgres",
    "tests.plugins.logstore",
    "tests.plugins.spark",
    "tests.plugins.spark_cluster",
    "tests.plugins.jvm_archive",
    "tests.plugins.spark_workers",
    "tests.plugins.capture",
    "tests.plugins.failover",
    "tests.plugins.cli",
]
