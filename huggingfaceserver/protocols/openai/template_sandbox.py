"""Request chat templates, rendered in a worker process that the server can kill.

A template sent in a request is code from the client, accepted only with
``--trust_request_chat_template``. It renders exactly as transformers renders a chat template
(its ``render_jinja_template``: jinja2's ``ImmutableSandboxedEnvironment`` with transformers'
filters and globals), but in a process of its own (:mod:`.template_worker`), within limits:

- :data:`MAX_SECONDS` of wall time per render, kept by the server: past it the worker is killed
  (SIGKILL, whatever it runs, C code included) and a new one started;
- :data:`MAX_MEMORY_BYTES` of address space beyond the worker's idle size (``RLIMIT_AS``): an
  allocation past it fails in the worker, never in the server, and the worker is replaced;
- :data:`CPU_SECONDS` of CPU time per render (``RLIMIT_CPU``), so that a worker whose server
  died stops by itself;
- :data:`MAX_SOURCE_CHARS` of template and :data:`MAX_OUTPUT_CHARS` of output.

Each limit is a :class:`TemplateLimit` (a 400 that names it); an error the template raises is a
:class:`TemplateFailed`. Workers start at the first request template, never at import (one by
default); a render has a worker to itself, so concurrent renders never share a pipe. Rendering
blocks the calling thread: callers run it in a worker thread, never on the event loop.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import selectors
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from ...errors import ServerError
from ...units import MiB
from .template_worker import HEADER, THREAD_VARIABLES, decode, encode

logger = logging.getLogger(__name__)

MAX_SECONDS = 1.0
"""Wall time for compiling and rendering one request's template."""
MAX_SOURCE_CHARS = 256 * 2**10
"""Length of a request's template (the largest on the Hub are a few tens of KiB)."""
MAX_OUTPUT_CHARS = 8 * 2**20
"""Characters of a rendered template."""
MAX_MEMORY_BYTES = 256 * MiB
"""Address space a render may add to the worker's idle size."""
CPU_SECONDS = MAX_SECONDS + 2
"""CPU time per render, after which the kernel ends the worker: above the deadline, so that
the server's kill comes first while the server lives."""
STARTUP_SECONDS = 60.0
"""Time for a worker to start (Python and transformers imported: about a second)."""
WORKER_SCRIPT = Path(__file__).with_name("template_worker.py")
READ_CHUNK = MiB


class TemplateLimit(Exception):
    """A request's template past one of the sandbox's limits (a 400 that names it)."""


class TemplateFailed(Exception):
    """An error raised in the worker by the template (or by transformers, on these messages).
    Its ``repr`` is the original exception's, as the worker wrote it."""

    def __init__(self, message: str, raised: str):
        super().__init__(message)
        self.raised = raised

    def __repr__(self) -> str:
        return self.raised


class WorkerGone(Exception):
    """The worker closed its end of the pipe (it ended) before replying."""


def read_exactly(fd: int, size: int, deadline: float) -> bytes | None:
    """``size`` bytes from ``fd``, or None past ``deadline`` (monotonic clock)."""
    chunks: list[bytes] = []
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while size > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                return None
            chunk = os.read(fd, min(size, READ_CHUNK))
            if not chunk:
                raise WorkerGone
            chunks.append(chunk)
            size -= len(chunk)
    return b"".join(chunks)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "killed by the server"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class TemplateWorker:
    """One worker process: started when first needed, replaced after a limit."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.ready = False
        self.stopped_at_exit = False

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        """Start the process and send its setup (without waiting for it to be ready)."""
        env = {**os.environ, **dict.fromkeys(THREAD_VARIABLES, "1")}
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.ready = False
        if not self.stopped_at_exit:
            atexit.register(self.stop)
            self.stopped_at_exit = True
        setup = {
            "path": [path for path in sys.path if isinstance(path, str)],
            "memory_bytes": MAX_MEMORY_BYTES,
            "cpu_seconds": CPU_SECONDS,
            "output_chars": MAX_OUTPUT_CHARS,
        }
        self.send(encode(setup))

    def send(self, message: tuple[bytes, bytes]) -> None:
        """An encoded message (see :func:`.template_worker.encode`)."""
        assert self.process is not None and self.process.stdin is not None
        for part in message:
            self.process.stdin.write(part)
        self.process.stdin.flush()

    def receive(self, deadline: float) -> Any:
        """The worker's next message, or None past ``deadline``; :class:`WorkerGone` if it
        ended."""
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        header = read_exactly(fd, HEADER.size, deadline)
        if header is None:
            return None
        body = read_exactly(fd, HEADER.unpack(header)[0], deadline)
        return None if body is None else decode(body)

    def stop(self) -> int | None:
        """End the process (killed if it still runs); its exit status if it had ended."""
        process, self.process, self.ready = self.process, None, False
        if process is None:
            return None
        code = process.poll()
        if code is None:
            process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with suppress(OSError):  # a pipe to a dead process: nothing left to flush
                    stream.close()
        return code

    def wait_ready(self) -> None:
        """A running worker, ready for a request (started or restarted as needed)."""
        if self.process is None or self.process.poll() is not None:
            self.stop()
            try:
                self.start()
            except OSError as exc:
                raise ServerError(f"the chat template worker process did not start: {exc}") from exc
        if self.ready:
            return
        try:
            hello = self.receive(time.monotonic() + STARTUP_SECONDS)
        except WorkerGone:
            hello = None
        if hello is None:
            assert self.process is not None
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1)  # an import error: let it exit, for its status
            how = describe_exit(self.stop())
            raise ServerError(
                f"the chat template worker process did not start ({how}); the server log "
                f"has its error"
            )
        self.ready = True
        if not hello["memory_limited"]:
            logger.warning("chat template worker: no memory limit here (no /proc/self/statm)")

    def render(self, request: dict[str, Any]) -> dict[str, Any]:
        """The worker's reply to ``request``; :class:`TemplateLimit` past the deadline, past
        the memory limit, or when the render ended the worker (which is then replaced)."""
        message = encode(request)  # before the worker is involved: it stays in step
        self.wait_ready()
        deadline = time.monotonic() + MAX_SECONDS
        try:
            self.send(message)
            reply = self.receive(deadline)
        except (WorkerGone, BrokenPipeError):
            assert self.process is not None
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1)  # it closed its pipe: it is ending
            how = describe_exit(self.replace())
            raise TemplateLimit(
                f"rendering the chat template ended its worker process ({how}); the limits "
                f"are {MAX_SECONDS:g} s and {MAX_MEMORY_BYTES // MiB} MiB"
            ) from None
        except BaseException:
            self.stop()  # whatever went wrong, the pipe may be out of step: a new worker
            raise
        if reply is None:
            logger.warning(
                "a request's chat template ran past %g s: worker process %s killed",
                MAX_SECONDS,
                self.pid,
            )
            self.replace()
            raise TemplateLimit(f"the chat template ran longer than its limit of {MAX_SECONDS:g} s")
        if reply.get("memory"):
            self.replace()
            raise TemplateLimit(
                f"the chat template needs more memory than its limit of "
                f"{MAX_MEMORY_BYTES // MiB} MiB"
            )
        assert isinstance(reply, dict)
        return reply

    def replace(self) -> int | None:
        """Stop this process and start the next at once (it imports while the server goes on);
        the stopped one's exit status if it had ended."""
        code = self.stop()
        try:
            self.start()
        except OSError:  # the next render tries again, and reports it
            logger.exception("chat template worker: cannot start a new worker process")
        return code


class TemplateSandbox:
    """A pool of template workers (``workers`` processes, started as renders need them)."""

    def __init__(self, workers: int = 1):
        self.workers = [TemplateWorker() for _ in range(workers)]
        self.idle: queue.SimpleQueue[TemplateWorker] = queue.SimpleQueue()
        for worker in self.workers:
            self.idle.put(worker)

    def render(
        self,
        template: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        variables: dict[str, Any],
    ) -> str:
        """``template`` rendered by transformers' ``render_jinja_template`` in a worker, with
        ``variables`` (special tokens and the request's kwargs, ``tools`` and ``documents``
        among them) as ``apply_chat_template`` passes its keyword arguments. Blocking."""
        if len(template) > MAX_SOURCE_CHARS:
            raise TemplateLimit(
                f"the chat template is {len(template)} characters long (limit {MAX_SOURCE_CHARS})"
            )
        request = {
            "template": template,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "variables": variables,
        }
        worker = self.idle.get()
        try:
            reply = worker.render(request)
        finally:
            self.idle.put(worker)
        if "error" in reply:
            raise TemplateFailed(reply["error"], reply["raised"])
        if "output" in reply:
            raise TemplateLimit(
                f"the chat template's output is over its limit of {MAX_OUTPUT_CHARS} characters"
            )
        text = reply["text"]
        assert isinstance(text, str)
        return text

    def warm(self) -> None:
        """Start every worker and wait until each is ready (renders do it when they need to).
        Blocking."""
        taken = [self.idle.get() for _ in self.workers]
        try:
            for worker in taken:
                worker.wait_ready()
        finally:
            for worker in taken:
                self.idle.put(worker)

    def pids(self) -> list[int]:
        """The worker processes running now."""
        return [worker.pid for worker in self.workers if worker.pid is not None]

    def close(self) -> None:
        """Stop the workers (call with no render in flight); a later render starts them again."""
        for worker in self.workers:
            worker.stop()


sandbox = TemplateSandbox()
"""The server's sandbox (its worker starts at the first request template)."""
