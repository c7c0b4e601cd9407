"""The ONNX Runtime backend for encoder tasks: the model exported once with torch's own exporter,
fused with ONNX Runtime's transformer optimizer, checked against torch, kept in the server's
cache, and run by one ONNX Runtime session behind the same batcher as the torch backend.

- :mod:`.graph`: what the exported graph takes and gives for a model and task;
- :mod:`.export`: export, fusions, int8, and the check against torch;
- :mod:`.store`: the cache of exports, keyed by the model's files and the library versions;
- :mod:`.session`: the session and its options;
- :mod:`.encoder`: the backend.
"""

from __future__ import annotations

import importlib.util

ONNX_INSTALL_HINT = "install it with `pip install onnxruntime onnx`"


def onnxruntime_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("onnxruntime", "onnx"))


class OnnxUnavailable(Exception):
    """ONNX Runtime cannot serve this model (the reason, for the log or the startup error)."""
