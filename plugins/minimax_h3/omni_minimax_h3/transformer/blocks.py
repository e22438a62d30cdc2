"""Building blocks of the MiniMax-H3 DiT, named as the official checkpoint names them.

- :class:`SwiGLU` — ``fc1`` (hidden -> 2·ffn, rows ``[gate | up]``) -> ``silu(gate) * up`` -> ``fc2``.
- :class:`TokenRefinerBlock` — pre-norm attention (no RoPE) + MLP, plain residuals (no AdaLN).
- :class:`DiTBlock` — the same pre-norm block modulated per row by its ``adaln_proj`` table (shift/scale/gate for
  attention, then for the MLP; no tanh on the gates).
- :class:`FinalLayer` — RMSNorm modulated per row by timestep (``modality_num`` 1), then the video / audio heads.
- :class:`TimeEmbedder` — ``[cos | sin]`` sinusoid of ``t`` in [0, 1] -> ``proj_in`` -> SiLU -> ``proj_out``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .adaln import H3AdaLNProjection
from .attention import Documents, H3Attention, PackedAttention, RMSNorm
from .config import BLOCK_EXPAND, MODALITY_NUM, MiniMaxH3TransformerConfig


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.ffn = ffn
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, ops: Any) -> torch.Tensor:
        gate, up = self.fc1(x).split(self.ffn, dim=-1)
        return self.fc2(ops.swiglu(gate, up))


class TokenRefinerBlock(nn.Module):
    def __init__(self, config: MiniMaxH3TransformerConfig) -> None:
        super().__init__()
        c = config
        self.norm1 = RMSNorm(c.hidden_size, c.norm_eps)
        self.attn = H3Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.ffn_dim)

    def forward(self, x: torch.Tensor, docs: Documents, attention: PackedAttention, ops: Any) -> torch.Tensor:
        x = x + self.attn(self.norm1(x, ops), docs, attention, ops)
        return x + self.mlp(self.norm2(x, ops), ops)


class TokenRefiner(nn.Module):
    def __init__(self, config: MiniMaxH3TransformerConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TokenRefinerBlock(config) for _ in range(config.num_refiner_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.final_norm_eps)

    def forward(self, x: torch.Tensor, docs: Documents, attention: PackedAttention, ops: Any) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, docs, attention, ops)
        return self.final_norm(x, ops)


class DiTBlock(nn.Module):
    def __init__(self, config: MiniMaxH3TransformerConfig) -> None:
        super().__init__()
        c = config
        self.hidden = c.hidden_size
        self.norm1 = RMSNorm(c.hidden_size, c.norm_eps)
        self.attn = H3Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.ffn_dim)
        self.adaln_proj = H3AdaLNProjection(c.time_embed_dim, c.hidden_size, BLOCK_EXPAND, MODALITY_NUM)

    def modulation(self, t_emb: torch.Tensor, *, direct: bool = False) -> tuple[torch.Tensor, ...]:
        """The block's six modulation tables ``[M*3, H]`` (shift, scale, gate, shift2, scale2, gate2), a few rows.

        The RMSNorm weights are folded into the scales here: ``rms(x)·w·(1 + s) + b`` == ``rms(x)·(1 + s') + b``
        with ``s' = w·(1 + s) - 1``, so the per-row work skips a multiply by ``w``. ``direct``: project from the
        weights (restored if offloaded) even when an AdaLN schedule table is installed.
        """
        proj = self.adaln_proj
        if direct:
            proj.restore()
            chunks = proj.compute_flat(t_emb).chunk(proj.expand_ratio, dim=-1)
        else:
            chunks = proj(t_emb)
        shift1, scale1, gate1, shift2, scale2, gate2 = chunks
        scale1 = self.norm1.weight.to(scale1.dtype) * (1 + scale1) - 1
        scale2 = self.norm2.weight.to(scale2.dtype) * (1 + scale2) - 1
        return tuple(m.contiguous() for m in (shift1, scale1, gate1, shift2, scale2, gate2))

    def modulated_input(self, x: torch.Tensor, t_emb: torch.Tensor, rows: torch.Tensor, ops: Any, *,
                        direct: bool = False) -> torch.Tensor:
        """``rms(x)·w·(1 + scale_msa) + shift_msa`` per row: the attention input of this block."""
        shift1, scale1 = self.modulation(t_emb, direct=direct)[:2]
        return ops.modulate(ops.rms_norm(x, None, self.norm1.eps), shift1.index_select(0, rows),
                            scale1.index_select(0, rows))

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, rows: torch.Tensor, docs: Documents,
                attention: PackedAttention, ops: Any, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x [T, H]``; ``rows [T]`` = each row's table row (``timestep_index * 3 + modality``) -> ``[T, H]``.

        Each per-row modulation is gathered right where it is used (``[T, H]`` at a time, never ``[T, 6H]``).
        """
        tables = self.modulation(t_emb)

        def per_row(i: int) -> torch.Tensor:
            return tables[i].index_select(0, rows)

        h = ops.modulate(ops.rms_norm(x, None, self.norm1.eps), per_row(0), per_row(1))
        a = self.attn(h, docs, attention, ops, rope)
        x, h = ops.gated_residual_norm_modulate(x, a, per_row(2), per_row(3), per_row(4), self.norm2.eps, norm="rms")
        return ops.gated_residual(x, self.mlp(h, ops), per_row(5))


class FinalLayer(nn.Module):
    def __init__(self, config: MiniMaxH3TransformerConfig) -> None:
        super().__init__()
        c = config
        self.norm = RMSNorm(c.hidden_size, c.final_norm_eps)
        self.adaln_proj = H3AdaLNProjection(c.time_embed_dim, c.hidden_size, 2, 1)
        self.video_out = nn.Linear(c.hidden_size, c.video_patch_dim, bias=True)
        self.audio_out = nn.Linear(c.hidden_size, c.audio_in_channels, bias=True)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, inverse: torch.Tensor, ops: Any,
                head: nn.Linear) -> torch.Tensor:
        """Rows ``x [N, H]`` at timestep indices ``inverse [N]`` through the norm, the modulation and ``head``."""
        shift, scale = (m.index_select(0, inverse) for m in self.adaln_proj(t_emb))
        h = ops.modulate(self.norm(x, ops), shift, scale)
        return head(h.to(head.weight.dtype))


class TimeEmbedder(nn.Module):
    def __init__(self, freq_dim: int, hidden: int, out: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.proj_in = nn.Linear(freq_dim, hidden, bias=True)
        self.proj_out = nn.Linear(hidden, out, bias=True)

    def sinusoid(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        args = t.float()[:, None] * torch.exp(exponent)[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """``t [M]`` in [0, 1] -> ``t_emb [M, out]`` (in the embedder's dtype, fp32 in the release)."""
        w = self.proj_in.weight
        h = nn.functional.silu(self.proj_in(self.sinusoid(t).to(w.dtype)))
        return self.proj_out(h)
