"""The ``[kafka]`` section of ``cdc.toml``: how the Kafka log store connects, authenticates and retries.

:class:`KafkaOptions` is read once at the entry point (:meth:`KafkaOptions.from_settings`, from
``settings.extra["kafka"]``); unknown keys and wrong types are a :class:`~cdc.errors.ConfigError`
naming the key, never echoing a value. The SASL password is a ``SecretStr``: it is shown nowhere
(not in ``repr``, not in errors) and only :meth:`KafkaOptions.client_config` reveals it, to the
client library. The environment variable ``CDC_KAFKA_SASL_PASSWORD`` is read by the entry point's
configuration loader into the same key. The settings and what each does: ``docs/logstore.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from cdc.errors import ConfigError

if TYPE_CHECKING:
    from cdc.config import Settings

__all__ = ["KafkaOptions"]

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class KafkaOptions(BaseModel):
    """Connection, security and retry settings of the Kafka log store (frozen; defaults: plaintext,
    no authentication, 10 s request timeout, transient errors retried for up to 60 s)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    #: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL (SASL over TLS)
    security_protocol: SecurityProtocol = "PLAINTEXT"
    #: PEM file of the CA certificates that sign the brokers' certificates (default: the system's)
    ssl_cafile: str | None = None
    #: PEM client certificate and key, for brokers that require TLS client authentication
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    #: check that the broker's certificate names the host connected to
    ssl_check_hostname: bool = True
    #: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (needed with SASL_PLAINTEXT and SASL_SSL)
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    #: how long one request (produce, fetch, metadata) may take before it counts as failed
    request_timeout_ms: int = Field(default=10_000, ge=1)
    #: how long an append keeps retrying transient errors (leader change, timeout, dropped
    #: connection) before it fails; 0 fails at the first error
    retry_max_s: float = Field(default=60.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> KafkaOptions:
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and (self.sasl_mechanism is None or not self.sasl_username or self.sasl_password is None):
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

    @classmethod
    def from_settings(cls, settings: Settings) -> KafkaOptions:
        """The ``[kafka]`` section (empty: the defaults). ConfigError names each wrong key."""
        raw = settings.extra.get("kafka", {}) or {}
        if not isinstance(raw, dict):
            raise ConfigError(
                "[kafka] in cdc.toml must be a table", fix="write [kafka] then key = value lines"
            )
        return cls.from_mapping(raw)

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> KafkaOptions:
        known = sorted(cls.model_fields)
        try:
            return cls.model_validate(raw)
        except pydantic.ValidationError as exc:
            problems = []
            for err in exc.errors(include_input=False, include_url=False):
                where = ".".join(str(part) for part in err["loc"]) or "[kafka]"
                problems.append(f"{where}: {err['msg']}")
            raise ConfigError(
                f"invalid [kafka] settings: {'; '.join(problems)}",
                fix=f"use only these [kafka] keys with the right types: {', '.join(known)} (see docs/logstore.md)",
                keys=sorted(str(e["loc"][0]) for e in exc.errors(include_input=False) if e["loc"]),
            ) from None

    def client_config(self) -> dict[str, Any]:
        """kafka-python client settings (the password revealed here only, for the client itself)."""
        config: dict[str, Any] = {
            "security_protocol": self.security_protocol,
            "request_timeout_ms": self.request_timeout_ms,
        }
        if self.security_protocol.endswith("SSL"):
            config.update(
                ssl_cafile=self.ssl_cafile,
                ssl_certfile=self.ssl_certfile,
                ssl_keyfile=self.ssl_keyfile,
                ssl_check_hostname=self.ssl_check_hostname,
            )
        if self.sasl_mechanism is not None:
            config.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=None
                if self.sasl_password is None
                else self.sasl_password.get_secret_value(),
            )
        return config
