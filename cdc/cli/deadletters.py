"""``cdc deadletters``: list the dead letters, and replay them once their cause is fixed.

* ``deadletters list [--table SCHEMA.TABLE] [--all] [--json]``: the dead letters not replayed yet (all
  of them with ``--all``): id (``<partition>:<offset>`` in the dead-letter topic), table, key, version,
  source position and reason. ``--json``: a list of objects with those fields and ``replayed``.
* ``deadletters replay [--table SCHEMA.TABLE] [--json]``: parse each not yet replayed dead letter again
  with the table's *current* registration (so a column excluded since is dropped), and apply those that
  now parse and that every sink can hold through the sinks' normal, version-guarded path: a replayed
  record never overwrites newer data (its version is older than whatever the key received since), and
  replaying is idempotent. The replayed ones are recorded in ``<state>/deadletters/replayed.json`` so
  a second replay does nothing; the others stay, and are listed with their current reason. It writes
  the same sinks as ``cdc apply`` (the search index has one writer), so it holds the apply lock
  (:mod:`cdc.locks`) while it runs: next to a running ``cdc apply`` it exits 2 naming that process,
  before it has changed anything; stop ``cdc apply`` first.

Exit codes: 0 done (nothing left failing); 1 some dead letters still fail (listed), or an error; 2
``cdc apply`` (or another replay) is running on the state directory.
See ``docs/apply.md`` ("a poison record never stops the others").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from cdc.cli import VERB_HELP
from cdc.cli.output import print_json, print_table
from cdc.config import Settings
from cdc.errors import CdcError, UnknownTopicError
from cdc.events import dead_letter_topic
from cdc.locks import ProcessLock
from cdc.logstore.factory import open_log_store
from cdc.registry import Registry, TableReg

# sinks, spark_jobs (pyarrow, deltalake, tantivy) are imported inside the functions: other verbs must
# not pay their import time.

#: the app id under which replays commit to the sinks (their idempotence is per app id and batch id)
REPLAY_APP_ID = "cdc-deadletters-replay"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc deadletters list|replay`` to the ``cdc`` parser."""
    p = sub.add_parser("deadletters", help=VERB_HELP["deadletters"])
    verbs = p.add_subparsers(dest="deadletters_verb", metavar="ACTION")
    verbs.required = True
    lst = verbs.add_parser("list", help="the dead letters not replayed yet")
    lst.add_argument("--table", metavar="SCHEMA.TABLE", help="only this table's")
    lst.add_argument("--all", action="store_true", help="also those already replayed")
    lst.add_argument("--json", action="store_true", help="print a JSON list")
    lst.set_defaults(handler=run_list)
    rep = verbs.add_parser("replay", help="apply the dead letters again through the sinks (idempotent)")
    rep.add_argument("--table", metavar="SCHEMA.TABLE", help="only this table's")
    rep.add_argument("--json", action="store_true", help="print a JSON summary")
    rep.set_defaults(handler=run_replay)


def replayed_path(state_dir: Path) -> Path:
    return Path(state_dir) / "deadletters" / "replayed.json"


@dataclass
class ReplayState:
    """``<state>/deadletters/replayed.json``: the dead letters replayed (id -> when, which replay batch)
    and the next replay batch id."""

    replayed: dict[str, dict[str, Any]] = field(default_factory=dict)
    next_batch_id: int = 0

    @classmethod
    def load(cls, state_dir: Path) -> ReplayState:
        try:
            raw = orjson.loads(replayed_path(state_dir).read_bytes())
        except FileNotFoundError:
            return cls()
        except orjson.JSONDecodeError as exc:
            raise CdcError(
                f"{replayed_path(state_dir)} is not valid JSON",
                fix="restore it, or delete it to replay every dead letter again (idempotent)",
            ) from exc
        return cls(dict(raw.get("replayed", {})), int(raw.get("next_batch_id", 0)))

    def save(self, state_dir: Path) -> None:
        path = replayed_path(state_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps({"replayed": self.replayed, "next_batch_id": self.next_batch_id}))
        os.replace(tmp, path)


def read_entries(settings: Settings) -> list[Any]:
    """Every record of the dead-letter topic, decoded (:class:`sinks.dead_letters.Entry`)."""
    from sinks.dead_letters import decode

    topic = dead_letter_topic(settings.topic_prefix)
    out = []
    with open_log_store(settings) as store:
        try:
            ends = store.end_offsets(topic)
        except UnknownTopicError:
            return []
        for partition in sorted(ends):
            for rec in store.iter_partition(topic, partition):
                try:
                    out.append(decode(rec))
                except ValueError:
                    continue  # not written by the apply job: nothing to replay
    return out


def _selected(entries: Sequence[Any], table: str | None) -> list[Any]:
    return [e for e in entries if table is None or e.letter.table == table]


def run_list(args: argparse.Namespace, settings: Settings) -> int:
    state = ReplayState.load(settings.state_dir)
    entries = _selected(read_entries(settings), _table_name(settings, args.table))
    rows = [{**e.to_dict(), "replayed": e.id in state.replayed} for e in entries]
    if not args.all:
        rows = [r for r in rows if not r["replayed"]]
    if args.json:
        print_json(rows)
        return 0
    print_table(
        "dead letters",
        ["id", "table", "key", "version", "source", "reason"],
        (
            [
                r["id"],
                r["table"] or "",
                str(r["key"]),
                "" if r["version"] is None else f"{r['version'][0]}/{r['version'][1]}",
                f"{r['source']['topic']}[{r['source']['partition']}]@{r['source']['offset']}",
                r["reason"] + (" (replayed)" if r["replayed"] else ""),
            ]
            for r in rows
        ),
    )
    sys.stdout.write(f"({len(rows)} dead letter{'' if len(rows) == 1 else 's'})\n")
    return 0


@dataclass
class ReplayReport:
    """What a replay did: dead letters applied (``replayed``), still failing (id -> reason), skipped
    because replayed before, and per table the events applied."""

    replayed: list[str] = field(default_factory=list)
    failing: dict[str, str] = field(default_factory=dict)
    already: int = 0
    tables: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "replayed": len(self.replayed),
            "replayed_ids": self.replayed,
            "still_failing": [{"id": k, "reason": v} for k, v in self.failing.items()],
            "already_replayed": self.already,
            "tables": self.tables,
        }


def replay(settings: Settings, table: str | None = None, *, out: Any = None) -> ReplayReport:
    """Replay the dead letters not replayed yet (see the module docstring); progress to ``out``.
    Holds the apply lock throughout (:class:`~cdc.errors.LockedError` if ``cdc apply`` runs)."""
    with ProcessLock(settings.state_dir, "apply", command="cdc deadletters replay"):
        return _replay(settings, table, out=out)


def _replay(settings: Settings, table: str | None, *, out: Any) -> ReplayReport:
    from sinks import RawRecord
    from sinks.parse import parse
    from spark_jobs.applier import open_sinks, reject

    report = ReplayReport()
    state = ReplayState.load(settings.state_dir)
    todo = []
    for e in _selected(read_entries(settings), table):
        if e.id in state.replayed:
            report.already += 1
        else:
            todo.append(e)
    if not todo:
        return report
    with Registry(settings.state_dir) as registry:
        by_topic = {r.topic: r for r in registry.list_tables()}
    groups: dict[str, list[Any]] = {}
    for e in todo:
        groups.setdefault(e.letter.topic, []).append(e)
    sinks = open_sinks(settings)
    try:
        for topic, entries in sorted(groups.items()):
            reg: TableReg | None = by_topic.get(topic)
            if reg is None:
                for e in entries:
                    report.failing[e.id] = f"topic {topic} is not registered"
                continue
            by_pos = {(e.letter.partition, e.letter.offset): e for e in entries}
            records = [
                RawRecord(topic, e.letter.partition, e.letter.offset, e.letter.key, e.letter.value, 0)
                for e in entries
            ]
            parsed = parse(reg, records, form="events")
            for d in parsed.dead:
                report.failing[by_pos[(d.partition, d.offset)].id] = d.reason
            batch, rejected = reject(sinks, parsed)
            for d in rejected:
                report.failing[by_pos[(d.partition, d.offset)].id] = d.reason
            batch_id = state.next_batch_id
            for sink in sinks:
                sink.apply(batch, batch_id, REPLAY_APP_ID)
            now = int(time.time() * 1000)
            done = [e for pos, e in by_pos.items() if e.id not in report.failing]
            for e in done:
                state.replayed[e.id] = {"at_ms": now, "batch_id": batch_id, "table": reg.qualified}
                report.replayed.append(e.id)
            state.next_batch_id = batch_id + 1
            state.save(settings.state_dir)  # after the sinks: a crash before it replays again (idempotent)
            report.tables[reg.qualified] = len(done)
            if out is not None:
                out.write(
                    f"{reg.qualified}: {len(done)} replayed, {len(entries) - len(done)} still failing\n"
                )
                out.flush()
    finally:
        for sink in sinks:
            sink.close()
    return report


def run_replay(args: argparse.Namespace, settings: Settings) -> int:
    report = replay(settings, _table_name(settings, args.table), out=sys.stderr if args.json else sys.stdout)
    if args.json:
        print_json(report.to_dict())
    else:
        sys.stdout.write(
            f"replayed {len(report.replayed)} dead letter(s); {len(report.failing)} still failing; "
            f"{report.already} replayed before\n"
        )
        for k, why in report.failing.items():
            sys.stdout.write(f"  {k}: {why}\n")
    return 1 if report.failing else 0


def _table_name(settings: Settings, table: str | None) -> str | None:
    """The registered table's qualified name for ``--table`` (RegistryError when unknown)."""
    if table is None:
        return None
    with Registry(settings.state_dir) as registry:
        return registry.find(table).qualified
