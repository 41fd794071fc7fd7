"""Builds ``unsharded_search/``: a search index as the sink wrote it before indexes were sharded
(one tantivy index at ``search/<topic>``, its side table at ``search/<topic>.versions.sqlite``), for
``tests/sinks/test_search_shards.py``. Run from the repository root with the old module::

    git show d061e1f:sinks/search.py > /tmp/legacy_search.py
    PYTHONPATH=$PWD python tests/sinks/data/make_unsharded_search.py /tmp/legacy_search.py

The table is ``public.docs`` (id, title, body, price; search columns title and body). Applied, as
batches 1-3 of the app ``cdc-apply-test``: ids 1-8; a TRUNCATE at LSN 200 and ids 1-5 again; an
update of 2 and a delete of 3 (tombstone at LSN 310). Live afterwards: 1, 2, 4, 5.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from tests.sinks.feed import Feed, table

COLS = (("id", "bigint"), ("title", "text"), ("body", "text"), ("price", "numeric(10,2)"))
APP = "cdc-apply-test"


def main(module_path: str) -> None:
    spec = importlib.util.spec_from_file_location("legacy_search", module_path)
    assert spec is not None and spec.loader is not None
    legacy = importlib.util.module_from_spec(spec)
    sys.modules["legacy_search"] = legacy  # dataclasses look their module up
    spec.loader.exec_module(legacy)
    out = Path(__file__).parent / "unsharded_search"
    shutil.rmtree(out, ignore_errors=True)
    reg = table("docs", columns=COLS, search=("title", "body"))
    f = Feed(reg)

    def row(i: int, title: str) -> dict[str, object]:
        return {"id": i, "title": title, "body": f"body of {i}", "price": f"{i}.25"}

    sink = legacy.SearchSink(out)
    sink.apply(f.batch(*(f.change("c", row(i, f"first apple {i}"), 100 + i) for i in range(1, 9))), 1, APP)
    sink.apply(
        f.batch(f.truncate(200), *(f.change("c", row(i, f"second pear {i}"), 210 + i) for i in range(1, 6))),
        2,
        APP,
    )
    sink.apply(f.batch(f.change("u", row(2, "third plum 2"), 300), f.delete({"id": 3}, 310)), 3, APP)
    sink.close()
    for lock in (out / "search" / reg.topic).glob(".tantivy-*.lock"):
        lock.unlink()


if __name__ == "__main__":
    main(sys.argv[1])
