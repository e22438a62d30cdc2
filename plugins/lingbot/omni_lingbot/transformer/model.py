"""``LingBotVideoTransformer3DModel``: the LingBot-Video DiT on packed joint sequences.

One forward handles any batch as a single packed sequence: sample ``i`` is the document
``[video_i ; text_i (real tokens only)]``; attention isolates documents through ``cu_seqlens`` so batch CFG
([cond, uncond] with different text lengths) costs one pass and never builds an O(S^2) mask, and a padded text
batch of one is exactly the unpadded one. Parameter names equal the diffusers checkpoint's, so its state dict
loads with ``strict=True``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from omnicore.plugin import (
    AttentionMetadata,
    SequenceShard,
    UlyssesAttention,
    check_heads,
    lora_packed_rows,
    sdpa_attention,
)
from torch import nn

from .attention import AttentionFn
from .blocks import LingBotBlock
from .config import LingBotTransformerConfig
from .embeddings import TextEmbedder, TimestepEmbedding, linear, patchify, sinusoidal_timestep_embedding, unpatchify
from .metadata import ForwardMetadata, build_forward_metadata
from .norm import FP32LayerNorm, bind_ops
from .rope import LingBotRotaryEmbedding
from .sequence_parallel import ShardedLayout

#: Name segments of parameters/buffers kept in fp32 when the model runs in bf16.
KEEP_FP32_MODULES: tuple[str, ...] = (
    "time_embedder", "time_modulation", "scale_shift_table", "norm", "norm1", "norm2", "norm_q", "norm_k",
    "norm_post_attn", "norm_post_ffn", "norm_out", "norm_out_modulation", "router",
)


def is_fp32_kept(name: str, keep: Iterable[str] = KEEP_FP32_MODULES) -> bool:
    """Whether the parameter/buffer ``name`` (dotted) stays fp32 under the model's dtype policy."""
    return not set(name.split(".")).isdisjoint(keep)


def cast_keeping_fp32(model: nn.Module, dtype: torch.dtype, keep: Iterable[str] = KEEP_FP32_MODULES) -> nn.Module:
    """Cast floating parameters/buffers to ``dtype`` except the fp32-kept ones (in place; returns ``model``)."""
    keep = tuple(keep)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if is_fp32_kept(name, keep) else dtype)
    return model


class _WithMetadata:
    """An attention backend called with one layer's metadata (the layout's, with that layer's sparse plan)."""

    def __init__(self, attention: AttentionFn, metadata: AttentionMetadata) -> None:
        self.attention = attention
        self.metadata = metadata

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, metadata: Any = None,
                 **kwargs: Any) -> torch.Tensor:
        return self.attention(q, k, v, metadata=self.metadata, **kwargs)


class LingBotVideoTransformer3DModel(nn.Module):
    """The LingBot-Video DiT. ``attention`` follows ``omnicore.attention.reference.sdpa_attention`` (packed mode)."""

    keep_fp32_modules: tuple[str, ...] = KEEP_FP32_MODULES
    #: this rank's omnicore.parallel.ParallelContext when the blocks run Ulysses-sharded (enable_ulysses)
    sequence_parallel: Any = None
    #: the attention backend's block-sparse planner (enable_sparse_attention); None = every call dense
    sparse_planner: Any = None

    def __init__(self, config: LingBotTransformerConfig, attention: AttentionFn | None = None, ops: Any = None) -> None:
        super().__init__()
        self.config = config
        self.attention: AttentionFn = attention or sdpa_attention
        hidden = config.hidden_size
        self.patch_embedder = nn.Linear(config.patch_volume * config.in_channels, hidden, bias=config.patch_embed_bias)
        self.time_embedder = TimestepEmbedding(config.freq_dim, hidden, bias=config.timestep_mlp_bias)
        self.time_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        self.text_embedder = TextEmbedder(config.text_dim, hidden)  # eps fixed at 1e-6, as the reference
        self.rope = LingBotRotaryEmbedding(config.axes_dims, config.axes_lens, config.rope_theta)
        self.blocks = nn.ModuleList(LingBotBlock(config, i) for i in range(config.depth))
        self.norm_out = FP32LayerNorm(hidden, eps=config.norm_eps, elementwise_affine=False)
        self.norm_out_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.proj_out = nn.Linear(hidden, config.patch_volume * config.out_channels)
        if ops is not None:  # a platform's op table (options.platform.ops); default: the eager references
            bind_ops(self, ops)

    # ------------------------------------------------------------------ dtype policy
    def cast(self, dtype: torch.dtype) -> LingBotVideoTransformer3DModel:
        """Cast to ``dtype`` keeping :attr:`keep_fp32_modules` in fp32 (what the loader calls for bf16)."""
        cast_keeping_fp32(self, dtype, self.keep_fp32_modules)
        return self

    def enable_ulysses(self, ctx: Any) -> None:
        """Run the blocks on this rank's rows of the packed sequence (``ctx.ulysses`` ranks; a head count it does
        not divide is a ConfigError here, at load) with attention through the Ulysses all-to-all."""
        check_heads(self.config.num_attention_heads, ctx.ulysses)
        self.sequence_parallel = ctx
        self.attention = UlyssesAttention(self.attention, ctx)

    def enable_expert_parallel(self, ctx: Any, dispatch: str = "all_to_all") -> None:
        """Partition every MoE block's routed experts over ``ctx.ep`` ranks (rank ``e`` keeps a contiguous
        ``1/ep``; a count the degree does not divide is a ConfigError naming both), tokens dispatched to their
        experts' ranks by ``dispatch`` (``all_to_all`` or ``all_reduce``; see :mod:`.moe`). A dense DiT (no MoE
        block) is refused: expert parallel would only replicate it."""
        for moe in self.moe_blocks(ctx.ep):
            moe.enable_expert_parallel(ctx, dispatch)

    def moe_blocks(self, degree: int) -> list[Any]:
        """The MoE FFNs expert parallel of ``degree`` splits (a dense DiT is a ConfigError: it would only
        replicate)."""
        from omnicore.plugin import ConfigError

        from .moe import LingBotMoE

        moes = [m for m in self.modules() if isinstance(m, LingBotMoE)]
        if not moes:
            raise ConfigError("parallel", f"ep={degree} needs a mixture-of-experts DiT; this one has no MoE block")
        return moes

    def keep_expert_share(self, rank: int, degree: int) -> None:
        """Expert parallel's narrowing alone (no dispatch): every MoE block keeps rank ``rank``'s ``1/degree`` of
        its routed experts, as :meth:`enable_expert_parallel` does at load (the planner runs it on the meta
        device)."""
        for moe in self.moe_blocks(degree):
            moe.keep_expert_share(rank, degree)

    def enable_sparse_attention(self, options: Mapping[str, Any] | None = None) -> bool:
        """Attach block-sparse plans to the attention calls when the backend executes them (it carries a
        ``sparse_planner`` factory, e.g. ``npu_rainfusion``), built from ``options`` (``sparsity``,
        ``skip_layers``); returns whether plans are on. Plans cover the full sequence's documents, so they are
        the same on every Ulysses rank (each attends over every row for its heads)."""
        backend = self.attention.attention if isinstance(self.attention, UlyssesAttention) else self.attention
        factory = getattr(backend, "sparse_planner", None)
        self.sparse_planner = factory(dict(options or {})) if callable(factory) else None
        return self.sparse_planner is not None

    def layer_attention(self, metadata: AttentionMetadata) -> list[AttentionFn]:
        """The attention of each block: the backend itself, or — with a sparse planner — the backend called with
        that layer's planned metadata (documents are ``[video ; text]``: the video leads)."""
        if self.sparse_planner is None:
            return [self.attention] * len(self.blocks)
        planned = self.sparse_planner.layer_metadata(metadata, len(self.blocks), video_first=True)
        return [_WithMetadata(self.attention, md) for md in planned]

    # ------------------------------------------------------------------ forward
    def time_embedding(self, timestep: torch.Tensor) -> torch.Tensor:
        """``timestep [B]`` (sigma*1000) -> ``t_emb [B, H]`` fp32."""
        return self.time_embedder(sinusoidal_timestep_embedding(timestep, self.config.freq_dim))

    def forward_metadata(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        *,
        pad_to_multiple: int = 1,
    ) -> ForwardMetadata:
        """The packed layout, RoPE frequencies and real-text index of a forward on these inputs.

        Depends only on shapes, the device and the mask's contents, so a pipeline builds it once per request
        branch and passes it as ``forward(..., metadata=...)`` at every step.
        """
        if self.sequence_parallel is not None:  # equal row shards on every Ulysses rank
            pad_to_multiple = math.lcm(pad_to_multiple, self.sequence_parallel.ulysses)
        return build_forward_metadata(self.config.patch_size, self.rope, hidden_states, encoder_hidden_states,
                                      encoder_attention_mask, pad_to_multiple)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        *,
        pad_to_multiple: int | None = None,
        metadata: ForwardMetadata | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity ``[B, out_channels, F, H, W]``.

        ``hidden_states [B, C, F, H, W]`` latents, ``timestep [B]`` (or a scalar) = sigma*1000,
        ``encoder_hidden_states [B, L, text_dim]``, ``encoder_attention_mask [B, L]`` (True = real token; padding
        tokens are dropped, wherever they sit). ``pad_to_multiple`` pads the packed sequence with rows that attend
        nowhere and get no routed MoE output (static shapes for kernels); the result does not depend on it.
        ``metadata`` is :meth:`forward_metadata` of inputs with these shapes and this very mask, built earlier and
        reused (checked on the host against the shapes and device; the mask's contents are not re-read).
        """
        cfg = self.config
        if hidden_states.dim() != 5 or hidden_states.shape[1] != cfg.in_channels:
            raise ValueError(f"hidden_states must be [B, {cfg.in_channels}, F, H, W], got {tuple(hidden_states.shape)}")
        b = hidden_states.shape[0]
        if encoder_hidden_states.dim() != 3 or encoder_hidden_states.shape[0] != b \
                or encoder_hidden_states.shape[2] != cfg.text_dim:
            raise ValueError(f"encoder_hidden_states must be [{b}, L, {cfg.text_dim}], "
                             f"got {tuple(encoder_hidden_states.shape)}")
        if encoder_attention_mask is not None and encoder_attention_mask.shape != encoder_hidden_states.shape[:2]:
            raise ValueError(f"encoder_attention_mask must be {tuple(encoder_hidden_states.shape[:2])}, "
                             f"got {tuple(encoder_attention_mask.shape)}")
        timestep = torch.as_tensor(timestep, device=hidden_states.device).reshape(-1)
        if timestep.numel() == 1 and b > 1:
            timestep = timestep.expand(b)
        if timestep.numel() != b:
            raise ValueError(f"timestep must have {b} entries (one per sample), got {timestep.numel()}")

        if metadata is None:
            metadata = self.forward_metadata(hidden_states, encoder_hidden_states, encoder_attention_mask,
                                             pad_to_multiple=1 if pad_to_multiple is None else pad_to_multiple)
        elif (why := metadata.mismatch(hidden_states, encoder_hidden_states, pad_to_multiple)) is not None:
            raise ValueError(f"metadata was built for other inputs: {why}")
        layout = metadata.layout
        video = linear(self.patch_embedder, patchify(hidden_states, cfg.patch_size)).float()
        texts = self.text_embedder(metadata.real_text(encoder_hidden_states)).float().split(
            list(layout.text_lengths), dim=0)

        t_emb = self.time_embedding(timestep)
        temb6 = linear(cast(nn.Linear, self.time_modulation[1]), self.time_modulation[0](t_emb)).float()
        x = layout.pack(video, texts)
        freqs = metadata.freqs
        sp = self.sequence_parallel
        blocks_layout: Any = layout
        if sp is not None:  # this rank's rows only, until the output head
            shard = SequenceShard(layout.total, sp.sp_rank, sp.ulysses)
            x, freqs, blocks_layout = shard.take(x), shard.take(freqs), ShardedLayout(layout, shard)
        # per-request LoRA: the blocks' linears see packed [T, H] rows (this rank's shard under Ulysses), sample
        # i's document is segments[i]
        with lora_packed_rows([end for _, end in layout.segments], layout.total,
                              window=None if sp is None else (shard.start, shard.end)):
            for block, attention in zip(self.blocks, self.layer_attention(layout.attention)):
                x = block(x, temb6, blocks_layout, freqs, attention)
        if sp is not None:
            x = shard.gather(x, sp)

        modulation = cast(nn.Linear, self.norm_out_modulation[1])
        shift, scale = linear(modulation, self.norm_out_modulation[0](t_emb)).float().chunk(2, dim=-1)
        vid = layout.video_rows(x)  # [B, Nv, H]
        vid = self.norm_out(vid) * (1 + scale[:, None]) + shift[:, None]
        out = linear(self.proj_out, vid)
        return unpatchify(out, layout.grid, cfg.patch_size).to(hidden_states.dtype)
