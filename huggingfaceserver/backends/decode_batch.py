"""The model side of rows decoded together: their KV cache, one new token per row a step.

A batch starts as one request's rows (its prompt run once, the cache repeated per row), or, for
a decoder-only model whose forward takes ``position_ids``, as the rows of several requests
admitted together: their prompts left-padded into one forward, as ``generate`` runs a batch. A
decoder-only model whose cache is a plain :class:`~transformers.DynamicCache` can then *absorb*
other batches: both caches are left-padded to the same length and concatenated, an attention
mask hides the padding and each row keeps its own positions, so rows of requests that started at
different times step together (continuous batching). Other models (sequence-to-sequence,
sliding-window or recurrent caches) keep one batch per request.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import BaseModelOutput


class DecodeBatch(ABC):
    """Rows decoded together, in the order of the logits rows they produce."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.device = model.device

    def _ids(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @abstractmethod
    def prefill(
        self, prompt_ids: list[int], rows: int, score_prompt: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompt once for ``rows`` rows: the first next-token logits ``[rows, V]``,
        and with ``score_prompt`` a decoder-only model's logits at every prompt position but
        the last ``[prompt - 1, V]`` (position ``i`` predicts prompt token ``i + 1``), else
        None (a seq2seq model's decoder never predicts the prompt)."""

    @property
    def prefills_together(self) -> bool:
        """Whether :meth:`prefill_together` runs several prompts in one forward."""
        return False

    def prefill_together(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        """Run the prompts as one batch, prompt ``i`` for ``rows[i]`` rows (rows in the order of
        the prompts): the first next-token logits ``[sum(rows), V]``. Only where
        :attr:`prefills_together`."""
        raise NotImplementedError(f"{type(self).__name__} runs one prompt at a time")

    @abstractmethod
    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed each row its latest token; the next-token logits ``[rows, V]``."""

    @abstractmethod
    def keep(self, rows: list[int]) -> None:
        """Drop every row but these (by position), e.g. the finished ones."""

    def absorb(self, other: DecodeBatch) -> bool:
        """Append ``other``'s rows after this batch's own and return True, or return False
        (changing nothing) when the two cannot be decoded as one batch."""
        return False


def _takes(model: PreTrainedModel, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


def _left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``tensor`` with zeros before its entries along ``dim`` up to ``length`` entries."""
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [missing, 0]
    return F.pad(tensor, pad)


def _stack(first: torch.Tensor, second: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Both left-padded to ``length`` along ``dim``, then one after the other (batch dim)."""
    return torch.cat([_left_pad(first, length, dim), _left_pad(second, length, dim)])


class CausalLMBatch(DecodeBatch):
    """A decoder-only model. ``mask`` marks the cache columns that hold tokens (1) rather
    than left padding (0); ``positions`` is each row's next position."""

    def __init__(self, model: PreTrainedModel):
        super().__init__(model)
        keep_last = _takes(model, "logits_to_keep")
        self.extra: dict[str, Any] = {"logits_to_keep": 1} if keep_last else {}
        self.takes_positions = _takes(model, "position_ids") and _takes(model, "attention_mask")
        self.cache: Any = None
        self.mask = torch.empty(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.empty(0, dtype=torch.long, device=self.device)

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, every_position: bool = False
    ) -> torch.Tensor:
        """The logits ``[rows, positions, V]``: of the last position only, unless
        ``every_position``."""
        inputs = {"attention_mask": self.mask, "position_ids": position_ids}
        extra = {**self.extra, "logits_to_keep": 0} if every_position and self.extra else self.extra
        output = self.model(
            input_ids=input_ids,
            past_key_values=self.cache,
            use_cache=True,
            **(inputs if self.takes_positions else {}),
            **extra,
        )
        self.cache = output.past_key_values
        return output.logits if every_position else output.logits[:, -1:]

    def prefill(
        self, prompt_ids: list[int], rows: int, score_prompt: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        length = len(prompt_ids)
        self.mask = torch.ones(1, length, dtype=torch.long, device=self.device)
        positions = torch.arange(length, device=self.device)[None]
        logits = self._forward(self._ids([prompt_ids]), positions, score_prompt)[0]
        if rows > 1:
            self.cache.batch_repeat_interleave(rows)
        self.mask = self.mask.expand(rows, -1).contiguous()
        self.positions = torch.full((rows,), length, dtype=torch.long, device=self.device)
        return logits[-1].expand(rows, -1), logits[:-1] if score_prompt else None

    @property
    def prefills_together(self) -> bool:
        return self.takes_positions  # left padding needs each row's own positions

    def prefill_together(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        length = max(len(ids) for ids in prompts)
        self.mask = torch.tensor(
            [[0] * (length - len(ids)) + [1] * len(ids) for ids in prompts],
            dtype=torch.long,
            device=self.device,
        )
        ids = self._ids([[0] * (length - len(ids)) + ids for ids in prompts])  # 0: masked out
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids, positions)[:, -1]
        lengths = torch.tensor([len(ids) for ids in prompts], device=self.device)
        if any(count != 1 for count in rows):
            index = torch.repeat_interleave(
                torch.arange(len(prompts), device=self.device),
                torch.tensor(rows, device=self.device),
            )
            self.cache.batch_select_indices(index)
            self.mask = self.mask.index_select(0, index)
            logits = logits.index_select(0, index)
            lengths = lengths.index_select(0, index)
        self.positions = lengths
        return logits

    def step(self, tokens: list[int]) -> torch.Tensor:
        self.mask = F.pad(self.mask, [0, 1], value=1)
        logits = self._forward(self._ids([[token] for token in tokens]), self.positions[:, None])
        self.positions = self.positions + 1
        return logits[:, -1]

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self._trim()

    def _trim(self) -> None:
        """Drop the leading cache columns that are padding in every row."""
        start = int(self.mask.any(dim=0).int().argmax())
        if start > 0 and self.mergeable:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, start:]
                layer.values = layer.values[:, :, start:]
            self.mask = self.mask[:, start:]

    @property
    def mergeable(self) -> bool:
        """Whether the cache can be padded and concatenated: plain full-attention layers."""
        return (
            self.takes_positions
            and type(self.cache) is DynamicCache
            and all(type(layer) is DynamicLayer for layer in self.cache.layers)
        )

    def absorb(self, other: DecodeBatch) -> bool:
        if not (isinstance(other, CausalLMBatch) and self.mergeable and other.mergeable):
            return False
        length = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = _stack(mine.keys, theirs.keys, length, 2)
            mine.values = _stack(mine.values, theirs.values, length, 2)
        self.mask = _stack(self.mask, other.mask, length, 1)
        self.positions = torch.cat([self.positions, other.positions])
        return True


class Seq2SeqBatch(DecodeBatch):
    """An encoder-decoder model: the prompt is encoded once, decoding starts at the model's
    decoder start token. Decoder positions are architecture-specific (learned, relative), so
    these batches are not merged."""

    def __init__(self, model: PreTrainedModel, decoder_start_token_id: int):
        super().__init__(model)
        self.decoder_start_token_id = decoder_start_token_id
        self.encoded = torch.empty(0)
        self.cache: Any = None

    def prefill(
        self, prompt_ids: list[int], rows: int, score_prompt: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        encoder = self.model.get_encoder()
        hidden = encoder(input_ids=self._ids([prompt_ids])).last_hidden_state
        self.encoded = hidden.repeat(rows, 1, 1)
        return self.step([self.decoder_start_token_id] * rows), None

    def step(self, tokens: list[int]) -> torch.Tensor:
        output = self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=self.encoded),  # type: ignore[arg-type]
            decoder_input_ids=self._ids([[token] for token in tokens]),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = output.past_key_values
        return output.logits[:, -1]

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.device)
        self.cache.batch_select_indices(index)
        self.encoded = self.encoded.index_select(0, index)
