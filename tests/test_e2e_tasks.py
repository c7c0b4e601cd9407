"""Every task through two front processes and an engine: the answers are the ones the
single-process server gives (itself checked against transformers in tests/encoder_tasks and
tests/backends), for V1, V2 and the OpenAI routes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.harness import client_for, load_model, run_server

pytestmark = pytest.mark.slow

TEXTS = ["john lives in new york", "the [MASK] of france is paris ."]
V2_BODY = {"inputs": [{"name": "input-0", "datatype": "BYTES", "shape": [2], "data": TEXTS}]}

# (tiny model, flags, [(method path, body)]): each case one two-front server
CASES = {
    "fill_mask": ("bert_fill_mask", [], [("/v1/models/m:predict", {"instances": TEXTS[1:]})]),
    "token_classification": (
        "bert_token_classification",
        ["--return_offsets_mapping", "--return_labels"],
        [("/v1/models/m:predict", {"instances": TEXTS}), ("/v2/models/m/infer", V2_BODY)],
    ),
    "sequence_classification": (
        "bert_sequence_classification",
        ["--return_probabilities"],
        [("/v1/models/m:predict", {"instances": TEXTS}), ("/v2/models/m/infer", V2_BODY)],
    ),
    "text2text_generation": (
        "t5",
        [],
        [
            (
                "/openai/v1/completions",
                {"model": "m", "prompt": "translate: hello", "max_tokens": 8, "temperature": 0},
            )
        ],
    ),
}


def comparable(path: str, answer: dict) -> object:
    """What must agree: predictions, V2 outputs, completion texts and usage (not ids)."""
    if path.endswith(":predict"):
        return answer
    if path.endswith("/infer"):
        return answer["outputs"]
    return [choice["text"] for choice in answer["choices"]], answer["usage"]


def assert_close(actual: object, expected: object, where: str = "") -> None:
    """Equal, floats within 1e-4 (processes may run a forward on different CPU thread counts;
    V2 carries score dicts as JSON text)."""
    if isinstance(expected, str) and isinstance(actual, str) and expected.startswith("{"):
        actual, expected = json.loads(actual), json.loads(expected)
    if isinstance(expected, float):
        assert actual == pytest.approx(expected, abs=1e-4), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where


async def in_process(argv: list[str], requests: list[tuple[str, dict]]) -> list[object]:
    model = load_model(argv)
    async with client_for(model) as client:
        answers = [await client.post(path, json=body) for path, body in requests]
    model.stop()
    for answer in answers:
        assert answer.status_code == 200, answer.text
    return [comparable(p, a.json()) for (p, _), a in zip(requests, answers, strict=True)]


@pytest.mark.parametrize("task", list(CASES))
def test_two_fronts_answer_as_one_process_does(task, tiny_models, tmp_path: Path):
    model, flags, requests = CASES[task]
    argv = ["--model_dir", str(tiny_models[model]), "--model_name", "m", *flags]
    expected = asyncio.run(in_process([*argv, "--backend", "huggingface"], requests))
    args = [*argv, "--backend", "huggingface", "--api_workers", "2"]
    with run_server(args, tmp_path) as server:
        for (path, body), want in zip(requests, expected, strict=True):
            answer = httpx.post(server.url + path, json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert_close(comparable(path, answer.json()), want, path)
