"""Warm-up at start-up (``--warmup``, ``Engine(warmup=True)``): one short generation before the engine serves.

The first request of a process pays one-time costs — with ``--compile`` the compilation of every block for its
shape (seconds to minutes), and otherwise lazy imports, allocator growth and kernel selection. A warm-up request at
the model's own default size and duration takes them at start-up, so the first user request runs at steady-state
speed (a server reports ready only after it). One denoise step is enough: the shapes are those of every step.

The request is the model's default text-to-X request (its first ``t2*`` mode, the output kind that mode makes),
with the per-request fields the model declares required for that mode filled from their declared examples
(MiniMax-H3's ``aspect_ratio``). A deployment that serves only conditioned modes has no such request: warm-up is
refused with the reason rather than guessing media.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UnsupportedFeature
from .request import GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from ..specs import ModelSpec

WARMUP_PROMPT = "warm-up"


def _text_mode(spec: ModelSpec, modes: tuple[str, ...] | None) -> str:
    served = tuple(modes) if modes else tuple(spec.capabilities.modes)
    mode = next((m for m in served if m.startswith("t2")), None)
    if mode is None:
        raise UnsupportedFeature("warmup", f"model {spec.name!r} serves only conditioned modes here "
                                           f"({', '.join(served)}), so there is no default request to warm up with")
    return mode


def warmup_request(spec: ModelSpec, modes: tuple[str, ...] | None = None) -> GenerationRequest:
    """The default request of ``spec``'s first text-to-X mode, one denoise step, a fixed seed."""
    mode = _text_mode(spec, modes)
    extra = {f.name: (f.example if f.example is not None else (f.choices or (None,))[0])
             for f in getattr(spec, "request_fields", ()) if mode in getattr(f, "required_for", ())}
    output_type = "image" if mode.endswith("i") else "video"
    return GenerationRequest(prompt=WARMUP_PROMPT, extra={k: v for k, v in extra.items() if v is not None},
                             params=SamplingParams(num_inference_steps=1, seed=0, output_type=output_type))
