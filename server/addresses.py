"""Host and port as each consumer spells them: gRPC takes an IPv6 address in brackets
("[::1]:50051"), getaddrinfo and http.server take it bare ("::1"). Configured hosts
come either way (`--host ::1`, `--host '[::1]'`). And listening sockets bound as gRPC
binds its ports, for the servers that are not gRPC's (`listening_sockets`)."""

from __future__ import annotations

import socket


def bare_host(host: str) -> str:
    """The host as getaddrinfo takes it: "[::1]" does not resolve, "::1" does."""
    return host.strip("[]")


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC parses it, and as logs and errors should print it: "::1"
    alone made "::1:0", which gRPC could not bind and a reader cannot split."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def listening_sockets(host: str, port: int, backlog: int = 128) -> list[socket.socket]:
    """Listening sockets for `host` (bare: "::", "127.0.0.1", "localhost") and `port`,
    bound as gRPC binds its ports: one per address the name resolves to, all on the same
    port (with 0, the one the first bind got), and "::" alone dual-stack (IPv4 too:
    asyncio's own binding made it IPv6 only, and an IPv4 probe of a pod was refused).
    Raises OSError where one cannot bind; none is left open then."""
    found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, str(address[0])) for family, *_, address in found))
    families = {family for family, _ in addresses}
    sockets: list[socket.socket] = []
    try:
        for family, address in addresses:
            listener = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # Beside an IPv4 address of the same name, each family has its socket.
                v6_only = int(socket.AF_INET in families)
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6_only)
            listener.bind((address, port))
            port = listener.getsockname()[1]  # with 0, the others take the first one's
            listener.listen(backlog)
            listener.setblocking(False)
    except BaseException:
        for listener in sockets:
            listener.close()
        raise
    return sockets
