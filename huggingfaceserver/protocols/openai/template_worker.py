"""The chat template worker: the process that renders request chat templates (started and
killed by :mod:`.template_sandbox`).

It runs as a script, ``python -I template_worker.py``, and imports nothing of this package:
only the standard library, then transformers' ``render_jinja_template`` (the function
``apply_chat_template`` renders with, jinja2's ``ImmutableSandboxedEnvironment``). Messages
both ways are length-prefixed JSON, so nothing but plain data crosses: requests on stdin,
replies on the process's original stdout (``sys.stdout`` itself is sent to stderr, so that
nothing printed can corrupt a reply).

The first message sets it up (the server's import path and the limits); once transformers is
imported, the worker limits its own address space to what it uses idle plus a budget, and
before each render its CPU time to what it has used plus a few seconds, so that a worker left
rendering by a server that died stops by itself. Its server enforces the wall-clock deadline.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
from collections.abc import Callable
from struct import Struct
from typing import Any, BinaryIO

HEADER = Struct(">Q")
"""Each message: its length in bytes, then that many bytes of UTF-8 JSON."""
ERROR_CHARS = 2000
"""Characters of a template error's message sent back (the 400 shows no more)."""
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""Set to 1 in the worker's environment: rendering needs no thread pools (numpy's included)."""


def encode(message: dict[str, Any]) -> tuple[bytes, bytes]:
    """A message's header and body (lone surrogates, which JSON strings may hold, kept)."""
    body = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return HEADER.pack(len(body)), body


def decode(body: bytes) -> Any:
    return json.loads(body.decode("utf-8", "surrogatepass"))


def read_message(stream: BinaryIO) -> Any:
    """The next message, or None when the server closed its end."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    body = stream.read(size)
    return decode(body) if len(body) == size else None


def send(stream: BinaryIO, message: dict[str, Any]) -> None:
    for part in encode(message):
        stream.write(part)
    stream.flush()


def address_space() -> int | None:
    """This process's virtual memory size in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def limit_memory(budget: int) -> bool:
    """Limit the address space to its size now plus ``budget`` (allocations past it raise
    ``MemoryError``); False where the size cannot be read."""
    size = address_space()
    if size is None:
        return False
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + budget if hard == resource.RLIM_INFINITY else min(size + budget, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return True


def limit_cpu(seconds: float) -> None:
    """Past ``seconds`` more of CPU time, the kernel ends this process (SIGXCPU)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def render(renderer: Callable[..., Any], request: dict[str, Any], output_chars: int) -> dict:
    """One request's reply: ``text``, or ``error`` (what the template raised), ``memory``,
    or ``output`` (the length of an output over ``output_chars``).

    As ``apply_chat_template``: keys whose value is None dropped from the messages, ``tools``
    and ``documents`` passed as themselves, every other variable as a template variable.
    """
    variables = dict(request["variables"])
    tools = variables.pop("tools", None)
    documents = variables.pop("documents", None)
    messages = [{k: v for k, v in m.items() if v is not None} for m in request["messages"]]
    try:
        rendered, _ = renderer(
            conversations=[messages],
            tools=tools,
            documents=documents,
            chat_template=request["template"],
            add_generation_prompt=request["add_generation_prompt"],
            continue_final_message=request["continue_final_message"],
            **variables,
        )
    except MemoryError:
        return {"memory": True}
    except Exception as exc:  # the template's own error, or the messages' (a 400)
        message = str(exc)
        if len(message) <= ERROR_CHARS:
            raised = repr(exc)[:ERROR_CHARS]
        else:
            raised = f"{type(exc).__name__}({message[:ERROR_CHARS]!r}...)"
        return {"error": message[:ERROR_CHARS], "raised": raised}
    text = rendered[0]
    if len(text) > output_chars:
        return {"output": len(text)}
    return {"text": text}


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the server leads
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer
    setup = read_message(requests)
    if setup is None:
        return
    sys.path[:] = setup["path"]
    from transformers.utils.chat_template_utils import render_jinja_template

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file when SIGXCPU ends it
    memory_limited = limit_memory(setup["memory_bytes"])
    try:
        send(replies, {"ready": True, "memory_limited": memory_limited})
        while (request := read_message(requests)) is not None:
            limit_cpu(setup["cpu_seconds"])
            send(replies, render(render_jinja_template, request, setup["output_chars"]))
    except BrokenPipeError:  # the server is gone
        return


if __name__ == "__main__":
    main()
