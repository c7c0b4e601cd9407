"""Open files: every connection is one, so the process's soft limit on them bounds how many
clients it can hold at once. Some runtimes start processes with a low soft limit (1,024) under
a much higher hard one; a flood of idle connections, each held until the headers deadline,
could then use up the descriptors and refuse clients that send whole requests. The server raises
its soft limit to the hard one at start, before any child process (which inherits it)."""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit, where the hard limit is
    a number (an unlimited one is left to the kernel's own ceiling); the soft limit before and
    after, logged when it changed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        logger.warning("open files: could not raise the soft limit %d to %d: %s", soft, hard, exc)
        return soft, soft
    logger.info("open files: soft limit raised from %d to the hard limit, %d", soft, hard)
    return soft, hard
