"""TEI's own clients against the server as a user starts it, in both process layouts:
``huggingface_hub``'s ``InferenceClient`` (the server's URL as its model); LangChain's
embeddings from a virtual environment of their own (``make install-clients``):
``langchain-huggingface``'s ``HuggingFaceEndpointEmbeddings`` (1.1.0, its last release that
takes a server's URL) on the TEI routes and ``langchain-openai``'s ``OpenAIEmbeddings`` on the
OpenAI route (where LangChain's TEI guide now points); tritonclient's gRPC with request
parameters. Every answer held to sentence-transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import huggingface_hub.constants
import numpy as np
import pytest
from huggingface_hub import InferenceClient

from tests.harness import REPO, run_server
from tiny_models import CORPUS

pytestmark = pytest.mark.slow

CLIENTS_PYTHON = REPO / ".venv-clients" / "bin" / "python"
GRPC_CLIENT = REPO / "tests" / "grpc_client.py"
TEXTS = ["The capital of France is Paris.", "food", " ".join(CORPUS[:6])]
KEY = "sk-tei"
LANGCHAIN = """
import json, sys
url, key, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
from langchain_huggingface import HuggingFaceEndpointEmbeddings
from langchain_openai import OpenAIEmbeddings
tei = HuggingFaceEndpointEmbeddings(model=url, huggingfacehub_api_token=key)
openai = OpenAIEmbeddings(model="st", base_url=url + "/openai/v1", api_key=key,
                          check_embedding_ctx_length=False)
print(json.dumps({client: {"documents": embeddings.embed_documents(texts),
                           "query": embeddings.embed_query(texts[0])}
                  for client, embeddings in (("tei", tei), ("openai", openai))}))
"""


@pytest.fixture(scope="module")
def model_path(sentence_models) -> Path:
    """Mean pooling, max_seq_length 16, query/passage prompts, saved by 2.x-3.x."""
    return sentence_models["mean_norm_short", "st3"]


@pytest.fixture(scope="module")
def server(model_path, layout, tmp_path_factory):
    args = ["--model_dir", str(model_path), "--model_name", "st", "--api_key", KEY, *layout]
    with run_server(args, tmp_path_factory.mktemp("tei")) as process:
        yield process


@pytest.fixture(scope="module")
def st(reference, model_path):
    return reference("SentenceTransformer", model_path)


def assert_vectors(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, atol=1e-5)


@pytest.fixture
def online(monkeypatch):
    """The hub client may reach a server (the tests run with HF_HUB_OFFLINE=1, which it reads
    into its constants at import)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_inference_client_feature_extraction(server, st, online):
    client = InferenceClient(model=server.url, token=KEY)
    assert_vectors(client.feature_extraction(TEXTS[0]), st.encode([TEXTS[0]]))
    got = client.feature_extraction(TEXTS[1], prompt_name="query", truncate=True)
    assert_vectors(got, st.encode([TEXTS[1]], prompt_name="query"))
    on_embed = InferenceClient(model=server.url + "/embed", token=KEY)
    assert_vectors(on_embed.feature_extraction(TEXTS[2]), st.encode([TEXTS[2]]))


def test_langchain_embeddings(server, st):
    if not CLIENTS_PYTHON.exists():
        pytest.fail(f"{CLIENTS_PYTHON} is missing: run `make install-clients`")
    environment = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(
        [str(CLIENTS_PYTHON), "-c", LANGCHAIN, server.url, KEY, json.dumps(TEXTS)],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    for answer in answers.values():
        assert_vectors(answer["documents"], st.encode(TEXTS))
        assert_vectors([answer["query"]], st.encode(TEXTS[:1]))


def test_grpc_request_parameters(server, st):
    parameters = json.dumps({"prompt_name": "passage"})
    done = subprocess.run(
        [sys.executable, str(GRPC_CLIENT), f"127.0.0.1:{server.grpc_port}", "st"]
        + ["infer-parameters", parameters, *TEXTS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"GRPC_API_KEY": KEY, "PATH": ""},
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert_vectors(answer["data"], st.encode(TEXTS, prompt_name="passage"))


def test_the_key_guards_teis_routes_but_not_its_health(server):
    refused = httpx.post(f"{server.url}/embed", json={"inputs": "a"}, timeout=30)
    assert refused.status_code == 401
    assert refused.json()["error_type"] == "Validation" and "API key" in refused.json()["error"]
    root = httpx.post(f"{server.url}/", json={"inputs": "a"}, timeout=30)
    assert root.status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    info = httpx.get(f"{server.url}/info", headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert info.json()["model_type"] == {"embedding": {"pooling": "mean"}}
