"""Prompts fed in a decode step's forward (backends/pytorch/ragged.py): the packed forward
gives every row the logits the separate forwards give (the decode rows' next tokens, each
prompt's first), its keys and values land where later steps read them, a forward that fails
leaves the batch as it was, and a model that cannot run it keeps its own attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from huggingfaceserver.backends.pytorch.decode_batch import (
    PromptPart,
    ReservedCausalLMBatch,
    mixes_prompts,
)
from huggingfaceserver.backends.pytorch.kv_cache import ReservedCache
from huggingfaceserver.backends.pytorch.ragged import FALLBACKS, RAGGED, enable_mixed_steps

from .generation_helpers import PROMPTS, forward_shapes, prompt

STEPS = 3


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def columns(vocab: int, rows: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` columns of one random token per row."""
    ids = torch.randint(0, vocab, (steps, rows), generator=torch.Generator().manual_seed(seed))
    return ids.tolist()


def packed_against_apart(
    new_batch, vocab: int, running: list[list[int]], joining: list[list[int]]
) -> None:
    """Rows of ``running`` decode a while; one step then feeds ``joining``'s prompts too; all
    rows step on together. Every logits row equals the same forwards run apart."""
    warm, then = columns(vocab, len(running), STEPS, 0), columns(vocab, len(running), 1, 1)
    after = columns(vocab, len(running) + len(joining), STEPS, 2)
    with torch.inference_mode():
        apart = new_batch()
        apart.prefill_together(running, [1] * len(running))
        for column in warm:
            apart.step(column)
        expected = [apart.step(then[0])]
        alone = []
        for ids in joining:
            batch = new_batch()
            expected.append(batch.prefill(ids, 1)[0])
            alone.append(batch)
        later = []
        for column in after:
            step = [apart.step(column[: len(running)])]
            step += [b.step([t]) for b, t in zip(alone, column[len(running) :], strict=True)]
            later.append(torch.cat(step))

        packed = new_batch()
        assert packed.mixes
        packed.prefill_together(running, [1] * len(running))
        for column in warm:
            packed.step(column)
        close(packed.step_mixing(then[0], joining), torch.cat(expected))
        for column, want in zip(after, later, strict=True):
            close(packed.step(column), want)


def parts_against_apart(
    new_batch, vocab: int, running: list[list[int]], long: list[int], size: int
) -> None:
    """Rows of ``running`` decode; each of their steps feeds the next ``size`` tokens of
    ``long`` into its own batch (every other part keeping every position's logits, as a
    scored prompt's); once it is all in, its row joins theirs and all step on. Every logits
    row equals the same forwards run apart (the parts by ``prefill_part``/``score_part``)."""
    starts = range(0, len(long), size)
    steps = columns(vocab, len(running), len(starts), 5)
    after = columns(vocab, len(running) + 1, STEPS, 6)
    with torch.inference_mode():
        apart, alone = new_batch(), new_batch()
        apart.prefill_together(running, [1] * len(running))
        expected = []
        for turn, (start, column) in enumerate(zip(starts, steps, strict=True)):
            ids = long[start : start + size]
            feed = alone.score_part if turn % 2 else alone.prefill_part
            part = feed(ids, start)
            expected.append(torch.cat([apart.step(column), part.view(-1, part.shape[-1])]))
        alone.finish_prefill(len(long), 1)
        later = [torch.cat([apart.step(c[:-1]), alone.step(c[-1:])]) for c in after]

        packed, parted = new_batch(), new_batch()
        packed.prefill_together(running, [1] * len(running))
        for turn, (start, column, want) in enumerate(zip(starts, steps, expected, strict=True)):
            part = PromptPart(parted, long[start : start + size], start, bool(turn % 2))
            close(packed.step_mixing(column, [], parts=[part]), want)
        parted.finish_prefill(len(long), 1)
        assert packed.absorb(parted)
        for column, want in zip(after, later, strict=True):
            close(packed.step(column), want)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_prompts_parts_fed_in_decode_steps_give_what_feeding_them_apart_gives(
    backends, name
) -> None:
    backend = backends(name)
    running = [prompt(backend, PROMPTS[0]), prompt(backend, PROMPTS[1])]
    long = prompt(backend, PROMPTS[2]) * 2
    parts_against_apart(backend.new_batch, backend.vocab_size, running, long, 5)


def test_a_step_feeding_a_part_and_a_prompt_runs_them_once(backends) -> None:
    """One forward: the running row's token, a new prompt and another prompt's part."""
    backend = backends("llama")
    running, joining = prompt(backend, PROMPTS[0]), prompt(backend, PROMPTS[1])
    long = prompt(backend, PROMPTS[2])
    with torch.inference_mode():
        apart, alone, in_parts = backend.new_batch(), backend.new_batch(), backend.new_batch()
        apart.prefill(running, 1)
        in_parts.prefill_part(long[:4], 0)
        expected = torch.cat(
            [apart.step([7]), alone.prefill(joining, 2)[0], in_parts.score_part(long[4:9], 4)]
        )
        packed, parted = backend.new_batch(), backend.new_batch()
        packed.prefill(running, 1)
        parted.prefill_part(long[:4], 0)
        part = PromptPart(parted, long[4:9], 4, every_position=True)
        with forward_shapes(backend) as shapes:
            got = packed.step_mixing([7], [joining], [2], parts=[part])
        assert shapes == [(1, 1 + len(joining) + 5)]
        close(got, expected)
        assert packed.cache.rows == 3 and parted.cache.end - parted.cache.start == 9


def test_a_failed_step_feeding_a_part_leaves_the_parts_batch_as_it_was(backends) -> None:
    backend = backends("llama")
    running, long = prompt(backend, PROMPTS[0]), prompt(backend, PROMPTS[2])
    with torch.inference_mode():
        packed, parted, kept = backend.new_batch(), backend.new_batch(), backend.new_batch()
        packed.prefill(running, 1)
        for batch in (parted, kept):
            batch.prefill_part(long[:4], 0)
        bad = PromptPart(parted, [backend.vocab_size + 5] * 3, 4)  # not a token
        with pytest.raises(IndexError):
            packed.step_mixing([7], [], parts=[bad])
        assert packed.cache.rows == 1 and parted.cache.end == 4
        close(parted.prefill_part(long[4:8], 4), kept.prefill_part(long[4:8], 4))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wider-than-the-columns"])
def test_a_packed_step_gives_what_the_separate_forwards_give(backends, name, wide) -> None:
    backend = backends(name)
    assert backend.mixes
    running = [prompt(backend, PROMPTS[0]), prompt(backend, PROMPTS[1])]
    widest = max(map(len, running)) + STEPS
    long = prompt(backend, PROMPTS[2]) * 3
    joining = [long[: widest + 5] if wide else long[:2], prompt(backend, PROMPTS[0])[:1]]
    assert (len(joining[0]) > widest + 1) == wide
    packed_against_apart(backend.new_batch, backend.vocab_size, running, joining)


def test_a_prompt_for_several_rows_runs_once_and_its_rows_step_as_apart(backends) -> None:
    backend = backends("llama")
    running, joining = [prompt(backend, PROMPTS[0])], prompt(backend, PROMPTS[2])
    after = columns(backend.vocab_size, 3, STEPS, 4)
    with torch.inference_mode():
        apart, alone = backend.new_batch(), backend.new_batch()
        apart.prefill(running[0], 1)
        expected = [torch.cat([apart.step([7]), alone.prefill(joining, 2)[0]])]
        for column in after:
            expected.append(torch.cat([apart.step(column[:1]), alone.step(column[1:])]))
        packed = backend.new_batch()
        packed.prefill(running[0], 1)
        with forward_shapes(backend) as shapes:
            got = [packed.step_mixing([7], [joining], [2])]
        assert shapes == [(1, 1 + len(joining))]  # the prompt ran once
        got += [packed.step(column) for column in after]
    for step, want in zip(got, expected, strict=True):
        close(step, want)


SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "max_position_embeddings": 128,
}
ARCHITECTURES = {
    "llama-gqa": ("llama", {"num_key_value_heads": 2}),  # 2 key/value heads for 4 queries
    "qwen2": ("qwen2", {"num_key_value_heads": 1}),
    "qwen3": ("qwen3", {"num_key_value_heads": 2, "head_dim": 16}),
    "mistral": ("mistral", {"num_key_value_heads": 2, "sliding_window": None}),
    "gemma": ("gemma", {"num_key_value_heads": 1, "head_dim": 16}),
    "gpt_neox": ("gpt_neox", {}),
    "opt": ("opt", {"ffn_dim": 96, "word_embed_proj_dim": 64}),
    "phi": ("phi", {}),
    "olmo": ("olmo", {}),
    "starcoder2": ("starcoder2", {"num_key_value_heads": 2, "sliding_window": None}),
    "gptj": ("gptj", {"n_embd": 64, "n_head": 4, "n_layer": 2, "rotary_dim": 8}),
}


def random_model(model_type: str, extra: dict) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **SMALL, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_architectures_the_readme_names_pack(name: str) -> None:
    model = random_model(*ARCHITECTURES[name])
    layers = ReservedCausalLMBatch.cache_layers(model)
    assert layers and mixes_prompts(model, layers)

    def new_batch() -> ReservedCausalLMBatch:
        cache = ReservedCache(layers, 8, model.device)
        return ReservedCausalLMBatch(model, cache, mixes=True)

    packed_against_apart(new_batch, 128, [[5, 6, 7], [8]], [list(range(10, 19)), [3, 4]])
    parts_against_apart(new_batch, 128, [[5, 6, 7], [8]], list(range(20, 33)), 4)


def test_a_model_that_refuses_the_switch_keeps_its_attention_and_outputs() -> None:
    """Falcon's attention is not behind transformers' attention registry."""
    model = random_model("falcon", {})
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert not mixes_prompts(model, ReservedCausalLMBatch.cache_layers(model))
        close(model(input_ids=ids).logits, before)


def test_a_packed_step_that_fails_leaves_the_batch_as_it_was(backends) -> None:
    backend = backends("llama")
    running = [prompt(backend, PROMPTS[0]), prompt(backend, PROMPTS[1])]
    tokens = columns(backend.vocab_size, 2, 2, 3)
    with torch.inference_mode():
        kept, tried = backend.new_batch(), backend.new_batch()
        for batch in (kept, tried):
            batch.prefill_together(running, [1, 1])
        with pytest.raises(IndexError):
            tried.step_mixing(tokens[0], [[backend.vocab_size + 5] * 40])  # not a token
        assert tried.cache.rows == 2
        close(tried.step(tokens[1]), kept.step(tokens[1]))


class Switchable:
    """A stand-in model for the attention switch: its output depends on the attention set,
    which may refuse some."""

    def __init__(self, outputs: dict[str, float], refused: tuple[str, ...] = ()):
        self.outputs = outputs
        self.refused = refused
        self.attention = "own"
        self.switches: list[str] = []

    def set_attn_implementation(self, name: str) -> None:
        self.switches.append(name)
        if name in self.refused:
            raise ValueError(f"{name} is not supported")
        self.attention = name

    def plain(self) -> torch.Tensor:
        return torch.tensor([self.outputs[self.attention]])


def test_the_switch_is_kept_where_packed_forwards_agree() -> None:
    model = Switchable({"own": 1.0, RAGGED: 1.0})
    assert enable_mixed_steps(model, model.plain, lambda: True)  # type: ignore[arg-type]
    assert model.attention == RAGGED


def test_a_model_whose_forward_does_not_pack_keeps_the_switch_but_no_mixing() -> None:
    """Its plain forwards are unchanged by the switch (SDPA, as before): nothing to undo."""
    model = Switchable({"own": 1.0, RAGGED: 1.0})

    def mixed() -> bool:
        raise TypeError("forward() got an unexpected keyword argument 'mixed_step'")

    assert not enable_mixed_steps(model, model.plain, mixed)  # type: ignore[arg-type]
    assert model.attention == RAGGED


def test_a_model_the_switch_changes_goes_back_to_an_attention_that_gives_its_outputs() -> None:
    """Its own attention is not SDPA's (say a softcap SDPA refuses): the first fallback that
    gives its logits again is set, here eager after SDPA refused."""
    model = Switchable({"own": 1.0, RAGGED: 2.0, "eager": 1.0}, refused=("sdpa",))
    assert not enable_mixed_steps(model, model.plain, lambda: True)  # type: ignore[arg-type]
    assert model.switches == [RAGGED, *FALLBACKS]
    assert model.attention == "eager"


def test_a_model_with_no_attention_giving_its_outputs_fails_the_load() -> None:
    model = Switchable({"own": 1.0, RAGGED: 2.0, "sdpa": 2.0, "eager": 3.0})
    with pytest.raises(RuntimeError, match="could not be restored"):
        enable_mixed_steps(model, model.plain, lambda: True)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_pack(dtype: torch.dtype) -> None:
    """What a GPU serves (the probe compares within the dtype's rounding)."""
    model = random_model(*ARCHITECTURES["llama-gqa"]).to(dtype)
    assert mixes_prompts(model, ReservedCausalLMBatch.cache_layers(model))
