"""AdaLN weight offload releases the device allocator's cache through the platform (seed behaviour: after the
projections' weights left the device, the freed blocks must not stay reserved): the ``adaln_schedule`` cache method
calls the serving platform's ``empty_cache`` once per offloading prepare, never when nothing was offloaded, and
prefers the pipeline's own platform. (On CUDA that is ``torch.cuda.empty_cache``: unverified here, no GPU.)"""

from __future__ import annotations

from typing import Any

import torch
from omnicore.cache.adaln_schedule import AdaLNScheduleConfig
from omnicore.platforms.cpu import CpuPlatform
from omnicore.plugin_host.host import PluginHost
from test_cache_adaln_schedule import SCHED_A, Pipe, _loop

SCHED_B = [[0.9, 0.7], [0.6]]


def _enable(host: PluginHost, pipe: Any, offload: bool) -> Any:
    return host.enable_cache(pipe, host.cache_methods.get("adaln_schedule"),
                             AdaLNScheduleConfig(offload_weights=offload))


def _recording_cpu(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(CpuPlatform, "empty_cache", lambda self: calls.append(type(self).__name__))
    return calls


def test_offload_releases_the_platform_cache_once_per_build(monkeypatch) -> None:
    calls = _recording_cpu(monkeypatch)
    host = PluginHost(autoload=False)
    pipe = Pipe(host)
    handle = _enable(host, pipe, offload=True)
    _loop(host, pipe, pipe.state(SCHED_A))
    assert all(p.offloaded for p in pipe.model.adaln.projections)
    assert calls == ["CpuPlatform"]  # the host's cpu platform: the projections live on the cpu
    _loop(host, pipe, pipe.state(SCHED_A))  # same schedule: the held tables, no new offload, no release
    assert calls == ["CpuPlatform"]
    _loop(host, pipe, pipe.state(SCHED_B))  # a new schedule: tables rebuilt, weights offloaded again
    assert calls == ["CpuPlatform"] * 2
    handle.remove()
    assert pipe.model.adaln.release_cached_memory is None


def test_no_offload_no_release(monkeypatch) -> None:
    calls = _recording_cpu(monkeypatch)
    host = PluginHost(autoload=False)
    pipe = Pipe(host)
    handle = _enable(host, pipe, offload=False)
    _loop(host, pipe, pipe.state(SCHED_A))
    assert pipe.model.adaln.cache is not None and not any(p.offloaded for p in pipe.model.adaln.projections)
    assert calls == []
    handle.remove()


def test_the_pipelines_own_platform_is_preferred(monkeypatch) -> None:
    class Mine(CpuPlatform):
        released = 0

        def empty_cache(self) -> None:
            type(self).released += 1

    host_calls = _recording_cpu(monkeypatch)
    host = PluginHost(autoload=False)
    pipe = Pipe(host)
    pipe.platform = Mine()
    handle = _enable(host, pipe, offload=True)
    with torch.no_grad():
        _loop(host, pipe, pipe.state(SCHED_A))
    assert Mine.released == 1 and host_calls == []
    handle.remove()
