"""The encoder backend on ONNX Runtime: the torch backend's tokenizer, batcher and results,
with the forward pass run by an ONNX Runtime session on the model's export."""

from __future__ import annotations

import logging

import torch
from transformers import BatchEncoding

from ...cli import ServerConfig
from ...errors import StartupError
from ...loading import ModelSource
from ...startup import STARTUP
from ..transformers import TransformersEncoder
from . import OnnxUnavailable
from .export import GraphSpec
from .session import OnnxSession
from .store import ExportStore, StoredGraph

logger = logging.getLogger(__name__)


class OnnxEncoder(TransformersEncoder):
    """``--backend onnx``, and ``auto`` for encoder tasks on CPU (``fallback``: where ONNX
    Runtime cannot serve the model, torch does, with the reason logged)."""

    name = "onnx"

    def __init__(
        self,
        source: ModelSource,
        config: ServerConfig,
        fallback: bool = False,
        store: ExportStore | None = None,
    ):
        super().__init__(source, config)
        self.fallback = fallback
        self.store = store or ExportStore.default()
        self.session: OnnxSession | None = None
        self.graph: StoredGraph | None = None
        """The export the session runs (None on torch)."""

    def spec(self) -> GraphSpec:
        inputs = ["input_ids", "attention_mask"]
        if self.inputs.token_type_ids:
            inputs.append("token_type_ids")
        return GraphSpec(
            self.task.auto_model, tuple(inputs), self.task.output_field, self.config.quantize
        )

    def unsupported(self) -> str | None:
        """Why ONNX Runtime does not serve the model here, before trying."""
        if self.device.type == "cuda":
            return "a CUDA device runs encoders on torch"
        if self.dtype != torch.float32:
            return f"--dtype {self.config.dtype}: the export runs in float32"
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
                    f"--backend onnx: ONNX Runtime cannot serve the model: {exc}"
                ) from None
            logger.warning(
                "ONNX Runtime cannot serve the model (%s): running it on torch%s",
                exc,
                f" (without --quantize {self.config.quantize})" if self.config.quantize else "",
            )
            self.name = "huggingface"
            super().load_model()

    def open_session(self, graph: StoredGraph) -> OnnxSession:
        session = OnnxSession.load(str(graph.path), self.task.output_field)
        self.graph = graph
        logger.info(
            "loaded the ONNX export of %s (%s, %s; %s, %d intra-op threads, max length %d)",
            self.source.path.name,
            self.task.task.value,
            graph.origin,
            graph.record["built"]["origin"],
            session.threads,
            self.max_length,
        )
        return session

    def shutdown(self) -> None:
        super().shutdown()
        self.session = None  # the session holds the weights

    def tune(self) -> None:
        if self.session is None:
            super().tune()

    def forward_batch(self, batch: BatchEncoding) -> torch.Tensor:
        if self.session is None:
            return super().forward_batch(batch)
        return self.session.run(batch)
