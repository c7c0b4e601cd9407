"""The ceiling: plain runtimes on the same models, in this process, no server.

Encoders: tokenize + forward (+ pooling or argmax) on torch (under ``torch.inference_mode``) or
on ONNX Runtime with the server's own export, in batches of several sizes, padded per batch; the
best rate is the ceiling, and the batch-1 latencies are what one request costs without a server.
Generation: ``model.generate`` on a left-padded batch, greedy, exactly ``new_tokens`` new tokens
per row (checked); with transformers' dynamic cache (eager) or its static cache, with which
``generate`` compiles the decoding forward itself on a GPU (``torch.compile``, CUDA graphs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

Encode = Callable[[Sequence[str]], torch.Tensor]
WARMUP_BATCHES = 3


@dataclass
class EncoderCeiling:
    """Raw encoder rates (requests/s per repeat, by batch size) and batch-1 latencies."""

    rates: dict[int, list[float]]
    single_ms: list[float]
    """Seconds per batch-1 call (tokenize + forward + post-processing), in ms, every call."""

    @property
    def best_batch(self) -> int:
        return max(self.rates, key=lambda size: statistics.median(self.rates[size]))

    @property
    def best_rate(self) -> float:
        return statistics.median(self.rates[self.best_batch])


@dataclass
class GenerationCeiling:
    """Raw ``generate`` throughput (new tokens/s per repeat) by batch size."""

    rates: dict[int, list[float]]
    new_tokens: int
    prompt_tokens: tuple[int, int]
    """The shortest and longest prompt, in tokens."""


def encoder(
    path: Path,
    task: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    runtime: str = "torch",
) -> Encode:
    """What the server computes for ``task`` (``sequence_classification`` or ``text_embedding``),
    as one function of a batch of texts, with the results on the CPU (as a server needs
    them; on a GPU that also waits for the computation). ``runtime``: ``torch``, or ``onnx``
    (the server's own ONNX export, in an ONNX Runtime session with the server's options)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if runtime == "onnx":
        return onnx_encoder(path, task, tokenizer)

    def tokenize(texts: Sequence[str]) -> Any:
        batch = tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
        return batch.to(device)

    if task == "sequence_classification":
        classifier = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        classifier = classifier.to(device).eval()

        def classify(texts: Sequence[str]) -> torch.Tensor:
            return classifier(**tokenize(texts)).logits.argmax(dim=-1).cpu()

        return classify
    model = AutoModel.from_pretrained(path, dtype=dtype).to(device).eval()

    def embed(texts: Sequence[str]) -> torch.Tensor:
        batch = tokenize(texts)
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(mean, p=2, dim=1).cpu()

    return embed


def onnx_encoder(path: Path, task: str, tokenizer: PreTrainedTokenizerBase) -> Encode:
    """:func:`encoder` on ONNX Runtime: the export the server makes (from the server's cache,
    made there if it is not yet), run as the server runs it."""
    from huggingfaceserver.backends.onnx.export import GraphSpec
    from huggingfaceserver.backends.onnx.session import OnnxSession
    from huggingfaceserver.backends.onnx.store import ExportStore
    from huggingfaceserver.cli import parse_args
    from huggingfaceserver.loading import load_source

    embedding = task == "text_embedding"
    inputs = tuple(name for name in ONNX_INPUTS if name in tokenizer.model_input_names)
    head = "AutoModel" if embedding else "AutoModelForSequenceClassification"
    output = "last_hidden_state" if embedding else "logits"
    source = load_source(parse_args(["--model_dir", str(path), "--task", task]))
    session = ExportStore.default().open(
        source,
        GraphSpec(head, inputs, output),
        False,
        lambda graph: OnnxSession.load(str(graph.path), output),
    )

    def run(texts: Sequence[str]) -> torch.Tensor:
        batch = tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
        raw = session.run(batch)
        if not embedding:
            return raw.argmax(dim=-1)
        mask = batch["attention_mask"].unsqueeze(-1).to(raw.dtype)
        mean = (raw * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(mean, p=2, dim=1)

    return run


ONNX_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
"""The inputs the server's rows carry, in the order its export spec lists them."""


def _batches(texts: Sequence[str], size: int) -> list[Sequence[str]]:
    return [texts[i : i + size] for i in range(0, len(texts), size)]


def time_encoder(encode: Encode, texts: Sequence[str], batch_size: int) -> list[float]:
    """Seconds per batch for ``texts`` cut into batches of ``batch_size``, after a warm-up."""
    batches = _batches(texts, batch_size)
    seconds = []
    with torch.inference_mode():
        for batch in batches[:WARMUP_BATCHES]:
            encode(batch)
        for batch in batches:
            start = time.perf_counter()
            encode(batch)
            seconds.append(time.perf_counter() - start)
    return seconds


def encoder_ceiling(
    path: Path,
    task: str,
    texts: Sequence[str] | Callable[[int], Sequence[str]],
    batch_sizes: Sequence[int],
    repeats: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    runtime: str = "torch",
) -> EncoderCeiling:
    """Requests/s for every batch size, ``repeats`` times (interleaved), and batch-1 latencies.
    ``texts``: the texts for every batch size, or a function of the batch size giving them."""
    encode = encoder(path, task, device, dtype, runtime)
    rates: dict[int, list[float]] = {size: [] for size in batch_sizes}
    single_ms: list[float] = []
    if device != "cpu":  # every padded shape once: a GPU picks kernels per shape on first use
        for size in batch_sizes:
            time_encoder(encode, texts(size) if callable(texts) else texts, size)
    for _ in range(repeats):
        for size in batch_sizes:
            sized = texts(size) if callable(texts) else texts
            seconds = time_encoder(encode, sized, size)
            rates[size].append(len(sized) / sum(seconds))
            if size == 1:
                single_ms += [s * 1000 for s in seconds]
    return EncoderCeiling(rates, single_ms)


def generate_new_tokens(
    model: Any,  # a causal LM; transformers types generate's self and result too loosely
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    new_tokens: int,
    cache_implementation: str | None = None,
) -> float:
    """Seconds for one greedy ``generate`` of ``new_tokens`` tokens on a left-padded batch
    (``cache_implementation``: transformers' name of the KV cache, None for its default).

    Fails when a row got fewer tokens or an EOS: the rate would not be comparable.
    """
    batch = tokenizer(list(prompts), padding=True, return_tensors="pt").to(model.device)
    eos = tokenizer.eos_token_id
    start = time.perf_counter()
    output = model.generate(
        **batch,
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=eos,
        cache_implementation=cache_implementation,
    )
    output = output.cpu()  # waits for the GPU, if any
    seconds = time.perf_counter() - start
    generated = output[:, batch["input_ids"].shape[1] :]
    if generated.shape[1] != new_tokens or bool((generated == eos).any()):
        raise RuntimeError(f"raw generate made {generated.shape[1]} tokens or hit EOS")
    return seconds


def generation_ceiling(
    path: Path,
    prompts: Sequence[str],
    batch_sizes: Sequence[int],
    new_tokens: int,
    repeats: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_implementation: str | None = None,
) -> GenerationCeiling:
    """New tokens/s of ``generate`` for each batch size (prompts taken in order), per repeat;
    ``cache_implementation`` as :func:`generate_new_tokens` takes it."""
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    cache = cache_implementation
    rates: dict[int, list[float]] = {size: [] for size in batch_sizes}
    with torch.inference_mode():
        for size in batch_sizes:  # warm-up: first calls allocate, pick kernels, compile
            for _ in range(2):
                generate_new_tokens(model, tokenizer, prompts[:size], new_tokens, cache)
        for _ in range(repeats):
            for size in batch_sizes:
                seconds = generate_new_tokens(model, tokenizer, prompts[:size], new_tokens, cache)
                rates[size].append(size * new_tokens / seconds)
    lengths = [len(ids) for ids in tokenizer(list(prompts))["input_ids"]]
    return GenerationCeiling(rates, new_tokens, (min(lengths), max(lengths)))
