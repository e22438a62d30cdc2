"""The pipeline protocol every model plugin implements and the state it threads through steps.

The engine calls, per batch: ``encode(requests)`` once (on requests already prepared by ``preprocess``),
then for each step the ``omnicore_denoise`` hook (whose default runs ``denoise_step`` =
``update(predict(...))``), then ``decode(state)``. Splitting a step into ``predict`` (the model evaluation,
incl. CFG) and ``update`` (the sampler) lets step caches reuse a prediction without knowing the sampler.
``decode`` returns the outputs in request order, ``num_outputs`` each; the engine fills ``request_id``,
``index``, ``seed`` and ``metrics`` where the pipeline left them unset.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from ..specs import AttentionRequirement, dtype_name

if TYPE_CHECKING:
    import torch

    from ..outputs.output import Output
    from ..parallel.context import ParallelContext
    from ..platforms.base import Platform
    from ..specs import ModelSpec
    from .request import GenerationRequest

#: the host's attention selector: a requirement in, the chosen backend's attention function out
AttentionSelector = Callable[[AttentionRequirement], Callable[..., "torch.Tensor"]]


def _vae_precision(value: object) -> str | None:
    from .model_options import check_vae_decode_precision

    return check_vae_decode_precision(value)


@attrs.define
class LoadOptions:
    """How to load a pipeline. ``attention`` picks a backend per requirement (the host's selector).

    ``model_options`` holds the model's declared deployment options (every one present, defaults filled,
    values checked by the engine). ``vae_decode_precision`` is ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``None``
    (the model's own choice) for models whose VAE decode can run in another precision than the DiT.
    """

    platform: Platform
    dtype: torch.dtype | None = None  # None = the platform's default (see torch_dtype())
    attention: AttentionSelector | None = None  # None: built outside the engine, the model's own attention
    offload: str = "none"  # "none" | "model" | "layerwise"
    model_options: Mapping[str, Any] = attrs.field(factory=dict)
    vae_decode_precision: str | None = attrs.field(default=None, converter=_vae_precision)
    # this rank's context when the engine runs over a worker group (``--parallel``); None in a single-process
    # engine. Models use it only for the dimensions their spec declares (parallel=...).
    parallel: ParallelContext | None = None

    def torch_dtype(self) -> torch.dtype:
        """The dtype to load in: ``dtype``, else the platform's default (every loader made this choice itself)."""
        return self.dtype if self.dtype is not None else self.platform.default_dtype()

    def device(self) -> torch.device:
        """The device this process loads onto (the platform's first device)."""
        device: torch.device = self.platform.device()
        return device

    def attention_requirement(self, dtype: torch.dtype | str, head_dim: int, **needs: bool) -> AttentionRequirement:
        """What one attention call site needs, on this platform: ``dtype`` (a torch dtype or its name),
        ``head_dim`` and the capability flags of :class:`AttentionRequirement` (``packed_varlen=True`` ...)."""
        return AttentionRequirement(platform=self.platform.name, dtype=dtype_name(dtype), head_dim=head_dim,
                                    **needs)

    def select_attention(self, dtype: torch.dtype | str, head_dim: int,
                         **needs: bool) -> Callable[..., torch.Tensor] | None:
        """The attention function the host selects for that call site, or ``None`` when these options carry no
        selector (the model then uses its own attention). An unmet requirement raises ``UnsupportedFeature``."""
        if self.attention is None:
            return None
        return self.attention(self.attention_requirement(dtype, head_dim, **needs))


@attrs.define(eq=False)
class DenoiseState:
    """Mutable per-batch state. Models keep their own tensors in ``latents`` and ``extras``.

    ``outputs_per_request`` lists how many outputs each request contributes (so seeds are ``seed + i``).
    """

    requests: list[GenerationRequest]
    num_steps: int
    latents: Any = None
    timesteps: Any = None
    extras: dict[str, Any] = attrs.Factory(dict)
    step_index: int = 0
    last_prediction: Any = None
    # steps a cache method reused (outputs' cache_reused_steps); None: a cache that cannot tell (reported as None)
    reused_steps: list[int] | None = attrs.Factory(list)


@runtime_checkable
class Pipeline(Protocol):
    """What the engine needs from a model plugin's pipeline class."""

    spec: ModelSpec

    @classmethod
    def from_pretrained(cls, path: Path, options: LoadOptions) -> Pipeline: ...

    def preprocess(self, request: GenerationRequest) -> GenerationRequest: ...

    def batch_key(self, request: GenerationRequest) -> Hashable: ...

    def encode(self, requests: Sequence[GenerationRequest]) -> DenoiseState: ...

    def predict(self, state: DenoiseState, step: int) -> Any: ...

    def update(self, state: DenoiseState, step: int, prediction: Any) -> DenoiseState: ...

    def denoise_step(self, state: DenoiseState, step: int) -> DenoiseState: ...

    def decode(self, state: DenoiseState) -> list[Output]: ...

    def select_requests(self, state: DenoiseState, keep: Sequence[int]) -> DenoiseState | None: ...


def output_seeds(request: GenerationRequest) -> list[int]:
    """Seeds of a request's outputs: ``seed + i`` (the engine fills an unset seed before preprocess)."""
    seed = request.params.seed
    if seed is None:
        raise ValueError(f"request {request.request_id} reached the pipeline without a seed")
    return [seed + i for i in range(request.params.num_outputs)]


class BasePipeline:
    """Convenience base: the step composition and the default batch key; subclasses do the model work."""

    spec: ModelSpec

    def batch_key(self, request: GenerationRequest) -> Hashable:
        return request.batch_key()

    def denoise_step(self, state: DenoiseState, step: int) -> DenoiseState:
        prediction = self.predict(state, step)
        state.last_prediction = prediction
        return self.update(state, step, prediction)

    def batch_requests(self, requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
        """The checks every ``encode`` starts with: a non-empty batch of preprocessed requests sharing a batch key."""
        reqs = list(requests)
        if not reqs:
            raise ValueError("encode() needs at least one request")
        if not all(r.prepared for r in reqs):
            raise ValueError("encode() takes preprocessed requests (call preprocess() first)")
        if len({self.batch_key(r) for r in reqs}) != 1:
            raise ValueError("requests in one batch must share a batch key")
        return reqs

    def select_requests(self, state: DenoiseState, keep: Sequence[int]) -> DenoiseState | None:
        """Shrink a running batch to the requests at indices ``keep`` (others were cancelled).

        Return ``None`` when the state cannot be shrunk: the engine then finishes the batch and discards the
        cancelled requests' outputs (they are reported cancelled at once all the same).
        """
        return None

    def predict(self, state: DenoiseState, step: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement predict()")

    def update(self, state: DenoiseState, step: int, prediction: Any) -> DenoiseState:  # pragma: no cover
        raise NotImplementedError(f"{type(self).__name__} must implement update()")
