"""`cdc wait` and `GET /wait` end to end: real Postgres, the real reader (`cdc run`), the embedded log
store and, for read-your-writes, the real apply (`cdc apply`, Spark, running continuously in its own
process). The reader's own heartbeat is set to an hour, so only the wait's nudge can move an idle
slot: a wait that returns on an idle table shows the wait does not depend on the reader's timer.
A view from joins is waited for by its name too: not caught up while its index is not built, then
its change is visible in its Delta table and its index once the wait returns."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import orjson
import psycopg
import pytest
from pydantic import SecretStr

from cdc.cli.serve.server import ServeOptions, Server
from tests.plugins.capture import CDC, CaptureEnv, SourceLoad, wait_streaming

#: a value with what breaks naive handling: quotes, a backslash, a newline, the field's own name
UGLY = 'ryw "commit_lsn":1 \\ it\'s\nnew'


def _tables(env: CaptureEnv) -> None:
    """The tables, registered; the reader's heartbeat (1 s in the tests' cdc.toml) set to an hour."""
    env.config.write_text(
        env.config.read_text().replace("heartbeat_interval_s = 1\n", "heartbeat_interval_s = 3600\n")
    )
    assert "heartbeat_interval_s = 3600" in env.config.read_text()
    env.sql("CREATE TABLE items (id int PRIMARY KEY, name text)")
    env.sql("INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 20) g")
    env.sql("CREATE TABLE quiet (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO quiet SELECT g, 'q' || g FROM generate_series(1, 5) g")
    env.sql("CREATE TABLE other (id serial PRIMARY KEY, v text)")  # never registered
    env.add_table("public.items", "--search", "name")
    env.add_table("public.quiet")


def _lsn(env: CaptureEnv) -> str:
    return str(env.fetch("SELECT pg_current_wal_lsn()::text")[0][0])


def _wait(env: CaptureEnv, lsn: str, *args: str) -> tuple[int, dict[str, Any]]:
    res = env.cdc("wait", "--lsn", lsn, "--json", *args, timeout=300)
    assert res.stdout.strip(), res.stderr
    return res.returncode, dict(orjson.loads(res.stdout))


def _table(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in result["tables"] if t["table"] == name)


@pytest.mark.parametrize("env", ["embedded", "kafka"], indirect=True)
def test_wait_without_apply_idle_table_timeout_and_bad_input(env: CaptureEnv) -> None:
    """No JVM, on both log stores: the capture side of the wait. A table with nothing in its topic is caught up once the
    slot passed L, even on an idle source; with the apply never started the wait times out (exit 3)
    saying how far behind; with the reader stopped it says capture is behind."""
    env.sql("CREATE TABLE empty (id int PRIMARY KEY, v text)")
    _tables(env)
    env.add_table("public.empty")
    proc = env.spawn("run")
    wait_streaming(env, proc)
    env.sql("INSERT INTO other (v) VALUES ('not captured')")  # WAL with nothing to decode for the slot
    env.sql("CHECKPOINT")  # more WAL the reader has nothing to decode in
    code, result = _wait(env, _lsn(env), "--table", "public.empty", "--timeout", "60")
    assert code == 0 and result["caught_up"], result
    assert result["capture"]["passed"] and _table(result, "public.empty")["lag_offsets"] == 0

    env.sql("UPDATE items SET name = 'changed' WHERE id <= 3")
    lsn = _lsn(env)
    code, result = _wait(env, lsn, "--table", "public.items", "--timeout", "3")
    assert code == 3 and not result["caught_up"] and result["capture"]["passed"], result
    items = _table(result, "public.items")
    assert items["lag_offsets"] == 23 and items["sinks"] == ["warehouse", "search"]  # 20 rows + 3 changes
    assert items["behind_bytes"] > 0 and items["pending_lsn"]
    # capture passed lsn above: the outcome no longer depends on how long the wait lasts
    text = env.cdc("wait", "--lsn", lsn, "--table", "public.items", "--timeout", "0.5")
    assert text.returncode == 3 and "NOT caught up" in text.stderr and "cdc apply" in text.stderr, text.stderr

    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    env.sql("UPDATE items SET name = 'while stopped' WHERE id = 4")
    code, result = _wait(env, _lsn(env), "--timeout", "0.5")  # the reader is stopped: it cannot pass
    assert code == 3 and not result["capture"]["passed"] and result["capture"]["active"] is False, result
    assert result["capture"]["behind_bytes"] > 0 and result["capture"]["pending_changes"] == 1
    assert all(t["lag_offsets"] is None for t in result["tables"])

    bad = env.cdc("wait", "--lsn", "16B3748")
    assert bad.returncode == 2 and "not an LSN" in bad.stderr and "pg_current_wal_lsn" in bad.stderr
    unknown = env.cdc("wait", "--lsn", "0/1", "--table", "public.nope")
    assert unknown.returncode != 0 and "public.nope" in unknown.stderr


def _get(url: str, token: str | None = None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(orjson.loads(resp.read()))
    except urllib.error.HTTPError as err:
        return err.code, dict(orjson.loads(err.read()))


def _start_apply(env: CaptureEnv) -> subprocess.Popen[bytes]:
    """`cdc apply` running continuously (a micro-batch every 0.2 s), in a process group of its own."""
    log = open(env.state.parent / "apply.log", "wb")  # noqa: SIM115
    return subprocess.Popen(
        [*CDC, "apply", "--trigger-interval", "0.2"],
        env=env.environ(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=env.state.parent,
    )


def _visible(env: CaptureEnv, key: int, name: str) -> None:
    """The row is in the warehouse (`cdc sql`) and its document in the index (`cdc search`) now."""
    res = env.cdc("sql", "--json", f"SELECT name FROM public.items WHERE id = {key}")
    assert res.returncode == 0, res.stderr
    assert orjson.loads(res.stdout) == [{"name": name}], res.stdout
    found = env.cdc("search", "public.items", "--json", "--limit", "100", f"tag{key}")
    assert found.returncode == 0, found.stderr
    assert [h["document"]["name"] for h in orjson.loads(found.stdout) if h["key"] == {"id": key}] == [name]


class _Churn(SourceLoad):
    """Updates of items 10-20, one transaction each, as fast as they go."""

    def loop(self, conn: psycopg.Connection[Any]) -> None:
        n = 0
        while not self.stop.is_set():
            conn.execute("UPDATE items SET name = %s WHERE id = %s", (f"churn {n}", 10 + n % 11))
            n += 1


def _write_wait_read(env: CaptureEnv, key: int) -> None:
    """Commit a change of row ``key``, take the LSN, `cdc wait` for it, then read it back."""
    name = f"{UGLY} tag{key}"
    env.sql(
        "INSERT INTO items VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name", (key, name)
    )
    code, result = _wait(env, _lsn(env), "--table", "public.items", "--timeout", "120")
    assert code == 0 and _table(result, "public.items")["caught_up"], result
    _visible(env, key, name)


#: a view over the two registered tables (items -> quiet on quiet's key), searchable by name
VIEW = "item_view"
VIEW_SQL = "SELECT i.id, i.name, q.v FROM items i LEFT JOIN quiet q ON i.id = q.id"


def _view_read_your_writes(env: CaptureEnv) -> None:
    """With the apply running and every change applied: a view added now has its Delta table (built
    at add) but not its index (the running apply holds the index's writer), so a wait for it is not
    caught up and says why; after a change of a table it reads, the wait returns once the view shows
    it, in `cdc sql` and `cdc search` (hits keyed by the driving row's key)."""
    code, result = _wait(env, _lsn(env), "--timeout", "120")  # every table: nothing left to apply
    assert code == 0, result
    added = env.cdc("views", "add", VIEW, "--sql", VIEW_SQL, "--search", "name", "--json")
    assert added.returncode == 0, added.stderr
    assert orjson.loads(added.stdout)["build"]["index"] is False  # the apply runs: built at its next batch
    code, result = _wait(env, _lsn(env), "--table", VIEW, "--timeout", "2")
    assert code == 3 and not result["caught_up"], result
    view = _table(result, VIEW)
    assert view["kind"] == "view" and view["reads"] == ["public.items", "public.quiet"], view
    assert view["lag_offsets"] == 0 and "search index of view item_view is not built" in view["error"]
    assert _table(result, "public.items")["caught_up"] and _table(result, "public.quiet")["caught_up"]

    name = f"{UGLY} tag4"
    env.sql("UPDATE items SET name = %s WHERE id = 4", (name,))
    code, result = _wait(env, _lsn(env), "--table", VIEW, "--timeout", "120")
    assert code == 0 and _table(result, VIEW)["caught_up"] and "error" not in _table(result, VIEW), result
    assert [t["table"] for t in result["tables"]] == ["public.items", "public.quiet", VIEW]
    res = env.cdc("sql", "--json", f"SELECT name, v FROM {VIEW} WHERE id = 4")
    assert res.returncode == 0 and orjson.loads(res.stdout) == [{"name": name, "v": "q4"}], res.stdout
    found = env.cdc("search", VIEW, "--json", "--limit", "100", "tag4")
    assert found.returncode == 0, found.stderr
    assert [(h["key"], h["document"]) for h in orjson.loads(found.stdout)] == [({"id": 4}, {"name": name})]
    text = env.cdc("wait", "--lsn", _lsn(env), "--table", VIEW, "--timeout", "30")
    assert text.returncode == 0 and text.stdout.endswith(f"public.items, public.quiet, {VIEW}\n"), text.stdout


def test_read_your_writes_end_to_end(env: CaptureEnv, jvm: None) -> None:
    """Commit, take pg_current_wal_lsn(), `cdc wait` (exit 0), then the change is visible in the
    warehouse and the index, also while other changes of the table stream in; a wait on a table
    with no change returns; the HTTP endpoint likewise
    with its token; with the apply stopped both time out saying how far behind."""
    _tables(env)
    reader = env.spawn("run")
    wait_streaming(env, reader)
    apply = _start_apply(env)
    try:
        code, result = _wait(env, _lsn(env), "--timeout", "600")  # Spark's start and the snapshots
        assert code == 0, (result, (env.state.parent / "apply.log").read_text(errors="replace")[-3000:])
        for key in (101, 102, 7):
            _write_wait_read(env, key)
        with _Churn(env):  # later changes of the same table land in the same partitions meanwhile
            for key in (103, 8):
                _write_wait_read(env, key)
        code, result = _wait(env, _lsn(env), "--table", "public.quiet", "--timeout", "60")
        assert code == 0 and _table(result, "public.quiet")["lag_offsets"] == 0, result
        _view_read_your_writes(env)
        _http(env, apply)
    finally:
        if apply.poll() is None:
            os.killpg(apply.pid, signal.SIGKILL)
            apply.wait(timeout=60)


def _http(env: CaptureEnv, apply: subprocess.Popen[bytes]) -> None:
    server = Server(
        env.settings(),
        ServeOptions(host="127.0.0.1", port=0, sample_interval_s=60),
        token=SecretStr("s3cret"),
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.address[1]}/wait"
    try:
        env.sql("UPDATE items SET name = %s WHERE id = 5", (f"{UGLY} tag5",))
        query = urllib.parse.urlencode({"lsn": _lsn(env), "table": "public.items", "timeout": "120"})
        assert _get(f"{base}?{query}")[0] == 401
        assert _get(f"{base}?{query}", "wrong")[0] == 401
        code, body = _get(f"{base}?{query}", "s3cret")
        assert code == 200 and body["caught_up"], body
        _visible(env, 5, f"{UGLY} tag5")
        query = urllib.parse.urlencode({"lsn": _lsn(env), "table": VIEW, "timeout": "120"})
        code, body = _get(f"{base}?{query}", "s3cret")
        assert code == 200 and _table(body, VIEW)["caught_up"], body
        assert _get(f"{base}?lsn=nonsense", "s3cret")[0] == 400
        assert _get(f"{base}?lsn=0/1&table=public.nope", "s3cret")[0] == 400

        os.killpg(apply.pid, signal.SIGTERM)
        apply.wait(timeout=120)
        env.sql("UPDATE items SET name = 'after the apply stopped' WHERE id = 6")
        lsn = _lsn(env)
        code, body = _get(f"{base}?{urllib.parse.urlencode({'lsn': lsn, 'timeout': '2'})}", "s3cret")
        assert code == 504 and not body["caught_up"] and body["capture"]["passed"], body
        items = _table(body, "public.items")
        assert items["lag_offsets"] == 1 and items["behind_bytes"] > 0, items
        assert _table(body, "public.quiet")["caught_up"]
        view = _table(body, VIEW)  # every table and view by default: the view waits for items
        assert not view["caught_up"] and view["lag_offsets"] == 1 and "error" not in view, view
        res = env.cdc("wait", "--lsn", lsn, "--timeout", "0.5", "--json")  # capture passed lsn above
        assert res.returncode == 3 and _table(orjson.loads(res.stdout), "public.items")["lag_offsets"] == 1
    finally:
        server.shutdown()
        thread.join(timeout=30)
