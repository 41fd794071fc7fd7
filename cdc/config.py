"""Configuration: one frozen object, built once at the entry point.

Precedence: flags, then environment (``CDC_SOURCE``, ``CDC_STATE``, ``CDC_LOG``, ``CDC_TOPIC_PREFIX``,
``CDC_SLOT``), then ``cdc.toml`` (in the working directory, or the file named by ``CDC_CONFIG``).
Only :func:`load_settings` reads the environment; everything else receives a :class:`Settings`.
The source DSN is a secret: it is held as ``SecretStr`` and only :func:`redact_dsn` output is printed.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from cdc.errors import ConfigError

DEFAULT_STATE = ".cdc"
DEFAULT_PREFIX = "cdc"
DEFAULT_SLOT = "cdc_slot"
DEFAULT_PARTITIONS = 4


@dataclass(frozen=True)
class Settings:
    """Everything a command needs to find the source, the state and the log store."""

    source: SecretStr | None = None
    state_dir: Path = Path(DEFAULT_STATE)
    log_url: str | None = None  # None: the embedded log store under state_dir/log
    topic_prefix: str = DEFAULT_PREFIX
    slot_name: str = DEFAULT_SLOT
    partitions: int = DEFAULT_PARTITIONS
    extra: Mapping[str, Any] = field(default_factory=dict)

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
    def source_display(self) -> str:
        return redact_dsn(self.source.get_secret_value()) if self.source else "(not set)"

    def with_overrides(self, **changes: Any) -> Settings:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


_URI_PASSWORD = re.compile(r"(://[^:/@]*:)([^@]*)(@)")
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact_dsn(dsn: str) -> str:
    """The DSN with its password replaced by ``***`` (URI and key=value forms)."""
    dsn = _URI_PASSWORD.sub(r"\1***\3", dsn)
    return _KV_PASSWORD.sub(r"\1***", dsn)


def load_settings(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Settings:
    """Build the settings from flags, the environment and cdc.toml, in that order of precedence."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    environ = environ or {}
    cwd = cwd or Path.cwd()
    toml_path = Path(environ["CDC_CONFIG"]) if "CDC_CONFIG" in environ else cwd / "cdc.toml"
    file_values: dict[str, Any] = {}
    if toml_path.exists():
        try:
            file_values = tomllib.loads(toml_path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(
                f"{toml_path} is not valid TOML: {exc}", fix=f"correct the syntax of {toml_path}"
            ) from exc
    elif "CDC_CONFIG" in environ:
        raise ConfigError(f"CDC_CONFIG names {toml_path}, which does not exist", fix="point it at a file")

    def pick(flag: str, env: str, key: str) -> Any:
        if flag in flags:
            return flags[flag]
        if env in environ and environ[env] != "":
            return environ[env]
        return file_values.get(key)

    source = pick("source", "CDC_SOURCE", "source")
    state = pick("state", "CDC_STATE", "state") or DEFAULT_STATE
    log_url = pick("log", "CDC_LOG", "log") or None
    prefix = pick("topic_prefix", "CDC_TOPIC_PREFIX", "topic_prefix") or DEFAULT_PREFIX
    slot = pick("slot", "CDC_SLOT", "slot") or DEFAULT_SLOT
    partitions_raw = pick("partitions", "CDC_PARTITIONS", "partitions") or DEFAULT_PARTITIONS
    try:
        partitions = int(partitions_raw)
        if partitions < 1:
            raise ValueError
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"partitions must be a positive integer, got {partitions_raw!r}", fix="set CDC_PARTITIONS=4"
        ) from exc
    if log_url is not None and not str(log_url).startswith(("kafka://", "embedded")):
        raise ConfigError(
            f"CDC_LOG={log_url!r} is not a log store this service knows",
            fix="leave CDC_LOG unset for the embedded store, or set it to kafka://HOST:PORT",
        )
    if log_url is not None and str(log_url).startswith("embedded"):
        log_url = None
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", str(slot)):
        raise ConfigError(
            f"slot name {slot!r} is not a valid replication slot name",
            fix="use lower-case letters, digits and underscores (at most 63 characters)",
        )
    state_dir = Path(state)
    if not state_dir.is_absolute():
        state_dir = cwd / state_dir
    extra = {
        k: v
        for k, v in file_values.items()
        if k not in {"source", "state", "log", "topic_prefix", "slot", "partitions"}
    }
    return Settings(
        source=SecretStr(str(source)) if source else None,
        state_dir=state_dir,
        log_url=str(log_url) if log_url else None,
        topic_prefix=str(prefix),
        slot_name=str(slot),
        partitions=partitions,
        extra=extra,
    )
