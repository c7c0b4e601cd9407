"""The ONNX backends for encoder tasks: the model exported once with torch's own exporter,
fused with ONNX Runtime's transformer optimizer (for ONNX Runtime), checked against torch, kept
in the server's cache, and run by one ONNX Runtime session (or one OpenVINO compiled model)
behind the same batcher as the torch backend.

- :mod:`.graph`: what the exported graph takes and gives for a model and task;
- :mod:`.export`: export, fusions, int8, and the check against torch;
- :mod:`.store`: the cache of exports, keyed by the model's files and the library versions;
- :mod:`.session`: the ONNX Runtime session and its options;
- :mod:`.openvino_session`: OpenVINO's compiled model (``--backend openvino``);
- :mod:`.encoder`: the backend.
"""

from __future__ import annotations

import importlib.util

ONNX_INSTALL_HINT = "install it with `pip install onnxruntime onnx`"


OPENVINO_INSTALL_HINT = "install it with `pip install huggingfaceserver[openvino]`"


def onnxruntime_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("onnxruntime", "onnx"))


def openvino_installed() -> bool:
    """OpenVINO, and what makes and checks the export."""
    return onnxruntime_installed() and importlib.util.find_spec("openvino") is not None


class OnnxUnavailable(Exception):
    """ONNX Runtime cannot serve this model (the reason, for the log or the startup error)."""
