"""A gRPC client for the load test, run as a subprocess (``tritonclient.grpc`` and ``kserve``
cannot be imported in one process, see tests/grpc_client.py).

    python tests/grpc_load_client.py HOST:PORT MODEL

It writes ``{"ready": true}`` once connected, then reads one request a line from stdin,
``{"id": N, "texts": [...]}``, sends each as a ModelInfer as soon as it is read (so the parent
decides how many are in flight) and writes one line per answer, in the order they come:
``{"id": N, "data": [[...], ...]}`` or ``{"id": N, "error": "STATUS message"}``. It exits when
stdin closes and every answer is written.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException


async def infer(client: grpcclient.InferenceServerClient, model: str, request: dict) -> dict:
    texts = request["texts"]
    text = grpcclient.InferInput("input-0", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array(texts, dtype=object))
    try:
        result = await client.infer(model, [text])
    except InferenceServerException as exc:
        return {"id": request["id"], "error": f"{exc.status()} {exc.message()}"}
    return {"id": request["id"], "data": result.as_numpy("output-0").tolist()}


async def answer(client: grpcclient.InferenceServerClient, model: str, line: bytes) -> None:
    print(json.dumps(await infer(client, model, json.loads(line))), flush=True)


async def main(url: str, model: str) -> None:
    client = grpcclient.InferenceServerClient(url)
    assert await client.is_server_live()
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    print(json.dumps({"ready": True}), flush=True)
    pending: set[asyncio.Task] = set()
    while line := await stdin.readline():
        task = asyncio.create_task(answer(client, model, line))
        pending.add(task)
        task.add_done_callback(pending.discard)
    await asyncio.gather(*pending)
    await client.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
