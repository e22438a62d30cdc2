"""TeaCache for MiniMax-H3.

What the cache watches: the first block's modulated input ``rmsnorm1(x)·(1 + scale_msa) + shift_msa`` over the
packed rows, ``x`` being the assembled embeddings (refined text, projected video and audio rows).

What a reuse does — the reference's rule, for which the 0.17 threshold was calibrated: every computed step keeps
the residual the transformer blocks added (their output minus the embedded input, ``[T, H]`` over the packed
batch); a reused step embeds its current latents, adds that residual and runs only the final layer at its own
timesteps (the blocks are skipped, audio and video together). This is the core's block-residual hook
(``keep_residual`` / ``reuse_residual``); the velocity replay is the core's fallback for models without one and
is not used here. Coefficients and the 0.17 threshold are the FL2VA DiT's calibration:

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

#: ``state.extras`` keys of the block-residual reuse: the adapter sets the flag before a computed step; that
#: forward (``MiniMaxH3Pipeline.predict``) then keeps its blocks' residual, ``[T, H]`` over the packed batch
KEEP_RESIDUAL = "teacache_keep_residual"
BLOCK_RESIDUAL = "teacache_block_residual"

logger = logging.getLogger("omni_minimax_h3")

REF2VA_REFUSAL = ("TeaCache only supports the MiniMax-H3 FL2VA partition; Ref2VA TeaCache has not been "
                  "calibrated")


def modulated_input(dit: Any, state: Any, step: int) -> torch.Tensor:
    """Block 0's modulated input ``[T, H]`` for the batch in ``state`` at ``step`` (no block is run): the DiT's
    own :meth:`~omni_minimax_h3.transformer.model.MiniMaxH3DiT.modulated_input`, so exactly what the forward
    feeds block 0's attention (norm weight folded into the scale, same embedding path)."""
    ex = state.extras
    batch, ts = ex["batch"], ex["steps"][step]
    video, audio = state.latents
    cache = dit.adaln.cache
    if cache is not None and cache.key == ex.get("adaln_key"):  # the table path, at this step
        return dit.modulated_input(batch, video, audio, ts.unique_timesteps, ts.inverse_indices,
                                   adaln_step_index=step)
    t_embs = ex.get("t_embs")
    return dit.modulated_input(batch, video, audio, ts.unique_timesteps, ts.inverse_indices, direct=True,
                               time_embedding=None if t_embs is None else t_embs[step])


def make_adapter(pipeline: Any) -> Any:
    """The pipeline's ``TeaCacheAdapter`` (raises ``ValueError`` on a Ref2VA-only deployment)."""
    from omnicore.plugin import TeaCacheAdapter

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
        from omnicore.plugin import materialize

        dit = pipeline.transformers["fl2va"]
        materialize(dit)  # the probe runs DiT modules outside forward (model offload releases them after it)
        with torch.no_grad():
            return modulated_input(dit, state, step)

    def keep_residual(state: Any, step: int) -> None:
        if state.extras["partition"] != "ref2va":  # Ref2VA batches never reuse: keep nothing for them
            state.extras[KEEP_RESIDUAL] = True

    def reuse_residual(state: Any, step: int) -> Any:
        return pipeline.predict_from_block_residual(state, step)

    return TeaCacheAdapter(extract=extract, coefficients=TEACACHE_COEFFICIENTS, default_threshold=TEACACHE_THRESHOLD,
                           keep_residual=keep_residual, reuse_residual=reuse_residual)
