"""What every backend that tokenizes with the model's own tokenizer shares."""

from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from transformers import BatchEncoding, PreTrainedTokenizerBase

from ..cli import DEFAULT_MAX_BATCH_SIZE, ServerConfig
from ..devices import to_device
from ..encoder_tasks import EncoderOptions, EncoderTask, encoder_task_class
from ..encoder_tasks.params import DEFAULT_PARAMS, EncodeParams, Output
from ..encoder_tasks.sparse import VOCABULARY_LOGITS_BYTES, SparseEmbedding
from ..errors import BadRequest, StartupError
from ..loading import ModelSource, load_tokenizer
from ..model_facts import context_length
from ..sentence.config import pooling_modes
from ..sentence.prompts import Prompts
from ..sentence.tokenizer import lower_case_texts
from ..tasks import Task
from ..units import MiB
from .base import EncoderBackend, EncoderInputs, ModelInfo, release_weights, unloaded
from .batching import BatchLimits, EncoderBatcher
from .row_tokenizer import Row, RowTokenizer
from .truncation import Truncation, asked_truncation

if TYPE_CHECKING:  # the model runs where torch is (a front process has neither)
    import torch
    from transformers import PretrainedConfig

T = TypeVar("T")

logger = logging.getLogger(__name__)

INLINE_TEXT_CHARS = 2048
"""Requests with at most this many characters of text are tokenized on the event loop."""
INLINE_TOKEN_IDS = 2048
"""...and token-id requests with at most this many ids are checked there."""

# tokenizer.model_max_length is this large when the tokenizer sets no limit
UNSET_MAX_LENGTH = 1_000_000


@dataclass(frozen=True)
class EncoderFacts:
    """What tokenizing and shaping results need of the model's config (a front process, which
    never reads the config, has them from the engine)."""

    context_length: int | None
    """The longest input the config declares (:attr:`.ModelSource.facts`); None: none."""
    num_labels: int
    labels: dict[int, str] = field(default_factory=dict)
    """The config's ``id2label``."""
    vocab_size: int | None = None
    dtype: str = "float32"
    """What the model runs in (torch's dtype name, or the runtime's precision)."""

    @classmethod
    def of(cls, source: ModelSource) -> EncoderFacts:
        config = source.config
        vocab = getattr(config, "vocab_size", None)
        return cls(
            source.facts.context_length,
            int(config.num_labels or 0),
            {int(index): str(label) for index, label in (config.id2label or {}).items()},
            int(vocab) if isinstance(vocab, int) else None,
        )


def resolve_max_length(
    requested: int | None,
    tokenizer: PreTrainedTokenizerBase,
    config: PretrainedConfig | EncoderFacts,
    declared: int | None = None,
) -> int:
    """``--max_length`` checked against what the model can take, or by default the length the
    model was trained with: sentence-transformers' ``max_seq_length`` where its layout keeps
    one (``declared``), else the tokenizer's, within the model's positions (the context length
    its config declares: ``config``'s, or the one in the engine's facts)."""
    positions = (
        config.context_length if isinstance(config, EncoderFacts) else context_length(config)
    )
    tokenizer_max = tokenizer.model_max_length
    tokenizer_limit = tokenizer_max if tokenizer_max < UNSET_MAX_LENGTH else None
    default_limits = [positions, declared or tokenizer_limit]
    known = [int(limit) for limit in default_limits if limit]
    default = min(known) if known else None
    ceiling = [positions, max(filter(None, (declared, tokenizer_limit)), default=None)]
    known = [int(limit) for limit in ceiling if limit]
    model_limit = min(known) if known else None
    if requested is None:
        if default is None:
            raise StartupError("the model declares no maximum length; pass --max_length")
        return default
    if model_limit is not None and requested > model_limit:
        raise StartupError(
            f"--max_length {requested} exceeds the model's maximum of {model_limit} tokens"
        )
    return requested


def token_inputs(
    inputs: EncoderInputs, truncation: Truncation | None, vocab: int, max_length: int
) -> list[list[int]]:
    """Token id inputs (used as they are: no special tokens added), cut as the request's own
    truncation cuts its texts where it asks for one (``right`` keeps the start), then
    checked."""
    ids: list[list[int]] = [list(i) for i in inputs]  # type: ignore[arg-type]
    if truncation is not None and truncation.enabled:
        keep = truncation.limit
        ids = [i[:keep] if truncation.side == "right" else i[-keep:] for i in ids]
    check_token_inputs(ids, vocab, max_length)
    return ids


def check_rows_have_tokens(rows: Sequence[Row]) -> None:
    """A 400 for a text that tokenizes to nothing (an empty text, where the model adds no
    special tokens of its own): its row would have no position to pool or classify."""
    for index, row in enumerate(rows):
        if not len(row["input_ids"]):
            raise BadRequest(f"input {index} has no tokens: an empty text, and the model adds none")


def check_token_inputs(inputs: list[list[int]], vocab: int, max_length: int) -> None:
    """Token id inputs (used as they are) must be non-empty, fit, and be in the vocabulary."""
    for index, ids in enumerate(inputs):
        if not ids:
            raise BadRequest(f"input {index} has no tokens")
        if len(ids) > max_length:
            raise BadRequest(f"input {index} has {len(ids)} tokens; the maximum is {max_length}")
        if not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise BadRequest(f"input {index} has token ids outside the vocabulary (0..{vocab - 1})")


class SentenceSettings(NamedTuple):
    """What a folder's sentence-transformers configuration sets for a backend that tokenizes."""

    max_length: int
    """``--max_length``, else sentence-transformers' ``max_seq_length``, else the tokenizer's."""
    prompts: Prompts
    similarity: str

    @classmethod
    def adopt(
        cls,
        source: ModelSource,
        config: ServerConfig,
        tokenizer: PreTrainedTokenizerBase,
        limits: PretrainedConfig | EncoderFacts,
    ) -> SentenceSettings:
        """The settings, ``tokenizer`` made to lower-case texts where sentence-transformers
        does (``do_lower_case``, unless ``--disable_lower_case``)."""
        sentence = source.sentence
        if sentence is not None and sentence.do_lower_case and not config.disable_lower_case:
            lower_case_texts(tokenizer)  # as sentence-transformers 6 does
        declared = sentence.max_seq_length if sentence is not None else None
        return cls(
            resolve_max_length(config.max_length, tokenizer, limits, declared),
            Prompts.of(sentence, config.default_prompt_name, config.default_prompt),
            sentence.similarity if sentence is not None else "cosine",
        )


def results_by_kind(
    task: EncoderTask, raw: torch.Tensor, batch: BatchEncoding, kinds: list[str]
) -> list[Any]:
    """A result per row of a merged batch, of the kind (an :class:`Output`) its request asked
    for: rows of one kind are shaped together, their part of the batch taken on the host and
    their part of the output where it is."""
    if all(kind == kinds[0] for kind in kinds):
        return task.results_for(Output(kinds[0]), raw, batch)
    import torch

    out: list[Any] = [None] * len(kinds)
    for kind in set(kinds):
        index = [i for i, k in enumerate(kinds) if k == kind]
        sub = BatchEncoding({key: value[index] for key, value in batch.items()})
        rows = to_device(torch.tensor(index), raw.device)
        part = task.results_for(Output(kind), raw.index_select(0, rows), sub)
        for i, result in zip(index, part, strict=True):
            out[i] = result
    return out


class TokenizingEncoder(EncoderBackend):
    """Loads the tokenizer and the task; turns inputs into checked rows for the batcher."""

    def __init__(self, source: ModelSource, config: ServerConfig):
        self.source = source
        self.config = config
        self.task_class = encoder_task_class(source.task)
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def load(self) -> None:
        tokenizer = self.load_tokenizer()
        facts = self.facts = self.model_facts()
        tokenizer.padding_side = "right"  # pooling and per-token trimming assume it
        if tokenizer.pad_token is None:
            raise StartupError(
                "the tokenizer has no padding token, needed to encode several texts at once"
            )
        sentence = self.source.sentence
        settings = SentenceSettings.adopt(self.source, self.config, tokenizer, facts)
        self.max_length, self.prompts, self.similarity = settings
        self.tokenizer = tokenizer
        self.task: EncoderTask = self.task_class(
            tokenizer, self.source, EncoderOptions.from_config(self.config), facts.labels
        )
        if self.task.needs_offsets and not tokenizer.is_fast:
            raise StartupError("--return_offsets_mapping needs a fast (Rust) tokenizer")
        self.inputs = RowTokenizer(
            tokenizer,
            self.max_length,
            add_special_tokens=not self.config.disable_special_tokens,
            token_type_ids=self.config.return_token_type_ids,
            offsets=self.task.needs_offsets,
            truncate=not self.config.no_truncation,
            pooling_mask=sentence is not None and sentence.excludes_prompt,
        )
        self.load_model()
        self.load_head()
        pad_values = {
            "input_ids": tokenizer.pad_token_id,
            "token_type_ids": tokenizer.pad_token_type_id,
        }
        limits = BatchLimits(
            self.batch_tokens(),
            self.config.max_batch_size or self.default_max_batch_size(),
            self.config.batch_wait_ms / 1000,
        )
        self.batcher = EncoderBatcher(self.run_rows, pad_values, limits, self.config.model_name)
        logger.info(
            "batches of up to %d rows and %d padded tokens (--max_batch_size, --max_batch_tokens)",
            limits.max_batch_size,
            limits.max_batch_tokens,
        )

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.source, self.config)

    def model_facts(self) -> EncoderFacts:
        """What the tokenizing side needs of the model's config."""
        return EncoderFacts.of(self.source)

    def load_model(self) -> None:
        """Whatever the backend needs beyond the tokenizer (weights, a client)."""

    def load_head(self) -> None:
        """What makes results of the model's outputs, where they are: on
        :meth:`results_device`."""
        self.task.load_head(self.results_device())

    def results_device(self) -> str:
        """Where the model's outputs are, and their results are made (here: on the CPU)."""
        return "cpu"

    def batch_tokens(self) -> int:
        """Padded tokens per forward pass: ``--max_batch_tokens``, within what a sparse
        model's vocabulary-sized logits allow."""
        limit = self.config.max_batch_tokens
        if isinstance(self.task, SparseEmbedding) and self.facts.vocab_size:
            cap = self.task.max_batch_tokens(self.facts.vocab_size)
            if cap < limit:
                logger.info(
                    "batches of at most %d padded tokens: their logits over the %d-term "
                    "vocabulary stay within %d MiB",
                    cap,
                    self.facts.vocab_size,
                    VOCABULARY_LOGITS_BYTES // MiB,
                )
                return cap
        return limit

    def shutdown(self) -> None:
        """Stop serving for good (an unload, or the server stopping): requests not yet run
        end with a 503 (:func:`.base.unloaded`), as do later ones; the batching and tokenizing
        threads end; then the weights are let go (the tokenizer and the task stay: a request
        under way may still read them)."""
        batcher: EncoderBatcher | None = getattr(self, "batcher", None)
        stopped = batcher is not None and batcher.close(unloaded(self.config.model_name))
        self.tokenizing.shutdown(wait=True)  # what it tokenizes now is then refused
        if stopped:
            self.release_model()
        elif batcher is not None:
            logger.warning("the batcher did not stop in time: the weights stay loaded")

    def release_model(self) -> None:
        """Let go of what runs the model, once the batcher's thread has ended."""
        release_weights(self)

    def default_max_batch_size(self) -> int:
        """Rows per forward pass without ``--max_batch_size``, once the model is loaded."""
        return DEFAULT_MAX_BATCH_SIZE

    def info(self) -> ModelInfo:
        limits = self.batcher.limits
        return ModelInfo(
            self.config.model_id or self.config.model_dir,
            self.facts.dtype,
            self.max_length,
            limits.max_batch_tokens,
            limits.max_batch_size,
            self.config.max_concurrent_requests,
            not self.config.no_truncation,
            pooling_modes(self.source.sentence) if self.task.task is Task.text_embedding else (),
        )

    # what a request asks of its inputs

    def truncation(self, params: EncodeParams) -> Truncation | None:
        """The truncation a request asks for (None: the server's own)."""
        return asked_truncation(params, self.inputs.default, self.inputs.text_specials)

    def prompt(self, params: EncodeParams, inputs: EncoderInputs) -> str:
        """The prompt a request's texts get ("" for none)."""
        if inputs and not isinstance(inputs[0], str):
            if params.asks_prompt:
                raise BadRequest("a prompt applies to texts; token ids are used as they are")
            return ""
        return self.prompts.text(params)

    # requests

    async def infer_counted(
        self,
        inputs: EncoderInputs,
        params: EncodeParams = DEFAULT_PARAMS,
        output: Output = Output.task,
    ) -> tuple[list[Any], list[int]]:
        """Checked and tokenized alone, then run in batches shared with other requests."""
        self.task.check_output(output)
        truncation = self.truncation(params)
        prompt = self.prompt(params, inputs)
        with self.preparing():
            if truncation is None and self.tokenizes_inline(inputs, len(prompt)):
                counts, rows = self.prepare_rows(inputs, None, prompt)
            else:
                counts, rows = await self.off_loop(self.prepare_rows, inputs, truncation, prompt)
            results = self.submit_rows(rows, output.value)
        return await results, counts

    def tokenizes_inline(self, inputs: EncoderInputs, prompt_chars: int = 0) -> bool:
        """Whether a request is small enough to tokenize right on the event loop: with the Rust
        tokenizer, a sentence takes some 20 microseconds, less than the hop to a thread and
        back (a thread switch each way, and the GIL handed over twice). Anything larger goes
        to the tokenizing thread, so the loop never waits on a long text (nor does a request
        that truncates otherwise than the server: its first makes a tokenizer copy)."""
        if self.inputs.rust is None:
            return False
        if inputs and isinstance(inputs[0], str):
            chars = sum(len(text) + prompt_chars for text in inputs)  # type: ignore[misc]
            return chars <= INLINE_TEXT_CHARS
        return sum(len(ids) for ids in inputs) <= INLINE_TOKEN_IDS

    async def infer_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        params: EncodeParams = DEFAULT_PARAMS,
        output: Output = Output.task,
    ) -> tuple[list[Any], list[int]]:
        """Text pairs through a sequence classifier (a cross-encoder)."""
        if self.task.task is not Task.sequence_classification:
            raise BadRequest(
                f"text pairs are read by sequence classifiers; this is a {self.task.task.value} "
                "model"
            )
        return await self.run_pairs(pairs, params, output, one_query=False)

    async def score_pairs(
        self,
        query: str,
        documents: Sequence[str],
        params: EncodeParams = DEFAULT_PARAMS,
        raw: bool = False,
    ) -> tuple[list[float], int]:
        """A cross-encoder's relevance of each document to the query (its activation applied,
        or its logit with ``raw``)."""
        if self.task.task is not Task.sequence_classification or self.facts.num_labels != 1:
            raise BadRequest("relevance scores need a cross-encoder (one-label classifier)")
        pairs = [(query, document) for document in documents]
        output = Output.logits if raw else Output.scores
        scores, counts = await self.run_pairs(pairs, params, output, one_query=True)
        return [score[0] if raw else score for score in scores], sum(counts)

    async def run_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        params: EncodeParams,
        output: Output,
        one_query: bool,
    ) -> tuple[list[Any], list[int]]:
        """Pairs tokenized off the loop, then run in batches shared with every other request
        (``one_query``: one first text, named "the query" in refusals)."""
        self.task.check_output(output)
        if params.asks_prompt:
            raise BadRequest("prompts apply to single texts, not to pairs")
        truncation = self.truncation(params)
        with self.preparing():
            counts, rows = await self.off_loop(self.prepare_pair_rows, pairs, truncation, one_query)
            results = self.submit_rows(rows, output.value)
        return await results, counts

    def preparing(self) -> AbstractContextManager[None]:
        """Around a request's preparation and submission: a batch about to run may wait
        (``--batch_wait_ms``) for the requests still being tokenized."""
        return self.batcher.expect()

    def submit_rows(self, rows: list[Row], kind: str) -> Awaitable[list[Any]]:
        """Queue a request's rows for the batcher: a result per row, of ``kind`` (an
        :class:`Output`'s value)."""
        return self.batcher.put(rows, kind)

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the tokenizing thread. One thread, not a pool: tokenization
        is mostly Python under the GIL, so more threads would add little but contention with
        the event loop and the batcher's thread."""
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self.tokenizing, partial(function, *args))
        except RuntimeError:  # the executor is shut down: the backend is
            raise unloaded(self.config.model_name) from None
        return await future

    def prepare_rows(
        self, inputs: EncoderInputs, truncation: Truncation | None = None, prompt: str = ""
    ) -> tuple[list[int], list[Row]]:
        """A request's inputs checked and tokenized (blocking: on the event loop only for small
        requests, see :meth:`tokenizes_inline`): each one's token count, and its row."""
        if inputs and not isinstance(inputs[0], str):
            ids = token_inputs(inputs, truncation, len(self.tokenizer), self.max_length)
            rows = self.inputs.token_ids(ids)
        else:
            for index, text in enumerate(inputs):
                self.task.check_text(index, text)  # type: ignore[arg-type]
            texts: Sequence[str] = inputs  # type: ignore[assignment]
            if prompt:
                texts = [prompt + text for text in texts]
            length = self.inputs.prompt_length(prompt) if self.inputs.pooling_mask else 0
            rows = self.inputs.texts(texts, truncation, length)
            check_rows_have_tokens(rows)
        self.task.check_rows(rows)
        return [len(row["input_ids"]) for row in rows], rows

    def prepare_pair_rows(
        self,
        pairs: Sequence[tuple[str, str]],
        truncation: Truncation | None = None,
        one_query: bool = False,
    ) -> tuple[list[int], list[Row]]:
        """Text pairs for a cross-encoder, truncated to the maximum length."""
        rows = self.inputs.pairs_of(pairs, truncation, one_query)
        check_rows_have_tokens(rows)
        return [len(row["input_ids"]) for row in rows], rows

    def run_rows(self, batch: BatchEncoding, kinds: list[str]) -> list[Any]:
        """One merged batch through the model, a result per row of its kind (on the
        batcher's thread)."""
        return results_by_kind(self.task, self.forward_batch(batch), batch, kinds)

    @abstractmethod
    def forward_batch(self, batch: BatchEncoding) -> torch.Tensor:
        """The model's raw output (logits, or the last hidden state) for a merged batch, on
        the batcher's thread."""
