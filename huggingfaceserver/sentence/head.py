"""The modules after the transformer, run in torch where the model runs: a model's token states
to the vectors sentence-transformers' ``encode`` gives.

Dense and LayerNorm weights are read from their folders (``model.safetensors``, else
``pytorch_model.bin`` read with ``weights_only``). Everything runs in float32 on the model's
device, whatever the model's dtype: these layers are small, and float32 keeps the vectors as
close to sentence-transformers' float32 ones as the model's own precision allows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import StartupError
from .config import Dense, Dropout, LayerNorm, Module, Normalize, Pooling, SentenceConfig
from .pooling import pool

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
DEFAULT_POOLING = Pooling(("mean",))
"""A bare transformers model (no sentence-transformers files): mean pooling, normalised."""

Step = Callable[[torch.Tensor], torch.Tensor]


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A module's state dict, as sentence-transformers saves it."""
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - safetensors and torch raise their own errors
            raise StartupError(f"cannot read the weights in {file}: {exc}") from None
    raise StartupError(f"{folder} has no weights ({' or '.join(WEIGHT_FILES)})")


def load_state(module: torch.nn.Module, folder: Path) -> torch.nn.Module:
    try:
        module.load_state_dict(read_weights(folder))
    except RuntimeError as exc:
        raise StartupError(f"the weights in {folder} do not fit its config: {exc}") from None
    return module.eval()


def activation(name: str) -> torch.nn.Module:
    """``torch.nn``'s module class ``name``, made with its defaults."""
    cls = getattr(torch.nn, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise StartupError(f"{name} is not one of torch.nn's modules")
    return cls()


class DenseStep(torch.nn.Module):
    """sentence-transformers' ``Dense``: ``activation(linear(x))`` (+ the residual)."""

    def __init__(self, spec: Dense):
        super().__init__()
        self.linear = torch.nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.activation_function = activation(spec.activation)
        self.use_residual = spec.residual
        if spec.residual and spec.in_features != spec.out_features:
            self.residual = torch.nn.Linear(spec.in_features, spec.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation_function(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if hasattr(self, "residual") else x)
        return out


class LayerNormStep(torch.nn.Module):
    """sentence-transformers' ``LayerNorm`` (its weights under ``norm.``)."""

    def __init__(self, spec: LayerNorm):
        super().__init__()
        self.norm = torch.nn.LayerNorm(spec.dimension)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, p=2, dim=-1)


def step(module: Module, device: torch.device) -> Step | None:
    """A module after pooling, ready to run (None: nothing to do at inference)."""
    if isinstance(module, Dense):
        return load_state(DenseStep(module), module.folder).to(device)
    if isinstance(module, LayerNorm):
        return load_state(LayerNormStep(module), module.folder).to(device)
    if isinstance(module, Normalize):
        return normalize
    if isinstance(module, Dropout):
        return None
    raise StartupError(f"{type(module).__name__} cannot follow the pooling")


@dataclass
class SentenceHead:
    """Pooling, then the modules after it: token states to sentence vectors."""

    pooling: Pooling
    steps: list[Step]
    normalized: bool
    """Whether the last step is a normalisation (:meth:`vectors` can leave it out)."""

    @classmethod
    def build(cls, config: SentenceConfig | None, device: torch.device) -> SentenceHead:
        """The head of a sentence-transformers model; mean pooling with L2 normalisation
        for a model saved without it (``config`` None)."""
        if config is None:
            return cls(DEFAULT_POOLING, [normalize], normalized=True)
        pooling = config.pooling or DEFAULT_POOLING
        after = config.modules[config.modules.index(pooling) + 1 :] if config.pooling else ()
        built = [step(module, device) for module in after]
        steps = [s for s in built if s is not None]
        return cls(pooling, steps, normalized=bool(steps) and steps[-1] is normalize)

    def vectors(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor,
        pooling_mask: torch.Tensor | None = None,
        normalized: bool = True,
    ) -> torch.Tensor:
        """``[B, S, H]`` token states to ``[B, D]`` float32 vectors, on their device (the
        masks are there too); ``normalized=False`` leaves out a last normalisation."""
        steps = self.steps if normalized or not self.normalized else self.steps[:-1]
        with torch.inference_mode():
            x = pool(hidden.float(), attention_mask, self.pooling.modes, pooling_mask)
            for run in steps:
                x = run(x)
        return x

    def check(self, hidden_size: int, device: torch.device) -> None:
        """Run a batch of zeros through: a module whose sizes do not fit is a startup error,
        not a failure of every request."""
        hidden = torch.zeros(1, 2, hidden_size, device=device)
        try:
            self.vectors(hidden, torch.ones(1, 2, dtype=torch.int64, device=device))
        except RuntimeError as exc:
            raise StartupError(
                f"the sentence-transformers modules do not fit the model's hidden size "
                f"{hidden_size}: {exc}"
            ) from None
