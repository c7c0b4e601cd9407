"""The GPU benchmark models: real sizes, random weights, built offline into the cache.

- ``bert_base``: ``BertForSequenceClassification`` with bert-base's dimensions (hidden 768,
  12 layers, 12 heads, intermediate 3072) on all-MiniLM-L6-v2's tokenizer and vocabulary;
- ``tinyllama``: ``LlamaForCausalLM`` with TinyLlama-1.1B's dimensions (hidden 2048, 22 layers,
  32 heads, 4 KV heads, intermediate 5632, 32,000 logits) in bf16, on the tests' byte-level
  BPE tokenizer, whose EOS and every token id past that tokenizer's vocabulary are unreachable
  (:func:`bench.models.make_unreachable`): every request generates exactly ``max_tokens``.

:data:`REHEARSAL` builds the same architectures at a few thousandths of the size, for a rehearsal
of the GPU mode on a CPU (``python -m bench --device cuda --rehearse``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path

import torch
from transformers import BertConfig, LlamaConfig, LlamaForCausalLM

from tiny_models import train_llama_tokenizer

from .models import (
    LABELS,
    SEED,
    built_once,
    make_unreachable,
    save_bert_classifier,
    unreachable_tokens,
)

TINYLLAMA_CONTEXT = 2048
TINYLLAMA_VOCAB = 32000


@dataclass(frozen=True)
class Dims:
    """A transformer's sizes: hidden, layers, attention heads (and KV heads), intermediate."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    kv_heads: int = 0
    """0: as many as ``heads``."""


@dataclass(frozen=True)
class Sizes:
    """The sizes of both GPU models, and the name their folders carry in the cache."""

    name: str
    bert: Dims
    llama: Dims


REAL = Sizes(
    "",
    bert=Dims(hidden=768, layers=12, heads=12, intermediate=3072),
    llama=Dims(hidden=2048, layers=22, heads=32, intermediate=5632, kv_heads=4),
)
"""bert-base's and TinyLlama-1.1B's."""
REHEARSAL = Sizes(
    "rehearsal-",
    bert=Dims(hidden=64, layers=2, heads=4, intermediate=128),
    llama=Dims(hidden=64, layers=2, heads=4, intermediate=128, kv_heads=2),
)
"""The same architectures, small enough to rehearse the GPU mode on a CPU in seconds."""


def build_bert_base(out_dir: Path, dims: Dims = REAL.bert) -> Path:
    """A random classifier with bert-base's dimensions (or ``dims``) and MiniLM's tokenizer."""
    config = BertConfig(
        vocab_size=30522,
        hidden_size=dims.hidden,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        intermediate_size=dims.intermediate,
        max_position_embeddings=512,
        **LABELS,
    )
    return save_bert_classifier(config, out_dir)


def build_tinyllama(out_dir: Path, dims: Dims = REAL.llama) -> Path:
    """A random Llama with TinyLlama-1.1B's dimensions (or ``dims``) in bf16 (built on the GPU
    when there is one: a 1.1B random init takes minutes on a CPU), EOS unreachable."""
    tokenizer = train_llama_tokenizer(out_dir)
    tokenizer.model_max_length = TINYLLAMA_CONTEXT
    tokenizer.save_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=TINYLLAMA_VOCAB,
        hidden_size=dims.hidden,
        intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads or dims.heads,
        max_position_embeddings=TINYLLAMA_CONTEXT,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    unused = list(range(len(tokenizer), TINYLLAMA_VOCAB))  # ids the tokenizer cannot decode
    make_unreachable(model, unreachable_tokens(tokenizer) + unused)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


class GpuModels:
    """The GPU models under ``cache``, each built when first asked for."""

    def __init__(self, cache: Path, sizes: Sizes = REAL) -> None:
        self.cache = cache
        self.sizes = sizes

    @cached_property
    def bert_base(self) -> Path:
        folder = self.cache / f"{self.sizes.name}bert-base-dims-classifier-v1"
        return built_once(folder, partial(build_bert_base, dims=self.sizes.bert))

    @cached_property
    def tinyllama(self) -> Path:
        folder = self.cache / f"{self.sizes.name}tinyllama-dims-bf16-v1"
        return built_once(folder, partial(build_tinyllama, dims=self.sizes.llama))
