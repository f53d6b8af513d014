"""TLS of every port, from the configured PEM files: the gRPC ports' credentials
(`server_credentials`) and the HTTPS context of the HTTP port and the metrics endpoint
(`https_context`). The files are judged as gRPC's TLS (BoringSSL) takes them, by
handshakes in memory and a throwaway loopback bind: gRPC itself takes any bytes and
fails at the bind, naming nothing. Apart from the assembly (app) because none of it
needs a server: `serve` checks the files before the model loads."""

from __future__ import annotations

import dataclasses
import ssl
from concurrent import futures
from pathlib import Path

import grpc

from laneserve.server.config import ConfigError, ServerConfig


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
