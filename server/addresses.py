"""Host and port as each consumer spells them: gRPC takes an IPv6 address in brackets
("[::1]:50051"), getaddrinfo and http.server take it bare ("::1"). Configured hosts
come either way (`--host ::1`, `--host '[::1]'`). And listening sockets bound as gRPC
binds its ports, for the servers that are not gRPC's (`listening_sockets`). And why an
address will not bind, keyed by the setting at fault: each configured port checked
before the model loads (`check_ports_free`), and a bind that failed explained
(`bind_refusal`)."""

from __future__ import annotations

import errno
import ipaddress
import socket

from laneserve.server.config import ConfigError, ServerConfig


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


def bind_refusal(host: str, port: int, setting: str) -> ConfigError | None:
    """Why the OS refuses to bind `host:port` ("Address already in use"), found by binding
    it once more after gRPC could not: gRPC raises "Failed to bind" alone, and its core's
    own line with the reason is off with JSON logs (cli.py). Keyed by the setting at
    fault: server.host for a name that does not resolve or an address not this host's,
    else `setting` (the port's: "port", "priority_port", "metrics_port"). None: the OS
    binds it now."""
    address = host_port(host, port)
    try:
        addresses = socket.getaddrinfo(bare_host(host), port, type=socket.SOCK_STREAM)
    except OSError as error:  # a name that does not resolve
        return _not_this_hosts(address, str(error))
    for family, kind, proto, _, resolved in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC and the metrics endpoint bind: a port left in TIME_WAIT by the last
            # run binds; one another socket listens on does not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(resolved)
            except OSError as error:
                reason = error.strerror or str(error)
                if error.errno == errno.EADDRNOTAVAIL:
                    return _not_this_hosts(address, reason)
                return ConfigError(
                    f"cannot listen on {address}: {reason}; expected a free port (0: any "
                    "free port)",
                    key=f"server.{setting}",
                )
    return None


def _not_this_hosts(address: str, reason: str) -> ConfigError:
    return ConfigError(
        f"cannot listen on {address}: {reason}; expected an address of this host, or a "
        "name that resolves to one",
        key="server.host",
    )


def check_ports_free(config: ServerConfig) -> None:
    """Refuses, before the model loads (minutes for a large one on a GPU), a configured
    port the OS will not bind: one another process listens on, an address not this
    host's (port 0, any free one, is checked for the address alone; -1, none, is not
    checked): a ConfigError keyed by the setting at fault, the port's or server.host,
    which `serve` names by its flag. Not a reservation: a port taken between this check
    and the bind is refused there (an OSError)."""
    ports = (
        ("port", config.port),
        ("priority_port", config.priority_port),
        ("http_port", config.http_port),
        ("metrics_port", config.metrics_port),
    )
    for setting, port in ports:
        if port < 0:
            continue
        refusal = bind_refusal(config.host, port, setting)
        if refusal is not None:
            raise refusal
    refusal = _grpc_address_refusal(config.host)
    if refusal is not None:
        raise refusal


def _grpc_address_refusal(host: str) -> ConfigError | None:
    """gRPC reads the address it listens on itself, not as the system does: "0", "127.1"
    and "0x7f000001" (IPv4 in the short forms inet_aton takes) and "[::1" (its bracket
    unclosed, which bare_host drops) resolve for getaddrinfo (the checks above, the HTTP
    and metrics ports) and failed gRPC's bind after the model had loaded, named as the
    port's fault; "127.0.0.010" gRPC read as 127.0.0.10 and the system as 127.0.0.8
    (octal). A host name is resolved by both. None: both read it alike."""
    bare = bare_host(host)
    bracketed = host.startswith("[") or host.endswith("]")
    if bracketed and not (host.startswith("[") and host.endswith("]") and _is_ip(bare, 6)):
        how = "brackets hold an IPv6 address, [::1]"
    elif not bracketed and not _is_ip(bare, 4) and not _is_ip(bare, 6) and _is_short_ipv4(bare):
        how = "an IPv4 address is written in full, without leading zeros: 127.0.0.1"
    else:
        return None
    return ConfigError(
        f"gRPC cannot listen on {host!r} as the system reads it (an address gRPC reads "
        f"otherwise, or not at all); expected an IP address or a host name ({how})",
        key="server.host",
    )


def _is_ip(text: str, version: int) -> bool:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    return address.version == version


def _is_short_ipv4(text: str) -> bool:
    """Whether inet_aton reads `text` ("0", "127.1", "0x7f000001", "127.0.0.010")
    though it is no IPv4 address as written in full."""
    try:
        socket.inet_aton(text)
    except OSError:
        return False
    return True
