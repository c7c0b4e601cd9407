"""The gateway middleware around a stand-in application: ids, key, limits, admission, deadlines,
disconnects and drain, each answered in the route's own error shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from huggingfaceserver.edge.admission import Admission
from huggingfaceserver.edge.gateway import Gateway, GatewayPolicy, ReadyFronts, ServerState
from huggingfaceserver.edge.shared_count import SharedCount

pytestmark = pytest.mark.asyncio


class StandIn:
    """An ASGI app: echoes bodies, holds requests on ``release``, streams SSE, records what
    happened to each handler."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0
        self.cancelled = 0
        self.seen_ids: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        headers = dict(scope["headers"])
        self.seen_ids.append(headers.get(b"x-request-id", b"").decode())
        body = b""
        if scope["method"] == "POST":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.entered += 1
        try:
            if scope["path"].endswith("/hold"):
                await self.release.wait()
            if scope["path"].endswith("/stream"):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")],
                    }
                )
                await send(
                    {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True}
                )
                await self.release.wait()
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
                return
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body or b"ok"})


def client(app: StandIn, make: Callable[..., GatewayPolicy] = GatewayPolicy, limit: int = 4,
           state: ServerState | None = None, **policy) -> httpx.AsyncClient:  # fmt: skip
    gateway = Gateway(app, make(**policy), Admission(limit), state or ServerState())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://t")


async def test_a_request_id_is_made_seen_by_the_handler_and_sent_back():
    app = StandIn()
    async with client(app) as http:
        made = await http.post("/v1/models/m:predict", content=b"{}")
        kept = await http.post("/v1/models/m:predict", headers={"x-request-id": "abc-1"})
    assert made.headers["x-request-id"] == app.seen_ids[0] and len(app.seen_ids[0]) == 36
    assert kept.headers["x-request-id"] == app.seen_ids[1] == "abc-1"


async def test_the_api_key_guards_model_routes_in_each_routes_shape():
    app = StandIn()
    async with client(app, api_key="sk-1") as http:
        kserve = await http.post("/v1/models/m:predict", content=b"{}")
        openai = await http.post("/openai/v1/completions", headers={"authorization": "Bearer no"})
        wrong_scheme = await http.post("/v2/models/m/infer", headers={"authorization": "sk-1"})
        good = await http.post("/v1/models/m:predict", headers={"authorization": "Bearer sk-1"})
        health = await http.get("/v2/health/ready")
        metrics = await http.get("/metrics")
    assert kserve.status_code == openai.status_code == wrong_scheme.status_code == 401
    assert kserve.headers["www-authenticate"] == "Bearer"
    assert "API key" in kserve.json()["error"]
    assert openai.json()["error"]["type"] == "authentication_error"
    assert good.status_code == health.status_code == metrics.status_code == 200
    assert app.entered == 3  # good, health, metrics


async def test_a_body_over_the_limit_is_a_413_before_the_handler_sees_it():
    app = StandIn()
    async with client(app, max_request_bytes=10) as http:
        declared = await http.post("/v1/models/m:predict", content=b"x" * 11)

        async def chunks():
            for _ in range(4):
                yield b"xxxx"

        streamed = await http.post("/openai/v1/embeddings", content=chunks())
        fits = await http.post("/v1/models/m:predict", content=b"x" * 10)
    assert declared.status_code == streamed.status_code == 413
    assert "--max_request_bytes" in declared.json()["error"]
    assert streamed.json()["error"]["message"].startswith("the request body is")
    assert fits.status_code == 200 and fits.content == b"x" * 10
    assert app.entered == 1


async def test_beyond_the_admission_limit_an_immediate_429_with_retry_after():
    app = StandIn()
    async with client(app, limit=2) as http:
        held = [asyncio.create_task(http.post("/v1/models/m/hold")) for _ in range(2)]
        while app.entered < 2:
            await asyncio.sleep(0.01)
        refused = await http.post("/openai/v1/chat/completions")
        health = await http.get("/v2/health/live")  # never counted
        app.release.set()
        answered = await asyncio.gather(*held)
        after = await http.post("/v1/models/m:predict")
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "--max_concurrent_requests" in refused.json()["error"]["message"]
    assert health.status_code == 200
    assert [r.status_code for r in answered] == [200, 200] and after.status_code == 200


async def test_past_the_deadline_a_504_and_the_handler_is_cancelled():
    app = StandIn()
    async with client(app, request_timeout_s=0.2) as http:
        late = await http.post("/v2/models/m/hold")
        fast = await http.post("/v1/models/m:predict")
    assert late.status_code == 504 and "--request_timeout_seconds" in late.json()["error"]
    assert app.cancelled == 1
    assert fast.status_code == 200


async def test_a_stream_past_the_deadline_ends_with_an_error_event():
    app = StandIn()
    async with client(app, request_timeout_s=0.2) as http:
        response = await http.post("/openai/v1/stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert events[0] == "data: 1" and events[-1] == "data: [DONE]"
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "--request_timeout_seconds" in error["message"]
    assert app.cancelled == 1


async def test_a_client_that_leaves_cancels_its_handler():
    app = StandIn()
    gateway = Gateway(app, GatewayPolicy(), Admission(4), ServerState())
    sent: list[dict] = []
    disconnect = asyncio.Event()

    async def receive():
        if not sent and not disconnect.is_set():
            sent.append({})
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/models/m/hold", "headers": []}
    call = asyncio.create_task(gateway(scope, receive, send))
    while app.entered < 1:
        await asyncio.sleep(0.01)
    disconnect.set()
    await asyncio.wait_for(call, 5)
    assert app.cancelled == 1
    assert gateway.admission.held == 0


async def test_while_draining_new_requests_are_503_and_health_still_answers():
    app, state = StandIn(), ServerState()
    async with client(app, state=state) as http:
        state.draining = True
        refused = await http.post("/v1/models/m:predict")
        live = await http.get("/v2/health/live")
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    assert live.status_code == 200


async def test_with_fronts_the_server_is_ready_once_every_front_is(tmp_path):
    """Each front's state reads one shared count: whichever front answers a probe, the server
    is ready for all of them at once, and a front that loads again is not counted twice."""
    path = SharedCount.create(str(tmp_path / "ready"))
    first, second = (ServerState(ReadyFronts(path, 2)) for _ in range(2))
    assert not first.fronts_ready() and not second.fronts_ready()
    first.front_ready()
    first.front_ready()  # a reload of the same front
    assert not first.fronts_ready() and not second.fronts_ready()
    second.front_ready()
    assert first.fronts_ready() and second.fronts_ready()


async def test_alone_the_server_needs_no_other_front():
    assert ServerState().fronts_ready()


def stalled_upload(gateway: Gateway, first: bytes = b'{"in') -> tuple[asyncio.Task, list[dict]]:
    """A POST whose client sends ``first`` of its body and then nothing more."""
    sent: list[dict] = []
    stall = asyncio.Event()  # never set
    chunks = [first]

    async def receive():
        if chunks:
            return {"type": "http.request", "body": chunks.pop(), "more_body": True}
        await stall.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/models/m:predict", "headers": []}
    return asyncio.create_task(gateway(scope, receive, send)), sent


async def test_a_stalled_upload_holds_no_admission_slot_and_gets_a_408_at_the_deadline():
    """Admission has one slot; a client stalled mid-upload does not take it, so a whole request
    is served meanwhile; the stalled one is told 408 and its connection closed."""
    app = StandIn()
    gateway = Gateway(app, GatewayPolicy(read_timeout_s=0.5), Admission(1), ServerState())
    stalled, sent = stalled_upload(gateway)
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        served = await http.post("/v1/models/m:predict", content=b"whole")
        assert not stalled.done()  # still waiting for its body
        assert gateway.reading.held == len(b'{"in')
        await asyncio.wait_for(stalled, 10)
    assert served.status_code == 200 and served.content == b"whole"
    start = sent[0]
    assert start["status"] == 408
    assert (b"connection", b"close") in start["headers"]
    assert "--request_read_timeout_seconds" in json.loads(sent[1]["body"])["error"]
    assert gateway.admission.held == 0 and gateway.reading.held == 0
    assert app.entered == 1


async def test_bodies_being_read_share_a_byte_budget():
    """A body that would overflow what the bodies being read may hold together is a 429 at
    once; the budget comes back when reads end."""
    app = StandIn()
    policy = GatewayPolicy(max_request_bytes=8, read_timeout_s=30)
    gateway = Gateway(app, policy, Admission(4), ServerState())
    budget = gateway.reading.limit
    stalled = [stalled_upload(gateway, b"x" * 8) for _ in range(budget // 8)]
    while gateway.reading.held < budget:
        await asyncio.sleep(0.01)
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        refused = await http.post("/v1/models/m:predict", content=b"abc")
        for task, _ in stalled:
            task.cancel()
        await asyncio.gather(*(task for task, _ in stalled), return_exceptions=True)
        assert gateway.reading.held == 0
        served = await http.post("/v1/models/m:predict", content=b"abc")
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "too many request bodies" in refused.json()["error"]
    assert served.status_code == 200 and served.content == b"abc"
