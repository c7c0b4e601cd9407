"""A tritonclient gRPC client, run as a subprocess by the end-to-end tests.

``tritonclient.grpc`` and ``kserve`` cannot be imported in one process (both register the
``inference`` protobuf package), so the tests run this file with ``sys.executable`` and read one
JSON object from its stdout.

    python tests/grpc_client.py HOST:PORT MODEL infer TEXT...   -> {"server_ready", "model_ready",
                                                                    "datatype", "shape", "data"}
    python tests/grpc_client.py HOST:PORT MODEL infer-int64      -> {"status", "message"}
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def infer_texts(client: grpcclient.InferenceServerClient, model: str, texts: list[str]) -> dict:
    text = grpcclient.InferInput("input-0", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array(texts, dtype=object))
    result = client.infer(model, [text])
    output = result.get_output("output-0")
    array = result.as_numpy("output-0")
    return {
        "server_ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(model),
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


def main(argv: list[str]) -> None:
    url, model, mode, *texts = argv
    client = grpcclient.InferenceServerClient(url)
    result = infer_texts(client, model, texts) if mode == "infer" else infer_int64(client, model)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
