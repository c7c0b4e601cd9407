"""The server as a user starts it (``python -m huggingfaceserver``), driven by real clients, in
both process layouts (``layout``: one process, or an engine behind two fronts)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.harness import REPO, free_port, run_server
from tests.prometheus import scrape

pytestmark = pytest.mark.slow

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread."]
GRPC_CLIENT = Path(__file__).with_name("grpc_client.py")


@pytest.fixture(scope="module")
def server(minilm_path, layout, tmp_path_factory):
    """The README's command line, started once per layout."""
    args = ["--model_dir", str(minilm_path), "--model_name", "minilm", "--task", "text_embedding"]
    with run_server([*args, *layout], tmp_path_factory.mktemp("e2e")) as process:
        yield process


@pytest.fixture(scope="module")
def v1_embeddings(server) -> np.ndarray:
    response = httpx.post(
        f"{server.url}/v1/models/minilm:predict", json={"instances": SENTENCES}, timeout=60
    )
    assert response.status_code == 200, response.text
    return np.array(response.json()["predictions"], dtype=np.float32)


def grpc_client(server, *args: str) -> dict:
    """Run tests/grpc_client.py against the server's gRPC port; its JSON answer."""
    done = subprocess.run(
        [sys.executable, str(GRPC_CLIENT), f"127.0.0.1:{server.grpc_port}", "minilm", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_v1_predict_gives_unit_vectors_with_the_known_similarity(v1_embeddings):
    assert v1_embeddings.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(v1_embeddings, axis=1), 1.0, atol=1e-5)
    assert float(v1_embeddings[0] @ v1_embeddings[1]) == pytest.approx(0.7553, abs=1e-3)


def test_v1_predict_as_curl_sends_it_by_default(server, v1_embeddings):
    """``curl -d '{...}'`` without a content-type header sends it form-encoded."""
    response = httpx.post(
        f"{server.url}/v1/models/minilm:predict",
        content=json.dumps({"instances": SENTENCES}),
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(response.json()["predictions"], v1_embeddings, atol=1e-6)


def test_v2_rest_infer_equals_v1(server, v1_embeddings):
    body = {
        "id": "request-1",
        "inputs": [{"name": "input-0", "datatype": "BYTES", "shape": [2], "data": SENTENCES}],
    }
    response = httpx.post(f"{server.url}/v2/models/minilm/infer", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model_name"] == "minilm"
    assert answer["id"] == "request-1"
    [output] = answer["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("output-0", "FP32", [2, 384])
    data = np.array(output["data"], dtype=np.float32).reshape(output["shape"])
    np.testing.assert_allclose(data, v1_embeddings, atol=1e-6)


@pytest.mark.parametrize(
    ("method", "path", "request_args", "status"),
    [
        ("POST", "/v1/models/minilm:predict", {"json": {"instances": [1]}}, 400),
        ("POST", "/v1/models/minilm:predict", {"json": {"instances": []}}, 400),
        (
            "POST",
            "/v1/models/minilm:predict",
            {"content": b"{not json", "headers": {"content-type": "application/json"}},
            400,
        ),
        ("POST", "/v1/models/nope:predict", {"json": {"instances": SENTENCES}}, 404),
        ("GET", "/v2/models/nope/ready", {}, 404),
        (
            "POST",
            "/v2/models/minilm/infer",
            {
                "json": {
                    "inputs": [{"name": "input-0", "datatype": "INT64", "shape": [1], "data": [1]}]
                }
            },
            400,
        ),
        ("POST", "/v2/models/minilm/infer", {"json": {"inputs": "input-0"}}, 400),
    ],
    ids=[
        "v1-int",
        "v1-empty",
        "v1-malformed",
        "v1-unknown-model",
        "v2-unknown-model",
        "v2-int64",
        "v2-inputs-not-a-list",
    ],
)
def test_client_errors_over_http_leave_the_server_serving(
    server, v1_embeddings, method, path, request_args, status
):
    response = httpx.request(method, server.url + path, timeout=60, **request_args)
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"]
    assert httpx.get(f"{server.url}/v2/health/live", timeout=10).json() == {"live": True}
    again = httpx.post(
        f"{server.url}/v1/models/minilm:predict", json={"instances": SENTENCES}, timeout=60
    )
    assert again.status_code == 200
    np.testing.assert_allclose(again.json()["predictions"], v1_embeddings, atol=1e-6)


def test_tritonclient_http_matches_v1(server, v1_embeddings):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready("minilm")
        text = httpclient.InferInput("input-0", [2], "BYTES")
        text.set_data_from_numpy(np.array(SENTENCES, dtype=object))
        result = client.infer("minilm", [text])
    finally:
        client.close()
    embeddings = result.as_numpy("output-0")
    assert embeddings.shape == (2, 384)
    np.testing.assert_allclose(embeddings, v1_embeddings, atol=1e-6)


def test_tritonclient_grpc_matches_v1(server, v1_embeddings):
    answer = grpc_client(server, "infer", *SENTENCES)
    assert answer["server_ready"] is True
    assert answer["model_ready"] is True
    assert (answer["datatype"], answer["shape"]) == ("FP32", [2, 384])
    np.testing.assert_allclose(np.array(answer["data"]), v1_embeddings, atol=1e-6)


def test_grpc_int64_input_is_invalid_argument(server):
    answer = grpc_client(server, "infer-int64")
    assert answer["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "BYTES" in answer["message"] and "INT64" in answer["message"]


def test_openai_sdk_embeddings_and_rerank(server, v1_embeddings):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="unused")
    response = client.embeddings.create(model="minilm", input=SENTENCES)
    got = np.array([d.embedding for d in response.data])
    np.testing.assert_allclose(got, v1_embeddings, atol=1e-6)
    assert response.usage.prompt_tokens > 0
    assert [m.id for m in client.models.list().data] == ["minilm"]
    rerank = httpx.post(
        f"{server.url}/openai/v1/rerank",
        json={"model": "minilm", "query": SENTENCES[0], "documents": [SENTENCES[1], "A violin."]},
    ).json()
    assert rerank["results"][0]["index"] == 0
    cosine = float(v1_embeddings[0] @ v1_embeddings[1])
    assert rerank["results"][0]["relevance_score"] == pytest.approx(cosine, abs=1e-5)


def test_ready_logs_one_startup_line_with_its_phases(server, layout):
    """Cold start, phase by phase: what imports, the config and the weights (read and loaded
    in this process in the one-process layout; in the engine otherwise, and a front logs its
    own phases) and the warm-up took."""
    line = server.wait_for_log(r"startup: imports [\d.]+ s, .*ready [\d.]+ s after start")
    assert "warm-up" in line.group(0)
    if layout == ["--api_workers", "1"]:
        assert " config " in line.group(0) and " weights " in line.group(0)


def test_metrics_count_each_request_once_summed_over_processes(server, layout):
    """``/metrics`` from whichever process answers: with two fronts, each front's KServe
    histograms and the engine's batch figures, summed (each request on a new connection, so
    the kernel spreads them over the fronts; the front that answers never batched)."""
    before = scrape(server.url)
    for _ in range(6):
        response = httpx.post(
            f"{server.url}/v1/models/minilm:predict", json={"instances": SENTENCES}, timeout=60
        )
        assert response.status_code == 200, response.text
    after = scrape(server.url)

    def moved(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    for stage in ("preprocess", "predict", "postprocess"):
        assert moved(f"request_{stage}_seconds_count", model_name="minilm") == 6
    assert moved("hfserver_encoder_queue_time_seconds_count") == 6
    assert moved("hfserver_encoder_batch_size_sum") == 6 * len(SENTENCES)
    assert after.value("hfserver_requests_queued") == 0
    assert after.type_lines("request_predict_seconds") == 1
    if layout[-1] == "2":  # the engine process times its load
        assert after.value("hfserver_model_load_seconds", model_name="minilm") > 0


def test_sigterm_stops_the_server_with_status_0(tiny_models, tmp_path):
    """One process (the two-front layout's SIGTERM, with requests in flight, is
    tests/topology/test_supervisor.py's)."""
    args = ["--model_dir", str(tiny_models["st_cls"]), "--model_name", "tiny", "--api_workers", "1"]
    with run_server(args, tmp_path) as process:
        process.process.send_signal(signal.SIGTERM)
        try:
            returncode = process.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 15s after SIGTERM:\n{process.log()}")
        assert returncode == 0, process.log()


@pytest.fixture(scope="module")
def failed_start(tiny_models, layout, tmp_path_factory) -> subprocess.CompletedProcess:
    """A fill-mask folder with config and tokenizer but no weights, served as a user would (in
    the two-front layout, the engine process finds the weights missing)."""
    folder = tmp_path_factory.mktemp("no-weights")
    for source in tiny_models["bert_fill_mask"].iterdir():
        if source.is_file() and source.suffix in (".json", ".txt"):
            shutil.copy(source, folder)
    argv = [
        "--model_dir",
        str(folder),
        "--model_name",
        "broken",
        "--http_port",
        str(free_port()),
        "--grpc_port",
        str(free_port()),
        *layout,
    ]
    try:
        return subprocess.run(
            [sys.executable, "-m", "huggingfaceserver", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        pytest.fail(f"the server did not exit within 120s:\n{stderr}")


def test_a_model_that_fails_to_load_exits_non_zero_with_our_error(failed_start):
    assert failed_start.returncode == 1, failed_start.stderr
    assert "huggingfaceserver: error: cannot load the model" in failed_start.stderr


def test_a_model_that_fails_to_load_ends_with_one_error_line(failed_start):
    stderr = failed_start.stderr
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("huggingfaceserver: error: "), stderr
    assert "Traceback" not in stderr, stderr
