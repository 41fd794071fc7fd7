"""Reading the facts of one status report from the source and the state directory.

Lag definitions (docs/status.md has the reasoning):

* capture, bytes: ``pg_current_wal_lsn() - confirmed_flush_lsn`` of the slot, or 0 when the slot's
  walsender has sent the reader everything written before the call (``sent_lsn``, waited for up to
  :data:`CATCH_UP_WAIT_S`): WAL with nothing to decode is confirmed only at the next heartbeat,
  so the slot alone would show a small lag that is not one. Seconds: 0 then; else now
  minus the newest time up to which capture is known complete: the newest commit time in the
  topics, the emission time of a confirmed heartbeat, a past sample whose WAL position is confirmed.
* apply, per table and sink: offsets = end offsets - applied offsets (the Spark checkpoint's last
  committed batch), summed over partitions. Seconds: 0 when nothing is pending, else now minus the
  commit time of the oldest pending change (the first unapplied record), which equals "now minus
  the newest applied change" while busy and is not inflated by an idle time before the change.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg

from cdc import metrics, paths, sink_locations
from cdc.catalog import SlotInfo, connect, failover_info, failover_supported, server_info, slot_info
from cdc.cli.status import history
from cdc.cli.status.judge import EXIT_CODES, OK, WARN, Judgement, Point, judge, worst
from cdc.cli.status.options import SCHEMA_VERSION, StatusOptions
from cdc.cli.status.slot import drop_slot, judge_slot, should_drop
from cdc.codec.plugins import PLUGINS
from cdc.config import Settings, redact_dsn
from cdc.errors import CdcError, LogStoreError, UnknownTopicError
from cdc.events import dead_letter_topic, int_to_lsn, lsn_to_int
from cdc.logstore import APPLY_CONSUMER, now_ms
from cdc.logstore.images import unknown_values
from cdc.preflight import gather_standbys
from cdc.registry import Registry, State, TableReg, TableState

CATCH_UP_WAIT_S = 1.5
CATCH_UP_MAX_BYTES = 16 * 1024 * 1024


def last_clean(registry: Registry, reg: TableReg) -> dict[str, Any] | None:
    """The summary of the table's last clean verify (what :func:`cdc.cli.verify.ranges.save` wrote:
    ``RangeRecord.summary``), None when never. Read here, not beside the ranges, whose bounds
    import numpy."""
    raw = registry.get_table_state(TableState.VERIFIED_CLEAN, reg.schema, reg.table)
    if raw is None:
        return None
    with contextlib.suppress(ValueError):
        out = json.loads(raw)
        if isinstance(out, dict):
            return out
    return None


def _source_table_stages(registry: Registry, tables: list[TableReg]) -> list[dict[str, Any]]:
    """One ERROR stage per registered table the capture no longer reads: dropped or renamed at the
    source (registry state ``TableState.SOURCE_MISSING``), or refused (a key column dropped or
    renamed, ``TableState.SCHEMA_REFUSED``). The other tables' capture goes on. A WARN stage per table
    whose topic holds values the reader could not know (``TableState.VALUES_UNKNOWN``)."""
    out: list[dict[str, Any]] = []
    for reg in tables:
        name = reg.qualified
        missing = registry.get_table_state(TableState.SOURCE_MISSING, reg.schema, reg.table)
        refused = registry.get_table_state(TableState.SCHEMA_REFUSED, reg.schema, reg.table)
        unknown = registry.get_table_state(TableState.VALUES_UNKNOWN, reg.schema, reg.table)
        if unknown is not None and missing is None and refused is None:
            reason, fix = unknown_values(name, unknown)
            out.append(
                {
                    "stage": "source_table",
                    "name": f"source table {name}",
                    "table": name,
                    "sink": None,
                    "verdict": "WARN",
                    "severity": "warn",
                    "reason": reason,
                    "fix": fix,
                    "process": "capture",
                }
            )
            continue
        if missing is None and refused is None:
            continue
        if missing is not None:
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(missing)))
            told = orjson.loads(
                registry.get_table_state(TableState.SOURCE_MISSING_DDL, reg.schema, reg.table) or "null"
            )
            if told and told.get("to"):
                what = f"renamed to {told['to']}, told by the DDL recorder"
                new_name = str(told["to"])
            elif told:
                what = f"dropped by {told.get('tag')}, told by the DDL recorder"
                new_name = "NEW_NAME"
            else:
                what = "dropped or renamed"
                new_name = "NEW_NAME"
            reason = (
                f"{name} does not exist at the source since {since} ({what}): it is no "
                "longer captured; the other tables go on"
            )
            fix = (
                f"`cdc tables remove {name}`; if it was renamed, also `cdc tables add {new_name}` "
                "(a new topic and snapshot); or restore the table under its name"
            )
        else:
            body = orjson.loads(refused or "{}")
            reason = f"REFUSED: {body.get('reason', 'refused by the capture')}"
            fix = str(body.get("fix") or f"`cdc tables remove {name}` then `cdc tables add {name}`")
        out.append(
            {
                "stage": "source_table",
                "name": f"source table {name}",
                "table": name,
                "sink": None,
                "verdict": "ERROR",
                "severity": "critical",
                "reason": reason,
                "fix": fix,
                "process": "capture",
            }
        )
    return out


def _process(doc: dict[str, Any] | None, now_ms: int, window_s: float) -> dict[str, Any]:
    """A process as status shows it: running (pid alive, or a fresh heartbeat on another host)."""
    if doc is None:
        return {"running": False, "published": False, "last_error": None}
    alive = metrics.pid_alive(doc)
    age = (now_ms - int(doc.get("heartbeat_ms") or 0)) / 1000
    if alive is None:
        alive = age <= max(30.0, window_s)
    elif alive and age > max(30.0, window_s):
        alive = False  # hung: alive but silent
    return {
        "running": bool(alive),
        "published": True,
        "pid": doc.get("pid"),
        "host": doc.get("host"),
        "started_ms": doc.get("started_ms"),
        "heartbeat_ms": doc.get("heartbeat_ms"),
        "heartbeat_age_s": round(age, 3),
        "stopped_ms": doc.get("stopped_ms"),
        "counters": doc.get("counters", {}),
        "batches": doc.get("batches", {}),
        "last_error": doc.get("last_error"),
    }


def _ts_of(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        body = orjson.loads(value)
        ts = (body.get("source") or {}).get("ts_ms") or body.get("ts_ms")
        return int(ts) if ts is not None else None
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None


class Collector:
    def __init__(self, settings: Settings, options: StatusOptions) -> None:
        self.settings = settings
        self.options = options
        self.state = Path(settings.state_dir)

    # -- the source ------------------------------------------------------------------------------
    def _peek(
        self, conn: Any, upto: int, tables: list[TableReg], plugin_name: str | None
    ) -> dict[str, Any] | None:
        """With no reader streaming, peek the slot (nothing is consumed) up to ``upto`` for changes
        of the registered tables: their count and the commit time of the oldest. None when the slot
        became busy meanwhile, or is not of a plugin cdc reads."""
        plugin = PLUGINS.get(plugin_name or "")
        if plugin is None:
            return None
        try:
            pending = plugin.peek(conn, self.settings.slot_name, upto, tables, self.settings.publication)
        except psycopg.errors.ObjectInUse:  # a reader just started streaming
            return None
        return {"pending_changes": pending.changes, "oldest_pending_ms": pending.oldest_ms}

    def _source(
        self, registry: Registry | None, enforce: bool, capture_running: bool, tables: list[TableReg]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"reachable": False, "error": None, "slot": None, "dropped_now": None}
        if self.settings.source is None:
            out["error"] = "no source configured (CDC_SOURCE)"
            return out
        try:
            conn = connect(self.settings.require_source(), application_name="cdc-status")
        except CdcError as exc:
            out["error"] = exc.message
            return out
        with conn:
            out["reachable"] = True
            server = server_info(conn)
            out["max_slot_wal_keep_size"] = server.max_slot_wal_keep_size
            info = slot_info(conn, self.settings.slot_name)
            if enforce and registry is not None and (reason := should_drop(info, self.options)):
                out["dropped_now"] = drop_slot(conn, registry, info, reason)
                info = slot_info(conn, self.settings.slot_name)
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
            assert row is not None
            wal = lsn_to_int(str(row[0]))
            if (
                info.exists
                and capture_running
                and info.active
                and 0 < (info.lag_bytes or 0) <= CATCH_UP_MAX_BYTES
            ):
                # A live reader confirms up to the last change or message it decoded, so WAL with
                # nothing to decode (other tables and databases, checkpoints) stays unconfirmed until
                # the next heartbeat. The walsender's sent position tells whether everything written
                # before this call has been read and handed to the reader: then nothing is pending.
                deadline = time.monotonic() + CATCH_UP_WAIT_S
                while time.monotonic() < deadline:
                    row = conn.execute(
                        "SELECT sent_lsn::text FROM pg_catalog.pg_stat_replication WHERE pid = %s",
                        [info.active_pid],
                    ).fetchone()
                    if row is None or row[0] is None:
                        break
                    if lsn_to_int(str(row[0])) >= wal:
                        out["caught_up_to_call"] = True
                        break
                    time.sleep(0.05)
            elif (
                info.exists and not info.active and 0 < (info.lag_bytes or 0) <= CATCH_UP_MAX_BYTES and tables
            ):
                out["peek"] = self._peek(conn, wal, tables, info.plugin)
            out["wal_lsn"] = wal
            out["slot"] = info
            out["failover"] = self._failover(conn, server.server_version_num, info)
        return out

    def _failover(self, conn: Any, server_version: int, info: SlotInfo) -> dict[str, Any] | None:
        """Failover readiness of the slot (PostgreSQL 17+; None before, or with no slot): whether
        it is a failover slot, and for each standby among the source DSN's hosts whether its copy
        is ready (``synced AND NOT temporary``, :func:`cdc.catalog.synced_slot`)."""
        if not failover_supported(server_version) or not info.exists:
            return None
        primary = failover_info(conn, info.name)
        standbys, unreachable = gather_standbys(self.settings.require_source(), conn, info.name)
        return {
            "failover": bool(primary.slot and primary.slot.failover),
            "standbys": [
                {
                    "standby": where,
                    "ready": bool(facts and facts.slot and facts.slot.ready),
                    "synced": bool(facts and facts.slot and facts.slot.synced),
                    "temporary": bool(facts and facts.slot and facts.slot.temporary),
                }
                for where, _, facts in standbys
            ],
            "unreachable": unreachable,
        }

    # -- the log store ---------------------------------------------------------------------------
    def open_store(self) -> Any:
        from cdc.logstore.factory import open_log_store

        if not self.settings.log_url and not paths.log_dir(self.state).exists():
            return None
        return open_log_store(self.settings, writer=False)

    @staticmethod
    def _newest_ts(store: Any, topic: str, part: int, end: int) -> int | None:
        """Commit time of the newest record with a value before ``end`` (reads at most 4 records)."""
        with contextlib.suppress(LogStoreError):
            recs = store.read(topic, part, max(end - 4, 0), 4)
            for rec in reversed(recs):
                if rec.offset < end and (ts := _ts_of(rec.value)) is not None:
                    return ts
        return None

    def _applied(self) -> tuple[dict[str, dict[int, int]] | None, int | None]:
        """The Spark checkpoint's applied offsets (its newest committed batch) and when it was
        committed (ms); (None, None) without a checkpoint."""
        from spark_jobs.checkpoint import batch_end_offsets, checkpoint_dir

        ckpt = checkpoint_dir(self.state)
        commits = ckpt / "commits"
        try:
            ids = sorted(int(p.name) for p in commits.iterdir() if p.name.isdigit())
        except FileNotFoundError:
            return None, None
        if not ids:
            return {}, None
        offsets = batch_end_offsets(ckpt, ids[-1])
        return offsets, int((commits / str(ids[-1])).stat().st_mtime * 1000)

    # -- one report --------------------------------------------------------------------------------
    def run(self, *, record: bool, enforce_policy: bool, store: Any = None) -> dict[str, Any]:
        """One report (``docs/status.md``): the processes, the source and its slot, the log store's
        per-table facts, then one stage each for capture, the slot, every table's sinks and the dead
        letters. ``record``: append this report's positions to the samples (``history``)."""
        now = now_ms()
        docs = metrics.read_all(self.state)
        procs = {role: _process(docs.get(role), now, self.options.window_s) for role in metrics.ROLES}
        tables, source, kept = self._registry_facts(enforce_policy, procs["capture"]["running"])
        samples = history.load(self.state)
        report = self._report_head(now, source, procs)
        facts, dead, store_error, applied_ms = self._store_facts(store, tables, source, now)
        apply_doc = docs.get("apply")
        if apply_doc is not None:
            dead["applied_counter"] = (apply_doc.get("counters") or {}).get("dead_letters", 0)
        report["log_store"] = {
            "backend": "kafka" if self.settings.log_url else "embedded",
            "error": store_error,
        }
        sample_stages: dict[str, dict[str, Any]] = {}
        gauges = (docs.get("capture") or {}).get("gauges", {})
        stages = [self._capture_stage(source, procs["capture"], gauges, facts, samples, now, sample_stages)]
        stages.extend(kept["source_tables"])  # registered tables missing or refused at the source
        dropped: dict[str, Any] | None = orjson.loads(kept["drop_raw"]) if kept["drop_raw"] else None
        if source.get("dropped_now"):
            dropped = source["dropped_now"]
        stages.append(self._slot_stage(source, tables, dropped, kept["initial"]))
        stages.extend(self._apply_stages(facts, procs["apply"], samples, applied_ms, now, sample_stages))
        stages.append(_dead_letter_stage(dead, self.options.window_s))
        report["stages"] = stages
        report["tables"] = [
            {k: v for k, v in f.items() if k not in ("sinks",)}
            | {"sinks": f["sinks"], "last_verified_clean": kept["verified"].get(f["table"])}
            for f in facts
        ]
        report["snapshots"] = [
            {"table": f["table"], "state": f["snapshot_state"], "topic_records": f["end_total"]}
            for f in facts
            if f["snapshot_state"] != "done"
        ]
        report["dead_letters"] = dead
        report["slot_drop"] = dropped
        sev = worst([s["severity"] for s in stages])
        report["severity"] = sev
        report["verdict"] = {"ok": OK, "warn": WARN}.get(sev, "CRITICAL")
        report["exit_code"] = EXIT_CODES[sev]
        if record:
            history.append(
                self.state,
                {"t_ms": now, "wal_lsn": source.get("wal_lsn"), "stages": sample_stages},
                keep_s=self.options.window_s * 2,
            )
        return report

    def _registry_facts(
        self, enforce_policy: bool, capture_running: bool
    ) -> tuple[list[TableReg], dict[str, Any], dict[str, Any]]:
        """The registered tables, the source's facts (:meth:`_source`, which may drop the slot by
        policy) and what the registry keeps for the report: the last policy drop, the tables
        missing or refused at the source, the initial snapshot's state."""
        registry = Registry(self.state) if paths.registry_path(self.state).exists() else None
        try:
            tables = registry.list_tables() if registry else []
            source = self._source(registry, enforce_policy, capture_running, tables)
            if source.get("dropped_now") and registry is not None:
                tables = registry.list_tables()
            kept = {
                "drop_raw": registry.get_state(State.SLOT_DROPPED) if registry else None,
                "source_tables": _source_table_stages(registry, tables) if registry else [],
                "initial": registry.get_state(State.INITIAL_SNAPSHOT) if registry else None,
                "verified": {r.qualified: last_clean(registry, r) for r in tables} if registry else {},
            }
        finally:
            if registry is not None:
                registry.close()
        return tables, source, kept

    def _report_head(self, now: int, source: dict[str, Any], procs: dict[str, Any]) -> dict[str, Any]:
        opts = self.options
        return {
            "version": SCHEMA_VERSION,
            "generated_ms": now,
            "host": socket.gethostname(),
            "source": {
                "dsn": redact_dsn(self.settings.source.get_secret_value()) if self.settings.source else None,
                "reachable": source["reachable"],
                "error": source["error"],
            },
            "options": {
                "window_s": opts.window_s,
                "lag_warn_s": opts.lag_warn_s,
                "lag_critical_s": opts.lag_critical_s,
                "retained_wal_warn_bytes": opts.retained_wal_warn_bytes,
                "retained_wal_critical_bytes": opts.retained_wal_critical_bytes,
                "slot_policy": opts.slot_policy,
                "slot_drop_at_bytes": opts.slot_drop_at_bytes,
            },
            "processes": procs,
        }

    def _store_facts(
        self, store: Any, tables: list[TableReg], source: dict[str, Any], now: int
    ) -> tuple[list[dict[str, Any]], dict[str, Any], str | None, int | None]:
        """Per table its offsets and apply lag (:meth:`_table`), the dead letters, the log store's
        error (None when it answered) and when the apply job last committed a batch."""
        table_facts: list[dict[str, Any]] = []
        store_error = None
        dead = {
            "topic": dead_letter_topic(self.settings.topic_prefix),
            "total": 0,
            "recent": 0,
            "window_s": self.options.window_s,
        }
        applied_all, applied_ms = self._applied()
        own_store = store is None
        try:
            if own_store:
                store = self.open_store()
        except CdcError as exc:
            store, store_error = None, exc.message
        try:
            slot0 = source.get("slot")
            peek0 = source.get("peek")
            want_newest = bool(
                slot0 is not None
                and slot0.exists
                and (slot0.lag_bytes or 0) > 0
                and not source.get("caught_up_to_call")
                and not (peek0 and not peek0["pending_changes"])
            )
            for reg in tables:
                table_facts.append(self._table(store, reg, applied_all, want_newest))
            if store is not None:
                self._dead_letters(store, dead, now)
        except CdcError as exc:
            store_error = exc.message
        finally:
            if store is not None and own_store:
                with contextlib.suppress(Exception):
                    store.close()
        return table_facts, dead, store_error, applied_ms

    def _capture_stage(
        self,
        source: dict[str, Any],
        cap_proc: dict[str, Any],
        gauges: dict[str, Any],
        table_facts: list[dict[str, Any]],
        samples: Any,
        now: int,
        sample_stages: dict[str, dict[str, Any]],
    ) -> dict[str, Any]:
        """source -> capture -> log store: the slot's lag in bytes and seconds, judged."""
        opts = self.options
        slot = source.get("slot")
        cap: dict[str, Any] = {
            "stage": "capture",
            "name": "source → capture → log store",
            "table": None,
            "sink": None,
        }
        if slot is not None and slot.exists:
            slot_lag = max(0, slot.lag_bytes or 0)
            peek = source.get("peek")
            lag_bytes = (
                0 if source.get("caught_up_to_call") or (peek and not peek["pending_changes"]) else slot_lag
            )
            confirmed = slot.confirmed_flush_lsn or 0
            through = self._captured_through(table_facts, gauges, samples, confirmed)
            if peek and peek["oldest_pending_ms"]:  # the true age of the oldest change not captured
                through = max(through or 0, peek["oldest_pending_ms"])
            lag_s = 0.0 if lag_bytes == 0 else (None if through is None else max(0.0, (now - through) / 1000))
            cap.update(
                lag_bytes=lag_bytes,
                slot_lag_bytes=slot_lag,
                pending_changes=peek["pending_changes"] if peek else None,
                lag_seconds=None if lag_s is None else round(lag_s, 3),
                position=int_to_lsn(confirmed),
                captured_through_ms=through,
            )
            points = history.points(samples, "capture")
            j = judge(
                points=points,
                now=Point(now, confirmed, lag_bytes),
                window_s=opts.window_s,
                running=cap_proc["running"],
                last_error=self._error_text(cap_proc),
                # not moving counts from the last confirmed move, or from when work appeared (the
                # commit of the oldest pending change, known when the slot was peeked)
                last_move_ms=max(
                    (x for x in (gauges.get("confirmed_ms"), (peek or {}).get("oldest_pending_ms")) if x),
                    default=None,
                ),
                lag_seconds=lag_s,
                lag_warn_s=opts.lag_warn_s,
                lag_critical_s=opts.lag_critical_s,
                unit=" bytes",
            )
            sample_stages["capture"] = {"position": confirmed, "lag": lag_bytes, "lag_seconds": lag_s}
        else:
            cap.update(lag_bytes=None, lag_seconds=None, position=None, captured_through_ms=None)
            if not source["reachable"]:
                j = Judgement(WARN, "warn", f"source not reachable: {source['error']}")
                if (err := self._error_text(cap_proc)) is not None:
                    j = Judgement("ERROR", "critical", f"the process recorded an error: {err}")
            elif (err := self._error_text(cap_proc)) is not None:
                j = Judgement("ERROR", "critical", f"the process recorded an error: {err}")
            else:
                j = Judgement(OK, "ok", "no slot: nothing captured yet")
        cap.update(
            verdict=j.verdict, severity=j.severity, reason=j.reason, fix=self._capture_fix(j, cap_proc)
        )
        cap["process"] = "capture"
        return cap

    def _slot_stage(
        self,
        source: dict[str, Any],
        tables: list[TableReg],
        dropped: dict[str, Any] | None,
        initial: str | None,
    ) -> dict[str, Any]:
        """The replication slot's health (:func:`cdc.cli.status.slot.judge_slot`)."""
        slot = source.get("slot")
        marked = set(dropped.get("tables", [])) if dropped else set()
        awaiting = any(t.snapshot_state != "done" for t in tables if t.qualified in marked)
        sj, fix = judge_slot(
            slot if source["reachable"] else None,
            self.options,
            max_keep=source.get("max_slot_wal_keep_size"),
            expected=initial == "done" and any(t.snapshot_state == "done" for t in tables),
            dropped=dropped,
            awaiting_resnapshot=awaiting,
        )
        return {
            "stage": "slot",
            "name": f"replication slot {self.settings.slot_name}",
            "table": None,
            "sink": None,
            "verdict": sj.verdict,
            "severity": sj.severity,
            "reason": sj.reason,
            "fix": fix,
            "slot": self.settings.slot_name,
            "decoder": slot.plugin if slot and slot.exists else None,
            "exists": bool(slot and slot.exists),
            "active": bool(slot and slot.active),
            "wal_status": slot.wal_status if slot else None,
            "retained_wal_bytes": slot.retained_bytes if slot else None,
            "safe_wal_size": slot.safe_wal_size if slot else None,
            "max_slot_wal_keep_size": source.get("max_slot_wal_keep_size"),
            "dropped": dropped,
            "failover": source.get("failover"),
        }

    def _apply_stages(
        self,
        table_facts: list[dict[str, Any]],
        app_proc: dict[str, Any],
        samples: Any,
        applied_ms: int | None,
        now: int,
        sample_stages: dict[str, dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """One apply stage per table and sink that keeps it: the table's offsets lag, judged."""
        opts = self.options
        stages: list[dict[str, Any]] = []
        for fact in table_facts:
            for sink in fact["sinks"]:
                sid = f"apply:{fact['table']}:{sink}"
                st: dict[str, Any] = {
                    "stage": "apply",
                    "name": f"log store → {sink} ({fact['table']})",
                    "table": fact["table"],
                    "sink": sink,
                    "lag_offsets": fact["lag_offsets"],
                    "lag_seconds": fact["lag_seconds"],
                    "position": fact["applied_total"],
                    "partitions": fact["partitions"],
                    "process": "apply",
                }
                if fact["lag_offsets"] is None:
                    j = Judgement(OK, "ok", "topic not created yet")
                else:
                    j = judge(
                        points=history.points(samples, sid),
                        now=Point(now, fact["applied_total"], fact["lag_offsets"]),
                        window_s=opts.window_s,
                        running=app_proc["running"],
                        last_error=self._error_text(app_proc),
                        # not moving counts from the last applied batch, or from when work appeared
                        last_move_ms=max(
                            x for x in (applied_ms, fact["pending_since_ms"], 0) if x is not None
                        )
                        or None,
                        lag_seconds=fact["lag_seconds"],
                        lag_warn_s=opts.lag_warn_s,
                        lag_critical_s=opts.lag_critical_s,
                        unit=" offsets",
                    )
                    sample_stages[sid] = {
                        "position": fact["applied_total"],
                        "lag": fact["lag_offsets"],
                        "lag_seconds": fact["lag_seconds"],
                    }
                st.update(verdict=j.verdict, severity=j.severity, reason=j.reason, fix=self._apply_fix(j))
                stages.append(st)
        return stages

    # -- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _error_text(proc: dict[str, Any]) -> str | None:
        err = proc.get("last_error")
        if not err:
            return None
        return f"{err.get('type')}: {err.get('message')}"

    @staticmethod
    def _capture_fix(j: Judgement, proc: dict[str, Any]) -> str | None:
        if j.verdict == OK:
            return None
        if j.reason.startswith("source not reachable"):
            return "check that the source is up and reachable from here (CDC_SOURCE / --source, pg_hba.conf)"
        err = proc.get("last_error") or {}
        if j.verdict == "ERROR" and err.get("fix"):
            return str(err["fix"])
        if j.verdict in ("STOPPED", WARN) and not proc.get("running"):
            return "start the capture: `cdc run` (it resumes from the slot); see its log for why it stopped"
        if j.verdict == "STALLED":
            return "capture runs but does not advance: check its log, the source's load and the log store; restart `cdc run`"
        return "capture is behind: check the source's write rate and the log store; `cdc status --watch` to follow"

    @staticmethod
    def _apply_fix(j: Judgement) -> str | None:
        if j.verdict == OK:
            return None
        if j.verdict == "ERROR":
            return "read the error; fix its cause and restart `cdc apply` (the failed batch is replayed from the checkpoint)"
        if j.verdict in ("STOPPED", WARN):
            return "start the apply job: `cdc apply` (it resumes from its checkpoint)"
        return "the apply job runs but does not advance: check its log and restart `cdc apply`"

    def _captured_through(
        self,
        facts: list[dict[str, Any]],
        gauges: dict[str, Any],
        samples: list[dict[str, Any]],
        confirmed: int,
    ) -> int | None:
        cands: list[int] = [f["newest_captured_ms"] for f in facts if f.get("newest_captured_ms")]
        for lsn_key, ts_key in (
            ("heartbeat_lsn", "heartbeat_emitted_ms"),
            ("prev_heartbeat_lsn", "prev_heartbeat_emitted_ms"),
        ):
            lsn, ts = gauges.get(lsn_key), gauges.get(ts_key)
            if lsn is not None and ts is not None and int(lsn) <= confirmed:
                cands.append(int(ts))
        for s in samples:
            if s.get("wal_lsn") is not None and int(s["wal_lsn"]) <= confirmed:
                cands.append(int(s["t_ms"]))
        return max(cands) if cands else None

    def _table(
        self, store: Any, reg: TableReg, applied_all: dict[str, dict[int, int]] | None, want_newest: bool
    ) -> dict[str, Any]:
        """The table's offsets and apply lag; ``want_newest``: also the newest captured commit time
        (read only when capture is behind: it costs a read per partition). ``sinks``: the sinks that
        keep the table (:func:`cdc.sink_locations.keeping`), one apply stage each."""
        now = now_ms()
        fact: dict[str, Any] = {
            "table": reg.qualified,
            "topic": reg.topic,
            "snapshot_state": reg.snapshot_state,
            "sinks": sink_locations.keeping(self.state, reg),
            "lag_offsets": None,
            "lag_seconds": None,
            "applied_total": None,
            "end_total": None,
            "partitions": {},
            "newest_captured_ms": None,
        }
        if store is None:
            return fact
        try:
            ends = store.end_offsets(reg.topic)
            starts = store.start_offsets(reg.topic)
        except UnknownTopicError:
            return fact
        if applied_all is None:  # no checkpoint: the advisory positions the job commits
            applied = store.committed(APPLY_CONSUMER, reg.topic)
        else:
            applied = applied_all.get(reg.topic, {})
        lag = 0
        oldest: int | None = None
        newest: int | None = None
        pending_since: int | None = None
        for part, end in sorted(ends.items()):
            pos = max(int(applied.get(part, starts.get(part, 0))), starts.get(part, 0))
            behind = max(0, end - pos)
            lag += behind
            fact["partitions"][str(part)] = {"end": end, "applied": pos, "lag": behind}
            if want_newest and end > starts.get(part, 0):
                ts = self._newest_ts(store, reg.topic, part, end)
                if ts is not None:
                    newest = ts if newest is None else max(newest, ts)
            if behind:  # one read: when work appeared (first pending append) and its commit time
                with contextlib.suppress(LogStoreError):
                    recs = [r for r in store.read(reg.topic, part, pos, 4) if r.offset < end]
                    if recs:
                        t = recs[0].timestamp_ms
                        pending_since = t if pending_since is None else min(pending_since, t)
                    ts = next((x for r in recs if (x := _ts_of(r.value)) is not None), None)
                    if ts is not None:
                        oldest = ts if oldest is None else min(oldest, ts)
        fact["lag_offsets"] = lag
        fact["applied_total"] = sum(p["applied"] for p in fact["partitions"].values())
        fact["end_total"] = sum(ends.values())
        fact["newest_captured_ms"] = newest
        fact["pending_since_ms"] = pending_since
        if lag == 0:
            fact["lag_seconds"] = 0.0
        elif oldest is not None:
            fact["lag_seconds"] = round(max(0.0, (now - oldest) / 1000), 3)
        return fact

    def _dead_letters(self, store: Any, dead: dict[str, Any], now: int) -> None:
        try:
            ends = store.end_offsets(dead["topic"])
            starts = store.start_offsets(dead["topic"])
        except UnknownTopicError:
            return
        dead["total"] = sum(ends.values())
        cutoff = now - int(self.options.window_s * 1000)
        recent = 0
        for part, end in ends.items():
            start = max(starts.get(part, 0), end - 1000)
            if end <= start:
                continue
            with contextlib.suppress(LogStoreError):
                recent += sum(
                    1 for r in store.read(dead["topic"], part, start, end - start) if r.timestamp_ms >= cutoff
                )
        dead["recent"] = recent


def collect(
    settings: Settings,
    options: StatusOptions | None = None,
    *,
    record: bool = True,
    enforce_policy: bool = True,
    store: Any = None,
) -> dict[str, Any]:
    """One status report (see ``docs/status.md``); ``record``: keep this sample in the history;
    ``enforce_policy``: apply the ``drop`` slot policy when its condition holds; ``store``: an open
    read-only log store to use (kept open by a caller that samples often), else one is opened."""
    return Collector(settings, options or StatusOptions.from_settings(settings)).run(
        record=record, enforce_policy=enforce_policy, store=store
    )


def _dead_letter_stage(dead: dict[str, Any], window_s: float) -> dict[str, Any]:
    """Dead letters: WARN while some were written within the window."""
    dl_j = (
        Judgement(WARN, "warn", f"{dead['recent']} dead letter(s) in the last {window_s:g} s")
        if dead["recent"]
        else Judgement(OK, "ok", f"{dead['total']} in total, none recent")
    )
    return {
        "stage": "dead_letters",
        "name": "dead letters",
        "table": None,
        "sink": None,
        "verdict": dl_j.verdict,
        "severity": dl_j.severity,
        "reason": dl_j.reason,
        "fix": f"inspect them: `cdc topic dump {dead['topic']} --json`; fix the cause, then re-snapshot "
        "the table if its rows matter"
        if dead["recent"]
        else None,
    }


def open_store(settings: Settings) -> Any:
    """The read-only log store status reads (None when the embedded store does not exist yet)."""
    return Collector(settings, StatusOptions()).open_store()
