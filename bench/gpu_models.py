"""The GPU benchmark models: real sizes, random weights, built offline into the cache.

- ``bert_base``: ``BertForSequenceClassification`` with bert-base's dimensions (hidden 768,
  12 layers, 12 heads, intermediate 3072) on all-MiniLM-L6-v2's tokenizer and vocabulary;
- ``tinyllama``: ``LlamaForCausalLM`` with TinyLlama-1.1B's dimensions (hidden 2048, 22 layers,
  32 heads, 4 KV heads, intermediate 5632, 32,000 logits) in bf16, on the tests' byte-level
  BPE tokenizer, whose EOS and every token id past that tokenizer's vocabulary are unreachable
  (:func:`bench.models.make_unreachable`): every request generates exactly ``max_tokens``.
"""

from __future__ import annotations

from functools import cached_property
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


def build_bert_base(out_dir: Path) -> Path:
    """A random classifier with bert-base's dimensions and MiniLM's tokenizer."""
    config = BertConfig(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
        **LABELS,
    )
    return save_bert_classifier(config, out_dir)


def build_tinyllama(out_dir: Path) -> Path:
    """A random Llama with TinyLlama-1.1B's dimensions in bf16 (built on the GPU when there is
    one: a 1.1B random init takes minutes on a CPU), EOS unreachable."""
    tokenizer = train_llama_tokenizer(out_dir)
    tokenizer.model_max_length = TINYLLAMA_CONTEXT
    tokenizer.save_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=TINYLLAMA_VOCAB,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
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

    def __init__(self, cache: Path) -> None:
        self.cache = cache

    @cached_property
    def bert_base(self) -> Path:
        return built_once(self.cache / "bert-base-dims-classifier-v1", build_bert_base)

    @cached_property
    def tinyllama(self) -> Path:
        return built_once(self.cache / "tinyllama-dims-bf16-v1", build_tinyllama)
