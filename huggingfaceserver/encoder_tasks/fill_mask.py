"""fill_mask: the predicted token(s) at the mask position(s)."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np
from kserve.protocol.infer_type import InferOutput
from transformers import BatchEncoding

from ..devices import to_device
from ..errors import BadRequest, StartupError
from ..tasks import Task
from .base import EncoderTask, bytes_output, host_array, output_type

if TYPE_CHECKING:  # the results are made in the process that runs the model
    import torch


class FillMask(EncoderTask):
    """V1: one decoded string per instance (all its masks), or per mask a score dict."""

    task = Task.fill_mask
    auto_model = "AutoModelForMaskedLM"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.tokenizer.mask_token is None:
            raise StartupError("fill_mask needs a tokenizer with a mask token; this one has none")

    def check_text(self, index: int, text: str) -> None:
        if self.tokenizer.mask_token not in text:
            raise BadRequest(
                f"instance {index} has no mask token {self.tokenizer.mask_token!r}: {text[:80]!r}"
            )

    def check_rows(self, rows: list[dict[str, np.ndarray]]) -> None:
        for index, row in enumerate(rows):
            if not (row["input_ids"] == self.tokenizer.mask_token_id).any():
                raise BadRequest(
                    f"instance {index}: the mask token was cut off by truncation to "
                    f"the maximum length ({len(row['input_ids'])} tokens)"
                )

    def label_key(self, index: int) -> str:
        return str(index)  # score dicts are keyed by vocabulary id

    def results(self, raw: torch.Tensor, batch: BatchEncoding) -> list[Any]:
        """The masks' logits gathered on the device at positions found on the host (no
        boolean mask of a device tensor, which waits to learn its size), and read once."""
        import torch

        rows, columns = np.nonzero(host_array(batch, "input_ids") == self.tokenizer.mask_token_id)
        positions = to_device(torch.from_numpy(np.stack([rows, columns])), raw.device)
        masked = raw[positions[0], positions[1]]  # [masks, vocab], the rows' masks in turn
        ends = np.cumsum(np.bincount(rows, minlength=len(raw))).tolist()
        if self.options.scores:
            dicts = self.score_dicts(self.score_values(masked))
            return [dicts[start:end] for start, end in pairwise([0, *ends])]
        ids = masked.argmax(dim=-1).tolist()
        return [self.tokenizer.decode(ids[start:end]) for start, end in pairwise([0, *ends])]

    def v2_outputs(self, results: list[Any]) -> list[InferOutput]:
        return [bytes_output("output-0", results)]

    def v2_output_types(self) -> list[dict[str, Any]]:
        return [output_type("output-0", "BYTES", [-1])]
