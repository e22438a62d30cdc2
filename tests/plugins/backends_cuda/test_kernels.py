"""The fused Triton ops against their eager references (``omnicore.ops.reference``), in Triton's interpreter on CPU
tensors here (``TRITON_INTERPRET=1``, see conftest.py), on the GPU where one is usable.

Each op runs the core kit's cases (through the platform's op table and directly) plus shapes of our own: sizes that
are not multiples of the block, single rows, empty tensors, and the reference's tables for the VAE kernels.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _cuda_helpers import DEVICE, PLUGIN, needs_gpu
from omni_backends_cuda import ops
from omnicore.ops import reference as ref
from omnicore.testing import PlatformOpConformance
from omnicore.testing.ops import Case


def _t(*shape: int, dtype: Any = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


class _Op(PlatformOpConformance):
    platform = "cuda"
    plugin_module = PLUGIN
    device = DEVICE

    def extra_cases(self, dtype: Any) -> list[Case]:
        return []

    def cases(self, dtype: Any) -> list[Case]:
        return super().cases(dtype) + self.extra_cases(dtype)


class TestRmsNorm(_Op):
    op = "rms_norm"

    def extra_cases(self, dtype: Any) -> list[Case]:  # widths off the power-of-two block, one row, many rows
        return [("odd-width", (_t(5, 3, 100, dtype=dtype), _t(100), 1e-6), {}),
                ("one-row", (_t(1, 257, dtype=dtype), None, 1e-5), {}),
                ("rows-past-a-tile", (_t(131, 24, dtype=dtype), _t(24, dtype=dtype), 1e-6), {})]


class TestGatedResidualNormModulate(_Op):
    op = "gated_residual_norm_modulate"

    def extra_cases(self, dtype: Any) -> list[Case]:  # a per-token modulation table (LingBot segments) and odd D
        return [("per-token", (_t(3, 5, 72, dtype=dtype), _t(3, 5, 72, dtype=dtype), _t(3, 5, 72, dtype=dtype),
                               _t(1, 72), _t(3, 1, 72, scale=0.1), 1e-6), {"norm": "layer"}),
                ("fp32-mods-odd", (_t(70, 40, dtype=dtype), _t(70, 40, dtype=dtype), _t(40), _t(40),
                                   _t(40, scale=0.1), 1e-6), {"norm": "rms", "weight": _t(40)})]


class TestRopeRotateHalf(_Op):
    op = "rope_rotate_half"

    def extra_cases(self, dtype: Any) -> list[Case]:  # head dim 128 with 96 rotated, one token, broadcast heads
        return [("partial-96-of-128", (_t(1, 7, 3, 128, dtype=dtype), _t(1, 7, 1, 96), _t(1, 7, 1, 96)), {}),
                ("one-token", (_t(1, 2, 16, dtype=dtype), _t(1, 1, 16), _t(1, 1, 16)), {})]


class TestGroupNormSilu(_Op):
    op = "group_norm_silu"

    def extra_cases(self, dtype: Any) -> list[Case]:  # channels-last, and a group longer than one block (3 passes)
        x = _t(1, 16, 6, 6, dtype=dtype).contiguous(memory_format=torch.channels_last)
        return [("channels-last", (x, 4, _t(16, dtype=dtype), _t(16, dtype=dtype), 1e-5), {}),
                ("long-group", (_t(1, 8, 33, 40, dtype=dtype), 2, _t(8, dtype=dtype), None, 1e-6), {})]


class TestRmsNormSilu(_Op):
    op = "rms_norm_silu"

    def extra_cases(self, dtype: Any) -> list[Case]:
        x = _t(1, 12, 2, 3, 5, dtype=dtype).contiguous(memory_format=torch.channels_last_3d)
        return [("channels-last-3d", (x, _t(12, 1, 1, 1), _t(12, 1, 1, 1)), {}),
                ("odd-channels", (_t(2, 7, 9, dtype=dtype), _t(7, 1), _t(7, 1), 1e-12), {"channel_dim": 1})]


class TestSwiglu(_Op):
    op = "swiglu"

    def extra_cases(self, dtype: Any) -> list[Case]:  # a size that is not a multiple of the 1024 block
        return [("ragged", (_t(3, 1031, dtype=dtype), _t(3, 1031, dtype=dtype)), {})]


class TestUpsample2xConv(_Op):
    op = "upsample2x_conv"
    # bf16: the kernel accumulates the folded taps in fp32 and rounds once; the reference rounds the 2x image's
    # conv through cuDNN/CPU bf16 paths, so the two differ by a few bf16 ulps of outputs of magnitude ~10
    tolerances = {"bfloat16": (0.1, 3e-2)}

    def extra_cases(self, dtype: Any) -> list[Case]:  # channels-last input, Cout past one channel block, 1x1
        x = _t(1, 8, 5, 4, dtype=dtype).contiguous(memory_format=torch.channels_last)
        return [("channels-last", (x, _t(6, 8, 3, 3, dtype=dtype, scale=0.2), _t(6, dtype=dtype)), {}),
                ("wide-cout", (_t(1, 4, 3, 3, dtype=dtype), _t(70, 4, 3, 3, dtype=dtype, scale=0.2), None), {}),
                ("one-pixel", (_t(2, 3, 1, 1, dtype=dtype), _t(2, 3, 3, 3, dtype=dtype, scale=0.2), None), {})]


def test_upsample2x_conv_folds_each_weight_once_and_refolds_after_an_update():
    from omni_backends_cuda.kernels import upsample

    upsample.clear_folded_weights()
    x, w, b = _t(1, 4, 3, 3), _t(5, 4, 3, 3, scale=0.2), _t(5)
    first = upsample.folded_weight(w)
    assert upsample.folded_weight(w) is first  # cached: the lazily built buffer
    _close(ops.upsample2x_conv(x, w, b), ref.upsample2x_conv(x, w, b), 1e-5, 1e-5)
    with torch.no_grad():
        w.mul_(2)  # an in-place update bumps the version: the fold is rebuilt, never stale
    assert upsample.folded_weight(w) is not first
    _close(ops.upsample2x_conv(x, w, b), ref.upsample2x_conv(x, w, b), 1e-5, 1e-5)
    assert upsample.clear_folded_weights() == 1 and upsample.folded_weight(w) is not None


# ---------------------------------------------------------------------------------------------- edges
@pytest.mark.parametrize("name", ["rms_norm", "swiglu", "rope_rotate_half", "gated_residual_norm_modulate"])
def test_empty_inputs_give_empty_outputs(name):
    x = _t(0, 64)
    args = {"rms_norm": (x, None, 1e-6), "swiglu": (x, x), "rope_rotate_half": (x, _t(1, 64), _t(1, 64)),
            "gated_residual_norm_modulate": (x, x, _t(64), _t(64), _t(64), 1e-6)}[name]
    assert getattr(ops, f"{name}_applies")(*args)
    got, want = getattr(ops, name)(*args), getattr(ref, name)(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.shape == w.shape == (0, 64) and g.dtype == w.dtype


def test_applies_says_no_where_the_kernel_does_not_fit():
    x = _t(4, 6, 64)
    assert not ops.rms_norm_applies(x.transpose(0, 1), None, 1e-6)  # not contiguous
    assert not ops.rms_norm_applies(x, _t(32), 1e-6)  # weight of another width
    assert not ops.rms_norm_applies(x.to(torch.float64), None, 1e-6)  # dtype the kernels do not load
    assert not ops.rms_norm_applies(x.to(torch.int32), None, 1e-6)
    assert not ops.swiglu_applies(x, _t(4, 6, 32))
    assert not ops.group_norm_silu_applies(_t(2, 30, 4, 4), 8, None, None, 1e-6)  # 30 channels, 8 groups
    assert not ops.rope_rotate_half_applies(_t(2, 4, 64), _t(4, 3), _t(4, 3))  # odd rotary dim
    assert not ops.rope_rotate_half_applies(_t(1, 2, 3, 4, 64), _t(1, 64), _t(1, 64))  # 5-d
    assert not ops.gated_residual_norm_modulate_applies(x, x, _t(4, 6, 64), _t(64), _t(64), 1e-6, "batch")
    assert not ops.gated_residual_norm_modulate_applies(x, x, _t(2, 4, 6, 64), _t(64), _t(64), 1e-6)  # grows h
    assert not ops.rms_norm_silu_applies(_t(2, 8, 5), _t(5), None)  # gamma not along channel dim 1
    assert not ops.upsample2x_conv_applies(_t(1, 4, 3, 3), _t(5, 4, 5, 5), None, 2)  # a 5x5 kernel
    assert not ops.upsample2x_conv_applies(_t(1, 4, 3, 3), _t(5, 4, 3, 3), None, 0)  # padding 0
    assert not ops.upsample2x_conv_applies(_t(1, 4, 3, 3, 3), _t(5, 4, 3, 3), None)  # 5-d input
    for verdict in (ops.rms_norm_applies(x, None, 1e-6), ops.swiglu_applies(x, x)):
        assert verdict is True


def test_the_table_falls_back_to_the_reference_where_the_kernel_does_not_apply():
    from omnicore.testing.plugin import add_to_host, isolated_host

    host = isolated_host()
    add_to_host(host, PLUGIN, "backends_cuda")
    table = host.platform_ops("cuda")
    x = _t(8, 64, dtype=torch.float64)  # fp64: applies says no -> the eager reference, bit for bit
    assert torch.equal(table.rms_norm(x, None, 1e-6), ref.rms_norm(x, None, 1e-6))


# ---------------------------------------------------------------------------------------------- docs/contracts-status.md C7.3
def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol)


def test_group_norm_silu_meets_the_seed_tolerances():
    """x (1, 64, 16, 16) channels-last, G=8, eps 1e-5: fp32 atol/rtol 1e-5; bf16 atol 7e-2, rtol 2e-2."""
    w, b = _t(64, seed=1), _t(64, seed=2)
    x = _t(1, 64, 16, 16, seed=3).contiguous(memory_format=torch.channels_last)
    assert ops.group_norm_silu_applies(x, 8, w, b, 1e-5)
    out = ops.group_norm_silu(x, 8, w, b, 1e-5)
    _close(out, ref.group_norm_silu(x, 8, w, b, 1e-5), 1e-5, 1e-5)
    assert out.stride() == x.stride()
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    _close(ops.group_norm_silu(xb, 8, wb, bb, 1e-5), ref.group_norm_silu(x, 8, w, b, 1e-5).bfloat16(), 7e-2, 2e-2)


def test_wan_rms_norm_silu_meets_the_seed_tolerances():
    """Channels-last-3d, C=96: fp32 1e-5/1e-5; bf16 activations + fp32 affine atol 0.15, rtol 0.03; the output has
    the input's strides."""
    x = _t(1, 96, 2, 4, 5, seed=4).contiguous(memory_format=torch.channels_last_3d)
    gamma, bias = _t(96, 1, 1, 1, seed=5), _t(96, 1, 1, 1, seed=6)
    assert ops.rms_norm_silu_applies(x, gamma, bias)
    out = ops.rms_norm_silu(x, gamma, bias)
    _close(out, ref.rms_norm_silu(x, gamma, bias), 1e-5, 1e-5)
    assert out.stride() == x.stride()
    xb = x.bfloat16()
    got = ops.rms_norm_silu(xb, gamma, bias)
    assert got.stride() == xb.stride()
    _close(got, ref.rms_norm_silu(xb, gamma, bias), 0.15, 0.03)


@needs_gpu
def test_kernels_run_on_the_gpu_in_bf16():
    x = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, device="cuda")
    _close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), 2e-2, 2e-2)
    g, u = torch.randn_like(x), torch.randn_like(x)
    _close(ops.swiglu(g, u), ref.swiglu(g, u), 2e-2, 2e-2)
