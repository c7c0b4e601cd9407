"""text_embedding: one vector per instance, as sentence-transformers' ``encode`` gives it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from kserve.protocol.infer_type import InferOutput
from transformers import BatchEncoding, PreTrainedTokenizerBase

from ..devices import to_device
from ..loading import ModelSource
from ..tasks import Task
from .base import EncoderOptions, EncoderTask, lengths, output_type, tensor_output
from .params import Output

if TYPE_CHECKING:  # the results are made in the process that runs the model
    import torch

    from ..sentence.head import SentenceHead


class TextEmbedding(EncoderTask):
    """The model's sentence-transformers modules (pooling, dense layers, layer norm,
    normalisation) after its last hidden state; mean pooling and L2 normalisation for a model
    saved without them."""

    task = Task.text_embedding
    auto_model = "AutoModel"
    output_field = "last_hidden_state"
    outputs: ClassVar[dict[Output, str]] = {
        Output.task: "results",
        Output.normalized: "normalized",
        Output.unnormalized: "unnormalized",
        Output.tokens: "token_states",
    }

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        source: ModelSource,
        options: EncoderOptions,
        labels: Mapping[int, str] | None = None,
    ):
        super().__init__(tokenizer, source, options, labels)
        self.head: SentenceHead | None = None

    def load_head(self, device: str) -> None:
        import torch

        from ..sentence.head import SentenceHead

        self.head = SentenceHead.build(self.source.sentence, torch.device(device))
        hidden_size = getattr(self.source.config, "hidden_size", None)
        if isinstance(hidden_size, int):
            self.head.check(hidden_size, torch.device(device))

    def vectors(
        self, raw: torch.Tensor, batch: BatchEncoding, normalized: bool = True
    ) -> torch.Tensor:
        """The batch's vectors on the output's device (its masks copied there)."""
        assert self.head is not None, "load_head() first"
        mask = to_device(batch["attention_mask"], raw.device)
        pooling_mask = batch.get("pooling_mask")
        if pooling_mask is not None:
            pooling_mask = to_device(pooling_mask, raw.device)
        return self.head.vectors(raw, mask, pooling_mask, normalized)

    def results(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        return self.vectors(raw, batch).tolist()

    def normalized(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        import torch.nn.functional as F

        return F.normalize(self.vectors(raw, batch), p=2, dim=-1).tolist()

    def unnormalized(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        return self.vectors(raw, batch, normalized=False).tolist()

    def token_states(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        """Each row's tokens' last hidden states, unpooled (padding left out): the whole
        batch's copied to the host at once, then cut into rows there."""
        states = raw.float().cpu().numpy()
        return [states[i, :length].tolist() for i, length in enumerate(lengths(batch))]

    def v2_outputs(self, results: list[Any]) -> list[InferOutput]:
        return [tensor_output("output-0", np.array(results, dtype=np.float32), "FP32")]

    def v2_output_types(self) -> list[dict[str, Any]]:
        return [output_type("output-0", "FP32", [-1, -1])]
