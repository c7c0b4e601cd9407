"""Encoder tasks, looked up by task in one registry."""

from __future__ import annotations

from ..errors import StartupError
from ..tasks import Task
from .base import EncoderOptions, EncoderTask
from .classification import SequenceClassification, TokenClassification
from .embedding import TextEmbedding
from .fill_mask import FillMask
from .sparse import SparseEmbedding

ENCODER_TASKS: dict[Task, type[EncoderTask]] = {
    cls.task: cls
    for cls in (
        FillMask,
        TokenClassification,
        SequenceClassification,
        TextEmbedding,
        SparseEmbedding,
    )
}


def encoder_task_class(task: Task) -> type[EncoderTask]:
    try:
        return ENCODER_TASKS[task]
    except KeyError:
        raise StartupError(
            f"{task.value} is not an encoder task; encoder tasks: "
            + ", ".join(t.value for t in ENCODER_TASKS)
        ) from None


__all__ = ["ENCODER_TASKS", "EncoderOptions", "EncoderTask", "encoder_task_class"]
