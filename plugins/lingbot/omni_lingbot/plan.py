"""The typed state ``LingBotPipeline.preprocess`` prepares for a request.

A prepared request carries a :class:`LingBotPlan` in its typed ``plan`` slot (``GenerationRequest.plan``): the
request rules' decisions (mode, CFG layout, schedule, optional stages) as one frozen, hashable record, read back
with :func:`plan_of` — no loose string keys for ``encode``/``decode`` to agree on, and the caller's ``extra`` stays
the caller's.
"""

from __future__ import annotations

from typing import Any

import attrs

from .request_rules import LowNoiseOptions, ResolvedRequest
from .stage_options import RefinerOptions, VaeTiling


@attrs.frozen
class LingBotPlan:
    """How one prepared request runs (everything but ``vae_tiling`` is part of its batch key)."""

    mode: str  # "t2i" | "t2v" | "ti2v"
    batch_cfg: bool = False  # CFG as one packed B=2N forward
    null_cond_clone_zero: bool = False  # zeros as the negative embedding
    low_noise: LowNoiseOptions = LowNoiseOptions()  # base low-noise schedule (threshold None = full grid)
    refiner: RefinerOptions | None = None  # the MoE package's refiner stage, or None
    vae_tiling: VaeTiling | None = None  # per request, not in the batch key
    batch_cfg_source: str = "request"  # who chose batch_cfg: "request" or "auto" (the platform; not in the key)

    @classmethod
    def from_resolved(cls, resolved: ResolvedRequest) -> LingBotPlan:
        return cls(mode=resolved.mode, batch_cfg=resolved.batch_cfg,
                   null_cond_clone_zero=resolved.null_cond_clone_zero, low_noise=resolved.low_noise,
                   refiner=resolved.refiner, vae_tiling=resolved.vae_tiling,
                   batch_cfg_source=resolved.batch_cfg_source)

    def batch_key(self, fps: float | None) -> tuple[Any, ...]:
        """Plans of one batch must agree on all of this; a refined clip's length depends on the base fps."""
        return (self.mode, self.batch_cfg, self.null_cond_clone_zero, self.low_noise, self.refiner,
                fps if self.refiner is not None else None)


def plan_of(request: Any) -> LingBotPlan:
    """The plan of a request prepared by ``LingBotPipeline.preprocess`` (``ValueError`` for any other request)."""
    plan: LingBotPlan = request.plan_as(LingBotPlan)
    return plan


@attrs.frozen
class Sampling:
    """A prepared request's sampling numbers, all filled (``SamplingParams`` keeps them optional)."""

    height: int
    width: int
    num_frames: int
    steps: int
    guidance_scale: float
    shift: float

    @classmethod
    def of(cls, request: Any) -> Sampling:
        p = request.params
        values = {"height": p.height, "width": p.width, "num_frames": p.num_frames, "steps": p.num_inference_steps,
                  "guidance_scale": p.guidance_scale, "shift": p.flow_shift}
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise ValueError(f"request {request.request_id} reached encode without {missing} (preprocess fills them)")
        return cls(int(values["height"]), int(values["width"]), int(values["num_frames"]), int(values["steps"]),
                   float(values["guidance_scale"]), float(values["shift"]))


def caption_of(request: Any) -> str:
    """The caption a prepared request carries as its prompt (preprocess turned any mapping into text)."""
    if not isinstance(request.prompt, str):
        raise ValueError("this request was not prepared by LingBotPipeline.preprocess (its prompt is not a caption)")
    return request.prompt
