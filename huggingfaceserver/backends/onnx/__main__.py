"""``python -m huggingfaceserver.backends.onnx --model_dir DIR [server flags]``: make the ONNX
export the server would make for those flags and store it in the cache (for images that ship
it), then print where it is. Exits 1 with the reason when ONNX Runtime cannot serve the model."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from ...cli import parse_args
from ...errors import StartupError
from ...loading import load_source
from .encoder import OnnxEncoder


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        backend = OnnxEncoder(load_source(config), config)  # encoder tasks only
        backend.load()
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    assert backend.graph is not None
    print(f"{backend.graph.path} ({backend.graph.origin})")
    backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
