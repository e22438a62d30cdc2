"""The ``cuda`` platform with CUDA absent: the probe's reasons, the plugin and platform kits, selection (never chosen
automatically, loud when forced), the attention preference, the op table models get, and the CLI failing at once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _cuda_helpers import CUDA_REASON, PLUGIN, needs_gpu
from omni_backends_cuda import probe as probe_mod
from omnicore.errors import PlatformUnavailable
from omnicore.specs import AttentionRequirement
from omnicore.testing import PlatformConformance, PluginConformance
from omnicore.testing.plugin import add_to_host, isolated_host

ROOT = Path(__file__).resolve().parents[3]
no_cuda = pytest.mark.skipif(CUDA_REASON is None, reason="checks the behaviour without a usable CUDA device")


class TestPlugin(PluginConformance):
    plugin_module = PLUGIN
    entry_point_name = "backends_cuda"
    require_plugin_info = True


class TestCudaPlatform(PlatformConformance):
    platform = "cuda"
    plugin_module = PLUGIN


@pytest.fixture
def host():
    h = isolated_host()
    add_to_host(h, PLUGIN, "backends_cuda")
    return h


# ---------------------------------------------------------------------------------------------- the probe
@pytest.mark.parametrize(("found", "reason"), [
    (("2.6.0+cpu", None, 0, None, None), "torch 2.6.0+cpu is a CPU-only build (no CUDA support)"),
    (("2.6.0", "12.4", 1, (9, 0), ""), "no CUDA device visible (CUDA_VISIBLE_DEVICES='')"),
    (("2.6.0", "12.4", 1, (9, 0), "-1"), "no CUDA device visible (CUDA_VISIBLE_DEVICES='-1')"),
    (("2.6.0", "12.4", 0, None, None), "no CUDA device visible (torch 2.6.0 built for CUDA 12.4; no GPU or no driver)"),
    (("2.6.0", "12.4", 2, (6, 1), "0,1"), "CUDA device 0 has compute capability 6.1, too old (needs >= 7.0)"),
    (("2.6.0", "12.4", 1, (7, 0), None), None),
    (("2.6.0", "12.4", 8, (9, 0), "3"), None),
])
def test_probe_reasons(found, reason):
    got = probe_mod.classify(*found)
    assert got == reason if reason is None else got.startswith(reason)


def test_the_torch_build_is_read_without_importing_torch():
    text = "__version__ = '2.13.0+cpu'\ndebug = False\ncuda: Optional[str] = None\nhip = None\n"
    assert probe_mod.parse_version_file(text) == ("2.13.0+cpu", None)
    assert probe_mod.parse_version_file("__version__ = '2.6.0+cu124'\ncuda: Optional[str] = '12.4'\n") == (
        "2.6.0+cu124", "12.4")
    code = ("import sys; from omni_backends_cuda.probe import probe; r = probe(); "
            "print(repr(r), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    reason, imported = out.stdout.strip().rsplit(" ", 1)
    assert reason == repr(CUDA_REASON)
    if CUDA_REASON is not None and "CPU-only" in CUDA_REASON:
        assert imported == "False"  # a CPU-only torch is never imported by the probe


# ---------------------------------------------------------------------------------------------- selection
@no_cuda
def test_cuda_is_never_chosen_automatically_and_fails_loudly_when_forced(host):
    assert host.select_platform().name == "cpu"
    with pytest.raises(PlatformUnavailable, match=re.escape(CUDA_REASON)):
        host.select_platform("cuda")
    row = next(r for r in host.platform_availability() if r["name"] == "cuda")
    assert row["available"] is False and row["reason"] == CUDA_REASON


def test_attention_preference_on_cuda(host):
    """Dense call sites get torch's fused SDPA, packed ones our Triton kernel (flash-attn first when installed),
    call sites needing spans the core reference."""
    from omni_backends_cuda.plugin import flash_attn_available

    dense = host.select_attention(AttentionRequirement(platform="cuda", dtype="bfloat16", head_dim=128))
    packed = host.select_attention(AttentionRequirement(platform="cuda", dtype="bfloat16", head_dim=128,
                                                        packed_varlen=True, packed_mask_free=True))
    spans = host.select_attention(AttentionRequirement(platform="cuda", dtype="bfloat16", head_dim=128, spans=True))
    assert dense.name == ("flash_varlen" if flash_attn_available() else "cuda_sdpa")
    assert packed.name == ("flash_varlen" if flash_attn_available() else "triton_varlen")
    assert spans.name == "sdpa"
    cpu = host.select_attention(AttentionRequirement(platform="cpu", packed_varlen=True))
    assert cpu.name == "sdpa"  # nothing of ours is offered on the CPU


def test_models_reach_the_fused_kernels_through_the_platform_ops(host, monkeypatch):
    """LingBot's and MiniMax-H3's RMSNorm modules call ``ops.rms_norm`` of the table they are given; on the cuda
    table that is our kernel (run in the interpreter here), with no import of this plugin in theirs."""
    import torch
    from omni_backends_cuda import ops
    from omni_lingbot.transformer.norm import RMSNorm as LingBotRMSNorm
    from omni_minimax_h3.transformer.attention import RMSNorm as H3RMSNorm
    from omnicore.ops import reference as ref

    calls = []
    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    table = host.platform_ops("cuda")
    x = torch.randn(3, 5, 64, device="cpu" if CUDA_REASON else "cuda")
    lingbot = LingBotRMSNorm(64).to(x.device)
    lingbot.ops = table
    torch.testing.assert_close(lingbot(x), ref.rms_norm(x, lingbot.weight, lingbot.eps))
    H3RMSNorm(64, 1e-6).to(x.device)(x, table)
    assert calls == [x.shape, x.shape]
    for plugin in ("lingbot", "minimax_h3", "hunyuan"):
        for path in (ROOT / "plugins" / plugin).rglob("*.py"):
            assert "omni_backends_cuda" not in path.read_text(), f"{path} imports the cuda backend"


# ---------------------------------------------------------------------------------------------- the CLI
def _omnicore(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("omnicore")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "omnicore.cli.main", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@no_cuda
def test_plugins_lists_cuda_as_unavailable_with_the_reason():
    table = _omnicore("plugins")
    assert table.returncode == 0, table.stderr
    line = next(ln for ln in table.stdout.splitlines() if ln.startswith("cuda "))
    assert f"no: {CUDA_REASON}" in line
    listing = _omnicore("plugins", "--json")
    assert listing.returncode == 0, listing.stderr
    row = next(p for p in json.loads(listing.stdout)["platforms"] if p["name"] == "cuda")
    assert row["available"] is False and row["reason"] == CUDA_REASON and row["provider"] == "backends_cuda"
    assert set(row["ops"]) == {"rms_norm", "gated_residual_norm_modulate", "rope_rotate_half", "group_norm_silu",
                               "rms_norm_silu", "swiglu", "upsample2x_conv", "lora_segment_delta"}


@no_cuda
@pytest.mark.parametrize("command", [("generate", "tiny:lingbot", "x", "--platform", "cuda", "-o", "x.png"),
                                     ("serve", "tiny:lingbot", "--platform", "cuda", "--port", "0")])
def test_forcing_cuda_fails_at_once_with_one_line(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = _omnicore(*command, timeout=60)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and CUDA_REASON in lines[0] and "cuda" in lines[0], proc.stderr
    assert "listening" not in (proc.stdout + proc.stderr).lower() and not (tmp_path / "x.png").exists()


@needs_gpu
def test_the_platform_serves_streams_events_and_pinned_memory():
    import torch
    from omni_backends_cuda.platform import CudaPlatform

    plat = CudaPlatform()
    host_t = plat.pin_memory(torch.ones(1024))
    assert host_t.is_pinned()
    stream, event = plat.stream(), plat.event()
    with torch.cuda.stream(stream):
        dev = host_t.to(plat.device(), non_blocking=True)
        event.record(stream)
    plat.current_stream().wait_event(event)
    plat.synchronize()
    assert float(dev.sum()) == 1024.0 and plat.memory_stats()["total"] > 0
