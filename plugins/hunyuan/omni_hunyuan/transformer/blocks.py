"""Building blocks of the HunyuanImage-3 language model and its image heads.

Parameter names follow the checkpoint after the loader's transforms (:mod:`omni_hunyuan.loader`): ``qkv_proj``
holds ``[Q; K; V]`` (ungrouped), every MLP holds separate ``gate_proj``/``up_proj``, and the routed experts of
one layer are stacked into ``[E, ...]`` tensors so the MoE can run one matmul pair per active expert.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .attention import SpanAttention
from .config import HunyuanConfig
from .rope import apply_rope


class RMSNorm(nn.Module):
    """Hunyuan RMSNorm: fp32 variance, the weight applied in fp32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` (the checkpoint's fused ``[up | gate]`` is split at load)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class StackedExperts(nn.Module):
    """``E`` SwiGLU experts stored as ``[E, I, H]`` gate/up and ``[E, H, I]`` down tensors."""

    #: expert parallel: this rank holds experts ``[first, first + len(w_gate))`` of ``total`` (``keep_experts``)
    first: int = 0
    #: expert parallel by all-to-all: the group's ``omnicore.plugin.ExpertDispatch`` (None: local or all-reduced)
    dispatch: Any = None

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.total = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[-1]))

    def keep_experts(self, first: int, count: int) -> None:
        """Expert parallel: keep experts ``[first, first + count)`` only; the forward then returns their share of
        the weighted sum (the model adds the ranks' shares with an all-reduce)."""
        for name in ("w_gate", "w_up", "w_down"):
            kept = getattr(self, name).data[first:first + count].clone()
            setattr(self, name, nn.Parameter(kept, requires_grad=False))
        self.first = first

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``; ``experts``/``weights`` ``[T, k]``: the weighted sum of each token's experts.

        Token copies are sorted by expert (one matmul pair per active expert on a contiguous slice), then put
        back in (token, slot) order with a gather and summed over the slots: no atomic scatter-adds, so the
        result does not depend on thread scheduling. Under all-to-all expert parallel (``dispatch``) this rank's
        slice of the tokens sends its copies to their experts' ranks, weights and sums what comes back the same
        way, and the slices are all-gathered."""
        tokens, k = experts.shape
        if self.dispatch is not None:
            d = self.dispatch
            part = d.token_slice(tokens)
            n = part.stop - part.start
            rows = x[part][torch.arange(n, device=x.device).repeat_interleave(k)]
            y = d.run(rows, experts[part].reshape(-1), self.run_rows)
            out = (y.reshape(n, k, -1) * weights[part][..., None].to(y.dtype)).sum(dim=1)
            return cast(torch.Tensor, d.gather(out, tokens))
        local = self.w_gate.shape[0]
        flat = experts.reshape(-1) - self.first
        if self.first or local != self.total:  # expert parallel: other ranks' experts go to a bucket left at zero
            flat = torch.where((flat < 0) | (flat >= local), torch.full_like(flat, local), flat)
        order = torch.argsort(flat, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        counts = torch.bincount(flat, minlength=local).tolist()
        xs = x[order // k]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts[:local]):
            if n == 0:
                continue
            xe = xs[start:start + n]
            ys[start:start + n] = (F.silu(xe @ self.w_gate[e].t()) * (xe @ self.w_up[e].t())) @ self.w_down[e].t()
            start += n
        ys[start:] = 0  # copies routed to another rank's experts (none without expert parallel)
        y = ys[inverse].reshape(tokens, k, -1) * weights[..., None].to(ys.dtype)
        return y.sum(dim=1)


    def run_rows(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``rows [N, H]``, each through this rank's expert ``local [N]`` -> ``[N, H]`` in the same order (rows of
        one expert keep their given order)."""
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.w_gate.shape[0]).tolist()
        xs = rows[order]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                xe = xs[start:start + n]
                ys[start:start + n] = (F.silu(xe @ self.w_gate[e].t()) * (xe @ self.w_up[e].t())) @ self.w_down[e].t()
                start += n
        out = torch.empty_like(ys)
        out[order] = ys
        return out


class MoE(nn.Module):
    """Softmax top-k routing (fp32 router, renormalised over the chosen experts when k > 1) plus a shared MLP."""

    def __init__(self, config: HunyuanConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k = config.moe_topk
        self.gate = nn.Linear(h, config.num_experts, bias=False)
        self.experts = StackedExperts(config.num_experts, h, config.moe_intermediate_size)
        self.shared_mlp = (MLP(h, config.moe_intermediate_size * max(1, config.num_shared_expert))
                           if config.use_mixed_mlp_moe else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.weight.float())
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        experts, weights = self.route(flat)
        out = self.experts(flat, experts, weights)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(flat)
        return out.reshape(shape)


class Attention(nn.Module):
    """Self-attention: fused ``[Q; K; V]`` projection, RoPE, then q/k RMSNorm, GQA, span attention."""

    def __init__(self, config: HunyuanConfig, attend: SpanAttention) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.attention_head_dim)
        d = self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, (self.heads + 2 * self.kv_heads) * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, config.hidden_size, bias=False)
        self.use_qk_norm = config.use_qk_norm
        if config.use_qk_norm:
            self.query_layernorm = RMSNorm(d, config.rms_norm_eps)
            self.key_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.attend = attend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Sequence[tuple[int, int]],
                past: tuple[torch.Tensor, torch.Tensor] | None, start: int, keep: int) -> tuple[torch.Tensor, Any]:
        """``x`` holds positions ``[start, start + L)``; ``past`` buffers hold valid K/V for ``[0, start)``. When
        a buffer has room, this call's K/V are written into it in place (positions ``>= start`` only, so a cached
        prefix is never touched) and attention reads a view: no copy of the prefix per step. Returns the output
        and, with ``keep > 0``, the full K/V buffers (their first ``keep`` positions are the prefix to keep)."""
        b, length, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = apply_rope(q.reshape(b, length, self.heads, d), cos, sin)
        k = apply_rope(k.reshape(b, length, self.kv_heads, d), cos, sin)
        v = v.reshape(b, length, self.kv_heads, d)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        if past is not None:
            kb, vb = past
            end = start + length
            if kb.shape[1] >= end:
                kb[:, start:end] = k
                vb[:, start:end] = v
                k, v = kb[:, :end], vb[:, :end]
            else:
                k, v = torch.cat([kb[:, :start], k], dim=1), torch.cat([vb[:, :start], v], dim=1)
        out = self.attend(q, k, v, spans)
        kept = (k, v) if keep > 0 else None
        return self.o_proj(out.reshape(b, length, self.heads * d)), kept


class DecoderLayer(nn.Module):
    def __init__(self, config: HunyuanConfig, index: int, attend: SpanAttention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, attend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = MoE(config) if config.layer_is_moe(index) else MLP(config.hidden_size,
                                                                                 config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Sequence[tuple[int, int]],
                past: Any, start: int, keep: int) -> tuple[torch.Tensor, Any]:
        attn, kept = self.self_attn(self.input_layernorm(x), cos, sin, spans, past, start, keep)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kept


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features ``[cos | sin]`` of ``t`` (any scale; Hunyuan feeds ``sigma * 1000``)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepEmbedder(nn.Module):
    """``mlp.0`` Linear(256, H) -> GELU -> ``mlp.2`` Linear(H, H) over the sinusoidal features."""

    def __init__(self, hidden: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        first = cast(nn.Linear, self.mlp[0])
        return self.mlp(timestep_embedding(t, self.freq_dim).to(first.weight.dtype))


class GroupNorm32(nn.GroupNorm):
    """GroupNorm computed in float32 (cast back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class ResBlock(nn.Module):
    """Timestep-conditioned residual block with scale-shift norm (``h = norm(h) * (1 + scale) + shift``)."""

    def __init__(self, channels: int, emb_channels: int, out_channels: int) -> None:
        super().__init__()
        self.in_layers = nn.Sequential(GroupNorm32(32, channels), nn.SiLU(),
                                       nn.Conv2d(channels, out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, 2 * out_channels))
        self.out_layers = nn.Sequential(GroupNorm32(32, out_channels), nn.SiLU(), nn.Dropout(0.0),
                                        nn.Conv2d(out_channels, out_channels, 3, padding=1))
        self.skip_connection: nn.Module = (nn.Identity() if channels == out_channels
                                           else nn.Conv2d(channels, out_channels, 1))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        scale, shift = self.emb_layers(emb)[..., None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1.0 + scale) + shift
        for layer in cast(nn.Sequential, self.out_layers[1:]):
            h = layer(h)
        return self.skip_connection(x) + h


class UNetDown(nn.Module):
    """Patch embed (patch size 1): ``model.0`` conv3x3 -> ``model.1`` ResBlock -> ``[B, h*w, H]`` tokens."""

    def __init__(self, latent_channels: int, emb_channels: int, hidden_channels: int, out_channels: int) -> None:
        super().__init__()
        self.model = nn.ModuleList([nn.Conv2d(latent_channels, hidden_channels, 3, padding=1),
                                    ResBlock(hidden_channels, emb_channels, out_channels)])

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.model[1](self.model[0](x), emb)
        return h.flatten(2).transpose(1, 2)


class UNetUp(nn.Module):
    """Final layer: ``model.0`` ResBlock(H -> hidden) -> ``model.1`` [GroupNorm, SiLU, conv3x3 -> latent]."""

    def __init__(self, in_channels: int, emb_channels: int, hidden_channels: int, latent_channels: int) -> None:
        super().__init__()
        self.model = nn.ModuleList([
            ResBlock(in_channels, emb_channels, hidden_channels),
            nn.Sequential(GroupNorm32(32, hidden_channels), nn.SiLU(),
                          nn.Conv2d(hidden_channels, latent_channels, 3, padding=1)),
        ])

    def forward(self, tokens: torch.Tensor, emb: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)
        return self.model[1](self.model[0](x, emb))


class LightProjector(nn.Module):
    """The vision aligner: ``mlp_gelu`` (Linear, [GELU, Linear] x (depth - 1)) or ``linear``."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        kind = config.get("projector_type", "mlp_gelu")
        in_dim, out_dim = int(config["input_dim"]), int(config["n_embed"])
        if kind == "linear":
            self.layers: nn.Module = nn.Linear(in_dim, out_dim)
        elif kind == "mlp_gelu":
            mods: list[nn.Module] = [nn.Linear(in_dim, out_dim)]
            for _ in range(int(config.get("depth", 1)) - 1):
                mods += [nn.GELU(), nn.Linear(out_dim, out_dim)]
            self.layers = nn.Sequential(*mods)
        else:
            raise ValueError(f"vit_aligner.projector_type {kind!r} is not supported ('mlp_gelu' or 'linear')")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
