"""No verb ever prints, logs or stores the source password (issue 9, Secrets).

Every verb runs as a real process with a DSN that carries a password -- valid DSNs in key=value and
URI form (the whole pipeline: register, capture, apply, query, verify), a wrong password, an
unreachable host, and DSNs that do not parse -- given by flag, environment and cdc.toml. Then all
output and every file under the state directory are searched for the password.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from cdc.devcluster import PgCluster, free_port
from tests.capture.test_reader_support import CDC

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

PASSWORD = f"S3cr3t-{uuid.uuid4().hex[:12]}"
#: a password with URI-special characters, given percent-encoded in the URI form
ODD_PASSWORD = f"p@ss/w:rd {uuid.uuid4().hex[:6]}"

VERBS: list[list[str]] = [
    ["check"],
    ["check", "--json"],
    ["tables", "add", "public.items", "--search", "name"],
    ["tables", "list"],
    ["tables", "list", "--json"],
    ["run", "--once"],
    ["run", "--once", "--json"],
    ["apply", "--once"],
    ["sql", "SELECT * FROM public.items ORDER BY id"],
    ["sql", "SELECT count(*) AS n FROM public.items", "--json"],
    ["search", "public.items", "widget"],
    ["verify"],
    ["verify", "--json"],
    ["topic", "list"],
    ["topic", "dump", "cdc.public.items", "--json"],
    ["snapshot", "--all"],
    ["snapshot", "public.items", "--json"],
    ["tables", "remove", "public.items"],
]


def _leaks(text: str | bytes, secrets: list[str]) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [s for s in secrets if s.encode() in data]


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CDC, *args], env=env, capture_output=True, text=True, timeout=600, cwd=cwd)


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


def test_no_verb_shows_or_stores_the_password(pg: PgCluster, pg_db: str, role: str, tmp_path: Path) -> None:
    secrets = [PASSWORD, ODD_PASSWORD, quote(ODD_PASSWORD, safe="")]
    kv = pg.dsn(pg_db, role, PASSWORD)
    uri = f"postgresql://{role}_odd:{quote(ODD_PASSWORD, safe='')}@127.0.0.1:{pg.port}/{pg_db}"
    outputs: list[tuple[str, str]] = []

    # 1. the whole pipeline with a good DSN, by flag (key=value) and by environment (URI)
    for how, dsn in (("flag", kv), ("env", uri)):
        state = tmp_path / f"state-{how}"
        env = {**_base_env(), "CDC_SLOT": f"sec_{uuid.uuid4().hex[:8]}"}
        pre = ["--state", str(state)]
        if how == "flag":
            pre += ["--source", dsn]
        else:
            env["CDC_SOURCE"] = dsn
        for verb in VERBS:
            res = _run([*pre, *verb], env, tmp_path)
            outputs.append((f"{how} {verb}", res.stdout + res.stderr))
            if (
                verb[0] in ("tables", "run", "apply", "verify")
                and verb[-1] != "--json"
                and verb[1:2] != ["remove"]
            ):
                assert res.returncode == 0, (verb, res.stderr[-2000:])
        for path in state.rglob("*"):
            if path.is_file():
                assert _leaks(path.read_bytes(), secrets) == [], path
        pg.execute(f"SELECT pg_drop_replication_slot('{env['CDC_SLOT']}')", pg_db)

    # 2. failing DSNs: a wrong password, an unreachable host, DSNs that do not parse -- every verb,
    #    by flag, environment and cdc.toml
    bad = [
        pg.dsn(pg_db, role, PASSWORD + "x"),
        f"postgresql://{role}:{PASSWORD}@127.0.0.1:{free_port()}/{pg_db}",
        f"postgres:/{role}:{PASSWORD}@127.0.0.1/{pg_db}",
        f"postgres:{role}:{PASSWORD}@localhost/db",
        f"host=127.0.0.1 password='{PASSWORD} dbname={pg_db}",
        f"host=127.0.0.1 password={PASSWORD} no_such_option=1",
        f"postgresql://{role}:{PASSWORD}@127.0.0.1:notaport/{pg_db}",
        f"{role}:{PASSWORD}@127.0.0.1",
    ]
    state = tmp_path / "state-bad"
    for i, dsn in enumerate(bad):
        for verb in (
            ["check"],
            ["check", "--json"],
            ["tables", "add", "public.items"],
            ["run", "--once"],
            ["verify"],
        ):
            where = ("flag", "env", "toml")[i % 3]
            env = _base_env()
            pre = ["--state", str(state)]
            cwd = tmp_path / f"cwd-{i}"
            cwd.mkdir(exist_ok=True)
            toml = "retry_max_s = 1\nbackoff_initial_s = 0.1\n"  # the unreachable host: retry briefly
            if where == "flag":
                pre += ["--source", dsn]
            elif where == "env":
                env["CDC_SOURCE"] = dsn
            else:
                toml = f"source = {dsn!r}\n" + toml
            (cwd / "cdc.toml").write_text(toml)
            env["CDC_CONFIG"] = str(cwd / "cdc.toml")
            res = _run([*pre, *verb], env, cwd)
            assert res.returncode != 0, (dsn, verb)
            outputs.append((f"bad {where} {verb}", res.stdout + res.stderr))
    for path in tmp_path.rglob("*"):
        if path.is_file() and "cwd-" not in str(path):
            assert _leaks(path.read_bytes(), secrets) == [], path

    leaked = [(what, _leaks(text, secrets)) for what, text in outputs if _leaks(text, secrets)]
    assert leaked == []
    assert len(outputs) >= 2 * len(VERBS) + 5 * len(bad)
