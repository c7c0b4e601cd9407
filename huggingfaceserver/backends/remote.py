"""Transformer mode: tokenize here, run the model on a remote V2 predictor (e.g. Triton).

With ``--predictor_host`` the server loads only the tokenizer, sends the tokenizer outputs
named by ``--tensor_input_names`` (all of them by default) to the predictor over Open Inference
Protocol REST or gRPC (``--predictor_protocol v2`` / ``grpc-v2``), and post-processes the
predictor's first output (logits, or the last hidden state for embeddings) exactly as the
transformers backend post-processes its own.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import httpx
import torch
from kserve.inference_client import InferenceGRPCClient, InferenceRESTClient, RESTConfig
from kserve.protocol.infer_type import InferInput, InferRequest, InferResponse
from transformers import BatchEncoding

from ..cli import ServerConfig
from ..errors import StartupError, UpstreamError
from ..loading import ModelSource
from .encoding import Row
from .tokenizing import TokenizingEncoder

logger = logging.getLogger(__name__)

NUMPY_TO_V2 = {"int64": "INT64", "int32": "INT32", "float32": "FP32", "bool": "BOOL"}
Send = Callable[[InferRequest], Awaitable[InferResponse]]


class RemoteEncoder(TokenizingEncoder):
    name = "remote"
    warms_up = False  # the predictor is served and probed on its own

    def __init__(self, source: ModelSource, config: ServerConfig):
        super().__init__(source, config)
        s = config.server
        self.host: str = s["predictor_host"]
        self.protocol: str = s["predictor_protocol"]
        if self.protocol not in ("v2", "grpc-v2"):
            raise StartupError(
                f"--predictor_host needs --predictor_protocol v2 or grpc-v2, not {self.protocol}"
            )
        self._send: Send | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        """The event loop the predictor calls run on (the one requests arrive on)."""

    def load_model(self) -> None:
        s = self.config.server
        if self.protocol == "grpc-v2":
            grpc = InferenceGRPCClient(
                self.host,
                use_ssl=s["predictor_use_ssl"],
                timeout=s["predictor_request_timeout_seconds"],
                retries=s["predictor_request_retries"],
            )
            self._send = grpc.infer
        else:
            rest = InferenceRESTClient(
                RESTConfig(
                    protocol="v2",
                    retries=s["predictor_request_retries"],
                    timeout=s["predictor_request_timeout_seconds"],
                )
            )
            scheme = "https" if s["predictor_use_ssl"] else "http"
            base_url = f"{scheme}://{self.host}"

            async def send(request: InferRequest) -> InferResponse:
                return await rest.infer(base_url, request, model_name=self.config.model_name)

            self._send = send
        logger.info("transformer mode: model runs on %s (%s)", self.host, self.protocol)

    def to_request(self, batch: BatchEncoding) -> InferRequest:
        """The tokenizer outputs the predictor takes, as V2 tensors."""
        names = self.config.tensor_input_names
        inputs = []
        for name, tensor in batch.items():
            if name == "offset_mapping" or (names is not None and name not in names):
                continue
            array = tensor.numpy()
            inputs.append(InferInput(name, list(array.shape), NUMPY_TO_V2[str(array.dtype)], array))
        return InferRequest(
            model_name=self.config.model_name, infer_inputs=inputs, request_id=str(uuid.uuid4())
        )

    def submit_rows(self, rows: list[Row], kind: str) -> Awaitable[list[Any]]:
        self.loop = asyncio.get_running_loop()
        return super().submit_rows(rows, kind)

    def forward_batch(self, batch: BatchEncoding) -> torch.Tensor:
        """The predictor's answer for a merged batch: the call runs on the event loop."""
        assert self.loop is not None, "rows are submitted on the event loop first"
        return asyncio.run_coroutine_threadsafe(self.run(batch), self.loop).result()

    async def run(self, batch: BatchEncoding) -> torch.Tensor:
        assert self._send is not None, "load() first"
        try:
            response = await self._send(self.to_request(batch))
        except (httpx.HTTPError, grpc.RpcError) as exc:
            raise UpstreamError(f"predictor {self.host} failed: {exc}") from exc
        return torch.from_numpy(response.outputs[0].as_numpy().copy())
