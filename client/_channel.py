"""Channels: plain or TLS (optionally mutual), with the options every laneserve call needs."""

from __future__ import annotations

import dataclasses
import re
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

__all__ = ["DEFAULT_TARGET", "TlsConfig"]

DEFAULT_TARGET = "127.0.0.1:50051"
# The smallest message limit taken, the server's own minimum: an error answer quoting a
# request_id fits in it, and a bulk job sends it as the largest answer it reads (the
# server refuses a stream that asks for less).
MIN_MESSAGE_BYTES = 1024
# The server's default gRPC message limit (ServerConfig.max_message_bytes).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_USER_AGENT = "laneserve-client/0.1.0"
# HTTP/2 pings find a connection that went silent (a host gone without a reset, a network
# black hole): without them a bulk job's stream, which has no deadline, waited for its
# answers for ever. A ping after 5 min without traffic (what a default gRPC server takes:
# more often are "too many pings", and it hangs up; laneserve's own takes one a minute),
# and a ping unanswered for 20 s ends the connection; a job then resumes on a new call. A
# caller's `options` replace these, key by key.
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 300_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.ping_timeout_ms", 20_000),
)
# gRPC's rules for metadata (validate_metadata.cc): a key is a lower-case HTTP/2 header
# name; a key ending in -bin carries bytes, any other key printable ASCII text.
# Metadata given to a client is text: str values.
_METADATA_KEY = re.compile(r"[0-9a-z_.-]+")
_METADATA_TEXT = re.compile(r"[\x20-\x7e]*")


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


def metadata_pair(key: str, value: str) -> tuple[str, str]:
    """(key in lower case, value), as gRPC sends it. Raises ValueError naming the key when
    gRPC would refuse the pair: it fails every call with a TypeError or an internal error
    that names neither the key nor the rule."""
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
    return lower, value


def channel_options(
    tls: TlsConfig | None, max_message_bytes: int, extra: Sequence[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    """The channel's gRPC options; ValueError for a message limit that is not a whole
    number of bytes of at least MIN_MESSAGE_BYTES. gRPC's -1 ("no limit") is refused too:
    the stream client sizes its items within the limit (an item over it would fail the
    whole call)."""
    limit: object = max_message_bytes  # from the caller, unchecked (a bool is an int)
    if type(limit) is not int or limit < MIN_MESSAGE_BYTES:
        raise ValueError(
            f"max_message_bytes: expected a whole number of bytes, at least "
            f"{MIN_MESSAGE_BYTES}, got {max_message_bytes!r}"
        )
    options: dict[str, Any] = {
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.primary_user_agent": _USER_AGENT,
        **dict(KEEPALIVE_OPTIONS),
    }
    if tls is not None and tls.server_name:
        options["grpc.ssl_target_name_override"] = tls.server_name
    options.update(extra)  # the caller's, last: gRPC's reading of a repeated key is its own
    return list(options.items())


def open_channel(
    target: str,
    *,
    tls: TlsConfig | None,
    max_message_bytes: int,
    options: Sequence[tuple[str, Any]],
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None,
) -> grpc.aio.Channel:
    """An asyncio channel; create it on the event loop it is used from (RuntimeError,
    saying so, with none: the arguments are checked first)."""
    merged = channel_options(tls, max_message_bytes, options)
    try:
        if tls is None:
            return grpc.aio.insecure_channel(target, options=merged, interceptors=interceptors)
        return grpc.aio.secure_channel(
            target, tls.credentials(), options=merged, interceptors=interceptors
        )
    except RuntimeError as error:
        # gRPC's channel binds to the thread's event loop (running, or set and to be run):
        # with none it said only "There is no current event loop in thread 'MainThread'".
        if "event loop" not in str(error):
            raise
        raise RuntimeError(
            "AsyncClient(...) was created with no event loop in this thread; expected it "
            "created on the event loop it is used on (in a coroutine: `async with "
            f"AsyncClient(...)`), or Client for code without one (gRPC: {error})"
        ) from None
