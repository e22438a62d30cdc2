"""The Triton segmented LoRA kernel (``lora_segment_delta``, punica-style shrink + expand) against the eager
reference, in Triton's interpreter on CPU tensors here (``TRITON_INTERPRET=1``, see conftest.py); never run on a
GPU in this suite unless one is usable (``test_lora_kernel_on_the_gpu`` is then the only GPU check).

Layouts: segments inside one row block, boundaries straddling blocks of every tile size the launcher picks, empty
segments first / middle / last, rows no segment covers, ranks 1..MAX_RANK (zero-padded by callers), widths off the
tile sizes and a shrink split over K (few rows, a wide input).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _cuda_helpers import DEVICE, PLUGIN, needs_gpu
from omni_backends_cuda import ops
from omni_backends_cuda.kernels import lora as lora_kernels
from omnicore.ops import reference as ref
from omnicore.testing import PlatformOpConformance
from omnicore.testing.ops import Case


def _t(*shape: int, dtype: Any = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7 * sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def _ends(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _case(n: int, d_in: int, d_out: int, rank: int, ends: tuple[int, ...], dtype: Any, seed: int = 0,
          ranks: tuple[int, ...] | None = None) -> tuple[Any, ...]:
    """x, a, b, seg_ends with magnitudes near 1 (so bf16 tolerances mean something); ``ranks`` zero-pads slot s
    past its own rank, as the core's gather does for mixed ranks."""
    s = len(ends)
    a, b = _t(s, rank, d_in, seed=seed + 1, scale=d_in ** -0.5), _t(s, d_out, rank, seed=seed + 2, scale=rank ** -0.5)
    for i, r in enumerate(ranks or ()):
        a[i, r:] = 0
        b[i, :, r:] = 0
    return _t(n, d_in, seed=seed), a.to(dtype), b.to(dtype), _ends(*ends)


class TestLoraSegmentDelta(PlatformOpConformance):
    """The core kit's cases plus layouts chosen against the kernel's tiling (rows 16/32/64, K 64, N 64)."""

    op = "lora_segment_delta"
    platform = "cuda"
    plugin_module = PLUGIN
    device = DEVICE
    # bf16: the kernel keeps x @ a^T in fp32 until one rounding before the expand; the reference's bf16 bmm
    # rounds the same intermediate but accumulates in another order, so outputs near 1 differ by a few ulps
    tolerances = {"bfloat16": (3e-2, 3e-2)}

    def cases(self, dtype: Any) -> list[Case]:
        def c(label: str, *args: Any, **kw: Any) -> Case:
            x, a, b, ends = _case(*args, dtype=dtype, **kw)
            return label, (x.to(dtype), a, b, ends), {}

        return [*super().cases(dtype),
                c("many-segments-in-one-block", 12, 24, 20, 4, (1, 2, 5, 5, 9, 12)),
                c("boundaries-straddle-32-row-blocks", 61, 40, 33, 8, (7, 31, 33, 61)),
                c("empty-first-and-last", 70, 48, 72, 16, (0, 35, 70, 70)),
                c("mixed-ranks-zero-padded", 48, 32, 40, 16, (16, 32, 48), ranks=(1, 16, 5)),
                c("rank-1", 9, 16, 16, 1, (4, 9)),
                c("max-rank", 17, 24, 18, lora_kernels.MAX_RANK, (9, 17)),
                c("split-k-wide-input", 20, 300, 24, 8, (6, 20)),
                c("one-row-segments", 5, 16, 130, 4, (1, 2, 3, 4, 5))]


def test_rows_past_the_last_segment_get_zero():
    """The reference requires ``seg_ends[-1] == N``; the kernel is total: rows no segment covers add nothing."""
    x, a, b, _ = _case(10, 16, 16, 4, (3, 6), torch.float32)
    got = ops.lora_segment_delta(x, a, b, _ends(3, 6))
    torch.testing.assert_close(got[:6], ref.lora_segment_delta(x[:6], a, b, _ends(3, 6)), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[6:], torch.zeros_like(got[6:]))


def test_a_zero_slot_is_exactly_zero_and_other_rows_are_unchanged():
    """A row without adapters sits in a zero slot: its delta is 0 bit for bit, whatever its neighbours use."""
    x, a, b, ends = _case(40, 32, 24, 8, (13, 27, 40), torch.float32)
    a[1], b[1] = 0, 0
    got = ops.lora_segment_delta(x, a, b, ends)
    assert torch.equal(got[13:27], torch.zeros_like(got[13:27]))
    for lo, hi, s in ((0, 13, 0), (27, 40, 2)):  # each segment alone, as the model would compute it unbatched
        alone = ops.lora_segment_delta(x[lo:hi], a[s:s + 1], b[s:s + 1], _ends(hi - lo))
        torch.testing.assert_close(got[lo:hi], alone, atol=1e-5, rtol=1e-5)


def test_empty_and_degenerate_inputs():
    x, a, b, ends = _case(6, 16, 8, 4, (2, 6), torch.float32)
    assert ops.lora_segment_delta(x[:0], a, b, _ends(0, 0)).shape == (0, 8)
    zero_rank = ops.lora_segment_delta(x, a[:, :0], b[:, :, :0], ends)
    assert zero_rank.shape == (6, 8) and not zero_rank.any()


@pytest.mark.parametrize("seg_dtype", [torch.int32, torch.int64])
def test_seg_ends_of_either_integer_dtype(seg_dtype):
    x, a, b, ends = _case(20, 16, 16, 4, (5, 20), torch.float32)
    assert ops.lora_segment_delta_applies(x, a, b, ends.to(seg_dtype))
    torch.testing.assert_close(ops.lora_segment_delta(x, a, b, ends.to(seg_dtype)),
                               ref.lora_segment_delta(x, a, b, ends), atol=1e-5, rtol=1e-5)


def test_applies_says_no_where_the_kernel_does_not_fit():
    x, a, b, ends = _case(8, 16, 12, 4, (4, 8), torch.float32)
    assert ops.lora_segment_delta_applies(x, a, b, ends) is True
    assert not ops.lora_segment_delta_applies(x.double(), a.double(), b.double(), ends)  # a dtype not loaded
    assert not ops.lora_segment_delta_applies(x.bfloat16(), a, b, ends)  # mixed dtypes: the reference promotes
    assert not ops.lora_segment_delta_applies(x[None], a, b, ends)  # 3-d rows
    assert not ops.lora_segment_delta_applies(x, a, b[:, :, :2], ends)  # ranks disagree
    assert not ops.lora_segment_delta_applies(x, a, b, ends[:1])  # one end for two slots
    assert not ops.lora_segment_delta_applies(x, a, b, ends.float())  # ends must be integers
    wide = lora_kernels.MAX_RANK + 1
    assert not ops.lora_segment_delta_applies(x, _t(2, wide, 16), _t(2, 12, wide), ends)


def test_the_table_runs_the_kernel_and_falls_back_to_the_reference():
    from omnicore.testing.plugin import add_to_host, isolated_host

    host = isolated_host()
    add_to_host(host, PLUGIN, "backends_cuda")
    table = host.platform_ops("cuda")
    assert [s.impl for s in table.implementations("lora_segment_delta")] == [
        "omni_backends_cuda.ops:lora_segment_delta"]
    x, a, b, ends = _case(8, 16, 12, 4, (4, 8), torch.float64)  # fp64: applies says no -> the reference exactly
    assert torch.equal(table.lora_segment_delta(x.double(), a, b, ends),
                       ref.lora_segment_delta(x.double(), a, b, ends))


@needs_gpu
def test_lora_kernel_on_the_gpu():
    """8 requests x 1024 tokens, a 3072-wide linear, rank 32, bf16: within bf16 tolerance of the reference."""
    x = torch.randn(8 * 1024, 3072, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8, 32, 3072, device="cuda", dtype=torch.bfloat16) * 3072 ** -0.5
    b = torch.randn(8, 3072, 32, device="cuda", dtype=torch.bfloat16) * 32 ** -0.5
    ends = torch.arange(1, 9, dtype=torch.int64) * 1024
    torch.testing.assert_close(ops.lora_segment_delta(x, a, b, ends).float(),
                               ref.lora_segment_delta(x, a, b, ends).float(), atol=3e-2, rtol=3e-2)
