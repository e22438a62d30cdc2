"""The platform op ``lora_segment_delta``: its eager reference against a per-row loop, through the op table."""

from __future__ import annotations

import pytest
import torch
from omnicore.ops.names import OP_NAMES
from omnicore.ops.reference import lora_segment_delta
from omnicore.ops.table import PlatformOps


def _naive(x, a, b, ends):
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    start = 0
    for s, end in enumerate(ends.tolist()):
        for row in range(start, end):
            out[row] = b[s].double() @ (a[s].double() @ x[row].double())
        start = end
    return out


@pytest.mark.parametrize("ends", [[6, 12, 18], [1, 9, 9, 20], [20]])
def test_matches_a_per_row_loop(ends: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    n, s = ends[-1], len(ends)
    x, a, b = torch.randn(n, 24, generator=g), torch.randn(s, 5, 24, generator=g), torch.randn(s, 40, 5, generator=g)
    seg = torch.tensor(ends, dtype=torch.int64)
    got = PlatformOps("cpu").lora_segment_delta(x, a, b, seg)  # what models call
    assert got.shape == (n, 40) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), _naive(x, a, b, seg), atol=1e-4, rtol=1e-5)


def test_zero_slots_add_exactly_nothing_and_bf16_keeps_its_dtype() -> None:
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    a, b = torch.randn(2, 4, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 4, dtype=torch.bfloat16)
    b[0] = 1
    out = lora_segment_delta(x, a, b, torch.tensor([3, 8]))
    assert out.dtype == torch.bfloat16 and torch.count_nonzero(out[3:]) == 0 and torch.count_nonzero(out[:3]) > 0


def test_bad_shapes_and_ends_are_refused() -> None:
    x, a, b = torch.randn(6, 8), torch.randn(2, 3, 8), torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="ending at N=6"):
        lora_segment_delta(x, a, b, torch.tensor([2, 5]))
    with pytest.raises(ValueError, match="non-decreasing"):
        lora_segment_delta(x, a, b, torch.tensor([4, 2]))
    with pytest.raises(ValueError, match="shapes disagree"):
        lora_segment_delta(x, a, torch.randn(2, 4, 2), torch.tensor([2, 6]))
    assert "lora_segment_delta" in OP_NAMES
