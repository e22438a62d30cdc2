"""The Wan 2.1 VAE (diffusers ``AutoencoderKLWan``) with LingBot's latent normalisation.

Latents the DiT sees are ``(z - mean) / std`` per channel; decoding undoes that. Pixels are [-1, 1] for the
VAE and [0, 1] everywhere else in the plugin.

Tiling is a per-call setting: :meth:`LingBotVAE.tiling` switches diffusers' tiled encode/decode on
for one request and restores the previous state afterwards, so one request's choice never leaks into the next.

Fast paths (``quality="high"`` requests only): :func:`install_fast_paths` puts the decoder's channel-RMSNorm+SiLU
pairs on the platform's fused ``rms_norm_silu`` op and its 2x nearest upsample + conv resamples on the fused
``upsample2x_conv`` op, behind the wrapper's request gate (``omnicore.plugin.fast_path_gate``). With the gate off
(every other quality) the decoder runs its own modules: the decode is bit-identical to an uninstalled VAE.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omnicore.plugin import cancel_points, decode_tiles, fast_path_gate, install_fast_path


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _rms_norm_silu(ops: Any, norm: Any) -> Any:
    """The fused forward of ``silu(WanRMS_norm(x))`` (channel-first norm: channels on dim 1, F.normalize's eps)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm_silu(x, norm.gamma, norm.bias, 1e-12, 1)

    return forward


def _upsample_conv(ops: Any, conv: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return ops.upsample2x_conv(x, conv.weight, conv.bias, int(conv.padding[0]))

    return forward


def _plain_3x3(conv: Any) -> bool:
    return (tuple(conv.kernel_size) == (3, 3) and tuple(conv.stride) == (1, 1) and tuple(conv.padding) == (1, 1)
            and tuple(conv.dilation) == (1, 1) and conv.groups == 1 and conv.padding_mode == "zeros")


def install_fast_paths(owner: Any, vae: Any, ops: Any) -> list[str]:
    """Install the decoder fast paths of diffusers' ``AutoencoderKLWan`` ``vae`` behind ``owner``'s gate; returns
    the names of the modules that got one (idempotent: installing again replaces them).

    Per residual block and the decoder head: ``norm -> nonlinearity`` becomes ``ops.rms_norm_silu`` on the norm and
    the identity on the SiLU after it (each block's SiLU follows only its norms). Per ``upsample2d``/``upsample3d``
    resample: ``Sequential(nearest 2x, Conv2d 3x3)`` becomes ``ops.upsample2x_conv``. The encoder is untouched."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanDecoder3d,
        WanResample,
        WanResidualBlock,
        WanUpsample,
    )

    gate = fast_path_gate(owner)
    decoder = vae.decoder
    installed: list[str] = []
    for name, module in decoder.named_modules():
        prefix = f"decoder.{name}." if name else "decoder."
        if isinstance(module, (WanResidualBlock, WanDecoder3d)) and isinstance(module.nonlinearity, torch.nn.SiLU):
            norms = ("norm1", "norm2") if isinstance(module, WanResidualBlock) else ("norm_out",)
            for attr in norms:
                norm = getattr(module, attr)
                if not getattr(norm, "channel_first", False):
                    break
            else:
                for attr in norms:
                    install_fast_path(getattr(module, attr), _rms_norm_silu(ops, getattr(module, attr)), gate)
                    installed.append(prefix + attr)
                install_fast_path(module.nonlinearity, _identity, gate)
                installed.append(prefix + "nonlinearity")
        elif isinstance(module, WanResample) and module.mode in ("upsample2d", "upsample3d"):
            seq = module.resample
            up, conv = seq[0], seq[1]
            scale = up.scale_factor if isinstance(up, WanUpsample) else None
            if (isinstance(scale, tuple) and tuple(scale) == (2.0, 2.0)
                    and up.mode in ("nearest", "nearest-exact") and isinstance(conv, torch.nn.Conv2d)
                    and _plain_3x3(conv)):
                install_fast_path(seq, _upsample_conv(ops, conv), gate)
                installed.append(prefix + "resample")
    return installed


def tiled_decode_over_ranks(vae: Any, z: torch.Tensor, ctx: Any) -> torch.Tensor | None:
    """diffusers' ``AutoencoderKLWan.tiled_decode`` with its tiles shared out over the ranks of ``ctx``'s worker
    group (:func:`omnicore.plugin.decode_tiles`, round-robin), then blended on rank 0 exactly as there: the same
    tile grid (latent stride steps), each tile decoded frame by frame through the causal feature cache (cleared per
    tile), the VAE's own ``blend_v`` / ``blend_h`` and crops. Rank 0 returns the decoded ``[B, 3, T, H, W]`` in
    [-1, 1]; the other ranks return ``None`` after decoding their tiles. Every rank calls it with the same ``z``."""
    if vae.use_slicing and z.shape[0] > 1:  # as AutoencoderKLWan.decode: one sample at a time
        parts = [tiled_decode_over_ranks(vae, row, ctx) for row in z.split(1)]
        return None if parts[0] is None else torch.cat([p for p in parts if p is not None])
    _, _, num_frames, height, width = z.shape
    ratio = int(vae.spatial_compression_ratio)
    tile_h, tile_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
    stride_h, stride_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio
    sample_h, sample_w = height * ratio, width * ratio
    out_stride_h, out_stride_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    patch = vae.config.patch_size
    if patch is not None:
        sample_h, sample_w = sample_h // patch, sample_w // patch
        out_stride_h, out_stride_w = out_stride_h // patch, out_stride_w // patch
        blend_h = vae.tile_sample_min_height // patch - out_stride_h
        blend_w = vae.tile_sample_min_width // patch - out_stride_w
    else:
        blend_h = vae.tile_sample_min_height - out_stride_h
        blend_w = vae.tile_sample_min_width - out_stride_w
    ys, xs = list(range(0, height, stride_h)), list(range(0, width, stride_w))

    def one(cell: tuple[int, int]) -> torch.Tensor:
        i, j = cell
        vae.clear_cache()
        frames = []
        for k in range(num_frames):
            vae._conv_idx = [0]
            tile = vae.post_quant_conv(z[:, :, k:k + 1, i:i + tile_h, j:j + tile_w])
            frames.append(vae.decoder(tile, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=(k == 0)))
        return torch.cat(frames, dim=2)

    tiles = decode_tiles([(i, j) for i in ys for j in xs], one, ctx, device=z.device)
    vae.clear_cache()
    if tiles is None:
        return None
    rows = [tiles[r * len(xs):(r + 1) * len(xs)] for r in range(len(ys))]
    out_rows = []
    for r, row in enumerate(rows):
        out_row = []
        for c, tile in enumerate(row):
            if r > 0:
                tile = vae.blend_v(rows[r - 1][c], tile, blend_h)
            if c > 0:
                tile = vae.blend_h(row[c - 1], tile, blend_w)
            out_row.append(tile[:, :, :, :out_stride_h, :out_stride_w])
        out_rows.append(torch.cat(out_row, dim=-1))
    dec = torch.cat(out_rows, dim=3)[:, :, :, :sample_h, :sample_w]
    if patch is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        dec = unpatchify(dec, patch_size=patch)
    return torch.clamp(dec, min=-1.0, max=1.0)


class LingBotVAE:
    """Encode an aligned reference frame to a clean latent; decode latents to [0, 1] frames."""

    spatial_ratio = 8  # pixels per latent cell (Wan 2.1 VAE)
    temporal_ratio = 4  # frames per latent frame after the first (causal: F = 4k + 1 -> k + 1)

    def __init__(self, vae: Any, ops: Any = None) -> None:
        self.vae = vae
        cfg = vae.config
        z = int(cfg.z_dim)
        mean = cfg.latents_mean if cfg.latents_mean is not None else [0.0] * z
        std = cfg.latents_std if cfg.latents_std is not None else [1.0] * z
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, z, 1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, z, 1, 1, 1)
        self.z_dim = z
        #: decoder modules with a fast path behind this wrapper's request gate (none without ``ops``)
        self.fast_paths: list[str] = install_fast_paths(self, vae, ops) if ops is not None else []

    @classmethod
    def from_pretrained(cls, vae_dir: Path, *, device: torch.device, ops: Any = None) -> LingBotVAE:
        """``ops``: the platform's op table (``options.platform.ops``), for the request-gated fast paths."""
        from diffusers import AutoencoderKLWan

        vae = AutoencoderKLWan.from_pretrained(str(vae_dir), torch_dtype=torch.float32, low_cpu_mem_usage=False)
        return cls(vae.to(device).eval().requires_grad_(False), ops)

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @contextmanager
    def tiling(self, tiling: Any) -> Iterator[None]:
        """Run the body with ``tiling`` (a :class:`~omni_lingbot.stage_options.VaeTiling`, or ``None`` for untiled)
        and put the VAE's previous tiling state back afterwards, even on error."""
        names = ("use_tiling", "tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height",
                 "tile_sample_stride_width")
        saved = {n: getattr(self.vae, n) for n in names}
        if tiling is None:
            self.vae.use_tiling = False
        else:  # set the attributes directly: enable_tiling() treats 0/None as "keep the previous value"
            self.vae.use_tiling = True
            self.vae.tile_sample_min_height, self.vae.tile_sample_min_width = tiling.min_height, tiling.min_width
            self.vae.tile_sample_stride_height = tiling.stride_height
            self.vae.tile_sample_stride_width = tiling.stride_width
        try:
            yield
        finally:
            for n, v in saved.items():
                setattr(self.vae, n, v)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """``[B, 3, T, H, W]`` in [0, 1] → normalised latents (posterior *sampled* with ``generator``)."""
        x = (pixels.to(self.device, torch.float32) - 0.5) / 0.5
        z = self.vae.encode(x).latent_dist.sample(generator=generator).float()
        return (z - self.mean.to(z.device)) / self.std.to(z.device)

    def splits_over_ranks(self, latents: torch.Tensor) -> bool:
        """Whether :meth:`decode` of ``latents`` under the current tiling is tiled (diffusers tiles only a latent
        larger than one tile), i.e. whether a parallel decode shares it out over the ranks."""
        ratio = int(self.vae.spatial_compression_ratio)
        return bool(self.vae.use_tiling) and (latents.shape[-1] > self.vae.tile_sample_min_width // ratio
                                              or latents.shape[-2] > self.vae.tile_sample_min_height // ratio)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents ``[B, C, t, h, w]`` → frames ``[B, T, H, W, 3]`` float32 in [0, 1]."""
        z = latents.to(self.device, torch.float32) * self.std.to(self.device) + self.mean.to(self.device)
        # diffusers' Wan decoder runs once per latent frame (and per tile when tiled): a cancellation point each
        # time, so DELETE stops a long video decode within one chunk (omnicore.engine.cancellation)
        with cancel_points(self.vae.decoder):
            video = self.vae.decode(z).sample.float().clamp(-1.0, 1.0)
        return self._frames(video)

    @torch.no_grad()
    def decode_over_ranks(self, latents: torch.Tensor, parallel: Any) -> torch.Tensor | None:
        """:meth:`decode` with a tiled decode's tiles decoded across the ranks of ``parallel`` (this rank's
        ``ParallelContext``; every rank calls it with the same latents when :meth:`splits_over_ranks`): rank 0 gets
        the frames of the single-process tiled decode, the other ranks ``None``. Untiled: :meth:`decode` here."""
        if not self.splits_over_ranks(latents):
            return self.decode(latents)
        z = latents.to(self.device, torch.float32) * self.std.to(self.device) + self.mean.to(self.device)
        tiled = tiled_decode_over_ranks(self.vae, z, parallel)
        return None if tiled is None else self._frames(tiled.float().clamp(-1.0, 1.0))

    @staticmethod
    def _frames(video: torch.Tensor) -> torch.Tensor:
        return ((video + 1.0) / 2.0).permute(0, 2, 3, 4, 1).contiguous()
