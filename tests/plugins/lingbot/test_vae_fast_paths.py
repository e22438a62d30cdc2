"""The Wan VAE's request-gated fast paths on LingBot: installed at load on the platform's ops, run only for
``quality="high"`` requests through the engine, gate off bit-identical to an uninstalled VAE, gate on equal to it
within the fused kernels' tolerance (the CPU's eager references here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omnicore.engine.api import Engine
from omnicore.plugin import fast_path_gate

FAST_OPS = ("rms_norm_silu", "upsample2x_conv")


def _spy(engine: Engine, decoding: list[bool]) -> list[str]:
    """Record every fast op called while the VAE decodes (the DiT may use other ops of the same table)."""
    table, calls = engine.platform.ops, []
    for name in FAST_OPS:
        real = getattr(table, name)
        table.__dict__[name] = lambda *a, _n=name, _r=real, **k: (calls.append(_n) if decoding[0] else None,
                                                                  _r(*a, **k))[1]
    vae = engine.pipeline.vae
    decode = vae.decode

    def traced(latents: torch.Tensor) -> torch.Tensor:
        decoding[0] = True
        try:
            return decode(latents)
        finally:
            decoding[0] = False

    vae.decode = traced
    return calls


def test_quality_high_runs_the_fused_decoder_ops_and_other_qualities_do_not(tiny_dir: Path) -> None:
    with Engine(str(tiny_dir)) as engine:
        assert engine.pipeline.vae.fast_paths, "no fast path was installed at load"
        calls = _spy(engine, [False])
        args = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 1, "seed": 3}
        [plain] = engine.generate("a red fox", **args)
        [draft] = engine.generate("a red fox", quality="draft", **args)
        assert calls == []
        [fast] = engine.generate("a red fox", quality="high", **args)
        assert set(calls) == set(FAST_OPS), calls
        n = len(calls)
        engine.generate("a red fox", **args)
        assert len(calls) == n  # the gate is off again after the high-quality batch
        assert fast_path_gate(engine.pipeline.vae).enabled is False
    assert np.array_equal(plain.frames, draft.frames)
    assert np.abs(fast.frames.astype(int) - plain.frames.astype(int)).max() <= 1


@torch.no_grad()
def test_gate_off_is_bit_identical_to_an_uninstalled_vae_and_gate_on_within_tolerance(tiny_dir: Path) -> None:
    from omni_lingbot.vae import LingBotVAE
    from omnicore.ops.table import PlatformOps

    cpu = torch.device("cpu")
    plain = LingBotVAE.from_pretrained(tiny_dir / "vae", device=cpu)
    fast = LingBotVAE.from_pretrained(tiny_dir / "vae", device=cpu, ops=PlatformOps("cpu"))
    assert plain.fast_paths == [] and fast_path_gate(plain, create=False) is None
    names = set(fast.fast_paths)
    assert any(n.endswith("upsamplers.0.resample") for n in names) and "decoder.norm_out" in names
    assert fast.vae.state_dict().keys() == plain.vae.state_dict().keys()
    z = torch.randn(1, fast.z_dim, 2, 6, 5, generator=torch.Generator().manual_seed(0))
    want = plain.decode(z)
    assert torch.equal(fast.decode(z), want)
    with fast_path_gate(fast)(True):
        got = fast.decode(z)
    torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-4)
    assert torch.equal(fast.decode(z), want)


@pytest.mark.parametrize("kernel", ["rms_norm_silu", "upsample2x_conv"])
@torch.no_grad()
def test_each_fast_path_really_replaces_its_modules(tiny_dir: Path, kernel: str) -> None:
    """A deliberately wrong op shows up in the decode only under the gate (the installed paths are live)."""
    from omni_lingbot.vae import LingBotVAE
    from omnicore.ops.table import PlatformOps

    class Broken:
        def __getattr__(self, name: str) -> Any:
            real = PlatformOps.eager(name)
            return (lambda *a, **k: real(*a, **k) + 1.0) if name == kernel else real

    vae = LingBotVAE.from_pretrained(tiny_dir / "vae", device=torch.device("cpu"), ops=Broken())
    z = torch.randn(1, vae.z_dim, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    off = vae.decode(z)
    with fast_path_gate(vae)(True):
        on = vae.decode(z)
    assert not torch.allclose(on, off, atol=1e-3)
