"""Checks for platform (hardware backend) registrations: :class:`PlatformConformance`."""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING

import pytest

from ..errors import PlatformUnavailable
from ..plugin_host.host import PluginHost
from ..specs import PlatformSpec
from .plugin import add_loaded, isolated_host

if TYPE_CHECKING:
    from ..platforms.base import Platform


class PlatformConformance:
    """Conformance checks for one registered platform.

    Attributes to set:
      ``platform``: the registered platform name. Required.
      ``plugin_module``: entry-point target of the plugin registering it (``None`` for core built-ins).
      ``probe_budget_s``: the most a probe may take (it runs at every start-up), default 2 s.
    """

    platform: str = ""
    plugin_module: str | None = None
    plugin_name: str | None = None
    probe_budget_s: float = 2.0

    @pytest.fixture
    def platform_host(self) -> PluginHost:
        if not self.platform:
            pytest.fail(f"{type(self).__name__}: set `platform` to the registered platform name")
        host = isolated_host()
        if self.plugin_module:
            add_loaded(host, self.plugin_module, self.plugin_name)
        return host

    @pytest.fixture
    def platform_spec(self, platform_host: PluginHost) -> PlatformSpec:
        return platform_host.platforms.get(self.platform)

    def test_spec_is_well_formed(self, platform_host: PluginHost, platform_spec: PlatformSpec) -> None:
        assert isinstance(platform_spec.priority, int)
        assert platform_spec.device_type, "device_type must name the torch device type (cpu, cuda, npu ...)"
        impl = platform_spec.load_impl()
        assert isinstance(impl, type), f"impl {platform_spec.impl!r} must name a platform class"
        unknown = [b for b in platform_spec.attention_preference if b not in platform_host.attention_backends]
        assert not unknown, f"attention_preference names unregistered backends {unknown}"

    def test_probe_is_fast_stable_and_side_effect_free(self, platform_spec: PlatformSpec) -> None:
        env_before = dict(os.environ)
        start = time.perf_counter()
        first = platform_spec.unavailable_reason()
        elapsed = time.perf_counter() - start
        second = platform_spec.unavailable_reason()
        assert first is None or (isinstance(first, str) and first.strip()), (
            f"probe must return None (usable) or a non-empty reason, got {first!r}")
        assert first == second, f"probe is not stable: {first!r} then {second!r}"
        assert elapsed <= self.probe_budget_s, f"probe took {elapsed:.2f} s (budget {self.probe_budget_s} s)"
        assert dict(os.environ) == env_before, "probe changed os.environ"

    def test_selection_honours_availability(self, platform_host: PluginHost, platform_spec: PlatformSpec) -> None:
        reason = platform_spec.unavailable_reason()
        if reason is None:
            assert platform_host.select_platform(self.platform).name == platform_spec.name
        else:  # explicit selection of an unavailable platform fails loudly with the probe's reason
            with pytest.raises(PlatformUnavailable, match=re.escape(reason[:40])):
                platform_host.select_platform(self.platform)

    def test_ops_table_is_bound_and_every_registered_op_resolves(self, platform_host: PluginHost,
                                                                 platform_spec: PlatformSpec) -> None:
        """The platform instance the engine makes carries this host's op table; every op is callable (fast
        kernels registered for this platform resolve; the rest are the eager references)."""
        if platform_spec.unavailable_reason() is not None:
            pytest.skip(f"platform {self.platform!r} is unavailable here: {platform_spec.unavailable_reason()}")
        from ..ops.names import OP_NAMES
        from ..ops.table import PlatformOps

        plat: Platform = platform_host.bind_platform_ops(platform_spec.load_impl()(), platform_spec.name)
        assert isinstance(plat.ops, PlatformOps) and plat.ops.platform == platform_spec.name
        registered = {s.name for s in platform_host.ops if s.platform == platform_spec.name}
        assert set(plat.ops.provided()) == registered
        for name in OP_NAMES:
            fn = getattr(plat.ops, name)
            assert callable(fn), f"op {name!r} of platform {self.platform!r} is not callable"
            if name not in registered:
                assert fn is PlatformOps.eager(name), f"op {name!r} has no fast kernel but is not the reference"

    def test_device_api_behaves(self, platform_spec: PlatformSpec) -> None:
        if platform_spec.unavailable_reason() is not None:
            pytest.skip(f"platform {self.platform!r} is unavailable here: {platform_spec.unavailable_reason()}")
        import torch

        plat: Platform = platform_spec.load_impl()()
        device = plat.device()
        assert isinstance(device, torch.device) and device.type == platform_spec.device_type
        x = torch.ones(256, 256, device=device)
        plat.synchronize()
        plat.reset_peak_memory()
        value = plat.memory_allocated()
        assert isinstance(value, int) and value >= 0, f"memory_allocated() returned {value!r}"
        peak = plat.max_memory_allocated()  # None = cannot measure a window (never a lifetime number)
        assert peak is None or (isinstance(peak, int) and peak >= 0), f"max_memory_allocated() returned {peak!r}"
        plat.empty_cache()
        assert isinstance(plat.default_dtype(), torch.dtype)
        assert float((x @ x).sum()) == 256.0 ** 3
