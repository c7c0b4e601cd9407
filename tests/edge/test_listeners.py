"""The servers we own: the HTTP listening socket we bind ourselves (TCP_NODELAY on what it
accepts, a port that front processes share, a port held by another program found before
serving), the app's routes and error handlers, and the stop signals that drain."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import signal
import socket
import ssl
import subprocess
from pathlib import Path

import httpx
import kserve.errors
import pytest
from kserve.model_repository import ModelRepository
from kserve.protocol.model_repository_extension import ModelRepositoryExtension

from huggingfaceserver import errors
from huggingfaceserver.edge import http_errors
from huggingfaceserver.edge.listeners import build_app, check_port_free, http_socket
from huggingfaceserver.edge.serving import ModelAwareDataPlane
from huggingfaceserver.errors import StartupError
from tests.harness import load_model, run_server, wait_until

KSERVE_ROUTES = {
    ("/", "GET"),
    ("/v1/models", "GET"),
    ("/v1/models/{model_name}", "GET"),
    ("/v1/models/{model_name}:predict", "POST"),
    ("/v1/models/{model_name}:explain", "POST"),
    ("/v2", "GET"),
    ("/v2/health/live", "GET"),
    ("/v2/health/ready", "GET"),
    ("/v2/models", "GET"),
    ("/v2/models/{model_name}", "GET"),
    ("/v2/models/{model_name}/ready", "GET"),
    ("/v2/models/{model_name}/infer", "POST"),
    ("/v2/models/{model_name}/versions/{model_version}", "GET"),
    ("/v2/models/{model_name}/versions/{model_version}/ready", "GET"),
    ("/v2/models/{model_name}/versions/{model_version}/infer", "POST"),
}
REPOSITORY_ROUTES = {
    ("/v2/repository/models/{model_name}/load", "POST"),
    ("/v2/repository/models/{model_name}/unload", "POST"),
}
OUR_ROUTES = {
    ("/metrics", "GET"),  # one process: KServe's own (fronts: metrics.mount)
    ("/openapi.json", "GET,HEAD"),
    ("/openai/v1/models", "GET"),
    ("/openai/v1/models/{model_id}", "GET"),
    ("/openai/v1/completions", "POST"),
    ("/openai/v1/chat/completions", "POST"),
    ("/openai/v1/responses", "POST"),
    ("/openai/v1/embeddings", "POST"),
    ("/openai/v1/rerank", "POST"),
    ("/openai/v1/tokenize", "POST"),
    ("/openai/v1/detokenize", "POST"),
    ("/openai/v1/load_lora_adapter", "POST"),
    ("/openai/v1/unload_lora_adapter", "POST"),
}
TEI_ROUTES = {
    *(
        (path, "POST")
        for path in (
            "/embed", "/embed_sparse", "/embed_all", "/predict", "/rerank", "/tokenize",
            "/decode", "/",
        )
    ),
    ("/info", "GET"),
    ("/health", "GET"),
}  # fmt: skip
"""text-embeddings-inference's, on a server of an encoder model."""
DOCS_ROUTES = {("/docs", "GET,HEAD"), ("/docs/oauth2-redirect", "GET,HEAD")}


def test_the_socket_says_it_is_tcp():
    """asyncio sets TCP_NODELAY on accepted connections only for IPPROTO_TCP sockets (with 0,
    small responses waited 40 ms for the client's delayed ACK)."""
    with http_socket(0, shared=False) as sock:
        assert (sock.type, sock.proto) == (socket.SOCK_STREAM, socket.IPPROTO_TCP)
        assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)


async def test_asyncio_accepts_with_tcp_nodelay():
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = writer.get_extra_info("socket")
        accepted.set_result(connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock = http_socket(0, shared=False)
    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        assert await asyncio.wait_for(accepted, 5)
        writer.close()


def test_two_shared_sockets_listen_on_one_port():
    with http_socket(0, shared=True) as first:
        port = first.getsockname()[1]
        with http_socket(port, shared=True) as second:
            assert second.getsockname()[1] == port
            for listening in (first, second):
                assert listening.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass


def test_an_unshared_port_in_use_is_a_startup_error():
    with http_socket(0, shared=False) as first:
        port = first.getsockname()[1]
        with pytest.raises(StartupError, match=f"cannot listen on HTTP port {port}"):
            http_socket(port, shared=False)


def test_check_port_free_finds_a_port_in_use():
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(StartupError, match=f"cannot listen on gRPC port {port}: "):
            check_port_free(port, "gRPC")
    check_port_free(port, "gRPC")  # released: free again


async def test_the_draining_line_is_logged_on_the_loop_after_the_signal_handler(caplog):
    """A SIGTERM that interrupts a log call must not log from inside the handler: the log
    handler's locks are held then, and the process would never exit."""
    import asyncio
    import logging

    from huggingfaceserver.edge.listeners import announce_draining

    with caplog.at_level(logging.INFO, logger="huggingfaceserver.edge.listeners"):
        announce_draining()
        assert "draining" not in caplog.text, "logged inside the signal handler"
        after = asyncio.Event()
        asyncio.get_running_loop().call_soon(after.set)  # runs after the scheduled log call
        await after.wait()
    assert "draining: readiness false" in caplog.text


@pytest.fixture(scope="module")
def encoder_model(tiny_models):
    return load_model(["--model_dir", str(tiny_models["st_cls"]), "--model_name", "tiny"])


def app_routes(enable_repository: bool, enable_docs_url: bool, model) -> set[tuple[str, str]]:
    registry = ModelRepository()
    registry.update(model)
    dataplane = ModelAwareDataPlane(model_registry=registry)
    repository = ModelRepositoryExtension(model_registry=registry)
    app = build_app(dataplane, repository, "/openai", enable_repository, enable_docs_url)
    return {(r.path, ",".join(sorted(r.methods or ()))) for r in app.router.routes}  # type: ignore[attr-defined]


@pytest.mark.parametrize("enable_repository", [False, True])
@pytest.mark.parametrize("enable_docs_url", [False, True])
def test_the_app_serves_kserves_routes_and_ours_and_nothing_else(
    encoder_model, enable_repository, enable_docs_url
):
    """KServe's V1/V2 routes (no OpenAI or time-series routes of its own), ours (TEI's: an
    encoder model is served), the repository routes only when enabled, the docs only with
    ``--enable_docs_url``."""
    expected = KSERVE_ROUTES | OUR_ROUTES | TEI_ROUTES
    if enable_repository:
        expected |= REPOSITORY_ROUTES
    if enable_docs_url:
        expected |= DOCS_ROUTES
    assert app_routes(enable_repository, enable_docs_url, encoder_model) == expected


def test_kserves_error_handlers_are_installed_and_ours_win(encoder_model):
    registry = ModelRepository()
    registry.update(encoder_model)
    dataplane = ModelAwareDataPlane(model_registry=registry)
    app = build_app(dataplane, ModelRepositoryExtension(model_registry=registry), "/openai")
    handlers = app.exception_handlers
    assert handlers[kserve.errors.InferenceError] is kserve.errors.inference_error_handler
    assert handlers[kserve.errors.ServerNotLive] is kserve.errors.server_not_live_handler
    assert handlers[kserve.errors.InvalidInput] is http_errors.kserve_client_error_handler
    assert handlers[Exception] is http_errors.outermost_error_handler
    assert handlers[errors.ServerError] is http_errors.server_error_handler


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGQUIT])
def test_sigint_and_sigquit_drain_and_exit_0_as_sigterm_does(tiny_models, tmp_path, stop):
    """Every stop signal KServe's server stopped on: readiness false, then exit 0 (SIGTERM is
    tests/test_e2e.py's and, with streams in flight, tests/test_production.py's)."""
    args = ["--model_dir", str(tiny_models["st_cls"]), "--model_name", "tiny", "--api_workers", "1"]
    with run_server(args, tmp_path) as server:
        since = len(server.log())
        server.process.send_signal(stop)
        server.wait_for_log("draining: readiness false", since, timeout=15)
        try:
            returncode = server.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 15s after {stop.name}:\n{server.log()}")
        assert returncode == 0, server.log()
        assert "Traceback" not in server.log()[since:], server.log()


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_and_the_docs_page_from_kserves_flags(tiny_models, tmp_path):
    """``--ssl_certfile``/``--ssl_keyfile`` serve HTTPS on our socket, and
    ``--enable_docs_url true`` the Swagger page, as they configure KServe's server."""
    cert, key = self_signed(tmp_path)
    args = [
        "--model_dir", str(tiny_models["st_cls"]), "--model_name", "tiny",
        "--ssl_certfile", str(cert), "--ssl_keyfile", str(key), "--enable_docs_url", "true",
    ]  # fmt: skip
    trusted = ssl.create_default_context(cafile=str(cert))
    with run_server(args, tmp_path, ready=False) as server:
        url = f"https://127.0.0.1:{server.http_port}"

        def ready() -> bool:
            assert server.process.poll() is None, server.log()
            try:
                return httpx.get(f"{url}/v2/health/ready", verify=trusted).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(ready, timeout=120), server.log()
        assert httpx.get(f"{url}/docs", verify=trusted).status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{server.http_port}/v2/health/ready", timeout=5)
