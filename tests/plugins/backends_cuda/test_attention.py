"""Attention backends of the cuda plugin against the core's reference (``AttentionBackendConformance``) plus our own
packed layouts: head dims 64/96/128, GQA, empty and single-row documents, lengths off the block size, prefix K/V,
``[real | pad]`` packing, and no per-call host work on device tensors.

The Triton kernel runs in Triton's interpreter on CPU tensors here (conftest.py); ``cuda_sdpa`` is torch SDPA and
runs on the CPU as well; flash-attn needs its package and a GPU.
"""

from __future__ import annotations

import pytest
import torch
from _cuda_helpers import CUDA_REASON, DEVICE, PLUGIN, needs_gpu
from omni_backends_cuda import attention
from omni_backends_cuda.plugin import flash_attn_available
from omnicore.attention.metadata import AttentionMetadata
from omnicore.attention.reference import sdpa_attention
from omnicore.testing import AttentionBackendConformance


class TestTritonVarlen(AttentionBackendConformance):
    backend = "triton_varlen"
    plugin_module = PLUGIN
    platform, device = "cuda", DEVICE
    dtypes = ("float32",) if DEVICE == "cpu" else ("bfloat16", "float16")


class TestCudaSdpa(AttentionBackendConformance):
    backend = "cuda_sdpa"
    plugin_module = PLUGIN
    platform, device = "cuda", DEVICE
    dtypes = ("float32",) if DEVICE == "cpu" else ("bfloat16", "float16", "float32")


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_REASON is not None or not flash_attn_available(),
                    reason=f"needs CUDA and flash-attn: {CUDA_REASON or 'flash_attn is not installed'}")
class TestFlashVarlen(AttentionBackendConformance):
    backend = "flash_varlen"
    plugin_module = PLUGIN
    platform, device = "cuda", "cuda"
    dtypes = ("bfloat16", "float16")


# ---------------------------------------------------------------------------------------------- our layouts
def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _ref(q, k, v, **kw):
    return sdpa_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), **kw)


TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2)}


@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.float32), (128, torch.bfloat16), (96, torch.float32)])
def test_packed_gqa_with_empty_single_row_and_ragged_documents(head_dim, dtype):
    """Documents of 0, 1, 33 (block 32 + 1) and 7 queries over prefix K/V, 4 query heads over 2 key heads."""
    md = AttentionMetadata(cu_seqlens_q=(0, 0, 1, 34, 41), cu_seqlens_k=(0, 5, 6, 45, 57))
    q = _rand(41, 4, head_dim, seed=1, dtype=dtype)
    k, v = (_rand(57, 2, head_dim, seed=s, dtype=dtype) for s in (2, 3))
    for causal in (False, True):
        got = attention.triton_varlen_attention(q, k, v, metadata=md, causal=causal)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got.float().cpu(), _ref(q, k, v, metadata=md, causal=causal), atol=atol, rtol=rtol)


def test_real_pad_packing_is_mask_free_and_pad_rows_never_leak():
    """(8, 2, 4)-style [real | pad] layout, cu = [0, 5, 8], max 5, valid_kv_length 5."""
    md = AttentionMetadata(cu_seqlens_q=(0, 5, 8), max_seqlen_q=5, max_seqlen_k=5, valid_kv_length=5)
    q, k, v = (_rand(8, 2, 64, seed=s) for s in (4, 5, 6))
    out = attention.triton_varlen_attention(q, k, v, metadata=md)
    want = _ref(q[None, :5], k[None, :5], v[None, :5])[0]
    torch.testing.assert_close(out[:5].cpu(), want, atol=2e-4, rtol=2e-4)
    assert torch.equal(out[5:].cpu(), torch.zeros(3, 2, 64))  # the padding document has no keys
    k[5:], v[5:] = float("nan"), float("nan")
    assert torch.equal(attention.triton_varlen_attention(q, k, v, metadata=md)[:5], out[:5])


def test_a_call_makes_no_device_copy_once_the_layout_is_cached(monkeypatch):
    """The cu_seqlens device copies come from the metadata's cache: a second call builds no tensor from host data."""
    md = AttentionMetadata.from_lengths([7, 12])
    q, k, v = (_rand(19, 2, 64, seed=s) for s in (7, 8, 9))
    first = attention.triton_varlen_attention(q, k, v, metadata=md)
    made = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: made.append(a) or real_tensor(*a, **kw))
    assert torch.equal(attention.triton_varlen_attention(q, k, v, metadata=md), first)
    assert made == []


def test_packed_calls_reject_what_the_kernel_does_not_do():
    from omnicore.attention.metadata import AttentionSpan

    q = k = v = _rand(8, 2, 64, seed=10)
    spans = AttentionMetadata(cu_seqlens_q=(0, 8), causal=True, spans=((AttentionSpan(0, 4),),))
    with pytest.raises(ValueError, match="spans"):
        attention.triton_varlen_attention(q, k, v, metadata=spans)
    with pytest.raises(ValueError, match="no keys"):
        attention.triton_varlen_attention(q, k, v, metadata=AttentionMetadata(cu_seqlens_q=(0, 8),
                                                                              cu_seqlens_k=(0, 0)))
    with pytest.raises(ValueError, match="dense backend"):
        attention.cuda_sdpa_attention(q, k, v, metadata=AttentionMetadata(cu_seqlens_q=(0, 8)))


def test_dense_calls_with_a_mask_match_the_reference():
    q, k, v = (_rand(2, 9, 2, 64, seed=s) for s in (11, 12, 13))
    mask = _rand(1, 1, 9, 9, seed=14) > 0
    mask[..., 0] = True
    for fn in (attention.triton_varlen_attention, attention.cuda_sdpa_attention):
        torch.testing.assert_close(fn(q, k, v, attn_mask=mask).cpu(), _ref(q, k, v, attn_mask=mask.cpu()),
                                   atol=2e-4, rtol=2e-4)


@needs_gpu
def test_triton_matches_sdpa_on_a_large_packed_batch():
    lengths = [4096, 1000, 3000, 8192]
    md = AttentionMetadata.from_lengths(lengths)
    q, k, v = (torch.randn(sum(lengths), 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = attention.triton_varlen_attention(q, k, v, metadata=md)
    torch.testing.assert_close(got.float(), sdpa_attention(q, k, v, metadata=md).float(), atol=3e-2, rtol=3e-2)
