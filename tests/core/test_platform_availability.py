"""Platform availability on the CLI surfaces and in selection: ``--platform`` naming an unknown or unavailable
platform fails before anything loads or listens (one line, exit != 0, within seconds); a platform's
``attention_preference`` orders backend selection; a model needing packed attention fails before its weights load
when the platform has no such backend."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omnicore.errors import UnsupportedFeature
from omnicore.hookspecs import hookimpl
from omnicore.specs import (
    AttentionBackendSpec,
    AttentionCapabilities,
    AttentionRequirement,
    ModelCapabilities,
    ModelSpec,
    PlatformSpec,
)
from omnicore.testing.plugin import isolated_host

UNAVAILABLE_PLUGIN = """
from omnicore import hookimpl
from omnicore.specs import PlatformSpec

def probe():
    return "fakenpu driver not installed"

@hookimpl
def omnicore_register_platforms(register):
    register(PlatformSpec(name="fakenpu", impl="omnicore.platforms.cpu:CpuPlatform", device_type="cpu",
                          priority=90, probe="omnitest_fakenpu:probe"))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("site")
    info = root / "omnitest_fakenpu-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omnitest-fakenpu\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[omnicore]\nfakenpu = omnitest_fakenpu\n")
    (root / "omnitest_fakenpu.py").write_text(UNAVAILABLE_PLUGIN)
    return root


def _cli(*args: str, site: Path | None = None, timeout: float = 30) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    if site is not None:
        env["PYTHONPATH"] = str(site) + os.pathsep + env.get("PYTHONPATH", "")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "omnicore.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)
    return proc, time.monotonic() - start


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
@pytest.mark.parametrize("command", [("serve", "tiny:lingbot", "--port", "1"),
                                     ("generate", "tiny:lingbot", "x", "-o", "OUT")])
def test_npu_here_fails_at_once_with_the_unavailable_reason(command, tmp_path):
    """omni-plugin-backends-npu registers "npu"; without torch_npu it is unavailable, and saying so is the error."""
    command = tuple(str(tmp_path / "x.png") if part == "OUT" else part for part in command)
    proc, elapsed = _cli(*command, "--platform", "npu")
    assert proc.returncode != 0 and elapsed < 5.0, (proc.returncode, elapsed, proc.stderr)
    assert _error_lines(proc) == ["error: platform 'npu': unavailable: torch_npu not installed"]
    assert "listening" not in proc.stderr and proc.stdout == "" and not (tmp_path / "x.png").exists()


def test_serve_with_an_unknown_platform_names_the_known_ones():
    proc, _ = _cli("serve", "tiny:lingbot", "--platform", "quantum", "--port", "1")
    assert proc.returncode == 2
    (line,) = _error_lines(proc)
    assert line.startswith("error: unknown platform 'quantum'; known: ") and "cpu (from omnicore)" in line


@pytest.mark.parametrize("command", [("serve", "tiny:lingbot"), ("generate", "tiny:lingbot", "x", "-o", "x.png")])
def test_an_unavailable_platform_fails_with_its_reason(site, command, tmp_path):
    proc, elapsed = _cli(*command, "--platform", "fakenpu", site=site)
    assert proc.returncode == 2 and elapsed < 5.0, (proc.returncode, elapsed, proc.stderr)
    assert _error_lines(proc) == ["error: platform 'fakenpu': unavailable: fakenpu driver not installed"]
    assert "listening" not in proc.stderr and not (tmp_path / "x.png").exists()


def test_unavailable_platform_is_never_auto_selected(site):
    proc, _ = _cli("plugins", "--json", site=site)
    import json

    platforms = {p["name"]: p for p in json.loads(proc.stdout)["platforms"]}
    assert platforms["fakenpu"]["available"] is False and platforms["fakenpu"]["priority"] == 90
    assert platforms["fakenpu"]["reason"] == "fakenpu driver not installed"


class Backends:
    """Three CPU backends: ``fast`` has the highest priority; a platform may prefer others."""

    def __init__(self, preference: tuple[str, ...]) -> None:
        self.preference = preference

    @hookimpl
    def omnicore_register_platforms(self, register):
        register(PlatformSpec(name="prefplat", impl="omnicore.platforms.cpu:CpuPlatform",
                              attention_preference=self.preference))

    @hookimpl
    def omnicore_register_attention_backends(self, register):
        caps = AttentionCapabilities(platforms=("cpu", "prefplat"), packed_varlen=True)
        for name, priority in (("fast", 50), ("steady", 10), ("dense_only", 90)):
            register(AttentionBackendSpec(name=name, impl="omnicore.attention.reference:sdpa_attention",
                                          priority=priority, capabilities=caps if name != "dense_only" else
                                          AttentionCapabilities(platforms=("cpu", "prefplat"))))


def test_attention_preference_orders_selection_before_priority():
    packed = AttentionRequirement(platform="prefplat", packed_varlen=True)
    host = isolated_host()
    host.add_plugin(Backends(("steady", "sdpa")), "backends")
    assert host.select_attention(packed).name == "steady"  # preferred, although "fast" has a higher priority
    assert host.select_attention(AttentionRequirement(platform="prefplat")).name == "steady"
    assert host.select_attention(AttentionRequirement(platform="cpu", packed_varlen=True)).name == "fast"
    host = isolated_host()
    host.add_plugin(Backends(("dense_only",)), "backends")  # a preferred backend that cannot serve is skipped
    assert host.select_attention(packed).name == "fast"
    assert host.select_attention(AttentionRequirement(platform="prefplat")).name == "dense_only"


def test_prefix_kv_and_span_requirements_select_only_declaring_backends():
    host = isolated_host()
    host.add_plugin(Backends(()), "backends")
    req = AttentionRequirement(packed_varlen=True, prefix_kv_slicing=True, spans=True)
    assert host.select_attention(req).name == "sdpa"  # the reference declares both; the others do not
    assert "prefix_kv_slicing not supported" in "; ".join(req.unmet_by(host.attention_backends.get("fast").capabilities))


def test_model_needing_packed_attention_fails_before_loading_without_a_packed_backend():
    host = isolated_host()
    needs = ModelSpec(name="packy", impl="m:P", capabilities=ModelCapabilities(needs_packed_varlen=True))
    host.check_model_platform(needs, "cpu")  # sdpa is packed on cpu
    with pytest.raises(UnsupportedFeature, match="needs a packed-varlen attention backend.*'elsewhere'"):
        host.check_model_platform(needs, "elsewhere")
    host.check_model_platform(ModelSpec(name="plain", impl="m:P"), "elsewhere")
