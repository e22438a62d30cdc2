"""``MiniMaxH3DiT``: the MiniMax-H3 DiT built for serving.

Compared with a straight port, per request (not per step): the RoPE table and the token-refined text rows
(:meth:`prepare_request`); per batch: several requests packed into one forward, each its own ``[real | pad]``
document pair, attention through the packed backend with no O(S²) mask (:meth:`pack`); per step: one fused qkv
GEMM per block, a few-row AdaLN table per block (pre-norm weights folded into its scales) whose rows are gathered
by ``timestep_index * 3 + modality`` where they are used, the time embedding or the exact-schedule AdaLN tables
(``adaln_step_index``), and the output heads applied to the video / audio rows only. Parameter names follow the
official checkpoint (``blocks.N.attn.qkv_proj``, ``mlp.fc1`` rows ``[gate | up]``, ...);
:mod:`omni_minimax_h3.loader` converts the diffusers layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from omnicore.plugin import (
    ABSENT,
    AdaLNScheduleController,
    SequenceShard,
    UlyssesAttention,
    check_heads,
    lora_packed_rows,
)
from torch import nn

from .attention import AttentionFn, Documents, PackedAttention
from .blocks import DiTBlock, FinalLayer, TimeEmbedder, TokenRefiner
from .config import MODALITY_NUM, MiniMaxH3TransformerConfig
from .layout import RequestLayout
from .metadata import BatchPlan, RequestPlan, _pad_tags
from .ops import resolve_ops
from .rope import H3Rope

#: Module name segments kept in float32 when the model runs in a lower precision (the release checkpoint's
#: fp32 islands).
KEEP_FP32: tuple[str, ...] = ("video_patch_proj", "audio_patch_proj", "time_embedder", "video_out", "audio_out",
                              "rope")


def is_fp32_kept(name: str) -> bool:
    return not set(name.split(".")).isdisjoint(KEEP_FP32)


class MiniMaxH3DiT(nn.Module):
    """See the package docstring (:mod:`omni_minimax_h3.transformer`) for the calling sequence."""

    #: this rank's omnicore.parallel.ParallelContext when the DiT blocks run Ulysses-sharded (enable_ulysses)
    sequence_parallel: Any = None
    #: this rank's omnicore.parallel.ParallelContext when the DiT's linears are split (enable_tensor_parallel)
    tensor_parallel: Any = None

    def __init__(self, config: MiniMaxH3TransformerConfig, *, attention: AttentionFn | None = None,
                 ops: Any = None) -> None:
        super().__init__()
        c = self.config = config
        self.ops = resolve_ops(ops)
        self.attention = PackedAttention(attention)
        self.video_patch_proj = nn.Linear(c.video_patch_dim, c.hidden_size, bias=True)
        self.audio_patch_proj = nn.Linear(c.audio_in_channels, c.hidden_size, bias=True)
        self.condition_proj = nn.Linear(c.text_dim, c.hidden_size, bias=True)
        self.time_embedder = TimeEmbedder(c.freq_dim, c.time_embed_hidden_dim, c.time_embed_dim)
        self.rope = H3Rope(c.rope_freq_dim, c.rope_theta)
        self.token_refiner = TokenRefiner(c)
        self.blocks = nn.ModuleList(DiTBlock(c) for _ in range(c.num_layers))
        self.final_layer = FinalLayer(c)
        self.adaln = AdaLNScheduleController(self.adaln_projections, self.time_embed)

    # ------------------------------------------------------------------ properties / dtype policy
    def adaln_projections(self) -> list[Any]:
        """Every block's AdaLN projection, then the final layer's (the controller's order)."""
        return [b.adaln_proj for b in self.blocks] + [self.final_layer.adaln_proj]

    @property
    def device(self) -> torch.device:
        return self.condition_proj.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the residual stream (that of ``condition_proj``, as in the reference)."""
        return self.condition_proj.weight.dtype

    def cast(self, dtype: torch.dtype) -> MiniMaxH3DiT:
        """``dtype`` everywhere except the fp32 islands (:data:`KEEP_FP32`); in place."""
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if is_fp32_kept(name) else dtype)
        return self

    # ------------------------------------------------------------------ worker group
    def enable_ulysses(self, ctx: Any) -> None:
        """Run the DiT blocks on this rank's rows of the packed batch (``ctx.ulysses`` ranks), attention through
        the Ulysses all-to-all with the full batch's documents (each request's ``[real | pad]`` bounds and the
        ``latent_grid`` are the whole sequence's, so they are right on every shard). The batch's total rows must
        be a multiple of the degree (the pipeline pads each document to one). A head count the degree does not
        divide (after any TP split) is a ConfigError here, at load. The token refiner runs unsharded."""
        heads = cast(DiTBlock, self.blocks[0]).attn.heads  # this rank's heads (all of them without TP)
        check_heads(heads, ctx.ulysses)
        self.sequence_parallel = ctx

    def enable_tensor_parallel(self, ctx: Any) -> None:
        """Split the attention and MLP linears of every block (and of the token refiner) and the blocks' AdaLN
        projections over ``ctx.tp`` ranks (:mod:`.tensor_parallel`'s plan; a head, FFN or AdaLN width the degree
        does not divide is a ConfigError naming them): a DiT loaded with ``tp=`` already holds its shard, a whole
        one is narrowed here. Each rank then computes its heads and FFN columns; DTensor's row-parallel linears
        all-reduce the block outputs; each AdaLN projection all-gathers its few modulation rows."""
        from omnicore.plugin import parallelize, shard_module

        from .attention import H3Attention
        from .blocks import DiTBlock, SwiGLU
        from .tensor_parallel import linear_plan, module_plan

        plan = module_plan(self.config)
        plan.check(ctx.tp)
        shard_module(self, plan, rank=ctx.tp_rank, degree=ctx.tp)  # no-op for the linears a sharded load made
        for module in self.modules():
            if isinstance(module, H3Attention):
                module.heads, module.inner = module.heads // ctx.tp, module.inner // ctx.tp
            elif isinstance(module, SwiGLU):
                module.ffn //= ctx.tp
            elif isinstance(module, DiTBlock):
                module.adaln_proj.gather_outputs(ctx.tp_group, ctx.stats)
        parallelize(self, linear_plan(self.config), ctx.tp_mesh, stats=ctx.stats)
        self.tensor_parallel = ctx

    def _block_attention(self) -> PackedAttention:
        """The blocks' attention: :attr:`attention` itself, or under Ulysses the same backend (and sparse
        planner) behind the all-to-all."""
        sp = self.sequence_parallel
        if sp is None:
            return self.attention
        wrapped = PackedAttention(UlyssesAttention(self.attention.fn, sp))
        wrapped.planner, wrapped.layers = self.attention.planner, self.attention.layers
        return wrapped

    # ------------------------------------------------------------------ per request / per batch
    def time_embed(self, unique_timesteps: torch.Tensor) -> torch.Tensor:
        """``[M]`` timesteps in [0, 1] -> ``t_emb [M, time_embed_dim]``."""
        return self.time_embedder(unique_timesteps)

    @torch.no_grad()
    def schedule_embeddings(self, unique_per_step: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``t_emb`` of every step of a schedule, computed up front (pass step ``k``'s as ``time_embedding=``);
        each step is embedded on its own, exactly as the AdaLN schedule cache does, so results match it bitwise."""
        return [self.time_embed(u) for u in unique_per_step]

    @torch.no_grad()
    def prepare_request(self, layout: RequestLayout, prompt_embeds: torch.Tensor) -> RequestPlan:
        """RoPE table and refined text rows of one request (positions and text do not change across steps)."""
        if prompt_embeds.dim() == 3 and prompt_embeds.shape[0] == 1:
            prompt_embeds = prompt_embeds[0]
        c = self.config
        if prompt_embeds.dim() != 2 or prompt_embeds.shape[1] != c.text_dim:
            raise ValueError(f"prompt_embeds must be [L, {c.text_dim}], got {tuple(prompt_embeds.shape)}")
        if prompt_embeds.shape[0] != layout.num_text_rows:
            raise ValueError(f"prompt_embeds has {prompt_embeds.shape[0]} rows but the layout has "
                             f"{layout.num_text_rows} text rows")
        device, dtype = self.device, self.compute_dtype
        w = self.condition_proj.weight
        text = self.condition_proj(prompt_embeds.to(device=device, dtype=w.dtype))
        if text.shape[0]:
            docs = Documents([0, text.shape[0]], device)
            with lora_packed_rows([text.shape[0]], text.shape[0]):  # one request's rows (its LoRA: sample_rows)
                text = self.token_refiner(text, docs, self.attention, self.ops)
        positions = torch.zeros(layout.seq_len, 3, dtype=torch.float64)
        positions[: layout.used] = layout.position_ids
        cos, sin = self.rope.table(positions.to(device), dtype)
        return RequestPlan(layout=layout, text=text.to(dtype), cos=cos, sin=sin, tags=_pad_tags(layout).to(device),
                           device=device)

    def pack(self, plans: Sequence[RequestPlan]) -> BatchPlan:
        return BatchPlan.pack(plans)

    # ------------------------------------------------------------------ forward
    def _check(self, batch: BatchPlan, video: torch.Tensor, audio: torch.Tensor,
               inverse_indices: torch.Tensor) -> None:
        c = self.config
        nv, na = sum(batch.video_rows), sum(batch.audio_rows)
        if video.dim() != 2 or tuple(video.shape) != (nv, c.video_patch_dim):
            raise ValueError(f"video rows must be [{nv}, {c.video_patch_dim}], got {tuple(video.shape)}")
        if audio.dim() != 2 or tuple(audio.shape) != (na, c.audio_in_channels):
            raise ValueError(f"audio rows must be [{na}, {c.audio_in_channels}], got {tuple(audio.shape)}")
        if inverse_indices.shape != (batch.total,):
            raise ValueError(f"inverse_indices must be [{batch.total}], got {tuple(inverse_indices.shape)}")

    def step_embedding(self, unique_timesteps: torch.Tensor, *, time_embedding: torch.Tensor | None = None,
                       adaln_step_index: Any = ABSENT) -> torch.Tensor:
        """``t_emb`` of a step: the prepared AdaLN schedule's (cursor moved to the step), else
        ``time_embedding`` if given, else :meth:`time_embed` of ``unique_timesteps``."""
        t_emb = self.adaln.select(adaln_step_index)
        if t_emb is None:
            t_emb = time_embedding if time_embedding is not None else self.time_embed(unique_timesteps)
        return t_emb

    def embed(self, batch: BatchPlan, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """The packed input ``[T, H]``: refined text, projected video and audio rows, zero padding rows."""
        x = batch.text.new_zeros(batch.total, self.config.hidden_size)
        x.index_copy_(0, batch.text_index, batch.text)
        wv, wa = self.video_patch_proj.weight, self.audio_patch_proj.weight
        x.index_copy_(0, batch.video_index, self.video_patch_proj(video.to(wv.dtype)).to(x.dtype))
        x.index_copy_(0, batch.audio_index, self.audio_patch_proj(audio.to(wa.dtype)).to(x.dtype))
        return x

    @torch.no_grad()
    def modulated_input(self, batch: BatchPlan, video: torch.Tensor, audio: torch.Tensor,
                        unique_timesteps: torch.Tensor, inverse_indices: torch.Tensor, *,
                        time_embedding: torch.Tensor | None = None, adaln_step_index: Any = ABSENT,
                        direct: bool = False) -> torch.Tensor:
        """The first block's modulated input ``[T, H]`` (what TeaCache compares between steps), computed as the
        forward computes it.

        ``direct``: ignore the AdaLN schedule cache (``adaln_step_index`` unused) and compute block 0's
        projection from its weights, restoring them if a schedule offloaded them; for a probe that runs before
        this batch's schedule is prepared, while another schedule's tables may still be installed.
        """
        self._check(batch, video, audio, inverse_indices)
        if direct:
            t_emb = time_embedding if time_embedding is not None else self.time_embed(unique_timesteps)
        else:
            t_emb = self.step_embedding(unique_timesteps, time_embedding=time_embedding,
                                        adaln_step_index=adaln_step_index)
        block = cast(DiTBlock, self.blocks[0])
        return block.modulated_input(self.embed(batch, video, audio), t_emb,
                                     inverse_indices * MODALITY_NUM + batch.tags, self.ops, direct=direct)

    def forward(self, batch: BatchPlan, video: torch.Tensor, audio: torch.Tensor, unique_timesteps: torch.Tensor,
                inverse_indices: torch.Tensor, *, time_embedding: torch.Tensor | None = None,
                adaln_step_index: Any = ABSENT, block_residual: torch.Tensor | None = None,
                residual_out: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocity rows ``(video [ΣNv, 96], audio [ΣNa, 32])`` for the packed batch (see the package docstring).

        ``time_embedding``: ``time_embed(unique_timesteps)`` computed earlier (e.g. for the whole schedule at
        once); ``adaln_step_index``: the step of a prepared AdaLN schedule (then neither is recomputed).

        TeaCache's block-residual reuse: ``residual_out`` (a dict) receives ``"block_residual"``, the ``[T, H]``
        the blocks added (their output minus the embedded input); ``block_residual`` given instead of running the
        blocks adds such a residual to this step's embedded input, then runs the final layer at this step's
        timesteps.
        """
        self._check(batch, video, audio, inverse_indices)
        t_emb = self.step_embedding(unique_timesteps, time_embedding=time_embedding,
                                    adaln_step_index=adaln_step_index)
        x = self.embed(batch, video, audio)
        if block_residual is not None:
            if tuple(block_residual.shape) != tuple(x.shape):
                raise ValueError(f"block_residual must be [{x.shape[0]}, {x.shape[1]}] (this batch's packed rows), "
                                 f"got {tuple(block_residual.shape)}")
            x = x + block_residual.to(x.dtype)
        else:
            x_in = x
            rows = inverse_indices * MODALITY_NUM + batch.tags
            rope = (batch.cos, batch.sin)
            sp, attention = self.sequence_parallel, self._block_attention()
            if sp is not None:  # this rank's rows only (every per-row table is gathered by row), until the heads
                shard = SequenceShard(batch.total, sp.sp_rank, sp.ulysses)
                x, rows, rope = shard.take(x), shard.take(rows), (shard.take(batch.cos), shard.take(batch.sin))
            # per-request LoRA: the blocks' linears see packed [T, H] rows (this rank's shard under Ulysses), one
            # document per output
            with lora_packed_rows(batch.offsets[1:], batch.total,
                                  window=None if sp is None else (shard.start, shard.end)):
                for block in self.blocks:
                    x = block(x, t_emb, rows, batch.docs, attention, self.ops, rope)
            if sp is not None:
                x = shard.gather(x, sp)
            if residual_out is not None:
                residual_out["block_residual"] = x - x_in

        final, ops = self.final_layer, self.ops
        v = final(x.index_select(0, batch.video_index), t_emb, inverse_indices.index_select(0, batch.video_index),
                  ops, final.video_out)
        a = final(x.index_select(0, batch.audio_index), t_emb, inverse_indices.index_select(0, batch.audio_index),
                  ops, final.audio_out)
        return v, a
