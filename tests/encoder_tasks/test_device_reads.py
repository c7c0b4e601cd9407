"""Every result kind reads the model's output from its device once per batch, whatever the
number of rows (SPLADE twice: its non-zero terms' count first), and the server's own inputs
(the collated batch) stay on the host.

Counted on the CPU with :class:`SyncCounter`, which there counts every read of values that
would make the host wait for a GPU, the reads of the collated batch left out: it is on the host
whatever the device. The model's own reads (inside its forward) are left out too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import BatchEncoding

from huggingfaceserver.backends.batching import collate
from huggingfaceserver.encoder_tasks.params import Output
from huggingfaceserver.observability.syncs import SyncCounter
from huggingfaceserver.protocols.kserve_model import EncoderModel
from huggingfaceserver.tasks import Task

ROWS = (2, 8)
"""Batch sizes: the reads must be the same at both."""
TEXTS = [
    "The capital of France is Paris.",
    "John lives in New York with his wife Mary.",
    "food",
    "My name is Sarah and I live in London.",
    "A man is eating a piece of bread.",
    "The cat sat on the mat, and the dog slept by the door.",
    "okay",
    "The weather in New York is cold in January and hot in July.",
]
MASKED = [
    "The capital of France is [MASK] .",
    "[MASK] is the capital and the largest [MASK] of France .",
    "John lives in New [MASK] with his wife [MASK] .",
    "[MASK]",
    "The [MASK] is eating [MASK] at the [MASK] .",
    "My name is [MASK] and I live in London .",
    "[MASK] [MASK]",
    "The train leaves at [MASK] .",
]
PAIRS = [("what is the capital of france?", text) for text in TEXTS]
FORWARD = ("--backend", "huggingface")
"""The torch backend: its forward keeps the output on the model's device."""

Encoder = Callable[..., EncoderModel]


def batch_of(model: EncoderModel, count: int, pairs: bool = False) -> BatchEncoding:
    """``count`` rows collated as the batcher collates them."""
    backend = model.backend
    if pairs:
        _, rows = backend.prepare_pair_rows(PAIRS[:count])
    else:
        texts = MASKED if backend.task.task is Task.fill_mask else TEXTS
        _, rows = backend.prepare_rows(texts[:count])
    return collate(rows, backend.batcher.pad_values)


def reads_per_batch(
    model: EncoderModel, kinds: Sequence[str], pairs: bool = False
) -> tuple[int, list[Any]]:
    """The reads of the model's output made by one batch of ``len(kinds)`` rows (each row's
    result of its kind), from the inputs to the results; the results."""
    backend = model.backend
    batch = batch_of(model, len(kinds), pairs)
    counter = SyncCounter(host=batch.values())
    with counter, counter.separating(backend.model):
        results = backend.run_rows(batch, list(kinds))
    assert len(results) == len(kinds) and None not in results
    return counter.outside_module, results


def assert_reads(model: EncoderModel, kind: str, want: int = 1, pairs: bool = False) -> None:
    got = {rows: reads_per_batch(model, [kind] * rows, pairs)[0] for rows in ROWS}
    assert got == dict.fromkeys(ROWS, want)


@pytest.mark.parametrize(
    "flags",
    [(), ("--return_labels",), ("--return_probabilities",), ("--return_raw_logits",)],
    ids=["classes", "labels", "probabilities", "raw-logits"],
)
def test_sequence_classification(encoder: Encoder, tiny_models: dict[str, Path], flags):
    model = encoder(tiny_models["bert_sequence_classification"], *FORWARD, *flags)
    assert_reads(model, Output.task)


@pytest.mark.parametrize("kind", [Output.scores, Output.logits])
def test_sequence_classification_scores_and_logits(
    encoder: Encoder, tiny_models: dict[str, Path], kind: Output
):
    model = encoder(tiny_models["bert_sequence_classification"], *FORWARD)
    assert_reads(model, kind)


@pytest.mark.parametrize("kind", [Output.task, Output.scores, Output.logits])
def test_cross_encoder_scores(encoder: Encoder, sentence_models, kind: Output):
    model = encoder(sentence_models["ce_default", "st6"], *FORWARD)
    assert_reads(model, kind, pairs=True)


def test_a_batch_of_several_kinds_reads_once_per_kind(
    encoder: Encoder, tiny_models: dict[str, Path]
):
    model = encoder(tiny_models["bert_sequence_classification"], *FORWARD)
    kinds = [Output.task, Output.scores, Output.logits, Output.scores] * 2
    reads, results = reads_per_batch(model, kinds)
    assert reads == 3
    batch = batch_of(model, len(kinds))
    raw = model.backend.forward_batch(batch)
    alone = {kind: model.backend.task.results_for(kind, raw, batch) for kind in set(kinds)}
    assert results == [alone[kind][i] for i, kind in enumerate(kinds)]


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--return_labels",),
        ("--return_probabilities",),
        ("--return_raw_logits",),
        ("--return_offsets_mapping",),
        ("--return_offsets_mapping", "--return_probabilities"),
    ],
    ids=["classes", "labels", "probabilities", "raw-logits", "offsets", "offsets-probabilities"],
)
def test_token_classification(encoder: Encoder, tiny_models: dict[str, Path], flags):
    model = encoder(tiny_models["bert_token_classification"], *FORWARD, *flags)
    assert_reads(model, Output.task)


@pytest.mark.parametrize(
    "flags",
    [(), ("--return_probabilities",), ("--return_raw_logits",)],
    ids=["decoded", "probabilities", "raw-logits"],
)
def test_fill_mask(encoder: Encoder, tiny_models: dict[str, Path], flags):
    model = encoder(tiny_models["bert_fill_mask"], *FORWARD, *flags)
    assert_reads(model, Output.task)


@pytest.mark.parametrize(
    "kind", [Output.task, Output.normalized, Output.unnormalized, Output.tokens]
)
def test_text_embedding(encoder: Encoder, tiny_models: dict[str, Path], kind: Output):
    model = encoder(tiny_models["bert_embedding"], *FORWARD)
    assert_reads(model, kind)


def test_token_states_are_each_rows_real_tokens(encoder: Encoder, tiny_models: dict[str, Path]):
    model = encoder(tiny_models["bert_embedding"], *FORWARD)
    batch = batch_of(model, len(TEXTS))
    raw = model.backend.forward_batch(batch)
    got = model.backend.task.results_for(Output.tokens, raw, batch)
    sizes = batch["attention_mask"].sum(dim=1).tolist()
    assert len(set(sizes)) > 1  # padded: the padding is left out
    assert got == [raw[i, :size].tolist() for i, size in enumerate(sizes)]


@pytest.mark.parametrize("name", ["cls_dense_tanh", "instructor", "lasttoken_layernorm"])
def test_sentence_transformers_heads(encoder: Encoder, sentence_models, name: str):
    """Dense and LayerNorm modules, a pooling that leaves the prompt out (its pooling mask)."""
    model = encoder(sentence_models[name, "st6"], *FORWARD)
    assert_reads(model, Output.task)


def test_sparse_embedding(encoder: Encoder, sentence_models):
    model = encoder(sentence_models["splade_max", "st6"], *FORWARD)
    assert_reads(model, Output.task, want=2)
