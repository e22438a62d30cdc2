"""TeaCache for MiniMax-H3 (models.md §1.9, seed-contracts §2.1–§2.2).

What the cache watches: the first block's modulated input ``rmsnorm1(x)·(1 + scale_msa) + shift_msa`` over the
packed rows, ``x`` being the assembled embeddings (refined text, projected video and audio rows). A reuse skips
the whole DiT forward (audio and video are coupled in it) and re-applies the previous velocity through the Euler
update. Coefficients and the 0.17 threshold are the FL2VA DiT's calibration:

- a Ref2VA-only deployment refuses TeaCache (``ValueError`` -> the engine reports it and enables nothing);
- a combined deployment enables it and runs Ref2VA batches uncached (a warning at enable time and one info line
  per Ref2VA batch): their probe signal is all zeros, whose relative change is infinite, so no threshold is ever
  met and every step computes.

With the exact-schedule AdaLN cache enabled too, the probe reads block 0's modulation from the installed table of
this batch's schedule (bit-identical to the projection); before that table exists it computes the projection
directly (restoring block 0's weights if an older schedule had offloaded them). Both caches are exact about
their own part: TeaCache decides from the same modulated input either way.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .plugin import TEACACHE_COEFFICIENTS, TEACACHE_THRESHOLD

logger = logging.getLogger("omni_minimax_h3")

REF2VA_REFUSAL = ("TeaCache only supports the MiniMax-H3 FL2VA partition; Ref2VA TeaCache has not been "
                  "calibrated")


def modulated_input(dit: Any, state: Any, step: int) -> torch.Tensor:
    """Block 0's modulated input ``[T, H]`` for the batch in ``state`` at ``step`` (no block is run)."""
    from .transformer.config import MODALITY_NUM

    ex = state.extras
    batch, ts = ex["batch"], ex["steps"][step]
    video, audio = state.latents
    c, dtype = dit.config, dit.compute_dtype
    x = batch.text.new_zeros(batch.total, c.hidden_size)
    x.index_copy_(0, batch.text_index, batch.text)
    wv, wa = dit.video_patch_proj.weight, dit.audio_patch_proj.weight
    x.index_copy_(0, batch.video_index, dit.video_patch_proj(video.to(wv.dtype)).to(dtype))
    x.index_copy_(0, batch.audio_index, dit.audio_patch_proj(audio.to(wa.dtype)).to(dtype))
    rows = ts.inverse_indices * MODALITY_NUM + batch.tags
    block = dit.blocks[0]
    proj = block.adaln_proj
    cache = dit.adaln.cache
    if cache is not None and cache.key == ex.get("adaln_key"):
        t_emb = dit.adaln.select(step)  # the table path, at this step
        chunks = proj(t_emb)
    else:
        proj.restore()  # no-op unless an older schedule offloaded it
        t_emb = dit.time_embed(ts.unique_timesteps)
        chunks = proj.compute_flat(t_emb).chunk(proj.expand_ratio, dim=-1)
    shift, scale = chunks[0].index_select(0, rows), chunks[1].index_select(0, rows)
    return dit.ops.modulate(block.norm1(x, dit.ops), shift, scale)


def make_adapter(pipeline: Any) -> Any:
    """The pipeline's ``TeaCacheAdapter`` (raises ``ValueError`` on a Ref2VA-only deployment)."""
    from omnicore.cache.teacache import TeaCacheAdapter

    partition = pipeline.partition
    if partition == "ref2va":
        raise ValueError(REF2VA_REFUSAL)
    if partition not in ("fl2va", "combined"):
        raise ValueError(f"Unsupported MiniMax-H3 partition for TeaCache: {partition}")
    if partition == "combined":
        logger.warning("TeaCache is calibrated for the FL2VA DiT only: Ref2VA requests on this deployment run "
                       "without TeaCache")

    def extract(state: Any, step: int) -> torch.Tensor:
        if state.extras["partition"] == "ref2va":
            if step == 0:
                logger.info("MiniMax-H3: this Ref2VA batch runs without TeaCache (not calibrated for Ref2VA)")
            # an all-zero signal: its relative L1 change is infinite (0 / 0 -> inf), so the rescaled change is
            # inf/nan and never below any threshold -> every step computes
            return torch.zeros(1)
        from omnicore.offload import materialize

        dit = pipeline.transformers["fl2va"]
        materialize(dit)  # the probe runs DiT modules outside forward (model offload releases them after it)
        with torch.no_grad():
            return modulated_input(dit, state, step)

    return TeaCacheAdapter(extract=extract, coefficients=TEACACHE_COEFFICIENTS, default_threshold=TEACACHE_THRESHOLD)
