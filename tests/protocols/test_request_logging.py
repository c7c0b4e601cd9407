"""--disable_log_requests and --max_log_len: they shape the log line, never the data."""

from __future__ import annotations

import logging

import httpx
import torch

from huggingfaceserver.edge.admission import Admission
from huggingfaceserver.edge.gateway import Gateway, GatewayPolicy, ServerState
from tests.encoder_tasks.test_embedding import reference_embeddings
from tests.harness import build_app, client_for

LOGGER = "huggingfaceserver.protocols.kserve_model"
LONG_TEXT = "john lives in new york and eats food in paris " * 6


async def embed(model, text):
    async with client_for(model) as client:
        response = await client.post(
            f"/v1/models/{model.name}:predict",
            json={"instances": [text]},
            headers={"x-request-id": "req-42"},
        )
    assert response.status_code == 200, response.text
    return torch.tensor(response.json()["predictions"])


def request_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


async def test_requests_are_logged_with_their_id(encoder, tiny_models, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    await embed(encoder(tiny_models["st_cls"]), LONG_TEXT)
    (line,) = request_lines(caplog)
    assert "req-42" in line and LONG_TEXT.strip() in line


async def test_max_log_len_truncates_the_log_line_only(encoder, tiny_models, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = tiny_models["st_cls"]
    got = await embed(encoder(path, "--max_log_len", "20"), LONG_TEXT)
    (line,) = request_lines(caplog)
    assert "req-42" in line
    assert line.endswith(f" {repr([LONG_TEXT])[:20]}... ({len(LONG_TEXT)} characters, 20 shown)")
    assert torch.allclose(got, reference_embeddings(path, [LONG_TEXT], "cls"), atol=1e-5)


async def test_disable_log_requests_logs_nothing(encoder, tiny_models, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    await embed(encoder(tiny_models["st_cls"], "--disable_log_requests"), LONG_TEXT)
    assert request_lines(caplog) == []


async def test_behind_the_gateway_the_inputs_go_on_its_one_line(encoder, tiny_models, caplog):
    caplog.set_level(logging.INFO)
    model = encoder(tiny_models["st_cls"], "--max_log_len", "20")
    gateway = Gateway(build_app(model), GatewayPolicy(model_name=model.name), Admission(4),
                      ServerState())  # fmt: skip
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post(
            f"/v1/models/{model.name}:predict",
            json={"instances": [LONG_TEXT]},
            headers={"x-request-id": "req-43"},
        )
    assert response.status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if "req-43" in r.getMessage()]
    assert f'"POST /v1/models/{model.name}:predict" 200' in line
    assert " model=model instances=1 " in line
    assert line.endswith(f"... ({len(LONG_TEXT)} characters, 20 shown)")
