"""The pod's limits: cores from the CPU affinity and the cgroup's CPU quota, the memory limit,
read from fake cgroup v1 and v2 trees, and from a real cgroup a server is started in."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from huggingfaceserver.pod import (
    CgroupMemory,
    GiB,
    PodLimits,
    cgroup_memory,
    cgroup_mounts,
    limit_folders,
    process_cgroups,
    read_pod_limits,
    threads_within,
)
from tests.harness import REPO, ServerProcess, free_port

UNLIMITED_V1 = "9223372036854771712"

V2_MOUNTINFO = (
    "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
    "31 23 0:28 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw\n"
)
V1_MOUNTINFO = (
    "31 23 0:28 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
    "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:9 - cgroup cgroup "
    "rw,cpu,cpuacct\n"
    "33 31 0:30 {root} /sys/fs/cgroup/memory rw,nosuid shared:10 - cgroup cgroup rw,memory\n"
    "34 31 0:31 {root} /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids\n"
)
V1_CGROUP = "5:memory:{path}\n4:pids:{path}\n3:cpu,cpuacct:{path}\n0::/\n"


def fake(root: Path, files: dict[str, str]) -> Path:
    """A tree of ``/proc`` and ``/sys`` files under ``root``; a name ending in ``/``: a folder."""
    for name, text in files.items():
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v2(root: Path, cpu_max: str | None, memory_max: str | None, own="/kubepods/pod/ctr"):
    folder = "sys/fs/cgroup" + own
    files = {
        "proc/self/mountinfo": V2_MOUNTINFO,
        "proc/self/cgroup": f"0::{own}\n",
        "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n",
        f"{folder}/": "",
    }
    if cpu_max is not None:
        files[f"{folder}/cpu.max"] = cpu_max + "\n"
    if memory_max is not None:
        files[f"{folder}/memory.max"] = memory_max + "\n"
    return fake(root, files)


def v1(
    root: Path,
    quota: str,
    limit: str,
    period: str = "100000",
    own: str = "/kubepods/pod/ctr",
    mount_root: str = "/",
) -> Path:
    """cgroup v1 as Docker and Kubernetes mount it: ``mount_root`` is what the mounts show
    (the container's own cgroup without a cgroup namespace), ``own`` /proc/self/cgroup's path."""
    relative = own[len(mount_root.rstrip("/")) :].lstrip("/")
    cpu = f"sys/fs/cgroup/cpu,cpuacct/{relative}".rstrip("/")
    memory = f"sys/fs/cgroup/memory/{relative}".rstrip("/")
    return fake(
        root,
        {
            "proc/self/mountinfo": V1_MOUNTINFO.format(root=mount_root),
            "proc/self/cgroup": V1_CGROUP.format(path=own),
            f"{cpu}/cpu.cfs_quota_us": quota + "\n",
            f"{cpu}/cpu.cfs_period_us": period + "\n",
            f"{memory}/memory.limit_in_bytes": limit + "\n",
        },
    )


# --- cgroup v2 ------------------------------------------------------------------------------


def test_v2_quota_and_memory_limit(tmp_path):
    limits = read_pod_limits(v2(tmp_path, "150000 100000", str(2 * GiB)), affinity=64)
    assert limits == PodLimits(2, 2 * GiB, "cgroup v2 cpu quota (1.5 CPUs)", "cgroup v2")
    assert limits.describe() == (
        "2 cores from cgroup v2 cpu quota (1.5 CPUs), memory limit 2.0 GiB from cgroup v2"
    )


def test_v2_unlimited_is_the_affinity_and_no_memory_limit(tmp_path):
    limits = read_pod_limits(v2(tmp_path, "max 100000", "max"), affinity=6)
    assert limits == PodLimits(6, None, "CPU affinity")
    assert limits.describe() == "6 cores from CPU affinity, no memory limit"


def test_v2_own_cgroup_missing_under_the_mount_reads_the_mount_root(tmp_path):
    """With a cgroup namespace the path may name a cgroup that is not under the mount: the
    mount's root is the container's cgroup then."""
    fake(
        tmp_path,
        {
            "proc/self/mountinfo": V2_MOUNTINFO,
            "proc/self/cgroup": "0::/../../kubepods/pod/ctr\n",
            "sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
            "sys/fs/cgroup/cpu.max": "100000 100000\n",
            "sys/fs/cgroup/memory.max": f"{GiB}\n",
        },
    )
    assert limit_folders("cpu", tmp_path) == [(2, tmp_path / "sys/fs/cgroup")]
    assert read_pod_limits(tmp_path, affinity=64) == PodLimits(
        1, GiB, "cgroup v2 cpu quota (1.0 CPUs)", "cgroup v2"
    )


def test_the_tightest_of_the_own_cgroup_and_the_mount_root_wins(tmp_path):
    v2(tmp_path, "400000 100000", str(3 * GiB))
    fake(tmp_path, {"sys/fs/cgroup/cpu.max": "200000 100000", "sys/fs/cgroup/memory.max": "max"})
    limits = read_pod_limits(tmp_path, affinity=64)
    assert (limits.cores, limits.memory_bytes) == (2, 3 * GiB)


# --- cgroup v1 ------------------------------------------------------------------------------


def test_v1_quota_and_memory_limit(tmp_path):
    limits = read_pod_limits(v1(tmp_path, "100000", str(2 * GiB)), affinity=64)
    assert limits == PodLimits(1, 2 * GiB, "cgroup v1 cpu quota (1.0 CPUs)", "cgroup v1")
    assert limits.describe() == (
        "1 core from cgroup v1 cpu quota (1.0 CPUs), memory limit 2.0 GiB from cgroup v1"
    )


def test_v1_unlimited_is_the_affinity_and_no_memory_limit(tmp_path):
    limits = read_pod_limits(v1(tmp_path, "-1", UNLIMITED_V1), affinity=3)
    assert limits == PodLimits(3, None, "CPU affinity")


def test_v1_mount_root_is_the_containers_cgroup(tmp_path):
    """Without a cgroup namespace Docker mounts the container's own cgroup at the mount point:
    /proc/self/cgroup and the mount's root name the same cgroup."""
    path = "/kubepods/burstable/pod1/ctr"
    v1(tmp_path, "250000", str(GiB), own=path, mount_root=path)
    assert limit_folders("cpu", tmp_path) == [(1, tmp_path / "sys/fs/cgroup/cpu,cpuacct")]
    assert read_pod_limits(tmp_path, affinity=64) == PodLimits(
        3, GiB, "cgroup v1 cpu quota (2.5 CPUs)", "cgroup v1"
    )


def test_v1_own_cgroup_missing_under_the_mount_reads_the_mount_root(tmp_path):
    fake(
        tmp_path,
        {
            "proc/self/mountinfo": V1_MOUNTINFO.format(root="/"),
            "proc/self/cgroup": V1_CGROUP.format(path="/kubepods/pod/gone"),
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{4 * GiB}\n",
        },
    )
    assert read_pod_limits(tmp_path, affinity=64) == PodLimits(
        2, 4 * GiB, "cgroup v1 cpu quota (2.0 CPUs)", "cgroup v1"
    )


def test_hybrid_host_reads_the_v1_controllers(tmp_path):
    """This kind of host: v1 controllers, and an empty v2 hierarchy at /sys/fs/cgroup/unified
    (``0::/``) without limit files."""
    fake(
        tmp_path,
        {
            "proc/self/mountinfo": (
                "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
                "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
            ),
            "proc/self/cgroup": "4:memory:/process_api/abc\n2:cpuacct:/\n1:cpu:/\n0::/\n",
            "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": UNLIMITED_V1 + "\n",
            "sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": f"{8 * GiB}\n",
            "sys/fs/cgroup/unified/cgroup.procs": "",
        },
    )
    assert process_cgroups(tmp_path) == {
        "memory": "/process_api/abc",
        "cpuacct": "/",
        "cpu": "/",
        "": "/",
    }
    assert read_pod_limits(tmp_path, affinity=2) == PodLimits(
        2, 8 * GiB, "CPU affinity", "cgroup v1"
    )


def test_without_mountinfo_the_usual_mount_points_are_read(tmp_path):
    fake(
        tmp_path,
        {
            "proc/self/cgroup": V1_CGROUP.format(path="/a"),
            "sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_quota_us": "50000\n",
            "sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/memory/a/memory.limit_in_bytes": f"{GiB}\n",
        },
    )
    assert [mount.path for mount in cgroup_mounts(tmp_path)] == [
        tmp_path / "sys/fs/cgroup/cpu,cpuacct",
        tmp_path / "sys/fs/cgroup/memory",
    ]
    assert read_pod_limits(tmp_path, affinity=8) == PodLimits(
        1, GiB, "cgroup v1 cpu quota (0.5 CPUs)", "cgroup v1"
    )


def test_an_escaped_mount_point_is_found(tmp_path):
    fake(
        tmp_path,
        {
            "proc/self/mountinfo": "31 23 0:28 / /sys/fs/my\\040cgroup rw - cgroup2 none rw\n",
            "proc/self/cgroup": "0::/\n",
            "sys/fs/my cgroup/memory.max": f"{GiB}\n",
        },
    )
    assert read_pod_limits(tmp_path, affinity=1).memory_bytes == GiB


def test_no_cgroups_at_all_is_the_affinity(tmp_path):
    assert read_pod_limits(tmp_path, affinity=5) == PodLimits(5, None, "CPU affinity")
    assert read_pod_limits(tmp_path, affinity=0).cores == 1


# --- memory: the limit and what the cgroup uses of it ----------------------------------------


def test_v2_usage_is_the_limited_cgroup_s_memory_current(tmp_path):
    v2(tmp_path, None, str(4 * GiB))
    fake(
        tmp_path,
        {
            "sys/fs/cgroup/kubepods/pod/ctr/memory.current": f"{GiB}\n",
            "sys/fs/cgroup/memory.current": f"{3 * GiB}\n",  # the whole mount: not this limit's
        },
    )
    memory = cgroup_memory(tmp_path)
    assert memory == CgroupMemory(4 * GiB, GiB, 2)
    assert memory is not None and memory.free == 3 * GiB
    assert read_pod_limits(tmp_path, affinity=1).memory_bytes == memory.limit


def test_v1_usage_is_memory_usage_in_bytes(tmp_path):
    v1(tmp_path, "-1", str(2 * GiB))
    fake(tmp_path, {"sys/fs/cgroup/memory/kubepods/pod/ctr/memory.usage_in_bytes": f"{GiB}\n"})
    assert cgroup_memory(tmp_path) == CgroupMemory(2 * GiB, GiB, 1)


def test_usage_over_the_limit_or_unreadable(tmp_path):
    v2(tmp_path, None, str(GiB))
    assert cgroup_memory(tmp_path) == CgroupMemory(GiB, 0, 2)  # no memory.current
    fake(tmp_path, {"sys/fs/cgroup/kubepods/pod/ctr/memory.current": f"{2 * GiB}\n"})
    memory = cgroup_memory(tmp_path)
    assert memory is not None and memory.free == 0


def test_no_memory_limit_is_none(tmp_path):
    assert cgroup_memory(v2(tmp_path, None, "max")) is None
    assert cgroup_memory(tmp_path / "nothing") is None


# --- cores: affinity and quota ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "cores", "source"),
    [
        (2, "400000 100000", 2, "CPU affinity"),  # fewer CPUs to run on than the quota
        (64, "100000 100000", 1, "cgroup v2 cpu quota (1.0 CPUs)"),  # the quota is fewer
        (64, "150000 100000", 2, "cgroup v2 cpu quota (1.5 CPUs)"),  # rounded up
        (64, "50000 100000", 1, "cgroup v2 cpu quota (0.5 CPUs)"),  # at least one
        (64, "1000 100000", 1, "cgroup v2 cpu quota (0.0 CPUs)"),
        (2, "200000 100000", 2, "cgroup v2 cpu quota (2.0 CPUs)"),  # a tie: the pod's limit
    ],
)
def test_cores_are_the_fewest_of_affinity_and_quota(tmp_path, affinity, cpu_max, cores, source):
    limits = read_pod_limits(v2(tmp_path, cpu_max, None), affinity=affinity)
    assert (limits.cores, limits.cores_source) == (cores, source)


# --- garbage --------------------------------------------------------------------------------


@pytest.mark.parametrize("cpu_max", ["lots", "", "100000", "0 100000", "100000 0", "1 2 3"])
@pytest.mark.parametrize("memory_max", ["??", "", "-5", "0", "2G"])
def test_v2_garbage_is_no_limit(tmp_path, cpu_max, memory_max):
    assert read_pod_limits(v2(tmp_path, cpu_max, memory_max), affinity=4) == PodLimits(
        4, None, "CPU affinity"
    )


@pytest.mark.parametrize(
    ("quota", "period", "limit"),
    [("abc", "100000", "x"), ("100000", "zero", ""), ("100000", "0", "\x00\x01")],
)
def test_v1_garbage_is_no_limit(tmp_path, quota, period, limit):
    limits = read_pod_limits(v1(tmp_path, quota, limit, period=period), affinity=4)
    assert limits == PodLimits(4, None, "CPU affinity")


def test_garbage_proc_files_are_no_limit(tmp_path):
    fake(
        tmp_path,
        {
            "proc/self/mountinfo": "garbage\n - \n1 2 3 - cgroup2\n\n",
            "proc/self/cgroup": "nonsense\n::\n",
        },
    )
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cgroup.controllers").write_bytes(b"\xff\xfe")
    (tmp_path / "sys/fs/cgroup/memory.max").write_bytes(b"\xff\xfe")
    assert read_pod_limits(tmp_path, affinity=3) == PodLimits(3, None, "CPU affinity")


def test_this_machine_is_read_without_error():
    limits = read_pod_limits()
    assert 1 <= limits.cores <= len(os.sched_getaffinity(0))
    assert limits.memory_bytes is None or limits.memory_bytes > 0


# --- a real cgroup ----------------------------------------------------------------------------


def v1_child(controller: str, name: str) -> Path:
    """A new v1 cgroup for ``controller`` under this process's own; skips when there is none
    or it cannot be made (no cgroup v1 hierarchy, not root, a read-only /sys/fs/cgroup)."""
    folders = [folder for version, folder in limit_folders(controller) if version == 1]
    if not folders:
        pytest.skip(f"no cgroup v1 {controller} hierarchy to make a limited cgroup in")
    child = folders[0] / name
    try:
        child.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a cgroup at {child}: {error}")
    return child


def remove_cgroup(folder: Path) -> None:
    """Remove an emptied cgroup; the kernel may take a moment to see its last process gone."""
    deadline = time.monotonic() + 10
    while folder.exists():
        try:
            folder.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def limited_cgroups() -> Iterator[tuple[Path, Path]]:
    """A v1 cpu cgroup with a quota of one CPU and a v1 memory cgroup limited to 3 GiB."""
    name = f"hfs-test-{os.getpid()}"
    cpu = v1_child("cpu", name)
    try:
        memory = v1_child("memory", name)
    except BaseException:
        remove_cgroup(cpu)
        raise
    try:
        try:
            (cpu / "cpu.cfs_period_us").write_text("100000")
            (cpu / "cpu.cfs_quota_us").write_text("100000")
            (memory / "memory.limit_in_bytes").write_text(str(3 * GiB))
        except OSError as error:
            pytest.skip(f"cannot set limits on the cgroups {cpu}, {memory}: {error}")
        yield cpu, memory
    finally:
        remove_cgroup(cpu)
        remove_cgroup(memory)


@pytest.mark.slow
def test_a_server_in_a_limited_cgroup_logs_the_limits_it_read(
    limited_cgroups, tiny_models, tmp_path
):
    """``--api_workers auto`` started as a user starts it, inside a cgroup of one CPU and
    3 GiB: the layout's reason names the limits read from the cgroup, not the machine's."""
    cpu, memory = limited_cgroups
    http_port, grpc_port = free_port(), free_port()
    log_path = tmp_path / "server.log"
    enter = f'echo $$ > {cpu}/cgroup.procs && echo $$ > {memory}/cgroup.procs && exec "$@"'
    argv = [sys.executable, "-m", "huggingfaceserver", "--model_dir"]
    argv += [str(tiny_models["bert_embedding"]), "--model_name", "m", "--api_workers", "auto"]
    argv += ["--http_port", str(http_port), "--grpc_port", str(grpc_port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["sh", "-c", enter, "sh", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            cwd=REPO,
        )
    server = ServerProcess(process, http_port, grpc_port, log_path)
    try:
        pattern = r"one process \((auto: no CUDA device \(pod: [^\n]*)\)\n"
        match = server.wait_for_log(pattern, timeout=180)
        assert str(process.pid) in (cpu / "cgroup.procs").read_text().split()
        assert str(process.pid) in (memory / "cgroup.procs").read_text().split()
    finally:
        process.terminate()
        process.wait(timeout=60)
    reason = match.group(1)
    assert reason == (
        "auto: no CUDA device (pod: 1 core from cgroup v1 cpu quota (1.0 CPUs), memory limit "
        "3.0 GiB from cgroup v1)"
    ), reason


# --- intra-op threads ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpu_max", "threads", "kept"), [("200000 100000", 64, 2), ("max 100000", 8, 8)]
)
def test_a_runtimes_threads_are_kept_within_the_cpu_quota(
    tmp_path, monkeypatch, cpu_max, threads, kept
):
    """torch counts the node's cores in the CPU affinity: under a 2-CPU quota 64 threads would
    be throttled by it; OMP_NUM_THREADS, where set, is as given."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    root = v2(tmp_path, cpu_max, None)
    assert threads_within(threads, root, affinity=64) == kept
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    assert threads_within(threads, root, affinity=64) == threads
