"""Which archives the Python daemon takes off ``sys.path`` (spark_jobs/pydaemon.py): the installed pyspark's
own zips and jars, only when pyspark and py4j are installed outside them."""

from __future__ import annotations

from pathlib import Path

from spark_jobs.pydaemon import without_spark_archives


def _site(base: Path, *packages: str) -> Path:
    site = base / "site-packages"
    for name in packages:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    return site


def test_the_installed_pysparks_zips_and_jars_go_and_every_other_entry_stays(tmp_path: Path) -> None:
    site = _site(tmp_path, "pyspark", "py4j")
    lib, jars = site / "pyspark" / "python" / "lib", site / "pyspark" / "jars"
    other = tmp_path / "elsewhere" / "pyspark.zip"  # a cluster's own Spark: not the installed package's
    own_jar = tmp_path / "elsewhere" / "spark-core_2.13-4.3.0.jar"
    path = [
        str(lib / "pyspark.zip"),
        str(lib / "py4j-0.10.9.9-src.zip"),
        str(jars / "spark-core_2.13-4.3.0.jar"),
        str(other),
        str(own_jar),
        str(jars),
        "",
        str(site),
    ]
    assert without_spark_archives(path) == [str(other), str(own_jar), str(jars), "", str(site)]


def test_nothing_goes_without_an_installed_pyspark_and_py4j(tmp_path: Path) -> None:
    site = _site(tmp_path, "pyspark")  # py4j only in its zip
    lib = site / "pyspark" / "python" / "lib"
    path = [str(lib / "pyspark.zip"), str(lib / "py4j-0.10.9.9-src.zip"), str(site)]
    assert without_spark_archives(path) == path
    assert without_spark_archives([str(lib / "pyspark.zip"), str(tmp_path)]) == [
        str(lib / "pyspark.zip"),
        str(tmp_path),
    ]
