"""Channels: plain or TLS (optionally mutual), with the options every laneserve call needs."""

from __future__ import annotations

import dataclasses
import ipaddress
import numbers
import os
import re
import reprlib
import ssl
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from laneserve.client._request import checked_str

__all__ = ["DEFAULT_TARGET", "TlsConfig"]

DEFAULT_TARGET = "127.0.0.1:50051"
# The smallest message limit taken, the server's own minimum: an error answer quoting a
# request_id fits in it, and a bulk job sends it as the largest answer it reads (the
# server refuses a stream that asks for less).
MIN_MESSAGE_BYTES = 1024
# The server's default gRPC message limit (ServerConfig.max_message_bytes).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The largest message limit taken: gRPC's limits are C ints (a larger one it refused with
# a ValueError naming its own option, 'grpc.max_receive_message_length', not the argument).
MAX_MESSAGE_BYTES = 2**31 - 1
# The gRPC option that bounds what a channel sends: set from max_message_bytes, unless a
# caller's `options` replace it. gRPC fails a larger request itself ("Sent message larger
# than max"), as if a server had refused it.
SEND_LIMIT_OPTION = "grpc.max_send_message_length"
_USER_AGENT = "laneserve-client/0.1.0"
# HTTP/2 pings find a connection that went silent (a host gone without a reset, a network
# black hole): without them a bulk job's stream, which has no deadline, waited for its
# answers for ever. A ping after 5 min without traffic, while a call is open (what a
# default gRPC server takes: more often are "too many pings", and at the third it hangs
# up; laneserve's takes one a minute, server.app.MIN_CLIENT_PING_INTERVAL_MS, with or
# without a call), and a ping unanswered for 20 s ends the connection; a job then resumes
# on a new call. A caller's `options` replace these, key by key.
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 300_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.ping_timeout_ms", 20_000),
)
# gRPC waits longer and longer between attempts to reach a server that is down (its
# attempts at about 1, 2.6, 5, 9, 16, 26, 43 s after the first failure; the wait grows
# to 120 s), failing calls meanwhile with its last error: a server back 25 s after a
# crash was not tried again for 17 s, and a bulk job, which opens new calls for
# STREAM_RESUME_S after its last answer, gave up with the server up (a review). Capped,
# the server is tried about every 2 s (gRPC adds ±20 % jitter). A caller's `options`
# replace it.
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.max_reconnect_backoff_ms", 2_000),)
# gRPC's rules for metadata (validate_metadata.cc): a key is a lower-case HTTP/2 header
# name; a key ending in -bin carries bytes, any other key printable ASCII text.
# Metadata given to a client is text: str values.
_METADATA_KEY = re.compile(r"[0-9a-z_.-]+")
_METADATA_TEXT = re.compile(r"[\x20-\x7e]*")
# InferStream call metadata: the largest message this client reads. gRPC ends the whole
# call on a larger answer, every other item unanswered; told, a laneserve server answers
# such an item ANSWER_TOO_LARGE alone (it alone knows an answer's size before sending it:
# an output's size may depend on the item's inputs). The client sets it from its
# max_message_bytes: a caller's own value of it is refused (the server refuses a call
# with two values of it, and a bulk job sends its own).
RECEIVE_LIMIT_KEY = "laneserve-max-receive-bytes"
# The ports a client can connect to. gRPC takes a larger port number modulo 65536 (and
# -1 as 65535): "127.0.0.1:105405" connected to port 39869, to whatever listens there.
MAX_PORT = 65535
# gRPC's target forms: a URI whose scheme names a resolver, else `host[:port]` resolved
# by DNS (gRPC prepends "dns:///"). A URI scheme, as gRPC's parser reads one.
_URI_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)", re.DOTALL)
# The resolvers gRPC's core registers (grpcio 1.85), by scheme; gRPC reads a scheme in
# any case ("DNS:///host:99999" is dns's, and wraps its port as dns: does). Those whose
# addresses are `host[:port]`:
_HOST_PORT_SCHEMES = frozenset({"dns", "ipv4", "ipv6"})
# And those whose addresses are of other forms (a socket's path, an xDS name): not checked
# here. "vsock" where the build has it (grpcio 1.85's Linux wheel resolves it by DNS);
# "fake", gRPC's test resolver, is registered too.
_OTHER_SCHEMES = frozenset(
    {"unix", "unix-abstract", "vsock", "xds", "google-c2p", "google-c2p-experimental", "fake"}
)
_KNOWN_SCHEMES = _HOST_PORT_SCHEMES | _OTHER_SCHEMES
# The schemes a refusal offers (not the test resolver, nor a superseded name).
_SCHEMES_SHOWN = "dns:, ipv4:, ipv6:, unix:, unix-abstract:, vsock:, xds: or google-c2p:"
# The forms a refusal of a malformed host:port offers.
_FORMS = (
    "expected HOST:PORT, [IPv6]:PORT (an IPv6 address in brackets), or a gRPC target URI of "
    f"{_SCHEMES_SHOWN}"
)
# A target quoted in a message: the caller's, of any length.
_TARGET_REPR = reprlib.Repr()
_TARGET_REPR.maxstring = 200


@dataclasses.dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS settings. All PEM bytes; ``None`` means gRPC's default (the system roots,
    no client certificate, the target's host name)."""

    root_certificates: bytes | None = dataclasses.field(default=None, repr=False)
    # Both or neither: the client's key and certificate chain, for mutual TLS.
    private_key: bytes | None = dataclasses.field(default=None, repr=False)
    certificate_chain: bytes | None = dataclasses.field(default=None, repr=False)
    # The name to check the server's certificate against, when it is not the target's.
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError(
                "TlsConfig: private_key and certificate_chain go together (mutual TLS); "
                "got only one of them"
            )

    @classmethod
    def from_files(
        cls,
        *,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
    ) -> TlsConfig:
        """Reads PEM files: `ca` the roots to trust, `cert` and `key` the client's own."""

        def read(path: str | Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        check_pem_files(ca, cert, key, names=("ca", "cert", "key"))
        return cls(read(ca), read(key), read(cert), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


def check_pem_files(
    ca: str | Path | None,
    cert: str | Path | None,
    key: str | Path | None,
    *,
    names: tuple[str, str, str],
) -> None:
    """Loads the PEM files as Python's TLS would, raising ValueError that names the one
    (by `names`: how the caller calls the ca, cert and key) that cannot be used: gRPC
    takes any bytes and fails each call's handshake instead ("Failed to create security
    handshaker"), retried as if the server were down, naming neither file nor fault."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # OpenSSL's security level refused keys and signatures gRPC's TLS (BoringSSL, which
    # has none) takes: an RSA-1024 or SHA-1 client certificate that worked was refused.
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    ca_name, cert_name, key_name = names
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except ssl.SSLError as error:
            raise ValueError(
                f"{ca_name} {ca}: holds no PEM CA certificate ({error.reason or error}); "
                "expected the PEM certificate(s) of the CA that signed the server's"
            ) from error
        if context.cert_store_stats()["x509"] == 0:
            # A file of CRLs (with a key or not) loads: gRPC took it as the roots, and
            # every call failed, as with a file that does not load.
            raise ValueError(
                f"{ca_name} {ca}: holds no PEM CA certificate (only CRLs or other PEM "
                "blocks); expected the PEM certificate(s) of the CA that signed the server's"
            )
    if cert is not None and key is not None:

        def refuse_passphrase() -> str:
            # Called only for an encrypted key; without it OpenSSL prompts on the terminal.
            raise ValueError(
                f"{key_name} {key}: an encrypted private key; gRPC takes no passphrase: "
                "expected an unencrypted PEM key"
            )

        try:
            context.load_cert_chain(cert, key, password=refuse_passphrase)
        except ssl.SSLError as error:
            raise ValueError(
                f"{cert_name} {cert} and {key_name} {key}: not a PEM certificate and its "
                f"private key ({error.reason or error}); expected PEM files of a matching "
                "certificate and key"
            ) from error


def check_target(target: object, *, what: str = "target") -> str:
    """`target`, checked where gRPC would take it for another address or fail every call
    with words that name neither (`what`: how the caller names it). Only what is certainly
    wrong is refused: a `host:port` (bare, or after ``dns:``, ``ipv4:``, ``ipv6:``, in
    any case) whose port is not a whole number from 1 to 65535, that holds whitespace
    (a target with a space before it, whatever follows), or that has more than one ':'
    and is no IPv6 address (``127.0.0.1:50051:1``); a URI of a scheme gRPC has no
    resolver for (``http://host:port``), and an empty target. A host alone (gRPC's
    default port, 443), ``::1``, ``[::1]:port``, ``unix:`` paths and gRPC's other URIs
    pass as they are.

    Raises:
        TypeError: `target` is not a str.
        ValueError: an empty target, a malformed `host:port`, a port out of range, or a
            scheme gRPC lacks, naming the target.
    """
    if not isinstance(target, str):
        raise TypeError(
            f"{what} {reprlib.repr(target)}: expected str (HOST:PORT), got {type(target).__name__}"
        )
    if not target:
        # gRPC: a bare UNKNOWN "Failed to create channel to ''" at each call, and its
        # C-core's lines on stderr.
        raise ValueError(
            f"{what} '': expected HOST:PORT (or a gRPC target URI such as unix:/path/to.sock)"
        )
    shown = _TARGET_REPR.repr(target)
    scheme, addresses = _resolution(target)
    if scheme not in _KNOWN_SCHEMES:
        # gRPC looked the whole target up as one DNS name, and failed every call as if
        # no server were there ("Misformatted domain name"), retries and all.
        raise ValueError(
            f"{what} {shown}: gRPC has no resolver for its scheme {scheme + ':'!r}, and "
            f"it is no HOST:PORT; expected HOST:PORT (no scheme), or a gRPC target URI of "
            f"{_SCHEMES_SHOWN}"
        )
    expected = f"expected HOST:PORT with a port from 1 to {MAX_PORT}"
    for address in addresses:
        # Both malformed, not unreachable: gRPC looked each up as one DNS name and failed
        # every call as if no server were there ("Misformatted domain name"), retries and
        # all. (gRPC reads an address of more than one ':', unbracketed, as an IPv6
        # address without a port.)
        if any(character.isspace() for character in address):
            raise ValueError(
                f"{what} {shown}: whitespace in the address {_TARGET_REPR.repr(address)} "
                f"(no host name or port holds any: strip it); {_FORMS}"
            )
        if not address.startswith("[") and address.count(":") > 1 and not _is_ipv6(address):
            raise ValueError(
                f"{what} {shown}: the address {_TARGET_REPR.repr(address)} has more than one "
                f"':' and is no IPv6 address; {_FORMS}"
            )
        port = _port_of(address)
        if port is None:
            continue
        if not port:  # gRPC takes it for its default port
            raise ValueError(
                f"{what} {shown}: no port after the ':'; {expected}, or HOST alone for "
                "gRPC's default (443)"
            )
        if not (port.isascii() and port.isdigit()):  # gRPC: -1 is 65535, " 80" 80
            raise ValueError(
                f"{what} {shown}: port {_TARGET_REPR.repr(port)} is not a whole number; {expected}"
            )
        digits = port.lstrip("0")
        if len(digits) > len(str(MAX_PORT)) or not 1 <= int(digits or "0") <= MAX_PORT:
            raise ValueError(
                f"{what} {shown}: port {_TARGET_REPR.repr(port)} is out of range; "
                # Only DNS wraps it: ipv4: and ipv6: refuse it ("target uri is not valid").
                f"{expected}{_wrapped(digits) if scheme == 'dns' else ''}"
            )
    return target


def _wrapped(digits: str) -> str:
    """What gRPC makes of a port over MAX_PORT: it reads one that fits an int (up to
    2**31 - 1; a longer one it refuses) and keeps its low 16 bits."""
    if len(digits) > len(str(2**31)) or not MAX_PORT < int(digits or "0") < 2**31:
        return ""
    return f" (gRPC would connect to port {int(digits) % (MAX_PORT + 1)} instead)"


def _resolution(target: str) -> tuple[str, list[str]]:
    """(the scheme of the resolver gRPC gives `target` to, in lower case; the
    `host[:port]` addresses it reads there): [] for a resolver whose addresses are of
    another form (a unix socket's path, an xDS name), and for a scheme gRPC has no
    resolver for where the target is no `host[:port]` either ("http://host:port")."""
    uri = _URI_SCHEME.fullmatch(target)
    if uri is None:  # "127.0.0.1:50051", "[::1]:50051": no scheme, resolved by DNS
        return "dns", [target]
    scheme, rest = uri[1].lower(), uri[2]
    if scheme == "dns":  # dns:host:port, dns:///host:port, dns://resolver/host:port
        if rest.startswith("//"):
            rest = rest[2:].partition("/")[2]
        return scheme, [rest.removeprefix("/")]
    if scheme in _HOST_PORT_SCHEMES:  # ipv4:, ipv6: a comma-separated list of addresses
        return scheme, [address.removeprefix("/") for address in rest.removeprefix("//").split(",")]
    if scheme in _OTHER_SCHEMES:
        return scheme, []
    # A scheme gRPC has no resolver for: it resolves the whole target by DNS, as a
    # `host[:port]`. "localhost:50051" parses as a URI of scheme "localhost", and
    # "fe80::1" of scheme "fe80" (gRPC reads more than one ':' unbracketed as an IPv6
    # address without a port); no host name holds a '/' or another ':'.
    if not rest.startswith("/") and (target.count(":") == 1 or _is_ipv6(target)):
        return "dns", [target]
    return scheme, []


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)  # with a %zone too: "fe80::1%eth0"
    except ValueError:
        return False
    return True


def _port_of(address: str) -> str | None:
    """The port of a `host[:port]` address as gRPC splits it; None for none (or for an
    address gRPC refuses itself, an unclosed "[")."""
    if address.startswith("["):  # [v6 address] or [v6 address]:port
        _, close, after = address.partition("]")
        return after[1:] if close and after.startswith(":") else None
    if address.count(":") != 1:  # no port, or a bare IPv6 address (gRPC's reading)
        return None
    return address.partition(":")[2]


def checked_metadata(metadata: object) -> tuple[tuple[str, str], ...]:
    """A client's `metadata` (a mapping of key to value, or any other iterable of (key,
    value) pairs, as gRPC takes it: `dict.items()`, a generator), each pair as
    `metadata_pair` makes it.

    Raises:
        TypeError: `metadata` is neither, or a key or value is not a str, naming it.
        ValueError: a pair gRPC would refuse, or a key the client sets itself.
    """
    if metadata is None:
        return ()
    if isinstance(metadata, Mapping):
        pairs: list[object] = list(metadata.items())
    elif isinstance(metadata, Iterable) and not isinstance(metadata, (str, bytes)):
        pairs = list(metadata)
    else:
        raise TypeError(
            "metadata: expected a mapping of key to value or an iterable of (key, value) "
            f"pairs, got {type(metadata).__name__} ({reprlib.repr(metadata)})"
        )
    checked = []
    for pair in pairs:
        if not (isinstance(pair, Sequence) and not isinstance(pair, (str, bytes))) or (
            len(pair) != 2  # noqa: PLR2004 - a pair
        ):
            raise TypeError(
                f"metadata: expected (key, value) pairs, got {reprlib.repr(pair)} "
                f"({type(pair).__name__}); a mapping, or [(key, value), ...]"
            )
        key, value = pair
        for field, text in (("key", key), ("value", value)):
            checked_str(f"metadata {field}", text)
        checked.append(metadata_pair(key, value))
    return tuple(checked)


def metadata_pair(key: str, value: str) -> tuple[str, str]:
    """(key in lower case, value), as gRPC sends it. Raises ValueError naming the key when
    gRPC would refuse the pair: it fails every call with a TypeError or an internal error
    that names neither the key nor the rule; and for a key the client sets itself."""
    lower = key.lower()
    if not (key.isascii() and _METADATA_KEY.fullmatch(lower)):
        raise ValueError(
            f"metadata key {key!r}: expected one or more ASCII letters, digits, '-', '_' "
            "or '.' (gRPC's rule for keys; they are sent in lower case)"
        )
    if lower.endswith("-bin"):
        raise ValueError(
            f"metadata key {key!r} ends in '-bin', gRPC's mark of a binary (bytes) value, "
            "and the client sends text values; expected a key without '-bin'"
        )
    if not _METADATA_TEXT.fullmatch(value):
        raise ValueError(
            f"metadata key {key!r}: value {value!r} is not printable ASCII; expected "
            "characters from ' ' to '~' (gRPC's rule for text values)"
        )
    if lower == RECEIVE_LIMIT_KEY:
        raise ValueError(
            f"metadata key {key!r}: the client sends its own value of it, its "
            "max_message_bytes (the server refuses a bulk job's call with two values); "
            "expected the client's max_message_bytes=N instead"
        )
    return lower, value


def checked_integer(field: str, value: object) -> int:
    """`value`, a caller's integer argument `field`, as an int: any `numbers.Integral`
    (numpy's integers too) but a bool (a count of True is a caller's bug). The client's
    one rule for integer arguments; each caller checks the range itself (ValueError).

    Raises:
        TypeError: `value` is no integer, naming `field`.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{field}: expected an integer, got {reprlib.repr(value)}")
    return int(value)


def checked_message_bytes(max_message_bytes: object) -> int:
    """A client's `max_message_bytes`, as an int. gRPC's -1 ("no limit") is refused: the
    stream client sizes its items within the limit (an item over it would fail the whole
    call).

    Raises:
        TypeError: it is no integer.
        ValueError: under MIN_MESSAGE_BYTES or over MAX_MESSAGE_BYTES.
    """
    limit = checked_integer("max_message_bytes", max_message_bytes)
    if not MIN_MESSAGE_BYTES <= limit <= MAX_MESSAGE_BYTES:
        raise ValueError(
            f"max_message_bytes: expected a whole number of bytes from {MIN_MESSAGE_BYTES} "
            f"to {MAX_MESSAGE_BYTES} (2**31 - 1, the largest limit gRPC takes), got {limit}"
        )
    return limit


def send_limit(
    options: Sequence[tuple[str, Any]], max_message_bytes: int
) -> tuple[int, str] | None:
    """The largest message a channel of `options` (`channel_options`' merged ones) sends,
    as gRPC reads SEND_LIMIT_OPTION, and the setting a refusal names (max_message_bytes,
    unless the caller's option replaced it); None: no limit (gRPC's -1, any negative
    number, or a value that is not an int, which gRPC ignores)."""
    value = dict(options).get(SEND_LIMIT_OPTION)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    named = (
        "max_message_bytes" if value == max_message_bytes else f"the option {SEND_LIMIT_OPTION!r}"
    )
    return value, named


def channel_options(
    tls: TlsConfig | None, max_message_bytes: int, extra: Sequence[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    """The channel's gRPC options, `max_message_bytes` checked by `checked_message_bytes`."""
    limit = checked_message_bytes(max_message_bytes)
    options: dict[str, Any] = {
        "grpc.max_receive_message_length": limit,
        "grpc.max_send_message_length": limit,
        "grpc.primary_user_agent": _USER_AGENT,
        **dict(KEEPALIVE_OPTIONS),
        **dict(RECONNECT_OPTIONS),
    }
    if tls is not None and tls.server_name:
        options["grpc.ssl_target_name_override"] = tls.server_name
    options.update(extra)  # the caller's, last: gRPC's reading of a repeated key is its own
    return list(options.items())


@dataclasses.dataclass(frozen=True, slots=True)
class ChannelSpec:
    """A client's channel, checked when the client is made (`channel_spec`) and opened by
    its first call (`open_channel`), on that call's event loop: a gRPC channel binds to
    the loop it is made on, and none may be running when the client is made (at import)."""

    target: str
    # None: plaintext.
    credentials: grpc.ChannelCredentials | None = dataclasses.field(repr=False)
    options: tuple[tuple[str, Any], ...]
    interceptors: tuple[grpc.aio.ClientInterceptor, ...]


# The interceptors a grpc.aio channel takes (it refuses any other object).
_INTERCEPTOR_TYPES = (
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
)
# An integer option is a C int in gRPC's core (it refuses a larger one).
_OPTION_INT_RANGE = range(-(2**31), 2**31)


def channel_spec(
    target: str,
    *,
    tls: TlsConfig | None,
    max_message_bytes: int,
    options: Sequence[tuple[str, Any]],
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None,
) -> ChannelSpec:
    """Checks what gRPC would check as the channel opens, so that a client's arguments
    fail when it is made, naming the one at fault, not at its first call.

    Raises:
        TypeError: an option or interceptor of a type gRPC refuses, naming it; the
            `tls` roots or key not bytes.
        ValueError: a target `check_target` refuses; an integer option out of gRPC's
            range (a C int), naming it.
    """
    check_target(target)
    merged = tuple(channel_options(tls, max_message_bytes, options))
    for key, value in merged:
        _check_option(key, value)
    return ChannelSpec(
        target,
        None if tls is None else tls.credentials(),  # checks the PEM fields' types
        merged,
        _checked_interceptors(interceptors),
    )


def _check_option(key: object, value: object) -> None:
    """gRPC's rule for a channel option (its _ChannelArg): a str or bytes key; an int,
    str, bytes or an object with __int__ (taken as a C pointer) for the value."""
    if not isinstance(key, str | bytes):
        raise TypeError(f"options: key {reprlib.repr(key)}: expected a str")
    if isinstance(value, int) and value not in _OPTION_INT_RANGE:
        raise ValueError(
            f"options: {key!r}: {value} is out of gRPC's range for an integer option; "
            f"expected {_OPTION_INT_RANGE.start} to {_OPTION_INT_RANGE.stop - 1}"
        )
    if not isinstance(value, int | str | bytes) and not hasattr(value, "__int__"):
        raise TypeError(
            f"options: {key!r}: expected an int or str value (gRPC's option types), got "
            f"{type(value).__name__} ({reprlib.repr(value)})"
        )


def _checked_interceptors(
    interceptors: object,
) -> tuple[grpc.aio.ClientInterceptor, ...]:
    if interceptors is None:
        return ()
    if isinstance(interceptors, _INTERCEPTOR_TYPES) or not isinstance(interceptors, Iterable):
        raise TypeError(
            f"interceptors: expected a sequence of grpc.aio client interceptors, got "
            f"{type(interceptors).__name__}"
        )
    checked = tuple(interceptors)
    for index, interceptor in enumerate(checked):
        if not isinstance(interceptor, _INTERCEPTOR_TYPES):
            raise TypeError(
                f"interceptors[{index}]: expected a grpc.aio UnaryUnaryClientInterceptor, "
                "UnaryStreamClientInterceptor, StreamUnaryClientInterceptor or "
                f"StreamStreamClientInterceptor, got {type(interceptor).__name__}"
            )
    return checked


# Every channel `open_channel` opened in this process, held weakly; and, in a child forked
# from it, the parent's channels held for good. gRPC's state does not survive a fork: a
# parent's channel deallocated in the child (its client dropped or replaced there, as in
# "create clients after the fork") crashed the child (SIGSEGV) or hung it. The child keeps
# them and never touches them; only their memory (copied at the fork) is kept.
_OPENED: weakref.WeakSet[grpc.aio.Channel] = weakref.WeakSet()
_KEPT_FROM_PARENT: set[grpc.aio.Channel] = set()
# The processes in which a channel was opened, as this process knows them: its own (once
# it opens one) and, copied at each fork, its ancestors' up to that fork. Once a process
# has made gRPC calls, a child forked from it that makes any may hang (its timeout
# ignored) or abort, on a client made in the child too.
_OPENED_IN_PIDS: set[int] = set()


def _keep_parents_channels() -> None:
    """In a child, just forked: the parent's channels are never deallocated here."""
    _KEPT_FROM_PARENT.update(_OPENED)


if hasattr(os, "register_at_fork"):  # POSIX: elsewhere no process forks
    os.register_at_fork(after_in_child=_keep_parents_channels)


def open_channel(spec: ChannelSpec) -> grpc.aio.Channel:
    """`spec`'s channel, bound to the running event loop: call it there."""
    if spec.credentials is None:
        channel = grpc.aio.insecure_channel(
            spec.target, options=spec.options, interceptors=spec.interceptors
        )
    else:
        channel = grpc.aio.secure_channel(
            spec.target, spec.credentials, options=spec.options, interceptors=spec.interceptors
        )
    _OPENED.add(channel)
    _OPENED_IN_PIDS.add(os.getpid())
    return channel


def forked_message(what: str, pid: int) -> str:
    """The refusal of a call made in a child forked from process `pid`, where `what` (the
    client, or its channel) was made: gRPC's state does not survive a fork (neither does
    a Client's thread), and the call would wait for ever or abort the process. Once
    process `pid` had opened a channel before the fork, a client made in the child may
    hang or abort too: the message leads with 'spawn' or 'forkserver' then."""
    refusal = (
        f"{what} was made in process {pid}, and this call is made in process "
        f"{os.getpid()}, a child forked from it (gunicorn --preload, multiprocessing's "
        "'fork' start method, Celery's prefork pool): a client's channel (and a Client's "
        "thread) does not survive a fork, and a call there would hang or abort the process"
    )
    if pid in _OPENED_IN_PIDS:
        return (
            f"{refusal}. Process {pid} had made gRPC calls before the fork, so a client "
            "created in this child may hang too (its timeout ignored) or abort. Expected "
            "worker processes started with multiprocessing's 'spawn' or 'forkserver' "
            "method, or forked before any gRPC call is made (gunicorn without --preload), "
            "each creating its own client after the fork (gunicorn's post_fork hook, a "
            "Pool initializer, Celery's worker_process_init)"
        )
    return (
        f"{refusal}. Expected a client created after the fork, in the process that uses it "
        "(gunicorn's post_fork hook, a Pool initializer, Celery's worker_process_init), or "
        "worker processes started with multiprocessing's 'spawn' or 'forkserver' method: "
        "the safe choice, as once a process has made gRPC calls, gRPC may hang or abort a "
        "child forked from it that makes any, even on a new client"
    )
