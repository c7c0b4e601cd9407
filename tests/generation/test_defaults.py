"""A model's own sampling defaults (its generation_config.json), as vLLM's OpenAI server applies
them: read from the folder, ``--generation-config vllm`` for none or another folder,
``--override-generation-config`` over them; applied to the settings a request leaves out, on
the served routes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from huggingfaceserver.assembly import generation_flags
from huggingfaceserver.cli import parse_args
from huggingfaceserver.errors import StartupError
from huggingfaceserver.generation.defaults import NO_DEFAULTS, SamplingDefaults, sampling_defaults
from huggingfaceserver.protocols.openai.requests import ChatCompletionRequest, CompletionRequest
from tests.harness import client_for, load_model

QWEN = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "transformers_version": "4.37.0",
}
"""Qwen2.5-7B-Instruct's generation_config.json."""


def folder_with(tmp_path: Path, settings: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(settings))
    return folder


def defaults_for(folder: Path, *flags: str) -> SamplingDefaults:
    """The model's defaults as the server reads them with these flags."""
    config = parse_args(["--model_dir", str(folder), *flags])
    return sampling_defaults(folder, *generation_flags(config))


def test_the_folders_generation_config_gives_the_defaults(tmp_path):
    folder = folder_with(tmp_path, QWEN)
    assert defaults_for(folder) == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05
    )
    assert defaults_for(folder, "--generation-config", "vllm") == NO_DEFAULTS
    assert defaults_for(tmp_path) == NO_DEFAULTS  # no generation_config.json


def test_another_folder_and_overrides(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 5, "max_new_tokens": 9}))
    folder = folder_with(tmp_path, QWEN)
    assert defaults_for(folder, "--generation-config", str(other)) == SamplingDefaults(
        top_k=5, max_tokens=9
    )
    overridden = defaults_for(folder, "--override-generation-config", '{"temperature": 0.2}')
    assert overridden.temperature == 0.2 and overridden.top_k == 20


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--override-generation-config", "{not json"), "not JSON"),
        (("--override-generation-config", "[1]"), "not a JSON object"),
        (("--override-generation-config", '{"temperature": "hot"}'), "must be a number"),
    ],
)
def test_bad_settings_are_startup_errors(tmp_path, flags, says):
    with pytest.raises(StartupError, match=says):
        defaults_for(folder_with(tmp_path, QWEN), *flags)


def test_a_request_keeps_what_it_sets_and_takes_the_rest():
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    messages = [{"role": "user", "content": "x"}]
    left_out = ChatCompletionRequest(messages=messages).to_sampling_params(defaults=defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.7, 0.8, 20)
    assert left_out.repetition_penalty == 1.05 and left_out.min_p == 0.0
    chosen = ChatCompletionRequest(messages=messages, temperature=1.0, top_k=0, top_p=None)
    params = chosen.to_sampling_params(defaults=defaults)
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 0, 0.8)  # null: the default
    completion = CompletionRequest(prompt="x").to_sampling_params(
        defaults=SamplingDefaults(max_tokens=5)
    )
    assert completion.max_tokens == 5


async def test_a_served_model_generates_with_its_defaults(tiny_models, tmp_path):
    """Greedy and 5 tokens by its generation config: a completion that sets neither is the
    one that asks for both; with --generation-config vllm, 16 tokens sampled."""
    folder = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    settings.update(temperature=0.0, max_new_tokens=5)
    (folder / "generation_config.json").write_text(json.dumps(settings))
    argv = ["--model_dir", str(folder), "--model_name", "m", "--backend", "huggingface"]
    own, neutral = load_model(argv), load_model([*argv, "--generation-config", "vllm"])
    body = {"prompt": "The capital of France", "ignore_eos": True}
    async with client_for(own) as client:
        left_out = (await client.post("/openai/v1/completions", json=body)).json()
        asked = await client.post(
            "/openai/v1/completions", json={**body, "temperature": 0, "max_tokens": 5}
        )
    assert left_out["usage"]["completion_tokens"] == 5
    assert left_out["choices"][0]["text"] == asked.json()["choices"][0]["text"]
    async with client_for(neutral) as client:
        sixteen = (await client.post("/openai/v1/completions", json=body)).json()
    assert sixteen["usage"]["completion_tokens"] == 16
