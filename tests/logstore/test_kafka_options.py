"""The ``[kafka]`` settings (:class:`KafkaOptions`) and which produce errors count as transient: pure
logic, no broker. That TLS really works is shown against Tansu behind stunnel (test_kafka_tls.py)."""

from __future__ import annotations

from pathlib import Path

import kafka.errors as kerr
import pytest

from cdc.config import Settings
from cdc.errors import ConfigError
from cdc.logstore.kafka.options import KafkaOptions
from cdc.logstore.kafka.producer import is_transient

PASSWORD = "s3cr3t-Pa55word"


def settings(kafka: object) -> Settings:
    return Settings(state_dir=Path("/nonexistent"), extra={"kafka": kafka})


def test_defaults_are_plaintext_without_authentication() -> None:
    opts = KafkaOptions.from_settings(settings({}))
    assert opts == KafkaOptions()
    assert opts.client_config() == {"security_protocol": "PLAINTEXT", "request_timeout_ms": 10_000}
    assert opts.retry_max_s == 60.0


def test_sasl_scram_over_tls_reaches_the_client_config() -> None:
    opts = KafkaOptions.from_settings(
        settings(
            {
                "security_protocol": "SASL_SSL",
                "ssl_cafile": "/etc/cdc/ca.pem",
                "ssl_check_hostname": False,
                "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_username": "cdc",
                "sasl_password": PASSWORD,
                "request_timeout_ms": 30_000,
                "retry_max_s": 300,
            }
        )
    )
    assert opts.client_config() == {
        "security_protocol": "SASL_SSL",
        "request_timeout_ms": 30_000,
        "ssl_cafile": "/etc/cdc/ca.pem",
        "ssl_certfile": None,
        "ssl_keyfile": None,
        "ssl_check_hostname": False,
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "cdc",
        "sasl_plain_password": PASSWORD,
    }
    assert opts.retry_max_s == 300
    assert PASSWORD not in repr(opts) and PASSWORD not in str(opts)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_every_sasl_mechanism_is_accepted(mechanism: str) -> None:
    raw = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": mechanism}
    opts = KafkaOptions.from_mapping({**raw, "sasl_username": "u", "sasl_password": PASSWORD})
    assert opts.client_config()["sasl_mechanism"] == mechanism


def test_kafka_log_store_passes_the_settings_to_every_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's clients (admin, consumer, producer) are built from one config that carries the
    security settings (checked without a broker: the store is not opened)."""
    from cdc.logstore.kafka import store as kafka_store

    opts = KafkaOptions.from_mapping(
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "PLAIN",
            "sasl_username": "u",
            "sasl_password": PASSWORD,
        }
    )
    seen: dict[str, object] = {}

    class Admin:
        def __init__(self, **config: object) -> None:
            seen.update(config)

    monkeypatch.setattr(kafka_store, "KafkaAdminClient", Admin)
    store = kafka_store.KafkaLogStore("broker:9093", options=opts)
    assert seen["security_protocol"] == "SASL_SSL"
    assert seen["sasl_mechanism"] == "PLAIN"
    assert seen["sasl_plain_password"] == PASSWORD
    assert store._common == seen
    assert PASSWORD not in repr(store.options)


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"security_protocl": "SSL"}, "security_protocl"),  # unknown key
        ({"security_protocol": "TLS"}, "security_protocol"),  # not one of the four
        ({"request_timeout_ms": "10s"}, "request_timeout_ms"),  # wrong type
        ({"retry_max_s": -1}, "retry_max_s"),
        ({"ssl_check_hostname": "no"}, "ssl_check_hostname"),
        ({"sasl_mechanism": "GSSAPI"}, "sasl_mechanism"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"}, "sasl_password"),  # incomplete
        ({"sasl_username": "u", "sasl_password": PASSWORD}, "SASL_SSL"),  # SASL without SASL_*
        ({"ssl_cafile": "/ca.pem"}, "SSL"),  # TLS files without TLS
        ({"sasl_password": 12345}, "sasl_password"),
    ],
)
def test_wrong_settings_are_a_config_error_that_names_the_key(raw: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        KafkaOptions.from_settings(settings(raw))
    assert named in str(err.value)
    assert err.value.fix and "security_protocol" in err.value.fix
    assert err.value.exit_code == 2
    text = f"{err.value} {err.value.fix} {err.value.to_dict()}"
    assert PASSWORD not in text and "12345" not in text


def test_a_section_that_is_not_a_table() -> None:
    with pytest.raises(ConfigError, match=r"\[kafka\]"):
        KafkaOptions.from_settings(settings("SSL"))


@pytest.mark.parametrize(
    "error",
    [
        kerr.KafkaConnectionError,
        kerr.KafkaTimeoutError,
        kerr.RequestTimedOutError,
        kerr.NotLeaderForPartitionError,
        kerr.LeaderNotAvailableError,
        kerr.NotEnoughReplicasError,
        kerr.NotEnoughReplicasAfterAppendError,
        kerr.NodeNotReadyError,
        kerr.NetworkExceptionError,
    ],
)
def test_transient_errors(error: type[Exception]) -> None:
    assert is_transient(error)
    assert is_transient(error())


@pytest.mark.parametrize(
    "error",
    [
        kerr.UnknownTopicOrPartitionError,  # retriable for Kafka; here: the topic was deleted
        kerr.OutOfOrderSequenceNumberError,
        kerr.DuplicateSequenceNumberError,
        kerr.MessageSizeTooLargeError,
        kerr.TopicAuthorizationFailedError,
        kerr.SaslAuthenticationFailedError,
        ValueError,
    ],
)
def test_permanent_errors(error: type[Exception]) -> None:
    assert not is_transient(error)


def test_the_file_and_the_store_share_one_model() -> None:
    """``cdc.toml``'s ``[kafka]`` section and the store's options are one model: a key's default is
    written once (they once disagreed: 30 s and 120 s in the file's model, 10 s and 60 s in effect)."""
    from cdc.config import KafkaConfig, load_settings

    assert issubclass(KafkaOptions, KafkaConfig)
    assert KafkaOptions.model_fields.keys() == KafkaConfig.model_fields.keys()
    loaded = load_settings(environ={"CDC_STATE": "/nonexistent"}, cwd=Path("/nonexistent"))
    assert KafkaOptions.from_settings(loaded) == KafkaOptions()
    assert KafkaOptions().request_timeout_ms == KafkaConfig().request_timeout_ms == 10_000
