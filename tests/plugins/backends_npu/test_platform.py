"""The ``npu`` platform: registered with a torch-free probe, unavailable here with the reason, never selected
automatically, and ``--platform npu`` fails at once with that reason; PlatformConformance."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _npu_helpers import NPU_REASON, PLUGIN, needs_npu
from omni_backends_npu import probe as npu_probe
from omnicore.errors import PlatformUnavailable
from omnicore.testing import PlatformConformance, PluginConformance
from omnicore.testing.plugin import add_to_host, isolated_host


class TestNpuPlatform(PlatformConformance):
    platform = "npu"
    plugin_module = PLUGIN


class TestNpuPlugin(PluginConformance):
    plugin_module = PLUGIN
    entry_point_name = "backends_npu"
    require_plugin_info = True


@pytest.mark.skipif(npu_probe.torch_npu_installed(), reason="torch_npu is installed here")
def test_unavailable_here_with_the_reason_and_never_auto_selected():
    assert NPU_REASON == "torch_npu not installed"
    host = isolated_host()
    assert add_to_host(host, PLUGIN, "backends_npu").status == "loaded"
    assert host.platforms.get("npu").unavailable_reason() == NPU_REASON
    assert host.select_platform(None).name != "npu"
    with pytest.raises(PlatformUnavailable, match="unavailable: torch_npu not installed"):
        host.select_platform("npu")


@pytest.mark.parametrize(("installed", "devices", "reason"), [
    (False, 0, "torch_npu not installed"),
    (False, 8, "torch_npu not installed"),
    (True, 0, "no Ascend NPU visible"),
    (True, 1, None),
])
def test_classify_table(installed, devices, reason):
    got = npu_probe.classify(installed, devices)
    assert got == reason if reason is None else got.startswith(reason)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}


@pytest.mark.skipif(npu_probe.torch_npu_installed(), reason="torch_npu is installed here")
def test_plugins_listing_is_torch_free_and_shows_the_reason():
    code = ("from omnicore.cli.main import main\nimport contextlib, io, json, sys\nbuf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n    assert main(['plugins', '--json']) == 0\n"
            "data = json.loads(buf.getvalue())\n"
            "npu = [p for p in data['platforms'] if p['name'] == 'npu'][0]\n"
            "print(json.dumps({'npu': npu, 'torch': 'torch' in sys.modules, "
            "'torch_npu': 'torch_npu' in sys.modules, 'probe': 'omni_backends_npu.probe' in sys.modules}))")
    proc = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["probe"] and not out["torch"] and not out["torch_npu"]
    assert out["npu"]["available"] is False and out["npu"]["reason"] == "torch_npu not installed"


@needs_npu
def test_device_services_on_an_npu():  # pragma: no cover - runs on Ascend machines only
    import torch
    from omni_backends_npu.platform import NpuPlatform, _npu

    plat = NpuPlatform()
    x = torch.ones(128, 128, device=plat.device())
    plat.reset_peak_memory()
    y = x @ x
    plat.synchronize()
    assert plat.max_memory_allocated() >= y.numel() * 4
    stream, event = plat.stream(), plat.event(timing=True)
    with _npu().stream(stream):
        event.record()
    event.synchronize()
    assert plat.memory_stats()["total"] > 0
