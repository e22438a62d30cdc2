"""``AutoencoderKLConv3D``: the HunyuanImage-3 VAE, 16x spatial and 4x temporal.

3-D convolutions throughout; GroupNorm(32)+SiLU ResNet blocks; one attention block in the middle; DC-AE style
space-to-channel down/up-sampling whose shortcut averages (down) or repeats (up) channel groups; the encoder's
output adds a group-mean shortcut and the decoder's input a channel-repeat shortcut. A still image is
repeated to ``ffactor_temporal`` frames to encode; decoding a one-frame latent keeps the last decoded frame.

Fast paths (``quality="high"`` requests only): :func:`install_fast_paths` runs the decoder's GroupNorm+SiLU pairs
(every ResNet block's two and the output head's) on the platform's fused ``group_norm_silu`` op, behind the VAE's
request gate (``omnicore.plugin.fast_path_gate``). Its up-sampling is DC-AE channel-to-space (a conv, then a
reshuffle), not a nearest upsample, so the fused upsample+conv op does not apply. With the gate off every module
runs its own forward: the decode is bit-identical to an uninstalled VAE.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from omnicore.plugin import fast_path_gate, install_fast_path
from torch import nn


def _gn(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = _gn(in_channels)
        self.conv1 = nn.Conv3d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _gn(out_channels)
        self.conv2 = nn.Conv3d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head attention over all ``f*h*w`` positions with 1x1x1 projections."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _gn(channels)
        self.q = nn.Conv3d(channels, channels, 1)
        self.k = nn.Conv3d(channels, channels, 1)
        self.v = nn.Conv3d(channels, channels, 1)
        self.proj_out = nn.Conv3d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, c, f, hh, ww = x.shape

        def seq(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, 1, c, f * hh * ww).transpose(2, 3)

        out = F.scaled_dot_product_attention(seq(self.q(h)), seq(self.k(h)), seq(self.v(h)))
        out = out.transpose(2, 3).reshape(b, c, f, hh, ww)
        return x + self.proj_out(out)


def _space_to_channel(x: torch.Tensor, rt: int) -> torch.Tensor:
    """``[b, c, f*rt, h*2, w*2] -> [b, (rt*2*2*c), f, h, w]`` (the factor index outermost)."""
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f // rt, rt, h // 2, 2, w // 2, 2)
    return x.permute(0, 3, 5, 7, 1, 2, 4, 6).reshape(b, rt * 4 * c, f // rt, h // 2, w // 2)


def _channel_to_space(x: torch.Tensor, rt: int) -> torch.Tensor:
    """Inverse of :func:`_space_to_channel`."""
    b, cc, f, h, w = x.shape
    c = cc // (rt * 4)
    x = x.reshape(b, rt, 2, 2, c, f, h, w)
    return x.permute(0, 4, 5, 1, 6, 2, 7, 3).reshape(b, c, f * rt, h * 2, w * 2)


class DownsampleDCAE(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, temporal: bool) -> None:
        super().__init__()
        factor = 8 if temporal else 4
        if out_channels % factor:
            raise ValueError(f"downsample out_channels {out_channels} must be a multiple of {factor}")
        self.conv = nn.Conv3d(in_channels, out_channels // factor, 3, padding=1)
        self.rt = 2 if temporal else 1
        self.group = factor * in_channels // out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _space_to_channel(self.conv(x), self.rt)
        s = _space_to_channel(x, self.rt)
        b, _, f, hh, ww = s.shape
        s = s.reshape(b, h.shape[1], self.group, f, hh, ww).mean(dim=2)
        return h + s


class UpsampleDCAE(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, temporal: bool) -> None:
        super().__init__()
        factor = 8 if temporal else 4
        self.conv = nn.Conv3d(in_channels, out_channels * factor, 3, padding=1)
        self.rt = 2 if temporal else 1
        self.repeats = factor * out_channels // in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _channel_to_space(self.conv(x), self.rt)
        s = _channel_to_space(x.repeat_interleave(self.repeats, dim=1), self.rt)
        return h + s


class _Level(nn.Module):
    pass


class _Mid(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nn.Module):
    def __init__(self, in_channels: int, z_channels: int, block_out_channels: list[int], num_res_blocks: int,
                 ffactor_spatial: int, ffactor_temporal: int, match_channel: bool = True) -> None:
        super().__init__()
        if block_out_channels[-1] % (2 * z_channels):
            raise ValueError("the last block_out_channels must be a multiple of 2 * latent_channels")
        self.z_channels, self.last = z_channels, block_out_channels[-1]
        self.conv_in = nn.Conv3d(in_channels, block_out_channels[0], 3, padding=1)
        self.down = nn.ModuleList()
        cin = block_out_channels[0]
        spatial_levels = int(math.log2(ffactor_spatial))
        temporal_from = int(math.log2(ffactor_spatial // ffactor_temporal))
        for i, ch in enumerate(block_out_channels):
            level = _Level()
            level.block = nn.ModuleList()
            for _ in range(num_res_blocks):
                level.block.append(ResnetBlock(cin, ch))
                cin = ch
            if i < spatial_levels:
                cout = block_out_channels[i + 1] if match_channel else cin
                level.downsample = DownsampleDCAE(cin, cout, temporal=i >= temporal_from)
                cin = cout
            self.down.append(level)
        self.mid = _Mid(cin)
        self.norm_out = _gn(cin)
        self.conv_out = nn.Conv3d(cin, 2 * z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            for block in cast(nn.ModuleList, level.block):
                h = block(h)
            if hasattr(level, "downsample"):
                h = cast(nn.Module, level.downsample)(h)
        h = self.mid(h)
        b, c, f, hh, ww = h.shape
        shortcut = h.reshape(b, 2 * self.z_channels, c // (2 * self.z_channels), f, hh, ww).mean(dim=2)
        return self.conv_out(F.silu(self.norm_out(h))) + shortcut


class Decoder(nn.Module):
    def __init__(self, z_channels: int, out_channels: int, block_out_channels: list[int], num_res_blocks: int,
                 ffactor_spatial: int, ffactor_temporal: int, match_channel: bool = True) -> None:
        super().__init__()
        if block_out_channels[0] % z_channels:
            raise ValueError("the first decoder channels must be a multiple of latent_channels")
        self.z_channels, self.first = z_channels, block_out_channels[0]
        cin = block_out_channels[0]
        self.conv_in = nn.Conv3d(z_channels, cin, 3, padding=1)
        self.mid = _Mid(cin)
        self.up = nn.ModuleList()
        spatial_levels, temporal_levels = int(math.log2(ffactor_spatial)), int(math.log2(ffactor_temporal))
        for i, ch in enumerate(block_out_channels):
            level = _Level()
            level.block = nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                level.block.append(ResnetBlock(cin, ch))
                cin = ch
            if i < spatial_levels or i < temporal_levels:
                cout = block_out_channels[i + 1] if match_channel else cin
                level.upsample = UpsampleDCAE(cin, cout, temporal=i < temporal_levels)
                cin = cout
            self.up.append(level)
        self.norm_out = _gn(cin)
        self.conv_out = nn.Conv3d(cin, out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z) + z.repeat_interleave(self.first // self.z_channels, dim=1)
        h = self.mid(h)
        for level in self.up:
            for block in cast(nn.ModuleList, level.block):
                h = block(h)
            if hasattr(level, "upsample"):
                h = cast(nn.Module, level.upsample)(h)
        return self.conv_out(F.silu(self.norm_out(h)))


def _gn_silu(ops: Any, norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    return cast(torch.Tensor, ops.group_norm_silu(x, norm.num_groups, norm.weight, norm.bias, norm.eps))


def _fast_resnet(ops: Any, block: ResnetBlock) -> Any:
    """``ResnetBlock.forward`` with each ``silu(norm(x))`` on the fused op."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = block.conv1(_gn_silu(ops, block.norm1, x))
        h = block.conv2(_gn_silu(ops, block.norm2, h))
        return (x if block.nin_shortcut is None else block.nin_shortcut(x)) + h

    return forward


def _fast_decoder(ops: Any, decoder: Decoder) -> Any:
    """``Decoder.forward`` with the output head's ``silu(norm_out(h))`` on the fused op."""
    def forward(z: torch.Tensor) -> torch.Tensor:
        h = decoder.conv_in(z) + z.repeat_interleave(decoder.first // decoder.z_channels, dim=1)
        h = decoder.mid(h)
        for level in decoder.up:
            for block in cast(nn.ModuleList, level.block):
                h = block(h)
            if hasattr(level, "upsample"):
                h = cast(nn.Module, level.upsample)(h)
        return decoder.conv_out(_gn_silu(ops, decoder.norm_out, h))

    return forward


def install_fast_paths(vae: AutoencoderKLConv3D, ops: Any) -> list[str]:
    """Install the decoder's fast paths behind ``vae``'s gate; returns the names of the modules that got one
    (idempotent). The encoder is untouched."""
    gate = fast_path_gate(vae)
    installed = []
    for name, module in vae.decoder.named_modules():
        if isinstance(module, ResnetBlock):
            install_fast_path(module, _fast_resnet(ops, module), gate)
            installed.append(f"decoder.{name}")
    install_fast_path(vae.decoder, _fast_decoder(ops, vae.decoder), gate)
    installed.append("decoder")
    return installed


class AutoencoderKLConv3D(nn.Module):
    """Encoder + decoder; ``config`` is the checkpoint's nested ``vae`` dict."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        blocks = [int(c) for c in config["block_out_channels"]]
        self.latent_channels = int(config["latent_channels"])
        self.ffactor_spatial = int(config.get("ffactor_spatial", 16))
        self.ffactor_temporal = int(config.get("ffactor_temporal", 4))
        self.scaling_factor = float(config.get("scaling_factor") or 1.0)
        self.shift_factor = float(config.get("shift_factor") or 0.0)
        layers = int(config.get("layers_per_block", 2))
        self.encoder = Encoder(int(config.get("in_channels", 3)), self.latent_channels, blocks, layers,
                               self.ffactor_spatial, self.ffactor_temporal,
                               bool(config.get("downsample_match_channel", True)))
        self.decoder = Decoder(self.latent_channels, int(config.get("out_channels", 3)), list(reversed(blocks)),
                               layers, self.ffactor_spatial, self.ffactor_temporal,
                               bool(config.get("upsample_match_channel", True)))

    def encode_moments(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``pixels [B, 3, H, W]`` in [-1, 1] -> posterior ``(mean, logvar)`` ``[B, C, 1, h, w]``."""
        x = pixels[:, :, None].expand(-1, -1, self.ffactor_temporal, -1, -1)
        moments = self.encoder(x)
        mean, logvar = moments.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """A posterior sample, normalised ``(z - shift) * scale``: ``[B, C, h, w]``."""
        mean, logvar = self.encode_moments(pixels)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        z = mean + torch.exp(0.5 * logvar) * noise
        return ((z - self.shift_factor) * self.scaling_factor)[:, :, 0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` normalised latents -> ``[B, 3, H, W]`` in [0, 1] (the last decoded frame)."""
        z = latents / self.scaling_factor + self.shift_factor
        frames = self.decoder(z[:, :, None])
        return (frames[:, :, -1] / 2 + 0.5).clamp(0, 1)
