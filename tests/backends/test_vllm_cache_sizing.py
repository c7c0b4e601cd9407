"""Sizing vLLM's CPU KV cache (backends/vllm/cache_sizing.py) from fake memory figures, fake
/sys and /proc trees and hand-made model configs; no vLLM needed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from transformers import GPT2Config, LlamaConfig

from huggingfaceserver.backends.vllm.cache_sizing import (
    BLOCK_TOKENS,
    Memory,
    ModelMemory,
    model_memory,
    plan_kv_cache,
    read_memory,
    size_kv_cache,
)
from huggingfaceserver.cli import ServerConfig
from huggingfaceserver.loading import ModelSource
from huggingfaceserver.tasks import Task
from huggingfaceserver.units import GiB, MiB

KiB = 1 << 10


def headroom(available: int) -> int:
    return 2 * GiB + int(available * 0.1)


# --- size_kv_cache --------------------------------------------------------------------------


def test_the_cache_takes_what_is_left_after_weights_and_headroom():
    memory = Memory(16 * GiB, "NUMA node 0")
    model = ModelMemory(weights=1 * GiB, bytes_per_token=64 * KiB, context=4096, max_num_seqs=256)
    plan = size_kv_cache(memory, model)
    block = 64 * KiB * BLOCK_TOKENS
    left = 16 * GiB - 1 * GiB - headroom(16 * GiB)
    assert plan.fits
    assert plan.size == left // block * block
    assert left - block < plan.size <= left
    assert "room for 45 of 256 sequences at the full 4096 tokens" in plan.reason
    assert "16.00 GiB available on NUMA node 0, less 1.00 GiB of weights" in plan.reason


def test_the_cache_is_capped_at_every_sequence_at_the_full_context():
    model = ModelMemory(weights=MiB, bytes_per_token=KiB, context=128, max_num_seqs=8)
    plan = size_kv_cache(Memory(10 * GiB, "NUMA node 0"), model)
    assert plan.size == 8 * 128 * KiB  # 8 sequences of one 128-token block
    assert "KV cache 1 MiB, room for 8 of 8 sequences at the full 128 tokens" in plan.reason


def test_a_context_is_counted_in_whole_blocks():
    model = ModelMemory(weights=0, bytes_per_token=KiB, context=BLOCK_TOKENS + 2, max_num_seqs=1)
    assert size_kv_cache(Memory(8 * GiB, "this host"), model).size == 2 * BLOCK_TOKENS * KiB


def test_one_full_context_sequence_that_does_not_fit_is_refused():
    # a Llama-3.2-1B shape in float32: 64 KiB a token, 8 GiB for one 131072-token sequence
    model = ModelMemory(weights=5 * GiB, bytes_per_token=64 * KiB, context=131072, max_num_seqs=128)
    plan = size_kv_cache(Memory(12 * GiB, "the cgroup (limit 16.00 GiB)"), model)
    assert not plan.fits and plan.size == 0
    left = 12 * GiB - 5 * GiB - headroom(12 * GiB)
    assert plan.reason.startswith(
        f"one 131072-token sequence needs 8.00 GiB of KV cache and {left / GiB:.2f} GiB is left"
    )
    assert "12.00 GiB available on the cgroup (limit 16.00 GiB)" in plan.reason


def test_weights_larger_than_the_memory_leave_nothing():
    model = ModelMemory(weights=9 * GiB, bytes_per_token=KiB, context=128, max_num_seqs=8)
    plan = size_kv_cache(Memory(8 * GiB, "NUMA node 0"), model)
    assert not plan.fits
    assert "and 0 MiB is left" in plan.reason


# --- memory figures -------------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_system(root: Path, node: int = 1) -> None:
    """A host with 10 GiB available and this process's first CPU on NUMA node ``node``
    (6 GiB free there, as vLLM counts it: free, file pages and reclaimable slab)."""
    cpu = min(os.sched_getaffinity(0))
    (root / f"sys/devices/system/cpu/cpu{cpu}/node{node}").mkdir(parents=True)
    write(
        root / f"sys/devices/system/node/node{node}/meminfo",
        f"Node {node} MemTotal: 16777216 kB\nNode {node} MemFree: 3145728 kB\n"
        f"Node {node} Active(file): 1048576 kB\nNode {node} Inactive(file): 1048576 kB\n"
        f"Node {node} SReclaimable: 1048576 kB\nNode {node} Active(anon): 1048576 kB\n",
    )
    write(root / "proc/meminfo", "MemTotal: 33554432 kB\nMemAvailable: 10485760 kB\n")


def test_memory_is_counted_on_the_numa_node_vllm_binds_to(tmp_path):
    fake_system(tmp_path, node=1)
    assert read_memory(tmp_path) == Memory(6 * GiB, "NUMA node 1")


def test_without_numa_information_the_hosts_available_memory_counts(tmp_path):
    write(tmp_path / "proc/meminfo", "MemTotal: 33554432 kB\nMemAvailable: 10485760 kB\n")
    assert read_memory(tmp_path) == Memory(10 * GiB, "this host")


def cgroup_v2(root: Path) -> Path:
    """cgroup v2 mounted at ``/sys/fs/cgroup`` (its ``cgroup.controllers`` says so), read as
    :func:`huggingfaceserver.pod.cgroup_memory` reads it."""
    write(root / "sys/fs/cgroup/cgroup.controllers", "cpu memory pids\n")
    return root / "sys/fs/cgroup"


def test_a_cgroup_v2_limit_below_the_node_memory_wins(tmp_path):
    fake_system(tmp_path)
    cgroup_v2(tmp_path)
    write(tmp_path / "sys/fs/cgroup/memory.max", f"{4 * GiB}\n")
    write(tmp_path / "sys/fs/cgroup/memory.current", f"{1 * GiB}\n")
    assert read_memory(tmp_path) == Memory(3 * GiB, "the cgroup (limit 4.00 GiB)")


def test_a_cgroup_limit_above_what_the_node_has_changes_nothing(tmp_path):
    fake_system(tmp_path)
    cgroup_v2(tmp_path)
    write(tmp_path / "sys/fs/cgroup/memory.max", f"{64 * GiB}\n")
    write(tmp_path / "sys/fs/cgroup/memory.current", f"{1 * GiB}\n")
    assert read_memory(tmp_path) == Memory(6 * GiB, "NUMA node 1")


@pytest.mark.parametrize(
    ("limit_file", "limit"),
    [("memory.max", "max"), ("memory/memory.limit_in_bytes", "9223372036854771712")],
)
def test_an_unlimited_cgroup_changes_nothing(tmp_path, limit_file, limit):
    fake_system(tmp_path)
    if limit_file == "memory.max":
        cgroup_v2(tmp_path)
    write(tmp_path / "sys/fs/cgroup" / limit_file, limit + "\n")
    assert read_memory(tmp_path) == Memory(6 * GiB, "NUMA node 1")


def test_a_cgroup_v1_limit_counts(tmp_path):
    fake_system(tmp_path)
    write(tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{2 * GiB}\n")
    write(tmp_path / "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{GiB // 2}\n")
    assert read_memory(tmp_path).available == 3 * GiB // 2


def test_the_limit_of_the_process_own_cgroup_counts(tmp_path):
    """As the pod's limits are read (huggingfaceserver.pod): the mounts from mountinfo, the
    process's cgroup from /proc/self/cgroup; its own limit is tighter than the mount root's."""
    fake_system(tmp_path)
    own = cgroup_v2(tmp_path) / "kubepods/pod/ctr"
    write(
        tmp_path / "proc/self/mountinfo",
        "31 23 0:28 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n",
    )
    write(tmp_path / "proc/self/cgroup", "0::/kubepods/pod/ctr\n")
    write(tmp_path / "sys/fs/cgroup/memory.max", "max\n")
    write(own / "memory.max", f"{4 * GiB}\n")
    write(own / "memory.current", f"{3 * GiB}\n")
    assert read_memory(tmp_path) == Memory(GiB, "the cgroup (limit 4.00 GiB)")


def test_the_real_machines_memory_is_readable():
    memory = read_memory()
    assert memory.available > 0


# --- the model's figures --------------------------------------------------------------------


def source_for(folder: Path, config) -> ModelSource:
    config.save_pretrained(folder)
    return ModelSource(folder, folder, Task.text_generation, None, config.architectures or [])


@pytest.fixture
def llama(tmp_path) -> ModelSource:
    """4 layers, 8 heads of 64 with 2 KV heads, bfloat16 weights (1,000 bytes), 4096 tokens."""
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 5000)  # vLLM loads the safetensors
    config = LlamaConfig(
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=512,
        max_position_embeddings=4096,
        dtype="bfloat16",
    )
    return source_for(tmp_path, config)


def test_keys_and_values_of_every_layer_at_the_served_dtype(llama):
    model = model_memory(llama, ServerConfig())
    assert model == ModelMemory(
        weights=2000,  # bfloat16 on disk, float32 served (auto on a CPU)
        bytes_per_token=2 * 4 * 2 * 64 * 4,
        context=4096,
        max_num_seqs=128,
    )


def test_flags_that_change_the_kv_cache_are_counted(llama):
    config = ServerConfig(
        dtype="bfloat16",
        max_length=1024,
        engine_flags={"kv-cache-dtype": ["fp8"], "max-num-seqs": ["8"]},
    )
    model = model_memory(llama, config)
    assert model == ModelMemory(
        weights=1000, bytes_per_token=2 * 4 * 2 * 64 * 1, context=1024, max_num_seqs=8
    )


def test_a_gpt2_config_is_understood(tmp_path):
    config = GPT2Config(n_layer=3, n_head=4, n_embd=128, n_positions=256)
    model = model_memory(source_for(tmp_path, config), ServerConfig())
    assert model is not None
    assert (model.bytes_per_token, model.context, model.weights) == (2 * 3 * 4 * 32 * 4, 256, 0)


# --- when we size it ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [{"kv-cache-memory-bytes": ["1G"]}, {"gpu-memory-utilization": ["0.5"]}],
)
def test_a_user_who_sized_the_cache_keeps_vllms_sizing(llama, flags):
    assert plan_kv_cache(llama, ServerConfig(engine_flags=flags), on_cpu=True) is None


def test_vllm_cpu_kvcache_space_keeps_vllms_sizing(llama, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert plan_kv_cache(llama, ServerConfig(), on_cpu=True) is None


def test_an_accelerator_keeps_vllms_sizing(llama, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert plan_kv_cache(llama, ServerConfig(), on_cpu=False) is None


def test_on_a_cpu_the_cache_is_sized_from_this_machines_memory(llama, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    plan = plan_kv_cache(llama, ServerConfig(max_length=256), on_cpu=True)
    assert plan is not None  # 128 MiB: fits on any machine that runs the suite
    assert plan.size == 128 * 256 * 4096  # 128 sequences of 256 tokens, 4 KiB a token
    assert "room for 128 of 128 sequences at the full 256 tokens" in plan.reason
