"""The reserved KV cache: every row's logits equal those of transformers' own cache (the model
run alone, as ``generate`` runs it), across buffer growth, requests joining wider and narrower
than the batch, rows leaving, splits and a forward that fails; steps and admissions write in
place instead of copying the running rows."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import DynamicCache

from huggingfaceserver.backends.pytorch import kv_cache
from huggingfaceserver.backends.pytorch.decode_batch import CausalLMBatch, ReservedCausalLMBatch
from huggingfaceserver.backends.pytorch.kv_cache import ReservedCache, full_attention_layers

from .generation_helpers import PROMPTS, prompt

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
PADDED = {"atol": 1e-4, "rtol": 1e-4}
"""float32 sums over a padded batch in another order: the tolerance the decode loop's tests give
logprobs."""


@pytest.fixture(autouse=True)
def small_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers grow by 3 columns at least, so that a few steps cross their capacity."""
    monkeypatch.setattr(kv_cache, "MIN_GROWTH", 3)


def tokens(count: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


class Alone:
    """One request's rows on transformers' own cache: the reference."""

    def __init__(self, backend, prompt_ids: list[int], rows: int = 1):
        self.batch = CausalLMBatch(backend.model)
        self.first, _ = self.batch.prefill(prompt_ids, rows)

    def step(self, column: list[int]) -> torch.Tensor:
        return self.batch.step(column)


def reserved(backend, max_rows: int = 16, max_tokens: int | None = None) -> ReservedCausalLMBatch:
    cache = ReservedCache(backend.cache_layers, max_rows, backend.model.device, max_tokens)
    return ReservedCausalLMBatch(backend.model, cache)


def cells(batch: ReservedCausalLMBatch) -> int:
    """The token cells its buffers hold (rows times columns), as allocated."""
    layer = batch.cache.reserved_layers[0]
    assert layer.key_buffer.shape[0] == batch.cache.row_capacity
    assert layer.key_buffer.shape[2] == batch.cache.column_capacity
    return batch.cache.row_capacity * batch.cache.column_capacity


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_steps_equal_transformers_cache_across_growth(backends, name: str) -> None:
    backend = backends(name)
    ids = prompt(backend, PROMPTS[1])
    feed = tokens(40, backend.vocab_size, 0)
    with torch.inference_mode():
        alone, batch = Alone(backend, ids, rows=2), reserved(backend)
        first, _ = batch.prefill(ids, 2)
        torch.testing.assert_close(first, alone.first, **TOLERANCE)
        grown = 0
        buffer = batch.cache.reserved_layers[0].key_buffer
        for token in feed:
            want = alone.step([token, token])
            torch.testing.assert_close(batch.step([token, token]), want, **TOLERANCE)
            now = batch.cache.reserved_layers[0].key_buffer
            grown += now is not buffer
            buffer = now
    assert batch.cache.get_seq_length() == len(ids) + len(feed)
    assert 1 <= grown <= 6  # by half again each time: a few growths, not one per step


def test_a_step_writes_in_place(backends) -> None:
    backend = backends("llama")
    with torch.inference_mode():
        batch = reserved(backend)
        batch.prefill(prompt(backend), 1)
        layer = batch.cache.reserved_layers[0]
        room = batch.cache.column_capacity - batch.cache.end
        assert room >= 3
        pointer = layer.key_buffer.data_ptr()
        for token in tokens(room, backend.vocab_size, 1):
            batch.step([token])
            assert layer.key_buffer.data_ptr() == pointer


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("joining_first", [False, True], ids=["narrower", "wider"])
def test_requests_that_join_step_as_they_would_alone(backends, name, joining_first) -> None:
    """A request joins a batch that ran a while: its prompt fits in the columns in use
    (narrower) or needs more (wider, the running rows move); then the first request leaves."""
    backend = backends(name)
    short, long = prompt(backend, PROMPTS[0]), prompt(backend, PROMPTS[2])
    running_ids, joining_ids = (short, long * 3) if joining_first else (long, short)
    warm, feed = tokens(3, backend.vocab_size, 2), tokens(8, backend.vocab_size, 3)
    with torch.inference_mode():
        running_alone, batch = Alone(backend, running_ids), reserved(backend)
        batch.prefill(running_ids, 1)
        for token in warm:
            running_alone.step([token])
            batch.step([token])
        joining_alone, joining = Alone(backend, joining_ids, rows=2), reserved(backend)
        joining.prefill(joining_ids, 2)
        assert batch.absorb(joining)
        assert batch.cache.rows == 3
        for step, token in enumerate(feed):
            got = batch.step([token, feed[-1 - step], feed[-1 - step]])
            torch.testing.assert_close(got[:1], running_alone.step([token]), **PADDED)
            want = joining_alone.step([feed[-1 - step]] * 2)
            torch.testing.assert_close(got[1:], want, **PADDED)
        batch.keep([1, 2])  # the first request finished: its padding-only columns go
        assert bool(batch.cache.mask.all())
        assert batch.cache.get_seq_length() == len(joining_ids) + len(feed)
        for token in feed:
            torch.testing.assert_close(
                batch.step([token, token]), joining_alone.step([token, token]), **PADDED
            )


def test_a_bounded_cache_grows_within_its_budget_and_steps_as_alone(backends) -> None:
    """Rows that fit in the KV cache budget (:mod:`.kv_budget`) grow buffers no larger than it,
    where unbounded ones double their rows and add half again to their columns; a wide row that
    ended leaves its columns behind only until the rows grow: then the buffers are cut back to
    the budget. The rows step as they would alone."""
    backend = backends("llama")
    vocab = backend.vocab_size
    long, short = tokens(60, vocab, 20), prompt(backend, PROMPTS[0])
    budget = 5 * (len(long) + 4)  # five rows as long as the long prompt, and 4 steps
    with torch.inference_mode():
        bounded, unbounded = reserved(backend, max_tokens=budget), reserved(backend)
        long_alone = Alone(backend, long)
        for batch in (bounded, unbounded):
            batch.prefill(long, 1)
            for _ in range(4):  # one row at a time: the row capacity doubles each join
                joining = reserved(backend, max_tokens=budget)
                joining.prefill(short, 1)
                assert batch.absorb(joining)
        assert bounded.cache.rows == unbounded.cache.rows == 5
        assert cells(unbounded) > budget  # 8 rows, 60 columns and half again
        assert cells(bounded) <= budget
        short_alone = Alone(backend, short, rows=4)
        for token in tokens(4, vocab, 21):
            got = bounded.step([token] * 5)
            torch.testing.assert_close(got[:1], long_alone.step([token]), **PADDED)
            torch.testing.assert_close(got[1:], short_alone.step([token] * 4), **PADDED)
        assert cells(bounded) <= budget
        bounded.keep([1, 2, 3, 4])  # the long row ended: the buffers stay as wide
        wide = bounded.cache.column_capacity
        more = reserved(backend, max_tokens=budget)
        more.prefill(short, 4)
        assert bounded.absorb(more)  # 8 rows: cut back to the columns the budget leaves them
        assert bounded.cache.rows == 8 and bounded.cache.column_capacity < wide
        assert cells(bounded) <= budget
        more_alone = Alone(backend, short, rows=4)
        for token in tokens(3, vocab, 22):
            got = bounded.step([token] * 8)
            torch.testing.assert_close(got[:4], short_alone.step([token] * 4), **PADDED)
            torch.testing.assert_close(got[4:], more_alone.step([token] * 4), **PADDED)


class OnItsWay:
    """A trim's first held column still on its way to the host, until :meth:`arrive`."""

    def __init__(self, value: int):
        self.value, self.arrived = value, False

    def arrive(self) -> None:
        self.arrived = True

    def done(self) -> bool:
        return self.arrived

    def values(self) -> list[int]:
        assert self.arrived, "read before it was in: the host would have waited"
        return [self.value]


def pending_trim(batch: ReservedCausalLMBatch, keep: list[int]) -> tuple[OnItsWay, int]:
    """``batch`` keeps the rows ``keep`` with their trim on its way, as a GPU leaves it: the
    copy, and the columns it will take out."""
    cache = batch.cache
    before = cache.start
    batch.keep(keep)  # on this CPU the trim is taken at once: undone here, to be redone
    padding, cache.start = cache.start - before, before
    copy = OnItsWay(padding)
    cache.trimming = kv_cache.PendingTrim(copy, before, cache.moves)  # type: ignore[arg-type]
    return copy, padding


def test_a_trim_is_taken_once_its_column_is_in_and_dropped_after_a_join(backends) -> None:
    """On a GPU a finish does not wait for the device to learn which leading columns became
    padding: the columns in use shrink at the first forward after the copy is in, and never
    where rows joined in between (their tokens may start left of that column). Every step's
    logits equal transformers' own cache all along."""
    backend = backends("llama")
    short, wide = prompt(backend, PROMPTS[0]), prompt(backend, PROMPTS[2]) * 2
    feed = tokens(6, backend.vocab_size, 8)
    with torch.inference_mode():
        alone, batch = Alone(backend, short), reserved(backend)
        batch.prefill(short, 1)
        leaving = reserved(backend)
        leaving.prefill(wide, 1)
        assert batch.absorb(leaving)
        batch.step([feed[0], feed[0]])
        alone.step([feed[0]])
        copy, padding = pending_trim(batch, [0])
        assert padding > 0
        start = batch.cache.start
        torch.testing.assert_close(batch.step([feed[1]]), alone.step([feed[1]]), **PADDED)
        assert batch.cache.start == start and batch.cache.trimming is not None  # not waited
        copy.arrive()
        torch.testing.assert_close(batch.step([feed[2]]), alone.step([feed[2]]), **PADDED)
        assert batch.cache.start == start + padding and batch.cache.trimming is None

        again = reserved(backend)
        again.prefill(wide, 1)
        assert batch.absorb(again)
        batch.step([feed[3], feed[3]])
        alone.step([feed[3]])
        copy, padding = pending_trim(batch, [0])  # the wide row leaves again
        assert padding > 0
        held = batch.cache.end - batch.cache.start - padding  # the short row's columns
        middle = wide[: held + 2]  # joins without widening; starts left of the short row
        joining = reserved(backend)
        joining.prefill(middle, 1)
        assert batch.absorb(joining)  # a row joined: the trim on its way no longer applies
        middle_alone = Alone(backend, middle)
        copy.arrive()
        start = batch.cache.start
        got = batch.step([feed[4], feed[4]])
        assert batch.cache.start == start and batch.cache.trimming is None
        torch.testing.assert_close(got[:1], alone.step([feed[4]]), **PADDED)
        torch.testing.assert_close(got[1:], middle_alone.step([feed[4]]), **PADDED)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_finish_on_a_gpu_does_not_wait_for_the_device(tiny_models) -> None:
    """Rows kept while the device is busy: the trim is left on its way (the host did not
    wait), and taken at a forward once it is in."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).to("cuda").eval()
    layers = ReservedCausalLMBatch.cache_layers(model)
    assert layers
    with torch.inference_mode():
        batch = ReservedCausalLMBatch(model, ReservedCache(layers, 4, model.device))
        batch.prefill([5, 6, 7], 1)
        leaving = ReservedCausalLMBatch(model, ReservedCache(layers, 4, model.device))
        leaving.prefill(list(range(10, 40)), 1)
        assert batch.absorb(leaving)
        batch.step([8, 9])
        start = batch.cache.start
        busy = torch.ones(2048, 2048, device="cuda")
        for _ in range(200):  # tens of milliseconds of work queued ahead of the copy
            busy = busy @ busy / 2048
        batch.keep([0])
        assert batch.cache.start == start and batch.cache.trimming is not None
        torch.cuda.synchronize()
        batch.step([10])
        assert batch.cache.start > start and batch.cache.trimming is None


def test_a_request_that_joins_does_not_copy_the_running_rows(backends) -> None:
    backend = backends("llama")
    with torch.inference_mode():
        batch = reserved(backend)
        batch.prefill(prompt(backend, PROMPTS[2]), 1)
        batch.step([5])
        for text in PROMPTS[:2]:  # the row capacity grows, by doubling: to 2, then 4
            earlier = reserved(backend)
            earlier.prefill(prompt(backend, text), 1)
            batch.absorb(earlier)
        assert batch.cache.row_capacity == 4
        layer = batch.cache.reserved_layers[0]
        pointer = layer.key_buffer.data_ptr()
        running = layer.key_buffer[:3].clone()
        joining = reserved(backend)
        joining.prefill(prompt(backend, PROMPTS[1]), 1)
        assert batch.absorb(joining)
    assert layer.key_buffer.data_ptr() == pointer
    assert torch.equal(layer.key_buffer[:3], running)


def a_row_with_room(backend, steps: int) -> tuple[Alone, ReservedCausalLMBatch]:
    """A one-row batch (and its reference) whose buffers have rows and columns to spare: two
    rows of a wide prompt joined it, stepped ``steps`` times with it, and left, their columns
    with them (room to the left of the row's)."""
    short, wide = prompt(backend, PROMPTS[0]), prompt(backend, PROMPTS[2]) * 2
    running, batch = Alone(backend, short), reserved(backend)
    batch.prefill(short, 1)
    leaving = reserved(backend)
    leaving.prefill(wide, 2)
    assert batch.absorb(leaving)
    for token in tokens(steps, backend.vocab_size, 6):
        torch.testing.assert_close(batch.step([token] * 3)[:1], running.step([token]), **PADDED)
    batch.keep([0])
    assert batch.cache.start > 0 and batch.cache.row_capacity >= 3
    return running, batch


def test_rows_that_move_within_the_buffers_keep_them(backends) -> None:
    """Where the buffers have room, the columns in use move within them, to the front when the
    last column is reached and to the right when a wider prompt joins: the buffers (and the
    cache's :attr:`~ReservedCache.layout`, which recorded steps are kept by) stay, and every
    row steps as it would alone."""
    backend = backends("llama")
    vocab = backend.vocab_size
    with torch.inference_mode():
        running, batch = a_row_with_room(backend, steps=2)
        cache = batch.cache
        layer = cache.reserved_layers[0]
        pointer, layout = layer.key_buffer.data_ptr(), cache.layout
        feed = tokens(cache.column_capacity - cache.end + 2, vocab, 7)
        for token in feed:  # past the last column: to the front
            torch.testing.assert_close(batch.step([token]), running.step([token]), **PADDED)
        assert cache.start == 0 and cache.rows == 1
        assert (layer.key_buffer.data_ptr(), cache.layout) == (pointer, layout)

        held = cache.end - cache.start
        joining_ids = tokens(held + 3, vocab, 8)  # wider than the columns in use
        assert len(joining_ids) <= cache.column_capacity and cache.row_capacity >= 3
        joining_alone, joining = Alone(backend, joining_ids, rows=2), reserved(backend)
        joining.prefill(joining_ids, 2)
        assert batch.absorb(joining)
        assert cache.start == 0 and cache.end - cache.start == len(joining_ids)  # moved right
        assert (layer.key_buffer.data_ptr(), cache.layout) == (pointer, layout)
        for token in tokens(4, vocab, 9):
            got = batch.step([token] * 3)
            torch.testing.assert_close(got[:1], running.step([token]), **PADDED)
            torch.testing.assert_close(got[1:], joining_alone.step([token] * 2), **PADDED)


def test_rows_moved_right_in_place_get_cleared_padding(backends) -> None:
    """A prompt wider than the columns up to the last one moves the running rows right within
    the buffers: the columns they then hold as padding are zeroed, whatever was left there (a
    row that held NaN before: ``0 * NaN`` reaches the attention's output)."""
    backend = backends("llama")
    vocab = backend.vocab_size
    with torch.inference_mode():
        running, batch = a_row_with_room(backend, steps=1)
        cache = batch.cache
        layer = cache.reserved_layers[0]
        pointer, layout = layer.key_buffer.data_ptr(), cache.layout
        for each in cache.reserved_layers:
            for buffer in each.buffers():
                buffer[0, :, : cache.start].fill_(float("nan"))
        joining_ids = tokens(cache.end + 2, vocab, 12)  # no room to its left
        assert len(joining_ids) <= cache.column_capacity
        joining_alone, joining = Alone(backend, joining_ids), reserved(backend)
        joining.prefill(joining_ids, 1)
        assert batch.absorb(joining)
        assert (layer.key_buffer.data_ptr(), cache.layout) == (pointer, layout)  # in place
        for token in tokens(3, vocab, 13):
            got = batch.step([token] * 2)
            torch.testing.assert_close(got[:1], running.step([token]), **PADDED)
            torch.testing.assert_close(got[1:], joining_alone.step([token]), **PADDED)


def test_a_cache_takes_another_batchs_rows_into_its_own_buffers(backends) -> None:
    """A batch's rows moved into a cache that held others (the one kept across an idle spell):
    its buffers and layout stay where the rows fit, and the rows step as they would alone."""
    backend = backends("llama")
    vocab = backend.vocab_size
    ids = prompt(backend, PROMPTS[1])
    with torch.inference_mode():
        earlier = reserved(backend)
        earlier.prefill(prompt(backend, PROMPTS[2]) * 2, 3)
        earlier.step([1, 2, 3])
        kept = earlier.cache
        pointer, layout = kept.reserved_layers[0].key_buffer.data_ptr(), kept.layout
        alone, batch = Alone(backend, ids, rows=2), reserved(backend)
        batch.prefill(ids, 2)
        batch.move_to(kept)
        assert batch.cache is kept and (kept.rows, kept.start, kept.end) == (2, 0, len(ids))
        assert (kept.reserved_layers[0].key_buffer.data_ptr(), kept.layout) == (pointer, layout)
        for token in tokens(6, vocab, 10):
            torch.testing.assert_close(batch.step([token] * 2), alone.step([token] * 2), **PADDED)
        wider = reserved(backend)  # more rows than the kept buffers hold: larger ones
        wider.prefill(ids, 4)
        wider.move_to(kept)
        assert kept.rows == 4 and kept.layout > layout


def test_rows_left_by_a_failed_request_leave_nothing_behind(backends) -> None:
    """A row that left may have held NaN (a model broken by its input): the row that takes
    its place computes from finite padding."""
    backend = backends("llama")
    ids = prompt(backend, PROMPTS[2])
    with torch.inference_mode():
        batch = reserved(backend)
        batch.prefill(ids, 2)
        batch.step([3, 3])
        for layer in batch.cache.reserved_layers:
            for buffer in layer.buffers():
                buffer[1].fill_(float("nan"))
        batch.keep([0])
        short = prompt(backend, PROMPTS[0])
        joining_alone, joining = Alone(backend, short), reserved(backend)
        joining.prefill(short, 1)
        assert batch.absorb(joining)
        got = batch.step([4, 4])
    torch.testing.assert_close(got[1:], joining_alone.step([4]), **PADDED)


def test_a_failed_forward_leaves_the_batch_as_it_was(backends) -> None:
    backend = backends("llama")
    ids = prompt(backend, PROMPTS[1])
    feed = tokens(4, backend.vocab_size, 4)

    def fail(*_args, **_kwargs) -> None:
        raise RuntimeError("out of memory")

    with torch.inference_mode():
        alone, batch = Alone(backend, ids), reserved(backend)
        batch.prefill(ids, 1)
        layer = backend.model.model.layers[-1]  # the cache of the other layers is written
        hook = layer.register_forward_pre_hook(fail)
        try:
            with pytest.raises(RuntimeError):
                batch.step([feed[0]])
        finally:
            hook.remove()
        for token in feed:
            torch.testing.assert_close(batch.step([token]), alone.step([token]), **TOLERANCE)


def test_split_rows_step_as_they_would_alone(backends) -> None:
    backend = backends("llama")
    prompts = [prompt(backend, text) for text in PROMPTS]
    feed = tokens(5, backend.vocab_size, 5)
    with torch.inference_mode():
        alone = [Alone(backend, ids) for ids in prompts]
        batch = reserved(backend)
        batch.prefill_together(prompts, [1, 1, 1])
        batch.step(feed[:3])
        for i, row in enumerate(alone):
            row.step([feed[i]])
        taken = batch.split([0, 2])
        assert (batch.cache.rows, taken.cache.rows) == (1, 2)
        for token in feed:
            torch.testing.assert_close(
                taken.step([token, token]),
                torch.cat([alone[0].step([token]), alone[2].step([token])]),
                **PADDED,
            )
            torch.testing.assert_close(batch.step([token]), alone[1].step([token]), **PADDED)


def test_only_plain_full_attention_models_use_the_reserved_cache(backends) -> None:
    backend = backends("llama")
    layers = backend.model.config.num_hidden_layers
    assert full_attention_layers(backend.model.config) == backend.cache_layers == layers
    assert isinstance(backend.new_batch(), ReservedCausalLMBatch)
    sliding = backend.model.config.__class__(
        **{
            **backend.model.config.to_dict(),
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 4,
        }
    )
    assert not all(
        type(layer).__name__ == "DynamicLayer" for layer in DynamicCache(config=sliding).layers
    )
    assert full_attention_layers(sliding) == 0


def test_the_cache_refuses_what_it_did_not_reserve() -> None:
    cache = ReservedCache(1, 4, torch.device("cpu"))
    cache.reserve(2, rows=1)
    [layer] = cache.reserved_layers
    with pytest.raises(ValueError, match="do not fit"):
        layer.update(torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 2, 4))


def test_a_batch_let_go_frees_its_buffers_at_once(backends) -> None:
    """No reference cycle keeps a dropped batch's cache (and its buffers) alive until the cyclic
    garbage collector runs: the decode loop drops a batch for every request that joins another
    (measured: the generation server's memory rose and fell by hundreds of MiB under a steady
    load while such caches waited for a full collection)."""
    backend = backends("llama")
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode():
            batch, joining = reserved(backend), reserved(backend)
            batch.prefill(prompt(backend, PROMPTS[0]), 2)
            joining.prefill(prompt(backend, PROMPTS[1]), 1)
            assert batch.absorb(joining)
            batch.step([1, 2, 3])
            taken = batch.split([1])
            caches = [weakref.ref(b.cache) for b in (batch, joining, taken)]
            buffers = [weakref.ref(b.cache.reserved_layers[0].key_buffer) for b in (batch, taken)]
            del batch, joining, taken
        assert [ref() for ref in caches + buffers] == [None] * 5
    finally:
        if collecting:
            gc.enable()
