"""The encoder backend on the model's ONNX export: the torch backend's tokenizer, batcher and
results, with the forward pass run by ONNX Runtime or OpenVINO (:data:`RUNTIMES`)."""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from transformers import BatchEncoding

from ...cli import EXPORT_MAX_BATCH_SIZE, ServerConfig
from ...errors import StartupError
from ...loading import ModelSource
from ...observability.startup import STARTUP
from ..pytorch.encoder import TransformersEncoder
from . import OnnxUnavailable
from .export import GraphSpec
from .session import OnnxSession
from .store import ExportStore, StoredGraph

logger = logging.getLogger(__name__)


class GraphSession(Protocol):
    """A loaded export: runs the server's padded batches."""

    threads: int

    def run(self, batch: BatchEncoding) -> torch.Tensor: ...


RUNTIMES: dict[str, tuple[str, str]] = {
    "onnx": ("onnxruntime", "ONNX Runtime"),
    "openvino": ("openvino", "OpenVINO"),
}
"""``--backend`` value -> the runtime its graph is made for (:class:`GraphSpec`), its name."""


class OnnxEncoder(TransformersEncoder):
    """The model's ONNX export on ONNX Runtime (``--backend onnx``, and ``auto`` for encoder
    tasks on CPU) or OpenVINO (``--backend openvino``). ``fallback``: where the runtime cannot
    serve the model, torch does, with the reason logged."""

    def __init__(
        self,
        source: ModelSource,
        config: ServerConfig,
        fallback: bool = False,
        store: ExportStore | None = None,
        backend: str = "onnx",
    ):
        super().__init__(source, config)
        self.name = backend
        self.runtime, self.runtime_name = RUNTIMES[backend]
        self.fallback = fallback
        self.store = store or ExportStore.in_cache(config.cache_dir)
        self.session: GraphSession | None = None
        self.graph: StoredGraph | None = None
        """The export the session runs (None on torch)."""

    def spec(self) -> GraphSpec:
        inputs = ["input_ids", "attention_mask"]
        if self.inputs.token_type_ids:
            inputs.append("token_type_ids")
        return GraphSpec(
            self.task.auto_model,
            tuple(inputs),
            self.task.output_field,
            self.config.quantize,
            self.runtime,
        )

    def unsupported(self) -> str | None:
        """Why the runtime does not serve the model here, before trying."""
        if self.device.type == "cuda":
            return "a CUDA device runs encoders on torch"
        if self.dtype not in (torch.float32, *self.other_dtypes()):
            return f"--dtype {self.config.dtype}: the export runs in float32"
        if self.config.quantize and self.runtime != "onnxruntime":
            return f"--quantize {self.config.quantize} quantises for ONNX Runtime only"
        if self.fallback and self.config.trust_remote_code:
            return "custom model code (--trust_remote_code) is not exported automatically"
        return None

    def load_model(self) -> None:
        try:
            reason = self.unsupported()
            if reason is not None:
                raise OnnxUnavailable(reason)
            with STARTUP.phase("weights"):  # an export, when there is none yet, included
                self.session = self.store.open(
                    self.source, self.spec(), self.config.trust_remote_code, self.open_session
                )
        except OnnxUnavailable as exc:
            if not self.fallback:
                raise StartupError(
                    f"--backend {self.name}: {self.runtime_name} cannot serve the model: {exc}"
                ) from None
            logger.warning(
                "ONNX Runtime cannot serve the model (%s): running it on torch%s",
                exc,
                f" (without --quantize {self.config.quantize})" if self.config.quantize else "",
            )
            self.name = "huggingface"
            super().load_model()

    def other_dtypes(self) -> tuple[torch.dtype, ...]:
        """Inference precisions beside float32 that the runtime offers (``--dtype``)."""
        if self.runtime == "openvino":
            from .openvino_session import PRECISIONS

            return tuple(PRECISIONS)
        return ()

    def open_session(self, graph: StoredGraph) -> GraphSession:
        session: GraphSession
        if self.runtime == "openvino":
            from .openvino_session import OpenVinoSession

            session = OpenVinoSession.load(
                str(graph.path), self.task.output_field, dtype=self.dtype
            )
        else:
            session = OnnxSession.load(str(graph.path), self.task.output_field)
        self.graph = graph
        logger.info(
            "loaded the ONNX export of %s on %s (%s, %s; %s, %d threads, %s, max length %d)",
            self.source.path.name,
            self.runtime_name,
            self.task.task.value,
            graph.origin,
            graph.record["built"]["origin"],
            session.threads,
            self.dtype,
            self.max_length,
        )
        return session

    def results_device(self) -> str:
        """The runtime's outputs are NumPy arrays on the host; torch's (the fallback) are on
        its device."""
        return "cpu" if self.session is not None else super().results_device()

    def release_model(self) -> None:
        self.session = None  # the session holds the weights (and its threads)
        super().release_model()

    def default_max_batch_size(self) -> int:
        if self.session is None:
            return super().default_max_batch_size()
        return EXPORT_MAX_BATCH_SIZE

    def tune(self) -> None:
        if self.session is None:
            super().tune()

    def forward_batch(self, batch: BatchEncoding) -> torch.Tensor:
        if self.session is None:
            return super().forward_batch(batch)
        return self.session.run(batch)
