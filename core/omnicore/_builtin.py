"""The core's own plugin: registers the CPU platform and the reference attention backend through the same
hooks as any third-party plugin, and provides the ``trylast`` defaults of the pipeline hooks.

Imports nothing heavy: implementations are named by lazy paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .hookspecs import hookimpl
from .specs import (
    AttentionBackendSpec,
    AttentionCapabilities,
    AttentionRequirement,
    CacheMethodSpec,
    PlatformSpec,
)


def plugin_info() -> dict[str, Any]:
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
        attention_preference=("sdpa",),
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
        ),
        priority=0,
        description="Reference: PyTorch SDPA, packed documents computed one by one (no O(S^2) mask).",
    ))


@hookimpl
def omnicore_register_cache_methods(register: Callable[[CacheMethodSpec], None]) -> None:
    for spec in _CACHE_METHODS:
        register(spec)


_CACHE_METHODS: tuple[CacheMethodSpec, ...] = ()


@hookimpl(trylast=True)
def omnicore_preprocess(request: Any, pipeline: Any) -> Any:
    return pipeline.preprocess(request)


@hookimpl(trylast=True)
def omnicore_denoise(pipeline: Any, state: Any, step: int) -> Any:
    return pipeline.denoise_step(state, step)


@hookimpl(trylast=True)
def omnicore_cache(pipeline: Any, method: CacheMethodSpec, config: Any) -> Any:
    return method.load_impl()(pipeline, config)


@hookimpl(trylast=True)
def omnicore_attention_backend(
    requirement: AttentionRequirement, candidates: Sequence[AttentionBackendSpec]
) -> AttentionBackendSpec | None:
    return candidates[0] if candidates else None


@hookimpl(trylast=True)
def omnicore_postprocess(request: Any, output: Any) -> Any:
    return output
