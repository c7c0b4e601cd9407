"""LoRA adapters on the transformers backend, served as a user starts it (``--enable-lora
--lora-modules``), driven by the official openai SDK: each adapter is a model of its own, and
completions and chats naming it, alone or beside the other adapter's and the base model's,
give PEFT's own greedy output; in both process layouts."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.harness import ServerProcess, run_server
from tiny_models import build_lora_adapter

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
ADAPTERS = ("sql", "chat")
MESSAGES = [{"role": "user", "content": "Hello world"}]
PROMPTS = ["Hello world", "A man is eating a piece of bread."]


@pytest.fixture(scope="module")
def llama_path(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def adapter_dirs(llama_path: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-lora-adapters")
    return {
        name: build_lora_adapter(llama_path, root / name, seed)
        for seed, name in enumerate(ADAPTERS, start=1)
    }


@pytest.fixture(scope="module")
def server(llama_path, adapter_dirs, layout, tmp_path_factory):
    modules = [f"{name}={path}" for name, path in adapter_dirs.items()]
    args = ["--model_dir", str(llama_path), "--model_name", "llama", "--backend", "huggingface"]
    args += ["--enable-lora", "--lora-modules", *modules]
    with run_server([*args, *layout], tmp_path_factory.mktemp("e2e-lora")) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="x", timeout=60)


@pytest.fixture(scope="module")
def peft_text(llama_path, adapter_dirs) -> Callable[[list[int], str], str]:
    """PEFT's own greedy ``generate`` for the prompt's token ids with an adapter (the model's
    name: the base model), decoded as the server decodes it."""
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    models: dict[str, torch.nn.Module] = {}

    def text(prompt_ids: list[int], model_name: str) -> str:
        if model_name not in models:
            model = AutoModelForCausalLM.from_pretrained(llama_path)
            if model_name in adapter_dirs:
                model = PeftModel.from_pretrained(model, adapter_dirs[model_name])
            models[model_name] = model.eval()
        with torch.no_grad():
            output = models[model_name].generate(
                input_ids=torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS
            )
        return tokenizer.decode(output[0, len(prompt_ids) :], skip_special_tokens=True)

    return text


def tokens(server: ServerProcess, **body) -> list[int]:
    """The prompt's token ids as the server makes them (its tokenize route)."""
    url = f"{server.url}/openai/v1/tokenize"
    response = httpx.post(url, json={"model": "llama", **body}, timeout=10)
    response.raise_for_status()
    return response.json()["tokens"]


def complete(client: openai.OpenAI, model: str, prompt: str) -> openai.types.Completion:
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )


def test_the_adapters_are_listed_as_models(server, client):
    assert [model.id for model in client.models.list()] == ["llama", *ADAPTERS]
    listed = httpx.get(f"{server.url}/v1/models", timeout=5).json()["models"]
    assert listed == ["llama", *ADAPTERS]
    assert client.models.retrieve("sql").id == "sql"


@pytest.mark.parametrize("model", ["llama", *ADAPTERS])
def test_a_completion_naming_an_adapter_is_the_adapters(server, client, peft_text, model):
    completion = complete(client, model, PROMPTS[1])
    assert completion.model == model
    assert completion.choices[0].text == peft_text(tokens(server, prompt=PROMPTS[1]), model)


def test_a_chat_naming_an_adapter_is_the_adapters(server, client, peft_text):
    chat = client.chat.completions.create(
        model="chat", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.model == "chat"
    expected = peft_text(tokens(server, messages=MESSAGES, add_generation_prompt=True), "chat")
    assert chat.choices[0].message.content == expected


def test_both_adapters_and_the_base_model_at_once(server, client, peft_text):
    jobs = [(model, prompt) for model in ("llama", *ADAPTERS) for prompt in PROMPTS] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        completions = list(pool.map(lambda job: complete(client, *job), jobs))
    expected = {prompt: tokens(server, prompt=prompt) for prompt in PROMPTS}
    for (model, prompt), completion in zip(jobs, completions, strict=True):
        assert completion.choices[0].text == peft_text(expected[prompt], model), model
    assert len({c.choices[0].text for c in completions[: len(jobs) // 2]}) == len(jobs) // 2


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        complete(client, "nosuchadapter", PROMPTS[0])
    assert "nosuchadapter" in str(error.value)


# --- adapters at run time -------------------------------------------------------------------

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def runtime_server(llama_path, adapter_dirs, tmp_path_factory):
    """Adapters loaded at run time from the folder that holds both, behind an API key; one
    process (run-time loading needs it)."""
    folder = adapter_dirs["sql"].parent
    args = ["--model_dir", str(llama_path), "--model_name", "llama", "--backend", "huggingface"]
    args += ["--enable-lora", "--enable_runtime_lora", "--lora_adapter_dir", str(folder)]
    args += ["--api_key", KEY, "--api_workers", "1"]
    with run_server(args, tmp_path_factory.mktemp("e2e-lora-runtime")) as process:
        yield process


def post(server: ServerProcess, route: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}/openai/v1/{route}", json=body, headers=headers, timeout=30)


def test_loading_at_run_time_needs_the_api_key(runtime_server):
    body = {"lora_name": "sql", "lora_path": "sql"}
    assert post(runtime_server, "load_lora_adapter", body, headers={}).status_code == 401
    assert post(runtime_server, "unload_lora_adapter", {"lora_name": "sql"}, {}).status_code == 401


def test_an_adapter_loaded_at_run_time_is_served_until_unloaded(runtime_server, peft_text):
    client = openai.OpenAI(base_url=f"{runtime_server.url}/openai/v1", api_key=KEY, timeout=60)
    loaded = post(runtime_server, "load_lora_adapter", {"lora_name": "sql", "lora_path": "sql"})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'sql' added successfully."
    assert [model.id for model in client.models.list()] == ["llama", "sql"]
    ids = httpx.post(
        f"{runtime_server.url}/openai/v1/tokenize",
        json={"model": "llama", "prompt": PROMPTS[1]},
        headers=AUTH,
        timeout=10,
    ).json()["tokens"]
    assert complete(client, "sql", PROMPTS[1]).choices[0].text == peft_text(ids, "sql")
    again = post(runtime_server, "load_lora_adapter", {"lora_name": "sql", "lora_path": "chat"})
    assert again.status_code == 400 and "already been loaded" in again.text
    replaced = post(  # vLLM's load_inplace: the name now serves the other adapter
        runtime_server,
        "load_lora_adapter",
        {"lora_name": "sql", "lora_path": "chat", "load_inplace": True},
    )
    assert replaced.status_code == 200, replaced.text
    assert [model.id for model in client.models.list()] == ["llama", "sql"]
    assert complete(client, "sql", PROMPTS[1]).choices[0].text == peft_text(ids, "chat")
    unloaded = post(runtime_server, "unload_lora_adapter", {"lora_name": "sql"})
    assert unloaded.status_code == 200, unloaded.text
    assert [model.id for model in client.models.list()] == ["llama"]
    with pytest.raises(openai.NotFoundError):
        complete(client, "sql", PROMPTS[1])
    missing = post(runtime_server, "unload_lora_adapter", {"lora_name": "sql"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The lora adapter 'sql' cannot be found."


def test_a_path_outside_the_adapter_dir_is_refused(runtime_server, llama_path):
    for path in (str(llama_path), "../../..", "/etc"):
        refused = post(runtime_server, "load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert refused.status_code == 400, refused.text
        assert "outside --lora_adapter_dir" in refused.json()["error"]["message"]


def test_loading_at_run_time_is_a_404_unless_enabled(server):
    refused = post(server, "load_lora_adapter", {"lora_name": "x", "lora_path": "x"}, {})
    assert refused.status_code == 404
    assert "--enable_runtime_lora" in refused.json()["error"]["message"]
