"""Entry-point module (``[project.entry-points.omnicore] backends_cuda``): the ``cuda`` platform, its attention
backends and fused ops.

Imports neither torch nor triton: implementations are lazy ``"module:attr"`` paths, and optional packages are
detected with ``importlib.util.find_spec``. Without CUDA the platform still registers and ``omnicore plugins``
lists it as unavailable with the probe's reason; it is then never chosen automatically, and ``--platform cuda``
fails at start-up with that reason.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from omnicore.plugin import AttentionBackendSpec, AttentionCapabilities, OpSpec, PlatformSpec, hookimpl

from . import __version__

PLATFORM = "cuda"

#: the fused Triton ops (each ``omni_backends_cuda.ops:<name>`` with ``<name>_applies``)
FUSED_OPS = ("rms_norm", "gated_residual_norm_modulate", "rope_rotate_half", "group_norm_silu", "rms_norm_silu",
             "swiglu", "upsample2x_conv", "lora_segment_delta")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def triton_available() -> bool:
    return _importable("triton")


def flash_attn_available() -> bool:
    return _importable("flash_attn")


def attention_preference() -> tuple[str, ...]:
    """flash-attn when installed, torch's fused SDPA for dense call sites, our Triton kernel for packed ones,
    then the core reference."""
    names = []
    if flash_attn_available():
        names.append("flash_varlen")
    names.append("cuda_sdpa")
    if triton_available():
        names.append("triton_varlen")
    names.append("sdpa")
    return tuple(names)


def plugin_info() -> dict[str, Any]:
    return {"kind": "backend", "api": ">=1.0,<2", "version": __version__, "platforms": [PLATFORM],
            "attention_backends": [n for n in attention_preference() if n != "sdpa"]}


@hookimpl
def omnicore_register_platforms(register: Callable[[PlatformSpec], None]) -> None:
    register(PlatformSpec(
        name=PLATFORM,
        impl="omni_backends_cuda.platform:CudaPlatform",
        device_type="cuda",
        priority=100,
        probe="omni_backends_cuda.probe:probe",
        attention_preference=attention_preference(),
        description="NVIDIA GPUs through torch.cuda (Triton kernels, flash-attn when installed).",
    ))


@hookimpl
def omnicore_register_attention_backends(register: Callable[[AttentionBackendSpec], None]) -> None:
    register(AttentionBackendSpec(
        name="cuda_sdpa",
        impl="omni_backends_cuda.attention:cuda_sdpa_attention",
        capabilities=AttentionCapabilities(platforms=(PLATFORM,), dtypes=("float16", "bfloat16", "float32"),
                                           head_dims=(1, 512)),
        priority=20,
        description="torch scaled_dot_product_attention (fused flash / memory-efficient kernels), dense, GQA.",
    ))
    if triton_available():
        register(AttentionBackendSpec(
            name="triton_varlen",
            impl="omni_backends_cuda.attention:triton_varlen_attention",
            capabilities=AttentionCapabilities(platforms=(PLATFORM,), dtypes=("float16", "bfloat16", "float32"),
                                               head_dims=(16, 256), packed_varlen=True, packed_mask_free=True,
                                               prefix_kv_slicing=True),
            priority=10,
            description="Triton packed-varlen forward: cu_seqlens documents, GQA, causal, [real | pad] packing "
                        "via valid_kv_length without a mask.",
        ))
    if flash_attn_available():
        register(AttentionBackendSpec(
            name="flash_varlen",
            impl="omni_backends_cuda.attention:flash_varlen_attention",
            capabilities=AttentionCapabilities(platforms=(PLATFORM,), dtypes=("float16", "bfloat16"),
                                               head_dims=(1, 256), packed_varlen=True, packed_mask_free=True,
                                               prefix_kv_slicing=True),
            priority=30,
            description="flash-attn 2 (flash_attn_varlen_func / flash_attn_func).",
        ))


@hookimpl
def omnicore_register_ops(register: Callable[[OpSpec], None]) -> None:
    if not triton_available():
        return
    for name in FUSED_OPS:
        register(OpSpec(name=name, platform=PLATFORM, impl=f"omni_backends_cuda.ops:{name}",
                        applies=f"omni_backends_cuda.ops:{name}_applies", priority=10,
                        description=f"fused Triton {name} (eager reference when the inputs do not fit)"))
