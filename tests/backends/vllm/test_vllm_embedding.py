"""Sentence embeddings on vLLM's pooling runner, asked for with --backend vllm: the same
V1/V2/OpenAI answers as the transformers backend."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest

from tests.backends.vllm import vllm_env
from tests.encoder_tasks.test_embedding import reference_embeddings
from tests.harness import REPO, run_server

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread."]


@pytest.fixture(scope="module")
def server(minilm_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-embed")
    args = ["--model_dir", str(minilm_path), "--model_name", "minilm", "--backend", "vllm"]
    with run_server([*args, "--enforce-eager"], root, env=vllm_env(root)) as process:
        yield process


def test_the_log_says_vllm_serves_it(server):
    assert "backend vllm: --backend vllm" in server.log()


def test_v1_and_v2_equal_transformers(server, minilm_path):
    v1 = httpx.post(
        f"{server.url}/v1/models/minilm:predict", json={"instances": SENTENCES}, timeout=60
    )
    assert v1.status_code == 200, v1.text
    got = np.array(v1.json()["predictions"])
    want = reference_embeddings(minilm_path, SENTENCES).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert float(got[0] @ got[1]) == pytest.approx(0.7553, abs=1e-3)
    body = {"inputs": [{"name": "input-0", "datatype": "BYTES", "shape": [2], "data": SENTENCES}]}
    v2 = httpx.post(f"{server.url}/v2/models/minilm/infer", json=body, timeout=60).json()
    assert v2["outputs"][0]["shape"] == [2, 384] and v2["outputs"][0]["datatype"] == "FP32"
    np.testing.assert_allclose(np.array(v2["outputs"][0]["data"]).reshape(2, 384), got, atol=1e-6)


def test_openai_embeddings_and_rerank(server, minilm_path):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="unused")
    response = client.embeddings.create(model="minilm", input=SENTENCES)
    got = np.array([d.embedding for d in response.data])
    np.testing.assert_allclose(got, reference_embeddings(minilm_path, SENTENCES), atol=1e-5)
    assert response.usage.prompt_tokens > 0
    rerank = httpx.post(
        f"{server.url}/openai/v1/rerank",
        json={"model": "minilm", "query": SENTENCES[0], "documents": [SENTENCES[1], "A violin."]},
        timeout=60,
    ).json()
    assert [r["index"] for r in rerank["results"]] == [0, 1]


def test_bad_input_is_still_a_400(server):
    response = httpx.post(f"{server.url}/v1/models/minilm:predict", json={"instances": [1]})
    assert response.status_code == 400 and "must be a string" in response.json()["error"]


def test_other_encoder_tasks_on_vllm_are_a_startup_error(tiny_models):
    result = subprocess.run(
        [sys.executable, "-m", "huggingfaceserver", "--backend", "vllm",
         "--model_dir", str(tiny_models["bert_fill_mask64"])],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("huggingfaceserver: error: ")
    assert "fill_mask" in last or "BertForMaskedLM" in last


def test_prompts_and_truncation_as_on_transformers(server, minilm_path, reference):
    """A request's prompt, MiniLM's max_seq_length (256) for a long text, and truncation off."""
    st = reference("SentenceTransformer", minilm_path)
    long = " ".join(SENTENCES * 80)  # some 800 tokens
    body = {"model": "minilm", "input": [SENTENCES[0], long], "prompt": "query: "}
    response = httpx.post(f"{server.url}/openai/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 200, response.text
    got = np.array([item["embedding"] for item in response.json()["data"]])
    want = st.encode([SENTENCES[0], long], prompt="query: ")
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.9999
    refused = httpx.post(
        f"{server.url}/openai/v1/embeddings",
        json={"model": "minilm", "input": [long], "truncate": False},
        timeout=60,
    )
    assert refused.status_code == 400
    assert "more than the maximum of 256" in refused.json()["error"]["message"]
