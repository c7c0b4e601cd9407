"""LoRA adapters on the transformers backend, loaded with PEFT and mixed in one batch.

PEFT injects each adapter's low-rank matrices beside the base model's layers (in place); its
``PeftModel`` forward takes ``adapter_names``, one per row, and adds each row's own adapter to
that row alone (PEFT's mixed-adapter batches), :data:`BASE` for a row of the base model. So the
rows of requests for different adapters and for the base model decode as one batch; the decode
batch keeps each row's adapter beside its KV cache row (:mod:`.decode_batch`).

What PEFT cannot mix in a batch is refused: adapters other than LoRA, DoRA, and
sequence-to-sequence models (the decode loop runs their encoder apart from PEFT's forward).
Adapters are added and removed on the decode thread, between two forwards.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import PreTrainedModel

from ...errors import StartupError
from ..lora import LoraModule

logger = logging.getLogger(__name__)

BASE = "__base__"
"""PEFT's name for a row that runs the base model alone, in ``adapter_names``."""


class InvalidAdapter(Exception):
    """An adapter that cannot be served; the message names it (a startup error, or a 400 for a
    load at run time)."""


def row_adapter(adapter: str | None) -> str:
    """A row's entry in PEFT's ``adapter_names``: its adapter, or :data:`BASE`."""
    return BASE if adapter is None else adapter


class LoraAdapters:
    """The adapters loaded into one base model, and the forward that mixes them per row. Until
    the first adapter is added (one loaded at run time) the forward is the base model's."""

    def __init__(self, model: PreTrainedModel):
        if model.config.is_encoder_decoder:
            raise StartupError(
                "LoRA adapters on the transformers backend need a decoder-only model: "
                f"{type(model).__name__} is an encoder-decoder"
            )
        try:
            import peft
        except ImportError:
            raise StartupError(
                "LoRA adapters on the transformers backend need PEFT: pip install 'peft>=0.21'"
            ) from None
        self.peft = peft
        self.model = model
        self.peft_model: Any = None
        """PEFT's model around ``model`` once an adapter is in."""
        self.names: list[str] = []

    def add(self, module: LoraModule) -> None:
        """Load the adapter into the model (changed in place); :class:`InvalidAdapter` for one
        that PEFT cannot read, that does not fit the model, or that PEFT cannot mix in a
        batch."""
        config = self._config(module)
        try:
            if self.peft_model is None:
                self.peft_model = self.peft.PeftModel.from_pretrained(
                    self.model, module.path, adapter_name=module.name, config=config
                )
            else:
                self.peft_model.load_adapter(module.path, adapter_name=module.name)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise InvalidAdapter(
                f"LoRA adapter {module.name} ({module.path}) does not fit "
                f"{type(self.model).__name__}: {exc}"
            ) from None
        if self.peft_model.active_adapter not in self.names:  # all unloaded: PEFT kept a name
            self.peft_model.set_adapter(module.name, inference_mode=True)
        self.peft_model.eval()  # PEFT refuses adapter_names in training mode
        self.names.append(module.name)
        logger.info("loaded LoRA adapter %s from %s", module.name, module.path)

    def remove(self, name: str) -> None:
        """Take the adapter's weights out of the model (no row may use it any more)."""
        self.names.remove(name)
        if self.peft_model.active_adapter == name and self.names:  # else PEFT warns
            self.peft_model.set_adapter(self.names[0], inference_mode=True)
        self.peft_model.delete_adapter(name)
        logger.info("unloaded LoRA adapter %s", name)

    def forward(self, adapters: list[str], **inputs: Any) -> Any:
        """The model's forward, row ``i`` with adapter ``adapters[i]`` (:data:`BASE`: none)."""
        if not self.names:  # none loaded yet, or every one unloaded
            return self.model(**inputs)
        # A row of an unloaded adapter belongs to a request that has ended (an adapter in use
        # is not unloaded) and leaves at the end of this step: its output is never read.
        names = [name if name in self.names or name == BASE else BASE for name in adapters]
        return self.peft_model(adapter_names=names, **inputs)

    def _config(self, module: LoraModule) -> Any:
        """The adapter's PEFT config, checked to be a LoRA that PEFT mixes in a batch."""
        if module.name == BASE:
            raise InvalidAdapter(f"LoRA adapter {BASE}: PEFT's name for the base model")
        try:
            config = self.peft.PeftConfig.from_pretrained(module.path)
        except (OSError, ValueError) as exc:
            raise InvalidAdapter(
                f"LoRA adapter {module.name}: no PEFT adapter at {module.path} ({exc})"
            ) from None
        kind = getattr(config.peft_type, "value", config.peft_type)
        if kind != "LORA":
            raise InvalidAdapter(f"LoRA adapter {module.name}: a {kind} adapter, not LoRA")
        if getattr(config, "use_dora", False):
            raise InvalidAdapter(
                f"LoRA adapter {module.name}: DoRA adapters cannot share a batch (PEFT's "
                "mixed-adapter batches); merge it into a model of its own"
            )
        return config
