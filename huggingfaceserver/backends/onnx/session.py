"""One ONNX Runtime session per model, shared by the batcher's forward passes."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from transformers import BatchEncoding

from ...pod import threads_within
from . import OnnxUnavailable

logger = logging.getLogger(__name__)

SPIN = False
"""Whether ONNX Runtime's intra-op threads spin between operations (its default): a spinning
worker keeps a core busy between forward passes, a core the HTTP side and the tokenizer need
(measured in BENCHMARKS.md: no loss of throughput without it)."""


def intra_op_threads() -> int:
    """The cores a forward pass may use: torch's own count (the cores of the process's
    affinity, or ``OMP_NUM_THREADS``) within the pod's CPU quota, the rule the torch backend
    starts from."""
    return threads_within(max(1, torch.get_num_threads()))


def session_options(threads: int, spin: bool = SPIN) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1  # one batch at a time: nothing runs beside a forward
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    options.log_severity_level = 3  # errors only: its warnings are about graph internals
    return options


class OnnxSession:
    """Runs a batch of the server's rows (right-padded int64 tensors) through the graph."""

    def __init__(self, session: Any, output: str, threads: int):
        self.session = session
        self.output = output
        self.threads = threads
        self.inputs = [i.name for i in session.get_inputs()]

    @classmethod
    def load(cls, path: str, output: str, threads: int | None = None) -> OnnxSession:
        import onnxruntime

        threads = threads or intra_op_threads()
        try:
            session = onnxruntime.InferenceSession(
                path, session_options(threads), providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own untyped errors
            raise OnnxUnavailable(f"ONNX Runtime cannot load {path}: {exc}") from None
        outputs = [o.name for o in session.get_outputs()]
        if output not in outputs:
            raise OnnxUnavailable(f"{path} gives {outputs}, not {output}")
        return cls(session, output, threads)

    def run_numpy(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """``batch`` holds every input the server has; the graph takes those it declares."""
        feed = {name: np.ascontiguousarray(batch[name]) for name in self.inputs}
        (result,) = self.session.run([self.output], feed)
        return result

    def run(self, batch: BatchEncoding) -> torch.Tensor:
        return torch.from_numpy(self.run_numpy({name: batch[name].numpy() for name in self.inputs}))
