"""Host and port as each consumer spells them: gRPC takes an IPv6 address in brackets
("[::1]:50051"), getaddrinfo and http.server take it bare ("::1"). Configured hosts
come either way (`--host ::1`, `--host '[::1]'`)."""

from __future__ import annotations


def bare_host(host: str) -> str:
    """The host as getaddrinfo takes it: "[::1]" does not resolve, "::1" does."""
    return host.strip("[]")


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC parses it, and as logs and errors should print it: "::1"
    alone made "::1:0", which gRPC could not bind and a reader cannot split."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
