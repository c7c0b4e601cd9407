"""The encoder task interface: each task owns its input checks and its output shapes."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from kserve.protocol.infer_type import InferOutput
from transformers import BatchEncoding, PreTrainedTokenizerBase

from ..cli import ServerConfig
from ..errors import BadRequest
from ..loading import ModelSource
from ..tasks import Task
from .params import Output

if TYPE_CHECKING:  # the results are made in the process that runs the model
    import torch


@dataclass(frozen=True)
class EncoderOptions:
    """The output flags that shape encoder results."""

    return_probabilities: bool = False
    return_raw_logits: bool = False
    return_offsets_mapping: bool = False
    return_labels: bool = False

    @classmethod
    def from_config(cls, config: ServerConfig) -> EncoderOptions:
        return cls(
            config.return_probabilities,
            config.return_raw_logits,
            config.return_offsets_mapping,
            config.return_labels,
        )

    @property
    def scores(self) -> bool:
        """Whether results are score dicts rather than predicted classes."""
        return self.return_probabilities or self.return_raw_logits


class EncoderTask(ABC):
    """One encoder task: which model head to load, what to check, how to shape results.

    ``results`` runs in a worker thread with the model's raw output (logits, or the last
    hidden state for embeddings) and returns one plain Python value per instance: the V1
    prediction. ``v2_outputs`` turns those into Open Inference Protocol tensors.

    The raw output is on the model's device and the batch (the collated inputs) on the host.
    Each result method computes for the whole batch where the output is and reads the device
    once, its small final result: on a GPU every read makes the host wait for the device, so
    reads row by row would cost a wait per row. What it needs of the batch there (a mask) it
    copies to the output's device; what it needs on the host (lengths, offsets, positions) it
    reads from the batch, with NumPy.
    """

    task: ClassVar[Task]
    auto_model: ClassVar[str]
    """Name of the ``transformers`` auto class that loads this task's model."""
    output_field: ClassVar[str] = "logits"
    needs_offsets: ClassVar[bool] = False
    outputs: ClassVar[dict[Output, str]] = {Output.task: "results"}
    """The results a row may ask for (:class:`Output`), and the method that makes them."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        source: ModelSource,
        options: EncoderOptions,
        labels: Mapping[int, str] | None = None,
    ):
        self.tokenizer = tokenizer
        self.labels = labels or {}
        """The model's class names (its config's ``id2label``)."""
        self.options = options
        self.source = source

    def load_head(self, device: str) -> None:
        """In the process that runs the model, before the first batch: what turns its output
        into results there (weights of the modules after the transformer, ...)."""

    def supports(self, output: Output) -> bool:
        return output in self.outputs

    def check_output(self, output: Output) -> None:
        """A 400 for results this task does not make."""
        if not self.supports(output):
            raise BadRequest(unsupported_output(output, self.task))

    def results_for(self, output: Output, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        """The rows' results of kind ``output`` (one the task :meth:`supports`)."""
        return getattr(self, self.outputs[output])(raw, batch)

    def check_text(self, index: int, text: str) -> None:
        """Reject an instance before tokenization (a :class:`BadRequest`)."""

    def check_rows(self, rows: list[dict[str, np.ndarray]]) -> None:
        """Reject a request's tokenized rows (a :class:`BadRequest`)."""

    @abstractmethod
    def results(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        """One V1 prediction per instance."""

    @abstractmethod
    def v2_outputs(self, results: list[Any]) -> list[InferOutput]:
        """The V2 output tensors for a request's results."""

    @abstractmethod
    def v2_output_types(self) -> list[dict[str, Any]]:
        """V2 metadata of the outputs: name, datatype and shape (-1 where it varies)."""

    def v1_response(self, results: list[Any]) -> dict[str, Any]:
        return {"predictions": results}

    # helpers shared by the tasks

    def label_key(self, index: int) -> str:
        """A class's key in score dicts: its index, or its id2label name with --return_labels."""
        if self.options.return_labels and index in self.labels:
            return str(self.labels[index])
        return str(index)

    def score_values(self, logits: torch.Tensor) -> Any:
        """``logits`` ``[..., classes]`` as the values of score dicts, in nested lists of its
        shape: probabilities or raw logits, per the flags, read from the device once."""
        values = logits.float()
        if self.options.return_probabilities:
            values = values.softmax(dim=-1)
        return values.tolist()

    def score_dicts(self, rows: Sequence[Sequence[float]]) -> list[dict[str, float]]:
        """Per row of :meth:`score_values`, ``{class: probability}`` (4 decimals) or
        ``{class: raw logit}``."""
        if not rows:
            return []
        keys = [self.label_key(i) for i in range(len(rows[0]))]
        if self.options.return_probabilities:
            return [{k: round(p, 4) for k, p in zip(keys, row, strict=True)} for row in rows]
        return [dict(zip(keys, row, strict=True)) for row in rows]


def unsupported_output(output: Output | str, task: Task) -> str:
    return f"a {task.value} model makes no {getattr(output, 'value', output)!r} results"


def output_type(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape}


def lengths(batch: BatchEncoding) -> list[int]:
    """Real (unpadded) token count of each row, from the batch on the host."""
    return host_array(batch, "attention_mask").sum(axis=1).tolist()


def host_array(batch: BatchEncoding, key: str) -> np.ndarray:
    """One of the batch's inputs as a NumPy view: the batch is collated on the host, and what
    is computed from it there stays off the device and reads nothing from it."""
    return batch[key].numpy()


def bytes_output(name: str, values: Sequence[Any], shape: list[int] | None = None) -> InferOutput:
    """A BYTES tensor; non-string values are sent as their JSON text."""
    texts = [v if isinstance(v, str) else json.dumps(v) for v in values]
    array = np.array(texts, dtype=np.object_).reshape(shape or [len(texts)])
    return InferOutput(name=name, shape=list(array.shape), datatype="BYTES", data=array)


def tensor_output(name: str, array: np.ndarray, datatype: str) -> InferOutput:
    return InferOutput(name=name, shape=list(array.shape), datatype=datatype, data=array)


def pad_rows(rows: Sequence[Sequence[Any]], fill: Any) -> list[list[Any]]:
    """Right-pad ragged rows to the longest one."""
    width = max((len(r) for r in rows), default=0)
    return [list(r) + [fill] * (width - len(r)) for r in rows]
