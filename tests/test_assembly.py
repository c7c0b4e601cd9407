"""Which vLLM engine flags the transformers backend reports as ignored: not those it honours
too (LoRA adapters, ``--async-scheduling`` and its negation, ``--kv-cache-memory-bytes``);
``--torch_compile`` reported as ignored by the other backends."""

from __future__ import annotations

import logging

import pytest

from huggingfaceserver.assembly import check_choice
from huggingfaceserver.backends import BackendChoice
from huggingfaceserver.cli import parse_args


@pytest.mark.parametrize("switch", ["--async-scheduling", "--no-async-scheduling"])
def test_the_transformers_backend_names_only_the_engine_flags_it_ignores(caplog, switch):
    config = parse_args(
        [
            *("--model_dir", "/models/llama", "--max-num-seqs", "8", switch, "--enable-lora"),
            *("--kv-cache-memory-bytes", "1G"),
        ]
    )
    logger = logging.getLogger("huggingfaceserver.assembly")
    logger.addHandler(caplog.handler)  # the package logger may not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="huggingfaceserver.assembly"):
            check_choice(config, BackendChoice("huggingface", "a test"))
    finally:
        logger.removeHandler(caplog.handler)
    (line,) = {record.getMessage() for record in caplog.records}
    assert line == "ignored with the transformers backend (vLLM engine flags): --max-num-seqs"


@pytest.mark.parametrize("backend", ["vllm", "onnx"])
def test_torch_compile_is_named_ignored_on_other_backends(caplog, backend):
    config = parse_args(["--model_dir", "/models/llama", "--torch_compile"])
    logger = logging.getLogger("huggingfaceserver.assembly")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="huggingfaceserver.assembly"):
            check_choice(config, BackendChoice(backend, "a test"))
            check_choice(config, BackendChoice("huggingface", "a test"))
    finally:
        logger.removeHandler(caplog.handler)
    (line,) = {record.getMessage() for record in caplog.records}
    assert line.startswith(
        f"--torch_compile compiles the transformers backend's decode steps; "
        f"ignored on {backend} (a test)"
    )
