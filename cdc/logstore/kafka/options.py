"""The ``[kafka]`` section of ``cdc.toml``: how the Kafka log store connects, authenticates and retries.

:class:`KafkaOptions` is read once at the entry point (:meth:`KafkaOptions.from_settings`, from
``settings.extra["kafka"]``); unknown keys and wrong types are a :class:`~cdc.errors.ConfigError`
naming the key, never echoing a value. The SASL password is a ``SecretStr``: it is shown nowhere
(not in ``repr``, not in errors) and only :meth:`KafkaOptions.client_config` reveals it, to the
client library. The environment variable ``CDC_KAFKA_SASL_PASSWORD`` is read by the entry point's
configuration loader into the same key. The settings and what each does: ``docs/logstore.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pydantic
from pydantic import model_validator

from cdc.config import KafkaConfig
from cdc.errors import ConfigError

if TYPE_CHECKING:
    from cdc.config import Settings

__all__ = ["KafkaOptions"]


class KafkaOptions(KafkaConfig):
    """The Kafka log store's settings: the ``[kafka]`` model (:class:`cdc.config.KafkaConfig`, where
    each key's default and bounds are written), complete: a SASL protocol also has its password."""

    @model_validator(mode="after")
    def _password(self) -> KafkaOptions:
        if self.security_protocol.startswith("SASL_") and self.sasl_password is None:
            raise ValueError(
                f"security_protocol = {self.security_protocol!r} needs sasl_password "
                "(or the environment variable CDC_KAFKA_SASL_PASSWORD)"
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
