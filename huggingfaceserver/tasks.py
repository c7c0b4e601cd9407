"""What a model does: the task names, and the architecture -> task table."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from .errors import StartupError


class Task(str, Enum):
    """Tasks in a stable order: the order error messages list them in."""

    text_generation = "text_generation"
    text2text_generation = "text2text_generation"
    fill_mask = "fill_mask"
    token_classification = "token_classification"
    sequence_classification = "sequence_classification"
    text_embedding = "text_embedding"

    @property
    def is_generative(self) -> bool:
        return self in (Task.text_generation, Task.text2text_generation)

    @classmethod
    def parse(cls, value: str) -> Task:
        """The task for a ``--task`` value; dashes and underscores are alike."""
        try:
            return cls(value.strip().lower().replace("-", "_"))
        except ValueError:
            raise StartupError(
                f"unknown task {value!r}; supported tasks: {supported_tasks()}"
            ) from None


def supported_tasks() -> str:
    return ", ".join(t.value for t in Task)


# Suffix -> task, tried in order; the bare "Model" suffix (BertModel, ...) is an encoder body,
# so the longer "...Model" suffixes come before it.
ARCHITECTURE_SUFFIX_TASKS: tuple[tuple[str, Task], ...] = (
    ("MTModel", Task.text2text_generation),  # MarianMTModel
    ("EncoderDecoderModel", Task.text2text_generation),
    ("ForMaskedLM", Task.fill_mask),
    ("ForTokenClassification", Task.token_classification),
    ("ForSequenceClassification", Task.sequence_classification),
    ("ForCausalLM", Task.text_generation),
    ("LMHeadModel", Task.text_generation),
    ("ForConditionalGeneration", Task.text2text_generation),
    ("Model", Task.text_embedding),
)


def task_for_architecture(architecture: str) -> Task | None:
    for suffix, task in ARCHITECTURE_SUFFIX_TASKS:
        if architecture.endswith(suffix):
            return task
    return None


def infer_task(architectures: Sequence[str] | None, sentence_transformers: bool) -> Task:
    """The task of a model from its ``config.json`` architectures.

    A sentence-transformers folder is an embedding model whatever its architecture says.
    Every architecture entry is tried, in order; the first that names a task wins.
    """
    if sentence_transformers:
        return Task.text_embedding
    for architecture in architectures or ():
        task = task_for_architecture(architecture)
        if task is not None:
            return task
    listed = ", ".join(architectures or ()) or "none"
    raise StartupError(
        f"cannot infer the task from the model's architectures ({listed}); "
        f"pass --task, one of: {supported_tasks()}"
    )
