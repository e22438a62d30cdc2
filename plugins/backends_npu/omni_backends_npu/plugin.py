"""Entry-point module (``[project.entry-points.omnicore] backends_npu``): the ``npu`` platform and its attention
backends (``npu_varlen``, ``npu_laser``, ``npu_rainfusion``).

Imports neither torch nor torch_npu: implementations are lazy ``"module:attr"`` paths and the probe finds
torch_npu with ``importlib.util.find_spec``. Without torch_npu the platform still registers: ``omnicore plugins``
lists it as unavailable ("torch_npu not installed"), it is never chosen automatically, and ``--platform npu`` fails
at start-up with that reason. Backends are chosen like every other backend (declared capabilities, the platform's
``attention_preference``, ``--attention-backend``) — never by an environment variable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omnicore.plugin import AttentionBackendSpec, AttentionCapabilities, PlatformSpec, hookimpl

from . import __version__

PLATFORM = "npu"
#: MindIE-SD's attention kernels compute in half precision
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (16, 512)

#: name -> (impl, priority, executes block-sparse plans, description)
BACKENDS: dict[str, tuple[str, int, bool, str]] = {
    "npu_varlen": ("omni_backends_npu.attention:npu_varlen_attention", 30, False,
                   "MindIE-SD TND varlen for [real | pad] packed calls, masked fused_attn_score otherwise"),
    "npu_laser": ("omni_backends_npu.attention:npu_laser_attention", 20, False,
                  "MindIE-SD laser attention: prefix-K/V slice, BNSD, power-of-two laser_input_scale"),
    "npu_rainfusion": ("omni_backends_npu.attention:npu_rainfusion_attention", 10, True,
                       "MindIE-SD rf_v2 block-sparse attention from a RainFusion plan; dense (npu_varlen) "
                       "without one"),
}


def capabilities(platforms: tuple[str, ...] = (PLATFORM,), dtypes: tuple[str, ...] = DTYPES, *,
                 sparse: bool = False) -> AttentionCapabilities:
    """What every npu backend honours: packed documents, ``[real | pad]`` without a mask, ``valid_kv_length``."""
    return AttentionCapabilities(platforms=platforms, dtypes=dtypes, head_dims=HEAD_DIMS, packed_varlen=True,
                                 packed_mask_free=True, prefix_kv_slicing=True, sparse=sparse)


def plugin_info() -> dict[str, Any]:
    return {"kind": "backend", "api": ">=1.0,<2", "version": __version__, "platforms": [PLATFORM],
            "attention_backends": list(BACKENDS)}


@hookimpl
def omnicore_register_platforms(register: Callable[[PlatformSpec], None]) -> None:
    register(PlatformSpec(
        name=PLATFORM,
        impl="omni_backends_npu.platform:NpuPlatform",
        device_type="npu",
        priority=90,
        probe="omni_backends_npu.probe:probe",
        attention_preference=("npu_varlen", "npu_laser", "npu_rainfusion", "sdpa"),
        description="Ascend NPUs through torch_npu; attention through MindIE-SD (varlen, laser, RainFusion).",
    ))


@hookimpl
def omnicore_register_attention_backends(register: Callable[[AttentionBackendSpec], None]) -> None:
    for name, (impl, priority, sparse, description) in BACKENDS.items():
        register(AttentionBackendSpec(name=name, impl=impl, capabilities=capabilities(sparse=sparse), priority=priority,
                                      description=description))
