"""Backend choice (CONTRACT.md section 1), with vLLM's presence and support faked."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from huggingfaceserver.backends import choose_backend
from huggingfaceserver.backends.vllm.cache_sizing import KvCachePlan
from huggingfaceserver.errors import StartupError
from huggingfaceserver.tasks import Task

LLAMA = ["LlamaForCausalLM"]
ENCODER_TASKS = [task for task in Task if not task.is_generative]
GENERATIVE_TASKS = [task for task in Task if task.is_generative]


def installed(value: bool) -> Callable[[], bool]:
    return lambda: value


def supports(*known: str) -> Callable[[Sequence[str]], bool]:
    """A fake vLLM model registry that knows only these architectures."""
    return lambda architectures: any(a in known for a in architectures)


@pytest.mark.parametrize("task", ENCODER_TASKS)
def test_auto_serves_encoder_tasks_on_onnx_runtime_with_torch_behind(task):
    choice = choose_backend(
        "auto", task, ["BertModel"], installed(True), supports("BertModel"), onnx=installed(True)
    )
    assert (choice.name, choice.fallback) == ("onnx", True)
    assert task.value in choice.reason


@pytest.mark.parametrize("task", ENCODER_TASKS)
def test_auto_serves_encoder_tasks_with_transformers_without_onnx_runtime(task):
    choice = choose_backend(
        "auto", task, ["BertModel"], installed(True), supports("BertModel"), onnx=installed(False)
    )
    assert choice.name == "huggingface"
    assert task.value in choice.reason


@pytest.mark.parametrize("task", ENCODER_TASKS)
def test_onnx_requested_is_onnx_without_a_fall_back(task):
    choice = choose_backend("onnx", task, ["BertModel"], onnx=installed(True))
    assert (choice.name, choice.fallback) == ("onnx", False)


@pytest.mark.parametrize("task", GENERATIVE_TASKS)
def test_onnx_requested_for_generation_is_an_error(task):
    with pytest.raises(StartupError, match="--backend onnx serves encoder tasks"):
        choose_backend("onnx", task, LLAMA, onnx=installed(True))


@pytest.mark.parametrize("task", ENCODER_TASKS)
def test_openvino_requested_is_openvino(task):
    choice = choose_backend("openvino", task, ["BertModel"], openvino=installed(True))
    assert (choice.name, choice.fallback) == ("openvino", False)


def test_openvino_requested_for_generation_is_an_error():
    with pytest.raises(StartupError, match="--backend openvino serves encoder tasks"):
        choose_backend("openvino", Task.text_generation, LLAMA, openvino=installed(True))


def test_openvino_requested_but_not_installed_says_what_to_install():
    with pytest.raises(StartupError, match=r"pip install huggingfaceserver\[openvino\]"):
        choose_backend("openvino", Task.text_embedding, ["BertModel"], openvino=installed(False))


def test_onnx_requested_but_not_installed_says_what_to_install():
    with pytest.raises(StartupError, match="pip install onnxruntime"):
        choose_backend("onnx", Task.text_embedding, ["BertModel"], onnx=installed(False))


@pytest.mark.parametrize("task", GENERATIVE_TASKS)
def test_auto_picks_vllm_when_installed_and_supported(task):
    choice = choose_backend("auto", task, LLAMA, installed(True), supports(*LLAMA))
    assert choice.name == "vllm"
    assert "LlamaForCausalLM" in choice.reason


def test_auto_falls_back_when_vllm_does_not_support_the_architecture():
    choice = choose_backend(
        "auto", Task.text_generation, ["MyOwnForCausalLM"], installed(True), supports(*LLAMA)
    )
    assert choice.name == "huggingface"
    assert "MyOwnForCausalLM" in choice.reason


def test_auto_falls_back_when_vllm_is_not_installed():
    choice = choose_backend("auto", Task.text_generation, LLAMA, installed(False), supports(*LLAMA))
    assert choice.name == "huggingface"
    assert "not installed" in choice.reason


def test_vllm_requested_but_not_installed_says_what_to_install():
    with pytest.raises(StartupError) as error:
        choose_backend("vllm", Task.text_generation, LLAMA, installed(False), supports(*LLAMA))
    assert "pip install" in str(error.value)


def test_vllm_requested_for_an_unsupported_architecture_is_an_error():
    with pytest.raises(StartupError) as error:
        choose_backend(
            "vllm", Task.text_generation, ["MyOwnForCausalLM"], installed(True), supports(*LLAMA)
        )
    assert "MyOwnForCausalLM" in str(error.value)


def test_vllm_requested_and_supported_is_vllm():
    choice = choose_backend("vllm", Task.text_generation, LLAMA, installed(True), supports(*LLAMA))
    assert choice.name == "vllm"
    assert choice.reason


@pytest.mark.parametrize("task", list(Task))
@pytest.mark.parametrize("vllm_installed", [True, False])
def test_huggingface_requested_is_always_huggingface(task, vllm_installed):
    choice = choose_backend("huggingface", task, LLAMA, installed(vllm_installed), supports(*LLAMA))
    assert choice.name == "huggingface"
    assert choice.reason


# --- vLLM's KV cache (backends/vllm/cache_sizing.py) --------------------------------------------

FITS = KvCachePlan(16 * 1024 * 1024, "KV cache 16 MiB, room for 128 of 128 sequences")
TOO_BIG = KvCachePlan(
    0, "one 131072-token sequence needs 8.00 GiB of KV cache and 2.00 GiB is left"
)


def plan(value: KvCachePlan | None) -> Callable[[], KvCachePlan | None]:
    return lambda: value


def never_asked() -> KvCachePlan | None:
    raise AssertionError("the KV cache matters only where vLLM would serve")


@pytest.mark.parametrize("requested", ["auto", "vllm"])
def test_vllm_gets_the_kv_cache_we_sized_and_says_so(requested):
    choice = choose_backend(
        requested, Task.text_generation, LLAMA, installed(True), supports(*LLAMA), plan(FITS)
    )
    assert choice.name == "vllm"
    assert choice.kv_cache_bytes == FITS.size
    assert choice.reason.endswith("; " + FITS.reason)


@pytest.mark.parametrize("requested", ["auto", "vllm"])
def test_vllm_sizes_the_kv_cache_itself_when_we_do_not(requested):
    choice = choose_backend(
        requested, Task.text_generation, LLAMA, installed(True), supports(*LLAMA), plan(None)
    )
    assert (choice.name, choice.kv_cache_bytes) == ("vllm", None)


def test_auto_falls_back_to_transformers_when_the_kv_cache_does_not_fit():
    choice = choose_backend(
        "auto", Task.text_generation, LLAMA, installed(True), supports(*LLAMA), plan(TOO_BIG)
    )
    assert (choice.name, choice.kv_cache_bytes) == ("huggingface", None)
    assert choice.reason == (
        "vLLM supports LlamaForCausalLM, but its KV cache does not fit: " + TOO_BIG.reason
    )


def test_vllm_requested_without_room_for_its_kv_cache_says_what_to_set():
    with pytest.raises(StartupError) as error:
        choose_backend(
            "vllm", Task.text_generation, LLAMA, installed(True), supports(*LLAMA), plan(TOO_BIG)
        )
    message = str(error.value)
    assert message.startswith("--backend vllm: vLLM's KV cache does not fit: " + TOO_BIG.reason)
    assert "VLLM_CPU_KVCACHE_SPACE" in message and "--kv-cache-memory-bytes" in message
    assert "--max_model_len" in message


@pytest.mark.parametrize(
    ("requested", "task", "known"),
    [
        ("huggingface", Task.text_generation, LLAMA),
        ("auto", Task.text_embedding, LLAMA),
        ("auto", Task.text_generation, ["OtherForCausalLM"]),
    ],
)
def test_the_kv_cache_is_not_sized_where_vllm_does_not_serve(requested, task, known):
    choice = choose_backend(
        requested, task, LLAMA, installed(True), supports(*known), never_asked, installed(False)
    )
    assert choice.name == "huggingface"


def refuses(reason: str | None) -> Callable[[], str | None]:
    """A fake check of whether vLLM runs the model on this machine."""
    return lambda: reason


@pytest.mark.parametrize("task", GENERATIVE_TASKS)
def test_auto_serves_a_model_vllm_cannot_run_here_on_transformers(task):
    choice = choose_backend(
        "auto", task, LLAMA, installed(True), supports(*LLAMA), refuses=refuses("head size 16")
    )
    assert (choice.name, choice.reason) == ("huggingface", "head size 16")


def test_vllm_requested_for_a_model_it_cannot_run_here_is_an_error():
    with pytest.raises(StartupError, match="--backend vllm: head size 16; --backend auto"):
        choose_backend(
            "vllm",
            Task.text_generation,
            LLAMA,
            installed(True),
            supports(*LLAMA),
            refuses=refuses("head size 16"),
        )


def test_a_model_vllm_runs_is_not_refused():
    task = Task.text_generation
    choice = choose_backend(
        "auto", task, LLAMA, installed(True), supports(*LLAMA), refuses=refuses(None)
    )
    assert choice.name == "vllm"
