"""A tritonclient gRPC client, run as a subprocess by the end-to-end tests.

``tritonclient.grpc`` and ``kserve`` cannot be imported in one process (both register the
``inference`` protobuf package), so the tests run this file with ``sys.executable`` and read one
JSON object from its stdout.

    python tests/grpc_client.py HOST:PORT MODEL infer TEXT...   -> {"server_ready", "model_ready",
                                                                    "datatype", "shape", "data"}
    python tests/grpc_client.py HOST:PORT MODEL infer-parameters JSON TEXT...  -> the same, the
                                              request's parameters (a JSON object) sent along
    python tests/grpc_client.py HOST:PORT MODEL infer-int64      -> {"status", "message"}
    python tests/grpc_client.py HOST:PORT MODEL status TEXT...   -> {"status", "message"}
    python tests/grpc_client.py HOST:PORT MODEL unload           -> {"status", "message"}
    python tests/grpc_client.py HOST:PORT MODEL version TEXT...  -> {"status", "message"}
                                                              (infer naming model version 2)

With ``GRPC_API_KEY`` set, every call sends ``authorization: Bearer <key>``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def infer_texts(
    client: grpcclient.InferenceServerClient,
    model: str,
    texts: list[str],
    parameters: dict | None = None,
    headers: dict | None = None,
) -> dict:
    text = grpcclient.InferInput("input-0", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array(texts, dtype=object))
    result = client.infer(model, [text], parameters=parameters, headers=headers)
    output = result.get_output("output-0")
    array = result.as_numpy("output-0")
    return {
        "server_ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(model, headers=headers),
        "datatype": output.datatype,
        "shape": list(array.shape),
        "data": array.tolist(),
    }


def infer_int64(client: grpcclient.InferenceServerClient, model: str) -> dict:
    numbers = grpcclient.InferInput("input-0", [2], "INT64")
    numbers.set_data_from_numpy(np.array([1, 2], dtype=np.int64))
    try:
        client.infer(model, [numbers])
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return {"status": "OK", "message": ""}


def outcome(call: Callable[[], object]) -> dict:
    try:
        call()
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return {"status": "OK", "message": ""}


def main(argv: list[str]) -> None:
    url, model, mode, *texts = argv
    key = os.environ.get("GRPC_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else None
    client = grpcclient.InferenceServerClient(url)
    if mode == "infer":
        result = infer_texts(client, model, texts)
    elif mode == "infer-parameters":
        parameters, *texts = texts
        result = infer_texts(client, model, texts, json.loads(parameters), headers)
    elif mode == "infer-int64":
        result = infer_int64(client, model)
    elif mode == "status":
        text = grpcclient.InferInput("input-0", [len(texts)], "BYTES")
        text.set_data_from_numpy(np.array(texts, dtype=object))
        result = outcome(lambda: client.infer(model, [text], headers=headers))
    elif mode == "version":
        text = grpcclient.InferInput("input-0", [len(texts)], "BYTES")
        text.set_data_from_numpy(np.array(texts, dtype=object))
        result = outcome(lambda: client.infer(model, [text], model_version="2", headers=headers))
    else:
        result = outcome(lambda: client.unload_model(model, headers=headers))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
