"""Configuration: validated frozen models, built once at the entry point.

Precedence: flags, then environment, then ``cdc.toml`` (in the working directory, or the file named
by ``CDC_CONFIG``). Only :func:`load_settings` reads the environment; everything else receives a
:class:`Settings`. The sections and keys of ``cdc.toml`` are the models below (:class:`CdcFile` and
its sections); an unknown key anywhere, or a value of the wrong type (``buckets = "16"``), is a
:class:`~cdc.errors.ConfigError` naming the key and what is allowed, never a traceback. Values in
the file are taken as TOML types, with no coercion (a quoted number is a string). Environment
variables: ``CDC_SOURCE``, ``CDC_STATE``, ``CDC_LOG``, ``CDC_TOPIC_PREFIX``, ``CDC_SLOT``,
``CDC_DECODER``, ``CDC_PUBLICATION``, ``CDC_PARTITIONS``, ``CDC_CONFIG``, ``CDC_KAFKA_SASL_PASSWORD``, ``CDC_SERVE_TOKEN`` (and the
process knobs in :data:`OTHER_ENV`); another ``CDC_*`` variable is refused as a likely typo.

Secrets (the source DSN, the Kafka SASL password, the serve token) are held as ``SecretStr``; only
:func:`redact_dsn` / :func:`redact_text` output of a DSN is ever printed. ``Settings.extra`` keeps
the validated sections and reader options as plain mappings (only the keys that were set; secrets
stay ``SecretStr``) for the ``from_settings`` readers of each area. Reference: ``docs/config.md``.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from cdc.errors import ConfigError, DsnError
from cdc.paths import DEFAULT_STATE, KAFKA_SCHEME

DEFAULT_PREFIX = "cdc"
DEFAULT_SLOT = "cdc_slot"
DEFAULT_PARTITIONS = 4
#: the output plugin the reader decodes (``decoder`` in cdc.toml, ``CDC_DECODER``): see
#: docs/decoders.md for how to choose; chosen when the slot is created and recorded in the registry
#: (cdc.codec.plugins holds each one's facts, one object per plugin; config, below the codec in
#: the layers, knows only the names it accepts)
DecoderName = Literal["wal2json", "pgoutput"]
DECODERS: tuple[str, ...] = get_args(DecoderName)
DEFAULT_DECODER: DecoderName = "wal2json"
GIB = 1 << 30

#: environment variables the service reads (at the entry point)
ENV_KEYS = (
    "CDC_SOURCE",
    "CDC_STATE",
    "CDC_LOG",
    "CDC_TOPIC_PREFIX",
    "CDC_SLOT",
    "CDC_DECODER",
    "CDC_PUBLICATION",
    "CDC_PARTITIONS",
    "CDC_CONFIG",
    "CDC_KAFKA_SASL_PASSWORD",
    "CDC_SERVE_TOKEN",
)
#: other ``CDC_*`` variables that belong to parts of the system outside this model (fault
#: injection, the Spark master, the compose file's password); ``CDC_TEST_*`` are test hooks
OTHER_ENV = (
    "CDC_FAULTS",
    "CDC_SPARK_MASTER",
    "CDC_PASSWORD",
    "CDC_NATIVE",
)  # CDC_NATIVE=0: cdc.codec.fastpath


class _Section(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


#: seconds between the apply's micro-batches when it runs continuously (``cdc apply --trigger-interval``)
TRIGGER_INTERVAL_S = 1.0

#: how long a delete's tombstone is kept, in the warehouse and in the search index alike
TOMBSTONE_RETENTION_HOURS = 7 * 24


class WarehouseConfig(_Section):
    """``[warehouse]`` (see ``sinks.warehouse.WarehouseOptions``)."""

    buckets: int = Field(default=16, ge=1)
    clustering: Literal["auto", "range", "hash"] = "auto"
    range_width: int = Field(default=65_536, ge=1)
    tombstone_retention_hours: float = Field(default=TOMBSTONE_RETENTION_HOURS, ge=0)
    maintain_every: int = Field(default=100, ge=0)
    #: the full vacuum (files no commit references, after ``vacuum_retention_hours``) as often as
    #: ``maintain_every``'s: each lists the whole table and loads every tombstone of the retention,
    #: and the reclaim after every batch takes the superseded files (docs/warehouse.md, Disk)
    vacuum_every: int = Field(default=100, ge=0)
    vacuum_retention_hours: int = Field(default=1, ge=0)
    vacuum_garbage_ratio: float = Field(default=1.0, ge=0)
    vacuum_min_retention_s: float = Field(default=300.0, ge=0)
    #: the longest a cdc reader's lease on a Delta table lasts (sinks.warehouse.leases)
    lease_max_age_s: float = Field(default=3600.0, gt=0)
    target_file_size: int | None = Field(default=8 << 20, ge=1)
    #: the number of shards of a new table, one Spark task each (unset: the log store's
    #: ``partitions``: WarehouseOptions.from_settings)
    shards: int = Field(default=1, ge=1)
    #: after every batch, its tables' partitions are compacted in size tiers, the most files to
    #: merge first, for up to this many seconds in all (0: only maintain compacts)
    compact_budget_s: float = Field(default=0.25, ge=0)
    #: a level of this many files is merged, and the levels' sizes are ``target_file_size`` over
    #: its powers (sinks/warehouse/compact.py)
    compact_min_files: int = Field(default=8, ge=2)
    #: the maintenance after a batch (reclaim, vacuum, the closed history rows' compaction) runs on a
    #: thread of its own while the next batch's tasks run; false: in line, after each commit
    maintain_in_background: bool = True


class SearchConfig(_Section):
    """``[search]`` (see ``sinks.search.SearchOptions``)."""

    tombstone_retention_hours: float = Field(default=TOMBSTONE_RETENTION_HOURS, ge=0)
    heap_size: int = Field(default=64_000_000, ge=1)
    threads: int = Field(default=1, ge=1)


class KafkaConfig(_Section):
    """``[kafka]``: how the Kafka log store connects, authenticates and retries (defaults: plaintext,
    no authentication, 10 s request timeout, transient errors retried for up to 60 s). The store
    reads it as :class:`cdc.logstore.kafka.options.KafkaOptions`, which also needs the SASL password
    (from the file or ``CDC_KAFKA_SASL_PASSWORD``, merged after the file is read)."""

    #: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL (SASL over TLS)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    #: PEM file of the CA certificates that sign the brokers' certificates (default: the system's)
    ssl_cafile: str | None = None
    #: PEM client certificate and key, for brokers that require TLS client authentication
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    #: check that the broker's certificate names the host connected to
    ssl_check_hostname: bool = True
    #: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (needed with SASL_PLAINTEXT and SASL_SSL)
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None  # also CDC_KAFKA_SASL_PASSWORD
    #: how long one request (produce, fetch, metadata) may take before it counts as failed
    request_timeout_ms: int = Field(default=10_000, ge=1)
    #: how long an append keeps retrying transient errors (leader change, timeout, dropped
    #: connection) before it fails; 0 fails at the first error
    retry_max_s: float = Field(default=60.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> KafkaConfig:
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and not (self.sasl_mechanism and self.sasl_username):
            raise ValueError(
                f"security_protocol = {self.security_protocol!r} needs sasl_mechanism, sasl_username and "
                "sasl_password (or the environment variable CDC_KAFKA_SASL_PASSWORD)"
            )
        if not sasl and (self.sasl_mechanism or self.sasl_username or self.sasl_password):
            raise ValueError(
                "sasl_* settings are set but security_protocol is "
                f"{self.security_protocol!r}: use SASL_SSL (or SASL_PLAINTEXT) to authenticate"
            )
        if not self.security_protocol.endswith("SSL") and (
            self.ssl_cafile or self.ssl_certfile or self.ssl_keyfile
        ):
            raise ValueError(
                f"ssl_* files are set but security_protocol is {self.security_protocol!r}: "
                "use SSL (or SASL_SSL) to connect with TLS"
            )
        return self


class StatusConfig(_Section):
    """``[status]``: the thresholds of ``cdc status`` (:class:`cdc.cli.status.options.StatusOptions`)."""

    window_s: float = Field(default=300.0, gt=0)
    lag_warn_s: float = Field(default=60.0, gt=0)
    lag_critical_s: float = Field(default=600.0, gt=0)
    retained_wal_warn_bytes: int = Field(default=GIB, gt=0)
    retained_wal_critical_bytes: int = Field(default=8 * GIB, gt=0)
    slot_policy: Literal["keep", "drop"] = "keep"
    slot_drop_at_bytes: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> StatusConfig:
        if self.slot_policy == "drop" and self.slot_drop_at_bytes is None:
            raise ValueError(
                'slot_policy = "drop" needs slot_drop_at_bytes (retained WAL bytes at which the slot is '
                'dropped), or slot_policy = "keep"'
            )
        if self.retained_wal_warn_bytes > self.retained_wal_critical_bytes:
            raise ValueError(
                "retained_wal_warn_bytes is above retained_wal_critical_bytes: make the warning the lower"
            )
        if self.lag_warn_s > self.lag_critical_s:
            raise ValueError("lag_warn_s is above lag_critical_s: make the warning threshold the lower one")
        return self


class ServeConfig(_Section):
    """``[serve]``: the dashboard and ``/metrics`` server (the token: ``--token`` or CDC_SERVE_TOKEN;
    :class:`cdc.cli.serve.server.ServeOptions`)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8787, ge=0, le=65535)  # 0: a free port, chosen when the server starts
    sample_interval_s: float = Field(default=5.0, gt=0)
    history_s: float = Field(default=3600.0, gt=0)


class SnapshotConfig(_Section):
    """``[snapshot]``: chunked snapshots of tables registered later."""

    chunk_size: int = Field(default=32768, ge=1)
    parallel_chunks: int = Field(default=1, ge=1)
    watermark_table: str = "public.cdc_watermark"

    @field_validator("watermark_table")
    @classmethod
    def _a_table_name(cls, value: str) -> str:
        from cdc.names import parse_table_name  # raises with a fix when malformed

        parse_table_name(value)
        return value


class ReaderConfig(_Section):
    """The reader's keys, at the top level of ``cdc.toml`` (:class:`cdc.reader.ReaderOptions`)."""

    batch_max_events: int = Field(default=5000, ge=1)
    batch_max_ms: int = Field(default=100, ge=1)
    #: a batch the stream has drained is still held this long from its first record (never past
    #: ``batch_max_ms``) for the transactions that follow: a slow stream is appended (one durable
    #: commit per topic) and confirmed every ``batch_linger_ms``, not after each transaction
    batch_linger_ms: int = Field(default=20, ge=0)
    heartbeat_interval_s: float = Field(default=10.0, ge=0)  # 0: no heartbeat messages
    max_attempts: int = Field(default=10, ge=1)
    backoff_initial_s: float = Field(default=0.5, gt=0)
    backoff_max_s: float = Field(default=30.0, gt=0)
    snapshot_workers: int = Field(default=2, ge=1)
    poll_s: float = Field(default=1.0, gt=0)
    #: time spent retrying transient source errors before giving up
    retry_max_s: float = Field(default=300.0, gt=0)
    #: fill in the out-of-line values an UPDATE leaves unchanged, so every event is the whole row
    #: and a compacted topic a complete copy (cdc.logstore.images); false: list them in
    #: ``unavailable`` and keep no image store (the topics are then not complete copies)
    fill_unchanged_toast: bool = True


READER_KEYS = tuple(ReaderConfig.model_fields)
SECTIONS = ("warehouse", "search", "kafka", "status", "serve", "snapshot")


class CdcFile(ReaderConfig):
    """The whole of ``cdc.toml``: top-level keys, the reader options (:class:`ReaderConfig`), and the
    sections."""

    source: SecretStr | None = None
    state: str | None = None
    log: str | None = None
    topic_prefix: str | None = None
    slot: str | None = None
    #: the output plugin: one of DECODERS (docs/decoders.md)
    decoder: DecoderName | None = None
    #: pgoutput's publication, kept in step with the registered tables (default: the slot's name)
    publication: str | None = None
    partitions: int | None = Field(default=None, ge=1)
    #: keep the non-finite recorder's triggers on captured tables where wal2json < 2.6 would turn a
    #: float/numeric NaN or infinity into null (cdc.recorders.nonfinite); false: never install them
    #: (such values then reach the topics as null, and cdc run / cdc check say where)
    #: when the reader finds its slot gone (a failover to a server without it, a DBA's drop) or
    #: invalidated: "fail" (exit with the fix: `cdc snapshot --all`) or "resnapshot" (create a new
    #: slot and snapshot every table again in chunks while streaming; status says it happened)
    slot_lost: Literal["fail", "resnapshot"] = "fail"
    nonfinite_recorder: bool = True
    #: the recorder's WHEN clause: "row" (the default) the whole row as text (never blocks the DBA's
    #: DDL and covers a column added later at once; costs the row's text output per write, and on a
    #: table with stored generated columns there is no WHEN at all); "columns" tests each
    #: float/numeric column (cheap, but Postgres then refuses ALTER COLUMN ... TYPE / DROP COLUMN of
    #: one while the trigger is there, and a column added later is covered only once cdc run sees it)
    nonfinite_recorder_when: Literal["columns", "row"] = "row"
    warehouse: WarehouseConfig = Field(default_factory=WarehouseConfig)
    search: SearchConfig = Field(default_factory=SearchConfig)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    status: StatusConfig = Field(default_factory=StatusConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)


@dataclass(frozen=True)
class Settings:
    """Everything a command needs: where the source, the state and the log store are, and the
    validated ``cdc.toml`` (:attr:`config`)."""

    source: SecretStr | None = None
    state_dir: Path = Path(DEFAULT_STATE)
    log_url: str | None = None  # None: the embedded log store under state_dir/log
    topic_prefix: str = DEFAULT_PREFIX
    slot_name: str = DEFAULT_SLOT
    partitions: int = DEFAULT_PARTITIONS
    #: the output plugin a new slot is created with (an existing slot keeps the one the registry
    #: recorded at its creation)
    decoder: str = DEFAULT_DECODER
    #: pgoutput's publication (None: named after the slot)
    publication_name: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    config: CdcFile = field(default_factory=CdcFile)
    serve_token: SecretStr | None = None

    def require_source(self) -> str:
        """The source DSN, or a ConfigError that says how to give one."""
        if self.source is None or not self.source.get_secret_value():
            raise ConfigError(
                "no source database is configured",
                fix="set CDC_SOURCE to a libpq DSN or URI (e.g. postgresql://cdc@host:5432/app), "
                "or pass --source, or put source = '...' in cdc.toml",
            )
        return self.source.get_secret_value()

    @property
    def publication(self) -> str:
        """pgoutput's publication: ``publication`` in cdc.toml, else the slot's name."""
        return self.publication_name or self.slot_name


# --- secrets in text ---------------------------------------------------------------------------------
#: ``user:password@`` anywhere (a URI with any number of slashes after the scheme, or none, or a
#: malformed one such as ``postgres:/u:pw@h/db``): the password runs to the last ``@`` of the word
_USERINFO_PASSWORD = re.compile(r"((?:^|[\s=])(?:[A-Za-z][\w+.-]*:/*)?[^\s:/@=]*:)((?!/)\S*)(@)")
#: ``password=...`` (key=value form, a URI query parameter, ``sslpassword``); a quoted value that is
#: never closed runs to the end
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*(?:'|$)|[^\s&]+)", re.IGNORECASE)


def redact_dsn(dsn: str) -> str:
    """The DSN with its password replaced by ``***``: URI and key=value forms, and strings that
    are neither (a DSN that does not parse is still shown without its password)."""
    dsn = _USERINFO_PASSWORD.sub(r"\1***\3", dsn)
    return _KV_PASSWORD.sub(r"\1***", dsn)


def dsn_passwords(dsn: str) -> list[str]:
    """Every string of ``dsn`` that may be its password (for scrubbing other text)."""
    found = [m.group(2) for m in _USERINFO_PASSWORD.finditer(dsn)]
    for m in _KV_PASSWORD.finditer(dsn):
        value = m.group(2)
        found.append(value)
        if value.startswith("'"):
            found.append(value.strip("'").replace("\\'", "'").replace("\\\\", "\\"))
    try:
        password = parse_dsn(dsn).get("password")
        if password:
            found.append(password)
    except DsnError:  # a DSN that does not parse has no parsed password to add
        pass
    return sorted({p for p in found if p and p != "***"}, key=len, reverse=True)


def redact_text(text: str, dsn: str | None) -> str:
    """``text`` (an exception's message, a log line) with the DSN and its password hidden."""
    if dsn:
        text = text.replace(dsn, redact_dsn(dsn))
        for password in dsn_passwords(dsn):
            text = text.replace(password, "***")
    return redact_dsn(text)


def parse_dsn(dsn: str) -> dict[str, str]:
    """The DSN's parameters; :class:`~cdc.errors.DsnError` (without the password, and without
    psycopg's text, which quotes the whole DSN) if it does not parse."""
    from psycopg import Error as PsycopgError
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    except PsycopgError:
        params = None
    # libpq checks that a port is a number only when it connects; refuse it here, with the others
    if params is None or not all(p.strip().isdigit() or not p for p in params.get("port", "").split(",")):
        raise DsnError(
            f"the source DSN {redact_dsn(dsn)} does not parse",
            fix="set CDC_SOURCE / --source / source in cdc.toml to a libpq key=value string "
            "(host=H port=5432 dbname=D user=U) or a URI (postgresql://U@H:5432/D); "
            "keep the password in ~/.pgpass or PGPASSWORD rather than in the DSN",
            source=redact_dsn(dsn),
        ) from None
    return params


# --- loading -----------------------------------------------------------------------------------------
_TYPE_NAMES = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "model_type": "a table ([section] with key = value lines)",
    "dict_type": "a table ([section] with key = value lines)",
}


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def _allowed(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = CdcFile
    for part in loc[:-1]:
        ann = model.model_fields[str(part)].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
    return sorted(model.model_fields)


def _config_error(exc: ValidationError, where: str) -> ConfigError:
    problems: list[str] = []
    fixes: list[str] = []
    keys: list[str] = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not isinstance(p, int))
        name = (f"[{loc[0]}] " if len(loc) > 1 else "") + ".".join(str(p) for p in loc[-1:])
        keys.append(name or "(top level)")
        kind = err["type"]
        if kind == "extra_forbidden":
            problems.append(f"unknown key {name!r}")
            section = f"[{loc[0]}]" if len(loc) > 1 else "the top level"
            fixes.append(f"remove or correct {name!r}; {section} allows {', '.join(_allowed(loc))}")
        elif kind in _TYPE_NAMES or kind.endswith("_type"):
            got = err.get("input")
            secret = "password" in name or name == "source"
            shown = _toml_type(got) if secret else f"{got!r} ({_toml_type(got)})"
            problems.append(
                f"{name!r} must be {_TYPE_NAMES.get(kind, kind.removesuffix('_type'))}, got {shown}"
            )
            fixes.append(
                f"write {loc[-1]} = <{_TYPE_NAMES.get(kind, 'value')}>"
                + (" without quotes" if isinstance(got, str) else "")
            )
        elif kind == "literal_error":
            problems.append(f"{name!r} is {err.get('input')!r}: {err['msg'].lower()}")
            fixes.append(f"set {name} to one of the values listed")
        elif kind == "value_error":
            section = f"[{loc[0]}]" if loc else "the top level"
            problems.append(f"{section}: {str(err['msg']).removeprefix('Value error, ')}")
            fixes.append("complete the section as the message says")
        else:
            problems.append(f"{name!r}: {err['msg'].lower()} (got {err.get('input')!r})")
            fixes.append(f"correct {name}")
    return ConfigError(
        f"{where}: " + "; ".join(problems),
        fix="; ".join(dict.fromkeys(fixes)),
        keys=keys,
    )


S = TypeVar("S", bound=BaseModel)


def section_options(cls: type[S], settings: Settings, section: str | None, **defaults: Any) -> S:
    """A stage's options (``cls``: its section model here, or a subclass of it) from ``settings``:
    the keys ``cdc.toml`` set (:attr:`Settings.extra`, the section's table, or the top level for
    ``section`` None) over ``defaults`` over the model's own. The model is where each key's default
    and bounds are written; a value it refuses (from code building ``Settings`` by hand: the file's
    are validated at load) is a :class:`~cdc.errors.ConfigError` naming the key."""
    where = f"[{section}]" if section else "cdc.toml"
    raw = settings.extra.get(section, {}) if section else settings.extra
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} in cdc.toml must be a table", fix=f"write {where} then key = value lines")
    names = set(cls.model_fields)
    values = {**defaults, **({k: v for k, v in raw.items() if k in names} if section is None else raw)}
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise _config_error(exc, where) from None


def _check_environment(environ: Mapping[str, str]) -> None:
    """Refuse a ``CDC_*`` variable cdc does not read: a misspelt name would otherwise be ignored."""
    unknown_env = sorted(
        k
        for k in environ
        if k.startswith("CDC_") and k not in ENV_KEYS and k not in OTHER_ENV and not k.startswith("CDC_TEST_")
    )
    if unknown_env:
        raise ConfigError(
            f"unknown environment variable {', '.join(unknown_env)}",
            fix=f"unset it or correct its name; cdc reads {', '.join(ENV_KEYS)}",
            keys=unknown_env,
        )


def _read_config_file(environ: Mapping[str, str], cwd: Path) -> CdcFile:
    """cdc.toml (or the file ``CDC_CONFIG`` names), validated, with the Kafka password from the environment."""
    toml_path = Path(environ["CDC_CONFIG"]) if environ.get("CDC_CONFIG") else cwd / "cdc.toml"
    file_values: dict[str, Any] = {}
    if toml_path.is_file():
        try:
            file_values = tomllib.loads(toml_path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"{toml_path} is not valid TOML: {exc}", fix=f"correct the syntax of {toml_path}"
            ) from None
        except OSError as exc:
            raise ConfigError(f"cannot read {toml_path}: {exc.strerror}", fix="make it readable") from None
    elif environ.get("CDC_CONFIG"):
        raise ConfigError(f"CDC_CONFIG names {toml_path}, which does not exist", fix="point it at a file")
    try:
        config = CdcFile.model_validate(file_values)
    except ValidationError as exc:
        raise _config_error(exc, str(toml_path)) from None
    if environ.get("CDC_KAFKA_SASL_PASSWORD"):
        kafka = config.kafka.model_copy(
            update={"sasl_password": SecretStr(environ["CDC_KAFKA_SASL_PASSWORD"])}
        )
        config = config.model_copy(update={"kafka": kafka})
    return config


def _partitions(raw: Any) -> int:
    """The partition count as a positive integer (a flag, a variable's text or a TOML integer)."""
    try:
        partitions = int(raw)
        if partitions < 1 or isinstance(raw, bool):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(
            f"partitions must be a positive integer, got {raw!r}", fix="set CDC_PARTITIONS=4"
        ) from None
    return partitions


def _log_url(raw: Any) -> str | None:
    """The log store URL: None for the embedded store, else a ``kafka://`` URL."""
    if raw is not None and not str(raw).startswith((KAFKA_SCHEME, "embedded")):
        raise ConfigError(
            f"CDC_LOG={raw!r} is not a log store this service knows",
            fix=f"leave CDC_LOG unset for the embedded store, or set it to {KAFKA_SCHEME}HOST:PORT",
        )
    if raw is None or str(raw).startswith("embedded"):
        return None
    return str(raw)


def _check_names(slot: Any, prefix: Any) -> None:
    """The slot and topic prefix are names Postgres and the log store accept."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", str(slot)):
        raise ConfigError(
            f"slot name {slot!r} is not a valid replication slot name",
            fix="use lower-case letters, digits and underscores (at most 63 characters)",
        )
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}", str(prefix)):
        raise ConfigError(
            f"topic prefix {prefix!r} is not a valid topic name prefix",
            fix="use letters, digits, '.', '_' and '-' (not starting with '.'), at most 100 characters",
        )


def _extra(config: CdcFile) -> dict[str, Any]:
    """The reader keys and section keys the file sets explicitly (the rest keep their defaults)."""
    set_keys = config.model_fields_set
    extra: dict[str, Any] = {k: getattr(config, k) for k in READER_KEYS if k in set_keys}
    for section in SECTIONS:
        model = getattr(config, section)
        extra[section] = {k: getattr(model, k) for k in model.model_fields_set}
    return extra


def load_settings(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Settings:
    """Build the settings from flags, the environment and cdc.toml, in that order of precedence."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    environ = environ or {}
    cwd = cwd or Path.cwd()
    _check_environment(environ)
    config = _read_config_file(environ, cwd)

    def pick(flag: str, env: str, key: str) -> Any:
        if flag in flags:
            return flags[flag]
        if env in environ and environ[env] != "":
            return environ[env]
        value = getattr(config, key)
        return value.get_secret_value() if isinstance(value, SecretStr) else value

    source = pick("source", "CDC_SOURCE", "source")
    state = pick("state", "CDC_STATE", "state") or DEFAULT_STATE
    log_raw = pick("log", "CDC_LOG", "log") or None
    prefix = pick("topic_prefix", "CDC_TOPIC_PREFIX", "topic_prefix") or DEFAULT_PREFIX
    slot = pick("slot", "CDC_SLOT", "slot") or DEFAULT_SLOT
    partitions = _partitions(pick("partitions", "CDC_PARTITIONS", "partitions") or DEFAULT_PARTITIONS)
    decoder = str(pick("decoder", "CDC_DECODER", "decoder") or DEFAULT_DECODER)
    if decoder not in DECODERS:
        raise ConfigError(
            f"decoder {decoder!r} is not one this service reads",
            fix=f"set CDC_DECODER (or decoder in cdc.toml) to one of {', '.join(DECODERS)}",
        )
    publication = pick("publication", "CDC_PUBLICATION", "publication") or None
    if publication is not None and not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", str(publication)):
        raise ConfigError(
            f"publication name {publication!r} is not a valid name",
            fix="use lower-case letters, digits and underscores (at most 63 characters)",
        )
    log_url = _log_url(log_raw)
    _check_names(slot, prefix)
    if source:
        parse_dsn(str(source))  # a DSN that does not parse is a ConfigError here, before any verb runs
    state_dir = Path(state)
    if not state_dir.is_absolute():
        state_dir = cwd / state_dir
    serve_token = environ.get("CDC_SERVE_TOKEN") or None
    return Settings(
        source=SecretStr(str(source)) if source else None,
        state_dir=state_dir,
        log_url=log_url,
        topic_prefix=str(prefix),
        slot_name=str(slot),
        partitions=partitions,
        decoder=decoder,
        publication_name=str(publication) if publication else None,
        extra=_extra(config),
        config=config,
        serve_token=SecretStr(serve_token) if serve_token else None,
    )
