"""The transformers (PyTorch) backend for generation: causal and sequence-to-sequence LMs.

A request is one batch of ``params.n`` rows decoded together with the model's KV cache, in a
worker thread; deltas reach the event loop through an asyncio queue. The loop is written over
a list of :class:`SequenceState` rows (each with its own settings, random generator, text and
finish state) and a :class:`DecodeBatch` (the model side), so that one continuously batched
loop shared by all requests can later replace "one loop per request" behind this interface.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_outputs import BaseModelOutput

from ..cli import ServerConfig
from ..errors import BadRequest, StartupError
from ..generation.detokenize import IncrementalDetokenizer
from ..generation.logits import choose_next_tokens
from ..generation.params import ChoiceDelta, FinishReason, SamplingParams, TokenLogprob
from ..loading import ModelSource, device, load_pretrained, load_tokenizer, resolve_dtype
from ..tasks import Task
from .base import GenerationBackend
from .tokenizing import UNSET_MAX_LENGTH

logger = logging.getLogger(__name__)

MODEL_CLASSES: dict[Task, Any] = {
    Task.text_generation: AutoModelForCausalLM,
    Task.text2text_generation: AutoModelForSeq2SeqLM,
}

# Config attributes that bound the positions a model takes (the ones vLLM reads).
POSITION_LIMIT_ATTRIBUTES = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
)
# Context for relative-position models (T5) whose tokenizer sets no limit either.
RELATIVE_POSITION_CONTEXT = 512
# Requests decoded at the same time, each in its own worker thread; later ones wait.
MAX_CONCURRENT_DECODES = 8


def model_context_length(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> int:
    """The longest sequence the model takes: its position limit, or for relative-position
    models the tokenizer's ``model_max_length`` when set, else 512."""
    text_config = config.get_text_config()
    limits = [getattr(text_config, name, None) for name in POSITION_LIMIT_ATTRIBUTES]
    known = [int(limit) for limit in limits if isinstance(limit, int) and limit > 0]
    if known:
        return min(known)
    if 0 < tokenizer.model_max_length < UNSET_MAX_LENGTH:
        return int(tokenizer.model_max_length)
    return RELATIVE_POSITION_CONTEXT


def resolve_context_length(
    requested: int | None, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> int:
    """``--max_model_len`` checked against the model's limit, or that limit by default."""
    limit = model_context_length(config, tokenizer)
    if requested is not None and requested > limit:
        raise StartupError(f"--max_model_len {requested} exceeds the model's limit of {limit}")
    return limit if requested is None else requested


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every token that ends a sequence: the generation config's (maybe several), the
    tokenizer's."""
    ids = model.generation_config.eos_token_id
    found = set(ids) if isinstance(ids, list) else {ids}
    found.add(tokenizer.eos_token_id)
    return frozenset(i for i in found if i is not None)


@dataclass(eq=False)
class SequenceState:
    """One choice being generated: its settings, generator, tokens, text and finish state."""

    index: int
    params: SamplingParams
    prompt_ids: list[int]
    stop_ids: frozenset[int]
    """Tokens that end the choice: EOS (unless ignore_eos) and the stop token ids."""
    budget: int
    """New tokens at most: max_tokens, capped by the context length."""
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def append(self, token_id: int, logprob: TokenLogprob | None) -> ChoiceDelta:
        """Take the next token; the delta it makes, with the finish reason when it ends."""
        self.output_ids.append(token_id)
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
            keep = self.params.include_stop_str_in_output
            text = (self.detokenizer.push(token_id) if keep else "") + self.detokenizer.flush()
        else:
            text = self.detokenizer.push(token_id)
            if self.detokenizer.stopped:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.budget:
                self.finish_reason = "length"
                text += self.detokenizer.flush()
        logprobs = None if logprob is None else [logprob]
        return ChoiceDelta(self.index, text, [token_id], logprobs, self.finish_reason)


def advance(rows: list[SequenceState], logits: torch.Tensor) -> list[ChoiceDelta]:
    """Choose each row's next token from its logits ``[rows, vocab]``; their deltas."""
    tokens, logprobs = choose_next_tokens(logits, rows)
    return [row.append(token, lp) for row, token, lp in zip(rows, tokens, logprobs, strict=True)]


class DecodeBatch(ABC):
    """The model side of rows decoded together: their KV cache, one token per row a step."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.device = model.device

    def _ids(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @abstractmethod
    def prefill(self, prompt_ids: list[int], rows: int) -> torch.Tensor:
        """Run the prompt once for ``rows`` rows; the first next-token logits ``[rows, V]``."""

    @abstractmethod
    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed each row its latest token; the next-token logits ``[rows, V]``."""

    @abstractmethod
    def keep(self, rows: list[int]) -> None:
        """Drop every row but these (by position), e.g. the finished ones."""


class CausalLMBatch(DecodeBatch):
    """A decoder-only model: the prompt's cache is computed once and repeated per row."""

    def __init__(self, model: PreTrainedModel):
        super().__init__(model)
        takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.extra = {"logits_to_keep": 1} if takes_keep else {}
        self.cache: Any = None

    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        output = self.model(
            input_ids=input_ids, past_key_values=self.cache, use_cache=True, **self.extra
        )
        self.cache = output.past_key_values
        return output.logits[:, -1]

    def prefill(self, prompt_ids: list[int], rows: int) -> torch.Tensor:
        logits = self._forward(self._ids([prompt_ids]))
        if rows > 1:
            self.cache.batch_repeat_interleave(rows)
        return logits.expand(rows, -1)

    def step(self, tokens: list[int]) -> torch.Tensor:
        return self._forward(self._ids([[token] for token in tokens]))

    def keep(self, rows: list[int]) -> None:
        self.cache.batch_select_indices(torch.tensor(rows, device=self.device))


class Seq2SeqBatch(DecodeBatch):
    """An encoder-decoder model: the prompt is encoded once, decoding starts at the model's
    decoder start token."""

    def __init__(self, model: PreTrainedModel, decoder_start_token_id: int):
        super().__init__(model)
        self.decoder_start_token_id = decoder_start_token_id
        self.encoded = torch.empty(0)
        self.cache: Any = None

    def prefill(self, prompt_ids: list[int], rows: int) -> torch.Tensor:
        encoder = self.model.get_encoder()
        hidden = encoder(input_ids=self._ids([prompt_ids])).last_hidden_state
        self.encoded = hidden.repeat(rows, 1, 1)
        return self.step([self.decoder_start_token_id] * rows)

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


Emit = Callable[[list[ChoiceDelta] | BaseException | None], None]


class TransformersGenerator(GenerationBackend):
    """Generate with an ``AutoModelForCausalLM`` or ``AutoModelForSeq2SeqLM``, one batched
    decode loop per request in a worker thread."""

    name = "huggingface"

    def __init__(self, source: ModelSource, config: ServerConfig):
        self.source = source
        self.config = config
        self.device = device()
        self.dtype = resolve_dtype(config.dtype, source.task, self.device.type == "cuda")
        self.executor = ThreadPoolExecutor(MAX_CONCURRENT_DECODES, thread_name_prefix="decode")

    def load(self) -> None:
        model_class = MODEL_CLASSES.get(self.source.task)
        if model_class is None:
            raise StartupError(f"{self.source.task.value} is not a generation task")
        self.tokenizer = load_tokenizer(self.source, self.config)
        model = load_pretrained(model_class, self.source, self.config, self.dtype)
        self.model: PreTrainedModel = model
        self.is_encoder_decoder = bool(model.config.is_encoder_decoder)
        self.decoder_start_token_id = self._decoder_start_token_id()
        self.max_model_len = resolve_context_length(
            self.config.max_length, self.source.config, self.tokenizer
        )
        self.eos_token_ids = eos_token_ids(model, self.tokenizer)
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        logger.info(
            "loaded %s (%s on %s, context %d tokens, EOS %s)",
            type(model).__name__,
            self.dtype,
            self.device,
            self.max_model_len,
            sorted(self.eos_token_ids),
        )

    def _decoder_start_token_id(self) -> int | None:
        if not self.is_encoder_decoder:
            return None
        start = self.model.generation_config.decoder_start_token_id
        if start is None:
            start = self.model.config.decoder_start_token_id
        if not isinstance(start, int):
            raise StartupError("the model config sets no decoder_start_token_id")
        return start

    def check_request(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> None:
        """Refuse what the model cannot do (the protocol layer should have caught it)."""
        if adapter is not None:
            raise BadRequest("LoRA adapters are served by the vLLM backend only")
        if not prompt_ids:
            raise BadRequest("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {len(prompt_ids)}, leaving no room for a completion"
            )
        if params.n < 1 or (params.max_tokens is not None and params.max_tokens < 1):
            raise BadRequest("n and max_tokens must be at least 1")
        ids = {*prompt_ids, *params.logit_bias, *params.stop_token_ids}
        outside = sorted(i for i in ids if not 0 <= i < self.vocab_size)
        if outside:
            raise BadRequest(
                f"token ids outside the vocabulary (0-{self.vocab_size - 1}): {outside}"
            )

    def new_sequences(self, prompt_ids: list[int], params: SamplingParams) -> list[SequenceState]:
        """The ``params.n`` rows of a request (row i samples with seed ``params.seed + i``)."""
        budget = self.max_model_len - len(prompt_ids)
        if params.max_tokens is not None:
            budget = min(budget, params.max_tokens)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return [
            SequenceState(
                index=index,
                params=params,
                prompt_ids=prompt_ids,
                stop_ids=stop_ids,
                budget=budget,
                generator=self._generator(params, index),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                ),
            )
            for index in range(params.n)
        ]

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()  # from the OS, not from the global RNG
        else:
            generator.manual_seed((params.seed + index) % 2**64)  # torch takes 64 bits
        return generator

    def new_batch(self) -> DecodeBatch:
        """The model side of a new batch, for this model's kind."""
        if self.decoder_start_token_id is None:
            return CausalLMBatch(self.model)
        return Seq2SeqBatch(self.model, self.decoder_start_token_id)

    def decode(
        self,
        prompt_ids: list[int],
        rows: list[SequenceState],
        emit: Emit,
        cancelled: threading.Event,
    ) -> None:
        """The decode loop (in a worker thread): until every row finished or ``cancelled``.

        Emits each step's deltas, then None at the end, or the exception that stopped it.
        """
        if cancelled.is_set():  # the consumer left while this waited for a worker
            return
        try:
            with torch.inference_mode():
                batch = self.new_batch()
                logits = batch.prefill(prompt_ids, len(rows))
                while not cancelled.is_set():
                    emit(advance(rows, logits))
                    live = [i for i, row in enumerate(rows) if row.finish_reason is None]
                    if not live:
                        break
                    if len(live) < len(rows):
                        batch.keep(live)
                        rows = [rows[i] for i in live]
                    logits = batch.step([row.output_ids[-1] for row in rows])
        except Exception as exc:  # the request fails, not the worker
            emit(exc)
        else:
            if cancelled.is_set():
                generated = max(len(row.output_ids) for row in rows)
                logger.info("generation cancelled (client gone) after %d tokens", generated)
            emit(None)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Deltas of the ``params.n`` choices, step by step, from a decode loop in a worker
        thread; closing the iterator (or cancelling its consumer) stops that loop."""
        self.check_request(prompt_ids, params, adapter)
        rows = self.new_sequences(prompt_ids, params)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[ChoiceDelta] | BaseException | None] = asyncio.Queue()
        cancelled = threading.Event()

        def emit(item: list[ChoiceDelta] | BaseException | None) -> None:
            if cancelled.is_set():
                return
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone
                cancelled.set()

        loop.run_in_executor(self.executor, self.decode, prompt_ids, rows, emit, cancelled)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()  # a consumer that left (closed or cancelled) stops the loop
