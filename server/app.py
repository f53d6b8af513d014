"""Assembly of a serving process: engine, scheduler thread, servicers, lifecycle.

server = LaneServer(load_engine(config), config)   # slow: loads and probes the model
port = await server.start()                        # listening, health SERVING
...
await server.stop()                                # drains, answers everything, stops
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import ipaddress
import logging
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_channelz.v1 import channelz, channelz_pb2
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from laneserve.server.addresses import bare_host, host_port
from laneserve.server.clock import Clock, SystemClock
from laneserve.server.config import DEFAULT_MEMORY_LOW_WATERMARK, ConfigError, ServerConfig
from laneserve.server.cost_model import RunTimeModel
from laneserve.server.engine import (
    CUDA,
    Engine,
    Probe,
    nvml_start_error,
    open_nvml_gauge,
)
from laneserve.server.errors import DrainingError, LaneserveError, SessionBrokenError
from laneserve.server.events import FanOut, NullTracer, SchedulerEvents
from laneserve.server.grpc_accept import (
    CallGate,
    ParallelAcceptors,
)
from laneserve.server.grpc_calls import GrpcCallCounts, GrpcCalls
from laneserve.server.grpc_methods import add_grpc_service, add_to_server
from laneserve.server.idempotency import LedgerCounts
from laneserve.server.kserve import INFER_METHOD as KSERVE_INFER_METHOD
from laneserve.server.kserve import SERVICE_NAME as KSERVE_SERVICE_NAME
from laneserve.server.kserve import KServeServicer, add_kserve_to_server
from laneserve.server.kserve_http import IDLE_CONNECTION_S, HttpFrontEnd
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.memory import (
    CgroupMemoryLimit,
    MemoryEstimate,
    MemoryFacts,
    MemoryGauge,
    NvmlUnavailableError,
    ProcessRssGauge,
    Watermark,
    cgroup_memory_limit,
    format_bytes,
    format_bytes_beyond,
    parse_memory_limit,
    release_free_heap,
    session_gpu_id,
    share_above,
)
from laneserve.server.process import open_file_limit
from laneserve.server.scheduler import Scheduler
from laneserve.server.scheduler_thread import SchedulerThread
from laneserve.server.service import InferenceServicer, OutcomeRouter, ServiceTelemetry
from laneserve.server.settings import TraceSettings
from laneserve.server.shared_memory import SharedMemoryRegions
from laneserve.server.stats import StatsRecorder
from laneserve.server.telemetry import MetricSources, Telemetry, log_event
from laneserve.server.text_thread import TextThread
from laneserve.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)
# Held while a gRPC server is made and its Channelz id read (see `_grpc_server`).
_SERVERS_BEING_MADE = threading.Lock()

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
CHANNELZ_SERVICE_NAME = channelz_pb2.DESCRIPTOR.services_by_name["Channelz"].full_name
# Both front ends' unary inference methods, by full name (gRPC's method paths).
INFERENCE_METHODS = (f"/{SERVICE_NAME}/Infer", f"/{KSERVE_SERVICE_NAME}/{KSERVE_INFER_METHOD}")
# The names the health service answers for: the server as a whole (""), and each
# inference service every port serves (a probe naming KServe's, as a KServe deployment's
# does, was answered NOT_FOUND).
HEALTH_SERVICES = ("", SERVICE_NAME, KSERVE_SERVICE_NAME)
# After the drain, how long the stop waits for the engine thread once the run in progress
# was told to end (its requests are already answered): a run the runtime does not end in
# that time is left behind, and `laneserve serve` exits without it.
RUNNING_BATCH_WAIT_S = 1.0
# After the last batch, how long the stop waits for its answers' text to be encoded off
# the event loop (`TextThread`): a 64 MiB answer of 2-byte strings, 13 M of them, takes
# about 5 s at `scripts/bench_text.py`'s 0.36 us an element.
TEXT_ANSWERS_WAIT_S = 10.0
# Before gRPC stops, the event loop reads what gRPC's core still holds (gRPC's stop would
# cancel it, bare CANCELLED), each call answered DRAINING, for as long as the count of
# calls not yet ended falls from one interval to the next (a free loop reads thousands of
# calls a second: 256 held ones take ~0.1 s here), and at most for the bound.
CORE_QUEUE_SETTLE_S = 0.05
CORE_QUEUE_WAIT_S = 2.0
# Inference calls (Infer; ModelInfer) each port asks gRPC's core for at once, per method,
# beside grpc.aio's own one (see grpc_accept). Quick runs of (a) on 2 cores: 0 -> 3 -> 7
# took 1 916 -> 2 593 -> 2 689 calls/s at 32 callers and 2 123 -> 3 039 -> 3 303 at 128,
# with p99 falling. An ask waits in gRPC's core, which completes it when a call comes:
# nothing polls.
INFER_ACCEPTORS = 8
# ... while the port has fewer calls in progress than this many batches at the cap (see
# grpc_accept): enough to fill the next batches.
ACCEPT_BELOW_BATCHES = 2
# How long a stop waits for the acceptors to see their asks fail.
ACCEPTORS_CLOSE_S = 1.0
# The shortest interval between a client's keepalive pings on a connection without
# traffic that the server takes (`_bare_grpc_server`). gRPC's default takes one per 5 min
# and, at the third ping sooner, hangs up (GOAWAY too_many_pings, which grpc-js and
# grpc-go answer by doubling their interval): clients ping to find a dead connection
# sooner than that.
MIN_CLIENT_PING_INTERVAL_MS = 60_000
# A gRPC connection with no call in progress is closed (GOAWAY) after this long, the
# HTTP port's own bound; a client's channel connects again on its next call. gRPC kept
# one for ever: 400 connections that sent their preface and nothing more took every file
# of the process, and both ports and the metrics endpoint stopped answering (a review).
IDLE_CONNECTION_MS = round(IDLE_CONNECTION_S * 1000)
# The share of the open-file limit one gRPC port's connections may take at once (a
# quarter, as shared memory regions may take another): past it gRPC closes a new
# connection at once, and the process keeps files for the rest.
CONNECTION_SHARE_OF_FILES = 4
# gRPC's bitset of the compression algorithms it takes (bit 0: identity): identity only
# refuses a compressed request UNIMPLEMENTED on its header, before inflating it.
IDENTITY_ONLY_ALGORITHMS = 1


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """The gRPC port's TLS credentials from the configured PEM files; None: plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None

    def read(key: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as error:
            raise ConfigError(
                f"cannot read {path!r} ({error.strerror}); expected a PEM file", key=f"server.{key}"
            ) from error

    cert = read("tls_cert", config.tls_cert)
    key = read("tls_key", config.tls_key)
    client_ca = (
        None if config.tls_client_ca is None else read("tls_client_ca", config.tls_client_ca)
    )
    _check_pem(config.tls_cert, config.tls_key, config.tls_client_ca)
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
    refusal = _grpc_refusal(credentials)
    if refusal is not None:
        raise ConfigError(
            f"server.tls_cert, server.tls_key: gRPC's TLS cannot serve with "
            f"{config.tls_cert!r} and {config.tls_key!r} ({refusal}); expected an RSA "
            "(PKCS#1 v1.5 key) or ECDSA certificate whose keyUsage, where it has one, "
            "includes digitalSignature",
            cites=_CERT_AND_KEY,
        )
    return credentials


# The settings a refusal of the certificate and key together names (`ConfigError.cites`).
_CERT_AND_KEY = ("server.tls_cert", "server.tls_key")
# OpenSSL cipher list at security level 0: Python's checks of TLS files judge them as
# gRPC's BoringSSL does, which has no security levels.
_ANY_SECURITY_LEVEL = "DEFAULT:@SECLEVEL=0"
# OpenSSL's verify codes of a certificate outside its validity window.
_DATE_ERRORS = frozenset({9, 10})  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED
_INVALID_PURPOSE = 26  # X509_V_ERR_INVALID_PURPOSE
# The issuer is not among the roots: X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT(_LOCALLY),
# X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE.
_ISSUER_UNKNOWN = frozenset({2, 20, 21})


def _check_pem(cert: str, key: str, client_ca: str | None) -> None:
    """Loads the files as Python's TLS would: gRPC takes any bytes here and fails later
    with "Failed to bind" and nothing on what was wrong."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # Refused only for what gRPC's TLS refuses too: OpenSSL's security level turned away
    # keys and signatures BoringSSL (which has none) takes ("EE_KEY_TOO_SMALL").
    context.set_ciphers(_ANY_SECURITY_LEVEL)

    def refuse_passphrase() -> str:
        # Called only for an encrypted key; without it OpenSSL prompts on the terminal.
        raise ConfigError(
            f"{key!r} is an encrypted private key; gRPC takes no passphrase: expected an "
            "unencrypted PEM key (e.g. `openssl pkey -in KEY -out PLAIN`), readable only by "
            "the server's user",
            key="server.tls_key",
        )

    try:
        context.load_cert_chain(cert, key, password=refuse_passphrase)
    except ssl.SSLError as error:
        raise ConfigError(
            f"server.tls_cert, server.tls_key: {cert!r} and {key!r} are not a PEM "
            f"certificate (chain) and its private key ({error.reason or error}); expected "
            "PEM files of a matching certificate and key",
            cites=_CERT_AND_KEY,
        ) from error
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as error:
            raise ConfigError(
                f"{client_ca!r} holds no PEM CA certificate ({error.reason or error}); "
                "expected the CA that signs client certificates",
                key="server.tls_client_ca",
            ) from error
        if context.cert_store_stats()["x509"] == 0:
            # A file of CRLs alone loads: gRPC then refused the bind, blaming the
            # server's own certificate and key.
            raise ConfigError(
                f"{client_ca!r} holds no certificate (only other PEM blocks); expected the "
                "CA that signs client certificates",
                key="server.tls_client_ca",
            )
    refusal = _certificate_refusal(cert, key)
    if refusal is not None:
        raise ConfigError(
            f"{cert!r} would be refused by every client ({refusal}); expected a certificate "
            "valid now, and for a server (extendedKeyUsage serverAuth, where it has one) "
            "unless it is self-signed",
            key="server.tls_cert",
        )


def _certificate_refusal(cert: str, key: str) -> str | None:
    """Why a client trusting this certificate's own chain would refuse it, in OpenSSL's
    words, found by TLS handshakes in memory; None: no reason found. Without this an
    expired certificate served: the start logged nothing and every client's handshake
    failed. Refused: its dates ("certificate has expired", "certificate is not yet
    valid"), and a purpose not a server's ("unsupported certificate purpose") unless the
    certificate is self-signed (gRPC's TLS takes a self-signed certificate its client
    pins as its root whatever its purpose; OpenSSL did not). OpenSSL's other judgments
    are not gRPC's TLS's: refusing what clients take is worse than letting through what
    they refuse."""
    trusting_the_file = _client_context(trusted_file=cert, partial_chain=True)
    refused = _handshake(cert, key, trusting_the_file).refused
    if refused is None:
        return None
    code, message = refused
    if code in _DATE_ERRORS:
        return message
    if code == _INVALID_PURPOSE and not _self_signed(cert, key):
        return message
    return None


def _self_signed(cert: str, key: str) -> bool:
    """Whether the certificate served with `key` is its own issuer: trusted alone, with
    no partial chain, its chain ends at itself (no "unable to get issuer certificate")."""
    leaf = _handshake(cert, key, _client_context()).served
    if leaf is None:
        return False
    trusting_the_leaf = _client_context(trusted_pem=ssl.DER_cert_to_PEM_cert(leaf))
    refused = _handshake(cert, key, trusting_the_leaf).refused
    return refused is None or refused[0] not in _ISSUER_UNKNOWN


def _client_context(
    *, trusted_file: str | None = None, trusted_pem: str | None = None, partial_chain: bool = False
) -> ssl.SSLContext:
    """A client of the in-memory handshakes: no host name checked; trusting as its roots
    the certificates of `trusted_file` or `trusted_pem` (neither: verifying nothing)."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.set_ciphers(_ANY_SECURITY_LEVEL)
    client.check_hostname = False
    if trusted_file is None and trusted_pem is None:
        client.verify_mode = ssl.CERT_NONE
    else:
        client.load_verify_locations(cafile=trusted_file, cadata=trusted_pem)
    if partial_chain:
        client.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return client


@dataclasses.dataclass(frozen=True, slots=True)
class _Handshake:
    """How an in-memory handshake ended; both None when it could not be made or finish
    (no judgment)."""

    # The client's verify code and message, when it refused the server's certificate.
    refused: tuple[int, str] | None = None
    # The certificate the server presented (DER), when the handshake completed.
    served: bytes | None = None


def _handshake(cert: str, key: str, client: ssl.SSLContext) -> _Handshake:
    """A TLS handshake in memory between a server of `cert` and `key` and `client`."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.set_ciphers(_ANY_SECURITY_LEVEL)
    try:
        server.load_cert_chain(cert, key)
    except ssl.SSLError:
        return _Handshake()
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client_side = client.wrap_bio(to_client, to_server)
    try:
        _shake(client_side, server.wrap_bio(to_server, to_client, server_side=True))
    except ssl.SSLCertVerificationError as error:
        return _Handshake(refused=(error.verify_code, str(error.verify_message)))
    except ssl.SSLError:
        return _Handshake()
    return _Handshake(served=client_side.getpeercert(binary_form=True))


def _shake(client_side: ssl.SSLObject, server_side: ssl.SSLObject) -> None:
    """Runs the handshake to its end (or its error): client and server speak in turn
    through the two buffers; a TLS 1.3 handshake takes a few turns, and the bound only
    keeps a protocol surprise from spinning."""
    for _ in range(16):
        done = 0
        for side in (client_side, server_side):
            try:
                side.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        if done == 2:  # noqa: PLR2004 - both sides
            return


def _grpc_refusal(credentials: grpc.ServerCredentials) -> str | None:
    """Why gRPC's own TLS cannot serve with `credentials` (a key type or key usage it
    takes no certificate with: an RSA-PSS key, an EC key for key agreement only), found
    by a throwaway server binding a loopback port with them; None: it binds, or the
    loopback binds nothing at all (no judgment of the certificate then). Otherwise the
    start failed at the real bind, after the model loaded, blaming the address."""
    refusal = _loopback_bind_refusal(credentials)
    if refusal is None or _loopback_bind_refusal(None) is not None:
        return None
    return refusal


def _loopback_bind_refusal(credentials: grpc.ServerCredentials | None) -> str | None:
    """Why a throwaway gRPC server cannot bind a loopback port (with TLS `credentials`;
    None: plaintext); None: it binds."""
    probe = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        if credentials is None:
            probe.add_insecure_port("127.0.0.1:0")
        else:
            probe.add_secure_port("127.0.0.1:0", credentials)
    except RuntimeError as error:
        return str(error)
    finally:
        probe.start()  # an unstarted server holds its port until the process exits
        probe.stop(None)
    return None


def https_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The HTTP port and the metrics endpoint follow the gRPC port: HTTPS with the same
    certificate, and client certificates required where the port requires them. None:
    plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    # Not create_default_context: on Python 3.13 it adds X509 strict checks, which refused
    # client certificates the gRPC port takes (one without an Authority Key Identifier).
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # What the gRPC port serves with (`_check_pem` judged the files so): OpenSSL's
    # security level refused keys BoringSSL takes ("EE_KEY_TOO_SMALL").
    context.set_ciphers(_ANY_SECURITY_LEVEL)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca is not None:
        context.load_verify_locations(config.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def pending_call_limits(max_pending_calls: int) -> list[tuple[str, int]]:
    """gRPC core's limits on calls not yet taken by the event loop: refusals start at
    three quarters of `max_pending_calls` (at random, ever likelier) and are certain at
    it. The soft limit sits high so that bursts below it pass untouched."""
    return [
        ("grpc.server.max_pending_requests", max_pending_calls * 3 // 4),
        ("grpc.server.max_pending_requests_hard_limit", max_pending_calls),
    ]


def _bind_refusal(host: str, port: int, setting: str) -> ConfigError | None:
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


async def _give_back(servers: list[grpc.aio.Server]) -> None:
    """Closes the ports of `servers`, started or not, so that an embedder whose start
    failed can retry on them. gRPC closes a server's listeners only once it has started
    (an unstarted one holds them until the process exits, collected or not), so each is
    started, where it has not been, and stopped at once; a call in between is refused
    UNAVAILABLE (the state is not SERVING)."""
    for server in servers:
        with contextlib.suppress(Exception):  # started already, or its start fails again
            await server.start()
        await server.stop(None)


def _rows_or_none(rows: int | None) -> str:
    return "none" if rows is None else f"{rows} rows"


# What to do about a start out of file descriptors (EMFILE).
OPEN_FILES_HINT = (
    "expected a higher open-file limit (`ulimit -n`: the server holds a few dozen files of "
    "its own and one per client connection)"
)
# The open-file limit (`ulimit -n`) under which a server refuses to start: an idle server
# holds ~20 files (17 measured, with the HTTP and metrics ports open), each client
# connection one more. Below it a start ran out midway: Python's EMFILE where it came
# first, or (Python 3.13, `ulimit -n 12`) an abort inside gRPC's core, which takes no
# error it cannot open its wakeup fd ("Eventfd wakeup fd is not supported", SIGABRT).
MIN_OPEN_FILES = 64


def connection_limit() -> list[tuple[str, int]]:
    """gRPC's option bounding a port's connections to a quarter of the open-file limit
    (CONNECTION_SHARE_OF_FILES); none where the limit is infinite."""
    limit = open_file_limit()
    if limit is None:
        return []
    return [("grpc.max_allowed_incoming_connections", max(1, limit // CONNECTION_SHARE_OF_FILES))]


def check_open_file_limit() -> None:
    """Refuses a process whose open-file limit is under MIN_OPEN_FILES, naming both:
    `serve` before the model loads, and every LaneServer's start (an embedder's too)."""
    limit = open_file_limit()
    if limit is not None and limit < MIN_OPEN_FILES:
        raise ConfigError(
            f"the open-file limit is {limit}, under the {MIN_OPEN_FILES} a server needs at "
            f"the least; {OPEN_FILES_HINT}"
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
        refusal = _bind_refusal(config.host, port, setting)
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


class _LongStreams:
    """The server's long-lived streams, every port's (health Watch, reflection), which
    the drain ends (`end`): open as long as their callers keep them, each held the stop
    for gRPC's whole grace, then ended UNAVAILABLE. `end` cancels the task of each
    stream `running`; the stream, seeing `ended`, takes the cancel for its end and ends
    OK in its own way."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()
        self.ended = False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The current task is a long stream until the block ends."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)

    def end(self) -> None:
        self.ended = True
        for task in self._tasks:
            task.cancel()


class _HealthServicer(health.aio.HealthServicer):
    """gRPC's health service, whose Watch calls end (OK, after their last status) when
    the server stops (`streams.end`)."""

    def __init__(self, streams: _LongStreams) -> None:
        super().__init__()
        self._streams = streams

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        if self._streams.ended:
            # Opened after the watches ended, late in a stop: its status, then its end.
            # Waiting, it held gRPC's stop for its whole grace and ended UNAVAILABLE.
            await context.write(_stopped_status(request.service))
            return
        with self._streams.running():
            await self._watch_until_ended(request, context)

    async def _watch_until_ended(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> None:
        """gRPC's Watch, ended OK by the drain after its last status."""
        written = _LastWritten(context)
        try:
            # gRPC's servicer uses its context's `write` alone, which `written` has.
            await super().Watch(request, written)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            if not self._streams.ended:
                raise  # the caller went away
            # gRPC's servicer sends NOT_SERVING to one watch at a time (each write under
            # its lock): the drain ended the rest before their turn, 7 of 10 open
            # watches and 991 of 1 000 ending OK without it. Sent now, where not yet sent.
            last = _stopped_status(request.service)
            if written.status != last.status:
                await context.write(last)


def _stopped_status(service: str) -> health_pb2.HealthCheckResponse:
    """A stopped server's health answer to a Watch of `service`."""
    known = service in HEALTH_SERVICES
    return health_pb2.HealthCheckResponse(status="NOT_SERVING" if known else "SERVICE_UNKNOWN")


class _LastWritten:
    """A Watch call's context as gRPC's health servicer uses it, keeping the status it
    last wrote (`status`; None: none yet). Set as the write begins: once it is awaited
    the message is gRPC's to send, and a write cut off by the drain still goes out.
    Set after it, the drain wrote the status again while gRPC still sent the first:
    refused (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), the call never ended and held the
    stop for gRPC's whole grace (2 of 45 stops with watches open)."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self.status: int | None = None

    async def write(self, answer: health_pb2.HealthCheckResponse) -> None:
        self.status = answer.status
        await self._context.write(answer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _PortHealth:
    """The health service as one port serves it: the server's own (`_HealthServicer`,
    one for every port: one status to set, one drain that ends every watch), its Watch
    streams counted by the port's gate (`CallGate.gate_watch`), so that a flood of them
    on the main port never refuses the priority port's. Its other methods (Check) are
    the shared servicer's, uncounted."""

    def __init__(self, shared: _HealthServicer, gate: CallGate) -> None:
        self._shared = shared
        self.Watch = gate.gate_watch(shared.Watch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)


def _ended_by_the_drain(
    behavior: Callable[..., Any], streams: _LongStreams
) -> Callable[..., AsyncIterator[Any]]:
    """`behavior` (reflection's stream: an async generator of answers), ended OK by the
    drain (`streams.end`); one opened after it ends at once."""

    async def ended(requests: Any, context: Any) -> AsyncIterator[Any]:
        if streams.ended:
            return
        with streams.running():
            try:
                async for answer in behavior(requests, context):
                    yield answer
            except asyncio.CancelledError:
                if not streams.ended:
                    raise  # the caller went away
                # Ended by the drain while it waited for its caller's next request (where
                # an open stream waits): returned, the stream ends OK.

    return ended


class _PortReflection:
    """gRPC's reflection service as one port serves it: its streams, open as long as
    their callers keep them, counted with the port's health watches
    (`CallGate.gate_reflection`) and ended by the drain (`_LongStreams`)."""

    def __init__(
        self,
        shared: reflection.aio.ReflectionServicer,
        gate: CallGate,
        streams: _LongStreams,
    ) -> None:
        self._shared = shared
        self.ServerReflectionInfo = gate.gate_reflection(
            _ended_by_the_drain(shared.ServerReflectionInfo, streams)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)


@dataclasses.dataclass(frozen=True, slots=True)
class _Listener:
    """One port's gRPC server: the port it bound, the acceptors that take its inference
    calls (to start once it has started), and its Channelz ids (gRPC's call counts)."""

    server: grpc.aio.Server
    port: int
    acceptors: ParallelAcceptors
    channelz_ids: frozenset[int]


def _retrieve_error(task: asyncio.Future[Any]) -> None:
    """Takes a shielded task's error: its caller, cancelled, takes none, and asyncio
    would log it as "never retrieved"."""
    if not task.cancelled():
        task.exception()


def load_engine(config: ServerConfig) -> Engine:
    return Engine(
        config.model_path,
        device=config.device,
        intra_op_threads=config.intra_op_threads,
        memory_limit=None
        if config.memory_limit is None
        else parse_memory_limit(config.memory_limit),
        probe_shapes=config.probe_shapes,
    )


def _on_gpu(engine: Engine) -> bool:
    """Whether the session runs on CUDA (the runtime may have built it on the CPU)."""
    return engine.providers[0] == CUDA


def device_gauge(engine: Engine, watermark: Watermark | None = None) -> MemoryGauge:
    """Memory in use where the session allocates: the GPU's (NVML) or this process's
    (fed to `watermark`, it gives back the free heap first when that decides: see
    ProcessRssGauge)."""
    return open_nvml_gauge() if _on_gpu(engine) else ProcessRssGauge(watermark)


def _watermark_limit_name(engine: Engine) -> str:
    """What the watermark's marks are fractions of, as messages name it."""
    if _on_gpu(engine):
        return f"the memory of GPU {session_gpu_id()!r}"
    return "server.host_memory_limit"


def make_watermark(
    config: ServerConfig,
    engine: Engine,
    device_total_bytes: int | None,
    cgroup: CgroupMemoryLimit | None,
) -> Watermark | None:
    """The admission watermark, where there is a limit to watch: on a GPU the device's
    total memory (`device_total_bytes`, NVML's), on the CPU host_memory_limit (resident
    memory), or where that is unset the least memory limit of the process's cgroups
    (`cgroup`, read by the caller: its warnings name the file), as logged (a
    container's: past it the OOM killer ends the server, and with no watermark queued
    request bodies took a 512 MiB pod's server from 95 to 761 MiB, none refused).
    Neither is the arena's budget (memory_limit): NVML reads the whole device, every
    process's use and the CUDA context beside the arena, so marks taken from the
    budget closed lanes at the server's own full batch (an 80 GiB GPU: the arena at its
    72 GiB cap, and the context, read 72.6 GiB, above a high mark of 68.4). On a GPU
    queued inputs wait in host memory and the arena is capped by the runtime: what
    presses the device is the device filling up as a whole."""
    if _on_gpu(engine):
        limit_bytes = device_total_bytes
    elif config.host_memory_limit is not None:
        limit_bytes = parse_memory_limit(config.host_memory_limit).resolve(None)
    elif cgroup is not None:
        limit_bytes = cgroup.limit_bytes
        log_event(
            log,
            logging.INFO,
            "host_memory_limit_from_cgroup",
            f"server.host_memory_limit unset: the host memory watermarks are fractions of "
            f"the cgroup memory limit, {format_bytes(limit_bytes)} ({cgroup.source}); "
            "--host-memory-limit overrides it",
            host_memory_limit_bytes=limit_bytes,
            source=cgroup.source,
        )
    else:
        limit_bytes = None
    if limit_bytes is None:
        return None
    high_bytes = int(limit_bytes * config.memory_high_watermark)
    low_bytes = int(limit_bytes * config.memory_low_watermark)
    if low_bytes == 0:  # a mark of 0 bytes; the high mark is never below the low one
        keys, marks = "server.memory_low_watermark", f"{config.memory_low_watermark:g} is"
        if high_bytes == 0:
            keys += ", server.memory_high_watermark"
            marks = f"{config.memory_low_watermark:g} and {config.memory_high_watermark:g} are"
        raise ConfigError(
            f"{keys}: {marks} 0 bytes of {_watermark_limit_name(engine)} "
            f"({format_bytes(limit_bytes)}); expected a fraction of the limit above what the "
            f"server holds idle (the default low watermark is {DEFAULT_MEMORY_LOW_WATERMARK})"
        )
    return Watermark(
        lanes=len(config.lanes),
        high_bytes=high_bytes,
        low_bytes=low_bytes,
        limit_bytes=limit_bytes,
    )


# What a server needs above its idle reading; the low mark must leave it.
_ROOM = "with room above it for what serving keeps in use (buffers and caches a burst leaves)"


def _check_idle_memory(
    config: ServerConfig,
    engine: Engine,
    watermark: Watermark,
    used_bytes: int | None,
    probe: Probe,
) -> None:
    """Refuses a start whose idle reading is at or above the low mark: a lane the
    watermark closes reopens only below it, so it would stay closed with nothing queued
    or running. `probe`: the start-up probe, whose fitted readings tell what a full
    batch keeps in use."""
    if used_bytes is None or used_bytes < watermark.low_bytes:
        return
    if _on_gpu(engine):
        _refuse_full_gpu(config, watermark, used_bytes)
    else:
        _refuse_host_limit(config, watermark, used_bytes, probe)


def _marks_expected(config: ServerConfig, share: float) -> tuple[str, str]:
    """The watermark keys at fault where the server needs `share` of the limit below its
    low mark (`share_above`'s), and what they are expected to be: the low mark above the
    share, the high one too where the low mark above it would be above the high one (the
    config refuses that)."""
    keys = "server.memory_low_watermark"
    expected = f"memory_low_watermark above {share:g}"
    if share > config.memory_high_watermark:
        keys += ", server.memory_high_watermark"
        expected += " and memory_high_watermark at least as high"
    return keys, expected


def _refuse_full_gpu(config: ServerConfig, watermark: Watermark, used_bytes: int) -> NoReturn:
    """On a GPU the reading is every process's use of the device, this server's context
    and weights among it, against the device's total: no setting of laneserve's holds
    it lower (memory_limit caps the arena, not the device), so the GPU is named with what
    it holds, and the marks as the setting that could still move."""
    keys, expected = _marks_expected(config, share_above(used_bytes, watermark.limit_bytes))
    raise ConfigError(
        f"{keys}: GPU {session_gpu_id()!r} has {format_bytes(used_bytes)} of its "
        f"{format_bytes(watermark.limit_bytes)} in use with the server idle after loading "
        "the model (every process's use, this server's among it), at or above the low "
        f"watermark {format_bytes(watermark.low_bytes)} (memory_low_watermark "
        f"{config.memory_low_watermark:g} of the GPU's memory), so lanes closed by memory "
        "pressure could never reopen; expected a GPU with more free memory, or "
        f"{expected} (the share of the GPU's memory in use idle; the default low watermark "
        f"is {DEFAULT_MEMORY_LOW_WATERMARK}), {_ROOM}"
    )


def _refuse_host_limit(
    config: ServerConfig, watermark: Watermark, used_bytes: int, probe: Probe
) -> NoReturn:
    """On the CPU the limit it names is a floor: the idle reading plus what a full batch
    keeps in use (`_full_batch_bytes`: the probe's fitted bytes per row times the cap),
    over the low mark. Named from the idle reading alone, it let a server start whose
    lanes all stayed closed after one burst: for 272 MiB of weights and 512-row batches
    ~426 MiB was named, and under 440 MiB the server held 431 MiB with nothing running,
    62 MiB above idle, against a low mark of 374 MiB. The probe measured 33 MiB for that
    batch: what a burst keeps beyond it (queued requests, gRPC's buffers, the heap) is
    the room the message asks for. Where the limit holds the idle server below the
    default low mark, the low mark set lower is what fails, and is named instead, above
    the same sum's share of the limit: above the idle reading's alone (0.581 of 200 MiB
    for the demo model with 4 096-row batches), lanes a burst closed stayed closed. A low
    mark of 1e-9 asked for a limit above 100 PiB. Where that share reaches the whole
    limit no mark can hold it, and the limit is named after all."""
    held = (
        f"the server holds {format_bytes(used_bytes)} idle after loading the model, at or "
        f"above the low watermark {format_bytes(watermark.low_bytes)} (memory_low_watermark "
        f"{config.memory_low_watermark:g} of {format_bytes(watermark.limit_bytes)}), so lanes "
        "closed by memory pressure could never reopen"
    )
    batch_bytes = _full_batch_bytes(probe)
    share = share_above(used_bytes + batch_bytes, watermark.limit_bytes)
    if used_bytes < int(watermark.limit_bytes * DEFAULT_MEMORY_LOW_WATERMARK) and share < 1:
        keys, expected = _marks_expected(config, share)
        counted = f" plus {_a_full_batch(probe, batch_bytes)}" if batch_bytes else ""
        raise ConfigError(
            f"{keys}: {held}; expected {expected} (the share of server.host_memory_limit the "
            f"server holds idle{counted}; the default low watermark is "
            f"{DEFAULT_MEMORY_LOW_WATERMARK}), {_ROOM}"
        )
    counted = (
        f" (the idle reading plus {_a_full_batch(probe, batch_bytes)}, over "
        f"memory_low_watermark {config.memory_low_watermark:g})"
        if batch_bytes
        else ""
    )
    floor_bytes = _host_limit_floor(config, used_bytes, batch_bytes)
    # Keyed: `serve` names --host-memory-limit where the flag gave it, the key where the
    # file did.
    raise ConfigError(
        f"{held}; expected a limit above {format_bytes_beyond(floor_bytes, above=True)}"
        f"{counted}, {_ROOM}",
        key="server.host_memory_limit",
    )


def _a_full_batch(probe: Probe, batch_bytes: int) -> str:
    """A full batch (`batch_bytes`, `_full_batch_bytes`'s, not 0) as messages name it."""
    return (
        f"a full batch of {probe.batch_cap} rows at "
        f"{format_bytes(batch_bytes // probe.batch_cap)} a row as the probe measured, "
        f"{format_bytes(batch_bytes)}"
    )


def _host_limit_floor(config: ServerConfig, used_bytes: int, batch_bytes: int) -> int:
    """The least host_memory_limit whose low mark lies above the idle reading plus a
    full batch: lanes a burst of full batches closes can reopen below it."""
    return int((used_bytes + batch_bytes) / config.memory_low_watermark)


def _full_batch_bytes(probe: Probe) -> int:
    """What a full batch keeps in use above the idle reading, as the probe measured it:
    its fitted bytes per row times the batch cap; 0 where memory in use could not be
    fitted (fewer than two sizes read)."""
    fit = probe.memory_fit
    return 0 if fit is None else fit.per_row_bytes * probe.batch_cap


def _warn_if_a_full_arena_closes_lanes(
    config: ServerConfig,
    engine: Engine,
    watermark: Watermark,
    used_bytes: int | None,
    weights_bytes: int,
) -> None:
    """On a GPU, warns where a batch that fills the arena would take the device to the
    high mark by itself: lanes would close at the server's own work, and reopen only
    once the arena gave its regions back. Not refused: a model whose batches never fill
    the arena (most small ones) never gets there.

    The device at a full arena is read as the idle reading plus the arena's whole cap
    less the weights (`weights_bytes`, the static estimate's: the arena holds them idle,
    so the idle reading has them already), not the probe's fitted readings: those
    predict a full batch of the probe's own rows, while rows of another width, or
    regions the arena keeps from batches of several sizes, fill it to its cap all the
    same. Where the estimate failed (0) the weights count twice: it errs toward warning
    by their size."""
    arena_bytes = engine.memory_limit_bytes
    if arena_bytes is None or used_bytes is None:
        return
    in_both_bytes = min(weights_bytes, arena_bytes)
    full_bytes = used_bytes + arena_bytes - in_both_bytes
    if full_bytes < watermark.high_bytes:
        return
    # Below the high mark less the idle reading, the weights given back (positive: the
    # idle check passed, so the reading is below the low mark, at most the high one).
    limit_below_bytes = watermark.high_bytes - used_bytes + in_both_bytes
    remedy = f"--memory-limit below {format_bytes_beyond(limit_below_bytes, above=False)}"
    remedy += _or_a_high_mark_above(full_bytes, watermark)
    gpu = session_gpu_id()
    log_event(
        log,
        logging.WARNING,
        "watermark_below_full_arena",
        f"GPU {gpu!r}: {format_bytes(used_bytes)} of {format_bytes(watermark.limit_bytes)} "
        "is in use with the server idle (every process's use), and the session's arena may "
        f"grow to its memory_limit of {format_bytes(arena_bytes)}: together (its weights "
        f"counted once) "
        f"{format_bytes(full_bytes)}, at or above the high watermark "
        f"{format_bytes(watermark.high_bytes)} (memory_high_watermark "
        f"{config.memory_high_watermark:g} of the GPU's memory), so a batch that fills the "
        "arena would close lanes by itself, until the arena gives its regions back; "
        f"expected {remedy}",
        gpu=gpu,
        used_bytes=used_bytes,
        memory_limit_bytes=arena_bytes,
        full_arena_bytes=full_bytes,
        high_watermark_bytes=watermark.high_bytes,
        total_bytes=watermark.limit_bytes,
        memory_limit_below_bytes=limit_below_bytes,
    )


def _warn_if_a_full_batch_closes_lanes(
    config: ServerConfig,
    watermark: Watermark,
    used_bytes: int | None,
    probe: Probe,
    cgroup_source: str | None,
) -> None:
    """On the CPU, warns where the idle reading plus a full batch as the probe measured
    it (`_full_batch_bytes`) reaches the high mark: the server's own batches would close
    lanes, and they reopen only below the low mark, which what a burst keeps may hold
    them above (the demo model with 4 096-row batches under a 140 MiB limit: 120 MiB
    idle, 137 MiB with every lane closed 10 s after one burst, against a low mark of
    119). Not refused, as on a GPU: a server whose requests never fill a batch never
    gets there, and limits like 150 MiB serve the demo model's small batches.

    Its own event, beside the GPU's watermark_below_full_arena: what fills is a batch
    the probe measured, not an arena at its cap, and the limit the remedy raises is
    host_memory_limit (or the container's), not the arena's memory_limit. The limit
    named is the floor a refused start names (the sum over the low mark, not the high
    one): above it lanes a burst closes can reopen as well. `cgroup_source`: the file
    the limit was read from where the cgroup's stands in for an unset host_memory_limit
    (None: the setting's). Then the limit to raise is the container's: the warning had
    named a --host-memory-limit never set, and one above the container's limit lets the
    OOM killer come before the watermark acts."""
    if used_bytes is None:
        return
    batch_bytes = _full_batch_bytes(probe)
    full_bytes = used_bytes + batch_bytes
    if full_bytes < watermark.high_bytes:
        return
    floor_bytes = _host_limit_floor(config, used_bytes, batch_bytes)
    limit = format_bytes(watermark.limit_bytes)
    limit_named, raised = f"server.host_memory_limit {limit}", "--host-memory-limit"
    source: dict[str, str] = {}
    if cgroup_source is not None:
        limit_named = (
            f"the cgroup memory limit {limit} ({cgroup_source}; server.host_memory_limit unset)"
        )
        raised, source = "a container memory limit", {"source": cgroup_source}
    remedy = f"{raised} above {format_bytes_beyond(floor_bytes, above=True)}"
    remedy += (
        f" (the idle reading plus the batch, over memory_low_watermark "
        f"{config.memory_low_watermark:g}), {_ROOM}"
    )
    log_event(
        log,
        logging.WARNING,
        "watermark_below_full_batch",
        f"the server holds {format_bytes(used_bytes)} idle of {limit_named}; with "
        f"{_a_full_batch(probe, batch_bytes)}, it holds "
        f"{format_bytes(full_bytes)}, at or above the high watermark "
        f"{format_bytes(watermark.high_bytes)} (memory_high_watermark "
        f"{config.memory_high_watermark:g} of {limit}), so a full batch would close lanes "
        "by itself, and they reopen only below the low watermark "
        f"{format_bytes(watermark.low_bytes)}; expected {remedy}"
        f"{_or_a_high_mark_above(full_bytes, watermark)}",
        used_bytes=used_bytes,
        batch_cap=probe.batch_cap,
        batch_bytes=batch_bytes,
        full_batch_bytes=full_bytes,
        high_watermark_bytes=watermark.high_bytes,
        low_watermark_bytes=watermark.low_bytes,
        host_memory_limit_bytes=watermark.limit_bytes,
        host_memory_limit_above_bytes=floor_bytes,
        **source,
    )


def _or_a_high_mark_above(full_bytes: int, watermark: Watermark) -> str:
    """The high mark that leaves `full_bytes` below it, as a warning's second remedy;
    "" where rounded up it reaches the whole limit: the config refuses marks above 1,
    and a mark of 1 would keep lanes open until the memory is gone."""
    share = share_above(full_bytes, watermark.limit_bytes)
    return "" if share >= 1 else f" or server.memory_high_watermark above {share:g}"


def _watermark_and_gauge(
    config: ServerConfig,
    engine: Engine,
    memory_gauge: MemoryGauge | None,
    cgroup: CgroupMemoryLimit | None,
) -> tuple[Watermark | None, MemoryGauge]:
    """The watermark, where there is a limit to watch, and its reading (`memory_gauge`,
    else the device's). On a GPU the gauge comes first, its total being the watermark's
    limit; on the CPU the watermark does, the process's gauge taking it."""
    if _on_gpu(engine):
        gauge = memory_gauge or device_gauge(engine)
        return make_watermark(config, engine, gauge.total_bytes(), None), gauge
    watermark = make_watermark(config, engine, None, cgroup)
    return watermark, memory_gauge or device_gauge(engine, watermark)


def _watch_memory(
    config: ServerConfig,
    engine: Engine,
    memory_gauge: MemoryGauge | None,
    weights_bytes: int,
    probe: Probe,
) -> tuple[Watermark | None, MemoryGauge | None]:
    """The watermark, where there is a limit to watch, and its reading (`memory_gauge`,
    else the device's), once the idle server is seen to fit below its low mark
    (ConfigError otherwise). `weights_bytes`: the model's weights, as far as known (0).
    `probe`: the start-up probe's findings. Under a limit taken from the cgroup
    (host_memory_limit unset) an idle reading at or above the low mark is no refusal:
    the server serves as it did without a limit, with no watermark, and says so (a
    default must not refuse a start that serves, a container sized for the model but
    not for the default marks)."""
    from_cgroup = not _on_gpu(engine) and config.host_memory_limit is None
    # Read once: the watermark's limit, and the file the warnings below name.
    cgroup = cgroup_memory_limit() if from_cgroup else None
    try:
        watermark, gauge = _watermark_and_gauge(config, engine, memory_gauge, cgroup)
        if watermark is None:
            return None, None
        # Read as an idle running server reads itself once lanes close: the arena's
        # regions given back (`release_idle_memory`) and the C library's free heap. Read
        # with the largest probe batch's regions still held, a start with max_batch_size
        # 2048 and a 200 MiB host limit was refused at 187 MiB, though idle it held 123.
        engine.release_idle_memory()
        release_free_heap()
        used_bytes = gauge.used_bytes()
    except NvmlUnavailableError as error:
        raise nvml_start_error(error) from error
    if from_cgroup and used_bytes is not None and used_bytes >= watermark.low_bytes:
        limit = format_bytes(watermark.limit_bytes)
        log_event(
            log,
            logging.WARNING,
            "host_watermark_off",
            f"the server holds {format_bytes(used_bytes)} idle after loading the model, at "
            f"or above the low watermark {format_bytes(watermark.low_bytes)} "
            f"(memory_low_watermark {config.memory_low_watermark:g} of the cgroup memory "
            f"limit {limit}), so lanes closed by memory pressure could never reopen: serving "
            "without a host memory watermark, queued requests bounded by the lanes alone; "
            "expected a cgroup memory limit with room above the idle server, or "
            "--host-memory-limit set (a start it cannot hold is refused, naming one that can)",
            used_bytes=used_bytes,
            low_watermark_bytes=watermark.low_bytes,
            host_memory_limit_bytes=watermark.limit_bytes,
        )
        return None, None
    _check_idle_memory(config, engine, watermark, used_bytes, probe)
    if _on_gpu(engine):
        _warn_if_a_full_arena_closes_lanes(config, engine, watermark, used_bytes, weights_bytes)
    else:
        source = None if cgroup is None else cgroup.source
        _warn_if_a_full_batch_closes_lanes(config, watermark, used_bytes, probe, source)
    return watermark, gauge


def _warn_if_the_fixed_cap_exceeds_the_fit(config: ServerConfig, probe: Probe) -> None:
    """A fixed cap (--batch-cap) at or above a size the probe saw run out of memory: the
    probe line said so at INFO only, and the first full batch then ran out of memory,
    split and lowered the cap, seconds into serving, with no WARNING before it."""
    fails = probe.first_failing_rows
    if config.batch_cap is None or fails is None or config.batch_cap < fails:
        return
    fitted = max(probe.run_s)  # the largest size that ran (the probe runs one at least)
    log_event(
        log,
        logging.WARNING,
        "batch_cap_exceeds_fit",
        f"--batch-cap {config.batch_cap} is above what fits: the probe ran out of memory at "
        f"{fails} rows ({fitted} ran). The first batch too large to fit will run out of "
        "memory, be split in halves and retried, and lower the cap, which then learns back "
        f"up; set --batch-cap below {fails}, or leave it out for the probe to find the cap",
        batch_cap=config.batch_cap,
        first_failing_rows=fails,
        largest_fitting_rows=fitted,
    )


def _line(estimate: MemoryEstimate | None) -> str:
    if estimate is None:
        return "n/a"
    return f"{format_bytes(estimate.fixed_bytes)} + {format_bytes(estimate.per_row_bytes)}/row"


class LaneServer:
    """One model served over gRPC. Create and start it inside the event loop it serves on."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        *,
        events: SchedulerEvents | None = None,
        clock: Clock | None = None,
        memory_gauge: MemoryGauge | None = None,
        telemetry: Telemetry | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        """`engine`: this server's alone (its stop ends the engine's runs for good): a
        new Engine for each LaneServer; one serving another, or spent by a stop, is
        refused (RuntimeError). One whose server could not be made, or failed to start,
        may serve another.
        `telemetry`: traces, metrics and event logs; by default from the config and the
        OTEL_* variables (Telemetry.from_config). A server refused at start closes the
        telemetry it built; one passed in stays the caller's to close. `events`: one more
        sink, for tests. `stopping`: set from another thread (a stop signal while
        starting), the start-up probe times no further batch size and the server is not
        made (ProbeStopped)."""
        engine.check_free()  # first: a spent or shared engine is refused before its probe
        self.config = config
        self.engine = engine
        self.clock = clock or SystemClock()
        self.state = Lifecycle.STARTING
        device = device_gauge(engine)
        # The engine's, worked out before its session (a failed one too, None: the child
        # ran ~1 s and logged why; a second run would do both again).
        self.memory_estimate = engine.static_estimate
        self.probe = engine.probe(
            config.batch_cap or config.max_batch_size,
            fixed_cap=config.batch_cap is not None,
            gauge=device,
            # No batch holds more rows than the lanes queue together.
            queue_rows=sum(lane.capacity_rows for lane in config.lanes),
            stopping=stopping,
        )
        run_ms = {rows: round(seconds * 1000, 3) for rows, seconds in self.probe.run_s.items()}
        limit = engine.memory_limit_bytes
        # The per-row figures hold for rows of these shapes only: a text model probed at
        # sequence length 1 read 214 B/row where its rows at 512 took 535 KiB.
        probe_shapes = {name: list(shape) for name, shape in engine.probe_shapes.items()}
        sizes_note = (
            " (dynamic sizes not configured are 1, longer rows take more: set "
            "server.probe_shapes, --probe-shape NAME=D1,D2,...)"
            if any(
                dim < 0
                for spec in engine.inputs
                if spec.name not in config.probe_shapes
                for dim in spec.shape[1:]
            )
            else ""
        )
        log_event(
            log,
            logging.INFO,
            "probe",
            f"probe: batch_cap={self.probe.batch_cap} (max_batch_size {config.max_batch_size}, "
            f"first out-of-memory at {_rows_or_none(self.probe.first_failing_rows)}; "
            f"stopped by {self.probe.stop_reason}) "
            f"memory_limit={'none' if limit is None else format_bytes(limit)} "
            f"probe_shapes={probe_shapes}{sizes_note} "
            f"estimate={_line(self.memory_estimate)} measured={_line(self.probe.memory_fit)} "
            f"run time by batch size { {rows: f'{ms:.2f}ms' for rows, ms in run_ms.items()} }",
            batch_cap=self.probe.batch_cap,
            max_batch_size=config.max_batch_size,
            first_failing_rows=self.probe.first_failing_rows,
            stop_reason=self.probe.stop_reason,
            memory_limit_bytes=limit,
            probe_shapes=probe_shapes,
            run_ms=run_ms,
        )
        _warn_if_the_fixed_cap_exceeds_the_fit(config, self.probe)
        self.stats = StatsRecorder([lane.name for lane in config.lanes], clock=self.clock)
        self.telemetry = telemetry or Telemetry.from_config(config, engine.providers)
        self.telemetry.event_log.arena = "device" if _on_gpu(engine) else "host arena"
        try:
            # The watermark's reading: the device's, unless a test supplies its own.
            # The weights (the static estimate's, 0 unknown) count in the idle reading.
            weights_bytes = self.memory_estimate.fixed_bytes if self.memory_estimate else 0
            # On a GPU the probe's NVML gauge reads for the watermark too (one opened, not
            # two); the CPU's takes the watermark, made after.
            watermark, self.memory_gauge = _watch_memory(
                config,
                engine,
                memory_gauge or (device if _on_gpu(engine) else None),
                weights_bytes,
                self.probe,
            )
        except BaseException:
            # Refused, no stop() will close it: its exporters' threads stayed behind.
            if telemetry is None:
                self.telemetry.close()
            raise
        sinks = [self.stats, *self.telemetry.events, *([] if events is None else [events])]
        self.events = FanOut(*sinks)
        self.scheduler = Scheduler(
            config.lanes,
            batch_cap=self.probe.batch_cap,
            run_time=RunTimeModel(self.probe.run_s),
            events=self.events,
            watermark=watermark,
            run_time_signature=engine.probe_signature,
        )
        self._long_streams = _LongStreams()  # health watches and reflection streams
        self._health = _HealthServicer(self._long_streams)
        # Triton's system shared memory regions, one registry for every port's KServe
        # front end; let go of as the server stops.
        self.shared_memory = SharedMemoryRegions(enabled=config.shared_memory)
        self._thread: SchedulerThread | None = None
        self._servicer: InferenceServicer | None = None
        self._listeners: list[_Listener] = []  # the main port's first, once started
        self._grpc_calls: GrpcCallCounts | None = None  # once the gRPC server runs
        self._stopped = asyncio.Event()
        # Set once start() has returned or raised. What a start has started (threads,
        # bound ports, the metrics endpoint) is known only then, so stop() waits for it:
        # a stop that ran in between saw nothing started, and the start went on to serve.
        self._start_ended: asyncio.Event | None = None
        # Set when the scheduler or engine thread failed; the server then stops itself.
        self.failure: LaneserveError | None = None
        # After stop: whether the engine thread ended (a run the runtime would not end
        # is still going; the process must not wait for it, see cli).
        self.threads_stopped = True
        self._grace_ended = False  # end_grace() was called (see there)
        # A stop the server began itself (its scheduler failed, its start was cancelled),
        # held so that the task is not collected; and the drain a stop() began.
        self._own_stop: asyncio.Future[None] | None = None
        self._stopping: asyncio.Future[None] | None = None
        self.port = 0
        self.priority_port: int | None = None  # bound, when configured
        self.metrics_port: int | None = None  # the Prometheus endpoint's, once started
        self.http_port: int | None = None  # KServe v2 HTTP's, once started (configured)
        self._http: HttpFrontEnd | None = None
        # Last: a server that could not be made leaves its engine free for another.
        engine.claim()

    async def start(self) -> int:
        """Binds, starts the threads and serves; returns the bound port. A LaneServer
        starts once: a second start, or one after stop(), raises RuntimeError."""
        once = "a LaneServer starts once (create another to serve again)"
        if self.state is not Lifecycle.STARTING:
            raise RuntimeError(f"LaneServer.start(): the server is {self.state.value}; {once}")
        if self._start_ended is not None:
            how = "failed" if self._start_ended.is_set() else "is in progress"
            raise RuntimeError(
                f"LaneServer.start(): the server is STARTING and its start {how}; {once}"
            )
        ended = self._start_ended = asyncio.Event()
        # A start, once begun, runs to its end, and a caller that cancels it (wait_for's
        # timeout, a task group's failure) leaves the server to stop once started:
        # cancelled in gRPC's start, after the threads started and every port was bound,
        # it left them running with nothing to stop them.
        starting = asyncio.ensure_future(self._start())

        starting.add_done_callback(lambda _: ended.set())
        starting.add_done_callback(_retrieve_error)
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            self._own_stop = asyncio.ensure_future(self.stop())
            raise
        except BaseException:
            # A start that failed (a port in use) served nothing: its engine may serve
            # another server (an embedder retrying on other ports).
            self.engine.release_claim()
            raise

    async def _start(self) -> int:
        check_open_file_limit()
        credentials = server_credentials(self.config)  # unreadable files fail before all else
        self.telemetry.count_unsent_answers((SERVICE_NAME, KSERVE_SERVICE_NAME), INFERENCE_METHODS)
        # NOT_SERVING until it serves (gRPC's health servicer begins SERVING): the main
        # port answers while the priority port starts, and refuses Infer meanwhile.
        for name in HEALTH_SERVICES:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        # Long text is decoded (the servicer) and answers of it encoded (the router) there.
        text = TextThread()
        router = OutcomeRouter(loop, text)
        thread = self._thread = SchedulerThread(
            self.scheduler,
            self.engine.run_batch,
            router.deliver,
            clock=self.clock,
            memory_gauge=self.memory_gauge,
            release_memory=self.engine.release_idle_memory,
            on_failure=lambda error: loop.call_soon_threadsafe(self._scheduler_failed, error),
        )
        if self._grace_ended:
            thread.end_grace()
        watermark = self.scheduler.watermark  # its marks are set once, when it is made
        self.telemetry.observe(
            MetricSources(
                depths=thread.depths,
                batch_cap=lambda: thread.batch_cap,
                max_batch_cap=thread.max_batch_cap,
                counts=self.stats.counts,
                grpc_calls=self.grpc_calls,
                ledger=self.ledger_counts,
                watermark=thread.watermark_state,  # what GetStats reports
                high_watermark_bytes=None if watermark is None else watermark.high_bytes,
                low_watermark_bytes=None if watermark is None else watermark.low_bytes,
                state=lambda: self.state,
                model_path=self.config.model_path,  # as GetModel names it
                model_sha256=self.engine.identity.sha256,
                memory_limit_bytes=self.engine.memory_limit_bytes,
                # None while shared memory is off: its figures absent, not 0.
                shared_memory=self.shared_memory.counts if self.shared_memory.enabled else None,
                # None until the HTTP port serves (none configured: absent throughout).
                http_requests=lambda: None if self._http is None else self._http.answered(),
                answers_unsent=self.telemetry.unsent_answers.counts,
                text_thread=text.counts,
            )
        )
        servicer = self._servicer = InferenceServicer(
            self.config,
            self.engine,
            self._thread,
            self.stats,
            state=lambda: self.state,
            clock=self.clock,
            started_s=self.clock.monotonic(),
            memory=MemoryFacts(
                limit_bytes=self.engine.memory_limit_bytes,
                probed_batch_cap=self.probe.batch_cap,
                estimate=self.memory_estimate,
                measured=self.probe.memory_fit,
            ),
            telemetry=ServiceTelemetry(
                events=self.events,
                tracer=self.telemetry.tracing or NullTracer(),
                device_utilization=self.telemetry.device_utilization,
                grpc_calls=self.grpc_calls,
            ),
            # One id for GetStats and the metrics' target_info.
            instance_id=self.telemetry.instance_id,
            text=text,
        )
        # One gRPC server per port, all in front of the same servicer and lanes: gRPC's
        # core queues the calls the event loop has not yet taken per server (and per
        # method), so calls on the priority port never wait behind a flood queued on the
        # main port.
        listeners: list[_Listener] = []  # the main port's first
        try:
            listeners.append(
                self._grpc_server(
                    servicer, credentials, self.config.port, "port", self.config.max_pending_calls
                )
            )
            if self.config.priority_port >= 0:
                listeners.append(
                    self._grpc_server(
                        servicer,
                        credentials,
                        self.config.priority_port,
                        "priority_port",
                        self.config.priority_max_pending_calls,
                    )
                )
            self.metrics_port = self.telemetry.serve_metrics(
                self.config.host, self.config.metrics_port, https_context(self.config)
            )
        except BaseException:
            await _give_back([each.server for each in listeners])  # no acceptor started
            self.telemetry.close()  # its exporter threads, and the metrics endpoint
            raise
        self.port = listeners[0].port
        if len(listeners) > 1:
            self.priority_port = listeners[1].port
        servers = [each.server for each in listeners]
        self._thread.start()
        try:
            for each in servers:
                await each.start()
            for listener in listeners:
                listener.acceptors.start()
            self.http_port = await self._start_http(servicer)
        except BaseException:
            # gRPC's own start, or the HTTP port's, failed: what this start began is
            # stopped here, since a stop() after a failed start finds nothing started.
            # Nothing was admitted (the state is not SERVING), so no request is left
            # without its answer.
            await self._stop_http()
            await asyncio.to_thread(self._thread.close, join_timeout_s=RUNNING_BATCH_WAIT_S)
            await _give_back(servers)
            for listener in listeners:
                await listener.acceptors.wait_closed(ACCEPTORS_CLOSE_S)
            self.telemetry.close()
            raise
        self._grpc_calls = GrpcCallCounts(set().union(*(each.channelz_ids for each in listeners)))
        self._listeners = listeners
        self.state = Lifecycle.SERVING
        if self.failure is not None:  # the scheduler failed while the server started
            self._own_stop = asyncio.ensure_future(self.stop())
            return self.port
        for name in HEALTH_SERVICES:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        identity = self.engine.identity
        log_event(
            log,
            logging.INFO,
            "startup",
            # Which model this instance ran: its files' hash (short here, whole in the
            # field) and its own version, as GetModel reports them.
            f"serving {self.config.model_path} (sha256 {identity.sha256[:12] or 'unknown'}, "
            f"model_version {'none' if identity.version is None else identity.version}) "
            f"on {host_port(self.config.host, self.port)}"
            + ("" if self.priority_port is None else f", priority port {self.priority_port}")
            + ("" if self.http_port is None else f", HTTP port {self.http_port}"),
            model=self.config.model_path,
            model_sha256=identity.sha256,
            model_version=identity.version,
            port=self.port,
            priority_port=self.priority_port,
            http_port=self.http_port,
            providers=self.engine.providers,
            batch_cap=self.scheduler.batch_cap,
            max_batch_size=self.config.max_batch_size,
            memory_limit_bytes=self.engine.memory_limit_bytes,
            lanes=[lane.name for lane in self.config.lanes],
            metrics_port=self.metrics_port,
            tracing=self.telemetry.tracing is not None,
        )
        return self.port

    def _bare_grpc_server(self, max_pending_calls: int) -> grpc.aio.Server:
        """A gRPC server with laneserve's options, no service yet (see `_grpc_server`)."""
        limit = self.config.max_message_bytes
        # gRPC inflates a compressed request up to `limit` before laneserve reads a byte
        # of it (78 KiB of gzip took 0.4 s to refuse): off, none is inflated.
        compression = (
            []
            if self.config.compressed_requests
            else [("grpc.compression_enabled_algorithms_bitset", IDENTITY_ONLY_ALGORITHMS)]
        )
        return grpc.aio.server(
            interceptors=self.telemetry.interceptors,
            # max_concurrent_rpcs is the CallGate's: gRPC's count misses the calls the
            # ParallelAcceptors take.
            maximum_concurrent_rpcs=None,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # A port another server listens on is refused, not shared: with gRPC's
                # default (SO_REUSEPORT) the kernel would split the connections.
                ("grpc.so_reuseport", 0),
                # gRPC ignores an option name it does not know: this is the string the
                # core reads (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS's).
                ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
                # ... and on a connection with no call too (else one per 2 h is taken):
                # grpc-js' keepalive_permit_without_calls and grpc-go's
                # PermitWithoutStream ping idle connections. At one a minute at most, an
                # idle connection costs a few bytes a minute.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
                *connection_limit(),
                *compression,
                *pending_call_limits(max_pending_calls),
            ],
        )

    def _grpc_server(
        self,
        servicer: InferenceServicer,
        credentials: grpc.ServerCredentials | None,
        port: int,
        setting: str,
        max_pending_calls: int,
    ) -> _Listener:
        """A gRPC server with every service, bound to `port` on the configured host, its
        core holding at most `max_pending_calls` calls not yet taken. Raises OSError
        naming `setting` when it cannot bind."""
        # Its own Channelz id: the ids made while it was made. Read with no await between,
        # and under a lock of the process's: ids read around start()'s awaits, or while
        # a server started on another thread's loop, counted that server's as this one's.
        thread = self._thread
        assert thread is not None
        gate = CallGate(
            # The probed cap, not the lowest in force: one shape's out-of-memory leaves
            # the others' batches at it (a number fixed at start, not asked per call).
            self.config.max_concurrent_rpcs,
            ACCEPT_BELOW_BATCHES * thread.max_batch_cap,
        )
        with _SERVERS_BEING_MADE:
            known = GrpcCallCounts.server_ids()
            server = self._bare_grpc_server(max_pending_calls)
            channelz_ids = frozenset(GrpcCallCounts.server_ids() - known)
            # Its handlers registered under the lock too: gRPC's core aborted the process
            # (once in a CI run) when Channelz listed the servers on one thread while
            # another registered a server's methods.
            handlers = add_to_server(servicer, server, gate)
            # KServe v2 / Triton clients' service, in front of the same servicer, counted
            # by the same gate (server/kserve.py).
            handlers |= add_kserve_to_server(self._kserve_servicer(servicer), server, gate)
        # Both front ends' inference calls taken several at a time (a ModelInfer had been
        # taken at grpc.aio's own pace: 0.75x Infer's calls/s at 32 callers).
        acceptors = ParallelAcceptors(
            server,
            INFERENCE_METHODS,
            handlers,
            self.telemetry.interceptors,
            gate,
            count=INFER_ACCEPTORS,
        )
        # gRPC's own services, as their add_*_to_server and enable_server_reflection add
        # them, each request read only up to a bound (see `add_grpc_service`).
        add_grpc_service(server, health.SERVICE_NAME, _PortHealth(self._health, gate))
        # gRPC's own view: calls started, succeeded and failed, sockets. Calls its core
        # refused (max_pending_calls) count as started and never end.
        add_grpc_service(server, CHANNELZ_SERVICE_NAME, channelz.aio.ChannelzServicer())
        reflection_servicer = reflection.aio.ReflectionServicer(
            (
                SERVICE_NAME,
                KSERVE_SERVICE_NAME,
                health.SERVICE_NAME,
                CHANNELZ_SERVICE_NAME,
                reflection.SERVICE_NAME,
            )
        )
        # Only v1alpha is served: a grpc.reflection.v1 service added here needs its own
        # streams gated too.
        add_grpc_service(
            server,
            reflection.SERVICE_NAME,
            _PortReflection(reflection_servicer, gate, self._long_streams),
        )
        address = host_port(self.config.host, port)
        bound = 0
        try:
            bound = (
                server.add_insecure_port(address)
                if credentials is None
                else server.add_secure_port(address, credentials)
            )
        except RuntimeError as error:  # what grpc raises when it cannot bind
            log_event(
                log,
                logging.DEBUG,
                "bind_failed",
                f"binding {address}: {error}",
                address=address,
                error=str(error),
            )
        if bound == 0:
            refusal = _bind_refusal(self.config.host, port, setting)
            # An OSError, as ever, for an embedder's start (`serve` checked the ports).
            raise OSError(
                f"cannot listen on {address} (server.{setting}): gRPC could not bind it; "
                "expected a local address and a free port (0: any free port)"
                if refusal is None
                else str(refusal)
            )
        return _Listener(server, bound, acceptors, channelz_ids)

    def grpc_calls(self) -> GrpcCalls | None:
        """gRPC's own call counts, summed over this server's ports; None before start."""
        return None if self._grpc_calls is None else self._grpc_calls.read()

    def ledger_counts(self) -> LedgerCounts | None:
        """The idempotency ledger's joins, replays and replay cache; None before start.
        Safe from any thread (the metric reader's)."""
        servicer = self._servicer
        return None if servicer is None else servicer.ledger_counts()

    def _kserve_servicer(self, servicer: InferenceServicer) -> KServeServicer:
        """KServe v2 / Triton clients' service in front of `servicer`: one per front end
        (each gRPC port, the HTTP port), all in front of the same lanes and regions."""
        return KServeServicer(
            servicer,
            self.config,
            self.engine.inputs,
            self.engine.outputs,
            self._health,
            totals=self.stats.cumulative,
            # ONNX Runtime's CUDA provider runs on its default device, 0: the first GPU
            # CUDA_VISIBLE_DEVICES lists (memory.session_gpu).
            gpu_id=0 if _on_gpu(self.engine) else None,
            regions=self.shared_memory,
            trace_settings=TraceSettings(
                tracing=self.telemetry.tracing is not None,
                root=self.telemetry.root_sampler,
                model_name=self.config.served_model_name,
            ),
        )

    async def _start_http(self, servicer: InferenceServicer) -> int | None:
        """Serves KServe v2's HTTP protocol on server.http_port, in front of `servicer`
        (the main port's default lane); returns the port bound (None: not configured).
        Raises ConfigError naming server.http_port (or server.host) where it cannot
        bind."""
        if self.config.http_port < 0:
            return None
        http = self._http = HttpFrontEnd(
            self._kserve_servicer(servicer),
            max_calls=self.config.max_concurrent_rpcs,
            max_body_bytes=self.config.max_message_bytes,
            compressed_requests=self.config.compressed_requests,
            spans=self.telemetry.http_spans,
            events=self.telemetry.event_log,
        )
        host, port = bare_host(self.config.host), self.config.http_port
        tls = https_context(self.config)
        try:
            return await http.start(host, port, tls)
        except OSError as error:
            refusal = _bind_refusal(self.config.host, port, "http_port")
            raise (refusal or error) from None

    async def _stop_http(self) -> None:
        if self._http is not None:
            await self._http.stop()

    async def announce_not_serving(self) -> None:
        """Health says NOT_SERVING from now on, for good (gRPC's health servicer takes no
        status after it), while the server still admits and serves: a lame-duck period
        before `stop` (`drain_delay_s`), for health checks to send callers elsewhere."""
        await self._health.enter_graceful_shutdown()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains: refuses new work, lets queued work finish within the grace period (or
        until `end_grace`), answers the rest UNAVAILABLE, then stops listening. Safe to
        call twice, and before, during or after a `start` (one in progress ends first).
        A caller that cancels it ends the grace (`end_grace`) and stops waiting; the stop
        goes on to its end (`wait_stopped`)."""
        if self._start_ended is not None:
            await self._start_ended.wait()
        if self.state in (Lifecycle.DRAINING, Lifecycle.STOPPED):
            await self._stopped.wait()
            return
        if not self._listeners:  # never started, or its start failed: nothing to drain
            self.state = Lifecycle.STOPPED
            if self._servicer is not None:
                self._servicer.close()
            self.telemetry.close()
            self.shared_memory.close()
            await self._health.enter_graceful_shutdown()  # as every stopped server says
            self._stopped.set()
            return
        self.state = Lifecycle.DRAINING
        # A stop, once begun, runs to its end. Cancelled mid-drain (wait_for's timeout),
        # it said STOPPED with its ports open, its threads running and admitted calls
        # unanswered, and every later stop returned at once.
        stopping = self._stopping = asyncio.ensure_future(
            self._drain_then_stop(self.config.drain_grace_s if grace_s is None else grace_s)
        )
        stopping.add_done_callback(_retrieve_error)
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            self.end_grace()  # the caller gave up waiting: what is queued is answered now
            raise

    async def _drain_then_stop(self, grace_s: float) -> None:
        try:
            drained = await self._drain(grace_s)
        finally:
            assert self._servicer is not None
            # The ledger's sweep timer goes, and none is armed again (an answer of a run
            # that would not end may still be stored): no timer outlives the server.
            self._servicer.close()
            self.telemetry.close()
            self.shared_memory.close()  # the servers have stopped: no call reads a region
            self.state = Lifecycle.STOPPED
            self._stopped.set()
        log_event(log, logging.INFO, "shutdown", "stopped", drained=drained)

    async def _drain(self, grace_s: float) -> bool:
        assert self._servicer is not None
        assert self._thread is not None
        self._servicer.stop_reading_streams()
        await self._health.enter_graceful_shutdown()
        started_s = self.clock.monotonic()
        # Requests read before the drain whose long text is still being decoded (on a
        # thread) are admitted as they would have been decoded on the event loop: the
        # scheduler stops admitting once they are, within the grace.
        decoding = await self._servicer.reads_finished(0.0 if self._grace_ended else grace_s)
        self._thread.stop_accepting()
        left_s = max(0.0, grace_s - (self.clock.monotonic() - started_s))
        drained = await asyncio.to_thread(self._thread.wait_drained, left_s) and not decoding
        if not drained:
            self._log_drain_incomplete(grace_s, self.clock.monotonic() - started_s, decoding)
        await asyncio.to_thread(
            functools.partial(
                self._thread.close,
                DrainingError("server shut down before this request could run"),
                running_error=DrainingError(
                    "server shut down while this request's batch was running; its answer "
                    "was not kept (it may have run)"
                ),
                join_timeout_s=0.0,
            )
        )
        # Every request has its answer: a run still in the runtime is ended (a process
        # that exits while one runs aborts), and waited for a moment.
        self.engine.terminate_runs()
        stopped = await asyncio.to_thread(self._thread.join, RUNNING_BATCH_WAIT_S)
        self.threads_stopped = stopped
        if not stopped:
            log_event(
                log,
                logging.WARNING,
                "batch_still_running",
                f"a batch still runs {RUNNING_BATCH_WAIT_S:.1f}s after the drain; stopping "
                "without waiting for it",
                waited_s=RUNNING_BATCH_WAIT_S,
            )
        # No batch runs any more: the answers of the last ones whose text was encoded off
        # the loop reach it now.
        await self._servicer.answers_encoded(TEXT_ANSWERS_WAIT_S)
        # Every RPC now has its answer; give them a moment to be written. Health watches
        # (NOT_SERVING sent) and reflection streams end now: the grace would wait for
        # them in full.
        self._long_streams.end()
        await self._read_what_grpc_holds()
        await asyncio.gather(
            *(each.server.stop(grace=2.0) for each in self._listeners),
            self._stop_http(),
        )
        for each in self._listeners:  # their asks failed as the servers stopped
            await each.acceptors.wait_closed(ACCEPTORS_CLOSE_S)
        return drained

    async def _read_what_grpc_holds(self) -> None:
        """Waits while the event loop reads (and answers DRAINING) the calls gRPC's core
        still holds, so that gRPC's stop has none left to cancel. gRPC does not say how
        many it holds; "started, not ended" holds them, plus the calls the core refused
        or dropped (never ended) and a few in progress. It falls while the held ones are
        read and stops falling when none are left: then gRPC stops. Not "until no call
        ends": a client resending on its open connection, DRAINING after DRAINING, ends
        calls all the time, and would wait for gRPC's GOAWAY (its sign to reconnect,
        elsewhere) for the whole bound. Calls arriving faster than the loop reads keep
        it from falling too: under such a flood those gRPC cancels are not avoidable."""
        assert self._grpc_calls is not None
        loop = asyncio.get_running_loop()
        until_s = loop.time() + CORE_QUEUE_WAIT_S
        calls = self._grpc_calls.read()
        while calls is not None and loop.time() < until_s:
            await asyncio.sleep(CORE_QUEUE_SETTLE_S)
            before, calls = calls, self._grpc_calls.read()
            if calls is not None and calls.unended >= before.unended:
                return

    def _log_drain_incomplete(self, grace_s: float, waited_s: float, decoding: int) -> None:
        """What the drain left: cut short by a second signal (`end_grace`), or its grace
        over; how much was queued, which batch ran, and how many requests' long text was
        still being decoded (`decoding`), all of it answered UNAVAILABLE. A drain cut short
        after a moment said it "ended after at most" its grace."""
        assert self._thread is not None
        cut_short = self._thread.grace_ended
        depths = self._thread.depths()
        queued_requests = sum(depth.queued_requests for depth in depths)
        queued_rows = sum(depth.queued_rows for depth in depths)
        running = self.telemetry.event_log.running_batch
        why = (
            f"drain cut short by a second signal after {waited_s:.1f}s of its {grace_s:.1f}s grace"
            if cut_short
            else f"drain grace of {grace_s:.1f}s over"
        )
        queued = (
            f"{queued_requests} request(s) ({queued_rows} rows) still queued"
            if queued_requests
            else "nothing queued"
        )
        if decoding:
            queued += f", {decoding} request(s) whose text was still being decoded"
        ran = "no batch" if running is None else f"batch {running.batch_id} ({running.rows} rows)"
        # The operator's second signal asked for it; a grace too short for the queue is
        # the operator's setting to change.
        remedy = (
            ""
            if cut_short
            else " (raise --drain-grace-s for the queue to finish, keeping --drain-delay-s "
            "plus it below the supervisor's kill grace: Kubernetes' "
            "terminationGracePeriodSeconds, systemd's TimeoutStopSec)"
        )
        log_event(
            log,
            logging.WARNING,
            "drain_incomplete",
            f"{why} with {queued} and {ran} running; answering them UNAVAILABLE{remedy}",
            grace_s=grace_s,
            waited_s=round(waited_s, 3),
            cut_short=cut_short,
            queued_requests=queued_requests,
            queued_rows=queued_rows,
            running_batch_id=None if running is None else running.batch_id,
            running_rows=0 if running is None else running.rows,
            decoding_requests=decoding,
        )

    def _scheduler_failed(self, error: LaneserveError) -> None:
        """The scheduler or engine thread failed for good, or the engine found the session
        broken (every live request has its answer): the server stops, so that health
        checks say NOT_SERVING and load balancers and supervisors act, instead of every
        call failing behind SERVING. The line says which, with the error: after
        session_broken it had said "the scheduler failed", the scheduler being sound."""
        if self.failure is not None:
            return
        self.failure = error
        failed = (
            f"the model's session is broken ({error.cause})"
            if isinstance(error, SessionBrokenError)
            else "the scheduler failed"
        )
        log_event(
            log,
            logging.ERROR,
            "scheduler_failed",
            f"{failed}; stopping (the process must be restarted)",
            error=error.message,
        )
        if self.state is Lifecycle.SERVING:  # while STARTING, start() stops it at its end
            self._own_stop = asyncio.ensure_future(self.stop())

    def end_grace(self) -> None:
        """A drain in progress (or the next one) answers what is queued now instead of
        waiting out its grace (a second SIGTERM or Ctrl-C)."""
        self._grace_ended = True  # for a thread not made yet: asked before start() made it
        if self._thread is not None:
            self._thread.end_grace()
        if self._servicer is not None:
            self._servicer.stop_waiting_for_text()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
