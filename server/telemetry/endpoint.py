"""`MetricsEndpoint`: the Prometheus scrape endpoint (`--metrics-port`)."""

from __future__ import annotations

import prometheus_client


class MetricsEndpoint:
    """The Prometheus scrape endpoint (HTTP GET /metrics) over one registry."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, host: str, port: int) -> None:
        address = host.strip("[]")  # "[::]" as gRPC writes it
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                port, addr=address, registry=registry
            )
        except OSError as error:
            raise OSError(
                f"cannot serve metrics on {host}:{port}: {error.strerror or error}; choose "
                f"another --metrics-port (0: any free port, -1: no endpoint)"
            ) from error
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
