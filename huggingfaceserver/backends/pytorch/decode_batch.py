"""The model side of rows decoded together: their KV cache, one new token per row a step.

A batch starts as one request's rows (its prompt run once, the cache repeated per row), or, for
a decoder-only model whose forward takes ``position_ids``, as the rows of several requests
admitted together: their prompts left-padded into one forward, as ``generate`` runs a batch.
Where the model's cache is plain full attention, the batch keeps it in a
:class:`~.kv_cache.ReservedCache` (written in place, never copied per step) and can *absorb*
other batches: their rows join its free rows, right-aligned, an attention mask hides the padding
and each row keeps its own positions, so rows of requests that started at different times step
together (continuous batching). Other models (sequence-to-sequence, sliding-window or recurrent
caches) keep transformers' own cache and one batch per prefill.

A step that raises leaves a reserved batch as it was, and :meth:`DecodeBatch.split` moves rows
out into a batch of their own: the decode loop retries a failed step with each request's rows
apart, so that only the request whose rows break the model fails.

With LoRA adapters (:mod:`.adapters`) every forward goes through PEFT with each row's adapter:
the batch keeps one adapter name per row (:attr:`DecodeBatch.adapters`), in step with its cache
rows whenever rows are repeated, dropped, absorbed or split. A recorded decode step (a CUDA
graph) runs every adapter on every row, masked to its rows by a column the graph reads
(:meth:`~.adapters.LoraAdapters.forward_masked`), while every row's adapter is plain LoRA
linear layers; a batch with another kind steps eagerly, through PEFT's batches. A decode step
that feeds new prompts is one packed batch row: each of its tokens gets its own row's or
prompt's adapter (:meth:`~.adapters.LoraAdapters.forward_tokens`), where the adapters are
plain LoRA linear layers, else only while every row and the prompts have one adapter
(:meth:`DecodeBatch.mixes_for`).
"""

from __future__ import annotations

import inspect
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from ...devices import to_device
from .adapters import LoraAdapters, row_adapter
from .kv_cache import MixedColumns, PartColumns, ReservedCache, full_attention_layers
from .ragged import MIXED, MixedAttention, agree, enable_mixed_steps
from .step_graphs import StepGraphs

T = TypeVar("T")


@dataclass(frozen=True)
class PromptPart:
    """The next part of a prompt fed in parts, to feed in another batch's decode step
    (:meth:`DecodeBatch.step_mixing`), as :meth:`DecodeBatch.prefill_part` would feed it."""

    batch: DecodeBatch
    """The prompt's own batch, of one row until :meth:`DecodeBatch.finish_prefill`."""
    ids: list[int]
    start: int
    """The position of the part's first token (0: the prompt's first part)."""
    every_position: bool = False
    """Keep the logits of every position of the part (:meth:`DecodeBatch.score_part`), else
    of its last."""
    adapter: str | None = None
    """The prompt's LoRA adapter (None: the base model)."""

    @property
    def kept(self) -> int:
        """The logits rows the part gives."""
        return len(self.ids) if self.every_position else 1


class DecodeBatch(ABC):
    """Rows decoded together, in the order of the logits rows they produce."""

    def __init__(self, model: PreTrainedModel, lora: LoraAdapters | None = None):
        self.model = model
        self.device = model.device
        self.lora = lora
        self.adapters: list[str] = []
        """Each row's adapter (PEFT's name; :data:`~.adapters.BASE` for none), in the order of
        the rows of the next forward; used only with ``lora``."""

    def _call(self, row_adapters: list[str] | None = None, /, **inputs: Any) -> Any:
        """The model's forward, through PEFT with each row's adapter (``row_adapters``, else
        :attr:`adapters`) when adapters are loaded."""
        if self.lora is None:
            return self.model(**inputs)
        return self.lora.forward(row_adapters or self.adapters, **inputs)

    def _ids(self, rows: list[list[int]]) -> torch.Tensor:
        return to_device(rows, self.device, torch.long)

    def _column(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """A step's input ``[rows, 1]``: one token per row, from the device or from a list."""
        if isinstance(tokens, torch.Tensor):
            return tokens.to(self.device).view(-1, 1)
        return self._ids([[token] for token in tokens])

    @abstractmethod
    def prefill(
        self,
        prompt_ids: list[int],
        rows: int,
        score_prompt: bool = False,
        adapter: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompt once for ``rows`` rows (with LoRA ``adapter``, None: the base
        model): the first next-token logits ``[rows, V]``,
        and with ``score_prompt`` a decoder-only model's logits at every prompt position but
        the last ``[prompt - 1, V]`` (position ``i`` predicts prompt token ``i + 1``), else
        None (a seq2seq model's decoder never predicts the prompt)."""

    @property
    def prefills_together(self) -> bool:
        """Whether :meth:`prefill_together` runs several prompts in one forward."""
        return False

    def prefill_together(
        self,
        prompts: list[list[int]],
        rows: list[int],
        adapters: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        """Run the prompts as one batch, prompt ``i`` for ``rows[i]`` rows (rows in the order of
        the prompts) with LoRA adapter ``adapters[i]`` (None: the base model): the first
        next-token logits ``[sum(rows), V]``. Only where :attr:`prefills_together`."""
        raise NotImplementedError(f"{type(self).__name__} runs one prompt at a time")

    def prefill_scoring_together(
        self,
        prompts: list[list[int]],
        rows: list[int],
        adapters: Sequence[str | None] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`prefill_together`, and each prompt's logits at every position but its last
        (``[prompt - 1, V]``, as :meth:`prefill` scores one). Only where
        :attr:`prefills_together`."""
        raise NotImplementedError(f"{type(self).__name__} runs one prompt at a time")

    @property
    def prefills_in_parts(self) -> bool:
        """Whether a prompt can be fed in parts (:meth:`prefill_part`), other batches stepping
        between the parts."""
        return False

    def prefill_part(self, ids: list[int], start: int, adapter: str | None = None) -> torch.Tensor:
        """Feed the next part of a prompt, one row (with LoRA ``adapter``): its tokens ``ids``,
        at positions from ``start`` (0 for the first part); the next-token logits after it
        ``[V]``. Only where :attr:`prefills_in_parts`; :meth:`finish_prefill` after the last
        part."""
        raise NotImplementedError(f"{type(self).__name__} runs a prompt in one forward")

    def score_part(self, ids: list[int], start: int, adapter: str | None = None) -> torch.Tensor:
        """:meth:`prefill_part`, keeping the logits of every position of the part
        ``[len(ids), V]`` (position ``i`` predicts the prompt's token ``start + i + 1``; the
        last part's last row is the next-token logits)."""
        raise NotImplementedError(f"{type(self).__name__} runs a prompt in one forward")

    def finish_prefill(self, length: int, rows: int) -> None:
        """After a prompt's last part (``length`` tokens in all): its cache held for ``rows``
        rows, ready to step."""
        raise NotImplementedError(f"{type(self).__name__} runs a prompt in one forward")

    @abstractmethod
    def step(self, tokens: torch.Tensor | Sequence[int], graphed: bool = True) -> torch.Tensor:
        """Feed each row its latest token (``[rows]`` on the device, or a list); the next-token
        logits ``[rows, V]``. ``graphed``: whether the step may replay the recorded decode
        steps where the batch has them (:mod:`.step_graphs`), or runs eagerly."""

    mixes = False
    """Whether :meth:`step_mixing` feeds new prompts in a decode step's forward."""

    def step_mixing(
        self,
        tokens: torch.Tensor | Sequence[int],
        prompts: list[list[int]],
        copies: list[int] | None = None,
        adapters: Sequence[str | None] | None = None,
        parts: Sequence[PromptPart] = (),
    ) -> torch.Tensor:
        """A decode step (``tokens`` as for :meth:`step`) that also runs ``prompts``, prompt
        ``i`` for ``copies[i]`` rows (1 each by default) joining the batch after its rows, with
        LoRA adapter ``adapters[i]`` (None: the base model), and the next part of each prompt
        fed in parts (``parts``: each into its own batch, as :meth:`prefill_part` or
        :meth:`score_part` would): the logits ``[rows + sum(copies) + sum(part.kept), V]``,
        the parts' last. Only where :meth:`mixes_for` each prompt's and part's adapter."""
        raise NotImplementedError(f"{type(self).__name__}'s decode steps take no prompts")

    def mixes_for(self, adapter: str | None) -> bool:
        """Whether the next decode step can feed a prompt for LoRA ``adapter`` (None: the base
        model) beside its rows: never here."""
        return False

    @abstractmethod
    def keep(self, rows: list[int]) -> None:
        """Drop every row but these (by position), e.g. the finished ones; maybe none."""

    def absorb(self, other: DecodeBatch) -> bool:
        """Append ``other``'s rows after this batch's own and return True, or return False
        (changing nothing) when the two cannot be decoded as one batch."""
        return False

    @property
    def columns(self) -> int:
        """The KV cache's columns in use, which every row holds (a row's tokens and its left
        padding): what a row of this batch costs the KV cache budget (:mod:`.kv_budget`);
        0 where the budget does not count it (a seq2seq model)."""
        return 0

    @property
    def narrows(self) -> bool:
        """Whether the rows that leave (:meth:`keep`) take with them the columns that only
        they held, down to the longest row left; where not, the rows left stay as wide."""
        return False

    @property
    def splits(self) -> bool:
        """Whether :meth:`split` can move rows out (after a step that raised too)."""
        return False

    def split(self, rows: list[int]) -> DecodeBatch:
        """Move these rows (by position) out into a new batch; this one keeps the others, in
        their order. Only where :attr:`splits`."""
        raise NotImplementedError(f"{type(self).__name__} does not split")


def _takes(model: PreTrainedModel, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


def _cache_argument(model: PreTrainedModel) -> str:
    """The forward's keyword for the KV cache: ``cache`` since transformers 5.2x, before
    ``past_key_values``."""
    return "cache" if _takes(model, "cache") else "past_key_values"


def _returned_cache(output: Any) -> Any:
    return output["cache"] if "cache" in output else output["past_key_values"]


class CausalLMBatch(DecodeBatch):
    """A decoder-only model on transformers' own cache (sliding-window, recurrent or mixed
    layers). ``mask`` marks the cache columns that hold tokens (1) rather than left padding
    (0); ``positions`` is each row's next position."""

    @property
    def columns(self) -> int:
        return int(self.mask.shape[-1])

    def __init__(self, model: PreTrainedModel, lora: LoraAdapters | None = None):
        super().__init__(model, lora)
        keep_last = _takes(model, "logits_to_keep")
        self.extra: dict[str, Any] = {"logits_to_keep": 1} if keep_last else {}
        self.takes_positions = _takes(model, "position_ids") and _takes(model, "attention_mask")
        self.cache_argument = _cache_argument(model)
        self.cache: Any = None
        self.mask = torch.empty(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.empty(0, dtype=torch.long, device=self.device)

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        every_position: bool = False,
    ) -> torch.Tensor:
        """The logits ``[rows, positions, V]``: of the last position only, unless
        ``every_position``."""
        inputs = {"attention_mask": mask, "position_ids": position_ids}
        extra = {**self.extra, "logits_to_keep": 0} if every_position and self.extra else self.extra
        output = self._call(
            input_ids=input_ids,
            use_cache=True,
            **{self.cache_argument: self.cache},
            **(inputs if self.takes_positions else {}),
            **extra,
        )
        self._keep_cache(_returned_cache(output), input_ids.shape[1])
        return output.logits if every_position else output.logits[:, -1:]

    def _keep_cache(self, cache: Any, tokens: int) -> None:
        """The cache after a forward that fed ``tokens`` tokens per row."""
        self.cache = cache

    def _begin(self, tokens: int, rows: int) -> torch.Tensor:
        """The attention mask of a first forward of ``rows`` rows of ``tokens`` tokens."""
        return torch.ones(rows, tokens, dtype=torch.long, device=self.device)

    def _repeat(self, order: list[int]) -> None:
        """The rows after a first forward, repeated or reordered as ``order`` says (host
        values: on a GPU nothing waits to read them)."""
        index = to_device(order, self.device, torch.long)
        self.cache.batch_select_indices(index)
        self.mask = self.mask.index_select(0, index)

    def _feed(self, ids: list[int], start: int, every_position: bool = False) -> torch.Tensor:
        """One row's prompt tokens ``ids`` at positions from ``start`` (0: the first forward):
        the logits of the last position ``[1, V]``, or of every one ``[len(ids), V]``."""
        mask = self._begin(len(ids), 1) if start == 0 else self._extend(len(ids))
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        logits = self._forward(self._ids([ids]), positions, mask, every_position)[0]
        self.mask = mask
        return logits

    def prefill(
        self,
        prompt_ids: list[int],
        rows: int,
        score_prompt: bool = False,
        adapter: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.adapters = [row_adapter(adapter)]
        logits = self._feed(prompt_ids, 0, score_prompt)
        self.finish_prefill(len(prompt_ids), rows)
        return logits[-1].expand(rows, -1), logits[:-1] if score_prompt else None

    @property
    def prefills_in_parts(self) -> bool:
        return self.takes_positions  # a later part's tokens need their own positions

    def prefill_part(self, ids: list[int], start: int, adapter: str | None = None) -> torch.Tensor:
        self.adapters = [row_adapter(adapter)]
        return self._feed(ids, start)[-1]

    def score_part(self, ids: list[int], start: int, adapter: str | None = None) -> torch.Tensor:
        self.adapters = [row_adapter(adapter)]
        return self._feed(ids, start, every_position=True)

    def finish_prefill(self, length: int, rows: int) -> None:
        if rows > 1:
            self._repeat([0] * rows)
            self.adapters = self.adapters * rows
        self.positions = torch.full((rows,), length, dtype=torch.long, device=self.device)

    @property
    def prefills_together(self) -> bool:
        return self.takes_positions  # left padding needs each row's own positions

    def prefill_together(
        self,
        prompts: list[list[int]],
        rows: list[int],
        adapters: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        return self._prefill_padded(prompts, rows, adapters, every_position=False)[0]

    def prefill_scoring_together(
        self,
        prompts: list[list[int]],
        rows: list[int],
        adapters: Sequence[str | None] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits, every = self._prefill_padded(prompts, rows, adapters, every_position=True)
        length = every.shape[1]  # prompt i's tokens are the last len(prompt) positions
        scored = [every[i, length - len(p) : length - 1] for i, p in enumerate(prompts)]
        return logits, scored

    def _prefill_padded(
        self,
        prompts: list[list[int]],
        rows: list[int],
        adapters: Sequence[str | None] | None,
        every_position: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts left-padded into one forward: the first next-token logits of the rows,
        and the forward's logits ``[prompts, positions, V]`` (the last position only unless
        ``every_position``)."""
        names = [row_adapter(a) for a in adapters or [None] * len(prompts)]
        self.adapters = names
        length = max(len(ids) for ids in prompts)
        mask = self._begin(length, len(prompts))
        for row, prompt in enumerate(prompts):
            mask[row, : length - len(prompt)] = 0
        ids = self._ids([[0] * (length - len(p)) + p for p in prompts])  # 0: masked out
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        every = self._forward(ids, positions, mask, every_position)
        logits = every[:, -1]
        self.mask = mask
        lengths = to_device([len(p) for p in prompts], self.device, torch.long)
        if any(count != 1 for count in rows):
            order = _repeated(range(len(rows)), rows)
            self._repeat(order)
            index = to_device(order, self.device, torch.long)
            logits = logits.index_select(0, index)
            lengths = lengths.index_select(0, index)
            self.adapters = _repeated(names, rows)
        self.positions = lengths
        return logits, every

    def _extend(self, tokens: int) -> torch.Tensor:
        """The attention mask of a forward of ``tokens`` more tokens per row."""
        return F.pad(self.mask, [0, tokens], value=1)

    def step(self, tokens: torch.Tensor | Sequence[int], graphed: bool = True) -> torch.Tensor:
        mask = self._extend(1)
        logits = self._forward(self._column(tokens), self.positions[:, None], mask)
        self.mask = mask
        self.positions = self.positions + 1
        return logits[:, -1]

    def keep(self, rows: list[int]) -> None:
        index = to_device(rows, self.device, torch.long)  # [] too
        self.cache.batch_select_indices(index)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.adapters = [self.adapters[row] for row in rows]


class ReservedCausalLMBatch(CausalLMBatch):
    """A decoder-only model whose cache is full attention in every layer: the cache is a
    :class:`~.kv_cache.ReservedCache` (its mask is the batch's), written in place; batches
    absorb each other and split. A decode step hands the model its attention mask ready-made
    (:meth:`~.kv_cache.ReservedCache.step_mask`), and with ``graphs`` replays a recorded one
    where it can (:mod:`.step_graphs`; with LoRA adapters only while every row's adapter is
    mixed by token: :meth:`~.adapters.LoraAdapters.forward_masked`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        cache: ReservedCache,
        graphs: StepGraphs | None = None,
        ready_masks: bool = True,
        lora: LoraAdapters | None = None,
        mixes: bool = False,
    ):
        super().__init__(model, lora)
        self.cache = cache
        if graphs is not None and not ready_masks:
            raise ValueError("recorded decode steps need ready masks")
        if mixes and not ready_masks:
            raise ValueError("decode steps take prompts with ready masks only")
        self.mixes = mixes
        """Whether :meth:`step_mixing` feeds prompts in a decode step (decided at load,
        :func:`~.ragged.enable_mixed_steps`)."""
        self.graphs = graphs
        """Recorded decode steps (chosen at load by :class:`~.generator.TransformersGenerator`)."""
        self.masks_for: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self.masks: torch.Tensor | None = None
        """:meth:`adapter_masks` of the rows' adapters :attr:`masks_for` names (None: they
        are not all mixed by token)."""
        self.ready_masks = ready_masks
        """Whether decode steps hand the model a ready 4-D mask (:func:`takes_ready_masks`)."""

    @staticmethod
    def cache_layers(model: PreTrainedModel) -> int:
        """The layers of a :class:`~.kv_cache.ReservedCache` for this model (read once, at
        load); 0 where its rows cannot be kept this way."""
        if not (_takes(model, "position_ids") and _takes(model, "attention_mask")):
            return 0
        return full_attention_layers(model.config)

    def _keep_cache(self, cache: Any, tokens: int) -> None:
        if cache is not self.cache:
            raise RuntimeError(f"{type(self.model).__name__} replaced the KV cache it was given")
        self.cache.advance(tokens)

    def _begin(self, tokens: int, rows: int) -> torch.Tensor:
        return self.cache.reserve(tokens, rows)

    def _repeat(self, order: list[int]) -> None:
        self.cache.select_rows(order)

    @property
    def mask(self) -> torch.Tensor:  # type: ignore[override]
        return self.cache.mask

    @mask.setter
    def mask(self, value: torch.Tensor) -> None:
        pass  # the cache's own, set through reserve

    @property
    def columns(self) -> int:  # without slicing the mask: asked every step
        return self.cache.end - self.cache.start

    @property
    def narrows(self) -> bool:
        return True  # keep trims the columns that are padding in every row left

    def _extend(self, tokens: int) -> torch.Tensor:
        return self.cache.reserve(tokens)

    def step(self, tokens: torch.Tensor | Sequence[int], graphed: bool = True) -> torch.Tensor:
        # with LoRA, rows of adapters mixed by token only (the others go through PEFT's batches)
        masked = self.lora is None or self.adapter_masks()[1] is not None
        graphs = self.graphs if graphed and masked else None
        # the rows for the padding first: fitting them may move the buffers
        size = graphs.bucket(self.cache) if graphs is not None else None
        mask = self.cache.reserve(1)
        column = self._column(tokens)
        logits = None
        if graphs is not None and size is not None:
            logits = graphs.step(self, column, size)
        if logits is not None:
            self.cache.advance(1)
        else:
            if self.ready_masks:
                mask = self.cache.step_mask(self.model.dtype)
            logits = self._forward(column, self.positions[:, None], mask)[:, -1]
        self.positions = self.positions + 1
        return logits

    def mixes_for(self, adapter: str | None) -> bool:
        """Where :attr:`mixes`, and a packed forward's one batch row can hold the rows' tokens
        beside a prompt's for LoRA ``adapter`` (None: the base model; see
        :meth:`~.adapters.LoraAdapters.packs`)."""
        if self.lora is None:
            return self.mixes
        return self.mixes and self.lora.packs([*self.adapters, row_adapter(adapter)])

    def step_mixing(
        self,
        tokens: torch.Tensor | Sequence[int],
        prompts: list[list[int]],
        copies: list[int] | None = None,
        adapters: Sequence[str | None] | None = None,
        parts: Sequence[PromptPart] = (),
    ) -> torch.Tensor:
        """A decode step that also feeds ``prompts`` (each run once, in a row of its own, then
        repeated to ``copies[i]`` rows joining this batch after its rows) and ``parts`` (each
        into its prompt's own batch, after the parts fed before), in one forward
        (:mod:`.ragged`; each token with its row's, prompt's or part's LoRA adapter, only
        where :meth:`mixes_for` each of them): the logits ``[rows + sum(copies) +
        sum(part.kept), V]``, the running rows' next tokens, then each prompt's first, per
        copy, then each part's. A forward that raises leaves the batches as they were."""
        names = [row_adapter(a) for a in adapters or [None] * len(prompts)]
        part_names = [row_adapter(part.adapter) for part in parts]
        if not self.mixes or (
            self.lora is not None and not self.lora.packs([*self.adapters, *names, *part_names])
        ):
            return super().step_mixing(tokens, prompts, copies, adapters, parts)
        caches = [self._part_cache(part) for part in parts]
        cache = self.cache
        lengths = tuple(len(prompt) for prompt in prompts)
        rows = cache.open_rows(lengths) if lengths else cache.rows
        try:
            cache.reserve(1)
            part_masks = []
            for own, part in zip(caches, parts, strict=True):
                own.reserve(len(part.ids), 1 if part.start == 0 else None)
                part_masks.append(self._part_mask(own, len(part.ids)))
            column = cache.end
            mask = cache.step_mask(self.model.dtype)[:rows]
            fed = [token for prompt in prompts for token in prompt]
            fed += [token for part in parts for token in part.ids]
            ids = torch.cat([self._column(tokens).view(-1), self._ids([fed]).view(-1)])
            starts = [0] * len(prompts) + [part.start for part in parts]
            counts = [*lengths, *(len(part.ids) for part in parts)]
            positions = torch.cat(
                [
                    self.positions,
                    *(
                        torch.arange(first, first + count, device=self.device)
                        for first, count in zip(starts, counts, strict=True)
                    ),
                ]
            )
            keep = self._kept(rows, lengths, parts)
            layout = MixedColumns(
                rows,
                column,
                lengths,
                tuple(PartColumns(own, len(p.ids)) for own, p in zip(caches, parts, strict=True)),
            )
            attention = MixedAttention(layout, cache.start, mask, tuple(part_masks))
            inputs = {
                "input_ids": ids[None],  # the packed sequence is one batch row
                "position_ids": positions[None],
                "attention_mask": mask.new_zeros(1, 1, ids.shape[0], 1),  # taken as given
                "use_cache": True,
                self.cache_argument: cache,
                MIXED: attention,
                **({"logits_to_keep": keep} if self.extra else {}),
            }
            with cache.mixing(layout):
                if self.lora is None:
                    output = self.model(**inputs)
                else:
                    each = [*self.adapters, *_repeated(names, lengths)]
                    each += _repeated(part_names, [len(part.ids) for part in parts])
                    output = self.lora.forward_tokens(each, **inputs)
        except BaseException:
            cache.close_rows(rows)
            raise
        if _returned_cache(output) is not cache:
            cache.close_rows(rows)
            raise RuntimeError(f"{type(self.model).__name__} replaced the KV cache it was given")
        cache.advance(1)
        for own, part, name in zip(caches, parts, part_names, strict=True):
            own.advance(len(part.ids))
            part.batch.adapters = [name]
        opened = to_device(lengths, self.device, torch.long)
        self.positions = torch.cat([self.positions + 1, opened])
        logits = output.logits[0]
        if not self.extra:
            logits = logits.index_select(0, keep)
        joined = rows + len(prompts)
        logits, of_parts = logits[:joined], logits[joined:]
        copies = list(copies) if copies is not None else [1] * len(prompts)
        if any(count != 1 for count in copies):
            index = list(range(rows)) + _repeated(range(rows, rows + len(copies)), copies)
            cache.select_rows(index)
            repeat = to_device(index, self.device, torch.long)
            self.positions = self.positions.index_select(0, repeat)
            logits = logits.index_select(0, repeat)
        self.adapters = self.adapters + _repeated(names, copies)
        return torch.cat([logits, of_parts]) if parts else logits

    def _part_cache(self, part: PromptPart) -> ReservedCache:
        """The cache a part is fed into: its prompt's own batch's, of one row."""
        batch = part.batch
        if not isinstance(batch, ReservedCausalLMBatch) or batch.lora is not self.lora:
            raise TypeError("a prompt's part joins a decode step of a batch like its own only")
        if part.start and batch.cache.rows != 1:
            raise ValueError("a prompt's later part is fed after its first, into one row")
        return batch.cache

    def _part_mask(self, cache: ReservedCache, tokens: int) -> torch.Tensor | None:
        """After ``cache`` reserved a part's ``tokens``: where each of them attends, over the
        columns the prompt holds and the part's own (None: a first part, causal as is)."""
        held = cache.end - cache.start
        if not held:
            return None
        columns = torch.arange(held + tokens, device=self.device)
        return (columns[None] <= torch.arange(held, held + tokens, device=self.device)[:, None])[
            None, None
        ]

    def _kept(
        self, rows: int, lengths: tuple[int, ...], parts: Sequence[PromptPart]
    ) -> torch.Tensor:
        """The positions of a packed forward whose logits are kept: every decode row's, each
        prompt's last, each part's last (or every one, :attr:`PromptPart.every_position`)."""
        ends = [rows - 1 + end for end in itertools.accumulate(lengths)]
        kept = list(range(rows)) + ends
        offset = rows + sum(lengths)
        for part in parts:
            count = len(part.ids)
            kept += range(offset + count - part.kept, offset + count)
            offset += count
        return to_device(kept, self.device, torch.long)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def adapter_masks(self) -> tuple[tuple[str, ...], torch.Tensor | None]:
        """For a recorded step: the LoRA adapters it computes
        (:meth:`~.adapters.LoraAdapters.masked_names`) and ``[adapters, rows, 1]`` in the
        model's dtype, 1 where a row runs that adapter; None where a row's adapter is not
        mixed by token (the step runs eagerly). Made (and copied to the device) when the rows
        or the adapters loaded change, not at every step."""
        if self.lora is None:
            return (), None
        names = self.lora.masked_names()
        key = (names, tuple(self.adapters))
        if self.masks_for != key:
            self.masks_for = key
            self.masks = None
            if self.lora.masks_cover(self.lora.served(self.adapters)):
                host = [[[float(row == name)] for row in self.adapters] for name in names]
                self.masks = to_device(torch.tensor(host, dtype=self.dtype), self.device)
        return names, self.masks

    def forward_whole(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        adapters: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """A decode step's logits ``[rows, 1, V]`` from a forward over the cache's whole
        buffers (inside :meth:`~.kv_cache.ReservedCache.writing_at`; the caller advances the
        cache), each row with the LoRA adapter whose ``adapters`` column has a 1 there
        (:meth:`~.adapters.LoraAdapters.forward_masked`)."""
        inputs = {
            "input_ids": ids,
            "position_ids": positions,
            "attention_mask": mask,
            "use_cache": True,
            self.cache_argument: self.cache,
            **self.extra,
        }
        if self.lora is not None:
            return self.lora.forward_masked(adapters, **inputs).logits
        return self.model(**inputs).logits

    def keep(self, rows: list[int]) -> None:
        if self.graphs is not None:  # a recorded step reads every cell of the rows it pads to
            self.cache.clear_rows(sorted(set(range(self.cache.rows)) - set(rows)))
        self.cache.select_rows(rows)
        index = to_device(rows, self.device, torch.long)  # [] too
        self.positions = self.positions.index_select(0, index)
        self.adapters = [self.adapters[row] for row in rows]
        self.cache.trim()

    def move_to(self, cache: ReservedCache) -> None:
        """Hold the rows in ``cache`` from now on (its rows and columns before dropped)."""
        cache.take(self.cache)
        self.cache = cache

    def absorb(self, other: DecodeBatch) -> bool:
        if not isinstance(other, ReservedCausalLMBatch) or other.lora is not self.lora:
            return False
        self.cache.absorb(other.cache)
        self.positions = torch.cat([self.positions, other.positions])
        self.adapters = self.adapters + other.adapters
        return True

    @property
    def splits(self) -> bool:
        return True

    def split(self, rows: list[int]) -> DecodeBatch:
        taken = ReservedCausalLMBatch(
            self.model,
            self.cache.take_rows(rows),
            self.graphs,
            self.ready_masks,
            self.lora,
            self.mixes,
        )
        taken.positions = self.positions.index_select(0, to_device(rows, self.device, torch.long))
        taken.adapters = [self.adapters[row] for row in rows]
        taken.cache.trim()
        moved = set(rows)
        kept = [row for row in range(self.cache.rows) if row not in moved]
        if kept:
            self.keep(kept)
        return taken


def takes_ready_masks(model: PreTrainedModel, cache_layers: int) -> bool:
    """Whether the model's decode steps give the same logits with a ready 4-D mask as with
    the 2-D one it would build its mask from: transformers' models take either, but a model's
    own code (``trust_remote_code``) may expand the mask itself. Probed once, at load, on two
    left-padded prompts of a few tokens."""
    batches = [
        ReservedCausalLMBatch(model, ReservedCache(cache_layers, 2, model.device), None, ready)
        for ready in (False, True)
    ]
    vocab = int(model.config.get_text_config().vocab_size)
    prompts = [[1 % vocab, 2 % vocab, 3 % vocab], [4 % vocab]]
    try:
        with torch.inference_mode():
            steps = []
            for batch in batches:
                batch.prefill_together(prompts, [1, 1])
                steps.append(batch.step([5 % vocab, 6 % vocab]).float())
    except Exception:  # noqa: BLE001 - a model that refuses it does not take it
        return False
    return bool(torch.allclose(steps[0], steps[1], atol=1e-3, rtol=1e-3))


def mixes_prompts(model: PreTrainedModel, cache_layers: int) -> bool:
    """Whether the model's decode steps can feed new prompts and prompts' parts
    (:mod:`.ragged`), switching its attention to the one that packs them where they can:
    probed once, at load, on two left-padded rows stepping while a prompt wider than their
    columns joins and a prompt fed in parts gets its second part (every position's logits
    kept), then all four rows stepping, against the same forwards run apart."""
    vocab = int(model.config.get_text_config().vocab_size)
    running, joining, parted = (
        [[1 % vocab, 2 % vocab, 3 % vocab], [4 % vocab]],
        [(7 + i) % vocab for i in range(6)],
        [(11 + i) % vocab for i in range(7)],
    )

    def batch(mixes: bool = False) -> ReservedCausalLMBatch:
        return ReservedCausalLMBatch(
            model, ReservedCache(cache_layers, 3, model.device), None, True, None, mixes
        )

    def plain() -> torch.Tensor:
        return batch().prefill(joining, 1)[0]

    def mixed() -> bool:
        apart, alone, packed = batch(), batch(), batch(mixes=True)
        in_parts, in_parts_alone = batch(), batch()
        apart.prefill_together(running, [1, 1])
        alone_first = alone.prefill(joining, 1)[0]
        apart_first = apart.step([5 % vocab, 6 % vocab])
        in_parts_alone.prefill_part(parted[:3], 0)
        part_scores = in_parts_alone.score_part(parted[3:], 3)
        packed.prefill_together(running, [1, 1])
        in_parts.prefill_part(parted[:3], 0)
        second = PromptPart(in_parts, parted[3:], 3, every_position=True)
        first = packed.step_mixing([5 % vocab, 6 % vocab], [joining], parts=[second])
        expected = torch.cat([apart_first, alone_first, part_scores])
        then = packed.step([8 % vocab, 9 % vocab, 10 % vocab])
        expected_then = torch.cat([apart.step([8 % vocab, 9 % vocab]), alone.step([10 % vocab])])
        for done in (in_parts, in_parts_alone):
            done.finish_prefill(len(parted), 1)
        return (
            agree(first, expected)
            and agree(then, expected_then)
            and agree(in_parts.step([12 % vocab]), in_parts_alone.step([12 % vocab]))
        )

    return enable_mixed_steps(model, plain, mixed)


class Seq2SeqBatch(DecodeBatch):
    """An encoder-decoder model: the prompt is encoded once, decoding starts at the model's
    decoder start token. Decoder positions are architecture-specific (learned, relative), so
    these batches are not merged."""

    def __init__(self, model: PreTrainedModel, decoder_start_token_id: int):
        super().__init__(model)
        self.decoder_start_token_id = decoder_start_token_id
        self.cache_argument = _cache_argument(model)
        self.encoded = torch.empty(0)
        self.cache: Any = None

    def prefill(
        self,
        prompt_ids: list[int],
        rows: int,
        score_prompt: bool = False,
        adapter: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if adapter is not None:  # refused at load (:class:`~.adapters.LoraAdapters`)
            raise ValueError("a sequence-to-sequence model serves no LoRA adapter")
        encoder = self.model.get_encoder()
        hidden = encoder(input_ids=self._ids([prompt_ids])).last_hidden_state
        self.encoded = hidden.repeat(rows, 1, 1)
        return self.step([self.decoder_start_token_id] * rows), None

    def step(self, tokens: torch.Tensor | Sequence[int], graphed: bool = True) -> torch.Tensor:
        output = self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=self.encoded),  # type: ignore[arg-type]
            decoder_input_ids=self._column(tokens),
            use_cache=True,
            **{self.cache_argument: self.cache},
        )
        self.cache = _returned_cache(output)
        return output.logits[:, -1]

    def keep(self, rows: list[int]) -> None:
        index = to_device(rows, self.device, torch.long)  # [] too
        self.cache.batch_select_indices(index)
        self.encoded = self.encoded.index_select(0, index)


def _repeated(items: Sequence[T], counts: Sequence[int]) -> list[T]:
    """Each item repeated its count of times, in order."""
    return [item for item, count in zip(items, counts, strict=True) for _ in range(count)]
