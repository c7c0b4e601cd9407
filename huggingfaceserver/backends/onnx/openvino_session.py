"""OpenVINO running the model's plain ONNX export (``--backend openvino``): one compiled model
and one infer request, used by the batcher's thread alone.

OpenVINO reads the ONNX file itself and compiles it for the CPU. Its inference precision is
float32 unless ``--dtype bfloat16`` asks for bfloat16, which OpenVINO's own default would pick
on CPUs with bfloat16 instructions: faster there, and no longer equal to torch (BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import BatchEncoding

from . import OnnxUnavailable
from .session import intra_op_threads

PRECISIONS = {torch.float32: "f32", torch.bfloat16: "bf16"}
"""``--dtype`` to OpenVINO's inference precision (inputs and outputs stay float32)."""


class OpenVinoSession:
    def __init__(self, compiled: Any, output: str, threads: int, precision: str):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.output = compiled.output(output)
        self.inputs = [port.get_any_name() for port in compiled.inputs]
        self.threads = threads
        self.precision = precision

    @classmethod
    def load(
        cls,
        path: str,
        output: str,
        threads: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> OpenVinoSession:
        try:
            import openvino
        except ImportError:
            raise OnnxUnavailable(
                "OpenVINO is not installed: `pip install huggingfaceserver[openvino]`"
            ) from None
        if dtype not in PRECISIONS:
            raise OnnxUnavailable(f"OpenVINO runs float32 or bfloat16, not {dtype}")
        threads = threads or intra_op_threads()
        config = {
            "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY",  # one batch at a time, on every thread
            "INFERENCE_PRECISION_HINT": PRECISIONS[dtype],
        }
        try:
            core = openvino.Core()
            compiled = core.compile_model(core.read_model(path), "CPU", config)
            compiled.output(output)
        except Exception as exc:  # noqa: BLE001 - OpenVINO raises its own untyped errors
            raise OnnxUnavailable(f"OpenVINO cannot compile {path}: {exc}") from None
        return cls(compiled, output, threads, PRECISIONS[dtype])

    def run_numpy(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        feed = {name: np.ascontiguousarray(batch[name]) for name in self.inputs}
        self.request.infer(feed)
        return np.array(self.request.get_tensor(self.output).data)  # a copy: the next run reuses it

    def run(self, batch: BatchEncoding) -> torch.Tensor:
        return torch.from_numpy(self.run_numpy({name: batch[name].numpy() for name in self.inputs}))
