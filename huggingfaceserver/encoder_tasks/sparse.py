"""sparse_embedding: a vocabulary-sized term-weight vector per instance, kept sparse (SPLADE), as
sentence-transformers' ``SparseEncoder.encode`` gives it."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np
from kserve.protocol.infer_type import InferOutput
from transformers import BatchEncoding

from ..devices import to_device
from ..sentence.config import SpladePooling
from ..tasks import Task
from ..units import MiB
from .base import EncoderTask, output_type, pad_rows, tensor_output

if TYPE_CHECKING:  # the results are made in the process that runs the model
    import torch

PADDING_INDEX = -1
"""Fills the V2 index tensor past an instance's last term (instances differ in terms)."""
VOCABULARY_LOGITS_BYTES = 256 * MiB
"""A batch's masked-LM logits (rows x tokens x vocabulary, float32) are kept within this: the
SPLADE pooling reads every token's logits over the whole vocabulary."""


class SparseEmbedding(EncoderTask):
    """V1: ``{"indices": [...], "values": [...]}`` per instance, the non-zero terms by
    vocabulary index; V2: ``indices`` (INT64, padded with -1) and ``values`` (FP32, padded
    with 0), both ``[N, K]``."""

    task = Task.sparse_embedding
    auto_model = "AutoModelForMaskedLM"
    output_field = "logits"
    pooling: SpladePooling

    def load_head(self, device: str) -> None:
        sentence = self.source.sentence
        found = [m for m in sentence.modules if isinstance(m, SpladePooling)] if sentence else []
        self.pooling = found[0] if found else SpladePooling()

    @staticmethod
    def max_batch_tokens(vocabulary: int) -> int:
        """Padded tokens per forward pass that keep its logits within
        :data:`VOCABULARY_LOGITS_BYTES`."""
        return max(1, VOCABULARY_LOGITS_BYTES // (4 * max(1, vocabulary)))

    def results(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        """The term weights on the output's device, their non-zero terms (a read: the host
        learns how many), then rows, terms and values packed into one tensor and read at once
        (float64 holds the indices exactly and the float32 values as they are)."""
        import torch

        from ..sentence.pooling import splade

        with torch.inference_mode():
            mask = to_device(batch["attention_mask"], raw.device)
            weights = splade(raw.float(), mask, self.pooling.strategy, self.pooling.activation)
            rows, terms = weights.nonzero(as_tuple=True)
            packed = torch.stack([rows.double(), terms.double(), weights[rows, terms].double()])
        found = packed.cpu().numpy()
        terms_at, values_at = found[1].astype(np.int64), found[2]
        ends = np.cumsum(np.bincount(found[0].astype(np.int64), minlength=len(raw))).tolist()
        return [
            {"indices": terms_at[start:end].tolist(), "values": values_at[start:end].tolist()}
            for start, end in pairwise([0, *ends])
        ]

    def v2_outputs(self, results: list[Any]) -> list[InferOutput]:
        indices = pad_rows([r["indices"] for r in results], PADDING_INDEX)
        values = pad_rows([r["values"] for r in results], 0.0)
        return [
            tensor_output("indices", np.array(indices, dtype=np.int64), "INT64"),
            tensor_output("values", np.array(values, dtype=np.float32), "FP32"),
        ]

    def v2_output_types(self) -> list[dict[str, Any]]:
        return [output_type("indices", "INT64", [-1, -1]), output_type("values", "FP32", [-1, -1])]
