"""The Kafka log store over TLS: Tansu behind stunnel (a TLS terminator) with a CA and a server
certificate made for the test. Tansu has no SASL (see docs/logstore.md): the SASL settings are shown
to reach the client in test_kafka_options.py."""

from __future__ import annotations

import uuid

import pytest

from cdc.errors import BrokerUnavailableError
from cdc.logstore import Record, TopicConfig, partition_for
from cdc.logstore.kafka import KafkaLogStore
from cdc.logstore.kafka.options import KafkaOptions
from tests.plugins.tansu import Stunnel, TansuBroker, TlsFiles


def test_append_read_and_commit_over_tls(tls_tansu: tuple[TansuBroker, Stunnel, TlsFiles]) -> None:
    _, tunnel, tls = tls_tansu
    options = KafkaOptions(security_protocol="SSL", ssl_cafile=str(tls.ca_cert))
    topic = f"cdc.tls.t_{uuid.uuid4().hex[:8]}"
    records = [Record(f'{{"id": {i}}}'.encode(), b"v%d" % i) for i in range(500)]
    with KafkaLogStore(f"127.0.0.1:{tunnel.port}", writer=True, options=options) as store:
        store.create_topic(topic, TopicConfig(partitions=2))
        last = store.append(topic, records)
        expected = {p: [r.value for r in records if partition_for(r.key, 2) == p] for p in (0, 1)}
        assert last == {p: len(v) - 1 for p, v in expected.items()}
        store.commit("apply", topic, {0: 3})
    with KafkaLogStore(f"127.0.0.1:{tunnel.port}", options=options) as reader:
        for p in (0, 1):
            assert [r.value for r in reader.iter_partition(topic, p)] == expected[p]
        assert reader.committed("apply", topic) == {0: 3}
    # the TLS terminator really carried it (its log shows the accepted TLS connections)
    assert "accepted connection from 127.0.0.1" in tunnel.log.read_text(errors="replace")


@pytest.mark.timeout(300)  # an error, never a hang
@pytest.mark.parametrize("case", ["untrusted CA", "plaintext client"])
def test_a_broker_the_client_cannot_trust_or_speak_to_is_refused(
    tls_tansu: tuple[TansuBroker, Stunnel, TlsFiles], case: str
) -> None:
    _, tunnel, tls = tls_tansu
    if case == "untrusted CA":  # the certificate is not signed by the CA the client trusts
        options = KafkaOptions(security_protocol="SSL", ssl_cafile=str(tls.other_ca_cert))
    else:
        options = KafkaOptions()
    with pytest.raises(BrokerUnavailableError) as err:
        KafkaLogStore(
            f"127.0.0.1:{tunnel.port}", options=options, connect_timeout_ms=3_000, request_timeout_ms=3_000
        )
    assert f"127.0.0.1:{tunnel.port}" in str(err.value)
