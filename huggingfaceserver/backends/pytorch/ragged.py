"""New prompts fed in the running rows' decode step: one forward for both (vLLM's mixed batch).

A forward of this model costs nearly as much for one token as for a few dozen: its weights are
read from memory once a forward whatever the tokens (on CPU, and on a GPU the kernel launches
too). A request admitted while others decode used to have its prompt run in a forward of its
own, then join the batch: a forward more per admission, during which no row stepped. Here the
decode rows' tokens and the new prompts' are packed into one sequence, ``[1, tokens]``, each
with its own position, and the step's forward runs it once:

- the reserved cache (:meth:`~.kv_cache.ReservedCache.mixing`) writes each token's keys and
  values into its row: the decode rows' at the step's column, each prompt's into a row opened
  for it (:meth:`~.kv_cache.ReservedCache.open_rows`), ending at that column; the next part of
  a long prompt fed in parts (chunked prefill) goes to that prompt's own one-row cache, after
  the parts fed before it;
- the attention, registered with transformers' public :class:`~transformers.AttentionInterface`
  under :data:`RAGGED`, attends each part over its own row's columns: the decode rows as the
  decode step would (its ready mask, batched), each prompt causally over its own tokens, a
  prompt's part causally over its prompt's tokens so far (its layer's keys and values found by
  the attention module's ``layer_idx``, the index it updates the cache with); every part
  through transformers' SDPA attention, so the results are the separate forwards' own;
- every other forward (prefills, plain decode steps, recorded graphs) goes straight to SDPA.

Whether a model runs this way is decided at load (:func:`enable_mixed_steps`): its attention is
switched to :data:`RAGGED` with the public ``set_attn_implementation``, and a probe compares a
packed forward with the separate ones (a model whose own code does not pass the forward's
keyword arguments down to its attention, or whose attention SDPA cannot run, fails it and is
served as before).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kv_cache import MixedColumns

logger = logging.getLogger(__name__)

RAGGED = "hfs_ragged"
"""The attention implementation name this module registers with transformers."""
MIXED = "mixed_step"
"""The forward's keyword argument that carries a packed forward's :class:`MixedAttention`."""
FALLBACKS = ("sdpa", "eager")
"""Implementations to go back to when the switch changes a model's outputs."""
TOLERANCE = 1e-3
"""Absolute and relative tolerance of the load-time probes in float32; in half precision four
of its steps (:func:`agree`): packed and separate forwards multiply matrices of other shapes."""


@dataclass(frozen=True)
class MixedAttention:
    """How a packed forward's queries attend, laid out as its keys and values were written
    (``columns``): the first ``columns.decoding`` are the decode rows' (one each, over the
    columns from ``start`` to the step's with ``mask``), then each prompt's, in its own row
    over its own tokens, which end at the step's column."""

    columns: MixedColumns
    start: int
    mask: torch.Tensor
    """``[decoding, 1, 1, columns]``: the decode step's ready mask."""
    part_masks: tuple[torch.Tensor | None, ...] = ()
    """For each of ``columns.parts``: ``[1, 1, tokens, tokens held]``, True where a token of
    the part attends (causal after every token held before it); None for a prompt's first
    part (causal over its own tokens)."""


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, or for a packed forward (``mixed_step`` given) each of
    its parts over its own rows' keys and values (``key``/``value``: the cache's whole
    buffers then)."""
    mixed: MixedAttention | None = kwargs.pop(MIXED, None)
    if mixed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows, stop = mixed.columns.decoding, mixed.columns.column + 1
    columns = slice(mixed.start, stop)
    parts = []
    if rows:
        decoding = query[0, :, :rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        out, _ = sdpa_attention_forward(
            module,
            decoding,
            key[:rows, :, columns],
            value[:rows, :, columns],
            mixed.mask,
            **kwargs,
        )
        parts.append(out.reshape(1, rows, *out.shape[2:]))
    offset = rows
    for row, length in enumerate(mixed.columns.lengths, start=rows):
        prompt = slice(stop - length, stop)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, offset : offset + length],
            key[row : row + 1, :, prompt],
            value[row : row + 1, :, prompt],
            None,  # causal over its own tokens
            **kwargs,
        )
        parts.append(out)
        offset += length
    layer = layer_index(module) if mixed.columns.parts else 0
    for part, mask in zip(mixed.columns.parts, mixed.part_masks, strict=True):
        keys, values = part.held(layer)
        out, _ = sdpa_attention_forward(
            module, query[:, :, offset : offset + part.tokens], keys, values, mask, **kwargs
        )
        parts.append(out)
        offset += part.tokens
    return torch.cat(parts, dim=1), None


def layer_index(module: torch.nn.Module) -> int:
    """The attention module's layer: the index it updates the KV cache with."""
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int):
        raise TypeError(f"{type(module).__name__} has no layer index to find its keys by")
    return index


def register() -> None:
    """Make :data:`RAGGED` known to transformers (its masks are SDPA's). Idempotent."""
    AttentionInterface.register(RAGGED, ragged_attention)
    AttentionMaskInterface.register(RAGGED, sdpa_mask)


Probe = Callable[[], torch.Tensor]
"""A forward of the load-time probe: its logits."""


def enable_mixed_steps(model: PreTrainedModel, plain: Probe, mixed: Callable[[], bool]) -> bool:
    """Switch the model's attention to :data:`RAGGED` and keep it where packed forwards give
    the separate forwards' logits (``mixed()``, after the switch). ``plain()`` runs an ordinary
    forward: where the switch changed its logits (attention SDPA cannot run the way the model
    did) the model goes back to the first of :data:`FALLBACKS` that gives them again. Returns
    whether decode steps may take new prompts."""
    register()
    with torch.inference_mode():
        before = plain()
    try:
        model.set_attn_implementation(RAGGED)
        with torch.inference_mode():
            same = agree(plain(), before)
    except Exception as exc:  # noqa: BLE001 - a model that refuses it keeps its attention
        logger.info("prompts are not fed in decode steps: %s", exc)
        same = False
    if not same:
        _restore(model, plain, before)
        return False
    try:
        with torch.inference_mode():
            agrees = mixed()
    except Exception as exc:  # noqa: BLE001 - its forward does not carry the packing
        logger.info("prompts are not fed in decode steps: %r", exc)
        agrees = False
    if not agrees:
        logger.info(
            "prompts are not fed in decode steps: %s's packed forward differs from the "
            "separate ones",
            type(model).__name__,
        )
    return agrees


def agree(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether two forwards' logits are the same within their dtype's rounding."""
    tolerance = max(TOLERANCE, 4 * torch.finfo(got.dtype).eps)
    return bool(torch.allclose(got.float(), expected.float(), atol=tolerance, rtol=tolerance))


def _restore(model: PreTrainedModel, plain: Probe, before: torch.Tensor) -> None:
    """Back to an attention that gives the model's own logits."""
    for implementation in FALLBACKS:
        try:
            model.set_attn_implementation(implementation)
            with torch.inference_mode():
                if agree(plain(), before):
                    logger.info(
                        "prompts are not fed in decode steps (attention: %s)", implementation
                    )
                    return
        except Exception:  # noqa: BLE001, S112 - try the next one
            continue
    raise RuntimeError(f"{type(model).__name__}'s attention could not be restored")
