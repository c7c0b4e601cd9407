"""Production behaviour against real server processes: the API key (HTTP and gRPC), body limit,
admission under a flood (probes still fast), CORS, the model repository (off, and on: unload then
load), model versions, deadlines that free the work, and SIGTERM while streams are in flight."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from .harness import REPO, ServerProcess, run_server, status, wait_until
from .prometheus import Samples

pytestmark = pytest.mark.slow

KEY = "sk-production-test"
AUTH = {"authorization": f"Bearer {KEY}"}
GRPC_CLIENT = Path(__file__).with_name("grpc_client.py")
CANCELLED = r"generation cancelled \(client gone\) after (\d+) tokens"
LIMIT = 3
LONG_BODY = {"prompt": "Hi", "max_tokens": 120, "n": 128, "logprobs": 20, "ignore_eos": True}
"""Seconds of work on a CPU (128 choices of 120 tokens with logprobs)."""


@pytest.fixture(scope="module")
def llama_path(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def server(llama_path: Path, tmp_path_factory):
    """One process, the key from the environment (not in the args), a small admission limit."""
    args = [
        "--model_dir", str(llama_path), "--model_name", "llama", "--backend", "huggingface",
        "--max_concurrent_requests", str(LIMIT), "--max_request_bytes", "65536",
        "--enable_model_repository", "--allowed_origins", "https://app.example",
    ]  # fmt: skip
    env = {"HUGGINGFACESERVER_API_KEY": KEY}
    with run_server(args, tmp_path_factory.mktemp("production"), env=env) as process:
        yield process


@pytest.fixture(scope="module")
def deadline_server(llama_path: Path, tmp_path_factory):
    """An engine behind two fronts, with a 0.3 s deadline and the repository left off."""
    args = [
        "--model_dir", str(llama_path), "--model_name", "llama", "--backend", "huggingface",
        "--api_workers", "2", "--request_timeout_seconds", "0.3",
    ]  # fmt: skip
    with run_server(args, tmp_path_factory.mktemp("deadline")) as process:
        yield process


def grpc_call(server: ServerProcess, *args: str, key: str | None = None) -> dict:
    env = {**os.environ, **({"GRPC_API_KEY": key} if key else {})}
    done = subprocess.run(
        [sys.executable, str(GRPC_CLIENT), f"127.0.0.1:{server.grpc_port}", "llama", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def stream_chat(
    url: str, max_tokens: int = 48, started: threading.Event | None = None
) -> tuple[int, str | None, list[str]]:
    """(status, Retry-After, SSE data lines) of one streamed chat; ``started`` is set at its
    first event."""
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    url = f"{url}/openai/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=120) as response:
        lines = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if started is not None:
                    started.set()
        return response.status_code, response.headers.get("retry-after"), lines


def test_model_routes_need_the_key_health_and_metrics_do_not(server):
    url = server.url
    body = {"prompt": "Hi", "max_tokens": 2}
    without = httpx.post(f"{url}/openai/v1/completions", json=body, timeout=30)
    wrong = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer nope"}, timeout=5)
    right = httpx.post(f"{url}/openai/v1/completions", json=body, headers=AUTH, timeout=30)
    assert without.status_code == wrong.status_code == 401
    assert without.json()["error"]["code"] == "invalid_api_key"
    assert isinstance(wrong.json()["error"], str)
    assert right.status_code == 200, right.text
    for path in ("/", "/v2/health/live", "/v2/health/ready", "/metrics"):
        assert status(url + path) == 200
    assert KEY not in server.log()  # the key never reaches the log (it is not in the args)


def test_grpc_needs_the_key_too(server):
    refused = grpc_call(server, "status", "hi")
    passed = grpc_call(server, "status", "hi", key=KEY)
    assert refused["status"] == "StatusCode.UNAUTHENTICATED"
    # past the key, a generative model refuses V2 inference as invalid input
    assert passed["status"] == "StatusCode.INVALID_ARGUMENT", passed


def test_a_request_id_is_honoured_and_returned(server):
    response = httpx.post(
        f"{server.url}/openai/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={**AUTH, "x-request-id": "trace-42"},
        timeout=30,
    )
    assert response.headers["x-request-id"] == "trace-42"
    made = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=5).headers["x-request-id"]
    assert len(made) == 36
    assert server.wait_for_log(r'request trace-42 "POST /openai/v1/completions" 200')


def test_a_body_over_the_limit_is_a_413(server):
    prompt = "word " * 20000  # 100 KB, over --max_request_bytes 65536
    response = httpx.post(
        f"{server.url}/openai/v1/completions",
        json={"prompt": prompt, "max_tokens": 1},
        headers=AUTH,
        timeout=30,
    )
    assert response.status_code == 413
    assert "--max_request_bytes" in response.json()["error"]["message"]


def test_a_flood_gets_429s_with_retry_after_while_probes_stay_fast(server):
    with ThreadPoolExecutor(16) as pool, httpx.Client(timeout=5) as probe:
        flood = [pool.submit(stream_chat, server.url) for _ in range(16)]
        probe_times = []
        while not all(f.done() for f in flood):
            start = time.monotonic()
            assert probe.get(server.url + "/v2/health/live").status_code == 200
            probe_times.append(time.monotonic() - start)
            time.sleep(0.05)
        answers = [f.result() for f in flood]
    codes = [code for code, _, _ in answers]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= LIMIT
    assert all(retry == "1" for code, retry, _ in answers if code == 429)
    assert all(lines[-1] == "data: [DONE]" for code, _, lines in answers if code == 200)
    assert max(probe_times) < 1.0, probe_times  # Kubernetes' default probe timeout
    assert stream_chat(server.url)[0] == 200  # every slot was given back
    scraped = Samples.parse(httpx.get(f"{server.url}/metrics", timeout=5).text)
    route = "/openai/v1/chat/completions"
    assert scraped.value("hfserver_requests_total", route=route, status="429") == codes.count(429)
    assert scraped.value("hfserver_requests_rejected_total", route=route) == codes.count(429)
    assert scraped.value("hfserver_requests_in_flight") == 0


def test_cors_answers_allowed_origins_only(server):
    def preflight(origin: str) -> httpx.Response:
        headers = {"origin": origin, "access-control-request-method": "POST"}
        return httpx.options(f"{server.url}/openai/v1/completions", headers=headers, timeout=5)

    allowed, other = preflight("https://app.example"), preflight("https://evil.example")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in other.headers


def test_model_versions_are_404_and_explain_is_400(server):
    version = httpx.get(f"{server.url}/v2/models/llama/versions/2", headers=AUTH, timeout=5)
    infer = httpx.post(
        f"{server.url}/v2/models/llama/versions/2/infer", json={"inputs": []}, headers=AUTH
    )
    explain = httpx.post(f"{server.url}/v1/models/llama:explain", json={}, headers=AUTH)
    assert version.status_code == infer.status_code == 404
    assert "version" in version.json()["error"]
    assert explain.status_code == 400
    over_grpc = grpc_call(server, "version", "Hi", key=KEY)
    assert over_grpc["status"] == "StatusCode.NOT_FOUND" and "version" in over_grpc["message"]


def test_client_faults_leave_no_traceback_in_the_log(server):
    """KServe's handlers logged an error with a traceback for each unknown model, unreadable
    body, and 503 readiness probe while loading; the server answers them the same, with the
    gateway's request line only."""
    since = len(server.log())
    faults = {
        "unknown-model": ("GET", "/v2/models/nope/ready", None, 404),
        "unreadable-body": ("POST", "/v1/models/llama:predict", b'{"instances": [', 400),
        "model-version": ("GET", "/v2/models/llama/versions/2", None, 404),
    }
    for request_id, (method, path, body, code) in faults.items():
        headers = {**AUTH, "x-request-id": request_id}
        response = httpx.request(method, server.url + path, content=body, headers=headers)
        assert response.status_code == code, response.text
        assert isinstance(response.json()["error"], str)
        server.wait_for_log(rf'request {request_id} "{method} {re.escape(path)}" {code}', since)
    log = server.log()
    loading = log[: log.index("model llama is ready")]  # the probes answered 503 while loading
    assert "Traceback" not in loading + log[since:], log
    assert "Exception:" not in loading + log[since:], log


def test_repository_unload_then_load_serves_again(server):
    url = server.url
    unload = httpx.post(f"{url}/v2/repository/models/llama/unload", headers=AUTH, timeout=60)
    assert unload.status_code == 200, unload.text
    assert status(url + "/v2/health/ready") == 503
    body = {"prompt": "Hi", "max_tokens": 2}
    gone = httpx.post(f"{url}/openai/v1/completions", json=body, headers=AUTH, timeout=30)
    assert gone.status_code == 404
    load = httpx.post(f"{url}/v2/repository/models/llama/load", headers=AUTH, timeout=120)
    assert load.status_code == 200, load.text
    assert status(url + "/v2/health/ready") == 200
    again = httpx.post(f"{url}/openai/v1/completions", json=body, headers=AUTH, timeout=30)
    assert again.status_code == 200, again.text


def test_sigterm_turns_readiness_false_and_lets_streams_finish(server):
    started = [threading.Event(), threading.Event()]
    with ThreadPoolExecutor(2) as pool:
        # decoded together (the tiny model's context leaves room for 100 tokens each): both
        # have their first token when the signal comes, and the rest to stream after it
        streams = [pool.submit(stream_chat, server.url, 100, event) for event in started]
        assert all(event.wait(30) for event in started)
        server.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: status(server.url + "/v2/health/ready") != 200, timeout=1.0)
        answers = [s.result() for s in streams]
    assert [code for code, _, _ in answers] == [200, 200]
    assert all(lines[-1] == "data: [DONE]" for _, _, lines in answers)
    assert server.process.wait(timeout=30) == 0


def test_past_the_deadline_a_504_and_the_generation_stops(deadline_server):
    since = len(deadline_server.log())
    url = f"{deadline_server.url}/openai/v1/completions"
    late = httpx.post(url, json=LONG_BODY, timeout=60)
    assert late.status_code == 504
    assert "--request_timeout_seconds" in late.json()["error"]["message"]
    tokens = int(deadline_server.wait_for_log(CANCELLED, since, timeout=15).group(1))
    assert tokens < 120
    short = httpx.post(url, json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
    assert short.status_code in (200, 504)  # one token fits 0.3 s on any machine we run on


def test_repository_routes_are_off_unless_enabled(deadline_server):
    url = deadline_server.url
    for verb in ("load", "unload"):
        response = httpx.post(f"{url}/v2/repository/models/llama/{verb}", timeout=5)
        assert response.status_code == 404
    assert grpc_call(deadline_server, "unload")["status"] == "StatusCode.UNIMPLEMENTED"
    assert status(url + "/v2/health/ready") == 200
