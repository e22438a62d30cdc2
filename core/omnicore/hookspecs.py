"""Hook specifications of omnicore (the plugin contract).

Written in pytest's ``hookspec.py`` style: grouped by phase, typed, a docstring per hook saying when it is
called, its arguments and how results combine. Heavy types are imported only for type checking, so
importing this module never imports torch.

Conventions shared by the pipeline hooks: each is ``firstresult``; the core provides a ``trylast``
default implementation, so a plugin *replaces* behaviour with a ``tryfirst`` implementation that returns a
value (or ``None`` to fall through), and *adjusts* behaviour with a ``wrapper=True`` implementation
(``result = yield`` ... ``return result``). Callers always pass every argument by keyword.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from .engine.protocol import DenoiseState, Pipeline
    from .engine.request import GenerationRequest
    from .outputs.output import Output
    from .specs import (
        AttentionBackendSpec,
        AttentionRequirement,
        CacheMethodSpec,
        ModelSpec,
        OpSpec,
        PlatformSpec,
    )

PROJECT = "omnicore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# -------------------------------------------------------------------------------------------------
# Registration hooks: called once per process, one implementation at a time, each with a ``register``
# callback bound to that plugin's name (so every record knows its provider). No wrappers.
# -------------------------------------------------------------------------------------------------


@hookspec
def omnicore_register_models(register: Callable[[ModelSpec], None]) -> None:
    """Register the model families this plugin serves.

    :param register: call ``register(ModelSpec(...))`` zero or more times. A name or alias that another
        plugin already registered is rejected with an error naming both plugins.

    Return value is ignored. Wrappers are not allowed (each implementation is called on its own).

    Use in plugins: model plugins (``omni-plugin-lingbot`` ...). The spec names its pipeline class lazily,
    so registering never imports torch.
    """


@hookspec
def omnicore_register_platforms(register: Callable[[PlatformSpec], None]) -> None:
    """Register device platforms (CPU, CUDA, NPU ...).

    :param register: call ``register(PlatformSpec(...))`` zero or more times. Only one platform is
        activated per process: the explicit choice, else the available one with the highest priority.

    Return value is ignored. Wrappers are not allowed.

    Use in plugins: hardware backend plugins. A platform whose hardware is absent still registers; its
    ``probe`` reports why it is unavailable.
    """


@hookspec
def omnicore_register_attention_backends(register: Callable[[AttentionBackendSpec], None]) -> None:
    """Register attention implementations with their declared capabilities.

    :param register: call ``register(AttentionBackendSpec(...))`` zero or more times.

    Return value is ignored. Wrappers are not allowed.

    Use in plugins: backend plugins (flash/varlen kernels) and the core (its SDPA reference).
    """


@hookspec
def omnicore_register_cache_methods(register: Callable[[CacheMethodSpec], None]) -> None:
    """Register cache / step-reuse methods (TeaCache, first-block cache, AdaLN schedule cache ...).

    :param register: call ``register(CacheMethodSpec(...))`` zero or more times. A spec lists the methods
        it conflicts with; enabling both is rejected at configuration time.

    Return value is ignored. Wrappers are not allowed.

    Use in plugins: the core (its built-in caches) and third-party acceleration plugins.
    """


@hookspec
def omnicore_register_ops(register: Callable[[OpSpec], None]) -> None:
    """Register faster implementations of the platform ops (``omnicore.ops``: RMSNorm, AdaLN modulate, RoPE ...).

    :param register: call ``register(OpSpec(name=..., platform=..., impl=..., applies=...))`` zero or more
        times. ``name`` is one of ``omnicore.ops.OP_NAMES``; ``impl`` takes the eager reference's signature;
        ``applies`` (optional, same arguments) returns whether ``impl`` handles those inputs. Several plugins may
        provide one op for a platform: they are tried by ``priority`` (highest first), then the eager reference.

    Return value is ignored. Wrappers are not allowed.

    Use in plugins: hardware backend plugins (fused Triton / vendor kernels). Models reach the ops only through
    the platform they were loaded with (``options.platform.ops.<name>(...)``) and never import a backend.
    """


# -------------------------------------------------------------------------------------------------
# Pipeline hooks: called by the engine for every request.
# -------------------------------------------------------------------------------------------------


class CacheHandle(Protocol):
    """What ``omnicore_cache`` returns: the enabled cache, undone by ``remove()``."""

    def remove(self) -> None: ...


@hookspec(firstresult=True)
def omnicore_preprocess(request: GenerationRequest, pipeline: Pipeline) -> GenerationRequest | None:
    """Prepare a request, once, at admission (before scheduling and outside engine locks).

    :param request: the validated :class:`omnicore.GenerationRequest`.
    :param pipeline: the loaded pipeline that will run it.

    Stops at the first non-``None`` result, which is the request that gets queued. The core's ``trylast``
    implementation calls ``pipeline.preprocess(request)`` (load references, resolve model defaults and
    modes). Wrappers may transform the prepared request (``prepared = yield``).

    Use in plugins: model plugins rarely need it (their pipeline's ``preprocess`` runs); request-rewriting
    or safety plugins wrap it.
    """


@hookspec(firstresult=True)
def omnicore_denoise(pipeline: Pipeline, state: DenoiseState, step: int) -> DenoiseState | None:
    """Run denoise step ``step`` of a batch and return the state to continue from.

    :param pipeline: the loaded pipeline.
    :param state: the batch's denoise state (what ``pipeline.encode`` returned, updated by earlier steps).
    :param step: zero-based step index, ``0 <= step < state.num_steps``.

    Stops at the first non-``None`` result. The core's ``trylast`` implementation calls
    ``pipeline.denoise_step(state, step)``. A cache method's ``tryfirst`` implementation may return a reused
    result to skip the model, or ``None`` to fall through (pluggy wrappers cannot skip the wrapped call).
    ``wrapper=True`` implementations time the step, report progress and check cancellation.

    Use in plugins: cache methods (``tryfirst``) and observers (wrappers). Called once per step, never per
    transformer block.
    """


@hookspec(firstresult=True)
def omnicore_cache(pipeline: Pipeline, method: CacheMethodSpec, config: Any) -> CacheHandle | None:
    """Enable cache method ``method`` on a loaded pipeline and return its handle (``handle.remove()`` undoes it).

    :param pipeline: the loaded pipeline (its model spec declares which cache methods it supports).
    :param method: the registry record of the method being enabled.
    :param config: the method's configuration object (or ``None`` for its defaults).

    Stops at the first non-``None`` result. The core's ``trylast`` implementation calls the method's
    ``impl`` (``apply(pipeline, config)``). A model plugin may implement it ``tryfirst`` to provide a
    model-specific variant. Wrappers may observe or decorate the returned handle (``handle = yield``).

    Use in plugins: cache-method plugins and model plugins with model-specific caches.
    """


@hookspec(firstresult=True)
def omnicore_attention_backend(
    requirement: AttentionRequirement, candidates: Sequence[AttentionBackendSpec]
) -> AttentionBackendSpec | None:
    """Choose the attention implementation for one call site.

    :param requirement: platform, dtype, head dim and packing/sparsity needs of the call site.
    :param candidates: every registered backend whose declared capabilities meet the requirement, highest
        priority first.

    Stops at the first non-``None`` result. The core's ``trylast`` implementation returns the first
    candidate. A backend plugin may implement it ``tryfirst`` to prefer its kernel for some shapes. Wrappers
    see the choice (``chosen = yield``) and may log it; returning another spec must keep to ``candidates``.

    Use in plugins: hardware backend plugins.
    """


@hookspec(firstresult=True)
def omnicore_postprocess(request: GenerationRequest, output: Output) -> Output | None:
    """Finish one output (an :class:`omnicore.Output`) before it is returned or written.

    :param request: the request the output belongs to.
    :param output: the decoded output (uint8 frames, optional audio, metrics).

    Stops at the first non-``None`` result, which replaces the output. The core's ``trylast``
    implementation returns the output unchanged. Wrappers adjust it (watermarking, safety filters,
    format conversion): ``out = yield``, then return the adjusted output.

    Use in plugins: output filters and exporters.
    """
