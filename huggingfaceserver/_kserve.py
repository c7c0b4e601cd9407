"""Import KServe without letting it parse our command line.

``kserve.model_server`` parses ``sys.argv`` when first imported (and exits on a value it cannot
read). Importing it here first, with an empty command line, keeps parsing a pure function of
argv (:func:`huggingfaceserver.cli.parse_args`); the server copies the parsed KServe flags back
into ``kserve.model_server.args`` before it starts (see :func:`sync_kserve_args`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .startup import importing

_saved = sys.argv
sys.argv = sys.argv[:1]
try:
    with importing():
        from kserve import model_server
finally:
    sys.argv = _saved


def sync_kserve_args(server_flags: dict[str, Any]) -> None:
    """Make KServe's module-level args (read by its gRPC server and logging) match ours."""
    vars(model_server.args).update(server_flags)


KSERVE_OPENAI = "kserve.protocol.rest.openai"


@contextmanager
def without_kserve_openai() -> Iterator[None]:
    """KServe's own OpenAI routes, left out for the block: KServe mounts them only for models
    of its ``OpenAIModel`` class, which this server never registers (it mounts its own), and
    finding that out imports vLLM's OpenAI protocol (3 s of startup). A ``None`` entry in
    ``sys.modules`` makes that import fail, and KServe then registers none."""
    if KSERVE_OPENAI in sys.modules:  # already imported by someone else: nothing to save
        yield
        return
    sys.modules[KSERVE_OPENAI] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get(KSERVE_OPENAI, 0) is None:
            del sys.modules[KSERVE_OPENAI]
