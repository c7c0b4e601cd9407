"""A decode step's grammar masks: every constrained row's allowed tokens in one llguidance call,
applied to the logits in place (where the model runs; :mod:`...generation.constraints` has
the grammars and matchers, which the processes that only check requests use too)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np
import torch

from ...devices import to_device
from ...errors import BadRequest
from ...generation.constraints import GrammarMatcher


@functools.cache
def mask_executor() -> llguidance.LLExecutor:
    """The threads that compute the masks of a step's constrained rows (one pool a process)."""
    return llguidance.LLExecutor()


def mask_disallowed(
    logits: torch.Tensor, matchers: Sequence[tuple[int, GrammarMatcher]]
) -> dict[int, BadRequest]:
    """Set the logits of the tokens each row's grammar does not allow next to -inf, in place:
    ``matchers`` are ``(row of logits, its matcher)``. One llguidance call fills the masks of
    all the rows. Returns the rows that cannot go on: a matcher in error, or one that allows
    no token (their logits are then left to whoever fails them)."""
    failures = {row: failed for row, m in matchers if (failed := m.failure()) is not None}
    by_vocab: dict[int, list[tuple[int, GrammarMatcher]]] = {}
    for row, matcher in matchers:
        if row not in failures:
            by_vocab.setdefault(matcher.vocab_size, []).append((row, matcher))
    for vocab_size, group in by_vocab.items():
        bitmask = llguidance.numpy.allocate_token_bitmask(len(group), vocab_size)
        llguidance.numpy.fill_next_token_bitmask_par(
            mask_executor(), [(m.matcher, k) for k, (_, m) in enumerate(group)], bitmask
        )
        allows_nothing = (bitmask == 0).all(axis=1).tolist()
        for k, (row, matcher) in enumerate(group):
            failed = matcher.failure()  # computing a mask can hit the grammar's limits
            if failed is None and allows_nothing[k]:
                failed = BadRequest("structured output failed: the grammar allows no next token")
            if failed is not None:
                failures[row] = failed
        allowed = unpack_bitmask(bitmask, logits.shape[-1], logits.device)
        rows = [row for row, _ in group]
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            index = to_device(rows, logits.device, torch.long)
            logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return failures


def unpack_bitmask(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """llguidance's token bitmask ``[rows, words]`` (int32; bit ``j`` of word ``w``: token
    ``32 * w + j``) as a bool mask ``[rows, vocab]`` on ``device``; tokens past the mask's
    width are not allowed.

    On CPU numpy's ``unpackbits`` (int32 words are little-endian on every platform torch runs
    on), under a millisecond for 32 rows of 150k tokens; on an accelerator the words travel and
    are unpacked there. llguidance's numpy helpers, not its torch ones: ``llguidance.torch``
    goes through ``torch.compile`` (its import adds 2.6 s to every process, and its mask
    kernel compiles on the decode thread at the first constrained step, 19 s on a 2-core CPU
    and 2.6 s with a warm cache, and again at new shapes).
    """
    if device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little"))
    else:
        words = to_device(bitmask, device, torch.int32)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        bits = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)
    allowed = bits[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed
