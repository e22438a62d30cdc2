"""A restored AdaLN projection is indistinguishable from one that was never offloaded.

The CPU GEMM kernels choose their code path by the operand's layout and alignment, so a weight restored into a
buffer that differs from the original only in its storage offset (tensors read back from a safetensors file start
at any 8-byte boundary) can give results that differ in the last bit on some CPUs (seen on AMD EPYC). This checks
the layout itself — dtype, shape, strides, contiguity, 64-byte alignment, storage of its own — on any host, for the
file-spill path (weights on the CPU) and for the core's copy path.
"""

from __future__ import annotations

import pytest
import torch
from omni_minimax_h3.transformer.adaln import H3AdaLNProjection
from omnicore.plugin import AdaLNProjection

ALIGN = 64  # the CPU caching allocator's alignment


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.is_contiguous(), t.storage_offset(),
            t.untyped_storage().nbytes())


def _installed(cls, dtype):
    torch.manual_seed(0)
    proj = cls(32, 16, expand_ratio=6, modality_num=2, dtype=dtype)
    t_embs = [torch.randn(3, 32, dtype=dtype) for _ in range(4)]
    proj.install(proj.build_table(t_embs), torch.zeros((), dtype=torch.int64))
    return proj, t_embs


@pytest.mark.parametrize("cls", [H3AdaLNProjection, AdaLNProjection], ids=["h3-file-spill", "core-copy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_gives_back_the_original_layout_and_values(cls, dtype):
    proj, t_embs = _installed(cls, dtype)
    before = {n: (_layout(p), p.detach().clone()) for n, p in proj.named_parameters()}
    direct = [proj.compute_flat(t) for t in t_embs]
    assert proj.offload() > 0 and proj.offloaded
    assert all(p.numel() == 0 for p in proj.parameters())
    proj.clear()
    assert not proj.offloaded and proj.table is None
    for name, p in proj.named_parameters():
        layout, value = before[name]
        assert _layout(p) == layout, name
        assert p.data_ptr() % ALIGN == 0, f"{name} restored at a {p.data_ptr() % ALIGN}-byte offset"
        assert torch.equal(p, value), name
    for t, ref in zip(t_embs, direct):
        assert torch.equal(proj.compute_flat(t), ref)
