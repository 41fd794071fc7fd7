"""A TCP proxy between Kafka clients and a broker, for fault injection and for seeing the requests.

The broker must advertise the proxy's address (``TansuBroker.start(advertised_port=proxy.port)``),
or the clients would connect to the broker directly after the bootstrap metadata.

The proxy reads the length-prefixed Kafka frames in both directions, records the API key of every
request (``api_keys``) and lets a test decide, per request, to pass it on, to drop the connection
before the broker sees it (the request is lost) or to pass it on and drop the connection instead of
returning the broker's answer (the broker applied it, the client never learns), or, for a
ProduceRequest, to answer it itself with NOT_LEADER_OR_FOLLOWER for every partition without passing
it on (a leader change: the broker never sees it). ``refuse`` makes it close every new connection at
once (a broker that is unreachable for a while).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from typing import Literal

from kafka.protocol.producer import ProduceRequest, ProduceResponse

Action = Literal["pass", "drop_before", "drop_after", "not_leader"]

NOT_LEADER_OR_FOLLOWER = 6

PRODUCE = 0
JOIN_GROUP = 11
HEARTBEAT = 12
SYNC_GROUP = 14


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(sock: socket.socket) -> bytes | None:
    head = _read_exact(sock, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">i", head)
    body = _read_exact(sock, size)
    return None if body is None else head + body


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: KafkaProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.sent = 0  # requests forwarded on this connection
        self.answered = 0  # responses seen on this connection
        self.swallow: set[int] = set()  # indexes of requests whose response is dropped
        #: in request order, what answers each request not answered yet: None (the broker) or the
        #: bytes of an answer the proxy made; answers go back in request order, as Kafka's do
        self.slots: list[bytes | None] = []
        self.lock = threading.Lock()

    def close(self) -> None:
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def requests(self) -> None:
        while True:
            frame = _read_frame(self.client)
            if frame is None:
                break
            (api_key,) = struct.unpack(">h", frame[4:6])
            action = self.proxy.request_seen(api_key)
            if action == "drop_before":
                break
            if action == "not_leader" and api_key == PRODUCE:
                answer = _not_leader_answer(frame)
                with self.lock:
                    self.slots.append(answer)
                    ok = self._flush_made_answers()
                self.proxy.made_answers += 1
                if not ok:
                    break
                continue
            with self.lock:
                self.slots.append(None)
                if action == "drop_after":
                    self.swallow.add(self.sent)
                self.sent += 1
            try:
                self.upstream.sendall(frame)
            except OSError:
                break
        self.close()

    def responses(self) -> None:
        while True:
            frame = _read_frame(self.upstream)
            if frame is None:
                break
            with self.lock:
                index = self.answered
                self.answered += 1
                drop = index in self.swallow
                if drop:
                    self.proxy.responses_dropped += 1
                    break
                self.slots.pop(0)  # the broker's slot (made answers before it were sent already)
                try:
                    self.client.sendall(frame)
                except OSError:
                    break
                if not self._flush_made_answers():
                    break
        self.close()

    def _flush_made_answers(self) -> bool:
        """Send the made answers now at the head of the queue (call under ``lock``)."""
        while self.slots and self.slots[0] is not None:
            answer = self.slots.pop(0)
            assert answer is not None
            try:
                self.client.sendall(answer)
            except OSError:
                return False
        return True


def _not_leader_answer(frame: bytes) -> bytes:
    """A ProduceResponse to ``frame`` (a whole ProduceRequest frame) with NOT_LEADER_OR_FOLLOWER for
    every partition it carries, framed, with the request's correlation id and version."""
    (version,) = struct.unpack(">h", frame[6:8])
    request = ProduceRequest.decode(frame[4:], version=version, header=True)
    topic_cls = ProduceResponse.TopicProduceResponse
    partition_cls = topic_cls.PartitionProduceResponse
    response = ProduceResponse[version](
        responses=[
            topic_cls(
                name=t.name,
                partition_responses=[
                    partition_cls(index=p.index, error_code=NOT_LEADER_OR_FOLLOWER, base_offset=-1)
                    for p in t.partition_data
                ],
            )
            for t in request.topic_data
        ],
        throttle_time_ms=0,
    )
    response.with_header(correlation_id=request.header.correlation_id)
    return bytes(response.encode(header=True, framed=True))


class KafkaProxy:
    """Listens on ``port`` (127.0.0.1) and forwards to ``upstream_port`` once it is set."""

    def __init__(self) -> None:
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port: int = self._server.getsockname()[1]
        self.upstream_port: int | None = None
        self.refuse = False
        self.api_keys: list[int] = []
        self.responses_dropped = 0
        self.made_answers = 0
        self.connections = 0
        #: called with (api key, how many requests of that key were seen before); returns the action
        self.decide: Callable[[int, int], Action] = lambda api_key, seen: "pass"
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"kafka-proxy:{self.port}", daemon=True).start()

    def request_seen(self, api_key: int) -> Action:
        with self._lock:
            seen = self.api_keys.count(api_key)
            self.api_keys.append(api_key)
        return self.decide(api_key, seen)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.refuse or self.upstream_port is None:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(self, client, upstream)
            with self._lock:
                self._links.append(link)
                self.connections += 1
            threading.Thread(target=link.requests, daemon=True).start()
            threading.Thread(target=link.responses, daemon=True).start()

    def drop_all(self) -> None:
        """Close every open connection (as a broker restart or a network cut would)."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.close()
        self.drop_all()
