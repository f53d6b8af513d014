"""`MetricsEndpoint`: the Prometheus scrape endpoint (`--metrics-port`)."""

from __future__ import annotations

import dataclasses
import logging
import ssl
import sys
import threading
from collections.abc import Iterable
from typing import Any, cast

import prometheus_client
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from laneserve.server.addresses import bare_host, host_port
from laneserve.server.log_events import log_event

log = logging.getLogger(__name__)

# A scrape connection silent this long (no TLS hello, no request) is closed.
CONNECTION_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class EndpointTls:
    """PEM files for HTTPS on the endpoint: the server's certificate and key and, for
    mutual TLS, the CA whose client certificates a scraper must present."""

    cert: str
    key: str
    client_ca: str | None = None


class MetricsEndpoint:
    """The Prometheus scrape endpoint (HTTP GET /metrics) over one registry; HTTPS with
    `tls` (and then mutual TLS when it names a client CA)."""

    def __init__(
        self,
        registry: prometheus_client.CollectorRegistry,
        host: str,
        port: int,
        tls: EndpointTls | None = None,
    ) -> None:
        address = bare_host(host)  # "[::]" as gRPC writes it
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                port,
                addr=address,
                registry=_OneScrapeAtATime(registry, threading.Lock()),
                certfile=None if tls is None else tls.cert,
                keyfile=None if tls is None else tls.key,
                client_cafile=None if tls is None else tls.client_ca,
                client_auth_required=tls is not None and tls.client_ca is not None,
            )
        except ssl.SSLError as error:
            raise OSError(
                f"cannot serve metrics over TLS: {error}; expected tls_cert and tls_key "
                "(and tls_client_ca) to be PEM files of a matching certificate and key"
            ) from error
        except OSError as error:
            raise OSError(
                f"cannot serve metrics on {host_port(host, port)}: {error.strerror or error}; "
                "choose another --metrics-port (0: any free port, -1: no endpoint)"
            ) from error
        self.port: int = self._server.server_port
        # prometheus_client wraps the listening socket, so the TLS handshake would run in
        # accept() on the one serving thread: a connection that never sends a hello (a
        # port scan, a load balancer's TCP probe) would block every scrape and close().
        # The handshake moves to the request's own thread, on its first read, and every
        # request's connection gets a timeout, so a stalled client ends its thread.
        listening = self._server.socket
        if isinstance(listening, ssl.SSLSocket):
            # An instance attribute accept() reads (typeshed does not declare it).
            listening.do_handshake_on_connect = False  # type: ignore[attr-defined]
        # A failed request (plain HTTP on the HTTPS port, a scraper without the client
        # certificate, a port scan) is one log line, not socketserver's traceback printed
        # to stderr (~23 lines of text each, outside the log's format).
        # An instance attribute, as a bound method would be (typeshed types it as one).
        self._server.handle_error = _log_failed_request  # type: ignore[assignment,method-assign]
        handler = cast(type, self._server.RequestHandlerClass)
        self._server.RequestHandlerClass = type(
            handler.__name__, (handler,), {"timeout": CONNECTION_TIMEOUT_S}
        )

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


def _log_failed_request(_request: Any, client_address: Any) -> None:
    """socketserver's `handle_error`, called in the request's thread while its error is
    being handled."""
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
