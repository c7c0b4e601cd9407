"""What the benchmark measures: the workloads, their routes, server modes and run lengths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from . import routes, texts

if TYPE_CHECKING:
    from .models import BenchModels

MAX_TOKENS = 64


class Kind(Enum):
    ENCODER = "encoder"
    GENERATION = "generation"


@dataclass(frozen=True)
class Route:
    """A served route and how to call it: ``make_call(base_url, model_name)``."""

    label: str
    make_call: Callable[[str, str], routes.Call]
    judged: bool = True
    """Whether the workload's share-of-raw target applies (else reported only)."""


@dataclass(frozen=True)
class Mode:
    """A server configuration: its label and the flags that make it."""

    label: str
    args: tuple[str, ...] = ()


BATCHING = Mode("batching")
BATCHING_OFF = Mode("batching off", ("--max_batch_size", "1"))
BATCHING_TWO_FRONTS = Mode("batching, --api_workers 2", ("--api_workers", "2"))
"""Generation with its decode loop in an engine process, two front processes making the text."""


@dataclass(frozen=True)
class Workload:
    """One model, how it is served and called, at which concurrencies."""

    key: str
    title: str
    kind: Kind
    model_name: str
    model_dir: Callable[[BenchModels], Path]
    task: str
    server_args: tuple[str, ...]
    routes: tuple[Route, ...]
    concurrency: tuple[int, int]
    """(1, the loaded level)."""
    modes: tuple[Mode, ...] = (BATCHING, BATCHING_OFF)

    @property
    def loaded(self) -> int:
        return self.concurrency[-1]


@dataclass(frozen=True)
class Settings:
    """How long and how often: the defaults are the full run, :data:`QUICK` a smoke run."""

    repeats: int = 3
    duration_s: float = 10.0
    """Encoder runs: seconds per loaded run."""
    warmup_s: float = 2.0
    """Encoder runs: seconds of load at the loaded level before measuring, per route."""
    raw_texts: int = 144
    """Encoder raw: texts per batch size (the sentences, repeated)."""
    raw_batch_sizes: tuple[int, ...] = (1, 8, 16, 32, 64)
    generation_rounds: int = 3
    """Generation runs: requests per worker..."""
    generation_min_requests: int = 16
    """...and at least this many requests per run (for concurrency 1)."""
    long_output_rounds: int = 2
    """Long-output runs: rounds, each making every run under both layouts (about 4.5 minutes
    a round on 2 cores; its own count: a third round would take the suite past 10 minutes)."""
    long_output_tokens: tuple[int, int] = (12_000, 4_000)
    """Long-output runs: ``max_tokens`` of the long stream alone and of the 8 long streams."""
    soak_s: float = 600.0
    """Soak: seconds of mixed load."""
    server_args: tuple[str, ...] = field(default_factory=tuple)
    """Extra flags for every server (e.g. ``--disable_log_requests``)."""

    def generation_requests(self, concurrency: int) -> int:
        """Requests per worker in a generation run."""
        return max(self.generation_rounds, -(-self.generation_min_requests // concurrency))


QUICK = Settings(
    repeats=1,
    duration_s=3.0,
    warmup_s=1.0,
    raw_texts=72,
    generation_rounds=1,
    generation_min_requests=4,
    long_output_rounds=1,
    long_output_tokens=(1_000, 500),
    soak_s=60.0,
)

V1 = Route("V1 :predict", lambda url, name: routes.v1_predict(url, name, texts.SENTENCES))
EMBEDDINGS = Route(
    "OpenAI embeddings", lambda url, name: routes.openai_embeddings(url, name, texts.SENTENCES)
)
COMPLETIONS = Route(
    "OpenAI completions (stream)",
    lambda url, name: routes.openai_completion_stream(url, name, texts.prompts(), MAX_TOKENS),
)

STAGGERED_TOKENS = tuple(range(16, 8 * 16, 16))
"""``max_tokens`` of a run's requests in turn (16 to 112, 64 on average): streams end at
different steps, so that requests arrive while others decode (their prompts join decode steps)."""
COMPLETIONS_STAGGERED = Route(
    f"OpenAI completions (stream), {STAGGERED_TOKENS[0]}-{STAGGERED_TOKENS[-1]} tokens",
    lambda url, name: routes.openai_completion_stream(url, name, texts.prompts(), STAGGERED_TOKENS),
    judged=False,  # a run's last, longest streams decode with few rows beside them
)

WORKLOADS = (
    Workload(
        key="classifier",
        title="Sequence classification: BERT with all-MiniLM-L6-v2's dimensions, random weights",
        kind=Kind.ENCODER,
        model_name="classifier",
        model_dir=lambda models: models.classifier,
        task="sequence_classification",
        server_args=(),  # the task is inferred from BertForSequenceClassification
        routes=(V1,),
        concurrency=(1, 32),
    ),
    Workload(
        key="minilm",
        title="Sentence embeddings: all-MiniLM-L6-v2",
        kind=Kind.ENCODER,
        model_name="minilm",
        model_dir=lambda models: models.minilm,
        task="text_embedding",
        server_args=("--task", "text_embedding"),
        routes=(V1, EMBEDDINGS),
        concurrency=(1, 32),
    ),
    Workload(
        key="llama",
        title=(
            f"Generation: Llama (hidden 512, 4 layers, random weights, EOS unreachable), "
            f"max_tokens={MAX_TOKENS}"
        ),
        kind=Kind.GENERATION,
        model_name="llama",
        model_dir=lambda models: models.llama,
        task="text_generation",
        server_args=("--backend", "huggingface"),
        routes=(COMPLETIONS, COMPLETIONS_STAGGERED),
        concurrency=(1, 16),
        modes=(BATCHING, BATCHING_TWO_FRONTS, BATCHING_OFF),
    ),
)
