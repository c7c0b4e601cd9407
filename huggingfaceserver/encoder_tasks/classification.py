"""sequence_classification and token_classification."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from kserve.protocol.infer_type import InferOutput
from transformers import BatchEncoding

from ..tasks import Task
from .base import (
    EncoderTask,
    bytes_output,
    host_array,
    lengths,
    output_type,
    pad_rows,
    tensor_output,
)
from .params import Output

if TYPE_CHECKING:  # the results are made in the process that runs the model
    import torch

PROBABILITY_FUNCTIONS = {"multi_label_classification": "Sigmoid", "regression": "Identity"}
"""What ``--return_probabilities`` applies by the config's ``problem_type``, as transformers'
text-classification pipeline chooses; a softmax otherwise. One label: the model's activation,
as its scores (a softmax over one logit would be 1.0 always)."""

PADDING_LABEL = -1
"""Fills the V2 token-label tensor past an instance's last token (instances differ in length)."""


class SequenceClassification(EncoderTask):
    """V1: a class index per instance (or label, or score dict); for a one-label model (a
    cross-encoder: a reranker, a similarity regressor) its score, as sentence-transformers'
    ``CrossEncoder.predict`` gives it. Instances are texts or text pairs.

    The score applies the cross-encoder's activation: the one its sentence-transformers files
    name, else sigmoid for one label and identity for more (``CrossEncoder``'s defaults)."""

    task = Task.sequence_classification
    auto_model = "AutoModelForSequenceClassification"
    outputs: ClassVar[dict[Output, str]] = {
        Output.task: "results",
        Output.scores: "scores",
        Output.logits: "logits",
    }
    activation: torch.nn.Module
    probability: torch.nn.Module
    """What turns logits into ``--return_probabilities``' values (:data:`PROBABILITY_FUNCTIONS`)."""

    @property
    def one_label(self) -> bool:
        return len(self.labels) == 1

    @property
    def scored(self) -> bool:
        """Whether V1/V2 results are a one-label model's scores (no flag asked for others)."""
        return self.one_label and not (self.options.scores or self.options.return_labels)

    def load_head(self, device: str) -> None:
        import torch

        from ..sentence.head import activation

        sentence = self.source.sentence
        name = sentence.activation_fn if sentence is not None else None
        default = torch.nn.Sigmoid() if self.one_label else torch.nn.Identity()
        self.activation = activation(name) if name else default
        problem = str(getattr(self.source.config, "problem_type", None))
        function = PROBABILITY_FUNCTIONS.get(problem)
        self.probability = self.activation if self.one_label else torch.nn.Softmax(dim=-1)
        if function and not self.one_label:
            self.probability = activation(function)

    def score_values(self, logits: torch.Tensor) -> Any:
        if not self.options.return_probabilities:
            return super().score_values(logits)
        import torch

        with torch.inference_mode():
            return self.probability(logits.float()).tolist()

    def results(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        if self.options.scores:
            return self.score_dicts(self.score_values(raw))
        if self.scored:
            return self.scores(raw, batch)
        classes = raw.argmax(dim=-1).tolist()
        if self.options.return_labels:
            return [self.label_key(c) for c in classes]
        return classes

    def scores(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        import torch

        with torch.inference_mode():
            values = self.activation(raw.float())
        return values[:, 0].tolist() if self.one_label else values.tolist()

    def logits(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        return raw.float().tolist()

    def v2_outputs(self, results: list[Any]) -> list[InferOutput]:
        if self.scored:
            return [tensor_output("output-0", np.array(results, dtype=np.float32), "FP32")]
        if self.options.scores or self.options.return_labels:
            return [bytes_output("output-0", results)]
        return [tensor_output("output-0", np.array(results, dtype=np.int64), "INT64")]

    def v2_output_types(self) -> list[dict[str, Any]]:
        if self.scored:
            return [output_type("output-0", "FP32", [-1])]
        plain = not (self.options.scores or self.options.return_labels)
        return [output_type("output-0", "INT64" if plain else "BYTES", [-1])]


class TokenClassification(EncoderTask):
    """V1: per instance ``[[label id per token]]`` (the compat nesting), or score dicts.

    With ``--return_offsets_mapping`` each result also carries its tokens' character offsets,
    which the V1 response returns as an extra top-level ``outputs`` entry.
    """

    task = Task.token_classification
    auto_model = "AutoModelForTokenClassification"

    @property
    def needs_offsets(self) -> bool:  # type: ignore[override]
        return self.options.return_offsets_mapping

    def results(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        """Each row's tokens, padding left out: the whole batch's scores or classes are read
        from the device at once, then cut into rows on the host."""
        sizes = lengths(batch)
        predictions: list[Any]
        if self.options.scores:
            values = self.score_values(raw)
            predictions = [self.score_dicts(row[:n]) for row, n in zip(values, sizes, strict=True)]
        else:
            rows = [row[:n] for row, n in zip(raw.argmax(dim=-1).tolist(), sizes, strict=True)]
            if self.options.return_labels:
                rows = [[self.label_key(c) for c in row] for row in rows]
            predictions = [[row] for row in rows]
        if "offset_mapping" not in batch:
            return predictions
        offsets = host_array(batch, "offset_mapping")
        return [
            (prediction, offsets[i, :n].tolist())
            for i, (prediction, n) in enumerate(zip(predictions, sizes, strict=True))
        ]

    def _split(self, results: list[Any]) -> tuple[list[Any], list[Any] | None]:
        if not self.options.return_offsets_mapping:
            return results, None
        return [r[0] for r in results], [r[1] for r in results]

    def _offset_output(self, offsets: list[Any]) -> InferOutput:
        array = np.array(pad_rows(offsets, [0, 0]), dtype=np.int64).reshape(len(offsets), -1, 2)
        return tensor_output("offset_mapping", array, "INT64")

    def v1_response(self, results: list[Any]) -> dict[str, Any]:
        predictions, offsets = self._split(results)
        response: dict[str, Any] = {"predictions": predictions}
        if offsets is not None:
            output = self._offset_output(offsets)
            response["outputs"] = [
                {
                    "name": output.name,
                    "datatype": output.datatype,
                    "shape": output.shape,
                    "data": output.data.flatten().tolist(),
                }
            ]
        return response

    def v2_outputs(self, results: list[Any]) -> list[InferOutput]:
        predictions, offsets = self._split(results)
        if self.options.scores:
            rows = pad_rows(predictions, {})
            outputs = [bytes_output("output-0", [d for r in rows for d in r], [len(rows), -1])]
        elif self.options.return_labels:
            rows = pad_rows([p[0] for p in predictions], "")
            outputs = [bytes_output("output-0", [v for r in rows for v in r], [len(rows), 1, -1])]
        else:
            rows = pad_rows([p[0] for p in predictions], PADDING_LABEL)
            array = np.array(rows, dtype=np.int64).reshape(len(rows), 1, -1)
            outputs = [tensor_output("output-0", array, "INT64")]
        if offsets is not None:
            outputs.append(self._offset_output(offsets))
        return outputs

    def v2_output_types(self) -> list[dict[str, Any]]:
        if self.options.scores:
            types = [output_type("output-0", "BYTES", [-1, -1])]
        else:
            datatype = "BYTES" if self.options.return_labels else "INT64"
            types = [output_type("output-0", datatype, [-1, 1, -1])]
        if self.options.return_offsets_mapping:
            types.append(output_type("offset_mapping", "INT64", [-1, -1, 2]))
        return types
