"""The gRPC port's rules (:class:`~huggingfaceserver.edge.grpc_policy.PolicyInterceptor`), in
process: a real ``grpc.aio`` server with KServe's generated service and a servicer of ours, called
through a real channel. The interceptor wraps each unary call in a handler of its own, built with
grpc's public constructor: the call still reaches the servicer with its request deserialized and
its response serialized, admitted, logged, and refused (with its code) where the rules say so."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as pb_grpc

from huggingfaceserver.edge.admission import Admission
from huggingfaceserver.edge.gateway import RETRY_LATER, ServerState
from huggingfaceserver.edge.grpc_errors import TRAILERS
from huggingfaceserver.edge.grpc_policy import PolicyInterceptor
from huggingfaceserver.edge.http_errors import VERSIONS_NOT_SERVED
from huggingfaceserver.edge.repository import DISABLED
from huggingfaceserver.errors import EngineDied, TooManyRequests

KEY = "sk-grpc-policy"
AUTH = (("authorization", f"Bearer {KEY}"),)
DEADLINE_S = 30.0


class Servicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Answers with what it was sent, so that a test sees the request arrived decoded; holds
    ModelInfer calls while ``hold`` is clear."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.entered = asyncio.Event()
        self.hold = asyncio.Event()
        self.hold.set()

    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context):
        self.calls.append(f"ModelMetadata {request.name}")
        return pb.ModelMetadataResponse(name=request.name, platform="test")

    async def ModelInfer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        self.calls.append(f"ModelInfer {request.model_name} {request.id}")
        self.entered.set()
        await self.hold.wait()
        return pb.ModelInferResponse(model_name=request.model_name, id=request.id)


@dataclass
class Served:
    stub: pb_grpc.GRPCInferenceServiceStub
    servicer: Servicer
    admission: Admission
    state: ServerState


@asynccontextmanager
async def serving(timeout_s: float | None = None) -> AsyncIterator[Served]:
    servicer, admission, state = Servicer(), Admission(1), ServerState()
    policy = PolicyInterceptor(admission, state, KEY, False, timeout_s=timeout_s)
    server = grpc.aio.server(interceptors=(policy,))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield Served(pb_grpc.GRPCInferenceServiceStub(channel), servicer, admission, state)
    await server.stop(None)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serving() as served:
        yield served


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    return raised.value


def infer(served: Served, request_id: str, **fields: str):
    request = pb.ModelInferRequest(model_name="m", id=request_id, **fields)
    return served.stub.ModelInfer(request, metadata=AUTH, timeout=DEADLINE_S)


async def test_a_call_reaches_the_servicer_decoded_and_is_logged_with_its_id(served, caplog):
    with caplog.at_level(logging.INFO, logger="huggingfaceserver.edge.grpc_policy"):
        answer = await infer(served, "r-1")
        metadata = await served.stub.ModelMetadata(
            pb.ModelMetadataRequest(name="m"), metadata=AUTH, timeout=DEADLINE_S
        )
    assert (answer.model_name, answer.id) == ("m", "r-1")
    assert (metadata.name, metadata.platform) == ("m", "test")
    assert served.servicer.calls == ["ModelInfer m r-1", "ModelMetadata m"]
    lines = [
        r.getMessage() for r in caplog.records if r.name == "huggingfaceserver.edge.grpc_policy"
    ]
    assert len(lines) == 2
    assert re.fullmatch(r"grpc r-1 ModelInfer OK [\d.]+ ms", lines[0])
    assert re.fullmatch(r"grpc \S+ ModelMetadata OK [\d.]+ ms", lines[1])  # a new id
    assert served.admission.held == 0


async def test_an_id_that_could_forge_a_log_line_is_logged_as_a_new_one(served, caplog):
    """As HTTP's x-request-id: an id with a line break, or past 128 characters, is not
    written to the log (it could forge lines or swell them by megabytes)."""
    with caplog.at_level(logging.INFO, logger="huggingfaceserver.edge.grpc_policy"):
        await infer(served, "r-2\ngrpc forged ModelInfer OK 1 ms")
        await infer(served, "r" * 129)
    lines = [
        r.getMessage() for r in caplog.records if r.name == "huggingfaceserver.edge.grpc_policy"
    ]
    assert len(lines) == 2
    for line in lines:
        assert re.fullmatch(r"grpc [0-9a-f-]{36} ModelInfer OK [\d.]+ ms", line), line


async def test_a_call_past_the_request_timeout_ends_deadline_exceeded_and_frees_its_slot():
    """As an HTTP request gets its 504 at --request_timeout_seconds: the call ends
    DEADLINE_EXCEEDED, its work is cancelled and its admission slot is free again."""
    async with serving(timeout_s=0.2) as served:
        served.servicer.hold.clear()  # the servicer never answers
        error = await refused(infer(served, "slow"))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--request_timeout_seconds" in (error.details() or "")
        assert served.admission.held == 0
        served.servicer.hold.set()
        assert (await infer(served, "next")).id == "next"


async def test_a_model_version_is_not_found_before_the_servicer(served):
    error = await refused(infer(served, "r-2", model_version="2"))
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert error.details() == VERSIONS_NOT_SERVED
    assert served.servicer.calls == [] and served.admission.held == 0


async def test_inference_over_the_limit_is_refused_until_a_slot_frees(served):
    served.servicer.hold.clear()
    first = asyncio.ensure_future(infer(served, "first"))
    await asyncio.wait_for(served.servicer.entered.wait(), DEADLINE_S)
    error = await refused(infer(served, "second"))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == served.admission.refusal()
    assert ("retry-after", RETRY_LATER["retry-after"]) in list(error.trailing_metadata())
    served.servicer.hold.set()
    assert (await first).id == "first"
    assert (await infer(served, "third")).id == "third"
    assert served.servicer.calls == ["ModelInfer m first", "ModelInfer m third"]
    assert served.admission.held == 0


async def test_the_key_is_needed_except_for_health(served):
    live = await served.stub.ServerLive(pb.ServerLiveRequest(), timeout=DEADLINE_S)
    assert live.live
    no_key = served.stub.ModelInfer(pb.ModelInferRequest(model_name="m"), timeout=DEADLINE_S)
    wrong = served.stub.ModelInfer(
        pb.ModelInferRequest(model_name="m"),
        metadata=(("authorization", "Bearer sk-wrong"),),
        timeout=DEADLINE_S,
    )
    for call in (no_key, wrong):
        error = await refused(call)
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED
        assert ("www-authenticate", "Bearer") in list(error.trailing_metadata())
    assert served.servicer.calls == []


async def test_repository_methods_are_off_and_draining_refuses_new_calls(served):
    unload = served.stub.RepositoryModelUnload(
        pb.RepositoryModelUnloadRequest(model_name="m"), metadata=AUTH, timeout=DEADLINE_S
    )
    error = await refused(unload)
    assert (error.code(), error.details()) == (grpc.StatusCode.UNIMPLEMENTED, DISABLED)
    served.state.draining = True
    error = await refused(infer(served, "late"))
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert served.servicer.calls == []


class Refusing(Servicer):
    """A servicer whose inference raises the error it is given, as a backend may."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def ModelInfer(self, request, context):
        raise self.error


@pytest.mark.parametrize(
    ("error", "code", "trailers"),
    [
        (
            TooManyRequests("queue full", headers={"Retry-After": "3", "connection": "close"}),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            [("retry-after", "3")],
        ),
        (EngineDied("the engine process stopped"), grpc.StatusCode.UNAVAILABLE, []),
    ],
)
async def test_a_servicer_error_ends_the_call_with_its_code_and_grpc_meaningful_headers(
    error, code, trailers
):
    policy = PolicyInterceptor(Admission(1), ServerState(), None, enable_repository=False)
    server = grpc.aio.server(interceptors=(policy,))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Refusing(error), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            answer = await refused(stub.ModelInfer(pb.ModelInferRequest(model_name="m")))
    finally:
        await server.stop(None)
    assert (answer.code(), answer.details()) == (code, str(error))
    ours = [(k, v) for k, v in answer.trailing_metadata() if k in TRAILERS or k == "connection"]
    assert ours == trailers
