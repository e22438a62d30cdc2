"""The adapter cache: hot adapters are not read again, a device budget evicts the least recently used copy (kept in
host memory and copied back without touching the file) and counts the running batch's stacked slots, a host budget
drops the least recently used converted copy (read from its file again), bytes are accounted, a changed file is
read again."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from _lora_helpers import MODULES, SPEC, Holder, Toy, make_peft_adapter
from omnicore.engine.request import GenerationRequest
from omnicore.errors import ConfigError
from omnicore.lora import AdapterRegistry, LoRA, LoRAError, TargetMap
from omnicore.lora.runtime import LoRARuntime
from omnicore.ops.table import PlatformOps


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("loras")
    for i, name in enumerate("abc"):
        make_peft_adapter(Toy(), MODULES, base / name, rank=4, seed=i)
    return base


def _bytes(tmap: TargetMap) -> int:  # one rank-4 adapter on the toy's five linears, fp32 on the device
    return sum(4 * (fan_in + fan_out) * 4 for fan_in, fan_out in (tmap.shapes[m] for m in MODULES))


def test_lru_evicts_the_oldest_and_reloads_from_host_memory(root: Path) -> None:
    tmap = TargetMap.build(Toy(), SPEC.lora, "toy")
    one = _bytes(tmap)
    reg = AdapterRegistry(lora_dirs=[root], max_device_bytes=2 * one)
    for name in "ab":
        reg.device_adapter(LoRA(name), tmap, "cpu", torch.float32)
    assert reg.on_device() == ["a", "b"]
    assert reg.stats() | {} == {**reg.stats(), "loads": 2, "uploads": 2, "evictions": 0, "device_bytes": 2 * one}
    reg.device_adapter(LoRA("a"), tmap, "cpu", torch.float32)  # a is now the most recent
    reg.device_adapter(LoRA("c"), tmap, "cpu", torch.float32)  # over budget: b (least recent) goes
    assert reg.on_device() == ["a", "c"]
    s = reg.stats()
    assert (s["evictions"], s["loads"], s["uploads"], s["device_bytes"]) == (1, 3, 3, 2 * one)
    assert s["host_adapters"] == 3 and s["host_bytes"] == 3 * one  # the evicted one stays in host memory
    reg.device_adapter(LoRA("b"), tmap, "cpu", torch.float32, keep=[])  # back: copied again, the file not read
    s = reg.stats()
    assert (s["loads"], s["uploads"], s["evictions"]) == (3, 4, 2)
    assert reg.on_device() == ["c", "b"]


def test_a_hot_adapter_is_not_read_again_and_a_changed_file_is(root: Path) -> None:
    tmap = TargetMap.build(Toy(), SPEC.lora, "toy")
    reg = AdapterRegistry(lora_dirs=[root])
    for _ in range(3):
        reg.check(LoRA("a"), tmap)
    assert (reg.stats()["loads"], reg.stats()["hits"]) == (1, 2)
    weights = root / "a" / "adapter_model.safetensors"
    stamp = time.time() + 5
    os.utime(weights, (stamp, stamp))  # rewritten (a new version of the adapter)
    reg.check(LoRA("a"), tmap)
    assert reg.stats()["loads"] == 2


def test_the_running_batch_keeps_its_adapters_over_budget(root: Path) -> None:
    """A batch needing more than the budget evicts only what it does not use; the next batch evicts again."""
    model = Toy()
    tmap = TargetMap.build(model, SPEC.lora, "toy")
    reg = AdapterRegistry(lora_dirs=[root], max_device_bytes=_bytes(tmap))
    runtime = LoRARuntime(reg, SPEC, Holder(model), PlatformOps("cpu"))
    runtime.activate([GenerationRequest("x", loras=["a"]), GenerationRequest("x", loras=["b"])])
    assert sorted(reg.on_device()) == ["a", "b"]
    runtime.activate([GenerationRequest("x", loras=["c"])])
    assert reg.on_device() == ["c"] and reg.stats()["evictions"] == 2


def test_an_adapter_larger_than_the_budget_is_refused(root: Path) -> None:
    tmap = TargetMap.build(Toy(), SPEC.lora, "toy")
    reg = AdapterRegistry(lora_dirs=[root], max_device_bytes=_bytes(tmap) - 1)
    with pytest.raises(LoRAError, match="more than the LoRA cache budget"):
        reg.check(LoRA("a"), tmap)


def test_preloaded_names_and_settings(root: Path, tmp_path: Path) -> None:
    tmap = TargetMap.build(Toy(), SPEC.lora, "toy")
    reg = AdapterRegistry(modules={"style": str(root / "a")})
    assert reg.list_modules() == ["style"]
    reg.preload(tmap)
    assert reg.stats()["loads"] == 1
    with pytest.raises(LoRAError, match="not a preloaded adapter"):
        reg.check(LoRA("other"), tmap)
    with pytest.raises(ConfigError, match="lora_modules"):
        AdapterRegistry(modules={"x": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="max_lora_bytes"):
        AdapterRegistry(max_device_bytes=0)
    with pytest.raises(ConfigError, match="lora_dir"):
        AdapterRegistry(lora_dirs=[tmp_path / "missing"])


def test_a_host_budget_drops_the_least_recently_used_and_reads_it_again(root: Path) -> None:
    """Distinct files named under --lora-dir cannot grow host memory without bound: past max_host_bytes the least
    recently used converted copy goes (counted), and naming it again reads its file again."""
    tmap = TargetMap.build(Toy(), SPEC.lora, "toy")
    one = _bytes(tmap)  # fp32 host copies are the same size as fp32 device copies
    reg = AdapterRegistry(lora_dirs=[root], max_host_bytes=2 * one)
    for name in "abc":
        reg.check(LoRA(name), tmap)
    s = reg.stats()
    assert (s["host_adapters"], s["host_bytes"], s["host_evictions"], s["loads"]) == (2, 2 * one, 1, 3)
    reg.check(LoRA("b"), tmap)  # still there: a hit, and now the most recent
    assert (reg.stats()["loads"], reg.stats()["hits"]) == (3, 1)
    reg.check(LoRA("a"), tmap)  # dropped before: read from its file again, c (least recent) goes
    s = reg.stats()
    assert (s["loads"], s["host_evictions"], s["host_bytes"]) == (4, 2, 2 * one)
    with pytest.raises(LoRAError, match="more than the LoRA host cache budget"):
        AdapterRegistry(lora_dirs=[root], max_host_bytes=one - 1).check(LoRA("a"), tmap)
    with pytest.raises(ConfigError, match="max_lora_host_bytes"):
        AdapterRegistry(max_host_bytes=-1)


def test_the_batch_slots_count_in_the_device_budget(root: Path) -> None:
    """The running batch's stacked slots are device memory too: counted (batch_bytes) and within
    max_device_bytes, so a batch's first forward evicts copies it does not use; they are released after it."""
    model = Toy()
    tmap = TargetMap.build(model, SPEC.lora, "toy")
    one = _bytes(tmap)
    reg = AdapterRegistry(lora_dirs=[root], max_device_bytes=3 * one)
    runtime = LoRARuntime(reg, SPEC, Holder(model), PlatformOps("cpu"))
    runtime.activate([GenerationRequest("x", loras=["c"])])
    runtime.activate([GenerationRequest("x", loras=["a"]), GenerationRequest("x", loras=["b"])])
    assert sorted(reg.on_device()) == ["a", "b", "c"] and reg.stats()["batch_bytes"] == 0  # slots built lazily
    with torch.inference_mode():
        model(torch.randn(2, 3, 16))
    s = reg.stats()
    # every linear stacks a and b (rank 4 each, two segments): as many bytes as the two adapters' copies
    assert s["batch_bytes"] == 2 * one
    # copies + slots = 4 adapters' bytes > 3: c (not in the batch) made room; the batch keeps its own over budget
    assert sorted(reg.on_device()) == ["a", "b"] and s["evictions"] == 1
    runtime.deactivate()
    assert reg.stats()["batch_bytes"] == 0
