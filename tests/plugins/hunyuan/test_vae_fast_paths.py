"""HunyuanImage-3's VAE fast paths: the decoder's GroupNorm+SiLU pairs run on the platform's ``group_norm_silu``
op only inside a ``quality="high"`` batch (the gate the engine's runner enters, reached through
``pipeline.fast_path_gates()``); gate off is bit-identical to an uninstalled VAE, gate on equal within the op's
tolerance."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _hunyuan_helpers import request, run
from omnicore.engine.protocol import LoadOptions
from omnicore.platforms.cpu import CpuPlatform
from omnicore.plugin import fast_path_gate
from omnicore.vae_fast_paths import request_fast_paths, uninstall_fast_path


def _load(path: Path) -> tuple[Any, list[str]]:
    """A pipeline on a fresh cpu platform whose ``group_norm_silu`` records its calls."""
    from omni_hunyuan.pipeline import HunyuanImage3Pipeline

    platform, calls = CpuPlatform(), []
    real = platform.ops.group_norm_silu
    platform.ops.__dict__["group_norm_silu"] = lambda *a, **k: (calls.append("group_norm_silu"), real(*a, **k))[1]
    opts = {"kv_mode": "dense_legacy", "kv_block_size": 16, "kv_pool_blocks": 512, "kv_reuse": True}
    return HunyuanImage3Pipeline.from_pretrained(path, LoadOptions(platform=platform, model_options=opts)), calls


@torch.no_grad()
def test_quality_high_runs_the_fused_group_norm_silu_and_other_qualities_do_not(micro_dir: Path) -> None:
    from omni_hunyuan.vae import ResnetBlock

    pipe, calls = _load(micro_dir)
    assert pipe.fast_path_gates() == [fast_path_gate(pipe.model.vae)]
    req = request(num_inference_steps=1)
    with request_fast_paths(pipe, {"standard"}):
        _, [plain] = run(pipe, req)
    assert calls == []
    with request_fast_paths(pipe, {"high"}):
        _, [fast] = run(pipe, req)
    blocks = sum(isinstance(m, ResnetBlock) for m in pipe.model.vae.decoder.modules())
    assert len(calls) == 2 * blocks + 1  # two per decoder ResNet block and the output head, one decode
    assert fast_path_gate(pipe.model.vae).enabled is False
    assert np.abs(fast.frames.astype(int) - plain.frames.astype(int)).max() <= 1


@torch.no_grad()
def test_gate_off_is_bit_identical_to_an_uninstalled_vae(pipe: Any) -> None:
    vae = pipe.model.vae
    plain = copy.deepcopy(vae)
    for module in plain.modules():
        uninstall_fast_path(module)
    z = torch.randn(1, vae.latent_channels, 2, 2, generator=torch.Generator().manual_seed(0))
    want = plain.decode(z)
    assert torch.equal(vae.decode(z), want)
    with fast_path_gate(vae)(True):
        got = vae.decode(z)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(vae.decode(z), want)
    assert vae.state_dict().keys() == plain.state_dict().keys()
