"""The KV cache the decode loop's rows may hold, sized once at load, and how the loop keeps to it.

The rows decoded together share their KV cache's column axis (:mod:`.kv_cache`): ``rows`` rows
hold ``rows x columns`` tokens' keys and values, the columns those of the longest row. Without a
bound, one request with a long prompt among fifteen short ones makes the cache sixteen rows that
long, and rows that generate long answers grow it step by step; on a CPU the kernel's OOM killer
then ends the server for every client (there is no exception to catch), on a GPU a step fails
its requests. So the memory the cache may take is a budget, in tokens (:class:`KvBudget`), kept
as vLLM keeps its paged cache's:

- a waiting request is admitted while the rows, its own with them, fit in :data:`ADMIT_SHARE`
  of the budget at the columns they would share (first come, first served: the requests behind
  one that waits for room wait too);
- when the rows, grown by their next step, would exceed the budget, the requests admitted last
  leave the batch (preempted, as vLLM's scheduler preempts by recomputation): each goes back to
  the head of the queue and, once there is room again, its prompt and the tokens it generated so
  far are fed again, and it goes on where it stopped, its stream unbroken (the same seeded
  generator, penalties and grammar state);
- a request with ``n`` > 1 cannot leave (each choice would need its own tokens fed again): it
  is admitted only with room for all its rows may reach (its prompt and ``max_tokens``), and
  one whose rows could never fit together is refused with a 400
  (:func:`~huggingfaceserver.generation.checks.check_generation_request`);
- the reserved cache's growth ahead is cut to the budget
  (:attr:`.kv_cache.ReservedCache.max_tokens`);
- where one sequence at the model's full context does not fit, the context served is lowered to
  what fits, and said at start (a ``--max_model_len`` that does not fit is a startup error).

The budget is ``--kv-cache-memory-bytes`` (vLLM's engine flag, which the transformers backend
honours with the same meaning), else :data:`KV_MEMORY_SHARE` of the memory free once the
weights are loaded: the GPU's on a GPU, on a CPU what the host has available within the
cgroup's limit (:func:`~huggingfaceserver.pod.available_memory`). The rest is left to the
prompts being fed (their own caches until they join the rows), the activations, the recorded
steps and the other processes. A seq2seq model's cache is not bounded (its decoder's tokens
cannot be fed again as a prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...pod import Memory, human

KV_MEMORY_SHARE = 0.4
"""Of the memory free after the weights (without ``--kv-cache-memory-bytes``): the KV cache of
the rows decoded together."""
FLAG = "kv-cache-memory-bytes"
ADMIT_SHARE = 0.9
"""A waiting request is admitted while the rows, its own with them, fit in this share of the
budget; the rows leave it only once they exceed the whole of it."""
MIN_CONTEXT = 64
"""A budget that holds fewer tokens than this for one sequence is a startup error."""


@dataclass(frozen=True)
class KvBudget:
    """How many tokens' keys and values the rows decoded together may hold, and why."""

    tokens: int | None
    """Token cells: rows times the columns of the cache they share; None: no bound (the
    model's config does not say its attention's shape)."""
    reason: str

    def holds(self, cells: int) -> bool:
        """Whether caches of ``cells`` token cells (each batch's rows times its columns) fit."""
        return self.tokens is None or cells <= self.tokens

    def admits(self, cells: int) -> bool:
        """Whether caches of ``cells`` token cells leave room to grow: they fit in
        :data:`ADMIT_SHARE` of it (a request admitted into a full cache would be the first to
        leave it again)."""
        return self.tokens is None or cells <= self.tokens * ADMIT_SHARE


UNBOUNDED = KvBudget(None, "not bounded")


def plan_kv_budget(bytes_per_token: int | None, configured: int | None, free: Memory) -> KvBudget:
    """The budget for a model whose KV cache takes ``bytes_per_token`` (None: unknown):
    ``configured`` bytes (``--kv-cache-memory-bytes``), else :data:`KV_MEMORY_SHARE` of what
    is ``free`` after the weights."""
    if not bytes_per_token:
        return KvBudget(None, "not bounded: the model's config does not say its attention")
    if configured is not None:
        size, source = configured, f"--{FLAG}"
    else:
        size = int(free.available * KV_MEMORY_SHARE)
        source = (
            f"{KV_MEMORY_SHARE:.0%} of {human(free.available)} available on {free.where} "
            "after the weights"
        )
    tokens = size // bytes_per_token
    return KvBudget(
        tokens,
        f"KV cache up to {human(size)}, {tokens} tokens over the rows decoded together "
        f"({bytes_per_token / 1024:.1f} KiB per token; {source})",
    )
