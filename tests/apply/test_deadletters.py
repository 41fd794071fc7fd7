"""Dead letters of the apply job fed by hand-built records (:class:`tests.plugins.changes.ChangeWriter`
writes the events, poison values and a record that is not JSON, to the log store; not ``cdc run``),
then the verbs: ``cdc topic dump`` shows them readably, ``cdc deadletters list`` lists them, and once
the cause is fixed (the column excluded) ``cdc deadletters replay`` applies them through the sinks'
versioned path -- never over newer data -- and a second replay does nothing. The job runs once in
this process (:func:`tests.plugins.apply.run_job`), the verbs through ``cdc``'s entry point."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import orjson
import pytest

from cdc.cli import main
from cdc.events import dead_letter_topic
from sinks.search import search
from sinks.warehouse import WarehouseSink
from tests.plugins.apply import Env, run_job
from tests.plugins.changes import ChangeWriter, make_reg
from tests.plugins.items import POISON_COLUMNS, good_row


def cli(capsys: pytest.CaptureFixture[str], env: Env, *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = main(["--state", str(env.state), *argv])
    out = capsys.readouterr().out
    return code, out


@pytest.mark.parametrize("backend", ["embedded"])
def test_dead_letters_are_shown_listed_and_replayed_once_fixed(
    spark_clean: Any, env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    reg = env.register(make_reg(f"d{uuid.uuid4().hex[:6]}", "items", POISON_COLUMNS, search=("name",)))
    w = ChangeWriter(env.store, reg, partitions=2)
    with w.txn():
        for i in range(1, 21):
            row = good_row(i)
            if i == 13:
                row["born"] = "0044-03-15 BC"
            if i == 17:
                row["born"] = "12000-01-01"
            w.insert(row)
        w.raw(b'{"id":99}', b"{not json")
    summary = run_job(spark_clean, env)
    assert summary.dead_letters == 3
    rows = lambda: {r["id"]: r for r in WarehouseSink(env.state).current_rows(reg, meta=False).to_pylist()}  # noqa: E731
    assert set(rows()) == set(range(1, 21)) - {13, 17}

    # `cdc topic dump` shows them with reason, table, key, version and source offset
    code, out = cli(capsys, env, "topic", "dump", dead_letter_topic("cdc"), "--json")
    assert code == 0
    dumped = [orjson.loads(line)["value"] for line in out.splitlines()]
    poison = [v for v in dumped if v["table"] == reg.qualified and v["version"] is not None]
    assert len(poison) == 2
    for v in poison:
        assert "column born" in v["reason"] and v["source"]["topic"] == reg.topic
        assert isinstance(v["source"]["offset"], int) and orjson.loads(v["key_json"])["id"] in (13, 17)

    # `cdc deadletters list --json`
    code, out = cli(capsys, env, "deadletters", "list", "--table", reg.qualified, "--json")
    listed = orjson.loads(out)
    assert code == 0 and len(listed) == 3 and not any(d["replayed"] for d in listed)
    assert {d["key"] for d in listed if d["version"]} == {'{"id":13}', '{"id":17}'}

    # key 17 gets a newer change before the replay: the replay must not overwrite it
    with w.txn():
        w.update({**good_row(17, 5), "born": "2001-01-01"})
    run_job(spark_clean, env)
    assert rows()[17]["name"] == "widget 17 v5"

    # nothing fixed yet: the replay applies nothing, the poison stays listed
    code, out = cli(capsys, env, "deadletters", "replay", "--json")
    first = orjson.loads(out)
    assert code == 1 and first["replayed"] == 0 and len(first["still_failing"]) == 3

    # the fix the error suggests: exclude the column
    env.registry.remove(reg.schema, reg.table)
    reg = env.register(replace(reg, exclude=("born",)))
    code, out = cli(capsys, env, "deadletters", "replay", "--json")
    done = orjson.loads(out)
    assert code == 1, "the record that is not JSON still fails"
    assert done["replayed"] == 2 and len(done["still_failing"]) == 1
    assert "not JSON" in done["still_failing"][0]["reason"]
    got = rows()
    assert got[13]["name"] == "widget 13 v0", "the replayed record applied"
    assert got[17]["name"] == "widget 17 v5", "the replay never overwrites newer data"
    assert 13 in {h.key["id"] for h in search(env.state, reg, "widget", limit=100)}
    history = WarehouseSink(env.state).history_rows(reg).to_pylist()
    assert [r["name"] for r in history if r["id"] == 17] == ["widget 17 v5"]

    # a second replay does nothing; the list shows what was replayed
    code, out = cli(capsys, env, "deadletters", "replay", "--json")
    again = orjson.loads(out)
    assert again["replayed"] == 0 and again["already_replayed"] == 2
    code, out = cli(capsys, env, "deadletters", "list", "--json")
    assert [d["key"] for d in orjson.loads(out)] == ['{"id":99}']
