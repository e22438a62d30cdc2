"""Our serving DiT for MiniMax-H3: interface of record for the rest of the plugin.

Names are exported lazily (module ``__getattr__``), so ``omni_minimax_h3.transformer.config`` and this package
import without torch.

Config
------
``MiniMaxH3TransformerConfig`` (``.config``, torch-free, attrs, frozen): the keys of diffusers'
``MiniMaxH3Transformer3DModel`` ``config.json`` exactly — ``num_attention_heads, attention_head_dim, hidden_size,
num_layers, num_refiner_layers, ffn_dim, in_channels, audio_in_channels, patch_size, text_dim, freq_dim,
time_embed_hidden_dim, time_embed_dim, rope_freq_dim, rope_theta, norm_eps, qk_norm_eps, final_norm_eps``;
``from_dict`` (also accepts the official partition's names), ``to_dict``, ``tiny()``, derived
``inner_dim``, ``rotary_dim`` (= 6·rope_freq_dim), ``video_patch_dim`` (= 96).

Model
-----
``MiniMaxH3DiT(config, *, attention=None, ops=None)`` (``.model``, an ``nn.Module``)
    ``attention``: the packed backend returned by ``options.attention(AttentionRequirement(packed_varlen=True,
    packed_mask_free=True, ...))`` (reference SDPA when None); ``ops``: ``options.platform.ops`` (the eager reference
    ops when None). Built by :func:`omni_minimax_h3.loader.load_transformer`; never call diffusers from here.

Per request (branch), once — ``RequestLayout`` (``.layout``) is what the pipeline packs::

    layout = RequestLayout.build(position_ids, token_tags, video_indices, audio_indices, text_indices,
                                 num_condition_video_rows=0, num_condition_audio_rows=0, seq_align=64)
        # position_ids [used, 3] float64 (t, h, w); token_tags [used] int (0 video, 1 text incl. presentation
        # tags, 2 audio); *_indices int64 row positions that partition [0, used) — exactly what diffusers'
        # MiniMaxH3PrepareLayoutStep.build_packed_sequence / build_ref2va_packed_sequence return (video rows:
        # conditioning/reference rows first, audio rows: reference rows first). The packed document is padded to a
        # multiple of ``seq_align`` rows ([real | pad], pad rows attend nowhere real and are never read back):
        # 64 (the release's MINIMAX_H3_SEQ_ALIGN) gives accelerator kernels static shapes; on a CPU device use
        # seq_align=1 — padding rows there cost GEMM work and buy nothing (results are identical either way).
    layout = layout.with_latent_grid((frames, h, w))       # optional: the generated video's token grid, published
        # as AttentionMetadata.latent_grid for attention planners (checked to be the last real rows)
    plan = dit.prepare_request(layout, prompt_embeds)      # prompt_embeds [L, text_dim] (L = len(text_indices))
        # -> RequestPlan: RoPE cos/sin table and the token-refined text rows (refiner runs here, not per step)

Per batch composition (cheap; reuse while the set of requests in the step batch is unchanged)::

    batch = dit.pack([plan_0, plan_1, ...])                # -> BatchPlan: requests end to end, each [real | pad]
    batch.video_rows / batch.audio_rows                    # tuple of per-request row counts
    batch.split_video(t) / batch.split_audio(t)            # packed rows -> per-request tensors

Per step::

    ts = batch.step_timesteps(t_video, t_audio, condition_video=0.999, condition_audio=1.0)
        # t_video / t_audio: one float per request (t = 1 - sigma, in [0, 1]); conditioning video rows get
        # max(t_video, condition_video), reference audio rows max(t_audio, condition_audio); text and pad rows get
        # t_video. Host-side -> omnicore.cache.adaln_schedule.StepTimesteps(unique_timesteps [M] float32 on the
        # model device, timestep_bits, inverse_indices [batch.total] int64 on the device); bit-identical to
        # torch.unique(sorted, return_inverse) over the per-row timesteps. Its list over steps is the
        # ``adaln_schedule_plan``: ([s.unique_timesteps ...], schedule_key(steps)).
    video_v, audio_v = dit(batch, video, audio, ts.unique_timesteps, ts.inverse_indices,
                           adaln_step_index=ABSENT)
        # video [Σ Nv_i, 96] / audio [Σ Na_i, 32]: each request's rows in its video_indices / audio_indices order,
        # requests in pack order. Returns the velocity rows in the same order (v points to data:
        # x0 = x_t + (1 - t) v), conditioning/reference rows included and unmasked (as diffusers); float32.

TeaCache: ``dit.modulated_input(batch, video, audio, unique_timesteps, inverse_indices, adaln_step_index=...)``
is the first block's modulated input ``[T, H]`` (what the cache compares; ``direct=True`` bypasses another
schedule's installed AdaLN tables). ``dit(..., residual_out={})`` also returns the blocks' residual
(``out["block_residual"]``, output minus embedded input, ``[T, H]``); ``dit(..., block_residual=r)`` skips the
blocks and runs the final layer on this step's embedded input plus ``r`` (the reference TeaCache's reuse).
Pieces of the forward are public:
``dit.step_embedding(unique_timesteps, adaln_step_index=...)`` -> ``t_emb``, ``dit.embed(batch, video, audio)``.

Time embeddings for a whole schedule up front: ``dit.schedule_embeddings([s.unique_timesteps for s in steps])``
-> per-step ``t_emb`` for ``time_embedding=`` (bitwise what the AdaLN schedule cache would hold).

AdaLN: every block owns ``adaln_proj`` (``AdaLNProjection``, expand 6, modality 3) and the final layer one
(expand 2, modality 1); ``dit.adaln`` is the ``AdaLNScheduleController``; ``dit.time_embed(unique_timesteps)``
maps timesteps to ``t_emb``. ``dit.blocks`` is the block list for ``BlockLoop``.

Loader (``omni_minimax_h3.loader``)
------------------------------------
``detect_transformer_format(model_dir) -> "diffusers" | "official"``,
``read_transformer_config(model_dir) -> MiniMaxH3TransformerConfig``,
``load_transformer(model_dir, *, device="cpu", dtype=torch.float32, attention=None, ops=None) -> MiniMaxH3DiT``
(either layout, strict: missing / unexpected / mis-shaped keys are named in ``WeightMismatch``),
``diffusers_to_ours(state, config)``, ``official_to_ours(state, config)``, ``ours_to_diffusers(state, config)``,
``ours_to_official(state, config)`` (pure state-dict transforms), ``save_transformer(dit, model_dir,
format="diffusers" | "official")``.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "MiniMaxH3TransformerConfig": "config",
    "MiniMaxH3DiT": "model",
    "RequestLayout": "layout",
    "RequestPlan": "metadata",
    "BatchPlan": "metadata",
}

__all__ = ["BatchPlan", "MiniMaxH3DiT", "MiniMaxH3TransformerConfig", "RequestLayout", "RequestPlan"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module}"), name)
