"""What the pod allows this process: its usable cores and its memory limit (read here only:
the layout and vLLM's CPU KV cache are sized from it).

A pod limited to ``cpu: 1`` on a 64-core node still sees 64 cores in ``os.cpu_count()``; its
limits are in the process's cgroup. Read (cgroup v1 and v2, hybrid hosts included):

- cores: the fewest of the CPU affinity and the CPU quota rounded up (v2 ``cpu.max``, v1
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), at least 1;
- memory: v2 ``memory.max``, v1 ``memory.limit_in_bytes``, and what the cgroup with that limit
  uses now (v2 ``memory.current``, v1 ``memory.usage_in_bytes``); the memory available now
  (``/proc/meminfo``'s ``MemAvailable``, within what the cgroup may still take).

The cgroup mounts come from ``/proc/self/mountinfo`` (the usual places under ``/sys/fs/cgroup``
when it cannot be read) and the process's cgroup from ``/proc/self/cgroup``. Each limit is read
in the process's own cgroup folder and at the root of the mount (in a container the path in
``/proc/self/cgroup`` may not exist under the mount, and the mount root is the container's
cgroup); the tightest wins. A missing or unreadable file is no limit, never an error.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .units import GiB, MiB

UNLIMITED_MEMORY = 1 << 62
"""A v1 ``memory.limit_in_bytes`` at or above this is "no limit" (the kernel writes
9223372036854771712, the largest page-aligned value)."""
DEFAULT_MOUNTS = "/sys/fs/cgroup"


@dataclass(frozen=True)
class PodLimits:
    cores: int
    """Cores this process may use: the fewest of its CPU affinity and its cgroup's CPU quota."""
    memory_bytes: int | None
    """The cgroup's memory limit; None: none."""
    cores_source: str = "CPU affinity"
    memory_source: str = ""

    def describe(self) -> str:
        """For the log: ``1 core from cgroup v1 cpu quota (1.0 CPUs), memory limit 2.0 GiB
        from cgroup v1``."""
        cores = f"{self.cores} core{'s' if self.cores != 1 else ''} from {self.cores_source}"
        if self.memory_bytes is None:
            return f"{cores}, no memory limit"
        return f"{cores}, memory limit {gib(self.memory_bytes)} from {self.memory_source}"


def gib(size: int) -> str:
    return f"{size / GiB:.1f} GiB"


def human(size: int) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB else f"{size / MiB:.0f} MiB"


@dataclass(frozen=True)
class Memory:
    """Bytes this process can have now, and where that figure comes from."""

    available: int
    where: str


def available_memory(root: Path = Path("/")) -> Memory:
    """Memory available now on this host, within what the cgroup may still take."""
    return within_cgroup(host_memory(root), root)


def within_cgroup(memory: Memory, root: Path = Path("/")) -> Memory:
    """``memory``, or what the cgroup may still take before its limit where that is less."""
    cgroup = cgroup_memory(root)
    if cgroup is not None and cgroup.free < memory.available:
        return Memory(cgroup.free, f"the cgroup (limit {human(cgroup.limit)})")
    return memory


def host_memory(root: Path) -> Memory:
    return Memory(meminfo(root / "proc/meminfo").get("MemAvailable", 0), "this host")


def meminfo(path: Path) -> dict[str, int]:
    """``/proc/meminfo`` or a NUMA node's ``meminfo``, in bytes."""
    info = {}
    for line in path.read_text().splitlines():
        match = re.search(r"([\w()]+):\s+(\d+)\s*kB", line)
        if match:
            info[match.group(1)] = int(match.group(2)) * 1024
    return info


@dataclass(frozen=True)
class CgroupMount:
    version: int
    """1 or 2."""
    controllers: frozenset[str]
    """v1: the controllers of the hierarchy (from the mount options); v2: empty (all)."""
    root: str
    """The cgroup at the mount point, within the hierarchy (``/`` unless namespaced)."""
    path: Path
    """The mount point, under the root the files are read from."""

    def serves(self, controller: str) -> bool:
        return self.version == 2 or controller in self.controllers


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _unescape(field: str) -> str:
    """Mount points in mountinfo escape space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def cgroup_mounts(root: Path = Path("/")) -> list[CgroupMount]:
    """The cgroup mounts in ``/proc/self/mountinfo``; the usual places when it lists none."""
    mounts = []
    for line in (read_text(root / "proc/self/mountinfo") or "").splitlines():
        before, separator, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not separator or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] not in ("cgroup", "cgroup2"):
            continue
        mount_point = root / _unescape(fields[4]).lstrip("/")
        version = 2 if tail[0] == "cgroup2" else 1
        controllers = frozenset(tail[2].split(",")) if version == 1 else frozenset()
        mounts.append(CgroupMount(version, controllers, _unescape(fields[3]), mount_point))
    return mounts or default_mounts(root)


def default_mounts(root: Path) -> list[CgroupMount]:
    """Where cgroups are mounted by default: v2 at ``/sys/fs/cgroup``, or v1 controllers in
    folders of their own under it."""
    base = root / DEFAULT_MOUNTS.lstrip("/")
    if (base / "cgroup.controllers").is_file():
        return [CgroupMount(2, frozenset(), "/", base)]
    v1 = {"cpu,cpuacct": {"cpu", "cpuacct"}, "cpu": {"cpu"}, "memory": {"memory"}}
    return [
        CgroupMount(1, frozenset(controllers), "/", base / name)
        for name, controllers in v1.items()
        if (base / name).is_dir()
    ]


def process_cgroups(root: Path = Path("/")) -> dict[str, str]:
    """This process's cgroup per controller from ``/proc/self/cgroup``; ``""`` keys the v2
    (unified) hierarchy."""
    paths = {}
    for line in (read_text(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            paths[""] = path
        for controller in controllers.split(","):
            if controller:
                paths.setdefault(controller, path)
    return paths


def limit_folders(controller: str, root: Path = Path("/")) -> list[tuple[int, Path]]:
    """``(cgroup version, folder)`` where ``controller``'s limits for this process are: its own
    cgroup's folder (when it exists under the mount) and the mount's root."""
    own = process_cgroups(root)
    folders: list[tuple[int, Path]] = []
    for mount in cgroup_mounts(root):
        if not mount.serves(controller):
            continue
        path = own.get("" if mount.version == 2 else controller)
        candidates = [mount.path]
        if path is not None:
            mount_root = mount.root.rstrip("/")
            if path == mount_root or path.startswith(mount_root + "/"):
                candidates.insert(0, mount.path / path[len(mount_root) :].lstrip("/"))
        for folder in candidates:
            if folder.is_dir() and (mount.version, folder) not in folders:
                folders.append((mount.version, folder))
    return folders


def _positive_int(text: str | None) -> int | None:
    try:
        value = int((text or "").strip())
    except ValueError:
        return None
    return value if value > 0 else None


def cpu_quota(version: int, folder: Path) -> float | None:
    """The CPUs the cgroup at ``folder`` may use (1.5: 150 ms per 100 ms); None: no quota."""
    if version == 2:
        fields = (read_text(folder / "cpu.max") or "").split()
        if len(fields) != 2:
            return None
        quota, period = _positive_int(fields[0]), _positive_int(fields[1])
    else:
        quota = _positive_int(read_text(folder / "cpu.cfs_quota_us"))
        period = _positive_int(read_text(folder / "cpu.cfs_period_us"))
    if quota is None or period is None:
        return None
    return quota / period


def memory_limit(version: int, folder: Path) -> int | None:
    """The cgroup's memory limit in bytes; None: none."""
    if version == 2:
        return _positive_int(read_text(folder / "memory.max"))
    limit = _positive_int(read_text(folder / "memory.limit_in_bytes"))
    return limit if limit is not None and limit < UNLIMITED_MEMORY else None


def memory_usage(version: int, folder: Path) -> int:
    """The memory the cgroup at ``folder`` uses now, in bytes (0 where unreadable)."""
    name = "memory.current" if version == 2 else "memory.usage_in_bytes"
    return _positive_int(read_text(folder / name)) or 0


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit of this process's cgroups, and what that cgroup uses."""

    limit: int
    usage: int
    version: int
    """The cgroup version the limit is read from: 1 or 2."""

    @property
    def free(self) -> int:
        """What the cgroup may still take before its limit."""
        return max(self.limit - self.usage, 0)


def cgroup_memory(root: Path = Path("/")) -> CgroupMemory | None:
    """The tightest memory limit among this process's own cgroup and the mount's root (v2 and
    v1), with the usage of the cgroup it is on; None: no limit."""
    limits = [
        (limit, version, folder)
        for version, folder in limit_folders("memory", root)
        if (limit := memory_limit(version, folder)) is not None
    ]
    if not limits:
        return None
    limit, version, folder = min(limits, key=lambda found: found[:2])
    return CgroupMemory(limit, memory_usage(version, folder), version)


def affinity_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def read_pod_limits(root: Path = Path("/"), affinity: int | None = None) -> PodLimits:
    """The cores and memory this process may use (``root``: where ``/proc`` and ``/sys`` are
    read from; ``affinity``: the CPUs it may run on, by default its real affinity)."""
    cores = max(1, affinity if affinity is not None else affinity_cores())
    cores_source = "CPU affinity"
    quotas = [
        (cpus, version)
        for version, folder in limit_folders("cpu", root)
        if (cpus := cpu_quota(version, folder)) is not None
    ]
    if quotas:
        cpus, version = min(quotas)
        if math.ceil(cpus) <= cores:
            cores = max(1, math.ceil(cpus))
            cores_source = f"cgroup v{version} cpu quota ({cpus:.1f} CPUs)"
    memory = cgroup_memory(root)
    if memory is None:
        return PodLimits(cores, None, cores_source)
    return PodLimits(cores, memory.limit, cores_source, f"cgroup v{memory.version}")


def threads_within(threads: int, root: Path = Path("/"), affinity: int | None = None) -> int:
    """``threads`` (a runtime's own count of intra-op threads: torch's, from the CPU affinity)
    no more than the pod's cores: a ``cpu: 2`` limit on a 64-core node leaves 2 (more threads
    than the quota runs are throttled by it, every forward waiting on the slowest). Where
    ``OMP_NUM_THREADS`` is set: as given."""
    if "OMP_NUM_THREADS" in os.environ:
        return threads
    return max(1, min(threads, read_pod_limits(root, affinity).cores))
