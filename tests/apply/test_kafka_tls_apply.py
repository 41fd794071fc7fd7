"""The apply on a Kafka log store that speaks only TLS (Tansu behind stunnel): the ``[kafka]``
section's settings reach every read of the job, the driver's offset planning and the records read
in Spark's workers or tasks, not only the reader's writes. Changes come from the real reader
(``cdc run --once``) and the job ends with ``cdc verify`` clean."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdc.config import Settings
from tests.plugins.apply import Env, run_job
from tests.plugins.items import capture, item_row, items_table, source, verify_json
from tests.plugins.postgres import PgCluster
from tests.plugins.tansu import Stunnel, TansuBroker, TlsFiles

ROWS = 40


def test_apply_reads_a_tls_only_broker_with_the_kafka_section(
    pg: PgCluster,
    pg_db: str,
    tmp_path: Path,
    spark: object,
    tls_tansu: tuple[TansuBroker, Stunnel, TlsFiles],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, tunnel, tls = tls_tansu
    state, url = tmp_path / "state", f"kafka://127.0.0.1:{tunnel.port}"
    toml = tmp_path / "cdc.toml"
    toml.write_text(f'[kafka]\nsecurity_protocol = "SSL"\nssl_cafile = "{tls.ca_cert}"\n')
    monkeypatch.setenv("CDC_LOG", url)  # what the CLI verbs below read at their entry point
    monkeypatch.setenv("CDC_CONFIG", str(toml))
    dsn, _reg = items_table(pg, pg_db, state)
    with source(dsn) as src:
        for i in range(1, ROWS + 1):
            src.insert(item_row(i))
        src.update(3, {"name": "widget 3 renamed"})
    capture(dsn, state)

    settings = Settings(
        state_dir=state,
        log_url=url,
        extra={"kafka": {"security_protocol": "SSL", "ssl_cafile": str(tls.ca_cert)}},
    )
    summary = run_job(spark, Env(settings, None, None))  # type: ignore[arg-type]
    assert summary.records >= ROWS, summary
    code, reports = verify_json(settings, dsn)
    assert code == 0, reports
    assert reports[0]["source_rows"] == ROWS
    # every connection went through the TLS terminator: there is no plaintext port to reach
    assert "accepted connection from 127.0.0.1" in tunnel.log.read_text(errors="replace")
