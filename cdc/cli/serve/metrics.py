"""The Prometheus exposition of a status report (``prometheus-client``, text format 0.0.4).

Names follow Prometheus conventions: the unit in the name, ``_total`` for counters, labels per
table and sink. Every metric is built from the latest sample (:mod:`cdc.cli.serve`), so a scrape never
queries the source. Counters are per process life (a restart starts them at 0; ``rate()`` copes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cdc.cli.status.judge import SEVERITIES, VERDICTS


class _ReportCollector(Collector):
    def __init__(self, report: dict[str, Any] | None, error: str | None) -> None:
        self.report = report
        self.error = error

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("cdc_status_up", "1 when the last status sample succeeded")
        up.add_metric([], 0 if self.report is None or self.error else 1)
        yield up
        r = self.report
        if r is None:
            return
        yield from _source_metrics(r["stages"])
        yield from _stage_metrics(r)
        yield from _process_metrics(r)


def _source_metrics(stages: list[dict[str, Any]]) -> Iterator[Metric]:
    """Capture's lag and the replication slot's facts."""

    def stage(name: str) -> dict[str, Any]:
        return next((s for s in stages if s["stage"] == name), {})

    cap, slot = stage("capture"), stage("slot")
    g = GaugeMetricFamily("cdc_source_lag_bytes", "WAL bytes the slot has not confirmed (source -> capture)")
    if cap.get("lag_bytes") is not None:
        g.add_metric([], cap["lag_bytes"])
    yield g
    g = GaugeMetricFamily("cdc_capture_lag_seconds", "now minus the time up to which capture is complete")
    if cap.get("lag_seconds") is not None:
        g.add_metric([], cap["lag_seconds"])
    yield g
    for name, key, doc in (
        (
            "cdc_slot_retained_wal_bytes",
            "retained_wal_bytes",
            "WAL the replication slot retains on the source",
        ),
        (
            "cdc_slot_safe_wal_size_bytes",
            "safe_wal_size",
            "WAL that can still be written before the slot is lost",
        ),
    ):
        g = GaugeMetricFamily(name, doc)
        if slot.get(key) is not None:
            g.add_metric([], slot[key])
        yield g
    g = GaugeMetricFamily("cdc_slot_active", "1 when a reader streams from the slot")
    g.add_metric([], 1 if slot.get("active") else 0)
    yield g
    g = GaugeMetricFamily("cdc_slot_exists", "1 when the replication slot exists")
    g.add_metric([], 1 if slot.get("exists") else 0)
    yield g


def _stage_metrics(r: dict[str, Any]) -> Iterator[Metric]:
    """Every apply stage's lag, every stage's severity and verdict, the exit code."""
    stages = r["stages"]
    secs = GaugeMetricFamily(
        "cdc_sink_lag_seconds",
        "now minus the commit time of the oldest change not applied",
        labels=["table", "sink"],
    )
    offs = GaugeMetricFamily(
        "cdc_sink_lag_offsets", "log-store records not applied yet", labels=["table", "sink"]
    )
    for s in stages:
        if s["stage"] != "apply":
            continue
        if s.get("lag_seconds") is not None:
            secs.add_metric([s["table"], s["sink"]], s["lag_seconds"])
        if s.get("lag_offsets") is not None:
            offs.add_metric([s["table"], s["sink"]], s["lag_offsets"])
    yield secs
    yield offs

    sev = GaugeMetricFamily(
        "cdc_stage_severity", "0 ok, 1 warn, 2 critical", labels=["stage", "table", "sink"]
    )
    ver = GaugeMetricFamily(
        "cdc_stage_verdict",
        "1 for the stage's current verdict",
        labels=["stage", "table", "sink", "verdict"],
    )
    for s in stages:
        labels = [s["stage"], s.get("table") or "", s.get("sink") or ""]
        sev.add_metric(labels, SEVERITIES.index(s["severity"]))
        for v in VERDICTS:
            ver.add_metric([*labels, v], 1 if s["verdict"] == v else 0)
    yield sev
    yield ver
    g = GaugeMetricFamily(
        "cdc_status_exit_code", "what `cdc status` would exit with: 0 OK, 1 WARN, 2 critical"
    )
    g.add_metric([], r["exit_code"])
    yield g


def _process_metrics(r: dict[str, Any]) -> Iterator[Metric]:
    """The processes' state and counters, the dead letters, the batches."""
    procs = r["processes"]
    g = GaugeMetricFamily("cdc_process_up", "1 when the process runs", labels=["role"])
    for role, p in procs.items():
        g.add_metric([role], 1 if p["running"] else 0)
    yield g
    cap_c = (procs.get("capture") or {}).get("counters", {})
    app_c = (procs.get("apply") or {}).get("counters", {})
    for name, value, doc in (
        ("cdc_changes_read", cap_c.get("changes_read"), "changes read from the replication stream"),
        (
            "cdc_events_captured",
            cap_c.get("events_written"),
            "events written to the log store by capture",
        ),
        ("cdc_records_read", app_c.get("records_read"), "log-store records read by the apply job"),
        ("cdc_events_applied", app_c.get("events_applied"), "events applied to the sinks"),
    ):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], value or 0)
        yield c
    c = CounterMetricFamily("cdc_dead_letters", "records in the dead-letter topic")
    c.add_metric([], r["dead_letters"]["total"])
    yield c
    g = GaugeMetricFamily("cdc_dead_letters_recent", "dead letters written in the evaluation window")
    g.add_metric([], r["dead_letters"]["recent"])
    yield g
    bc = CounterMetricFamily("cdc_batches", "batches processed", labels=["role"])
    bs = CounterMetricFamily("cdc_batch_duration_seconds", "time spent in batches", labels=["role"])
    for role, p in procs.items():
        b = p.get("batches") or {}
        bc.add_metric([role], b.get("count", 0))
        bs.add_metric([role], b.get("seconds_sum", 0.0))
    yield bc
    yield bs


def render_metrics(report: dict[str, Any] | None, error: str | None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReportCollector(report, error))
    return generate_latest(registry)
