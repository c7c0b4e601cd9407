"""Import KServe without letting it parse our command line.

``kserve.model_server`` parses ``sys.argv`` when first imported (and exits on a value it cannot
read). Importing it here first, with an empty command line, keeps parsing a pure function of
argv (:func:`huggingfaceserver.cli.parse_args`); the server copies the parsed KServe flags back
into ``kserve.model_server.args`` before it starts (see :func:`sync_kserve_args`).
"""

from __future__ import annotations

import sys
from typing import Any

_saved = sys.argv
sys.argv = sys.argv[:1]
try:
    from kserve import model_server
finally:
    sys.argv = _saved


def sync_kserve_args(server_flags: dict[str, Any]) -> None:
    """Make KServe's module-level args (read by its gRPC server and logging) match ours."""
    vars(model_server.args).update(server_flags)
