"""Our flags and vLLM's pass-through flags as vLLM's ``AsyncEngineArgs``, request parameters as
vLLM's ``SamplingParams``, LoRA modules kept out of the engine's argv, and the backend choice,
against the installed vLLM's own parser and model registry (no engine is started)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from huggingfaceserver.assembly import build_model, locate
from huggingfaceserver.backends import choose_backend, installed_engine_flag_names
from huggingfaceserver.cli import KNOWN_VLLM_ENGINE_FLAGS, ServerConfig, parse_args
from huggingfaceserver.errors import BadRequest, StartupError
from huggingfaceserver.generation.params import SamplingParams
from huggingfaceserver.loading import load_source
from huggingfaceserver.tasks import Task
from tests.harness import REPO

vllm = pytest.importorskip("vllm")

from vllm.sampling_params import RequestOutputKind  # noqa: E402

from huggingfaceserver.backends.lora import LoraModule, lora_modules  # noqa: E402
from huggingfaceserver.backends.vllm.attention_fit import attention_refusal  # noqa: E402
from huggingfaceserver.backends.vllm.compat import engine_flag_names  # noqa: E402
from huggingfaceserver.backends.vllm.engine_args import (  # noqa: E402
    build_engine_args,
    engine_argv,
)
from huggingfaceserver.backends.vllm.generation import to_vllm_params  # noqa: E402

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module")
def llama_path(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama64"]


def config_for(model_dir: Path, *flags: str) -> ServerConfig:
    """The config ``python -m huggingfaceserver`` builds for these flags (vLLM installed)."""
    argv = ["--model_dir", str(model_dir), "--model_name", "llm", *flags]
    return parse_args(argv, more_engine_flag_names=installed_engine_flag_names)


def engine_args_for(model_dir: Path, *flags: str) -> Any:
    config = config_for(model_dir, *flags)
    return build_engine_args(load_source(config), config)


# --- AsyncEngineArgs ------------------------------------------------------------------------


def test_our_flags_become_engine_arguments(llama_path):
    args = engine_args_for(
        llama_path, "--dtype", "float16", "--max_model_len", "64", "--trust_remote_code"
    )
    assert args.model == str(llama_path)
    assert args.tokenizer == str(llama_path)
    assert args.served_model_name == ["llm"]
    assert args.dtype == "float16"
    assert args.max_model_len == 64
    assert args.trust_remote_code is True


def test_defaults_leave_the_context_to_vllm(llama_path):
    args = engine_args_for(llama_path)
    assert args.dtype == "float32"  # auto on a CPU
    assert args.max_model_len is None
    assert args.trust_remote_code is False


@pytest.mark.parametrize("spelling", ["dashed", "underscored"])
def test_pass_through_flags_reach_the_engine(llama_path, spelling):
    flags = [
        "--max-num-seqs", "8",
        "--enforce-eager",
        "--gpu-memory-utilization", "0.5",
        "--enable-prefix-caching",
    ]  # fmt: skip
    if spelling == "underscored":
        flags = ["--" + f[2:].replace("-", "_") if f.startswith("--") else f for f in flags]
    args = engine_args_for(llama_path, *flags)
    assert args.max_num_seqs == 8
    assert args.enforce_eager is True
    assert args.gpu_memory_utilization == 0.5
    assert args.enable_prefix_caching is True


@pytest.mark.parametrize("flag", ["--reasoning-parser", "--reasoning_parser"])
def test_the_reasoning_parser_is_ours_and_vllms(llama_path, flag):
    # Ours (the split of chat output) and the engine's (its grammar starts after the reasoning)
    config = config_for(llama_path, flag, "qwen3")
    assert config.reasoning_parser == "qwen3" and "reasoning-parser" not in config.engine_flags
    args = build_engine_args(load_source(config), config)
    assert args.reasoning_parser == "qwen3"
    assert engine_args_for(llama_path).reasoning_parser == ""


def test_the_users_tensor_parallel_size_is_never_overridden(llama_path):
    config = config_for(llama_path, "--tensor-parallel-size", "2")
    assert engine_argv(load_source(config), config).count("--tensor-parallel-size") == 1
    assert build_engine_args(load_source(config), config).tensor_parallel_size == 2


def test_older_speculative_flags_become_a_speculative_config(llama_path):
    args = engine_args_for(llama_path, "--speculative-model", "X", "--num-speculative-tokens", "3")
    assert args.speculative_config == {"model": "X", "num_speculative_tokens": 3}


def test_older_speculative_flags_complete_an_explicit_speculative_config(llama_path):
    args = engine_args_for(
        llama_path,
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}',
        "--speculative-model", "X",
        "--num-speculative-tokens", "3",
    )  # fmt: skip
    # the explicit JSON wins where both say something
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 5, "model": "X"}


def test_lora_modules_stay_out_of_the_engine_argv(llama_path, tmp_path):
    config = config_for(llama_path, "--enable-lora", "--lora-modules", f"sql={tmp_path}")
    argv = engine_argv(load_source(config), config)
    assert "--lora-modules" not in argv and "--enable-lora" in argv
    assert lora_modules(config) == [LoraModule("sql", str(tmp_path))]


def test_a_known_front_end_flag_does_not_crash_the_engine_parser(llama_path):
    # Accepted by our parser (a manifest written for the vLLM image), but not an engine
    # argument: ignored with a warning (as on the transformers backend) or refused as a
    # StartupError, never an argparse exit from inside build_model.
    with contextlib.suppress(StartupError):
        engine_args_for(llama_path, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def test_our_kv_cache_size_reaches_the_engine(llama_path):
    config = config_for(llama_path)
    assert build_engine_args(load_source(config), config).kv_cache_memory_bytes is None
    args = build_engine_args(load_source(config), config, kv_cache_bytes=3 << 20)
    assert args.kv_cache_memory_bytes == 3 << 20


def test_on_a_cpu_the_auto_backend_sizes_the_kv_cache(llama_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    config = config_for(llama_path, "--max-num-seqs", "8")
    source, choice = locate(config)
    # 8 sequences of one 128-token block, 1 KiB a token: what the engine can use
    assert (choice.name, choice.kv_cache_bytes) == ("vllm", 8 * 128 * 1024)
    built = build_model(config, (source, choice))  # no weights are loaded
    assert built.backend.engine_args.kv_cache_memory_bytes == 8 * 128 * 1024


@pytest.mark.parametrize("flag", ["--gpu-memory-utilization", "--kv-cache-memory-bytes"])
def test_a_user_sizing_flag_leaves_the_kv_cache_to_vllm(llama_path, monkeypatch, flag):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    value = "0.5" if flag == "--gpu-memory-utilization" else "1G"
    config = config_for(llama_path, flag, value)
    _, choice = locate(config)
    assert (choice.name, choice.kv_cache_bytes) == ("vllm", None)
    assert "KV cache" not in choice.reason


# --- flag names -----------------------------------------------------------------------------


def test_engine_flag_names_come_from_vllms_engine_arguments():
    names = engine_flag_names()
    assert {"max-num-seqs", "kv-cache-dtype", "enforce-eager", "tensor-parallel-size"} <= names
    assert {"lora-modules", "speculative-model", "num-speculative-tokens"} <= names
    assert "no-enable-prefix-caching" in names  # a boolean's negation is a flag too
    assert all(not name.startswith("-") and "_" not in name for name in names)
    assert all(name == name.lower() for name in names)  # no metavar (``MAX_MODEL_LEN``)


def flag_missing_from_the_static_list() -> str:
    """A flag of the installed vLLM that cli.KNOWN_VLLM_ENGINE_FLAGS does not list."""
    extra = sorted(engine_flag_names() - KNOWN_VLLM_ENGINE_FLAGS)
    assert extra, "every vLLM flag is in the static list: pick another check"
    return "max-num-scheduled-tokens" if "max-num-scheduled-tokens" in extra else extra[0]


@pytest.mark.parametrize("spelling", ["dashed", "underscored"])
def test_a_flag_only_the_installed_vllm_knows_is_accepted(llama_path, spelling):
    name = flag_missing_from_the_static_list()
    typed = f"--{name}" if spelling == "dashed" else f"--{name.replace('-', '_')}"
    config = config_for(llama_path, typed, "7")
    assert config.engine_flags[name] == ["7"]


def test_a_bogus_flag_still_exits_2(llama_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        config_for(llama_path, "--max-num-seqs", "8", "--no-such-vllm-flag", "1")
    assert exit_.value.code == 2
    assert "--no-such-vllm-flag" in capsys.readouterr().err


# --- SamplingParams -------------------------------------------------------------------------


def test_every_sampling_parameter_maps_onto_vllms():
    params = SamplingParams(
        n=2,
        max_tokens=7,
        min_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logit_bias={3: 1.5, 7: -2.0},
        stop=("ab", "cd"),
        stop_token_ids=(4, 9),
        ignore_eos=True,
        logprobs=2,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    out = to_vllm_params(params)
    assert isinstance(out, vllm.SamplingParams)
    assert (out.n, out.max_tokens, out.min_tokens) == (2, 7, 2)
    assert (out.temperature, out.top_p, out.top_k, out.min_p) == (0.7, 0.9, 5, 0.05)
    assert out.seed == 42
    assert (out.presence_penalty, out.frequency_penalty, out.repetition_penalty) == (
        0.5,
        0.25,
        1.1,
    )
    assert out.logit_bias == {3: 1.5, 7: -2.0}
    assert list(out.stop) == ["ab", "cd"]
    assert list(out.stop_token_ids) == [4, 9]
    assert out.ignore_eos is True
    assert out.logprobs == 2
    assert out.include_stop_str_in_output is True
    assert out.skip_special_tokens is False
    assert out.output_kind == RequestOutputKind.DELTA


def test_defaults_map_onto_vllms_defaults():
    out = to_vllm_params(SamplingParams())
    assert out.top_k == -1  # our 0: top-k disabled
    assert out.logit_bias is None
    assert not out.stop and not out.stop_token_ids
    assert out.logprobs is None and out.seed is None
    assert out.output_kind == RequestOutputKind.DELTA


def test_the_largest_seed_fits_vllms_engine_messages():
    """vLLM seeds its ``n`` choices ``seed + index`` and sends them to its engine as uint64:
    a seed past int64 is taken modulo 2**63."""
    out = to_vllm_params(SamplingParams(n=128, temperature=1, seed=2**64 - 1))
    assert out.seed == 2**63 - 1 and out.seed + 127 < 2**64
    assert to_vllm_params(SamplingParams(seed=-(2**63))).seed == -(2**63)
    assert to_vllm_params(SamplingParams(seed=2**63 - 1)).seed == 2**63 - 1


def test_greedy_with_several_choices_generates_one():
    out = to_vllm_params(SamplingParams(n=3, temperature=0.0))
    assert out.n == 1 and out.temperature == 0.0


def test_a_value_vllm_refuses_is_a_bad_request():
    with pytest.raises(BadRequest, match="min_p"):
        to_vllm_params(SamplingParams(min_p=2.0))


# --- backend choice with the real model registry -------------------------------------------


def test_auto_picks_vllm_for_llama():
    choice = choose_backend("auto", Task.text_generation, ["LlamaForCausalLM"])
    assert choice.name == "vllm"
    assert "LlamaForCausalLM" in choice.reason


def test_auto_picks_transformers_for_t5():
    choice = choose_backend("auto", Task.text2text_generation, ["T5ForConditionalGeneration"])
    assert choice.name == "huggingface"
    assert "T5ForConditionalGeneration" in choice.reason


@pytest.mark.parametrize(
    ("model", "backend", "class_name"),
    [("llama64", "vllm", "VLLMGenerator"), ("t5", "huggingface", "TransformersGenerator")],
)
def test_the_choice_and_its_reason_are_logged(tiny_models, caplog, model, backend, class_name):
    logger = logging.getLogger("huggingfaceserver.assembly")
    logger.addHandler(caplog.handler)  # the package logger may not propagate (records: a set)
    try:
        with caplog.at_level(logging.INFO, logger="huggingfaceserver.assembly"):
            built = build_model(config_for(tiny_models[model]))  # no weights are loaded
    finally:
        logger.removeHandler(caplog.handler)
    assert type(built.backend).__name__ == class_name
    (line,) = {r.getMessage() for r in caplog.records if r.getMessage().startswith("backend ")}
    architecture = "LlamaForCausalLM" if model == "llama64" else "T5ForConditionalGeneration"
    assert line.startswith(f"backend {backend}: ") and architecture in line


def test_the_cpu_attention_refuses_a_head_size_it_has_no_kernel_for(tiny_models):
    """The tiny Llama's heads are 16 wide: vLLM's CPU engine would start, then die at the first
    forward; with 32 (llama64) it runs."""
    narrow = load_source(config_for(tiny_models["llama"]))
    refusal = attention_refusal(narrow, on_cpu=True)
    assert refusal is not None and "LlamaForCausalLM's head size 16" in refusal
    assert "32" in refusal
    assert attention_refusal(narrow, on_cpu=False) is None  # other platforms take any size
    assert attention_refusal(load_source(config_for(tiny_models["llama64"])), on_cpu=True) is None


def test_auto_serves_a_model_vllm_cannot_run_here_on_transformers(tiny_models, caplog):
    logger = logging.getLogger("huggingfaceserver.assembly")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="huggingfaceserver.assembly"):
            built = build_model(config_for(tiny_models["llama"]))  # no weights are loaded
    finally:
        logger.removeHandler(caplog.handler)
    assert type(built.backend).__name__ == "TransformersGenerator"
    (line,) = {r.getMessage() for r in caplog.records if r.getMessage().startswith("backend ")}
    assert line.startswith("backend huggingface: vLLM's CPU attention") and "16" in line


def test_backend_vllm_for_a_model_vllm_cannot_run_here_is_a_startup_error(tiny_models):
    with pytest.raises(StartupError, match="--backend vllm: vLLM's CPU attention .* head size 16"):
        locate(config_for(tiny_models["llama"], "--backend", "vllm"))


@pytest.mark.slow
def test_backend_vllm_for_an_unsupported_architecture_exits_1(tiny_models):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "huggingfaceserver", "--model_dir", str(tiny_models["t5"])]
        + ["--backend", "vllm"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 60
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("huggingfaceserver: error: ")
    assert "T5ForConditionalGeneration" in last
    assert "Traceback" not in result.stderr


def test_structured_output_is_llguidance_with_compact_json_unless_the_user_says(llama_path):
    config = engine_args_for(llama_path).structured_outputs_config
    assert config.backend == "guidance" and config.disable_any_whitespace
    own = '{"backend": "xgrammar"}'
    mine = engine_args_for(llama_path, "--structured-outputs-config", own)
    mine = mine.structured_outputs_config
    assert mine.backend == "xgrammar" and not mine.disable_any_whitespace
