"""No verb ever prints, logs or stores the source password (issue 9, Secrets).

Every verb runs as a real process with a DSN that carries a password -- valid DSNs in key=value and
URI form (the whole pipeline: register, capture, apply, status, serve, query, verify, topics, dead
letters), a wrong password, an unreachable host, and DSNs that do not parse -- given by flag,
environment and cdc.toml. Then all output (and the bodies `cdc serve` answers) and every file under
the state directory are searched for the password.

`cdc demo` is not run: it always starts its own private Postgres and passes that cluster's DSN to
every step (cdc/cli/demo/pipeline.py), so neither --source nor CDC_SOURCE ever reaches it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import pytest

from cdc.devcluster import PgCluster, free_port
from cdc.registry import Registry, TableReg
from tests.plugins.capture import CDC

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

PASSWORD = f"S3cr3t-{uuid.uuid4().hex[:12]}"
#: a password with URI-special characters, given percent-encoded in the URI form
ODD_PASSWORD = f"p@ss/w:rd {uuid.uuid4().hex[:6]}"

#: `cdc serve` and `cdc topic tail` run until stopped: :func:`_serve` and :func:`_tail` run them
SERVE = ["serve", "--port", "0"]
TAIL = ["topic", "tail", "cdc.public.items", "--limit", "1"]

#: every verb, in the order of the pipeline (`demo` aside, see the module docstring)
VERBS: list[list[str]] = [
    ["check"],
    ["check", "--json"],
    ["tables", "add", "public.items", "--search", "name"],
    ["tables", "list"],
    ["tables", "list", "--json"],
    ["run", "--once"],
    ["run", "--once", "--json"],
    TAIL,
    ["apply", "--once"],
    ["status"],
    ["status", "--json"],
    SERVE,
    ["sql", "SELECT * FROM public.items ORDER BY id"],
    ["sql", "SELECT count(*) AS n FROM public.items", "--json"],
    ["search", "public.items", "widget"],
    ["verify"],
    ["verify", "--json"],
    ["topic", "list"],
    ["topic", "dump", "cdc.public.items", "--json"],
    ["deadletters", "list"],
    ["deadletters", "list", "--json"],
    ["deadletters", "replay"],
    ["snapshot", "--all"],
    ["snapshot", "public.items", "--json"],
    ["tables", "remove", "public.items"],
]

#: the verbs that connect to the source with the DSN (the others only parse it, when the settings
#: are loaded: a DSN that does not parse fails every verb there, before it runs)
CONNECTING = [
    ["check"],
    ["check", "--json"],
    ["tables", "add", "public.items"],
    ["run", "--once"],
    ["status"],
    ["status", "--json"],
    SERVE,
    ["verify", "--wait", "0"],  # the env pass does not apply: do not wait for the warehouse
]

#: each verb's exit code with a good DSN, in the order of VERBS (the whole pipeline by flag): a verb
#: that crashed early (exit 1, a traceback) would leak nothing and must not pass. `check` warns
#: (exit 1) on the test cluster: max_slot_wal_keep_size is unlimited, and this role may not create
#: the watermark table
GOOD_EXIT: dict[str, int] = {
    "check": 1,
    "check --json": 1,
    "tables add public.items --search name": 0,
    "tables list": 0,
    "tables list --json": 0,
    "run --once": 0,
    "run --once --json": 0,
    " ".join(TAIL): 0,
    "apply --once": 0,
    "status": 0,
    "status --json": 0,
    " ".join(SERVE): 0,
    "sql SELECT * FROM public.items ORDER BY id": 0,
    "sql SELECT count(*) AS n FROM public.items --json": 0,
    "search public.items widget": 0,
    "verify": 0,
    "verify --json": 0,
    "topic list": 0,
    "topic dump cdc.public.items --json": 0,
    "deadletters list": 0,
    "deadletters list --json": 0,
    "deadletters replay": 0,
    "snapshot --all": 0,
    "snapshot public.items --json": 0,
    "tables remove public.items": 0,
}
#: the env pass: the verbs that connect, with a good DSN by environment, on a pipeline whose
#: warehouse was never applied: status warns (records pending, no apply job: 1) and verify finds
#: the warehouse behind (3)
ENV_EXIT: dict[str, int] = {
    "check": 1,
    "check --json": 1,
    "tables add public.items": 0,
    "run --once": 0,
    "status": 1,
    "status --json": 1,
    " ".join(SERVE): 0,
    "verify --wait 0": 3,
    "tables remove public.items": 0,
}
#: what a failing DSN must have got to, by kind: the exit code of a verb that connects, and words
#: of the error that show it tried the DSN (a crash before that would leak nothing and pass). `cdc
#: status` reports the source unreachable with that error and warns (1); `cdc serve` serves it (0)
FAILING = {
    "wrong password": (2, "password authentication failed"),
    "unreachable": (1, "it cannot be reached"),
    "malformed": (2, "does not parse"),
}


def _leaks(text: str | bytes, secrets: list[str]) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [s for s in secrets if s.encode() in data]


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CDC, *args], env=env, capture_output=True, text=True, timeout=600, cwd=cwd)


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return value


class _Background:
    """A verb that runs until stopped, with its stdout and stderr in files that can be polled."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, out_dir: Path) -> None:
        out_dir.mkdir(exist_ok=True)
        name = uuid.uuid4().hex[:8]
        self.out, self.err = out_dir / f"{name}.out", out_dir / f"{name}.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen([*CDC, *args], env=env, cwd=cwd, stdout=out, stderr=err, text=True)

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _serve(args: list[str], env: dict[str, str], cwd: Path, out_dir: Path) -> tuple[int, str]:
    """`cdc serve`: once it listens, GET /status (until it has a sample), /metrics and /history, then
    SIGTERM. Returns its exit code and everything it printed and answered."""
    bg = _Background(args, env, cwd, out_dir)
    try:
        listening = re.compile(r"cdc serve: (http://\S+/)")
        _wait(lambda: bg.proc.poll() is not None or listening.search(bg.err.read_text()), 60, "serve")
        found = listening.search(bg.err.read_text())
        bodies = []
        if found:
            url = found.group(1)
            status = _wait(lambda: (s := _get(url + "status"))[0] != 503 and s, 60, "a /status sample")
            assert isinstance(status, tuple) and status[0] == 200, status
            bodies = [status[1], *(_get(url + path)[1] for path in ("metrics", "history"))]
    finally:
        code = bg.stop()
    return code, bg.text() + "".join(bodies)


def _tail(
    args: list[str], env: dict[str, str], cwd: Path, out_dir: Path, change: Callable[[], None]
) -> tuple[int, str]:
    """`cdc topic tail --limit 1`: once it follows the topic, ``change()`` appends a record to it;
    the tail prints that record and exits."""
    bg = _Background(args, env, cwd, out_dir)
    try:
        _wait(lambda: bg.proc.poll() is not None or "following" in bg.err.read_text(), 60, "tail")
        if bg.proc.poll() is None:
            change()
            bg.proc.wait(timeout=60)
    finally:
        code = bg.stop()
    return code, bg.text()


@pytest.fixture
def role(pg: PgCluster, pg_db: str) -> str:
    name = f"sec_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE ROLE {name} LOGIN REPLICATION PASSWORD '{PASSWORD}' IN ROLE cdc_password_auth")
    pg.execute(f"CREATE ROLE {name}_odd LOGIN REPLICATION IN ROLE cdc_password_auth")
    pg.execute(f"ALTER ROLE {name}_odd PASSWORD '{ODD_PASSWORD.replace(chr(39), chr(39) * 2)}'")
    pg.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text)", pg_db)
    pg.execute("INSERT INTO public.items SELECT g, 'widget ' || g FROM generate_series(1, 20) g", pg_db)
    pg.execute(f"GRANT SELECT ON public.items TO {name}, {name}_odd", pg_db)
    return name


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CDC_")}


#: (pass, verb, exit code, output) of a verb that did not end as expected
Wrong = list[tuple[str, str, int, str]]


def _good_passes(
    pg: PgCluster,
    pg_db: str,
    dsns: tuple[str, str],
    tmp_path: Path,
    captured: Path,
    secrets: list[str],
) -> tuple[list[tuple[str, str]], Wrong]:
    """1. the whole pipeline with a good DSN by flag (key=value); then every verb that connects with
    a good DSN by environment (URI; the verbs that do not connect only parse it, which the flag
    pass and the failing pass cover): (outputs, what did not end as expected)."""
    kv, uri = dsns
    outputs: list[tuple[str, str]] = []
    wrong: Wrong = []
    for how, dsn, verbs in (
        ("flag", kv, VERBS),
        ("env", uri, [*CONNECTING, ["tables", "remove", "public.items"]]),
    ):
        state = tmp_path / f"state-{how}"
        env = {**_base_env(), "CDC_SLOT": f"sec_{uuid.uuid4().hex[:8]}"}
        pre = ["--state", str(state)]
        if how == "flag":
            pre += ["--source", dsn]
        else:
            env["CDC_SOURCE"] = dsn

        def change(pre: list[str] = pre, env: dict[str, str] = env, how: str = how) -> None:
            pg.execute("INSERT INTO public.items SELECT max(id) + 1, 'tailed' FROM public.items", pg_db)
            res = _run([*pre, "run", "--once"], env, tmp_path)
            assert res.returncode == 0, res.stderr[-2000:]
            outputs.append((f"{how} run --once (for tail)", res.stdout + res.stderr))

        expected = GOOD_EXIT if how == "flag" else ENV_EXIT
        for verb in verbs:
            if verb is SERVE:
                code, text = _serve([*pre, *verb], env, tmp_path, captured)
                assert '"reachable":true' in text.replace(" ", ""), text[-2000:]
            elif verb is TAIL:
                code, text = _tail([*pre, *verb], env, tmp_path, captured, change)
                assert "tailed" in text, text[-2000:]
            else:
                res = _run([*pre, *verb], env, tmp_path)
                code, text = res.returncode, res.stdout + res.stderr
            if code != expected[" ".join(verb)] or "Traceback" in text:
                wrong.append((how, " ".join(verb), code, text[-1500:]))
            outputs.append((f"{how} {verb}", text))
        for path in state.rglob("*"):
            if path.is_file():
                assert _leaks(path.read_bytes(), secrets) == [], path
        pg.execute(f"SELECT pg_drop_replication_slot('{env['CDC_SLOT']}')", pg_db)
    return outputs, wrong


def _failing_jobs(
    pg: PgCluster, pg_db: str, role: str
) -> tuple[list[tuple[str, str, list[str]]], dict[str, str]]:
    """2. failing DSNs, by flag, environment and cdc.toml. A wrong password and an unreachable host
    get every verb that connects (where they fail). DSNs that do not parse fail as the settings
    load, before any verb runs -- the same path for every verb -- so they share the verbs out: every
    verb runs with one of them (connecting verbs first, so each such DSN meets one that would
    connect if it parsed), and each of them runs by flag, environment and cdc.toml.
    Returns the (where, DSN, verb) jobs and the kind of each DSN."""
    connects = [
        pg.dsn(pg_db, role, PASSWORD + "x"),
        f"postgresql://{role}:{PASSWORD}@127.0.0.1:{free_port()}/{pg_db}",
    ]
    malformed = [
        f"postgres:/{role}:{PASSWORD}@127.0.0.1/{pg_db}",
        f"postgres:{role}:{PASSWORD}@localhost/db",
        f"host=127.0.0.1 password='{PASSWORD} dbname={pg_db}",
        f"host=127.0.0.1 password={PASSWORD} no_such_option=1",
        f"postgresql://{role}:{PASSWORD}@127.0.0.1:notaport/{pg_db}",
        f"{role}:{PASSWORD}@127.0.0.1",
    ]
    wheres = ("flag", "env", "toml")
    jobs = [(wheres[i % 3], dsn, verb) for i, dsn in enumerate(connects) for verb in CONNECTING]
    connecting_first = [*CONNECTING, *(v for v in VERBS if v not in CONNECTING)]
    n = len(malformed)
    jobs += [(wheres[(j // n) % 3], malformed[j % n], verb) for j, verb in enumerate(connecting_first)]
    assert {tuple(v) for _, dsn, v in jobs if dsn in malformed} >= {tuple(v) for v in VERBS}
    kind_of = {
        connects[0]: "wrong password",
        connects[1]: "unreachable",
        **dict.fromkeys(malformed, "malformed"),
    }
    return jobs, kind_of


def _failing(
    job: tuple[str, str, list[str]], kind_of: dict[str, str], tmp_path: Path, captured: Path, wrong: Wrong
) -> tuple[str, str]:
    """One failing job in its own process and state directory: (what, output); a verb that did not
    end as expected goes to ``wrong``."""
    where, dsn, verb = job
    malformed = kind_of[dsn] == "malformed"
    code_wanted, words = FAILING[kind_of[dsn]]
    env = _base_env()
    run_id = uuid.uuid4().hex[:8]
    cwd = tmp_path / f"cwd-{run_id}"  # holds the cdc.toml with the DSN: not searched
    cwd.mkdir()
    state = tmp_path / f"state-bad-{run_id}"
    pre = ["--state", str(state)]
    if verb[0] == "verify":  # with no table registered it stops before it connects
        with Registry(state) as registry:
            registry.add(TableReg("public", "items", "cdc.public.items", ("id",)))
    toml = "retry_max_s = 1\nbackoff_initial_s = 0.1\n"  # the unreachable host: retry briefly
    if where == "flag":
        pre += ["--source", dsn]
    elif where == "env":
        env["CDC_SOURCE"] = dsn
    else:
        toml = f"source = {dsn!r}\n" + toml
    (cwd / "cdc.toml").write_text(toml)
    env["CDC_CONFIG"] = str(cwd / "cdc.toml")
    if verb is SERVE:
        code, text = _serve([*pre, *verb], env, cwd, captured)
        if not malformed:
            # it serves (exit 0 on SIGTERM) and reports the source as unreachable
            code_wanted, words = 0, '"reachable":false'
    else:
        res = _run([*pre, *verb], env, cwd)
        code, text = res.returncode, res.stdout + res.stderr
        if verb[0] == "status" and not malformed:
            code_wanted = 1
    # a DSN that does not parse fails every verb as its settings load (exit 2)
    if code != code_wanted or words not in text.replace('": ', '":') or "Traceback" in text:
        wrong.append((f"bad {where} {kind_of[dsn]}", " ".join(verb), code, text[-1500:]))
    return f"bad {where} {verb}", text


# about 70 processes (a Spark start among them): over the 600 s default at load 15 on 2 cores
@pytest.mark.timeout(1800)
def test_no_verb_shows_or_stores_the_password(pg: PgCluster, pg_db: str, role: str, tmp_path: Path) -> None:
    secrets = [PASSWORD, ODD_PASSWORD, quote(ODD_PASSWORD, safe="")]
    kv = pg.dsn(pg_db, role, PASSWORD)
    uri = f"postgresql://{role}_odd:{quote(ODD_PASSWORD, safe='')}@127.0.0.1:{pg.port}/{pg_db}"
    captured = tmp_path / "captured"  # the output of the background verbs (checked as output)
    # 1. good DSNs by flag and by environment
    outputs, wrong = _good_passes(pg, pg_db, (kv, uri), tmp_path, captured, secrets)
    # 2. failing DSNs, by flag, environment and cdc.toml, each run its own process and state
    #    directory, 3 at a time
    jobs, kind_of = _failing_jobs(pg, pg_db, role)
    with ThreadPoolExecutor(3) as pool:
        outputs += pool.map(lambda job: _failing(job, kind_of, tmp_path, captured, wrong), jobs)
    for path in tmp_path.rglob("*"):
        if path.is_file() and "cwd-" not in str(path):
            assert _leaks(path.read_bytes(), secrets) == [], path

    leaked = [(what, _leaks(text, secrets)) for what, text in outputs if _leaks(text, secrets)]
    assert leaked == []
    # every verb ended as expected, having got as far as the DSN: "leaks nothing" is not a crash
    assert wrong == [], "\n\n".join(
        f"{how}: cdc {verb}: exit {code}\n{text}" for how, verb, code, text in wrong
    )
    # the pipeline (and tail's run), the env pass (and its remove), the failing DSNs
    assert len(outputs) == len(VERBS) + 1 + len(CONNECTING) + 1 + len(jobs)
