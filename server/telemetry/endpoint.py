"""`MetricsEndpoint`: the Prometheus scrape endpoint (`--metrics-port`)."""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import prometheus_client
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from laneserve.server.addresses import bare_host, host_port
from laneserve.server.log_events import log_event

log = logging.getLogger(__name__)

# A scrape connection silent this long (no TLS hello, no request) is closed.
CONNECTION_TIMEOUT_S = 10.0


class MetricsEndpoint:
    """The Prometheus scrape endpoint (HTTP GET /metrics) over one registry, one thread a
    request; HTTPS with `tls` (the gRPC port's certificate, cipher levels and client
    certificate rule: tls.https_context)."""

    def __init__(
        self,
        registry: prometheus_client.CollectorRegistry,
        host: str,
        port: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        address = bare_host(host)  # "[::]" as gRPC writes it
        try:
            server = _scrape_server(address, port, registry)
        except OSError as error:
            raise OSError(
                f"cannot serve metrics on {host_port(host, port)}: {error.strerror or error}; "
                "choose another --metrics-port (0: any free port, -1: no endpoint)"
            ) from error
        if tls is not None:
            # The handshake runs in the request's own thread, on its first read, not in
            # accept() on the one serving thread: a connection that never sends a hello
            # (a port scan, a load balancer's TCP probe) would block every scrape and
            # close(). Each request's connection has a timeout (_ScrapeHandler), so a
            # stalled client ends its thread. (The context holds its certificate already:
            # https_context; a context that cannot wrap still leaves no socket open.)
            try:
                server.socket = tls.wrap_socket(
                    server.socket, server_side=True, do_handshake_on_connect=False
                )
            except BaseException:
                server.server_close()
                raise
        self._server = server
        self.port: int = server.server_port
        self._thread = threading.Thread(
            target=server.serve_forever, name="laneserve-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _OneScrapeAtATime(Collector):
    """`registry` collected by one scrape at a time (each request has its own thread).

    OpenTelemetry's Prometheus reader queues each collection in one deque shared by all
    scrapes and writes out all it finds there: two scrapes at once wrote every family
    twice in one body (duplicate `# TYPE` lines, which Prometheus rejects) and none in
    the other (every series stale). The lock is held until a scrape's metrics are all
    collected; the text is written from them outside it.
    """

    def __init__(
        self,
        registry: prometheus_client.CollectorRegistry,
        lock: threading.Lock,
        names: frozenset[str] | None = None,
    ) -> None:
        self._registry = registry
        self._lock = lock
        self._names = names  # None: every family

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            metrics = list(self._registry.collect())
        if self._names is None:
            return metrics
        return [kept for metric in metrics if (kept := _samples_named(metric, self._names))]

    def restricted_registry(self, names: Iterable[str]) -> _OneScrapeAtATime:
        """The samples named `names` alone (a scrape's `name[]` parameters), filtered
        here: the registry's own filter keeps only collectors that declare their names,
        and OpenTelemetry's declares none (`?name[]=...` got an empty body)."""
        return _OneScrapeAtATime(self._registry, self._lock, frozenset(names))


def _samples_named(metric: Metric, names: frozenset[str]) -> Metric | None:
    """`metric` with only its samples named in `names` (None: none is)."""
    samples = [sample for sample in metric.samples if sample.name in names]
    if not samples:
        return None
    kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
    kept.samples = samples
    return kept


class _ScrapeServer(ThreadingMixIn, WSGIServer):
    """A WSGI server answering each request in a daemon thread of its own (as
    prometheus_client's), each failed request one log line: plain HTTP on the HTTPS
    port, a scraper without the client certificate or a port scan printed socketserver's
    traceback to stderr (~23 lines each, outside the log's format)."""

    daemon_threads = True  # a request's thread is not waited for at close
    allow_reuse_port = False  # one endpoint a port (a later Python's default may differ)

    def __init__(self, family: socket.AddressFamily, address: tuple[str, int]) -> None:
        self.address_family = family  # the socket TCPServer.__init__ makes and binds
        super().__init__(address, _ScrapeHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Called in the request's thread while its error is being handled."""
        error = sys.exc_info()[1]
        peer = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        log_event(
            log,
            logging.WARNING,
            "metrics_request_failed",
            f"metrics request from {peer} failed: {error!r}",
            peer=peer,
            error=repr(error),
        )


class _ScrapeHandler(WSGIRequestHandler):
    """A request's connection: silent for CONNECTION_TIMEOUT_S (no TLS hello, no request)
    it is closed; nothing logged per request."""

    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


def _scrape_server(
    address: str, port: int, registry: prometheus_client.CollectorRegistry
) -> _ScrapeServer:
    """The endpoint's server, bound and listening (not yet serving), in the family of the
    first address `address` names (an IPv6 wildcard takes IPv4 too, as Linux binds it)."""
    family, _, _, _, bound = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server = _ScrapeServer(family, (str(bound[0]), port))  # closes its socket if bind fails
    server.set_app(prometheus_client.make_wsgi_app(_OneScrapeAtATime(registry, threading.Lock())))
    return server
