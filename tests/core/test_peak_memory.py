"""``peak_memory_bytes`` is the batch's peak, not the process lifetime's (issue 14 §4)."""

from __future__ import annotations

import numpy as np
import pytest
from omnicore.platforms.base import Platform
from omnicore.platforms.cpu import CpuPlatform

MB = 1024 * 1024


@pytest.fixture
def cpu() -> CpuPlatform:
    platform = CpuPlatform()
    platform.reset_peak_memory()
    if platform.max_memory_allocated() is None:
        pytest.skip("no /proc/self/clear_refs here: the CPU peak is reported as unavailable (checked below)")
    return platform


def _touch(nbytes: int) -> None:
    block = np.ones(nbytes // 8)  # written, so resident
    assert block[-1] == 1.0


def test_a_window_sees_an_allocation_made_inside_it(cpu):
    base = cpu.memory_allocated()
    _touch(96 * MB)
    assert cpu.max_memory_allocated() - base >= 80 * MB


def test_a_new_window_forgets_an_earlier_larger_peak(cpu):
    """The old implementation returned ru_maxrss, the process-lifetime peak: a big earlier batch made every later
    small batch report the big number."""
    _touch(160 * MB)
    big = cpu.max_memory_allocated()
    cpu.reset_peak_memory()
    _touch(8 * MB)
    small = cpu.max_memory_allocated()
    assert small < big - 100 * MB
    assert small >= cpu.memory_allocated()


def test_without_a_window_the_peak_is_unknown(monkeypatch):
    platform = CpuPlatform()
    assert platform.max_memory_allocated() is None
    real_open = open

    def no_clear_refs(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError("read-only /proc")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_clear_refs)
    platform.reset_peak_memory()
    assert platform.max_memory_allocated() is None  # unavailable, never a lifetime number
    assert Platform().max_memory_allocated() is None  # the base platform knows nothing either


def test_engine_reports_none_when_the_platform_cannot_measure(toy_host, tmp_path, monkeypatch):
    from omnicore.config import Settings
    from omnicore.engine.api import Engine

    monkeypatch.setattr(CpuPlatform, "reset_peak_memory", lambda self: None)
    monkeypatch.setattr(CpuPlatform, "max_memory_allocated", lambda self: None)
    with Engine("tiny:toy", host=toy_host, settings=Settings(cache_dir=str(tmp_path / "cache"))) as engine:
        [img] = engine.generate("a cat", seed=1, height=16, width=16)
    assert "peak_memory_bytes" in img.metrics and img.metrics["peak_memory_bytes"] is None


def test_a_single_process_engine_reports_its_load_peak(cpu, toy_host, tmp_path):
    """``Engine.load_memory``: one entry (rank 0) whose peak is the load's, not what the process held before it
    (the engine resets the high-water mark when its load begins)."""
    from omnicore.config import Settings
    from omnicore.engine.api import Engine

    _touch(192 * MB)  # an earlier, larger peak of this process, freed again
    with Engine("tiny:toy", host=toy_host, settings=Settings(cache_dir=str(tmp_path / "cache"))) as engine:
        [memory] = engine.load_memory
        assert memory is not None and memory.peak_rss_bytes is not None and memory.rss_bytes is not None
        assert memory.rss_bytes <= memory.peak_rss_bytes < memory.rss_bytes + 150 * MB  # the 192 MB are forgotten
