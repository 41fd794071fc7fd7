"""``cdc serve``: Prometheus metrics, the status JSON and a live dashboard over HTTP.

Interface: :class:`Server` (``Server(settings, options, token=...).serve_forever()``), tuned by
:class:`ServeOptions` (``[serve]`` in ``cdc.toml``). Beside it: :mod:`~cdc.cli.serve.metrics` (the
Prometheus exposition of a status report), ``static/`` (the dashboard page and the vendored uPlot
chart library, MIT, from npm ``uplot`` 1.6.32: nothing is loaded from the internet).

Endpoints: ``/`` the dashboard; ``/status`` the report of :func:`cdc.cli.status.gather.collect` (the same JSON
as ``cdc status --json``, at most ``sample_interval_s`` old); ``/metrics`` Prometheus text format;
``/history`` the samples of the last ``history_s`` (for the chart); ``/static/...``;
``/wait?lsn=LSN[&table=T ...][&timeout=S]`` read-your-writes (:func:`wait_response`, as ``cdc wait``,
a table or a view per ``table``:
200 with the result once caught up, 504 with how far behind each table is on timeout, 400 for a bad
LSN, timeout or table, 503 when the source or the log store cannot be reached). Each wait holds one request thread and
opens its own source connection and read-only log store.

Guarantees
----------
* **Access.** It binds to loopback (127.0.0.1) unless told otherwise; binding anything else needs a
  token (``--token`` or ``CDC_SERVE_TOKEN``), else a ConfigError. With a token every request must
  carry it (``Authorization: Bearer TOKEN``, or ``?token=TOKEN``, which the dashboard passes on to its
  own requests); a request without it gets 401. Tokens are compared in constant time, never logged.
* **Sampling.** One sampler thread calls :func:`cdc.cli.status.gather.collect` every ``sample_interval_s`` (so
  the status history and the ``drop`` slot policy keep working while only ``serve`` runs) and keeps
  the samples of the last ``history_s`` in memory. Requests never query the source themselves.
  A sample that fails (source down) is recorded as such; the sampler goes on.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import threading
import time
from collections import deque
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson
from pydantic import SecretStr

from cdc.cli.status.gather import collect, open_store
from cdc.cli.status.options import StatusOptions
from cdc.config import ServeConfig, Settings, section_options
from cdc.errors import CdcError, ConfigError

__all__ = ["ServeOptions", "Server", "is_loopback"]

STATIC_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html; charset=utf-8"}


class ServeOptions(ServeConfig):
    """``[serve]`` in ``cdc.toml``, whose model (:class:`cdc.config.ServeConfig`) holds each key's
    default and bounds."""

    @classmethod
    def from_settings(cls, settings: Settings) -> ServeOptions:
        return section_options(cls, settings, "serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Sampler:
    """Collects a status report every ``interval_s`` and keeps ``history_s`` of them."""

    def __init__(
        self, settings: Settings, status_options: StatusOptions, interval_s: float, history_s: float
    ) -> None:
        self.settings = settings
        self.status_options = status_options
        self.interval_s = interval_s
        self.history_s = history_s
        self.samples: deque[dict[str, Any]] = deque()
        self.latest: dict[str, Any] | None = None
        self.error: str | None = None
        self.cpu_s = 0.0  # CPU time the sampling used (thread time), for the benchmark
        self.count = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None  # the read-only log store, kept open between samples

    def _close_store(self) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()
            self._store = None

    def sample(self) -> None:
        t0 = time.thread_time()
        try:
            if self._store is None:
                self._store = open_store(self.settings)
            report = collect(self.settings, self.status_options, store=self._store)
            error = None
        except CdcError as exc:
            report, error = None, exc.message
            self._close_store()  # reopened by the next sample
        point: dict[str, Any] = {"t_ms": int(time.time() * 1000), "error": error}
        if report is not None:
            point = _chart_point(report)
        with self._lock:
            if report is not None:
                self.latest = report
            self.error = error
            self.samples.append(point)
            cutoff = point["t_ms"] - self.history_s * 1000
            while self.samples and self.samples[0]["t_ms"] < cutoff:
                self.samples.popleft()
            self.count += 1
        self.cpu_s += time.thread_time() - t0

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="cdc-serve-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as exc:  # an unexpected error: kept visible on /status, sampling goes on
                with self._lock:
                    self.error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._close_store()

    def snapshot(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]], str | None]:
        with self._lock:
            return self.latest, list(self.samples), self.error


def _chart_point(report: dict[str, Any]) -> dict[str, Any]:
    """What the chart needs of a report: per stage its lag in seconds and its verdict."""
    stages = {}
    for st in report["stages"]:
        key = st["stage"] if st["stage"] != "apply" else f"apply:{st['table']}:{st['sink']}"
        stages[key] = {"lag_seconds": st.get("lag_seconds"), "verdict": st["verdict"]}
    return {"t_ms": report["generated_ms"], "severity": report["severity"], "stages": stages}


class Server:
    """The HTTP server; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        options: ServeOptions | None = None,
        *,
        token: SecretStr | None = None,
        status_options: StatusOptions | None = None,
    ) -> None:
        self.options = options or ServeOptions.from_settings(settings)
        if token is not None and not token.get_secret_value():
            token = None
        if token is None and not is_loopback(self.options.host):
            raise ConfigError(
                f"refusing to serve on {self.options.host} without a token: anyone who can reach it could read "
                "the pipeline's status",
                fix="pass --token (or set CDC_SERVE_TOKEN), or bind to 127.0.0.1",
            )
        self.token = token
        self.sampler = Sampler(
            settings,
            status_options or StatusOptions.from_settings(settings),
            self.options.sample_interval_s,
            self.options.history_s,
        )
        self.httpd = ThreadingHTTPServer((self.options.host, self.options.port), _handler(self))
        self.httpd.daemon_threads = True

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def authorized(self, headers: Any, query: dict[str, list[str]]) -> bool:
        if self.token is None:
            return True
        expected = self.token.get_secret_value().encode()
        auth = str(headers.get("Authorization") or "")
        given = auth[7:] if auth.startswith("Bearer ") else (query.get("token") or [""])[0]
        return hmac.compare_digest(given.encode(), expected)

    def serve_forever(self) -> None:
        self.sampler.start()
        try:
            self.httpd.serve_forever(poll_interval=0.2)
        finally:
            self.sampler.stop()
            self.httpd.server_close()

    def shutdown(self) -> None:
        self.httpd.shutdown()


def wait_response(settings: Settings, query: Mapping[str, list[str]]) -> tuple[int, bytes]:
    """``GET /wait``: (HTTP status, JSON body) of :func:`cdc.cli.wait.lsn.wait_for_lsn` for the query's
    ``lsn``, ``table`` (a registered table or view, repeated; default every registered table and
    view) and ``timeout`` (seconds, default 30)."""
    from cdc.cli.wait.lsn import parse_lsn, parse_timeout, resolve, wait_for_lsn
    from cdc.errors import LogStoreError, RegistryError, SourceError

    try:
        lsn = parse_lsn((query.get("lsn") or [""])[0])
        raw_timeout = (query.get("timeout") or ["30"])[0]
        try:
            timeout = float(raw_timeout)
        except ValueError:
            raise ConfigError(
                f"timeout is not a number: {raw_timeout!r}", fix="pass e.g. timeout=30"
            ) from None
        timeout = parse_timeout(timeout)
        targets = resolve(settings.state_dir, query.get("table") or [])
    except (ConfigError, RegistryError) as exc:
        return 400, orjson.dumps(exc.to_dict())
    try:
        result = wait_for_lsn(settings, lsn, targets.tables, timeout, views=targets.views)
    except (SourceError, LogStoreError) as exc:  # the source or the log store cannot be reached
        return 503, orjson.dumps(exc.to_dict())
    except CdcError as exc:  # e.g. no source configured
        return 500, orjson.dumps(exc.to_dict())
    return (200 if result.caught_up else 504), orjson.dumps(result.to_dict())


def _static(name: str) -> bytes:
    return resources.files("cdc.cli.serve").joinpath("static", name).read_bytes()


def _handler(server: Server) -> type[BaseHTTPRequestHandler]:
    from cdc.cli.serve.metrics import render_metrics

    class Handler(BaseHTTPRequestHandler):
        server_version = "cdc-serve"

        def log_message(self, format: str, *args: Any) -> None:  # no access log (URLs may carry the token)
            return

        def _send(self, code: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            if not server.authorized(self.headers, query):
                self._send(
                    401,
                    b'{"error": "unauthorized", "fix": "send Authorization: Bearer TOKEN or ?token=TOKEN"}',
                    "application/json",
                    {"WWW-Authenticate": 'Bearer realm="cdc"'},
                )
                return
            latest, samples, error = server.sampler.snapshot()
            path = url.path
            if path == "/metrics":
                from prometheus_client import CONTENT_TYPE_LATEST

                self._send(200, render_metrics(latest, error), CONTENT_TYPE_LATEST)
            elif path == "/status":
                if latest is None:
                    self._send(503, orjson.dumps({"error": error or "no sample yet"}), "application/json")
                else:
                    self._send(200, orjson.dumps(latest), "application/json")
            elif path == "/wait":
                code, body = wait_response(server.sampler.settings, query)
                self._send(code, body, "application/json")
            elif path == "/history":
                self._send(200, orjson.dumps({"samples": samples, "error": error}), "application/json")
            elif path in ("/", "/index.html"):
                self._send(200, _static("dashboard.html"), STATIC_TYPES[".html"])
            elif path.startswith("/static/") and "/" not in path[8:] and not path[8:].startswith("."):
                name = path[8:]
                ext = name[name.rfind(".") :]
                try:
                    body = _static(name)
                except (FileNotFoundError, IsADirectoryError):
                    self._send(404, b"not found", "text/plain")
                    return
                self._send(200, body, STATIC_TYPES.get(ext, "application/octet-stream"))
            else:
                self._send(404, b"not found", "text/plain")

    return Handler
