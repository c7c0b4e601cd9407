"""A stand-in for a remote V2 predictor (Triton's role in transformer mode), for tests.

``python tests/fake_predictor.py MODEL_DIR NAME HTTP_PORT GRPC_PORT RECORD_FILE`` serves NAME
over V2 REST and gRPC: it runs the model on the tensors it receives (logits, or the last hidden
state for a bare encoder) and appends the names of the inputs it got to RECORD_FILE.
"""

from __future__ import annotations

import json
import sys

import torch
import transformers
from kserve import Model, ModelServer
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse


class TensorPredictor(Model):
    def __init__(self, name: str, path: str, record: str):
        super().__init__(name)
        config = transformers.AutoConfig.from_pretrained(path)
        arch = config.architectures[0]
        self.model = getattr(transformers, arch).from_pretrained(path).eval()
        self.record = record
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None, response_headers=None):
        inputs = {i.name: torch.from_numpy(i.as_numpy().copy()) for i in payload.inputs}
        with open(self.record, "a") as f:
            f.write(json.dumps(sorted(inputs)) + "\n")
        with torch.no_grad():
            out = self.model(**inputs, return_dict=True)
        tensor = out.logits if hasattr(out, "logits") else out.last_hidden_state
        array = tensor.numpy()
        output = InferOutput("output-0", list(array.shape), "FP32", array)
        return InferResponse(payload.id, self.name, [output])


if __name__ == "__main__":
    path, name, http_port, grpc_port, record = sys.argv[1:6]
    ModelServer(http_port=int(http_port), grpc_port=int(grpc_port)).start(
        [TensorPredictor(name, path, record)]
    )
