"""The fused Triton ops registered for platform ``cuda`` and their ``applies`` predicates.

Each ``<op>`` has the reference signature of ``omnicore.ops.reference.<op>``; ``<op>_applies`` (same arguments)
answers from shapes, strides, dtypes and devices only — cheap and never a device read — whether the kernel handles
the call. When it says no, the platform's op table runs the eager reference instead. Kernels run on CUDA tensors
(CPU tensors in Triton's interpreter, ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Any

import torch

from ._triton import kernel_dtype, on_kernel_device
from .kernels import elementwise, norms
from .kernels.elementwise import rope_rotate_half, swiglu
from .kernels.lora import MAX_RANK as LORA_MAX_RANK
from .kernels.lora import lora_segment_delta
from .kernels.norms import gated_residual_norm_modulate, group_norm_silu, rms_norm, rms_norm_silu
from .kernels.upsample import upsample2x_conv

#: widest row a one-block-per-row norm kernel takes (fp32 registers per program)
MAX_ROW = 16384


def _tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _ok(*tensors: torch.Tensor) -> bool:
    return kernel_dtype(*tensors) and on_kernel_device(*tensors)


def rms_norm_applies(x: Any, weight: Any, eps: Any) -> bool:
    if not _tensor(x) or x.dim() == 0 or not 0 < x.shape[-1] <= MAX_ROW or not x.is_contiguous():
        return False
    if weight is None:
        return _ok(x)
    return _tensor(weight) and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.is_contiguous() \
        and _ok(x, weight)


def gated_residual_norm_modulate_applies(residual: Any, update: Any, gate: Any, shift: Any, scale: Any, eps: Any,
                                         norm: str = "layer", weight: Any = None) -> bool:
    mods = (gate, shift, scale)
    if norm not in ("layer", "rms") or not all(_tensor(t) for t in (residual, update, *mods)):
        return False
    if residual.dim() == 0 or residual.shape != update.shape or not 0 < residual.shape[-1] <= MAX_ROW:
        return False
    if not (residual.is_contiguous() and update.is_contiguous()) or any(t.dim() == 0 for t in mods):
        return False
    try:
        if torch.broadcast_shapes(residual.shape, *(t.shape for t in mods)) != residual.shape:
            return False
    except RuntimeError:
        return False
    if any(norms.broadcast_strides(t, residual.shape) is None for t in mods):
        return False
    tensors = [residual, update, *mods]
    if weight is not None:
        if not (_tensor(weight) and weight.dim() == 1 and weight.shape[0] == residual.shape[-1]
                and weight.is_contiguous()):
            return False
        tensors.append(weight)
    return _ok(*tensors)


def rope_rotate_half_applies(x: Any, cos: Any, sin: Any) -> bool:
    if not (_tensor(x) and _tensor(cos) and _tensor(sin)) or not 1 <= x.dim() <= 4:
        return False
    rot = cos.shape[-1] if cos.dim() else 0
    if cos.dim() > x.dim() or sin.dim() > x.dim() or sin.shape[-1:] != cos.shape[-1:] or rot % 2 or not \
            0 < rot <= x.shape[-1]:
        return False
    try:  # cos/sin must broadcast to x's leading dims without growing them
        lead = torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1], sin.shape[:-1])
    except RuntimeError:
        return False
    return tuple(lead) == tuple(x.shape[:-1]) and _ok(x, cos, sin)


def _channel_vector(t: torch.Tensor, ndim: int, channel_dim: int, channels: int) -> bool:
    """``t`` holds one value per channel, laid out to broadcast along ``channel_dim`` of an ``ndim``-d tensor."""
    where = t.dim() - (ndim - channel_dim)
    if t.numel() != channels or t.dim() > ndim or not t.is_contiguous():
        return False
    if t.dim() == 0 or where < 0:
        return channels == 1
    return all(size == (channels if i == where else 1) for i, size in enumerate(t.shape))


def group_norm_silu_applies(x: Any, num_groups: Any, weight: Any, bias: Any, eps: Any) -> bool:
    if not _tensor(x) or x.dim() < 2 or type(num_groups) is not int or num_groups <= 0:
        return False
    c = x.shape[1]
    if c % num_groups or norms.ncs_strides(x, 1) is None:
        return False
    dense = x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)) or (
        x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))
    if not dense:
        return False
    tensors = [x]
    for t in (weight, bias):
        if t is not None:
            if not (_tensor(t) and t.dim() == 1 and t.shape[0] == c and t.is_contiguous()):
                return False
            tensors.append(t)
    return _ok(*tensors)


def rms_norm_silu_applies(x: Any, gamma: Any, bias: Any, eps: Any = 1e-12, channel_dim: Any = 1) -> bool:
    if not _tensor(x) or not _tensor(gamma) or x.dim() == 0 or type(channel_dim) is not int:
        return False
    if not -x.dim() <= channel_dim < x.dim():
        return False
    cd = channel_dim % x.dim()
    c = x.shape[cd]
    if not 0 < c <= 4096 or norms.ncs_strides(x, cd) is None or not _channel_vector(gamma, x.dim(), cd, c):
        return False
    tensors = [x, gamma]
    if _tensor(bias):
        if not _channel_vector(bias, x.dim(), cd, c):
            return False
        tensors.append(bias)
    elif bias is not None and type(bias) not in (int, float):
        return False
    return _ok(*tensors)


def swiglu_applies(gate: Any, up: Any) -> bool:
    return _tensor(gate) and _tensor(up) and gate.shape == up.shape and gate.is_contiguous() \
        and up.is_contiguous() and _ok(gate, up)


def upsample2x_conv_applies(x: Any, weight: Any, bias: Any, padding: Any = 1) -> bool:
    """A 4-D ``x``, a 3x3 ``weight`` over its channels with ``padding=1`` (the Wan VAE's up-sampling conv),
    ``bias`` None or one value per output channel (contiguous); one device and a kernel dtype for all."""
    if not (_tensor(x) and _tensor(weight)) or type(padding) is not int or padding != 1:
        return False
    if x.dim() != 4 or weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3) or weight.shape[1] != x.shape[1]:
        return False
    if not weight.is_contiguous() or weight.dtype != x.dtype:
        return False
    tensors = [x, weight]
    if bias is not None:
        if not (_tensor(bias) and bias.shape == (weight.shape[0],) and bias.is_contiguous()):
            return False
        tensors.append(bias)
    return _ok(*tensors)


def lora_segment_delta_applies(x: Any, a: Any, b: Any, seg_ends: Any) -> bool:
    """``x (N, in)``, ``a (S, R, in)``, ``b (S, out, R)`` of one kernel dtype with ``R <= LORA_MAX_RANK``,
    ``seg_ends (S,)`` an integer vector (on the host or the device: it is copied over), the rest on one kernel
    device (any strides: the kernels take them)."""
    if not all(_tensor(t) for t in (x, a, b, seg_ends)):
        return False
    if x.dim() != 2 or a.dim() != 3 or b.dim() != 3 or seg_ends.dim() != 1:
        return False
    s, rank, d_in = a.shape
    if b.shape[0] != s or b.shape[2] != rank or d_in != x.shape[1] or seg_ends.shape[0] != s:
        return False
    if rank > LORA_MAX_RANK or seg_ends.dtype not in (torch.int64, torch.int32):
        return False
    if not x.dtype == a.dtype == b.dtype:
        return False
    return _ok(x, a, b)


__all__ = [
    "elementwise", "gated_residual_norm_modulate", "gated_residual_norm_modulate_applies", "group_norm_silu",
    "group_norm_silu_applies", "lora_segment_delta",
    "lora_segment_delta_applies", "norms", "rms_norm", "rms_norm_applies", "rms_norm_silu", "rms_norm_silu_applies",
    "rope_rotate_half", "rope_rotate_half_applies", "swiglu", "swiglu_applies", "upsample2x_conv",
    "upsample2x_conv_applies",
]
