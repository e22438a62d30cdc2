"""The core's own plugin: registers the CPU platform and the reference attention backend through the same
hooks as any third-party plugin, and provides the ``trylast`` defaults of the pipeline hooks.

Imports nothing heavy: implementations are named by lazy paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .hookspecs import hookimpl
from .specs import (
    AttentionBackendSpec,
    AttentionCapabilities,
    AttentionRequirement,
    CacheMethodSpec,
    PlatformSpec,
)

if TYPE_CHECKING:
    from .engine.protocol import DenoiseState, Pipeline
    from .engine.request import GenerationRequest
    from .hookspecs import CacheHandle
    from .outputs.output import Output


def plugin_info() -> dict[str, object]:
    return {"kind": "core", "api": ">=1.0,<2"}


@hookimpl
def omnicore_register_models(register: Callable[..., None]) -> None:
    """The core serves no model on its own."""


@hookimpl
def omnicore_register_platforms(register: Callable[[PlatformSpec], None]) -> None:
    register(PlatformSpec(
        name="cpu",
        impl="omnicore.platforms.cpu:CpuPlatform",
        device_type="cpu",
        priority=0,
        attention_preference=(),  # no ranking: a plugin's CPU kernel with a higher priority wins over the reference
        description="Host CPU (always available; lowest priority).",
    ))


@hookimpl
def omnicore_register_attention_backends(register: Callable[[AttentionBackendSpec], None]) -> None:
    register(AttentionBackendSpec(
        name="sdpa",
        impl="omnicore.attention.reference:sdpa_attention",
        capabilities=AttentionCapabilities(
            platforms=("cpu", "cuda", "npu"),
            dtypes=("float32", "bfloat16", "float16"),
            head_dims=(1, 1024),
            packed_varlen=True,
            packed_mask_free=True,
            prefix_kv_slicing=True,
            spans=True,
        ),
        priority=0,
        description="Reference: PyTorch SDPA, packed documents computed one by one from host-int metadata "
                    "(valid_kv_length, prefix K/V, causal spans; no O(S^2) mask).",
    ))


@hookimpl
def omnicore_register_cache_methods(register: Callable[[CacheMethodSpec], None]) -> None:
    for spec in _CACHE_METHODS:
        register(spec)


_CACHE_METHODS: tuple[CacheMethodSpec, ...] = (
    CacheMethodSpec(
        name="teacache",
        impl="omnicore.cache.teacache:apply_teacache",
        conflicts=("first_block_cache",),
        description="TeaCache: reuse the previous prediction while the rescaled change of the modulated input "
                    "stays below rel_l1_thresh (model supplies extractor, coefficients, default threshold).",
    ),
    CacheMethodSpec(
        name="first_block_cache",
        impl="omnicore.cache.first_block_cache:apply_first_block_cache",
        conflicts=("teacache",),
        description="First-block cache: run block 0, skip the remaining blocks with their cached residual "
                    "while block 0's residual barely changes (model declares its block loop).",
    ),
    CacheMethodSpec(
        name="adaln_schedule",
        impl="omnicore.cache.adaln_schedule:apply_adaln_schedule",
        resident="omnicore.cache.adaln_schedule:resident_modules",
        description="Exact-schedule AdaLN modulation tables (bit-exact), optionally offloading the "
                    "projection weights.",
    ),
)


@hookimpl(trylast=True)
def omnicore_preprocess(request: GenerationRequest, pipeline: Pipeline) -> GenerationRequest:
    return pipeline.preprocess(request)


@hookimpl(trylast=True)
def omnicore_denoise(pipeline: Pipeline, state: DenoiseState, step: int) -> DenoiseState:
    return pipeline.denoise_step(state, step)


@hookimpl(trylast=True)
def omnicore_cache(pipeline: Pipeline, method: CacheMethodSpec, config: object) -> CacheHandle:
    handle: CacheHandle = method.load_impl()(pipeline, config)
    return handle


@hookimpl(trylast=True)
def omnicore_attention_backend(
    requirement: AttentionRequirement, candidates: Sequence[AttentionBackendSpec]
) -> AttentionBackendSpec | None:
    return candidates[0] if candidates else None


@hookimpl(trylast=True)
def omnicore_postprocess(request: GenerationRequest, output: Output) -> Output:
    return output
