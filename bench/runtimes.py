"""The runtimes an encoder could run on, in this process, no server: plain torch, ONNX Runtime on
the server's export (float32, and ``--quantize int8``), and OpenVINO (its float32 precision, and
its default precision on this CPU, which is bfloat16 where the CPU has bfloat16 instructions).

For MiniLM (embeddings: mean pooling, normalised) and the bench classifier (class probabilities):
sequences/s by batch size (tokenizer + forward + post-processing, padded per batch, the
runtimes alternated within each repeat), and how far each runtime's results are from torch's
(embeddings: the smallest cosine and the largest difference; the classifier: argmax agreement
and the largest probability difference). This is what chose ONNX Runtime for the server's
encoders and kept OpenVINO out (see the section's text), and it measures the cost of int8.
"""

from __future__ import annotations

import importlib.util
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import texts
from .report import num, table
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

KEY = "runtimes"
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
Run = Callable[[dict[str, np.ndarray]], np.ndarray]
"""A runtime: a padded numpy batch to the model's raw output."""


@dataclass
class ModelResult:
    label: str
    rates: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    accuracy: dict[str, str] = field(default_factory=dict)


@dataclass
class RuntimesOutcome:
    results: list[ModelResult]
    notes: list[str]

    def targets(self) -> list[Target]:
        return []

    def section(self) -> list[str]:
        lines = [
            "## Runtimes for encoders, in-process",
            "",
            "Method. In the benchmark process with no server up: tokenizer + forward + "
            "post-processing (MiniLM: mean pooling and normalisation; the classifier: softmax) "
            "in batches padded per batch, each runtime on the same batches, alternated within "
            "each repeat; sequences/s (median over repeats). ONNX Runtime runs the export the "
            "server makes (fused, checked against torch), with the server's session options; "
            "OpenVINO compiles the torch model converted with `openvino.convert_model`, with "
            "as many inference threads, latency hint. 'vs torch': how far the results are from "
            "plain torch's on the bench sentences.",
            "",
        ]
        for result in self.results:
            sizes = sorted(next(iter(result.rates.values())))
            columns = ["runtime", *(f"batch {s}" for s in sizes), "best", "vs torch"]
            rows = []
            for name, rates in result.rates.items():
                medians = {s: statistics.median(v) for s, v in rates.items()}
                best = max(medians, key=medians.__getitem__)
                rows.append(
                    [
                        name,
                        *(num(medians[s], 0) for s in sizes),
                        f"{num(medians[best], 0)} (batch {best})",
                        result.accuracy.get(name, "–"),
                    ]
                )
            lines += [f"**{result.label}** (sequences/s)", "", *table(columns, rows), ""]
        lines += [f"- {note}" for note in self.notes]
        return lines


def openvino_installed() -> bool:
    return importlib.util.find_spec("openvino") is not None


def measure(models: Any, settings: Settings, cache: Path) -> RuntimesOutcome:
    import torch
    from transformers import AutoTokenizer

    sentences = list(texts.SENTENCES)
    count = settings.raw_texts
    batch_texts = [sentences[i % len(sentences)] for i in range(count)]
    results: list[ModelResult] = []
    notes: list[str] = []
    for label, path, task in (
        ("all-MiniLM-L6-v2, embeddings", models.minilm, "text_embedding"),
        ("Classifier with MiniLM's dimensions, probabilities", models.classifier, None),
    ):
        tokenizer = AutoTokenizer.from_pretrained(path)
        runtimes, post = build_runtimes(path, task, cache, notes, torch.get_num_threads())
        result = ModelResult(label)
        reference_batch = encode(tokenizer, sentences)
        outputs = {name: post(run(reference_batch), reference_batch) for name, run in runtimes}
        for name, _ in runtimes:
            result.accuracy[name] = compare(outputs[name], outputs["torch"], task)
        for size in settings.raw_batch_sizes:
            batches = [encode(tokenizer, batch_texts[i : i + size]) for i in range(0, count, size)]
            for _, run in runtimes:  # warm-up: first calls allocate and pick kernels
                run(batches[0])
            for _ in range(settings.repeats):
                for name, run in runtimes:
                    start = time.perf_counter()
                    for batch in batches:
                        post(run(batch), batch)
                    rate = count / (time.perf_counter() - start)
                    result.rates.setdefault(name, {}).setdefault(size, []).append(rate)
            logger.info(
                "%s: %s, batch %d: %s",
                KEY,
                label,
                size,
                ", ".join(
                    f"{name} {statistics.median(result.rates[name][size]):.0f}/s"
                    for name, _ in runtimes
                ),
            )
        results.append(result)
    return RuntimesOutcome(results, notes)


def encode(tokenizer: Any, batch: Sequence[str]) -> dict[str, np.ndarray]:
    encoded = tokenizer(list(batch), padding=True, truncation=True, return_tensors="np")
    return {name: encoded[name].astype(np.int64) for name in INPUTS if name in encoded}


def build_runtimes(
    path: Path, task: str | None, cache: Path, notes: list[str], threads: int
) -> tuple[list[tuple[str, Run]], Callable[[np.ndarray, dict[str, np.ndarray]], np.ndarray]]:
    """The runtimes for the model, and its post-processing of a raw output."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    from huggingfaceserver.backends.onnx.export import GraphSpec
    from huggingfaceserver.backends.onnx.session import OnnxSession
    from huggingfaceserver.backends.onnx.store import ExportStore
    from huggingfaceserver.cli import parse_args
    from huggingfaceserver.loading import load_source

    embedding = task == "text_embedding"
    head = AutoModel if embedding else AutoModelForSequenceClassification
    output = "last_hidden_state" if embedding else "logits"
    model = head.from_pretrained(path).eval()

    def run_torch(batch: dict[str, np.ndarray]) -> np.ndarray:
        with torch.inference_mode():
            result = model(**{k: torch.from_numpy(v) for k, v in batch.items()})
        return getattr(result, output).numpy()

    runtimes: list[tuple[str, Run]] = [("torch", run_torch)]
    argv = ["--model_dir", str(path)] + (["--task", task] if task else [])
    source = load_source(parse_args(argv))
    store = ExportStore(cache / "runtimes-onnx")
    for quantize in (None, "int8"):
        spec = GraphSpec(head.__name__, INPUTS, output, quantize)
        session = store.open(source, spec, False, lambda g: OnnxSession.load(str(g.path), output))

        def run_onnx(batch: dict[str, np.ndarray], session: OnnxSession = session) -> np.ndarray:
            (result,) = session.session.run([output], batch)
            return result

        runtimes.append((f"ONNX Runtime{' int8' if quantize else ''}", run_onnx))
    if openvino_installed():
        runtimes += openvino_runtimes(model, output, threads, notes)
    else:
        notes.append("OpenVINO is not installed here (`pip install openvino`): not measured.")

    def post(raw: np.ndarray, batch: dict[str, np.ndarray]) -> np.ndarray:
        if embedding:
            mask = batch["attention_mask"][..., None].astype(np.float32)
            pooled = (raw * mask).sum(1) / mask.sum(1)
            return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        shifted = np.exp(raw - raw.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)

    return runtimes, post


def openvino_runtimes(model: Any, output: str, threads: int, notes: list[str]):
    import openvino
    import torch

    example = {name: torch.ones(2, 8, dtype=torch.long) for name in INPUTS}
    converted = openvino.convert_model(model, example_input=example)
    core = openvino.Core()
    runtimes = []
    for label, precision in (("OpenVINO f32", "f32"), ("OpenVINO default precision", None)):
        config: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
        if precision:
            config["INFERENCE_PRECISION_HINT"] = precision
        compiled = core.compile_model(converted, "CPU", config)
        used = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        if precision is None:
            label = f"OpenVINO default precision ({used})"
            note = f"OpenVINO {openvino.__version__}: its default precision on this CPU is {used}."
            if note not in notes:
                notes.append(note)

        def run(batch: dict[str, np.ndarray], compiled: Any = compiled) -> np.ndarray:
            return compiled(batch)[0]

        runtimes.append((label, run))
    return runtimes


def compare(got: np.ndarray, want: np.ndarray, task: str | None) -> str:
    if task == "text_embedding":
        cosine = (got * want).sum(1)
        return f"cosine >= {cosine.min():.5f}, max diff {np.abs(got - want).max():.1e}"
    agree = int((got.argmax(1) == want.argmax(1)).sum())
    return f"argmax {agree}/{len(got)}, max prob diff {np.abs(got - want).max():.1e}"
