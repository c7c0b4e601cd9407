"""A stand-in for a remote V2 predictor (Triton's role in transformer mode), for tests.

``python tests/fake_predictor.py MODEL_DIR NAME HTTP_PORT GRPC_PORT RECORD_FILE [HANG_ID]``
serves NAME over V2 REST and gRPC: it runs the model on the tensors it receives (logits, or the
last hidden state for a bare encoder) and appends the names of the inputs it got to RECORD_FILE.
With HANG_ID, a call whose ``input_ids`` hold that token id is never answered (a hung
predictor), while other calls are answered as usual.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
import transformers
from kserve import Model, ModelServer
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse


class TensorPredictor(Model):
    def __init__(self, name: str, path: str, record: str, hang_id: int | None = None):
        super().__init__(name)
        self.hang_id = hang_id
        config = transformers.AutoConfig.from_pretrained(path)
        arch = config.architectures[0]
        self.model = getattr(transformers, arch).from_pretrained(path).eval()
        self.record = record
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None, response_headers=None):
        inputs = {i.name: torch.from_numpy(i.as_numpy().copy()) for i in payload.inputs}
        with open(self.record, "a") as f:
            f.write(json.dumps(sorted(inputs)) + "\n")
        if self.hang_id is not None and bool((inputs["input_ids"] == self.hang_id).any()):
            await asyncio.Event().wait()  # never set: this call hangs
        with torch.no_grad():
            out = self.model(**inputs, return_dict=True)
        tensor = out.logits if hasattr(out, "logits") else out.last_hidden_state
        array = tensor.numpy()
        output = InferOutput("output-0", list(array.shape), "FP32", array)
        return InferResponse(payload.id, self.name, [output])


if __name__ == "__main__":
    path, name, http_port, grpc_port, record = sys.argv[1:6]
    hang_id = int(sys.argv[6]) if len(sys.argv) > 6 else None
    ModelServer(http_port=int(http_port), grpc_port=int(grpc_port)).start(
        [TensorPredictor(name, path, record, hang_id)]
    )
