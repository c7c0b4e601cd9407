"""With ``--api_workers N`` (N > 1): the parent of one engine process and N front processes.

The engine loads the model and batches for every front; each front serves HTTP and gRPC on the
shared ports. The engine is spawned; the fronts are forked from multiprocessing's fork server,
which imports their modules once (:data:`FRONT_PRELOAD`), so they are its children and this
process's grandchildren. This process only watches them: when one exits unasked, the others
are stopped and the server exits non-zero (Kubernetes restarts it) rather than serve half. On
SIGTERM (or SIGINT, SIGQUIT) the fronts stop accepting and drain their requests first, then
the engine stops. Each child exits by itself if this process dies, so none is ever orphaned.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path

from ..cli import ServerConfig
from ..edge.admission import FileSlots
from ..edge.shared_count import SharedCount
from ..errors import EngineDied, ProcessDied, StartupError
from ..observability.metrics import shared_across_processes
from .engine import STOP_SIGNAL

logger = logging.getLogger(__name__)

FRONT_STOP_MARGIN_S = 10.0
"""How much longer than ``--shutdown_grace_seconds`` fronts get after SIGTERM before SIGKILL."""
ENGINE_STOP_S = 15.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
FRONT_PRELOAD = [f"{__package__}.front"]
"""What multiprocessing's fork server imports before it forks the fronts (:mod:`.front`); the
engine is spawned."""


@dataclass(frozen=True)
class Wiring:
    """What a child needs to find the others."""

    address: str
    """The engine's ZeroMQ endpoint."""
    run_dir: str
    """A private folder for the socket and the children's error reports."""
    fronts: int

    def error_file(self, name: str) -> Path:
        return Path(self.run_dir) / f"{name}.error"


def run_processes(config: ServerConfig, fronts: int) -> None:
    """Start the engine and ``fronts`` front processes; return when they have all stopped on
    request; when one of them exited unasked, raise :class:`StartupError` if the server was
    not yet serving, else :class:`ProcessDied`."""
    from ..edge.listeners import check_port_free, http_port

    check_port_free(http_port(config.server), "HTTP")
    if config.server.enable_grpc:
        check_port_free(config.server.grpc_port, "gRPC")
    run_dir = tempfile.mkdtemp(prefix="huggingfaceserver-")
    wiring = Wiring(f"ipc://{run_dir}/engine.sock", run_dir, fronts)
    metrics_dir = Path(run_dir, "metrics")
    metrics_dir.mkdir()
    try:
        with shared_across_processes(str(metrics_dir)):  # /metrics sums over the children
            ProcessGroup(config, wiring).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class ProcessGroup:
    def __init__(self, config: ServerConfig, wiring: Wiring):
        self.wiring = wiring
        self.engine = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(config, wiring), name="engine", daemon=False
        )
        # admission is counted once for the server: the fronts share one counter
        slots = FileSlots.create(str(Path(wiring.run_dir) / "admission"))
        # and the server is ready once every front is: they share one count of ready fronts
        ready = SharedCount.create(str(Path(wiring.run_dir) / "ready"))
        self.ready_fronts = SharedCount(ready)
        """Fronts counted once each when first ready: all of them, the server was serving."""
        front_context = multiprocessing.get_context("forkserver")
        front_context.set_forkserver_preload(FRONT_PRELOAD)
        self.fronts = [
            front_context.Process(
                target=front_main,
                args=(config, wiring, index, slots, ready),
                name=f"front-{index}",
            )
            for index in range(wiring.fronts)
        ]
        self.front_stop_s = config.shutdown_grace_seconds + FRONT_STOP_MARGIN_S
        self.stop_requested = False

    @property
    def children(self) -> list[BaseProcess]:
        return [self.engine, *self.fronts]

    def run(self) -> None:
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        wake_write.setblocking(False)
        previous_fd = signal.set_wakeup_fd(wake_write.fileno())
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            for child in self.children:
                child.start()
            logger.info(
                "engine pid %s, fronts pids %s",
                self.engine.pid,
                ", ".join(str(front.pid) for front in self.fronts),
            )
            self._watch(wake_read)
        finally:
            self._stop_all()
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            wake_read.close()
            wake_write.close()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_requested = True

    def _watch(self, wake: socket.socket) -> None:
        """Until a stop is asked for (then return) or a child exits (then raise)."""
        sentinels = {child.sentinel: child for child in self.children}
        while not self.stop_requested:
            ready = wait([*sentinels, wake])
            if wake in ready:
                try:
                    while wake.recv(512):
                        pass
                except BlockingIOError:
                    pass
            for sentinel in ready:
                child = sentinels.get(sentinel) if isinstance(sentinel, int) else None
                if child is not None and not self.stop_requested:
                    raise self.exit_error(child)
        logger.info("stopping: fronts drain their requests, then the engine stops")

    def exit_error(self, child: BaseProcess) -> StartupError | ProcessDied:
        """What ``child``'s unasked exit ends the server with: a startup failure until every
        front was ready, a run-time one after."""
        serving = self.ready_fronts.value() >= self.wiring.fronts
        return (ProcessDied if serving else StartupError)(self._exit_report(child))

    def _exit_report(self, child: BaseProcess) -> str:
        """Why ``child`` exited: the engine's own error when it left one (a front that lost
        the engine only knows that it stopped), else the child's, else its exit status."""
        child.join()
        for name in ("engine", child.name):
            error = self.wiring.error_file(name)
            if error.is_file():
                return error.read_text().strip()
        code = child.exitcode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code and code < 0
            else (f"exited with status {code}")
        )
        return f"the {child.name} process {how}"

    def _stop_all(self) -> None:
        """Fronts first (they drain, the engine still serving them), then the engine."""
        stops = (
            (self.fronts, signal.SIGTERM, self.front_stop_s),
            ([self.engine], STOP_SIGNAL, ENGINE_STOP_S),
        )
        for group, stop_signal, timeout in stops:
            started = [child for child in group if child.pid is not None]
            for child in started:
                if child.exitcode is None:
                    os.kill(child.pid, stop_signal)  # type: ignore[arg-type]
            for child in started:
                child.join(timeout)
                if child.exitcode is None:
                    logger.warning("%s did not stop in %.0f s: killed", child.name, timeout)
                    child.kill()
                    child.join()


def exit_with_parent() -> None:
    """Exit at once if the supervisor dies (it would otherwise leave this process behind)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _child_setup(config: ServerConfig) -> None:
    from ..observability.logs import configure_logging

    configure_logging(config.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent leads
    exit_with_parent()


def _report(wiring: Wiring, name: str, exc: StartupError | EngineDied) -> None:
    """Leave the child's one-line error for the supervisor, which prints it last."""
    wiring.error_file(name).write_text(str(exc))


def engine_main(config: ServerConfig, wiring: Wiring) -> None:
    """The engine process: load the model, serve the fronts until SIGTERM."""
    _child_setup(config)
    from ..assembly import engine_local_backend
    from .engine.process import serve_engine

    try:
        serve_engine(engine_local_backend(config), wiring.address, wiring.fronts, config.model_name)
    except StartupError as exc:
        _report(wiring, "engine", exc)
        raise SystemExit(1) from None


def front_main(config: ServerConfig, wiring: Wiring, index: int, slots: str, ready: str) -> None:
    """A front process (:mod:`.front`), forked from the fork server that preloaded it."""
    _child_setup(config)
    from ..observability.startup import importing

    with importing(freeze=True):  # already imported by the fork server: freezes what it made
        from .front import serve_front

    try:
        serve_front(config, wiring.address, index, wiring.fronts, slots, ready)
    except (StartupError, EngineDied) as exc:
        _report(wiring, f"front-{index}", exc)
        raise SystemExit(1) from None
