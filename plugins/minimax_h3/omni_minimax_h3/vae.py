"""MiniMax-H3's video and audio VAEs: diffusers' ``AutoencoderKLMiniMaxH3`` / ``AutoencoderKLMiniMaxH3Audio`` with
the release's conventions around them.

Video: pixels are ImageNet-normalised for the encoder; a condition's posterior is *sampled* under a fresh generator
seeded 42 (independent of the request), rounded through float16 and normalised ``(z - mean) / std``; decoding undoes
the normalisation and maps the decoder's ImageNet-normalised output back to [0, 1]. Tiling is on (the release's
frames are the blended-tile ones). Audio: 32 kHz stereo, the two channels as two batch items of the mono VAE;
a soundtrack takes the posterior mean; latents are normalised per channel.

Fast paths (``quality="high"`` requests only): the video decoder is a ViT (no GroupNorm/RMSNorm+SiLU pairs, no
upsampling convs), so :func:`install_fast_paths` puts what it does have on the platform's fused ops: every
RMSNorm (block pre-norms and the attention's q/k norms) on ``rms_norm`` and every SwiGLU feed-forward activation on
``swiglu``, behind the wrapper's request gate. With the gate off the decoder runs its own modules (bit-identical).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omnicore.plugin import decode_tiles, fast_path_gate, install_fast_path

PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
CONDITION_ENCODE_SEED = 42


def _load(cls: Any, folder: Path) -> Any:
    """Build from ``config.json`` and load the safetensors strictly (diffusers' ``from_pretrained`` for these
    classes needs ``accelerate``: they pin fp32 modules, which rules out ``low_cpu_mem_usage=False``)."""
    from omnicore.plugin import load_strict, read_state_dict

    from .loader import PLUGIN

    folder, part = Path(folder), Path(folder).name
    model = cls.from_config(cls.load_config(str(folder)))
    load_strict(model, read_state_dict(folder, plugin=PLUGIN, component=part), plugin=PLUGIN, path=folder,
                component=part)
    return model.float()


_AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _rms_norm(ops: Any, norm: torch.nn.RMSNorm) -> Any:
    eps = float(norm.eps)  # type: ignore[arg-type]  # callers skip norms without an explicit eps

    def forward(x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, norm.weight, eps)

    return forward


def _swiglu(ops: Any, act: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        up, gate = act.proj(x).chunk(2, dim=-1)  # diffusers' SwiGLU: ``up * silu(gate)``
        return ops.swiglu(gate, up)

    return forward


def install_fast_paths(owner: Any, vae: Any, ops: Any) -> list[str]:
    """Install the video decoder's fast paths behind ``owner``'s gate; returns the names of the modules that got
    one (idempotent). Only ``nn.RMSNorm`` with an explicit ``eps`` over the last dim and diffusers' ``SwiGLU``
    (``proj`` then ``up * SiLU(gate)``) are replaced; the encoder is untouched."""
    from diffusers.models.activations import SwiGLU

    gate = fast_path_gate(owner)
    installed: list[str] = []
    for name, module in vae.decoder.named_modules():
        if isinstance(module, torch.nn.RMSNorm) and module.eps is not None and len(module.normalized_shape) == 1:
            install_fast_path(module, _rms_norm(ops, module), gate)
        elif isinstance(module, SwiGLU) and isinstance(module.activation, torch.nn.SiLU):
            install_fast_path(module, _swiglu(ops, module), gate)
        else:
            continue
        installed.append(f"decoder.{name}")
    return installed


@contextmanager
def tiles_over_ranks(vae: Any, ctx: Any) -> Iterator[None]:
    """Inside the block, every spatially tiled clip ``vae`` decodes has its tiles shared out over the ranks of
    ``ctx``'s worker group (:func:`omnicore.plugin.decode_tiles`, round-robin) and stitched on rank 0 by the VAE's
    own ``_stitch_tiles``: the tile layout (``_split_tiles``), each tile's decode and the blend are those of
    diffusers' ``_decode_clip``, so rank 0's frames are the single-process tiled decode's. The other ranks stitch
    shape-only zeros (their frames are discarded). Untiled VAEs decode each clip on every rank as before."""
    native = vae._decode_clip

    def decode_clip(z: torch.Tensor) -> torch.Tensor:
        if not vae.use_tiling:
            return native(z)
        ratio = int(vae.spatial_compression_ratio)
        ys, y_lengths, y_overlaps = vae._split_tiles(z.shape[-2] * ratio, vae.tile_sample_min_height,
                                                      vae.tile_sample_min_overlap_height)
        xs, x_lengths, x_overlaps = vae._split_tiles(z.shape[-1] * ratio, vae.tile_sample_min_width,
                                                      vae.tile_sample_min_overlap_width)
        cells = [(i // ratio, h // ratio, j // ratio, w // ratio)
                 for i, h in zip(ys, y_lengths) for j, w in zip(xs, x_lengths)]

        def one(cell: tuple[int, int, int, int]) -> torch.Tensor:
            i, h, j, w = cell
            return vae.decoder(vae.post_quant_conv(z[..., i:i + h, j:j + w]))

        tiles = decode_tiles(cells, one, ctx, device=z.device, placeholders=True)
        assert tiles is not None  # placeholders=True: every rank gets a list
        rows = [tiles[r * len(xs):(r + 1) * len(xs)] for r in range(len(ys))]
        return vae._stitch_tiles(rows, y_overlaps, x_overlaps)

    vae._decode_clip = decode_clip
    try:
        yield
    finally:
        del vae._decode_clip  # the class's method again


class H3VideoVAE:
    """``precision`` (``LoadOptions.vae_decode_precision``): None/"fp32" decodes in float32 (bit-stable, the
    parity setting); "fp16"/"bf16" decode under autocast, as the release does on GPUs (fp16)."""

    def __init__(self, vae: Any, precision: str | None = None, ops: Any = None) -> None:
        self.vae = vae
        self.autocast = _AUTOCAST.get(precision or "fp32")
        cfg = vae.config
        c = int(cfg.latent_channels)
        self.latent_channels = c
        self.mean = torch.tensor(list(cfg.latents_mean), dtype=torch.float32).view(1, c, 1, 1, 1)
        self.std = torch.tensor(list(cfg.latents_std), dtype=torch.float32).view(1, c, 1, 1, 1)
        self.spatial_ratio = int(vae.spatial_compression_ratio)
        #: decoder modules with a fast path behind this wrapper's request gate (none without ``ops``)
        self.fast_paths: list[str] = install_fast_paths(self, vae, ops) if ops is not None else []

    @classmethod
    def from_pretrained(cls, folder: Path, *, device: Any, precision: str | None = None,
                        ops: Any = None) -> H3VideoVAE:
        """``ops``: the platform's op table (``options.platform.ops``), for the request-gated fast paths."""
        from diffusers import AutoencoderKLMiniMaxH3

        return cls(_load(AutoencoderKLMiniMaxH3, folder).to(device).eval().requires_grad_(False), precision, ops)

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @torch.no_grad()
    def encode_condition(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 ``[F, H, W, 3]`` (F = 1 for a keyframe or an image reference) -> normalised latents
        ``[1, C, t, H/16, W/16]`` float32 on the CPU."""
        dev = self.device
        pixels = torch.from_numpy(np.ascontiguousarray(frames)).to(dev).permute(3, 0, 1, 2)[None]
        mean = torch.tensor(PIXEL_MEAN, device=dev).view(1, 3, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=dev).view(1, 3, 1, 1, 1)
        pixels = (pixels.to(torch.float32) / 255.0 - mean) / std
        posterior = self.vae.encode(pixels, return_dict=False)[0]
        z = posterior.sample(generator=torch.Generator().manual_seed(CONDITION_ENCODE_SEED))
        z = z.to(torch.float16).float().cpu()
        return (z - self.mean) / self.std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, parallel: Any = None) -> torch.Tensor:
        """Normalised ``[1, C, t, h, w]`` -> frames ``[F, H, W, 3]`` float32 in [0, 1].

        ``parallel`` (this rank's ``ParallelContext``; every rank of the group calls this with the same latents):
        the tiles of each clip are decoded across the ranks (:func:`tiles_over_ranks`); rank 0 gets the frames of
        the single-process tiled decode, the other ranks frames to discard."""
        dev = self.device
        z = latents.to(dev, torch.float32) * self.std.to(dev) + self.mean.to(dev)
        with tiles_over_ranks(self.vae, parallel) if parallel is not None else nullcontext():
            if self.autocast is None:
                video = self.vae.decode(z, return_dict=False)[0].float()
            else:
                with torch.autocast(dev.type, dtype=self.autocast):
                    video = self.vae.decode(z, return_dict=False)[0].float()
        mean = torch.tensor(PIXEL_MEAN, device=dev).view(1, 3, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=dev).view(1, 3, 1, 1, 1)
        video = (video * std + mean).clamp(0, 1)
        return video[0].permute(1, 2, 3, 0).contiguous()


class H3AudioVAE:
    def __init__(self, vae: Any) -> None:
        self.vae = vae
        cfg = vae.config
        c = int(cfg.latent_channels)
        self.latent_channels = c
        mean = cfg.latents_mean if cfg.latents_mean is not None else [0.0] * c
        std = cfg.latents_std if cfg.latents_std is not None else [1.0] * c
        self.mean = torch.tensor(list(mean), dtype=torch.float32)
        self.std = torch.tensor(list(std), dtype=torch.float32)
        self.sample_rate = int(cfg.sampling_rate)
        self.hop = int(vae.hop_length)

    @classmethod
    def from_pretrained(cls, folder: Path, *, device: Any) -> H3AudioVAE:
        from diffusers import AutoencoderKLMiniMaxH3Audio

        return cls(_load(AutoencoderKLMiniMaxH3Audio, folder).to(device).eval().requires_grad_(False))

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @torch.no_grad()
    def encode_rows(self, waveform: torch.Tensor) -> torch.Tensor:
        """Stereo ``[2, N]`` at the VAE's rate -> normalised channel-major rows ``[2·T, C]`` (posterior mean)."""
        posterior = self.vae.encode(waveform.to(self.device, torch.float32)[:, None], return_dict=False)[0]
        z = posterior.mode().float().cpu().transpose(1, 2)  # [2, T, C]
        return ((z - self.mean.view(1, 1, -1)) / self.std.view(1, 1, -1)).reshape(-1, self.latent_channels)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised ``[2, C, T]`` -> waveform ``[2, T·hop]`` float32."""
        dev = self.device
        z = latents.to(dev, torch.float32) * self.std.to(dev).view(1, -1, 1) + self.mean.to(dev).view(1, -1, 1)
        return self.vae.decode(z, return_dict=False)[0].float()[:, 0]
