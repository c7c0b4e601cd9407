"""LoRA adapters on the transformers backend, loaded with PEFT and mixed in one batch.

PEFT injects each adapter's low-rank matrices beside the base model's layers (in place); its
``PeftModel`` forward takes ``adapter_names``, one per row, and adds each row's own adapter to
that row alone (PEFT's mixed-adapter batches), :data:`BASE` for a row of the base model. So the
rows of requests for different adapters and for the base model decode as one batch; the decode
batch keeps each row's adapter beside its KV cache row (:mod:`.decode_batch`).

A decode step that also feeds new prompts packs every token into one batch row (:mod:`.ragged`),
where PEFT's ``adapter_names`` would give them all one adapter. For that forward each token gets
its own (:meth:`LoraAdapters.forward_tokens`): PEFT runs it as the base model, and a forward hook
on each LoRA linear layer (torch's public ``register_forward_hook``) adds each adapter's
``lora_B(lora_A(x)) * scaling`` to its own tokens' outputs, as PEFT's mixed batches add it to
their rows, from the layer's public ``lora_A``, ``lora_B``, ``lora_dropout`` and ``scaling``.
Rows of several adapters go the same way (each row's tokens with its adapter), with each
adapter's token indices on the device, made once while the rows stay the same: PEFT's mixed
batches index each LoRA layer's rows with a Python list per adapter, copied to a GPU from
pageable memory, a wait for the device per adapter and layer in every decode step.
A recorded decode step (a CUDA graph, :mod:`.step_graphs`) cannot choose rows by index, whose
count changes with the rows: it runs every such adapter on every row, times a ``[rows, 1]``
column of 0 and 1 that the graph reads as an input (:meth:`LoraAdapters.forward_masked`).
Only adapters made of plain LoRA linear layers are mixed by token (:attr:`LoraAdapters.per_token`);
a batch with another one goes through PEFT's ``adapter_names``, and a prompt of it is packed
only with rows of its own adapter.

What PEFT cannot mix in a batch is refused: adapters other than LoRA, DoRA, and
sequence-to-sequence models (the decode loop runs their encoder apart from PEFT's forward).
Adapters are added and removed on the decode thread, between two forwards.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from ...devices import to_device
from ...errors import StartupError
from ..lora import LoraModule

logger = logging.getLogger(__name__)

BASE = "__base__"
"""PEFT's name for a row that runs the base model alone, in ``adapter_names``."""


class InvalidAdapter(Exception):
    """An adapter that cannot be served; the message names it (a startup error, or a 400 for a
    load at run time)."""


UNMIXABLE: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (
        lambda config: bool(getattr(config, "use_dora", False)),
        "DoRA adapters cannot share a batch (PEFT's mixed-adapter batches); merge it into a "
        "model of its own",
    ),
    (
        lambda config: getattr(config, "bias", "none") not in (None, "none"),
        "it trains the base model's biases (bias != 'none'), which every request shares; "
        "merge it into a model of its own",
    ),
    (
        lambda config: str(getattr(config, "init_lora_weights", "")).startswith(
            ("pissa", "olora", "corda")
        ),
        "its initialisation (PiSSA, OLoRA, CorDA) rewrites the base model's weights, which "
        "every request shares; convert it to a plain LoRA (PEFT's "
        "path_initial_model_for_weight_conversion) or merge it",
    ),
    (
        lambda config: bool(getattr(config, "target_parameters", None)),
        "LoRA on parameters (target_parameters) cannot share a batch (PEFT's mixed-adapter "
        "batches)",
    ),
    (
        lambda config: bool(getattr(config, "alora_invocation_tokens", None)),
        "an activated LoRA (alora_invocation_tokens) is switched on by tokens of the prompt, "
        "which the decode steps' forwards do not see",
    ),
)
"""What the adapters PEFT cannot mix in a batch of requests (or that would change the base
model every request shares) have, and why each is refused (vLLM refuses the same)."""


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
        self.per_token: set[str] = set()
        """The adapters whose every layer is a plain LoRA linear layer: their tokens can share
        a batch row with other adapters' (:meth:`forward_tokens`)."""
        self.hooked: weakref.WeakSet[Any] = weakref.WeakSet()
        """The LoRA layers that add the per-token adapters' outputs."""
        self.token_groups: dict[str, torch.Tensor] | None = None
        """While a forward by token runs: each adapter's token indices (flattened)."""
        self.token_masks: dict[str, torch.Tensor] | None = None
        """While a masked forward runs (:meth:`forward_masked`): each adapter's ``[tokens, 1]``
        column, 1 on its tokens and 0 elsewhere."""
        self.groups: dict[str, torch.Tensor] = {}
        self.grouped_for: list[str] = []
        """The adapter of each token that :attr:`groups` were made for."""

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
        if self._plain(module.name):
            self.per_token.add(module.name)
            self._hook()
        logger.info("loaded LoRA adapter %s from %s", module.name, module.path)

    def remove(self, name: str) -> None:
        """Take the adapter's weights out of the model (no row may use it any more)."""
        self.names.remove(name)
        self.per_token.discard(name)
        if self.peft_model.active_adapter == name and self.names:  # else PEFT warns
            self.peft_model.set_adapter(self.names[0], inference_mode=True)
        self.peft_model.delete_adapter(name)
        logger.info("unloaded LoRA adapter %s", name)

    def forward(self, adapters: list[str], **inputs: Any) -> Any:
        """The model's forward, row ``i`` with adapter ``adapters[i]`` (:data:`BASE`: none):
        where the rows' adapters differ and each is mixed by token, by token (each row's
        tokens with its adapter; PEFT's mixed batches index a layer's rows with a Python list
        per adapter, which on a GPU waits for the device in every LoRA layer), else through
        PEFT's ``adapter_names``."""
        if not self.names:  # none loaded yet, or every one unloaded
            return self.model(**inputs)
        names = self.served(adapters)
        if len(set(names)) > 1 and self.packs(names):
            tokens = inputs["input_ids"].shape[1]
            each = [name for name in names for _ in range(tokens)]
            return self._by_token(each, len(names), inputs)
        return self.peft_model(adapter_names=names, **inputs)

    def packs(self, adapters: Iterable[str]) -> bool:
        """Whether tokens of these adapters (PEFT's names) can share one batch row
        (:meth:`forward_tokens`): all of one adapter, or each of them :data:`BASE` or one of
        :attr:`per_token`."""
        distinct = set(adapters)
        return len(distinct) <= 1 or distinct <= self.per_token | {BASE}

    def masks_cover(self, adapters: Iterable[str]) -> bool:
        """Whether a masked forward (:meth:`forward_masked`) runs these rows' adapters (PEFT's
        names): each is :data:`BASE` or one of :attr:`per_token` (one other adapter alone,
        which :meth:`packs`, would run as the base model)."""
        return set(adapters) <= self.per_token | {BASE}

    def forward_tokens(self, adapters: list[str], **inputs: Any) -> Any:
        """The model's forward, token ``i`` of its inputs (flattened, e.g. one packed batch
        row) with adapter ``adapters[i]``; only where :meth:`packs` them."""
        names = self.served(adapters)
        rows = inputs["input_ids"].shape[0]
        if len(set(names)) == 1:  # PEFT's own path: one adapter for every row
            return self.forward([names[0]] * rows, **inputs)
        if not self.packs(names):
            raise ValueError(f"LoRA adapters {sorted(set(names))} cannot share a batch row")
        return self._by_token(names, rows, inputs)

    def masked_names(self) -> tuple[str, ...]:
        """The adapters a masked forward computes (:meth:`forward_masked`): every loaded one
        mixed by token, in load order."""
        return tuple(name for name in self.names if name in self.per_token)

    def forward_masked(self, masks: dict[str, torch.Tensor], **inputs: Any) -> Any:
        """The model's forward with each token's adapter given by ``masks``: for each of
        :meth:`masked_names` a ``[tokens, 1]`` column of the model's dtype, 1 on that adapter's
        tokens (a row's one token in a decode step) and 0 elsewhere; a token of the base model
        has 0 in every column. PEFT runs the model as the base model, and the hooks add every
        adapter's LoRA output to every token, times its column: no index depends on which
        rows hold which adapter, so every step launches the same kernels on the same memory
        (a CUDA graph records them, the columns among its inputs). It computes each adapter on
        every row: a few small products more per LoRA layer and adapter."""
        if not self.names:
            return self.model(**inputs)
        self.token_masks = masks
        try:
            return self.peft_model(adapter_names=[BASE] * inputs["input_ids"].shape[0], **inputs)
        finally:
            self.token_masks = None

    def _by_token(self, names: list[str], rows: int, inputs: dict[str, Any]) -> Any:
        """PEFT's forward of the ``rows`` rows as the base model, the hooks adding each
        adapter's LoRA output to its own tokens (token ``i`` of the flattened inputs with
        ``names[i]``). The indices of each adapter's tokens go to the device once for a run of
        forwards with the same ``names`` (a batch's decode steps)."""
        if self.grouped_for != names:
            device = inputs["input_ids"].device
            self.groups = {
                name: to_device([i for i, n in enumerate(names) if n == name], device, torch.long)
                for name in set(names) - {BASE}
            }
            self.grouped_for = names
        self.token_groups = self.groups
        try:
            return self.peft_model(adapter_names=[BASE] * rows, **inputs)
        finally:
            self.token_groups = None

    def served(self, adapters: list[str]) -> list[str]:
        """Each row's adapter as the forward runs it: :data:`BASE` for an unloaded one."""
        # A row of an unloaded adapter belongs to a request that has ended (an adapter in use
        # is not unloaded) and leaves at the end of this step: its output is never read.
        return [name if name in self.names or name == BASE else BASE for name in adapters]

    def _layers(self) -> Iterator[Any]:
        """PEFT's LoRA layers in the model."""
        kind = self.peft.tuners.lora.LoraLayer
        return (module for module in self.peft_model.modules() if isinstance(module, kind))

    def _plain(self, name: str) -> bool:
        """Whether every layer of adapter ``name`` is a LoRA linear layer of PEFT's own, with
        no variant: ``lora_B(lora_A(dropout(x))) * scaling`` added to the base output; and it
        replaces no module (``modules_to_save``, ``trainable_token_indices``: PEFT's mixed
        batches pick those per row, which a forward by token as the base model would not)."""
        config = self.peft_model.peft_config[name]
        if getattr(config, "modules_to_save", None) or getattr(
            config, "trainable_token_indices", None
        ):
            return False
        linear = self.peft.tuners.lora.Linear
        for layer in self._layers():
            holds = any(
                name in getattr(layer, attribute) for attribute in layer.adapter_layer_names
            )
            if holds and (type(layer) is not linear or name in layer.lora_variant):
                return False
        return True

    def _hook(self) -> None:
        """Add :meth:`_add_token_outputs` to each LoRA linear layer not hooked yet."""
        for layer in self._layers():
            if layer not in self.hooked and type(layer) is self.peft.tuners.lora.Linear:
                layer.register_forward_hook(self._add_token_outputs, with_kwargs=True)
                self.hooked.add(layer)

    def _add_token_outputs(
        self, layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
    ) -> torch.Tensor | None:
        """During a forward by token (PEFT ran the layer as the base model): each
        adapter's LoRA output added to its own tokens' rows, as PEFT adds it to its rows; in a
        masked forward, to every token, times the adapter's column."""
        groups, masks = self.token_groups, self.token_masks
        if groups is None and masks is None:
            return None
        x = args[0] if args else kwargs["x"]
        inputs = x.reshape(-1, x.shape[-1])
        outputs = output.reshape(-1, output.shape[-1])  # a view where the output allows it
        if masks is not None:
            self._check_tokens(layer, inputs, next(iter(masks.values()), inputs).shape[0])
            for name, column in masks.items():
                if name in layer.lora_A:
                    added = self._lora_output(layer, name, inputs) * column
                    outputs.add_(added.to(outputs.dtype))
            return outputs.view(output.shape)
        assert groups is not None
        self._check_tokens(layer, inputs, len(self.grouped_for))
        for name, index in groups.items():
            if name in layer.lora_A:
                added = self._lora_output(layer, name, inputs.index_select(0, index))
                outputs.index_add_(0, index, added.to(outputs.dtype))
        return outputs.view(output.shape)

    @staticmethod
    def _lora_output(layer: Any, name: str, inputs: torch.Tensor) -> torch.Tensor:
        """``lora_B(lora_A(dropout(x))) * scaling`` of adapter ``name`` in ``layer``, as PEFT
        adds it to the base layer's output."""
        lora_a = layer.lora_A[name]
        own = layer.lora_dropout[name](inputs.to(lora_a.weight.dtype))
        return layer.lora_B[name](lora_a(own)) * layer.scaling[name]

    @staticmethod
    def _check_tokens(layer: Any, inputs: torch.Tensor, tokens: int) -> None:
        if inputs.shape[0] != tokens:  # e.g. an expert's share of the tokens
            raise ValueError(
                f"a LoRA layer ({type(layer.base_layer).__name__}) takes {inputs.shape[0]} "
                f"rows for {tokens} tokens: its adapters cannot be mixed by token"
            )

    def _config(self, module: LoraModule) -> Any:
        """The adapter's PEFT config, checked to be a LoRA that PEFT mixes in a batch."""
        if module.name == BASE:
            raise InvalidAdapter(f"LoRA adapter {BASE}: PEFT's name for the base model")
        try:
            config = self.peft.PeftConfig.from_pretrained(module.path)
        except (OSError, ValueError, KeyError) as exc:  # KeyError: a peft_type PEFT lacks
            raise InvalidAdapter(
                f"LoRA adapter {module.name}: no PEFT adapter at {module.path} ({exc!r})"
            ) from None
        kind = getattr(config.peft_type, "value", config.peft_type)
        if kind != "LORA":
            raise InvalidAdapter(f"LoRA adapter {module.name}: a {kind} adapter, not LoRA")
        for refused, why in UNMIXABLE:
            if refused(config):
                raise InvalidAdapter(f"LoRA adapter {module.name}: {why}")
        return config
