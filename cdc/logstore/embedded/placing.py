"""The reference path of an embedded append (:meth:`EmbeddedLogStore._packed
<cdc.logstore.embedded.store.EmbeddedLogStore._packed>`): each record's partition and the records as
the rows to store, grouped by partition, vectorised with numpy. The store imports it only for a batch
the compiled path (:mod:`cdc.logstore.embedded._pack`) does not take, so a process that only reads
(``cdc status``, ``cdc wait``) imports no numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat

import numpy as np

from cdc.errors import LogStoreError
from cdc.logstore import Record, partition_for
from cdc.logstore.embedded.codec import StoredRow, check_record
from cdc.logstore.partition_arrays import partition_array


def partitions(topic: str, n: int, records: Sequence[Record]) -> Sequence[int] | np.ndarray:
    """Each record's partition: the one it names (checked against the topic's ``n``), else its key's
    (vectorised when no record names one: :func:`cdc.logstore.partition_arrays.partition_array`)."""
    explicit = [r.partition for r in records]
    if explicit.count(None) != len(explicit):  # some record names its partition
        parts = [
            p if p is not None else partition_for(r.key, n) for p, r in zip(explicit, records, strict=True)
        ]
        for p in set(parts):
            if not 0 <= p < n:
                raise LogStoreError(
                    f"record for topic {topic!r} names partition {p}, the topic has {n} (0..{n - 1})",
                    fix=f"leave Record.partition None or use a partition in 0..{n - 1}",
                    topic=topic,
                    partition=p,
                )
    else:
        return partition_array([r.key for r in records], n)
    return parts


def stored_rows(
    name: str,
    n: int,
    end: Mapping[int, int],
    parts: Sequence[int] | np.ndarray,
    records: Sequence[Record],
    now: int,
) -> tuple[list[list[StoredRow]], list[int]]:
    """The records as stored, grouped by partition, with their offsets (partition ``p`` continues at
    ``end[p]``), and the tombstones per partition. Checks every record (:func:`check_record`).

    The usual batch (keys bytes, values bytes or None, no headers, timestamps int or None) is built
    without Python work per record (type sets, numpy grouping, ``map`` over the columns); anything
    else takes the per-record loop, which names an offending record."""
    keys = [r.key for r in records]
    values = [r.value for r in records]
    stamps = [r.timestamp_ms for r in records]
    usual = (
        set(map(type, keys)) == {bytes}
        and set(map(type, values)) <= {bytes, type(None)}
        and set(map(type, stamps)) <= {int, type(None)}
        and not any(r.headers for r in records)
    )
    groups: list[list[StoredRow]] = [[] for _ in range(n)]
    tombstones = [0] * n
    if not usual:
        nxt = [end[p] for p in range(n)]
        for i, (p, r) in enumerate(zip(parts, records, strict=True)):
            check_record(name, i, r)
            p = int(p)
            if r.value is None:
                tombstones[p] += 1
            ts = r.timestamp_ms
            groups[p].append(StoredRow(name, p, nxt[p], r.key, r.value, r.headers, now if ts is None else ts))
            nxt[p] += 1
        return groups, tombstones
    if None in stamps:
        stamps = [now if ts is None else ts for ts in stamps]
    placed = np.asarray(parts, dtype=np.int64)
    for p in range(n):
        idx = np.flatnonzero(placed == p).tolist()
        if not idx:
            continue
        vals = list(map(values.__getitem__, idx))
        tombstones[p] = vals.count(None)
        groups[p] = list(
            map(
                StoredRow,
                repeat(name),
                repeat(p),
                range(end[p], end[p] + len(idx)),
                map(keys.__getitem__, idx),
                vals,
                repeat(()),
                map(stamps.__getitem__, idx),
            )
        )
    return groups, tombstones
