"""An encoder as an ONNX graph: exported with torch's exporter (or taken from the model folder's
own ``onnx/model.onnx``), fused with ONNX Runtime's transformer optimizer, optionally quantised
to int8, and checked against the torch model before it is used.

The export runs the model with eager attention: its graph is the one ONNX Runtime's fusions
recognise (one ``Attention`` node per layer, ``EmbedLayerNormalization``,
``SkipLayerNormalization``, ``BiasGelu``), where the scaled-dot-product graph keeps every
attention step as separate nodes.
The legacy (TorchScript) exporter is used: it traces the encoder in about a second, where the
``torch.export`` one takes several, and the fusions were written for its graphs. A graph whose
outputs differ from torch's on inputs of other shapes than the traced ones is refused
(:class:`~.OnnxUnavailable`), the fused one first and then the plain one.
"""

from __future__ import annotations

import copy
import gc
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from ...loading import ModelSource
from ...model_facts import context_length
from . import OnnxUnavailable

logger = logging.getLogger(__name__)

OPSET = 17
"""LayerNormalization is an ONNX operator from 17 on."""
SHIPPED_FILES = ("onnx/model.onnx", "model.onnx")
"""Where model folders (sentence-transformers repos, optimum exports) keep their export."""
EXPORT_SHAPE = (2, 12)
"""Rows and tokens of the batch the export traces."""
CHECK_LENGTHS = ((64, 9, 1), (3,))
"""Rows (their real lengths, right-padded to the longest) of the batches that check a graph:
other shapes than the traced one, padding, a one-token row, a row longer than a local
attention window (cut to the model's positions)."""
ABS_TOLERANCE = 1e-4
REL_TOLERANCE = 1e-3
"""How far a float32 graph's outputs may be from torch's, per value (scaled by torch's)."""
INT8_MIN_COSINE = 0.9
"""An int8 graph whose outputs point elsewhere than the float32 graph's (per row) is broken."""

# config.json model types whose encoders ONNX Runtime's BERT fusions apply to; others are
# exported and run without fusions
FUSED_MODEL_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "albert", "camembert", "mpnet"}
)


@dataclass(frozen=True)
class GraphSpec:
    """What the server feeds the graph and reads from it."""

    auto_model: str
    """The ``transformers`` auto class of the task's torch model."""
    inputs: tuple[str, ...]
    """Model inputs the server's rows may carry (``input_ids``, ``attention_mask``, and
    ``token_type_ids`` where the tokenizer gives them); the graph takes those the model does."""
    output: str
    """The model output the task reads: ``logits`` or ``last_hidden_state``."""
    quantize: str | None = None
    """``int8``: dynamic quantisation of the graph's weights."""
    runtime: str = "onnxruntime"
    """What runs the graph: ``onnxruntime`` (fused with its own operators) or ``openvino``
    (the plain ONNX graph, which OpenVINO reads and optimises itself)."""


@dataclass
class BuiltGraph:
    """How a graph was made, for the log and the cache's record."""

    origin: str  # "export" or the shipped file's name
    fused: dict[str, int] = field(default_factory=dict)
    max_difference: float = 0.0
    """Largest difference from torch's outputs on the check batches (float32 graph)."""
    int8_min_cosine: float | None = None

    def describe(self) -> str:
        fused = ", ".join(f"{count} {name}" for name, count in self.fused.items() if count)
        text = f"{self.origin}, fusions: {fused or 'none'}, max difference to torch "
        text += f"{self.max_difference:.1e}"
        if self.int8_min_cosine is not None:
            text += f", int8 (cosine to float32 >= {self.int8_min_cosine:.4f})"
        return text


class GraphOutput(torch.nn.Module):
    """The model as a function of its input tensors, in a fixed order, to its one output."""

    def __init__(self, model: torch.nn.Module, inputs: Sequence[str], output: str):
        super().__init__()
        self.model = model
        self.names = list(inputs)
        self.output = output

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        result = self.model(**dict(zip(self.names, tensors, strict=True)), return_dict=True)
        return getattr(result, self.output)


def load_torch_model(source: ModelSource, spec: GraphSpec, trust_remote_code: bool) -> Any:
    """The task's torch model in float32 with eager attention (the graph the fusions know)."""
    auto_class = getattr(transformers, spec.auto_model)
    config = copy.deepcopy(source.config)  # from_pretrained records the attention on it
    try:
        model = auto_class.from_pretrained(
            source.path,
            config=config,
            dtype=torch.float32,
            attn_implementation="eager",
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError, ImportError) as exc:
        raise OnnxUnavailable(f"the torch model does not load for the export: {exc}") from None
    return model.eval()


def graph_inputs(model: Any, spec: GraphSpec) -> list[str]:
    """The inputs of ``spec`` that the model's forward takes, in the spec's order."""
    import inspect

    accepted = set(inspect.signature(model.forward).parameters)
    names = [name for name in spec.inputs if name in accepted]
    if "input_ids" not in names:
        raise OnnxUnavailable(f"{type(model).__name__}.forward takes no input_ids")
    return names


def probe_batch(
    lengths: Sequence[int], names: Sequence[str], config: Any, seed: int
) -> dict[str, np.ndarray]:
    """Right-padded random token ids with these real lengths (pairs' second segment in the
    first row where the model has token types)."""
    generator = np.random.default_rng(seed)
    lengths = [min(length, position_limit(config)) for length in lengths]
    vocab = int(config.vocab_size)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    width = max(lengths)
    ids = np.full((len(lengths), width), pad, dtype=np.int64)
    mask = np.zeros((len(lengths), width), dtype=np.int64)
    for row, length in enumerate(lengths):
        ids[row, :length] = generator.integers(0, vocab, length)
        mask[row, :length] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in names:
        types = np.zeros_like(ids)
        if (getattr(config, "type_vocab_size", 0) or 0) > 1:
            types[0, lengths[0] // 2 : lengths[0]] = 1
        batch["token_type_ids"] = types
    return {name: batch[name] for name in names}


def position_limit(config: Any) -> int:
    """Tokens a row may have: the model's context length (RoBERTa-like models' positions from
    the padding id on taken off), 512 where its config sets none."""
    return context_length(config) or 512


def torch_output(model: Any, names: Sequence[str], output: str, batch: dict[str, np.ndarray]):
    with torch.inference_mode():
        result = model(**{name: torch.from_numpy(batch[name]) for name in names}, return_dict=True)
    return getattr(result, output).float().numpy()


def export(model: Any, names: Sequence[str], output: str, config: Any, path: Path) -> None:
    """``torch.onnx.export`` with batch and sequence axes left open."""
    probe = probe_batch(
        [EXPORT_SHAPE[1], EXPORT_SHAPE[1] // 2 + 1][: EXPORT_SHAPE[0]], names, config, seed=0
    )
    args = tuple(torch.from_numpy(probe[name]) for name in names)
    axes: dict[str, dict[int, str]] = {name: {0: "batch", 1: "sequence"} for name in names}
    axes[output] = {0: "batch", 1: "sequence"} if output == "last_hidden_state" else {0: "batch"}
    if output == "logits" and torch_output(model, names, output, probe).ndim == 3:
        axes[output] = {0: "batch", 1: "sequence"}  # per-token logits
    try:
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")  # the exporter's tracer warnings, checked below
            torch.onnx.export(
                # eval: the exporter puts the module back in its mode afterwards, and a new
                # module is in training mode (dropout on, in the model too)
                GraphOutput(model, names, output).eval(),
                args,
                str(path),
                input_names=list(names),
                output_names=[output],
                dynamic_axes=axes,
                opset_version=OPSET,
                dynamo=False,
            )
    except Exception as exc:  # noqa: BLE001 - any exporter failure means: torch serves it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OnnxUnavailable(f"torch.onnx.export failed: {first}") from None


def fuse(source: Path, target: Path, config: Any) -> dict[str, int]:
    """ONNX Runtime's transformer fusions (attention, embedding and skip layer norms, GELU)
    into ``target``; the fused node counts."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", 0)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "dim", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = optimizer.optimize_model(
            str(source),
            model_type="bert",
            num_heads=int(heads or 0),
            hidden_size=int(hidden or 0),
            optimization_options=FusionOptions("bert"),
            opt_level=0,
        )
    model.save_model_to_file(str(target), use_external_data_format=needs_external_data(source))
    return {name: count for name, count in model.get_fused_operator_statistics().items() if count}


def quantize_int8(source: Path, target: Path) -> None:
    """Dynamic quantisation: int8 weights (a scale per output channel), activations quantised
    per batch at run time."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        quantize_dynamic(
            source,
            target,
            weight_type=QuantType.QInt8,
            per_channel=True,  # MiniLM: cosine to float32 >= 0.985 per sentence, 0.92 without
            use_external_data_format=needs_external_data(source),
            # the fused operators are ONNX Runtime's own, unknown to ONNX's shape inference
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    except Exception as exc:  # noqa: BLE001 - the quantiser's own failures
        raise OnnxUnavailable(f"int8 quantisation failed: {exc}") from None


def needs_external_data(path: Path) -> bool:
    """Protobuf holds at most 2 GiB: larger models keep their weights beside the graph."""
    total = sum(p.stat().st_size for p in path.parent.iterdir() if p.name.startswith(path.name))
    return total > 1_800_000_000


Runner = Callable[[dict[str, np.ndarray]], np.ndarray]
"""A graph loaded for the checks: a batch (every input the server has) to its one output."""


def runner_for_check(path: Path, output: str, runtime: str = "onnxruntime") -> Runner:
    """The graph at ``path`` on ``runtime`` (OpenVINO in float32), on one thread, loaded as the
    server loads it."""
    if runtime == "openvino":
        from .openvino_session import OpenVinoSession

        return OpenVinoSession.load(str(path), output, threads=1).run_numpy
    from .session import OnnxSession

    return OnnxSession.load(str(path), output, threads=1).run_numpy


def valid_positions(reference: np.ndarray, batch: dict[str, np.ndarray]) -> np.ndarray:
    """Per-token outputs compared where a token is (padding's outputs are never read)."""
    if reference.ndim == 3:
        return batch["attention_mask"].astype(bool)
    return np.ones(reference.shape[:1], dtype=bool)


def difference_to_torch(
    path: Path,
    model: Any,
    names: Sequence[str],
    output: str,
    config: Any,
    runtime: str = "onnxruntime",
) -> tuple[float, float]:
    """How far the graph's outputs on ``runtime`` are from torch's on :data:`CHECK_LENGTHS`:
    the largest difference relative to the tolerance (1.0 is the tolerance), and the largest
    absolute one. OnnxUnavailable when the graph does not run or gives another shape."""
    run = runner_for_check(path, output, runtime)
    worst = largest = 0.0
    for seed, lengths in enumerate(CHECK_LENGTHS, start=1):
        batch = probe_batch(lengths, names, config, seed)
        expected = torch_output(model, names, output, batch)
        try:
            got = run(batch)
        except Exception as exc:  # noqa: BLE001 - the runtimes raise their own untyped errors
            raise OnnxUnavailable(f"the graph fails on a batch of {lengths}: {exc}") from None
        if got.shape != expected.shape:
            raise OnnxUnavailable(f"the graph gives {got.shape} where torch gives {expected.shape}")
        where = valid_positions(expected, batch)
        diff = np.abs(got[where] - expected[where])
        allowed = ABS_TOLERANCE + REL_TOLERANCE * np.abs(expected[where])
        worst = max(worst, float(np.max(diff / allowed)))
        largest = max(largest, float(np.max(diff)))
    return worst, largest


def min_row_cosine(int8: Path, float32: Path, names: Sequence[str], output: str, config: Any):
    """Per row (and token), the cosine of the int8 graph's output to the float32 one's."""
    worst = 1.0
    runs = [runner_for_check(path, output) for path in (int8, float32)]
    for seed, lengths in enumerate(CHECK_LENGTHS, start=1):
        batch = probe_batch(lengths, names, config, seed)
        outputs = [run(batch) for run in runs]
        where = valid_positions(outputs[1], batch)
        a, b = (o[where].reshape(-1, o.shape[-1]) for o in outputs)
        cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
        worst = min(worst, float(cosine.min()))
    return worst


def shipped_graph(folder: Path, names: Sequence[str], output: str) -> Path | None:
    """The folder's own export, when it takes what the server feeds and gives the output."""
    import onnx

    for relative in SHIPPED_FILES:
        path = folder / relative
        if not path.is_file():
            continue
        try:
            graph = onnx.load(str(path), load_external_data=False).graph
        except Exception:  # noqa: BLE001 - a damaged or foreign file: export instead
            logger.info("%s does not load as ONNX: exporting the model instead", path)
            continue
        initializers = {i.name for i in graph.initializer}
        takes = {i.name for i in graph.input if i.name not in initializers}
        gives = {o.name for o in graph.output}
        if "input_ids" in takes and takes <= set(names) and output in gives:
            return path
        logger.info(
            "%s takes %s and gives %s, not what the server feeds and reads: exporting instead",
            path,
            sorted(takes),
            sorted(gives),
        )
    return None


def build(
    source: ModelSource, spec: GraphSpec, target: Path, workdir: Path, trust_remote_code: bool
) -> BuiltGraph:
    """The checked graph for ``spec`` at ``target`` (external weights beside it), made in
    ``workdir``. Raises :class:`OnnxUnavailable` with the reason when there is none."""
    model = load_torch_model(source, spec, trust_remote_code)
    try:
        names = graph_inputs(model, spec)
        config = source.config
        candidates: list[tuple[str, Path]] = []
        shipped = shipped_graph(source.path, names, spec.output)
        if shipped is not None:
            candidates.append((str(shipped.relative_to(source.path)), shipped))
        exported = workdir / "exported.onnx"
        reasons: list[str] = []
        for origin, plain in [*candidates, ("export", exported)]:
            if origin == "export":
                export(model, names, spec.output, config, exported)
            built = BuiltGraph(origin)
            fused = workdir / f"fused-{len(reasons)}.onnx"
            attempts: list[Path] = [plain]
            if spec.runtime == "onnxruntime" and config.model_type in FUSED_MODEL_TYPES:
                try:
                    built.fused = fuse(plain, fused, config)
                    attempts.insert(0, fused)
                except Exception as exc:  # noqa: BLE001 - the optimizer's own failures
                    logger.info("ONNX Runtime's fusions failed (%s): the graph runs unfused", exc)
            for graph in attempts:
                what = f"{origin}{' (fused)' if graph is fused else ''}"
                try:
                    worst, built.max_difference = difference_to_torch(
                        graph, model, names, spec.output, config, spec.runtime
                    )
                except OnnxUnavailable as exc:  # a graph the runtime cannot run: the next one
                    reasons.append(f"{what}: {exc}")
                    continue
                if worst <= 1.0:
                    if graph is not fused:
                        built.fused = {}
                    return finish(graph, target, built, spec, names, config)
                reasons.append(f"{what} is {worst:.1f}x the tolerance away from torch")
        raise OnnxUnavailable("; ".join(reasons))
    finally:
        del model
        gc.collect()


def finish(
    graph: Path, target: Path, built: BuiltGraph, spec: GraphSpec, names: Sequence[str], config: Any
) -> BuiltGraph:
    """The checked float32 graph (quantised when asked) written to ``target``."""
    import onnx

    if spec.quantize == "int8":
        quantize_int8(graph, target)
        built.int8_min_cosine = min_row_cosine(target, graph, names, spec.output, config)
        if built.int8_min_cosine < INT8_MIN_COSINE:
            raise OnnxUnavailable(
                f"the int8 graph's outputs are too far from float32 ones (cosine "
                f"{built.int8_min_cosine:.3f})"
            )
        return built
    model = onnx.load(str(graph))
    onnx.save_model(
        model,
        str(target),
        save_as_external_data=needs_external_data(graph),
        location=target.name + ".data",
    )
    return built
