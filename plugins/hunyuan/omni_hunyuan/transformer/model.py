"""``HunyuanImage3``: the unified MoE language model with its image heads, VAE and vision tower.

A denoise forward embeds the token rows, scatters the generated image's patch tokens and ``<timestep>``
embedding (and, for edits, each condition image's VAE tokens, zero-timestep embeddings and aligned ViT
features), runs the decoder over positions ``[start, gen_end)`` against the cached K/V of ``[0, start)``, and
turns the image tokens' last hidden states into the velocity with the final layer (no ``ln_f``).

Prompt-KV reuse: the prefix (everything before the generated image's ``<timestep>``) never attends to the image,
so its K/V is the same at every step. Step 0 runs from position 0 and keeps the prefix K/V per CFG row; later
steps run only ``[<timestep>, <img>*N]``. Tokens after the image (``<eoi>``, closing text) are never attended by
the image and are skipped; :meth:`HunyuanImage3.full_forward` computes the whole sequence as the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from ..vae import AutoencoderKLConv3D
from .attention import SpanAttention
from .blocks import DecoderLayer, LightProjector, RMSNorm, TimestepEmbedder, UNetDown, UNetUp
from .config import HunyuanConfig
from .layout import SequenceLayout
from .rope import rope_table


@attrs.define
class PrefixKV:
    """Per-layer ``(k, v)`` buffers ``[R, capacity, Hkv, D]`` (one row per CFG row) whose first ``length``
    positions hold the cached prefix; later positions are scratch space the next forward writes in place."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    length: int

    def row(self, index: int) -> PrefixKV:
        return PrefixKV([(k[index:index + 1], v[index:index + 1]) for k, v in self.layers], self.length)


@attrs.define
class CondFeatures:
    """Condition-image inputs of one request: normalised VAE latents ``[C, h, w]`` and aligned ViT tokens
    ``[N_vit, H]`` per image."""

    latents: list[torch.Tensor]
    vit: list[torch.Tensor]


class LanguageModel(nn.Module):
    def __init__(self, config: HunyuanConfig, attend: SpanAttention) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i, attend) for i in range(config.num_hidden_layers)])
        self.ln_f = RMSNorm(config.hidden_size, config.rms_norm_eps)  # text logits only; unused by diffusion


def build_vision_model(config: dict[str, Any]) -> nn.Module:
    """The SigLIP2 vision transformer from transformers (the checkpoint's ``vision_model.*`` names)."""
    from transformers import Siglip2VisionConfig, Siglip2VisionModel

    fields = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures",)}
    fields["vision_use_head"] = False
    cfg = Siglip2VisionConfig(**fields)
    cfg._attn_implementation = "sdpa"
    model = Siglip2VisionModel(cfg)
    # transformers 4.x nests the transformer under .vision_model; 5.x holds its parts directly
    return getattr(model, "vision_model", model)


def build_sharded(config: HunyuanConfig, attention_backend: Any, tp: tuple[int, int] | None,
                  ep: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> HunyuanImage3:
    """A model whose tensor-parallel linears and experts have this rank's shapes (``tp = (rank, degree)``) and
    that holds only its routed experts (``ep = (rank, degree)``), with no full-size weights ever allocated: built
    on the meta device, narrowed (:func:`omnicore.plugin.shard_module`, ``StackedExperts.keep_experts``), then
    given empty CPU storage for :func:`.loader.load_state` to fill (every parameter comes from the checkpoint; the
    model holds no buffers, which ``to_empty`` could not restore — checked). ``dtype``: the storage's dtype (the
    load dtype, so a bf16 load never holds its shard in float32 on the host; the checkpoint's tensors are cast as
    they are copied in); ``None`` keeps the float32 the model is built in."""
    from omnicore.plugin import ConfigError

    model = build_sharded_meta(config, attention_backend, tp, ep)
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise ConfigError("parallel", f"cannot build a sharded model holding buffers ({buffers[0]})")
    if dtype is not None:
        model = model.to(dtype=dtype)  # on the meta device: no storage yet, so no copy
    return model.to_empty(device="cpu")


def build_sharded_meta(config: HunyuanConfig, attention_backend: Any, tp: tuple[int, int] | None,
                       ep: tuple[int, int] | None = None) -> HunyuanImage3:
    """:func:`build_sharded`'s model before it gets storage: on the meta device with this rank's shapes (a
    degree the plan or the expert count refuses is a ConfigError). ``omnicore plan`` sizes a rank from it."""
    from omnicore.plugin import shard_module

    from .blocks import StackedExperts
    from .tensor_parallel import module_plan

    plan = module_plan(config)
    if tp is not None:
        plan.check(tp[1])
    if ep is not None:
        check_experts(config, ep[1])
    with torch.device("meta"):
        model = HunyuanImage3(config, attention_backend=attention_backend)
    if tp is not None:
        shard_module(model, plan, rank=tp[0], degree=tp[1])
    if ep is not None:
        per = config.num_experts // ep[1]
        for module in model.modules():
            if isinstance(module, StackedExperts):
                module.keep_experts(ep[0] * per, per)
    return model


def check_experts(config: HunyuanConfig, degree: int) -> None:
    """Refuse an expert-parallel degree that does not divide the routed experts (a ConfigError naming both)."""
    from omnicore.plugin import ConfigError

    if config.num_experts % degree:
        raise ConfigError("parallel", f"ep={degree} must divide the model's routed experts ({config.num_experts}); "
                                      f"choose a degree among the divisors of {config.num_experts}")


class HunyuanImage3(nn.Module):
    def __init__(self, config: HunyuanConfig, attention_backend: Any = None) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.attend = SpanAttention(attention_backend)
        self.model = LanguageModel(config, self.attend)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.timestep_emb = TimestepEmbedder(h)
        self.time_embed = TimestepEmbedder(h)
        self.time_embed_2 = TimestepEmbedder(h)
        if config.cfg_distilled:
            self.guidance_emb = TimestepEmbedder(h)
        if config.use_meanflow:
            self.timestep_r_emb = TimestepEmbedder(h)
        self.patch_embed = UNetDown(config.latent_channels, h, config.patch_embed_hidden_dim, h)
        self.final_layer = UNetUp(h, h, config.patch_embed_hidden_dim, config.latent_channels)
        self.vae = AutoencoderKLConv3D(config.vae)
        if config.has_vision:
            self.vision_model = build_vision_model(config.vit)  # type: ignore[arg-type]
            self.vision_aligner = LightProjector(config.vit_aligner)  # type: ignore[arg-type]

    #: this rank's omnicore.parallel.ParallelContext when the language model is split (enable_tensor_parallel)
    tensor_parallel: Any = None
    #: this rank's omnicore.parallel.ParallelContext when the experts are partitioned (enable_expert_parallel)
    expert_parallel: Any = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.wte.weight.dtype

    def enable_tensor_parallel(self, ctx: Any) -> None:
        """Split attention, the MLPs and the routed experts over ``ctx.tp`` ranks (:mod:`.tensor_parallel`'s plan;
        a head or MLP width the degree does not divide is a ConfigError naming them). The attention and MLP
        linears run through DTensor's Colwise/RowwiseParallel; each MoE layer's experts add their partial sums
        with one all-reduce (the router is replicated, so every rank routes every token alike)."""
        from omnicore.plugin import all_reduce_sum, parallelize, shard_module

        from .blocks import Attention, StackedExperts
        from .tensor_parallel import module_plan

        plan = module_plan(self.config)
        plan.check(ctx.tp)
        shard_module(self, plan, rank=ctx.tp_rank, degree=ctx.tp)
        for module in self.modules():
            if isinstance(module, Attention):
                module.heads, module.kv_heads = module.heads // ctx.tp, module.kv_heads // ctx.tp
            elif isinstance(module, StackedExperts):
                def reduce(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
                    return all_reduce_sum(output, ctx.tp_group, ctx.stats)
                module.register_forward_hook(reduce)
        parallelize(self, plan, ctx.tp_mesh, stats=ctx.stats)
        self.tensor_parallel = ctx

    def enable_expert_parallel(self, ctx: Any, dispatch: str = "all_to_all") -> None:
        """Partition every MoE layer's routed experts over ``ctx.ep`` ranks (rank ``e`` keeps a contiguous
        ``1/ep`` of them; an expert count the degree does not divide is a ConfigError naming both). The router is
        replicated, so each rank sees the same top-k choice. ``dispatch="all_to_all"``: each rank sends the token
        copies of its slice of the tokens to their experts' ranks and back (``omnicore.plugin.ExpertDispatch``),
        then the slices are all-gathered; ``"all_reduce"``: each rank computes the copies routed to its experts
        for every token and one all-reduce per MoE layer adds the shares. The shared MLP runs on every rank."""
        from omnicore.plugin import ExpertDispatch, all_reduce_sum, check_dispatch

        from .blocks import StackedExperts

        check_dispatch(dispatch)
        check_experts(self.config, ctx.ep)
        per = self.config.num_experts // ctx.ep

        def reduce(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
            return all_reduce_sum(output, ctx.ep_group, ctx.stats)

        for module in self.modules():
            if isinstance(module, StackedExperts):
                if module.w_gate.shape[0] != per:  # a model loaded whole keeps its share now
                    module.keep_experts(ctx.ep_rank * per, per)
                if dispatch == "all_to_all":
                    module.dispatch = ExpertDispatch(rank=ctx.ep_rank, degree=ctx.ep, per_rank=per,
                                                     group=ctx.ep_group, stats=ctx.stats)
                else:
                    module.register_forward_hook(reduce)
        self.expert_parallel = ctx

    # ------------------------------------------------------------------------------------------ inputs
    @staticmethod
    def _put(emb: torch.Tensor, a: int, b: int, start: int, values: torch.Tensor) -> None:
        """Write ``values [R, n, H]`` (positions ``[start, start + n)``) into ``emb`` (positions ``[a, b)``)."""
        n = values.shape[1]
        lo, hi = max(a, start), min(b, start + n)
        if lo < hi:
            emb[:, lo - a: hi - a] = values[:, lo - start: hi - start].to(emb.dtype)

    def embed_range(self, layout: SequenceLayout, tokens: torch.Tensor, a: int, b: int, latents: torch.Tensor,
                    t: torch.Tensor, cond: CondFeatures | None = None, guidance: float | None = None) -> torch.Tensor:
        """Input embeddings of positions ``[a, b)`` for every row (``latents [R, C, h, w]``, ``t [R]``)."""
        emb = self.model.wte(tokens[:, a:b]).clone()
        rows = tokens.shape[0]
        dtype = self.dtype
        if b > layout.gen_start and a < layout.gen_end:
            self._put(emb, a, b, layout.gen_start, self.patch_embed(latents.to(dtype), self.time_embed(t)))
        if a <= layout.gen_timestep < b:
            emb[:, layout.gen_timestep - a] = self.timestep_emb(t).to(emb.dtype)
        if layout.guidance_pos is not None and a <= layout.guidance_pos < b:
            g = torch.full_like(t, 1000.0 * float(guidance if guidance is not None else 1.0))
            emb[:, layout.guidance_pos - a] = self.guidance_emb(g).to(emb.dtype)
        if layout.timestep_r_pos is not None and a <= layout.timestep_r_pos < b:
            emb[:, layout.timestep_r_pos - a] = self.timestep_r_emb(t).to(emb.dtype)
        zero = torch.zeros(rows, device=t.device, dtype=t.dtype)
        for i, sec in enumerate(layout.cond):
            if b <= sec.timestep or a >= sec.vit_end:
                continue
            if cond is None:
                raise ValueError("the layout has condition images but no condition features were given")
            if a <= sec.timestep < b:
                emb[:, sec.timestep - a] = self.timestep_emb(zero).to(emb.dtype)
            lat = cond.latents[i].to(dtype)[None].expand(rows, -1, -1, -1)
            self._put(emb, a, b, sec.vae_start, self.patch_embed(lat, self.time_embed(zero)))
            self._put(emb, a, b, sec.vit_start, cond.vit[i][None].expand(rows, -1, -1))
        return emb

    def rope(self, layout: SequenceLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_table(layout.positions(), self.config.attention_head_dim, self.config.rope_theta)
        return cos.to(device), sin.to(device)

    # ------------------------------------------------------------------------------------------ forwards
    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   spans: Sequence[tuple[int, int]], past: PrefixKV | None, keep: int) -> tuple[torch.Tensor, Any]:
        kept = []
        start = 0 if past is None else past.length
        for i, layer in enumerate(self.model.layers):
            hidden, kv = layer(hidden, cos, sin, spans, None if past is None else past.layers[i], start, keep)
            kept.append(kv)
        return hidden, (PrefixKV(kept, keep) if keep > 0 else None)

    def denoise(self, layout: SequenceLayout, tokens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                latents: torch.Tensor, t: torch.Tensor, past: PrefixKV | None = None,
                cond: CondFeatures | None = None, guidance: float | None = None) -> tuple[torch.Tensor, Any]:
        """Velocity ``[R, C, h, w]`` for ``latents`` at model timestep ``t`` (``sigma * 1000``).

        ``past`` holds the K/V of positions ``[0, past.length)`` (``None``: start at 0). Returns the prediction and
        the prefix K/V ``[0, prefix_len)`` when this call computed part of the prefix (else ``None``).
        """
        start = 0 if past is None else past.length
        if start > layout.prefix_len:
            raise ValueError(f"cached K/V covers {start} positions, past the prefix ({layout.prefix_len})")
        end = layout.gen_end
        emb = self.embed_range(layout, tokens, start, end, latents, t, cond, guidance)
        cos, sin = rope[0][start:end], rope[1][start:end]
        keep = layout.prefix_len if start < layout.prefix_len else 0
        hidden, kept = self.run_layers(emb, cos, sin, layout.spans, past, keep)
        image = hidden[:, layout.gen_start - start: layout.gen_end - start]
        pred = self.final_layer(image, self.time_embed_2(t), layout.gen_h, layout.gen_w)
        return pred.float(), kept

    def full_forward(self, layout: SequenceLayout, tokens: torch.Tensor, latents: torch.Tensor, t: torch.Tensor,
                     cond: CondFeatures | None = None, guidance: float | None = None) -> torch.Tensor:
        """Reference: the whole sequence (trailing tokens included), no cache."""
        cos, sin = self.rope(layout, tokens.device)
        emb = self.embed_range(layout, tokens, 0, layout.seq_len, latents, t, cond, guidance)
        hidden, _ = self.run_layers(emb, cos, sin, layout.spans, None, 0)
        image = hidden[:, layout.gen_start: layout.gen_end]
        return self.final_layer(image, self.time_embed_2(t), layout.gen_h, layout.gen_w).float()

    # ------------------------------------------------------------------------------------------ vision
    def vision_features(self, pixel_values: torch.Tensor, attention_mask: torch.Tensor,
                        spatial_shapes: torch.Tensor) -> list[torch.Tensor]:
        """Aligned ViT tokens per image: ``[h*w, H]`` (the valid patches of each padded row)."""
        if not self.config.has_vision:
            raise ValueError("this checkpoint has no vision tower (config.json lacks 'vit'/'vit_aligner')")
        out = self.vision_model(pixel_values.to(self.dtype), attention_mask, spatial_shapes)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        feats = self.vision_aligner(hidden)
        return [feats[i, : int(spatial_shapes[i, 0] * spatial_shapes[i, 1])] for i in range(feats.shape[0])]
