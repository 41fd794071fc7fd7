"""The flags of the JVMs the apply starts (issues 33, 35; ``spark_jobs.session.JVM_OPTIONS``): the
driver's JVM runs with them, and Spark's launcher gets them unless its options are set."""

from __future__ import annotations

import os
from typing import Any

import pytest

from spark_jobs.session import JVM_OPTIONS, prepare_environment


def _vm_option(spark: Any, name: str) -> str:
    jvm = spark.sparkContext._jvm
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    )
    return str(bean.getVMOption(name).getValue())


def test_the_driver_jvm_runs_c1_only_with_the_serial_collector_and_no_perf_data(spark: Any) -> None:
    assert JVM_OPTIONS.split() == ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-XX:-UsePerfData"]
    assert _vm_option(spark, "TieredStopAtLevel") == "1"
    assert _vm_option(spark, "UseSerialGC") == "true"
    assert _vm_option(spark, "UseG1GC") == "false"
    assert _vm_option(spark, "UsePerfData") == "false"


def test_the_launcher_gets_the_flags_unless_its_options_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # a copy: what prepare_environment sets (JAVA_HOME too, which `make check` points nowhere) goes with it
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "SPARK_LAUNCHER_OPTS"})
    prepare_environment()
    assert os.environ["SPARK_LAUNCHER_OPTS"] == JVM_OPTIONS
    os.environ["SPARK_LAUNCHER_OPTS"] = "-Xss4m"
    prepare_environment()
    assert os.environ["SPARK_LAUNCHER_OPTS"] == "-Xss4m"
