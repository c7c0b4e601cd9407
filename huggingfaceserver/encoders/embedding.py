"""text_embedding: one pooled (and usually normalised) vector per instance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from kserve.protocol.infer_type import InferOutput
from transformers import BatchEncoding, PreTrainedTokenizerBase

from ..loading import ModelSource
from ..tasks import Task
from .base import EncoderOptions, EncoderTask, output_type, tensor_output
from .pooling import PoolingConfig, pool

if TYPE_CHECKING:  # the results are made in the process that runs the model
    import torch


class TextEmbedding(EncoderTask):
    task = Task.text_embedding
    auto_model = "AutoModel"
    output_field = "last_hidden_state"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        source: ModelSource,
        options: EncoderOptions,
        labels: Mapping[int, str] | None = None,
    ):
        super().__init__(tokenizer, source, options, labels)
        self.pooling = PoolingConfig.from_sentence_transformers(
            source.path, source.sentence_transformers_modules
        )

    def results(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        return pool(raw.float(), batch["attention_mask"], self.pooling).tolist()

    def v2_outputs(self, results: list[Any]) -> list[InferOutput]:
        return [tensor_output("output-0", np.array(results, dtype=np.float32), "FP32")]

    def v2_output_types(self) -> list[dict[str, Any]]:
        return [output_type("output-0", "FP32", [-1, -1])]
