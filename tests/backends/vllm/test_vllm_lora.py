"""LoRA adapters served under their own model names (``--enable-lora --lora-modules``), with a
random adapter for the tiny Llama written by hand in PEFT's format (no peft needed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from tests.backends.vllm import VLLM_FLAGS, vllm_env
from tests.harness import ServerProcess, run_server

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RANK = 8
HIDDEN = 64
LAYERS = 2


def build_lora_adapter(out_dir: Path, base_model: Path, seed: int = 0) -> Path:
    """A PEFT LoRA adapter (rank 8 on q_proj and v_proj) with random, seeded, non-zero weights:
    large enough that greedy text changes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(base_model),
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for projection in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN, RANK, generator=generator)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out_dir


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], tmp_path_factory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("vllm-lora")
    llama = tiny_models["llama64"]
    adapter = build_lora_adapter(root / "sql-adapter", llama)
    args = ["--model_dir", str(llama), "--model_name", "llm", *VLLM_FLAGS]
    args += ["--enable-lora", "--lora-modules", f"sql={adapter}", "--max-lora-rank", str(RANK)]
    with run_server(args, root, env=vllm_env(root)) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="x", timeout=60)


def greedy(client: openai.OpenAI, model: str) -> openai.types.Completion:
    return client.completions.create(
        model=model, prompt="Hello world", max_tokens=12, temperature=0
    )


def test_the_adapter_is_listed_as_a_model(server, client):
    assert [model.id for model in client.models.list()] == ["llm", "sql"]
    assert httpx.get(f"{server.url}/v1/models", timeout=5).json()["models"] == ["llm", "sql"]
    assert httpx.get(f"{server.url}/v1/models/sql", timeout=5).json() == {
        "name": "sql",
        "ready": True,
    }


def test_the_adapters_model_card_names_it(client):
    card = client.models.retrieve("sql")
    assert card.id == "sql" and card.object == "model"


def test_a_completion_with_the_adapter_differs_from_the_base_model(client):
    base, adapted = greedy(client, "llm"), greedy(client, "sql")
    assert base.model == "llm" and adapted.model == "sql"
    assert adapted.choices[0].finish_reason == "length"
    assert adapted.usage is not None and adapted.usage.completion_tokens == 12
    assert adapted.choices[0].text != base.choices[0].text
    assert greedy(client, "sql").choices[0].text == adapted.choices[0].text


def test_chat_with_the_adapter(client):
    messages = [{"role": "user", "content": "Hello world"}]
    base = client.chat.completions.create(
        model="llm", messages=messages, max_tokens=12, temperature=0
    )
    adapted = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=12, temperature=0
    )
    assert adapted.model == "sql"
    assert adapted.choices[0].message.content != base.choices[0].message.content


def test_a_streamed_completion_with_the_adapter_names_it(client):
    whole = greedy(client, "sql")
    chunks = list(
        client.completions.create(
            model="sql", prompt="Hello world", max_tokens=12, temperature=0, stream=True
        )
    )
    assert {chunk.model for chunk in chunks} == {"sql"}
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        greedy(client, "nosuchadapter")
    assert error.value.status_code == 404
    assert "nosuchadapter" in str(error.value)


# --- adapters at run time -------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime_server(tiny_models: dict[str, Path], tmp_path_factory) -> Iterator[ServerProcess]:
    """No adapter at startup; the folder ``adapters`` (holding ``sql``, the same adapter as
    :func:`server`'s) is ``--lora_adapter_dir``."""
    root = tmp_path_factory.mktemp("vllm-lora-runtime")
    llama = tiny_models["llama64"]
    build_lora_adapter(root / "adapters" / "sql", llama)
    args = ["--model_dir", str(llama), "--model_name", "llm", *VLLM_FLAGS]
    args += ["--enable-lora", "--max-lora-rank", str(RANK)]
    args += ["--enable_runtime_lora", "--lora_adapter_dir", str(root / "adapters")]
    with run_server(args, root, env=vllm_env(root)) as process:
        yield process


def test_an_adapter_loaded_at_run_time_is_served_until_unloaded(runtime_server, client):
    runtime = openai.OpenAI(base_url=f"{runtime_server.url}/openai/v1", api_key="x", timeout=60)
    url = f"{runtime_server.url}/openai/v1"
    outside = httpx.post(
        f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}, timeout=30
    )
    assert outside.status_code == 400 and "outside --lora_adapter_dir" in outside.text
    body = {"lora_name": "sql", "lora_path": "sql"}
    loaded = httpx.post(f"{url}/load_lora_adapter", json=body, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert [model.id for model in runtime.models.list()] == ["llm", "sql"]
    assert greedy(runtime, "sql").choices[0].text == greedy(client, "sql").choices[0].text
    unloaded = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert [model.id for model in runtime.models.list()] == ["llm"]
    with pytest.raises(openai.NotFoundError):
        greedy(runtime, "sql")
