"""A tiny Llama that thinks: after any chat prompt its greedy output is
``<think>`` + :data:`REASONING` + ``</think>`` + :data:`ANSWER`, then end of sequence.

A random model never writes the markers, so this one follows a script: each token of the
script has a one-hot embedding, the layer adds nothing (its output projections are zero), and
``lm_head`` maps each token to the next one (a bigram table), so greedy decoding walks the
script from the generation prompt's last token. Its head size is 32, as vLLM's CPU attention
needs, so both backends serve it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tiny_models import build_llama

THINK_START, THINK_END = "<think>", "</think>"
REASONING = "Paris is the capital"
ANSWER = "France has Paris."
GENERATION_PROMPT = "<|assistant|>\n"
# The tiny chat template, plus what thinking models' templates do: an assistant's earlier
# reasoning_content is written back in its markers, and enable_thinking is read.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>"
    "{% endif %}{{ message['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    "{% if add_generation_prompt %}" + GENERATION_PROMPT + "{% endif %}"
)
HIDDEN = 64
LOGIT = 10.0


def build_thinking_llama(out_dir: str | Path) -> Path:
    """Save the scripted model and its tokenizer (the markers added as tokens) to ``out_dir``."""
    build_llama(out_dir, hidden_size=HIDDEN)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_tokens([THINK_START, THINK_END])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    script = [
        ids(GENERATION_PROMPT)[-1],
        *ids(THINK_START + REASONING + THINK_END + ANSWER),
        tokenizer.eos_token_id,
    ]
    assert len(set(script)) == len(script) <= HIDDEN, "each token of the script once"
    assert tokenizer.decode(script[1:-1]) == THINK_START + REASONING + THINK_END + ANSWER
    model = LlamaForCausalLM.from_pretrained(out_dir).eval()
    model.resize_token_embeddings(len(tokenizer))
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for dim, (token, following) in enumerate(zip(script, script[1:], strict=False)):
            model.model.embed_tokens.weight[token, dim] = 1.0
            model.lm_head.weight[following, dim] = LOGIT
    model.save_pretrained(out_dir)
    return Path(out_dir)


def reasoning_token_count(out_dir: str | Path) -> int:
    """The tokens between the markers in the script (what vLLM counts as reasoning tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    return len(tokenizer.encode(REASONING, add_special_tokens=False))
