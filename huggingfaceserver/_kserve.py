"""Import KServe without letting it parse our command line.

``import kserve`` imports ``kserve.model_server``, which parses ``sys.argv`` at import (and
exits on a value it cannot read) into module globals this package never reads: our CLI parses
KServe's flags itself (:func:`huggingfaceserver.cli.build_parser`) and the servers are ours
(:mod:`.listeners`). :func:`import_kserve` is called once, at package import, because nearly
every module of the package imports from KServe at its top (:mod:`.errors` first of all).
"""

from __future__ import annotations

import sys

from .startup import importing


def import_kserve() -> None:
    """Import KServe with an empty command line, so that parsing stays a pure function of the
    argv given to :func:`huggingfaceserver.cli.parse_args`."""
    if "kserve.model_server" in sys.modules:
        return
    saved = sys.argv
    sys.argv = sys.argv[:1]
    try:
        with importing():
            import kserve.model_server  # noqa: F401
    finally:
        sys.argv = saved
