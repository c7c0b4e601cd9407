"""Transformer mode: tokenize here, run the model on a remote V2 predictor (REST or gRPC)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.harness import REPO, client_for, free_port, load_model, run_server, wait_until

TEXTS = ["the capital of france is paris .", "john lives in new york"]


@pytest.fixture(scope="module")
def classifier(tiny_models, tmp_path_factory) -> Path:
    """The tiny BERT classifier, with a tokenizer that returns no token_type_ids by default."""
    path = tmp_path_factory.mktemp("remote") / "bert"
    shutil.copytree(tiny_models["bert_sequence_classification"], path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["model_input_names"] = ["input_ids", "attention_mask"]
    config_file.write_text(json.dumps(config))
    return path


def start_predictor(classifier: Path, record: Path, *extra: str):
    """The fake predictor process, ready: (process, http host:port, grpc host:port)."""
    http_port, grpc_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "tests/fake_predictor.py", str(classifier), "clf", str(http_port),
         str(grpc_port), str(record), *extra],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/v2/models/clf/ready").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        process.kill()
        pytest.fail("fake predictor did not start")
    return process, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def predictor(classifier, tmp_path_factory):
    """The fake predictor process: (http host:port, grpc host:port, record file)."""
    record = tmp_path_factory.mktemp("record") / "inputs.jsonl"
    process, http, grpc = start_predictor(classifier, record)
    yield http, grpc, record
    process.terminate()
    process.wait(timeout=30)


def reference_logits(path: Path, texts: list[str]) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return model(**tokenizer(texts, padding=True, return_tensors="pt")).logits


async def remote_predict(classifier, host, *flags, texts=TEXTS):
    model = load_model(
        [
            "--model_dir",
            str(classifier),
            "--model_name",
            "clf",
            "--predictor_host",
            host,
            "--return_raw_logits",
            *flags,
        ]
    )
    async with client_for(model) as client:
        response = await client.post("/v1/models/clf:predict", json={"instances": texts})
    return response


def last_inputs(record: Path) -> list[str]:
    return json.loads(record.read_text().splitlines()[-1])


@pytest.mark.parametrize("protocol", ["v2", "grpc-v2"])
async def test_remote_predictor_gives_the_local_results(classifier, predictor, protocol):
    http, grpc, record = predictor
    host = http if protocol == "v2" else grpc
    response = await remote_predict(classifier, host, "--predictor_protocol", protocol)
    assert response.status_code == 200, response.text
    got = torch.tensor([list(d.values()) for d in response.json()["predictions"]])
    assert torch.allclose(got, reference_logits(classifier, TEXTS), atol=1e-5)
    assert last_inputs(record) == ["attention_mask", "input_ids"]


async def test_return_token_type_ids_sends_them(classifier, predictor):
    http, _, record = predictor
    response = await remote_predict(
        classifier, http, "--predictor_protocol", "v2", "--return_token_type_ids"
    )
    assert response.status_code == 200, response.text
    assert last_inputs(record) == ["attention_mask", "input_ids", "token_type_ids"]


async def test_tensor_input_names_selects_the_tensors_sent(classifier, predictor):
    http, _, record = predictor
    response = await remote_predict(
        classifier,
        http,
        "--predictor_protocol",
        "v2",
        "--tensor_input_names",
        "input_ids",
        texts=TEXTS[:1],
    )
    assert response.status_code == 200, response.text
    assert last_inputs(record) == ["input_ids"]
    got = torch.tensor([list(d.values()) for d in response.json()["predictions"]])
    assert torch.allclose(got, reference_logits(classifier, TEXTS[:1]), atol=1e-5)


async def test_unreachable_predictor_is_a_502(classifier):
    response = await remote_predict(
        classifier, f"127.0.0.1:{free_port()}", "--predictor_protocol", "v2"
    )
    assert response.status_code == 502
    assert "predictor" in response.json()["error"]


def test_v1_predictor_protocol_is_a_startup_error(classifier):
    from huggingfaceserver.errors import StartupError

    with pytest.raises(StartupError, match="predictor_protocol"):
        load_model(["--model_dir", str(classifier), "--predictor_host", "localhost:1"])


HUNG_WORD = "paris"
"""A call whose input holds this word's token is never answered by the hanging predictor."""


def test_a_hung_predictor_call_is_a_504_and_holds_up_no_other_request(classifier, tmp_path):
    """A real server in transformer mode: while one request's predictor call hangs, others are
    answered; the hung one gets a 504 at --predictor_request_timeout_seconds."""
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    hang_id = tokenizer.convert_tokens_to_ids(HUNG_WORD)
    assert hang_id != tokenizer.unk_token_id  # a word of its own, not every unknown one
    record = tmp_path / "inputs.jsonl"
    process, http, _ = start_predictor(classifier, record, str(hang_id))
    args = [
        "--model_dir", str(classifier), "--model_name", "clf", "--predictor_host", http,
        "--predictor_protocol", "v2", "--return_raw_logits",
        "--predictor_request_timeout_seconds", "10", "--max_concurrent_predictor_calls", "2",
    ]  # fmt: skip
    try:
        with run_server(args, tmp_path) as server:
            url = f"{server.url}/v1/models/clf:predict"
            with ThreadPoolExecutor(1) as pool:
                hung = pool.submit(
                    httpx.post, url, json={"instances": [f"the capital is {HUNG_WORD}"]},
                    timeout=120,
                )  # fmt: skip
                # the hung call has reached the predictor (it records each call first)
                assert wait_until(lambda: record.exists() and record.read_text().strip(), 60)
                for _ in range(5):
                    answered = httpx.post(url, json={"instances": TEXTS[1:]}, timeout=60)
                    assert answered.status_code == 200, answered.text
                    assert not hung.done()
                response = hung.result(timeout=120)
            assert response.status_code == 504, response.text
            assert "--predictor_request_timeout_seconds" in response.json()["error"]
            after = httpx.post(url, json={"instances": TEXTS[1:]}, timeout=60)
            assert after.status_code == 200
            got = torch.tensor([list(d.values()) for d in after.json()["predictions"]])
            assert torch.allclose(got, reference_logits(classifier, TEXTS[1:]), atol=1e-5)
    finally:
        process.kill()  # its hung call would hold up a graceful stop
        process.wait(timeout=30)
