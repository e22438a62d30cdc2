"""Request-gated VAE fast paths: decode time with the gate on (``quality="high"``) vs off, per model's VAE.

Each model's VAE is loaded with its fast paths installed on a platform's op table (the way the pipelines do at
load); the two arms decode the same latents with the gate on (``fast``) and off (``plain``), interleaved:

- ``lingbot_tiny`` / ``minimax_h3_tiny`` / ``hunyuan_tiny``: the tiny presets' VAEs (random weights, real layout);
- ``lingbot_wan_mid``: a mid-size Wan VAE (base dim 64, 2 residual blocks per level) decoding 9 frames of 128x128.

On the CPU the op table holds the core's eager references (no CPU kernels are registered), so the fast arm runs
the same math through the op seam: the goal there is "no slower" (``ratio <= 1.05``), and ``max_abs_diff`` shows
how far the fused path is from the unfused one. With a CUDA device the ``cuda`` cases (the fused Triton kernels of
omni-plugin-backends-cuda) are added with goal ``ratio <= 0.9``; without one they print a skip record.

One torch thread by default (``--threads N`` to change): on a shared machine multi-threaded CPU decodes are too
erratic to compare two arms of equal math.

    python benchmarks/vae_fast_paths.py [--case lingbot] [--reps 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Case, main, ratio_at_most, skipped  # noqa: E402
from omnicore.plugin import fast_path_gate  # noqa: E402

BENCH = "vae_fast_paths"


def _arms(owner: Any, decode: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    gate = fast_path_gate(owner)

    @torch.no_grad()
    def fast() -> torch.Tensor:
        with gate(True):
            return decode()

    @torch.no_grad()
    def plain() -> torch.Tensor:
        with gate(False):
            return decode()

    return fast, plain


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    return {"max_abs_diff": float((a.float() - b.float()).abs().max()), "identical": bool(torch.equal(a, b))}


def _lingbot(root: Path, ops: Any, device: str) -> tuple[Any, Callable[[], torch.Tensor], dict[str, Any]]:
    from omni_lingbot.presets import build_tiny_lingbot
    from omni_lingbot.vae import LingBotVAE

    path = build_tiny_lingbot(root / "lingbot")
    vae = LingBotVAE.from_pretrained(path / "vae", device=torch.device(device), ops=ops)
    z = torch.randn(1, vae.z_dim, 3, 12, 20, generator=torch.Generator().manual_seed(0)).to(device)
    return vae, lambda: vae.decode(z), {"latents": list(z.shape), "fast_paths": len(vae.fast_paths)}


def _wan_mid(ops: Any, device: str) -> tuple[Any, Callable[[], torch.Tensor], dict[str, Any]]:
    from diffusers import AutoencoderKLWan
    from omni_lingbot.vae import LingBotVAE

    torch.manual_seed(0)
    model = AutoencoderKLWan(base_dim=64, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=2,
                             temperal_downsample=[False, True, True]).eval().requires_grad_(False).to(device)
    vae = LingBotVAE(model, ops)
    z = torch.randn(1, 16, 3, 16, 16, generator=torch.Generator().manual_seed(0)).to(device)
    return vae, lambda: vae.decode(z), {"latents": list(z.shape), "fast_paths": len(vae.fast_paths)}


def _h3(root: Path, ops: Any, device: str) -> tuple[Any, Callable[[], torch.Tensor], dict[str, Any]]:
    from omni_minimax_h3.presets import build_tiny_fl2va
    from omni_minimax_h3.vae import H3VideoVAE

    path = build_tiny_fl2va(root / "h3")
    vae = H3VideoVAE.from_pretrained(path / "vae", device=device, ops=ops)
    z = torch.randn(1, vae.latent_channels, 9, 4, 6, generator=torch.Generator().manual_seed(0)).to(device)
    return vae, lambda: vae.decode(z), {"latents": list(z.shape), "fast_paths": len(vae.fast_paths)}


def _hunyuan(root: Path, ops: Any, device: str) -> tuple[Any, Callable[[], torch.Tensor], dict[str, Any]]:
    from omni_hunyuan.pipeline import HunyuanImage3Pipeline
    from omni_hunyuan.presets import build_tiny
    from omni_hunyuan.vae import install_fast_paths
    from omnicore.engine.protocol import LoadOptions
    from omnicore.platforms.cpu import CpuPlatform

    path = build_tiny(root / "hunyuan", base_size=64)
    pipe = HunyuanImage3Pipeline.from_pretrained(path, LoadOptions(platform=CpuPlatform(), model_options={
        "kv_mode": "dense_legacy"}))
    vae = pipe.model.vae.to(device)
    names = install_fast_paths(vae, ops)  # idempotent: re-bound to this table
    z = torch.randn(1, vae.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0)).to(device)
    return vae, lambda: vae.decode(z), {"latents": list(z.shape), "fast_paths": len(names)}


BUILDERS: dict[str, Callable[..., Any]] = {
    "lingbot_tiny": lambda root, ops, dev: _lingbot(root, ops, dev),
    "lingbot_wan_mid": lambda root, ops, dev: _wan_mid(ops, dev),
    "minimax_h3_tiny": lambda root, ops, dev: _h3(root, ops, dev),
    "hunyuan_tiny": lambda root, ops, dev: _hunyuan(root, ops, dev),
}


def _tables() -> Iterator[tuple[str, Any, str, Any]]:
    """``(platform, op table, device, sync)``: the cpu's eager table, and cuda's fused one when usable."""
    from omnicore.ops.table import PlatformOps

    yield "cpu", PlatformOps("cpu"), "cpu", None
    try:
        from omni_backends_cuda.probe import probe
    except ImportError:
        reason: str | None = "omni-plugin-backends-cuda is not installed"
    else:
        reason = probe()
    if reason is not None:
        yield "cuda", None, reason, None
        return
    from omnicore.testing.plugin import add_to_host, isolated_host

    host = isolated_host()
    add_to_host(host, "omni_backends_cuda.plugin", "backends_cuda")
    yield "cuda", host.platform_ops("cuda").prepare(), "cuda", torch.cuda.synchronize


def cases() -> Iterator[Case | dict]:
    root = Path(tempfile.mkdtemp(prefix="omnicore-bench-vae-"))
    for platform, ops, device, sync in _tables():
        if ops is None:
            yield skipped(BENCH, f"cuda cases: {device}")
            continue
        for name, build in BUILDERS.items():
            owner, decode, facts = build(root, ops, device)
            fast, plain = _arms(owner, decode)
            goal = ratio_at_most(1.05) if platform == "cpu" else ratio_at_most(0.9)
            yield Case(BENCH, f"{name}_{platform}", "gate_on", "gate_off", fast, plain, goal=goal, reps=7,
                       warmup=1, sync=sync, compare=_diff, extra={"platform": platform, **facts})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--threads", type=int, default=1)
    known, rest = parser.parse_known_args()
    torch.set_num_threads(known.threads)
    raise SystemExit(main(cases, rest))
