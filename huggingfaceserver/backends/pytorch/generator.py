"""The transformers (PyTorch) backend for generation: causal and sequence-to-sequence LMs.

Requests are checked and turned into rows (:class:`~.sequence.SequenceState`, one
per choice) on the event loop; one :class:`~.decode_loop.ContinuousBatcher` decodes the
rows of every request in a worker thread, over the model's KV cache (:mod:`.decode_batch`);
deltas reach each request's consumer through an asyncio queue. LoRA adapters named at startup
(``--lora-modules``) or loaded at run time are loaded with PEFT and served in the same batches
(:mod:`.adapters`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ...cli import ServerConfig
from ...errors import BadRequest, StartupError
from ...generation.constraints import LazyGrammars
from ...generation.params import ChoiceDelta, SamplingParams
from ...generation.text import ChoiceText
from ...loading import ModelSource, device, load_pretrained, load_tokenizer, served_dtype
from ...model_facts import attention_shape, context_length
from ...pod import Memory, available_memory
from ...tasks import Task
from ..base import GenerationBackend, release_weights, unloaded
from ..loop_calls import LoopCalls
from ..lora import LoraModule, ServedAdapters, served_adapters
from ..tokenizing import UNSET_MAX_LENGTH
from .adapters import InvalidAdapter, LoraAdapters
from .batch_rows import decode_rows
from .decode_batch import (
    CausalLMBatch,
    DecodeBatch,
    ReservedCausalLMBatch,
    Seq2SeqBatch,
    mixes_prompts,
    takes_ready_masks,
)
from .decode_loop import ContinuousBatcher, DecodeRequest
from .kv_budget import FLAG as KV_FLAG
from .kv_budget import MIN_CONTEXT, UNBOUNDED, KvBudget, plan_kv_budget
from .kv_cache import ReservedCache
from .sequence import SequenceState
from .step_graphs import StepGraphs, cuda_graph, eager, torch_compiled
from .threads import (
    CALIBRATION_SHAPE,
    TunedLoopThreads,
    calibrate_cpu_threads,
    most_calibration_forwards,
)

logger = logging.getLogger(__name__)

CALIBRATION_ROWS = 32
"""Rows of the decode step the thread calibration times (fewer with a smaller batch limit)."""
CALIBRATION_STEPS = most_calibration_forwards()
"""Decode steps the calibration may take, each a column more of the calibration batch's cache."""

MODEL_CLASSES: dict[Task, Any] = {
    Task.text_generation: AutoModelForCausalLM,
    Task.text2text_generation: AutoModelForSeq2SeqLM,
}

# Context for relative-position models (T5) whose tokenizer sets no limit either.
RELATIVE_POSITION_CONTEXT = 512


def model_context_length(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> int:
    """The longest sequence the model takes: the context length its config declares
    (:func:`.model_facts.context_length`), or for relative-position models the tokenizer's
    ``model_max_length`` when set, else 512."""
    declared = context_length(config)
    if declared is not None:
        return declared
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


def steps_ahead(async_scheduling: bool | None, device_type: str) -> bool:
    """Whether the decode loop queues a step before the host reads the one before it (vLLM's
    asynchronous scheduling): as ``--async-scheduling`` / ``--no-async-scheduling`` say, else
    on a GPU only (a CPU runs each forward as it is queued: nothing would overlap)."""
    return device_type == "cuda" if async_scheduling is None else async_scheduling


def records_steps(
    ready_masks: bool, device_type: str, enforce_eager: bool, lora: bool, compiles: bool = False
) -> bool:
    """Whether decode steps are recorded per bucket (:class:`StepGraphs`): as CUDA graphs on a
    GPU unless ``--enforce_eager``, and on a CPU with ``--torch_compile`` (``compiles``; run
    compiled, not recorded), for a model that takes a ready mask (a reserved cache). With
    LoRA adapters a step is recorded with every adapter masked per row
    (:meth:`~.adapters.LoraAdapters.forward_masked`), on a GPU only, uncompiled."""
    if not ready_masks or enforce_eager:
        return False
    return device_type == "cuda" or (compiles and not lora)


NARROW, WIDE = 8, 40
"""Prompt tokens of :meth:`TransformersGenerator.compile_steps`' warm-up batches: KV caches of
two widths, so that the column capacity, like the rows, has changed before serving does."""


class TransformersGenerator(GenerationBackend):
    """Generate with an ``AutoModelForCausalLM`` or ``AutoModelForSeq2SeqLM``, every request's
    rows in one continuously batched decode loop (``--max_batch_size`` rows at most)."""

    name = "huggingface"

    def __init__(self, source: ModelSource, config: ServerConfig):
        self.source = source
        self.config = config
        self.device = device()
        self.dtype = served_dtype(config, source, self.device.type == "cuda")
        self.adapters: ServedAdapters = served_adapters(config)
        """LoRA adapters, each served under its own model name (loaded with the model)."""
        self.lora: LoraAdapters | None = None

    def load(self) -> None:
        model_class = MODEL_CLASSES.get(self.source.task)
        if model_class is None:
            raise StartupError(f"{self.source.task.value} is not a generation task")
        self.tokenizer = load_tokenizer(self.source, self.config)
        model = load_pretrained(model_class, self.source, self.config, self.dtype)
        self.model: PreTrainedModel = model
        if self.adapters or self.adapters.runtime:
            self.lora = LoraAdapters(model)
            for module in self.adapters.modules.values():
                try:
                    self.lora.add(module)
                except InvalidAdapter as exc:
                    raise StartupError(str(exc)) from None
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
        planned = self.plan_kv_budget(model)
        self.max_rows = self.config.max_batch_size or self.default_rows(planned)
        self.kv_budget = UNBOUNDED if self.is_encoder_decoder else planned
        """The budget the decode loop keeps to: not a seq2seq model's (its decoder's tokens
        cannot be fed again as a prompt), whose rows it sizes only."""
        self.kv_cache_tokens = self.kv_budget.tokens
        self.cache_layers = (
            0 if self.is_encoder_decoder else ReservedCausalLMBatch.cache_layers(model)
        )
        """Layers of a reserved KV cache for this model; 0: transformers' own cache."""
        self.ready_masks = bool(self.cache_layers) and takes_ready_masks(model, self.cache_layers)
        """Whether decode steps hand the model a ready 4-D attention mask."""
        if self.cache_layers and not self.ready_masks:
            logger.warning(
                "%s's decode steps do not take a ready-made attention mask: each forward "
                "builds its own (and waits for the device once), no CUDA graphs",
                type(model).__name__,
            )
        self.mixes = self.ready_masks and mixes_prompts(model, self.cache_layers)
        """Whether decode steps feed new prompts in their forward (:mod:`.ragged`)."""
        if self.mixes:
            logger.info("new prompts are fed in the running rows' decode steps")
        compiles = self.config.torch_compile
        lora = self.lora is not None
        graphed = records_steps(
            self.ready_masks, self.device.type, self.config.enforce_eager, lora, compiles
        )
        if compiles and (lora or not graphed):
            logger.warning(
                "--torch_compile: decode steps run uncompiled (%s)",
                "LoRA adapters" if lora else "no reserved KV cache for this model",
            )
        record = cuda_graph if self.device.type == "cuda" else eager
        compile = torch_compiled() if compiles and graphed and not lora else None
        if compile is not None and self.device.type == "cpu":
            logger.warning(
                "--torch_compile on a CPU: the compiled decode step runs over the whole KV "
                "cache buffers, slower than the default steps with many rows (BENCHMARKS.md: "
                "45% at 16 streams); it is meant for a GPU's CUDA graphs"
            )
        self.graphs = StepGraphs(self.max_rows, record, compile) if graphed else None
        """Decode steps replayed as CUDA graphs (on a GPU, for a reserved cache), compiled
        first with ``--torch_compile`` (on a CPU too; not with LoRA adapters)."""
        self.batcher = ContinuousBatcher(
            self.new_batch,
            self.max_rows,
            self.config.model_name,
            self.config.prefill_chunk_tokens,
            self.retire_batch,
            self.settle_batch,
            step_ahead=steps_ahead(self.config.async_scheduling, self.device.type),
            kv_budget=self.kv_budget,
        )
        self.idle_cache: ReservedCache | None = None
        """The KV cache of the last batch whose rows all ended, kept for the next batch that
        runs while the recorded decode steps write into it (:meth:`retire_batch`,
        :meth:`settle_batch`)."""
        self.grammars = LazyGrammars.for_tokenizer(
            self.tokenizer, self.vocab_size, self.eos_token_ids
        )

    def plan_kv_budget(self, model: PreTrainedModel) -> KvBudget:
        """The KV cache budget of the rows decoded together (:mod:`.kv_budget`), logged; where
        one sequence at the full context does not fit in it, the context is lowered to what
        fits (``--max_model_len`` asked for more: a startup error); a seq2seq model's only
        sizes its rows."""
        shape = attention_shape(model.config.get_text_config())
        per_token = shape.kv_bytes_per_token(self.dtype.itemsize) if shape else None
        if self.device.type == "cuda":
            free = Memory(torch.cuda.mem_get_info(self.device)[0], str(self.device))
        else:
            free = available_memory()
        budget = plan_kv_budget(per_token, self.config.kv_cache_memory_bytes, free)
        if self.is_encoder_decoder:
            logger.info("%s; a seq2seq model's is not kept to, it sizes the rows", budget.reason)
            return budget
        logger.info("%s", budget.reason)
        fits = budget.tokens
        if fits is not None and fits < self.max_model_len:
            if self.config.max_length is not None or fits < MIN_CONTEXT:
                raise StartupError(
                    f"one sequence of {self.max_model_len} tokens does not fit: {budget.reason}; "
                    f"free memory, give --{KV_FLAG} more or serve a shorter --max_model_len "
                    f"(at most {fits})"
                )
            logger.warning(
                "serving a context of %d tokens, not the model's %d: one sequence at the full "
                "context does not fit in the KV cache budget (--%s or free memory raise it)",
                fits,
                self.max_model_len,
                KV_FLAG,
            )
            self.max_model_len = fits
        return budget

    def default_rows(self, budget: KvBudget) -> int:
        """Rows decoded together without ``--max_batch_size`` (:mod:`.batch_rows`): on a GPU,
        as many as the KV cache ``budget`` holds at full context, logged."""
        rows = decode_rows(self.device.type, budget.tokens, self.max_model_len)
        if self.device.type == "cuda":
            logger.info(
                "decoding up to %d rows together (%s sequences of %d tokens fit in the KV "
                "cache budget; --max_batch_size sets it)",
                rows,
                "unknown" if budget.tokens is None else budget.tokens // self.max_model_len,
                self.max_model_len,
            )
        return rows

    def tune(self) -> None:
        """On CPU, torch's intra-op threads only where they make the loop's forward passes
        faster (as for encoders: on a small model or a busy CPU their spin-waits made each
        decode step 10 to 45 times slower), decided on the decode thread, which runs every
        forward pass. A decoder-only model is timed on what the loop runs most: a decode step
        of a full batch (:data:`CALIBRATION_ROWS` rows at most) over a prompt's cache; a
        prefill-shaped forward, which threads speed up far more, kept 2 threads for a model
        whose decode steps they did not speed up at all. That is where the loop starts; while
        it serves, its decode steps (by rows) and prefills (by prompt tokens) are timed on both
        counts again now and then (:class:`TunedLoopThreads`).

        With ``--torch_compile`` the decode steps are compiled after (:meth:`compile_steps`),
        and on CPU the threads stay as the calibration left them: a step is compiled for one
        thread count, and another one compiles it again."""
        compiles = self.graphs is not None and self.graphs.compile is not None
        if self.device.type == "cpu":
            decision = self.batcher.run_on_loop(
                lambda: calibrate_cpu_threads(self._calibration_forward())
            )
            logger.info("intra-op threads: %s", decision)
            if decision.tuned and compiles:
                self.batcher.run_on_loop(partial(torch.set_num_threads, decision.threads))
            elif decision.tuned:
                self.batcher.threads = TunedLoopThreads(decision)
        if compiles:
            self.batcher.run_on_loop(self.compile_steps)

    def compile_steps(self) -> None:
        """Compile the decode steps before serving (on the decode thread), so that the
        compiles a new shape costs are paid here, not by the first requests. A size compiled
        once is specialised; its first change makes it symbolic; a size of one is a case apart
        (torch's rules; the buffers are never one row deep: :attr:`StepGraphs.least_rows`).
        So: a batch of the largest bucket's rows over a narrow cache steps in that bucket and
        the next one down; a batch of the next bucket's rows over a wider cache steps in that
        bucket and in one row (rows dropped between steps). The batches are dropped; the
        graphs recorded over their caches are recorded again over the first batch that
        serves."""
        graphs = self.graphs
        assert graphs is not None
        largest = graphs.sizes[-1]
        below = graphs.sizes[-2] if len(graphs.sizes) > 1 else largest
        plan = ((NARROW, (largest, below)), (WIDE, (below, 1)))
        started = time.perf_counter()
        for tokens, steps in plan:
            batch = self.new_batch()
            with torch.inference_mode():
                batch.prefill([0] * min(tokens, self.max_model_len - 1), steps[0])
                for rows in dict.fromkeys(steps):
                    batch.keep(list(range(rows)))
                    batch.step(torch.zeros(rows, dtype=torch.long, device=self.device))
        logger.info(
            "decode steps compiled in %.1f s%s",
            time.perf_counter() - started,
            f" (failed: {graphs.uncompiled}; they run uncompiled)" if graphs.uncompiled else "",
        )

    def _calibration_forward(self) -> Callable[[], object]:
        """The forward pass the thread calibration times (made on the decode thread)."""
        rows, tokens = CALIBRATION_SHAPE
        tokens = min(tokens, self.max_model_len - CALIBRATION_STEPS)
        ids = torch.randint(0, self.vocab_size, (rows, tokens), generator=torch.Generator())
        if self.is_encoder_decoder:
            inputs = {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "decoder_input_ids": torch.full((rows, 1), self.decoder_start_token_id or 0),
            }

            def forward() -> None:
                with torch.inference_mode():
                    self.model(**inputs)

            return forward
        decode_rows = min(self.max_rows, CALIBRATION_ROWS)
        batch = self.new_batch()
        with torch.inference_mode():
            batch.prefill(ids[0].tolist(), decode_rows)
        step = torch.zeros(decode_rows, dtype=torch.long, device=self.device)

        def decode_step() -> None:
            with torch.inference_mode():
                batch.step(step, graphed=False)  # not compiled on every thread count

        return decode_step

    def _decoder_start_token_id(self) -> int | None:
        if not self.is_encoder_decoder:
            return None
        start = self.model.generation_config.decoder_start_token_id
        if start is None:
            start = self.model.config.decoder_start_token_id
        if not isinstance(start, int):
            raise StartupError("the model config sets no decoder_start_token_id")
        return start

    def new_sequences(
        self, prompt_ids: list[int], params: SamplingParams, with_text: bool = True
    ) -> list[SequenceState]:
        """The ``params.n`` rows of a request (row i samples with seed ``params.seed + i``);
        ``with_text=False``: rows that yield token ids only (a front process makes the text)."""
        budget = params.answer_tokens(len(prompt_ids), self.max_model_len)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        constraint = params.constraint
        return [
            SequenceState(
                index=index,
                params=params,
                prompt_ids=prompt_ids,
                stop_ids=stop_ids,
                budget=budget,
                generator=self._generator(params, index),
                text=ChoiceText.for_params(self.tokenizer, params) if with_text else None,
                matcher=self.grammars.get().matcher(constraint) if constraint else None,
            )
            for index in range(params.n)
        ]

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """A seeded row's own generator; None for the others (unseeded rows draw from the
        process's sampling generator, never torch's global RNG)."""
        if params.greedy or params.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed((params.seed + index) % 2**64)  # torch takes 64 bits
        return generator

    def new_batch(self) -> DecodeBatch:
        """The model side of a new batch, for this model's kind."""
        if self.decoder_start_token_id is None:
            if self.cache_layers:
                cache = ReservedCache(
                    self.cache_layers, self.max_rows, self.device, self.kv_budget.tokens
                )
                return ReservedCausalLMBatch(
                    self.model, cache, self.graphs, self.ready_masks, self.lora, self.mixes
                )
            return CausalLMBatch(self.model, self.lora)
        return Seq2SeqBatch(self.model, self.decoder_start_token_id)

    def retire_batch(self, batch: DecodeBatch) -> None:
        """A batch whose rows have all ended: where decode steps are recorded as graphs over
        its KV cache, that cache is kept (:attr:`idle_cache`) for the next batch that runs
        (:meth:`settle_batch`), so that a wave of requests after an idle spell replays the
        graphs recorded before it instead of recording them again over new buffers. It costs
        no memory: the graphs hold the cache whose buffers they write until they are recorded
        over another one. Elsewhere (on a CPU) nothing is recorded and the cache goes with
        its batch."""
        if (
            self.graphs is not None
            and isinstance(batch, ReservedCausalLMBatch)
            and self.graphs.records_over(batch.cache)
        ):
            self.idle_cache = batch.cache

    def settle_batch(self, batch: DecodeBatch) -> None:
        """A batch whose rows now run on their own (no running batch took them): its rows move
        into the kept cache (:attr:`idle_cache`), if any, whose buffers the recorded steps
        write. Only the batch that runs takes it: a batch whose rows join another's (a prompt
        fed in parts, another admitted beside it) would leave it behind."""
        cache, self.idle_cache = self.idle_cache, None
        if (
            cache is not None
            and self.graphs is not None
            and self.graphs.records_over(cache)  # not since recorded over another batch's
            and isinstance(batch, ReservedCausalLMBatch)
        ):
            batch.move_to(cache)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Deltas of the ``params.n`` choices, step by step, from the shared decode loop;
        closing the iterator (or cancelling its consumer) takes the rows out of that loop."""
        if params.constraint is None:
            self.check_request(prompt_ids, params, adapter)
            rows = self.new_sequences(prompt_ids, params)
        else:  # a grammar is compiled and checked: not on the event loop
            await asyncio.to_thread(self.check_request, prompt_ids, params, adapter)
            rows = await asyncio.to_thread(self.new_sequences, prompt_ids, params)
        loop = asyncio.get_running_loop()
        calls = LoopCalls.of(loop)
        queue: asyncio.Queue[list[ChoiceDelta] | BaseException | None] = asyncio.Queue()

        def emit(item: list[ChoiceDelta] | BaseException | None) -> None:
            if request.cancelled.is_set():
                return
            if loop.is_closed():  # nobody will read it
                request.cancelled.set()
                return
            calls.call(queue.put_nowait, item)

        request = DecodeRequest(rows, emit, adapter)
        with self.adapters.use(adapter):  # not unloaded while in use
            self.batcher.submit(request)
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                request.cancelled.set()  # a consumer that left (closed or cancelled) stops it
                self.batcher.withdraw(request)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter at run time (on the decode thread, between two steps), served
        under ``name`` from then on: 404 unless ``--enable_runtime_lora``, 400 for a path
        outside ``--lora_adapter_dir``, a name in use or an adapter that does not fit."""
        module = self.adapters.begin_load(name, path)
        loaded = False
        try:
            await asyncio.to_thread(self.batcher.run_on_loop, partial(self._add, module))
            loaded = True
        finally:
            self.adapters.end_load(module, loaded)

    def _add(self, module: LoraModule) -> None:
        assert self.lora is not None  # made at load with --enable_runtime_lora
        try:
            self.lora.add(module)
        except InvalidAdapter as exc:
            raise BadRequest(str(exc)) from None
        if self.graphs is not None:
            self.graphs.forget()

    def _remove(self, name: str) -> None:
        assert self.lora is not None
        self.lora.remove(name)
        if self.graphs is not None:
            self.graphs.forget()

    async def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter loaded at startup or at run time, and take it out of the
        model: 404 for an unknown name, 409 while requests use it."""
        self.adapters.begin_unload(name)
        assert self.lora is not None
        await asyncio.to_thread(self.batcher.run_on_loop, partial(self._remove, name))

    def shutdown(self) -> None:
        """Stop serving for good (an unload, or the server stopping), when the model was
        loaded: requests waiting or decoding end with a 503, the decode loop's thread ends, and
        the weights are let go (the tokenizer stays: a request under way may still read it)."""
        batcher = getattr(self, "batcher", None)
        if batcher is None:
            return
        if batcher.close(unloaded(self.config.model_name)):
            release_weights(self)
        else:
            logger.warning("the decode loop did not stop in time: the weights stay loaded")
