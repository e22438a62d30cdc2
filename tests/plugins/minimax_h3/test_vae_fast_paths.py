"""The H3 video VAE's request-gated fast paths: its ViT decoder's RMSNorms and SwiGLU activations run on the
platform's ``rms_norm`` / ``swiglu`` ops only inside a ``quality="high"`` batch (the gate the engine's runner
enters, reached through ``pipeline.fast_path_gates()``), the decode is bit-identical to an uninstalled VAE with the
gate off and equal within the ops' tolerance with it on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _h3_helpers import request, run
from omnicore.engine.protocol import LoadOptions
from omnicore.platforms.cpu import CpuPlatform
from omnicore.plugin import fast_path_gate
from omnicore.vae_fast_paths import request_fast_paths

FAST_OPS = ("rms_norm", "swiglu")


def _load(path: Path) -> tuple[Any, list[str]]:
    """A pipeline on a fresh cpu platform whose op table records the fast ops called while the VAE decodes."""
    from omni_minimax_h3.pipeline import MiniMaxH3Pipeline

    platform, calls, decoding = CpuPlatform(), [], [False]
    table = platform.ops
    for name in FAST_OPS:
        real = getattr(table, name)
        table.__dict__[name] = lambda *a, _n=name, _r=real, **k: (calls.append(_n) if decoding[0] else None,
                                                                  _r(*a, **k))[1]
    pipe = MiniMaxH3Pipeline.from_pretrained(path, LoadOptions(platform=platform))
    decode = pipe.video_vae.decode

    def traced(latents: torch.Tensor, **kwargs: Any) -> torch.Tensor:  # the pipeline passes parallel=...
        decoding[0] = True
        try:
            return decode(latents, **kwargs)
        finally:
            decoding[0] = False

    pipe.video_vae.decode = traced
    return pipe, calls


@pytest.mark.slow
@torch.no_grad()
def test_quality_high_runs_the_fast_decoder_ops_and_other_qualities_do_not(tiny_dir: Path) -> None:
    pipe, calls = _load(tiny_dir)
    assert pipe.video_vae.fast_paths and pipe.fast_path_gates() == [fast_path_gate(pipe.video_vae)]
    req = request(num_inference_steps=1)
    with request_fast_paths(pipe, {"standard"}) as on:
        assert on is False
        _, [plain] = run(pipe, req)
    assert calls == []
    with request_fast_paths(pipe, {"high"}) as on:
        assert on is True
        _, [fast] = run(pipe, req)
    assert set(calls) == set(FAST_OPS), calls
    assert fast_path_gate(pipe.video_vae).enabled is False
    assert np.abs(fast.frames.astype(int) - plain.frames.astype(int)).max() <= 1
    np.testing.assert_array_equal(fast.audio, plain.audio)  # the audio VAE has no fast path


@torch.no_grad()
def test_gate_off_is_bit_identical_to_an_uninstalled_vae(tiny_dir: Path) -> None:
    from omni_minimax_h3.vae import H3VideoVAE
    from omnicore.ops.table import PlatformOps

    folder = tiny_dir / "vae" if (tiny_dir / "vae").is_dir() else tiny_dir / "video_vae"
    plain = H3VideoVAE.from_pretrained(folder, device="cpu")
    fast = H3VideoVAE.from_pretrained(folder, device="cpu", ops=PlatformOps("cpu"))
    assert plain.fast_paths == [] and len(fast.fast_paths) >= 2
    assert fast.vae.state_dict().keys() == plain.vae.state_dict().keys()
    z = torch.randn(1, fast.latent_channels, 9, 2, 3, generator=torch.Generator().manual_seed(0))
    want = plain.decode(z)
    assert torch.equal(fast.decode(z), want)
    with fast_path_gate(fast)(True):
        got = fast.decode(z)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast.decode(z), want)
