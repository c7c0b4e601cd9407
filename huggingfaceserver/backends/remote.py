"""Transformer mode: tokenize here, run the model on a remote V2 predictor (e.g. Triton).

With ``--predictor_host`` the server loads only the tokenizer, sends the tokenizer outputs
named by ``--tensor_input_names`` (all of them by default) to the predictor over Open Inference
Protocol REST or gRPC (``--predictor_protocol v2`` / ``grpc-v2``), and post-processes the
predictor's first output (logits, or the last hidden state for embeddings) exactly as the
transformers backend post-processes its own.

Each request's rows go to the predictor in calls of their own (cut to ``--max_batch_tokens`` /
``--max_batch_size``; the predictor batches across calls, as Triton's dynamic batcher does), at
most ``--max_concurrent_predictor_calls`` at once, on the event loop: no thread waits on the
network. A call still unanswered after ``--predictor_request_timeout_seconds`` (counted from
when the request's rows were ready, waiting for a free call included) fails its request with a
504 and frees its place; a hung predictor call never holds up the calls beside it. Padding the
rows and post-processing the outputs (torch) run on the tokenizing thread, off the loop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import grpc
import httpx
import torch
from kserve.inference_client import InferenceGRPCClient, InferenceRESTClient, RESTConfig
from kserve.protocol.infer_type import InferInput, InferRequest, InferResponse
from transformers import BatchEncoding

from ..cli import ServerConfig
from ..errors import StartupError, UpstreamError, UpstreamTimeout
from ..loading import ModelSource
from .batching import BatchLimits, EncodeRequest, collate, plan_batches
from .row_tokenizer import Row
from .tokenizing import TokenizingEncoder, results_by_kind

logger = logging.getLogger(__name__)

NUMPY_TO_V2 = {"int64": "INT64", "int32": "INT32", "float32": "FP32", "bool": "BOOL"}
SERVER_COLUMNS = frozenset({"offset_mapping", "pooling_mask"})
"""Row columns the server keeps for itself (what results read), never model inputs."""
Send = Callable[[InferRequest], Awaitable[InferResponse]]


class RemoteEncoder(TokenizingEncoder):
    name = "remote"
    warms_up = False  # the predictor is served and probed on its own

    def __init__(self, source: ModelSource, config: ServerConfig):
        super().__init__(source, config)
        s = config.server
        self.host: str = s.predictor_host or ""  # set: RemoteEncoder is transformer mode
        self.protocol: str = s.predictor_protocol
        if self.protocol not in ("v2", "grpc-v2"):
            raise StartupError(
                f"--predictor_host needs --predictor_protocol v2 or grpc-v2, not {self.protocol}"
            )
        self.send: Send | None = None
        self.timeout_s = float(s.predictor_request_timeout_seconds)
        self.calls = asyncio.Semaphore(config.max_concurrent_predictor_calls)
        """At most ``--max_concurrent_predictor_calls`` in flight (it binds to the loop that
        first waits on it: the serving loop)."""

    def load_model(self) -> None:
        s = self.config.server
        if self.protocol == "grpc-v2":
            grpc = InferenceGRPCClient(
                self.host,
                use_ssl=s.predictor_use_ssl,
                timeout=s.predictor_request_timeout_seconds,
                retries=s.predictor_request_retries,
            )
            self.send = grpc.infer
        else:
            rest = InferenceRESTClient(
                RESTConfig(
                    protocol="v2",
                    retries=s.predictor_request_retries,
                    timeout=s.predictor_request_timeout_seconds,
                )
            )
            scheme = "https" if s.predictor_use_ssl else "http"
            base_url = f"{scheme}://{self.host}"

            async def send(request: InferRequest) -> InferResponse:
                return await rest.infer(base_url, request, model_name=self.config.model_name)

            self.send = send
        logger.info("transformer mode: model runs on %s (%s)", self.host, self.protocol)

    def to_request(self, batch: BatchEncoding) -> InferRequest:
        """The tokenizer outputs the predictor takes, as V2 tensors."""
        names = self.config.tensor_input_names
        inputs = []
        for name, tensor in batch.items():
            if name in SERVER_COLUMNS or (names is not None and name not in names):
                continue
            array = tensor.numpy()
            inputs.append(InferInput(name, list(array.shape), NUMPY_TO_V2[str(array.dtype)], array))
        return InferRequest(
            model_name=self.config.model_name, infer_inputs=inputs, request_id=str(uuid.uuid4())
        )

    def preparing(self) -> AbstractContextManager[None]:
        return nullcontext()  # no batch waits for this request: its rows get calls of their own

    def submit_rows(self, rows: list[Row], kind: str) -> Awaitable[list[Any]]:
        return self.predict_rows(rows, kind)

    async def predict_rows(self, rows: list[Row], kind: str) -> list[Any]:
        """A request's rows, in as many predictor calls as the batch limits ask, run together;
        a result per row, in order."""
        size = self.config.max_batch_size or self.default_max_batch_size()
        limits = BatchLimits(self.config.max_batch_tokens, size)
        request = EncodeRequest(rows, settle=lambda _: None, kind=kind)
        plan = plan_batches([(request, index) for index in range(len(rows))], limits)
        try:
            async with asyncio.timeout(self.timeout_s):
                parts = await asyncio.gather(
                    *(self.predict_batch([rows[i] for _, i in part], kind) for part in plan)
                )
        except TimeoutError:
            raise UpstreamTimeout(
                f"predictor {self.host} did not answer within {self.timeout_s:g} s "
                "(--predictor_request_timeout_seconds)"
            ) from None
        results: list[Any] = [None] * len(rows)
        for part, answers in zip(plan, parts, strict=True):
            for (_, index), answer in zip(part, answers, strict=True):
                results[index] = answer
        return results

    async def predict_batch(self, rows: list[Row], kind: str) -> list[Any]:
        batch = await self.off_loop(collate, rows, self.batcher.pad_values)
        async with self.calls:
            output = await self.run(batch)
        return await self.off_loop(results_by_kind, self.task, output, batch, [kind] * len(rows))

    def forward_batch(self, batch: BatchEncoding) -> torch.Tensor:
        raise NotImplementedError("the predictor runs the model: see predict_rows")

    async def run(self, batch: BatchEncoding) -> torch.Tensor:
        assert self.send is not None, "load() first"
        try:
            response = await self.send(self.to_request(batch))
        except (httpx.HTTPError, grpc.RpcError) as exc:
            raise UpstreamError(f"predictor {self.host} failed: {exc}") from exc
        return torch.from_numpy(response.outputs[0].as_numpy().copy())
