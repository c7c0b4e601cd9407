"""Backend choice (CONTRACT.md section 1), with vLLM's presence and support faked."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from huggingfaceserver.backends import choose_backend
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
def test_auto_serves_encoder_tasks_with_transformers(task):
    choice = choose_backend("auto", task, ["BertModel"], installed(True), supports("BertModel"))
    assert choice.name == "huggingface"
    assert task.value in choice.reason


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
