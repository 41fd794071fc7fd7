"""One error root for the whole service.

Every error says what is wrong (``str(err)``) and, where one exists, how to fix it (``err.fix``), and
carries the values involved as attributes. The CLI's single error boundary prints both and sets the
exit code; anything that is not a ``CdcError`` is a bug and crashes the process.
"""

from __future__ import annotations

from typing import Any


class CdcError(Exception):
    """Root of every error the service raises on purpose."""

    exit_code: int = 1

    def __init__(self, message: str, *, fix: str | None = None, **values: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.values = values
        for name, value in values.items():
            setattr(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": type(self).__name__,
            "message": self.message,
            "fix": self.fix,
            **{k: _jsonable(v) for k, v in self.values.items()},
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


class ConfigError(CdcError):
    """The configuration (flags, environment, cdc.toml) is missing or wrong."""

    exit_code = 2


# --- log store -------------------------------------------------------------------------------------
class LogStoreError(CdcError):
    """A log-store operation failed."""


class UnknownTopicError(LogStoreError):
    """The topic does not exist (``topic``)."""


class TopicExistsError(LogStoreError):
    """The topic exists with a different layout (``topic``, ``partitions``)."""


class OffsetOutOfRangeError(LogStoreError):
    """A read asked for an offset outside [start, end] of a partition (``topic``, ``partition``,
    ``offset``, ``start``, ``end``)."""


class StoreCorruptError(LogStoreError):
    """A store file is corrupt or truncated (``path``)."""


class WriterLockedError(LogStoreError):
    """Another process holds the store's single-writer lock (``path``, ``holder``)."""


class BrokerUnavailableError(LogStoreError):
    """The Kafka broker is down or unreachable (``bootstrap``)."""


# --- source, registry, capture ---------------------------------------------------------------------
class SourceError(CdcError):
    """The Postgres source refused or failed an operation."""


class SourceUnavailableError(SourceError):
    """Transient: the source cannot be reached or dropped the connection (refused, unreachable,
    timed out, restarting, too many connections). Retried with backoff for ``retry_max_s``; raised
    when that time is spent (``source``, ``attempts``)."""


class SourcePermanentError(SourceError):
    """Permanent: the source answered and refused; retrying cannot help. Fails fast (exit 2)."""

    exit_code = 2


class SourceAuthError(SourcePermanentError):
    """Authentication failed (SQLSTATE 28P01 invalid password, 28000; a role that does not exist
    or a client that pg_hba.conf rejects) (``source``, ``user``)."""


class SourcePrivilegeError(SourcePermanentError):
    """The role lacks a privilege (SQLSTATE 42501) (``source``, ``sqlstate``)."""


class SourceMissingError(SourcePermanentError):
    """A database, schema or table does not exist (SQLSTATE 3D000, 3F000, 42P01) (``source``,
    ``sqlstate``)."""


class DsnError(ConfigError):
    """The source DSN does not parse as a libpq ``key=value`` string or a ``postgresql://`` URI
    (``source``: the DSN with its password hidden)."""


class RegistryError(CdcError):
    """A table registration was refused or the registry is inconsistent."""


class SlotLostError(SourceError):
    """The replication slot was dropped or invalidated; a re-snapshot is needed (``slot``)."""

    exit_code = 3


class DecodeError(CdcError):
    """A change from the replication stream could not be decoded (``lsn``, ``reason``)."""


# --- apply -----------------------------------------------------------------------------------------
class ApplyError(CdcError):
    """The apply job or a sink failed."""


class LockedError(CdcError):
    """Another process holds this role's lock on the state directory (``role``, ``path``, ``pid``,
    ``host``). Nothing was changed."""

    exit_code = 2
