"""The transformers (PyTorch) backend for encoder tasks."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection
from dataclasses import replace

import torch
import transformers
from transformers import BatchEncoding

from ...cli import ServerConfig
from ...devices import to_device
from ...loading import ModelSource, device, load_pretrained, resolve_dtype
from ..tokenizing import EncoderFacts, TokenizingEncoder
from .batch_rows import encoder_rows
from .threads import CALIBRATION_SHAPE, calibrate_cpu_threads

logger = logging.getLogger(__name__)


def model_inputs_on(
    device: torch.device, batch: BatchEncoding, names: Collection[str]
) -> dict[str, torch.Tensor]:
    """The batch's inputs that the model takes (``names``), on ``device`` in one copy: they are
    all int64 ``[B, T]``, stacked into one tensor on the host, copied (see :func:`to_device`)
    and unbound there, rather than one copy each."""
    keys = [key for key in batch if key in names]
    packed = to_device(torch.stack([batch[key] for key in keys]), device)
    return dict(zip(keys, packed.unbind(), strict=True))


class TransformersEncoder(TokenizingEncoder):
    """Tokenize and run an ``AutoModelFor...`` in a worker thread."""

    name = "huggingface"

    def __init__(self, source: ModelSource, config: ServerConfig):
        super().__init__(source, config)
        self.device = device()
        self.dtype = resolve_dtype(config.dtype, source.task, self.device.type == "cuda")

    def model_facts(self) -> EncoderFacts:
        return replace(super().model_facts(), dtype=str(self.dtype).removeprefix("torch."))

    def load_model(self) -> None:
        auto_class = getattr(transformers, self.task.auto_model)
        self.model = load_pretrained(auto_class, self.source, self.config, self.dtype)
        self.model_inputs = set(inspect.signature(self.model.forward).parameters)
        logger.info(
            "loaded %s (%s, %s on %s, max length %d)",
            type(self.model).__name__,
            self.task.task.value,
            self.dtype,
            self.device,
            self.max_length,
        )

    def default_max_batch_size(self) -> int:
        return encoder_rows(self.device.type)

    def tune(self) -> None:
        if self.device.type == "cpu":
            batch = self.calibration_batch()
            threads = self.batcher.run_on_worker(
                lambda: calibrate_cpu_threads(lambda: self.forward(batch))
            )
            logger.info("intra-op threads: %s", threads)

    def calibration_batch(self) -> BatchEncoding:
        rows, tokens = CALIBRATION_SHAPE
        tokens = min(tokens, self.max_length)
        ids = torch.randint(0, len(self.tokenizer), (rows, tokens), generator=torch.Generator())
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.inputs.token_type_ids:
            batch["token_type_ids"] = torch.zeros_like(ids)
        return BatchEncoding(batch)

    def results_device(self) -> str:
        """The model's device, where its outputs stay."""
        return str(self.device)

    def forward(self, batch: BatchEncoding) -> torch.Tensor:
        """The model's raw output for the task (logits, or the last hidden state), left on its
        device: the task reads there only its small results."""
        inputs = model_inputs_on(self.device, batch, self.model_inputs)
        with torch.inference_mode():
            output = self.model(**inputs, return_dict=True)
        return getattr(output, self.task.output_field)

    def forward_batch(self, batch: BatchEncoding) -> torch.Tensor:
        return self.forward(batch)
