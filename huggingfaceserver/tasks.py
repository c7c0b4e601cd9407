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
    sparse_embedding = "sparse_embedding"

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


SENTENCE_MODEL_TASKS = {
    "SentenceTransformer": Task.text_embedding,
    "SparseEncoder": Task.sparse_embedding,
    "CrossEncoder": Task.sequence_classification,
}
"""sentence-transformers' model types (``SentenceConfig.model_type``) -> task."""


def infer_task(architectures: Sequence[str] | None, sentence_model_type: str | None) -> Task:
    """The task of a model from its ``config.json`` architectures.

    A folder saved by sentence-transformers is what its model type says (an embedding, sparse
    embedding or cross-encoder model) whatever its architecture says. Otherwise every
    architecture entry is tried, in order; the first that names a task wins.
    """
    if sentence_model_type is not None:
        return SENTENCE_MODEL_TASKS[sentence_model_type]
    for architecture in architectures or ():
        task = task_for_architecture(architecture)
        if task is not None:
            return task
    listed = ", ".join(architectures or ()) or "none"
    raise StartupError(
        f"cannot infer the task from the model's architectures ({listed}); "
        f"pass --task, one of: {supported_tasks()}"
    )
