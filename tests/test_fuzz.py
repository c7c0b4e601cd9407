"""A schema fuzzer against real servers: schemathesis generates requests from the server's own
/openapi.json, schema-conforming and not, for every route of an encoder (model repository on,
behind an API key) and of a tiny llama. No answer may be a 5xx, and the servers serve after."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.strategies import SearchStrategy
from schemathesis import Case, GenerationMode
from schemathesis.schemas import APIOperation, BaseSchema

from .harness import ServerProcess, run_server, wait_ready

pytestmark = pytest.mark.slow

EXAMPLES = 12
"""Generated requests per operation, generation mode and path-parameter choice."""
KEY = "sk-fuzz"
AUTH = {"authorization": f"Bearer {KEY}"}
PATH_PARAMETER = re.compile(r"{(\w+)}")
MODEL_PARAMETERS = ("model_name", "model_id")
REPOSITORY = "/v2/repository/"
V1_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"instances": {"type": "array", "items": {"type": "string"}}},
                "required": ["instances"],
            }
        }
    },
}
"""KServe's V1 routes read a raw body; the fuzzer is given the shape they take."""
OPENAI_BODIES = {
    "POST /openai/v1/completions", "POST /openai/v1/chat/completions",
    "POST /openai/v1/responses",
    "POST /openai/v1/embeddings", "POST /openai/v1/rerank",
    "POST /openai/v1/tokenize", "POST /openai/v1/detokenize",
    "POST /openai/v1/load_lora_adapter", "POST /openai/v1/unload_lora_adapter",
}  # fmt: skip
OPERATIONS = OPENAI_BODIES | {
    "GET /openai/v1/models", "GET /openai/v1/models/{model_id}",
    "GET /", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_name}",
    "POST /v1/models/{model_name}:predict", "POST /v1/models/{model_name}:explain",
    "GET /v2", "GET /v2/health/live", "GET /v2/health/ready", "GET /v2/models",
    "GET /v2/models/{model_name}", "GET /v2/models/{model_name}/ready",
    "GET /v2/models/{model_name}/versions/{model_version}/ready",
    "POST /v2/models/{model_name}/infer",
}  # fmt: skip
"""Every route the server serves."""
TEI_BODIES = {
    f"POST /{route}"
    for route in ("embed", "embed_sparse", "embed_all", "predict", "rerank", "tokenize", "decode")
} | {"POST /"}
TEI_OPERATIONS = TEI_BODIES | {"GET /info", "GET /health"}
"""text-embeddings-inference's routes: an encoder server's only."""
REPOSITORY_OPERATIONS = {
    f"POST {REPOSITORY}models/{{model_name}}/{verb}" for verb in ("load", "unload")
}
"""And these with --enable_model_repository."""
SERVERS = {
    "encoder": (
        "st_cls",
        ["--task", "text_embedding", "--enable_model_repository", "--api_key", KEY],
    ),
    "llama": ("llama", ["--backend", "huggingface"]),
}
"""The model and flags of each server."""
SERVED_AFTER = {
    "encoder": ("/openai/v1/embeddings", {"input": "Hello world"}),
    "llama": ("/openai/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
}


@pytest.fixture(scope="module")
def servers(tiny_models: dict[str, Path], tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    """Both servers, started side by side."""
    log_dir = tmp_path_factory.mktemp("fuzz")
    with ExitStack() as stack:
        started = {
            name: stack.enter_context(
                run_server(
                    ["--model_dir", str(tiny_models[model]), "--model_name", name, *flags],
                    log_dir,
                    ready=False,
                )
            )
            for name, (model, flags) in SERVERS.items()
        }
        for server in started.values():
            wait_ready(server)
        yield started


def published_schema(server: ServerProcess, repository: bool, encoder: bool) -> BaseSchema:
    """The server's /openapi.json, checked to list every route and the OpenAI (and TEI) bodies,
    with the V1 body added, loaded for schemathesis."""
    response = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    document = response.json()
    paths = document["paths"]
    published = {f"{method.upper()} {path}" for path, ops in paths.items() for method in ops}
    expected = OPERATIONS | (REPOSITORY_OPERATIONS if repository else set())
    assert published == expected | (TEI_OPERATIONS if encoder else set())
    for label in OPENAI_BODIES | (TEI_BODIES if encoder else set()):
        method, path = label.lower().split(" ")
        assert "requestBody" in paths[path][method], label
    paths["/v1/models/{model_name}:predict"]["post"]["requestBody"] = V1_BODY
    return schemathesis.openapi.from_dict(document)


def strategies(operation: APIOperation, model: str) -> Iterator[SearchStrategy]:
    """Requests that fit the schema and requests that do not, each with generated path
    parameters and with the served model's name where the path names a model. A request that
    does not fit needs a body or a query, header or cookie (any path is a string)."""
    named = {p: model for p in PATH_PARAMETER.findall(operation.path) if p in MODEL_PARAMETERS}
    parts = [operation.body, operation.query, operation.headers, operation.cookies]
    modes = list(GenerationMode) if any(len(part) for part in parts) else [GenerationMode.POSITIVE]
    for fixed in [None, named] if named else [None]:
        for mode in modes:
            yield operation.as_strategy(generation_mode=mode, path_parameters=fixed)


def fuzz_operation(
    operation: APIOperation, server: ServerProcess, model: str, failures: list[str]
) -> int:
    """Send the generated requests of one operation; 5xx answers go to ``failures``. The number
    of requests sent."""
    sent = 0
    for strategy in strategies(operation, model):

        @given(case=strategy)
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def send(case: Case) -> None:
            nonlocal sent
            sent += 1
            response = case.call(base_url=server.url, headers=AUTH, timeout=60)
            if response.status_code >= 500:
                failures.append(
                    f"{response.status_code} {response.text[:300]!r}\n"
                    f"    {case.as_curl_command(headers=AUTH)}"
                )

        send()
    return sent


def repository_last(operation: APIOperation) -> tuple[bool, bool]:
    """Unload, then load, after everything else (unload takes the model away)."""
    return operation.path.startswith(REPOSITORY), operation.path.endswith("/load")


@pytest.mark.parametrize("name", list(SERVERS))
def test_no_generated_request_gets_a_5xx(servers, name):
    server, repository = servers[name], "--enable_model_repository" in SERVERS[name][1]
    schema = published_schema(server, repository, encoder=name == "encoder")
    operations = sorted((r.ok() for r in schema.get_all_operations()), key=repository_last)
    failures: list[str] = []
    start = time.monotonic()
    sent = sum(fuzz_operation(operation, server, name, failures) for operation in operations)
    print(f"fuzzed {name}: {sent} requests in {time.monotonic() - start:.1f}s")
    assert not failures, f"{len(failures)} of {sent} requests got a 5xx:\n" + "\n".join(failures)

    # alive, and ready: with the repository on, the fuzzer unloaded the model, then loaded it
    assert server.process.poll() is None
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200
    path, body = SERVED_AFTER[name]
    served = httpx.post(server.url + path, json={"model": name, **body}, headers=AUTH, timeout=60)
    assert served.status_code == 200, served.text
