"""README claims checked as the README states them, against real servers on loopback:
client TLS and mutual TLS (library and `laneserve-client` flags), `--metadata`, per-item
`timeout_ms` on InferStream, and job_id replay through `Client.stream`. (A bulk job's
exit codes 130 / 143 with its checkpoint: test_client_cli.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from google.rpc import code_pb2

from laneserve.client import NO_RETRIES, Client, LaneserveError, StreamResult, TlsConfig
from laneserve.server import LaneServer, ServerConfig
from laneserve.server.cli import main as laneserve_main
from laneserve.server.config import ConfigError
from laneserve.server.telemetry import Telemetry
from laneserve.server.tls import server_credentials
from laneserve.v1 import inference_pb2 as pb
from tests.support import F32, RecordingEngine, config, item_reason, request, rows, serving
from tests.support import client_cli as cli

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

# The name in the test server's certificate (besides IP 127.0.0.1).
SERVER_NAME = "laneserve.test"
STEP_TIMEOUT_S = 30.0


def small_reference(small_model: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(small_model), providers=["CPUExecutionProvider"])


# ---- 1. client TLS and mutual TLS -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pki:
    """A throwaway CA, a server certificate (DNS laneserve.test, IP 127.0.0.1) and a
    client certificate, all signed by the CA; PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_tls(self, *, require_client_auth: bool) -> dict[str, str]:
        """The server's TLS settings (ServerConfig fields)."""
        return {
            "tls_cert": str(self.server_cert),
            "tls_key": str(self.server_key),
            **({"tls_client_ca": str(self.ca)} if require_client_auth else {}),
        }


# `openssl req` options for a new P-256 key, written unencrypted.
NEW_KEY = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"


def openssl(directory: Path, *args: str) -> None:
    """Runs `openssl ARGS` in `directory`, where the files it reads and writes are."""
    # The `cryptography` package is not installed in .venv; the openssl command is.
    command = shutil.which("openssl")
    assert command is not None, "the TLS tests generate their certificates with `openssl`"
    done = subprocess.run(
        [command, *args], cwd=directory, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"openssl {' '.join(args)} exited {done.returncode}: {done.stderr}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return issue_pki(tmp_path_factory.mktemp("pki"))


def issue_pki(directory: Path, server_key: str = NEW_KEY) -> Pki:
    """A throwaway CA in `directory`, a server certificate (DNS SERVER_NAME, IP
    127.0.0.1) and a client certificate it signed; the server's key made by `server_key`
    (`openssl req`'s options for a new key), the others by NEW_KEY."""
    # Valid under VERIFY_X509_STRICT, which ssl.create_default_context sets from Python
    # 3.13: the CA has a key usage (without one Python 3.13 refused it: "CA cert does not
    # include key usage extension"); so do the leaves, with both key identifiers, which
    # OpenSSL 3's `x509 -req` adds by default and older versions did not. The CA's key
    # identifiers and basic constraints come from openssl's configuration (v3_ca).
    ca = f"req -x509 {NEW_KEY} -keyout ca.key -out ca.pem -days 2"
    openssl(
        directory,
        *ca.split(),
        "-subj",
        "/CN=laneserve test CA",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    leaf = (
        "keyUsage=critical,digitalSignature\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
    )
    extensions = {
        "server": (
            f"{leaf}subjectAltName=DNS:{SERVER_NAME},IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
        ),
        "client": f"{leaf}extendedKeyUsage=clientAuth\n",
    }
    for serial, (name, text) in enumerate(extensions.items(), start=2):
        (directory / f"{name}.ext").write_text(text, encoding="ascii")
        key = server_key if name == "server" else NEW_KEY
        csr = f"req -new {key} -keyout {name}.key -out {name}.csr"
        openssl(directory, *csr.split(), "-subj", f"/CN=laneserve test {name}")
        sign = (
            f"x509 -req -in {name}.csr -CA ca.pem -CAkey ca.key -set_serial {serial} "
            f"-days 2 -extfile {name}.ext -out {name}.pem"
        )
        openssl(directory, *sign.split())
    return Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )


@dataclasses.dataclass(frozen=True)
class Served:
    target: str  # the gRPC port
    priority_target: str  # the priority port: the same TLS
    metrics_port: int


@contextlib.asynccontextmanager
async def tls_servers(model: Path, pki: Pki) -> AsyncIterator[tuple[Served, Served]]:
    """Two LaneServers whose gRPC ports (main and priority) speak TLS (their tls_*
    settings), the second requiring a client certificate (mutual TLS), each with its
    metrics endpoint."""
    async with contextlib.AsyncExitStack() as stack:
        served = []
        for require_client_auth in (False, True):
            tls = pki.server_tls(require_client_auth=require_client_auth)
            server = LaneServer(
                RecordingEngine(str(model)),
                config(model, host="127.0.0.1", port=0, priority_port=0, metrics_port=0, **tls),
            )
            port = await server.start()
            stack.push_async_callback(server.stop, grace_s=5.0)
            assert server.metrics_port is not None
            served.append(
                Served(
                    f"127.0.0.1:{port}",
                    f"127.0.0.1:{server.priority_port}",
                    server.metrics_port,
                )
            )
        yield served[0], served[1]


def test_client_speaks_tls_and_mutual_tls(
    small_model: Path, small_reference: ort.InferenceSession, pki: Pki
) -> None:
    """`Client(target, tls=TlsConfig(...))`: TLS against the CA it is given, mutual TLS
    with a client certificate; a server that requires one refuses a client without it."""
    x = rows(3, seed=1)
    expected = small_reference.run(None, {"input": x})[0]

    def infer(target: str, tls: TlsConfig | None) -> F32:
        with Client(target, tls=tls, retry=NO_RETRIES) as client:
            scores: F32 = client.infer({"input": x}, timeout=STEP_TIMEOUT_S)["output"]
            return scores

    def refused(target: str, tls: TlsConfig | None) -> LaneserveError:
        with (
            Client(target, tls=tls, retry=NO_RETRIES) as client,
            pytest.raises(LaneserveError) as caught,
        ):
            client.infer({"input": x}, timeout=STEP_TIMEOUT_S)
        return caught.value

    ca = pki.ca.read_bytes()
    mutual = TlsConfig.from_files(
        ca=pki.ca, cert=pki.client_cert, key=pki.client_key, server_name=SERVER_NAME
    )

    async def scenario() -> None:
        async with tls_servers(small_model, pki) as (tls, mtls):
            # TLS: the server is checked against the given roots (its IP is in its cert).
            got = await asyncio.to_thread(infer, tls.target, TlsConfig(root_certificates=ca))
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
            plaintext = await asyncio.to_thread(refused, tls.target, None)
            assert plaintext.code == grpc.StatusCode.UNAVAILABLE, plaintext

            # Mutual TLS: the client's certificate and key, and the name to check.
            got = await asyncio.to_thread(infer, mtls.target, mutual)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
            no_cert = await asyncio.to_thread(
                refused, mtls.target, TlsConfig(root_certificates=ca, server_name=SERVER_NAME)
            )
            assert no_cert.code == grpc.StatusCode.UNAVAILABLE, no_cert

            # The priority port speaks the same TLS.
            got = await asyncio.to_thread(infer, mtls.priority_target, mutual)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
            for target, tls_config in (
                (tls.priority_target, None),
                (mtls.priority_target, TlsConfig(root_certificates=ca, server_name=SERVER_NAME)),
            ):
                refusal = await asyncio.to_thread(refused, target, tls_config)
                assert refusal.code == grpc.StatusCode.UNAVAILABLE, refusal

    asyncio.run(scenario())


def test_top_watches_a_server_over_tls_and_mutual_tls(
    small_model: Path, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    """`laneserve top` takes laneserve-client's TLS options (it dialled plaintext only, so
    a TLS-only server could not be watched)."""
    mutual = [
        *("--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert)),
        *("--tls-key", str(pki.client_key), "--tls-server-name", SERVER_NAME),
    ]

    async def scenario() -> list[int]:
        async with tls_servers(small_model, pki) as (tls, mtls):
            runs = (
                ["--target", tls.target, "--tls-ca", str(pki.ca)],
                ["--target", mtls.target, *mutual],
                ["--target", tls.target],  # plaintext against TLS: unreachable
            )
            return [
                await asyncio.to_thread(
                    laneserve_main, ["top", "--once", "--timeout-s", "10", *args]
                )
                for args in runs
            ]

    assert asyncio.run(scenario()) == [0, 0, 1]
    captured = capsys.readouterr()
    assert captured.out.count("SERVING") == 2
    assert "UNAVAILABLE" in captured.err


def test_an_expired_server_certificate_is_refused_at_start(tmp_path: Path) -> None:
    """The server started with an expired certificate and logged nothing; every
    client's handshake failed ("certificate has expired"). It is refused before the
    model loads, naming the setting and why clients would refuse it."""
    (tmp_path / "ca.cnf").write_text(
        "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\nserial = serial\npolicy = p\n"
        "default_md = sha256\nnew_certs_dir = .\n[p]\ncommonName = supplied\n",
        encoding="ascii",
    )
    (tmp_path / "index.txt").touch()
    (tmp_path / "serial").write_text("01\n", encoding="ascii")
    ca = f"req -x509 {NEW_KEY} -keyout ca.key -out ca.pem -days 2"
    openssl(tmp_path, *ca.split(), "-subj", "/CN=ca")
    csr = f"req -new {NEW_KEY} -keyout old.key -out old.csr"
    openssl(tmp_path, *csr.split(), "-subj", "/CN=old")
    sign = "ca -batch -config ca.cnf -keyfile ca.key -cert ca.pem -in old.csr -out old.pem"
    openssl(tmp_path, *sign.split(), "-startdate", "20200101000000Z", "-enddate", "20200102000000Z")
    cert, key = str(tmp_path / "old.pem"), str(tmp_path / "old.key")
    config = ServerConfig(model_path="m.onnx", tls_cert=cert, tls_key=key)
    with pytest.raises(ConfigError) as refused:
        server_credentials(config)
    assert str(refused.value).startswith(
        f"server.tls_cert: {cert!r} would be refused by every client (certificate has expired)"
    )


@pytest.mark.parametrize(
    ("extension", "refused"),
    [
        # gRPC's TLS binds no port with it: the start failed after the model loaded,
        # blaming the address ("cannot listen on 127.0.0.1:...").
        ("keyUsage=critical,keyAgreement", "gRPC's TLS cannot serve with"),
        # Self-signed for another purpose: gRPC's clients pinning it as their root take
        # it; the start check refused it ("unsuitable certificate purpose").
        ("extendedKeyUsage=clientAuth", None),
    ],
    ids=["key-agreement-only", "self-signed-client-purpose"],
)
def test_a_server_certificate_is_judged_as_grpcs_tls_judges_it(
    tmp_path: Path, extension: str, refused: str | None
) -> None:
    command = f"req -x509 {NEW_KEY} -keyout s.key -out s.pem -days 2 -subj /CN=s".split()
    openssl(tmp_path, *command, "-addext", extension)
    config = ServerConfig(
        model_path="m.onnx", tls_cert=str(tmp_path / "s.pem"), tls_key=str(tmp_path / "s.key")
    )
    if refused is None:
        server_credentials(config)
        return
    with pytest.raises(ConfigError, match=re.escape(refused)):
        server_credentials(config)


def test_a_ca_issued_certificate_for_another_purpose_is_refused_at_start(pki: Pki) -> None:
    """A CA-issued client certificate served as the server's: every gRPC client refuses
    it ("unsupported certificate purpose"). Unlike a self-signed one of another purpose
    (pinned by its clients as their root), it is refused at start."""
    config = ServerConfig(
        model_path="m.onnx", tls_cert=str(pki.client_cert), tls_key=str(pki.client_key)
    )
    with pytest.raises(ConfigError, match=re.escape("(unsuitable certificate purpose)")):
        server_credentials(config)


def test_a_client_ca_file_of_crls_alone_is_refused_naming_it(pki: Pki, tmp_path: Path) -> None:
    """PEM that loads but holds no certificate (a CRL): gRPC refused the bind, and the
    start blamed the server's own certificate and key."""
    (tmp_path / "ca.cnf").write_text(
        "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\ndefault_md = sha256\n"
        "default_crl_days = 2\n",
        encoding="ascii",
    )
    (tmp_path / "index.txt").touch()
    ca_key = pki.ca.with_suffix(".key")
    gencrl = ["ca", "-gencrl", "-config", "ca.cnf", "-keyfile", str(ca_key), "-cert", str(pki.ca)]
    openssl(tmp_path, *gencrl, "-out", "crl.pem")
    tls = pki.server_tls(require_client_auth=True) | {"tls_client_ca": str(tmp_path / "crl.pem")}
    config = ServerConfig(model_path="m.onnx", **tls)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape("server.tls_client_ca: ")):
        server_credentials(config)


def test_metrics_endpoint_follows_the_ports_tls(small_model: Path, pki: Pki) -> None:
    """With tls_cert and tls_key the Prometheus endpoint speaks HTTPS with the same
    certificate; with tls_client_ca it requires the scraper's client certificate, as the
    gRPC port does. Plain HTTP gets nothing."""
    ca_only = ssl.create_default_context(cafile=str(pki.ca))
    with_cert = ssl.create_default_context(cafile=str(pki.ca))
    with_cert.load_cert_chain(str(pki.client_cert), str(pki.client_key))

    def scrape(url: str, context: ssl.SSLContext | None = None) -> str:
        with urllib.request.urlopen(url, context=context, timeout=STEP_TIMEOUT_S) as answer:  # noqa: S310 - a test URL
            body: bytes = answer.read()
            return body.decode()

    def refused(url: str, context: ssl.SSLContext | None = None) -> None:
        with pytest.raises((OSError, http.client.HTTPException)):
            scrape(url, context)

    async def scenario() -> None:
        async with tls_servers(small_model, pki) as (tls, mtls):
            https = f"https://127.0.0.1:{tls.metrics_port}/metrics"
            assert "laneserve_" in await asyncio.to_thread(scrape, https, ca_only)
            await asyncio.to_thread(refused, f"http://127.0.0.1:{tls.metrics_port}/metrics")
            mutual = f"https://127.0.0.1:{mtls.metrics_port}/metrics"
            assert "laneserve_" in await asyncio.to_thread(scrape, mutual, with_cert)
            await asyncio.to_thread(refused, mutual, ca_only)

    asyncio.run(scenario())


def test_a_failed_scrape_of_the_https_metrics_is_one_log_line(
    small_model: Path,
    pki: Pki,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Plain HTTP on the HTTPS endpoint, or a scraper without the client certificate mutual
    TLS asks for: socketserver printed its traceback to stderr, ~23 lines outside the log's
    format (JSON included) for each, and a port scan filled the log with them."""
    ca_only = ssl.create_default_context(cafile=str(pki.ca))

    def refused(url: str, context: ssl.SSLContext | None = None) -> None:
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(url, context=context, timeout=STEP_TIMEOUT_S)  # noqa: S310 - a test URL

    async def scenario() -> None:
        async with tls_servers(small_model, pki) as (tls, mtls):
            await asyncio.to_thread(refused, f"http://127.0.0.1:{tls.metrics_port}/metrics")
            await asyncio.to_thread(
                refused, f"https://127.0.0.1:{mtls.metrics_port}/metrics", ca_only
            )

    with caplog.at_level("WARNING", logger="laneserve.server.telemetry.endpoint"):
        asyncio.run(scenario())
    assert "Traceback" not in capsys.readouterr().err
    failed = [
        record
        for record in caplog.records
        if getattr(record, "event", None) == "metrics_request_failed"
    ]
    assert len(failed) == 2, [record.getMessage() for record in failed]
    assert all("metrics request from 127.0.0.1 failed: SSLError" in r.getMessage() for r in failed)


def test_a_silent_connection_to_the_https_metrics_blocks_neither_scrapes_nor_stop(
    small_model: Path, pki: Pki
) -> None:
    """A TCP connection that never sends a TLS hello (a port scan, a load balancer's TCP
    probe): the handshake ran in accept() on the endpoint's one thread, so every later
    scrape and stop() waited on it, and a SIGTERM never exited."""
    context = ssl.create_default_context(cafile=str(pki.ca))

    def scrape(url: str) -> str:
        with urllib.request.urlopen(url, context=context, timeout=STEP_TIMEOUT_S) as answer:  # noqa: S310 - a test URL
            body: bytes = answer.read()
            return body.decode()

    async def scenario() -> None:
        tls = pki.server_tls(require_client_auth=False)
        server = LaneServer(
            RecordingEngine(str(small_model)),
            config(small_model, host="127.0.0.1", port=0, metrics_port=0, **tls),
        )
        await server.start()
        assert server.metrics_port is not None
        with socket.create_connection(("127.0.0.1", server.metrics_port)):  # says nothing
            url = f"https://127.0.0.1:{server.metrics_port}/metrics"
            assert "laneserve_" in await asyncio.to_thread(scrape, url)
            await server.stop(grace_s=1.0)  # returns with the silent connection still open

    asyncio.run(scenario())


def test_cli_tls_flags(small_model: Path, pki: Pki) -> None:
    """`--tls-ca --tls-cert --tls-key --tls-server-name` make a mutual-TLS call; without
    the client certificate, or with a name the certificate lacks, it is refused (exit 3).
    `--tls` alone uses the default roots (here gRPC's GRPC_DEFAULT_SSL_ROOTS_FILE_PATH
    stands in for the system's, in the child process only)."""
    mutual = [
        "--tls-ca",
        str(pki.ca),
        "--tls-cert",
        str(pki.client_cert),
        "--tls-key",
        str(pki.client_key),
        "--tls-server-name",
        SERVER_NAME,
    ]
    default_roots = {**os.environ, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(pki.ca)}

    async def scenario() -> None:
        async with tls_servers(small_model, pki) as (tls, mtls):
            ok, no_cert, wrong_name, system_roots = await asyncio.gather(
                cli("model", "--target", mtls.target, "--attempts", "1", *mutual),
                cli("model", "--target", mtls.target, "--attempts", "1", *mutual[:2], *mutual[6:]),
                cli(
                    "model",
                    "--target",
                    mtls.target,
                    "--attempts",
                    "1",
                    *mutual[:6],
                    "--tls-server-name",
                    "other.test",
                ),
                cli("model", "--target", tls.target, "--attempts", "1", "--tls", env=default_roots),
            )
        code, out, err = ok
        assert code == 0, err
        assert "input   input   float32  [?, 512]" in out
        code, _, err = no_cert
        assert code == 3, err
        assert "UNAVAILABLE" in err
        code, _, err = wrong_name
        assert code == 3, err
        assert "UNAVAILABLE" in err
        code, out, err = system_roots
        assert code == 0, err
        assert "input   input   float32  [?, 512]" in out

    asyncio.run(scenario())


def test_tls_files_that_cannot_be_used_are_refused_naming_them(pki: Pki, tmp_path: Path) -> None:
    """A CA file that holds no certificate, or a key not the certificate's, went to gRPC
    unchecked: every call failed "Failed to create security handshaker", retried as if
    the server were down (the command line's exit 3, "could not be reached"). Refused at
    once, naming the file: exit 2 on the command line, ValueError in the library."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n", encoding="ascii")
    nobody = "127.0.0.1:1"  # never dialled: refused before any call
    bad_ca = ["--tls-ca", str(garbage)]
    mismatched = ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.server_key)]
    for arguments, expected in (
        (bad_ca, f"--tls-ca {garbage}: holds no PEM CA certificate"),
        (mismatched, f"--tls-cert {pki.client_cert} and --tls-key {pki.server_key}: not a PEM"),
    ):
        code, _, err = asyncio.run(cli("model", "--target", nobody, *arguments))
        assert code == 2, err
        assert expected in err, err
    with pytest.raises(ValueError, match=re.escape(f"ca {garbage}: holds no PEM CA")):
        TlsConfig.from_files(ca=garbage)
    with pytest.raises(ValueError, match="private key"):
        TlsConfig.from_files(cert=pki.client_cert, key=pki.server_key)
    TlsConfig.from_files(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)


def test_tls_files_grpc_takes_are_taken_whatever_the_openssl_security_level(
    pki: Pki, tmp_path: Path
) -> None:
    """The checks of TLS files loaded them at OpenSSL's security level, which gRPC's
    TLS (BoringSSL) does not have: an RSA-1024 certificate that served and called was
    refused "not a PEM certificate and its private key (EE_KEY_TOO_SMALL)"."""
    ca_key = pki.ca.with_suffix(".key")
    csr = "req -new -newkey rsa:1024 -nodes -keyout weak.key -out weak.csr"
    openssl(tmp_path, *csr.split(), "-subj", "/CN=w")
    sign = f"x509 -req -in weak.csr -CA {pki.ca} -CAkey {ca_key} -set_serial 9 -days 2"
    openssl(tmp_path, *sign.split(), "-out", "weak.pem")
    weak_cert, weak_key = tmp_path / "weak.pem", tmp_path / "weak.key"
    TlsConfig.from_files(ca=pki.ca, cert=weak_cert, key=weak_key)
    server_credentials(ServerConfig(model_path="m", tls_cert=str(weak_cert), tls_key=str(weak_key)))


# ---- 2. --metadata ----------------------------------------------------------------------


class MetadataRecorder(grpc.aio.ServerInterceptor):
    """Records each incoming call's method and invocation metadata."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[tuple[str, str], ...]]] = []

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        metadata = tuple(
            (str(key), str(value)) for key, value in handler_call_details.invocation_metadata or ()
        )
        self.calls.append((handler_call_details.method, metadata))
        return await continuation(handler_call_details)


def test_cli_metadata_reaches_the_server(small_model: Path, tmp_path: Path) -> None:
    """`--metadata KEY=VALUE` (repeatable) goes with every call of every subcommand:
    unary calls and the bulk stream alike; a value may itself hold `=`."""
    np.save(tmp_path / "in.npy", rows(40, seed=2))
    recorder = MetadataRecorder()

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, metrics_port=-1)
        telemetry = Telemetry.from_config(server_config, engine.providers)
        telemetry.interceptors.append(recorder)
        async with serving(engine, server_config, telemetry=telemetry) as s:
            # Keys travel lower-cased (gRPC's rule): X-Run arrives as x-run.
            tagged = ["--target", s.target, "--metadata", "authorization=Bearer a=b"]
            results = await asyncio.gather(
                cli("stats", *tagged, "--metadata", "X-Run=stats"),
                cli("model", *tagged, "--metadata", "x-run=model"),
                cli(
                    "infer",
                    *tagged,
                    "--metadata",
                    "x-run=infer",
                    "--json",
                    json.dumps(rows(1, seed=3).tolist()),
                ),
                cli(
                    "bulk",
                    *tagged,
                    "--metadata",
                    "x-run=bulk",
                    "--input",
                    str(tmp_path / "in.npy"),
                    "--output",
                    str(tmp_path / "out.npy"),
                    "--rows-per-item",
                    "10",
                ),
            )
        for code, _, err in results:
            assert code == 0, err

    asyncio.run(scenario())
    by_run: dict[str, set[str]] = {}
    for method, metadata in recorder.calls:
        assert ("authorization", "Bearer a=b") in metadata, (method, metadata)
        runs = [value for key, value in metadata if key == "x-run"]
        assert len(runs) == 1, (method, metadata)
        by_run.setdefault(runs[0], set()).add(method.rsplit("/", 1)[-1])
    assert by_run == {
        "stats": {"GetStats"},
        "model": {"GetModel"},
        "infer": {"GetModel", "Infer"},
        "bulk": {"GetModel", "InferStream"},
    }


# ---- 3. exit codes 130 / 143: test_client_cli.py, test_interrupted_bulk_job_... ----


# ---- 4. timeout_ms on InferStream items ----------------------------------------------------


def test_stream_item_past_its_timeout_ms_is_answered_deadline_and_the_stream_goes_on(
    small_model: Path,
) -> None:
    """An item whose `timeout_ms` cannot be met (the session is busy past it) is answered
    on the stream with a DEADLINE_EXCEEDED `error` under its request_id, never runs, and
    the stream goes on: the items before and after it are answered."""

    async def scenario() -> tuple[pb.InferStreamResponse, list[pb.InferStreamResponse], Any]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            engine.hold_next()
            call = s.stub.InferStream()
            try:
                await call.write(request(rows(1, start=0), request_id="first"))
                entered = await asyncio.to_thread(engine.entered.acquire, timeout=STEP_TIMEOUT_S)
                assert entered, "the first item is in the session"
                await call.write(request(rows(1, start=1), request_id="late", timeout_ms=50))
                late = await read(call)  # answered while the session is still held
                engine.release()
                await call.write(request(rows(1, start=2), request_id="after"))
                await call.done_writing()
                rest = [await read(call), await read(call)]
                assert await asyncio.wait_for(call.read(), STEP_TIMEOUT_S) is grpc.aio.EOF
                assert await call.code() == grpc.StatusCode.OK
            finally:
                engine.release()
                call.cancel()
        return late, rest, engine

    late, rest, engine = asyncio.run(scenario())
    assert late.request_id == "late"
    assert late.WhichOneof("result") == "error"
    assert late.error.code == code_pb2.DEADLINE_EXCEEDED
    assert item_reason(late) in {"EXPIRED_IN_QUEUE", "DEADLINE_UNMEETABLE"}
    assert sorted(response.request_id for response in rest) == ["after", "first"]
    assert all(response.WhichOneof("result") == "response" for response in rest)
    assert sorted(engine.ran_tags) == [0, 2], "the late item never ran"


async def read(call: Any) -> pb.InferStreamResponse:
    message = await asyncio.wait_for(call.read(), STEP_TIMEOUT_S)
    assert isinstance(message, pb.InferStreamResponse), message
    return message


# ---- 5. job_id replay ------------------------------------------------------------------


def test_rerun_with_the_same_job_id_is_answered_without_running_again(
    small_model: Path, small_reference: ort.InferenceSession
) -> None:
    """`Client.stream(..., job_id=J)` twice: the second run's items (ids f"{J}-{index}")
    are answered from the server's replay cache, none runs again; another job_id runs."""
    x = rows(300, seed=5, start=0)
    expected = small_reference.run(None, {"input": x})[0]

    def job(target: str, job_id: str) -> list[StreamResult]:
        with Client(target) as client:
            return list(client.stream({"input": x}, rows_per_item=25, job_id=job_id))

    def scores(results: list[StreamResult]) -> F32:
        return np.concatenate([result.unwrap()["output"] for result in results])

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            first = await asyncio.to_thread(job, s.target, "job-a")
            assert [r.request_id for r in first] == [f"job-a-{i}" for i in range(12)]
            np.testing.assert_allclose(scores(first), expected, rtol=1e-5, atol=1e-6)
            assert sorted(engine.ran_tags) == list(range(300))
            before = await s.stub.GetStats(pb.GetStatsRequest())

            again = await asyncio.to_thread(job, s.target, "job-a")
            after = await s.stub.GetStats(pb.GetStatsRequest())
            assert [r.request_id for r in again] == [f"job-a-{i}" for i in range(12)]
            np.testing.assert_array_equal(scores(again), scores(first))
            assert sorted(engine.ran_tags) == list(range(300)), "no row ran again"
            assert after.idempotent_replays - before.idempotent_replays == 12
            assert after.rows_run == before.rows_run

            other = await asyncio.to_thread(job, s.target, "job-b")
            np.testing.assert_allclose(scores(other), expected, rtol=1e-5, atol=1e-6)
            assert sorted(engine.ran_tags) == sorted([*range(300), *range(300)])

    asyncio.run(scenario())


# ---- helpers ---------------------------------------------------------------------------
