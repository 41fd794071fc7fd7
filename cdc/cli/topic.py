"""``cdc topic list|dump|tail``: look into the log store (embedded or Kafka, from the settings).

* ``cdc topic list [--json]``: every topic with its partitions, whether it is compacted, start and end
  offsets per partition and (embedded store) its live record count. ``--json`` prints a list of
  ``{"name", "partitions", "compacted", "start_offsets", "end_offsets", "records"}`` (``records`` is
  null where counting would mean reading the topic).
* ``cdc topic dump TOPIC [--from OFFSET] [--partition N] [--limit N] [--json]``: the records present
  now, partition by partition (0, 1, ...), each partition in offset order. Without ``--partition``,
  ``--from`` is applied to each partition and clamped to its start offset; with ``--partition`` an
  offset outside the partition's range is an error that names the range.
* ``cdc topic tail TOPIC [--partition N] [--interval S] [--limit N] [--json]``: follow the records
  appended after the command started, polling, until Ctrl-C (exit 0) or ``--limit`` records.

``--json`` prints one JSON object per record and line, ``{"topic", "partition", "offset",
"timestamp", "key", "value"}``: ``timestamp`` in milliseconds since the epoch, ``key`` and ``value`` as
the JSON they hold, verbatim (numbers keep their digits); ``value`` is null for a tombstone; a key or
value that is not valid JSON is printed as a JSON string (invalid UTF-8 as ``\\x..`` escapes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime

import orjson

from cdc.cli import VERB_HELP
from cdc.cli.output import print_json, print_table
from cdc.config import Settings
from cdc.errors import LogStoreError
from cdc.logstore import LogStore, StoredRecord
from cdc.logstore.factory import open_log_store


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc topic list|dump|tail`` to the ``cdc`` parser."""
    topic = sub.add_parser("topic", help=VERB_HELP["topic"])
    verbs = topic.add_subparsers(dest="topic_verb", metavar="VERB")
    verbs.required = True

    lst = verbs.add_parser("list", help="topics with partitions, offsets and record counts")
    lst.add_argument("--json", action="store_true", help="print a JSON list")
    lst.set_defaults(handler=run_list)

    dump = verbs.add_parser("dump", help="print a topic's records (partition by partition, offset order)")
    dump.add_argument("topic")
    dump.add_argument(
        "--from",
        dest="from_offset",
        type=int,
        default=0,
        metavar="OFFSET",
        help="first offset to print in each partition (default: the start)",
    )
    dump.add_argument("--partition", type=int, help="only this partition")
    dump.add_argument("--limit", type=int, help="stop after this many records")
    dump.add_argument("--json", action="store_true", help="one JSON object per record and line")
    dump.set_defaults(handler=run_dump)

    tail = verbs.add_parser("tail", help="follow new records until Ctrl-C")
    tail.add_argument("topic")
    tail.add_argument("--partition", type=int, help="only this partition")
    tail.add_argument("--interval", type=float, default=0.5, help="seconds between polls (default 0.5)")
    tail.add_argument("--limit", type=int, help="exit after this many records")
    tail.add_argument("--json", action="store_true", help="one JSON object per record and line")
    tail.set_defaults(handler=run_tail)


# -- list ---------------------------------------------------------------------------------------------
def run_list(args: argparse.Namespace, settings: Settings) -> int:
    with open_log_store(settings) as store:
        counter: Callable[[str], dict[int, int]] | None = getattr(store, "record_counts", None)
        rows = []
        for info in store.list_topics():
            records = sum(counter(info.name).values()) if counter is not None else None
            rows.append(
                {
                    "name": info.name,
                    "partitions": info.partitions,
                    "compacted": info.config.compacted,
                    "start_offsets": dict(info.start_offsets),
                    "end_offsets": dict(info.end_offsets),
                    "records": records,
                }
            )
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print(f"no topics in the log store ({settings.log_url or settings.state_dir / 'log'})")
        return 0
    print_table(
        "topics",
        ["topic", "partitions", "compacted", "start offsets", "end offsets", "records"],
        [
            (
                r["name"],
                r["partitions"],
                "yes" if r["compacted"] else "no",
                _offsets(r["start_offsets"]),  # type: ignore[arg-type]
                _offsets(r["end_offsets"]),  # type: ignore[arg-type]
                "" if r["records"] is None else f"{r['records']:,}",
            )
            for r in rows
        ],
    )
    return 0


def _offsets(offsets: Mapping[int, int]) -> str:
    return " ".join(f"{p}:{o}" for p, o in sorted(offsets.items()))


# -- dump ---------------------------------------------------------------------------------------------
def run_dump(args: argparse.Namespace, settings: Settings) -> int:
    with open_log_store(settings) as store:
        info = store.topic(args.topic)
        _check_partition(args.partition, info.partitions, args.topic)
        records = _dump_records(
            store, args.topic, args.partition, args.from_offset, info.start_offsets, info.end_offsets
        )
        _emit(_limited(records, args.limit), as_json=args.json)
    return 0


def _dump_records(
    store: LogStore,
    topic: str,
    partition: int | None,
    from_offset: int,
    starts: Mapping[int, int],
    ends: Mapping[int, int],
) -> Iterator[StoredRecord]:
    if partition is not None:
        # strict: the store says what the range is if the offset is outside it (before the start:
        # removed by retention; past the end)
        if from_offset >= ends[partition] or from_offset < starts[partition]:
            store.read(topic, partition, from_offset, 1)
            return
        yield from store.iter_partition(topic, partition, from_offset, ends[partition])
        return
    if from_offset < 0:
        raise LogStoreError(
            f"--from {from_offset} is not an offset",
            fix="give an offset >= 0 (without --partition it applies to each partition, clamped to its start)",
            offset=from_offset,
        )
    for p in sorted(ends):
        start = max(from_offset, starts[p])
        if start < ends[p]:
            yield from store.iter_partition(topic, p, start, ends[p])


def _check_partition(partition: int | None, partitions: int, topic: str) -> None:
    if partition is not None and not 0 <= partition < partitions:
        raise LogStoreError(
            f"topic {topic!r} has no partition {partition} (it has {partitions})",
            fix=f"use --partition in 0..{partitions - 1}, or leave it out for all partitions",
            topic=topic,
            partition=partition,
        )


def _limited(records: Iterable[StoredRecord], limit: int | None) -> Iterator[StoredRecord]:
    """The first ``limit`` records; stops right after the last one (``tail`` must not wait for one
    more record before it exits)."""
    if limit is None:
        yield from records
        return
    if limit <= 0:
        return
    for i, rec in enumerate(records, 1):
        yield rec
        if i >= limit:
            return


# -- tail ---------------------------------------------------------------------------------------------
def run_tail(args: argparse.Namespace, settings: Settings) -> int:
    try:
        with open_log_store(settings) as store:
            info = store.topic(args.topic)
            _check_partition(args.partition, info.partitions, args.topic)
            positions = {
                p: o for p, o in info.end_offsets.items() if args.partition is None or p == args.partition
            }
            if not args.json:
                print(
                    f"following {args.topic} from offsets {_offsets(positions)} (Ctrl-C to stop)",
                    file=sys.stderr,
                    flush=True,
                )
            _emit(
                _limited(_follow(store, args.topic, positions, args.interval), args.limit),
                as_json=args.json,
                flush=True,
            )
    except KeyboardInterrupt:
        pass
    return 0


def _follow(
    store: LogStore, topic: str, positions: dict[int, int], interval: float
) -> Iterator[StoredRecord]:
    while True:
        got = False
        for p in sorted(positions):
            start = store.start_offsets(topic)[p]
            for rec in store.read(topic, p, max(positions[p], start)):
                positions[p] = rec.offset + 1
                got = True
                yield rec
        if not got:
            time.sleep(interval)


# -- printing -----------------------------------------------------------------------------------------
def _emit(records: Iterable[StoredRecord], *, as_json: bool, flush: bool = False) -> None:
    out = sys.stdout
    for rec in records:
        out.write((json_line(rec) if as_json else text_line(rec)) + "\n")
        if flush:
            out.flush()
    out.flush()


def _json_text(data: bytes | None) -> bytes:
    """``data`` as JSON text: itself when it is valid JSON (verbatim, on one line), else a JSON string."""
    if data is None:
        return b"null"
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError:
        try:  # orjson refuses integers beyond 64 bits, which are valid JSON (e.g. a numeric key)
            json.loads(data)
        except ValueError:
            return orjson.dumps(data.decode("utf-8", "backslashreplace"))
    # In valid JSON, CR and LF can only be whitespace between tokens.
    return data.strip().replace(b"\r", b" ").replace(b"\n", b" ")


def json_line(rec: StoredRecord) -> str:
    """The ``--json`` line of a record (see the module docstring)."""
    head = orjson.dumps(
        {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset, "timestamp": rec.timestamp_ms}
    )
    return (
        head[:-1] + b',"key":' + _json_text(rec.key) + b',"value":' + _json_text(rec.value) + b"}"
    ).decode()


def text_line(rec: StoredRecord) -> str:
    when = datetime.fromtimestamp(rec.timestamp_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    value = "(tombstone)" if rec.value is None else rec.value.decode("utf-8", "backslashreplace")
    return f"p{rec.partition}@{rec.offset} {when} {rec.key.decode('utf-8', 'backslashreplace')} {value}"
