"""The CPU reference attention against an independent dense computation (float64 einsum + boolean mask).

Packed varlen attention is computed per ``cu_seqlens`` document; here the same result is derived the slow way:
one [T, T] block-diagonal mask over the whole packed sequence, softmax written out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from omnicore.attention.packed import PackedSequence
from omnicore.attention.reference import sdpa_attention

TOL = {"atol": 2e-5, "rtol": 2e-5}


def naive_attention(q, k, v, mask=None, scale=None):
    """``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]``; mask ``[B or 1, Sq, Sk]`` bool (True = attend); float64."""
    q, k, v = (x.double() for x in (q, k, v))
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    kv_index = torch.tensor([h // group for h in range(heads)])  # query head h reads kv head h // group
    k, v = k[:, :, kv_index], v[:, :, kv_index]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)


def doc_ids(bounds: list[int], total: int) -> torch.Tensor:
    """Document index of each packed row; padding rows get -1 (and -2 on the key side, so they never match)."""
    ids = torch.full((total,), -1, dtype=torch.long)
    for i in range(len(bounds) - 1):
        ids[bounds[i]:bounds[i + 1]] = i
    return ids


def dense_packed_reference(q, k, v, cu_q, cu_k=None, causal=False):
    """Packed attention as ONE dense computation with a block-diagonal mask (the O(T^2) way)."""
    cu_k = cu_q if cu_k is None else cu_k
    bq, bk = cu_q.tolist(), cu_k.tolist()
    qi, ki = doc_ids(bq, q.shape[0]), doc_ids(bk, k.shape[0])
    ki[ki == -1] = -2
    mask = qi[:, None] == ki[None, :]
    if causal:
        q_pos = torch.arange(q.shape[0]) - torch.tensor(bq)[qi.clamp(min=0)]
        k_pos = torch.arange(k.shape[0]) - torch.tensor(bk)[ki.clamp(min=0)]
        mask &= k_pos[None, :] <= q_pos[:, None]
    out = naive_attention(q[None], k[None], v[None], mask[None])[0]
    valid = qi >= 0
    return out, valid


def rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


LAYOUTS = {
    "one_doc": ([7], 7),
    "equal_docs": ([4, 4, 4], 12),
    "unequal_with_length_one": ([1, 5, 2, 1, 3], 12),
    "empty_doc_in_the_middle": ([3, 0, 2], 5),
    "trailing_padding": ([3, 2], 8),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_packed_matches_block_diagonal_dense(layout, heads, kv_heads):
    lengths, total = LAYOUTS[layout]
    cu = PackedSequence.from_lengths(lengths).cu_seqlens()
    q, k, v = rand(total, heads, 8, seed=1), rand(total, kv_heads, 8, seed=2), rand(total, kv_heads, 8, seed=3)
    out = sdpa_attention(q, k, v, cu_seqlens_q=cu)
    expected, valid = dense_packed_reference(q, k, v, cu)
    assert out.shape == (total, heads, 8) and out.dtype == q.dtype
    torch.testing.assert_close(out[valid].double(), expected[valid], **TOL)
    assert torch.count_nonzero(out[~valid]) == 0  # padding rows come back as zeros


@pytest.mark.parametrize("kv_heads", [3, 1])
def test_cross_attention_with_different_key_lengths(kv_heads):
    cu_q = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 5, 10], dtype=torch.int64)  # int64 accepted too
    q = rand(7, 3, 16, seed=4)  # one trailing padding query row
    k, v = rand(11, kv_heads, 16, seed=5), rand(11, kv_heads, 16, seed=6)  # one padding key row
    out = sdpa_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    expected, valid = dense_packed_reference(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out[valid].double(), expected[valid], **TOL)
    assert torch.count_nonzero(out[6]) == 0


def test_causal_is_applied_within_each_document():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    q, k, v = rand(9, 2, 8, seed=7), rand(9, 2, 8, seed=8), rand(9, 2, 8, seed=9)
    out = sdpa_attention(q, k, v, cu_seqlens_q=cu, causal=True)
    expected, _ = dense_packed_reference(q, k, v, cu, causal=True)
    torch.testing.assert_close(out.double(), expected, **TOL)
    # the first token of each document attends only to itself: its output is its own value row
    for start in (0, 3, 4):
        torch.testing.assert_close(out[start], v[start], **TOL)


def test_custom_scale_is_honoured():
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    q, k, v = rand(9, 2, 8, seed=10), rand(9, 2, 8, seed=11), rand(9, 2, 8, seed=12)
    out = sdpa_attention(q, k, v, cu_seqlens_q=cu, scale=0.05)
    qi = doc_ids(cu.tolist(), 9)
    expected = naive_attention(q[None], k[None], v[None], (qi[:, None] == qi[None, :])[None], scale=0.05)[0]
    torch.testing.assert_close(out.double(), expected, **TOL)


def test_bfloat16_packed_is_close_to_float64_reference():
    cu = torch.tensor([0, 6, 7, 16], dtype=torch.int32)
    q, k, v = (rand(16, 4, 32, seed=s, dtype=torch.bfloat16) for s in (13, 14, 15))
    out = sdpa_attention(q, k, v, cu_seqlens_q=cu)
    assert out.dtype == torch.bfloat16
    expected, _ = dense_packed_reference(q, k, v, cu)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("perturbed", [0, 1, 2])
def test_perturbing_one_document_leaves_the_others_bit_identical(perturbed):
    ps = PackedSequence.from_lengths([4, 1, 6], pad_to_multiple=4)  # 11 rows -> 12
    q, k, v = (rand(ps.padded_length, 2, 8, seed=s) for s in (16, 17, 18))
    cu = ps.cu_seqlens()
    base = sdpa_attention(q, k, v, cu_seqlens_q=cu)
    o = ps.offsets
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[o[perturbed]:o[perturbed + 1]] += rand(o[perturbed + 1] - o[perturbed], 2, 8, seed=99) * 3
    t_pad = ps.valid_length
    k2[t_pad:] = 1e4  # garbage in padding keys/values must not leak either
    v2[t_pad:] = -1e4
    out = sdpa_attention(q2, k2, v2, cu_seqlens_q=cu)
    for i in range(3):
        same = torch.equal(out[o[i]:o[i + 1]], base[o[i]:o[i + 1]])
        assert same == (i != perturbed), f"document {i} (perturbed {perturbed})"


def test_dense_mode_matches_naive_with_and_without_mask_and_gqa():
    q, k, v = rand(2, 5, 4, 8, seed=20), rand(2, 6, 2, 8, seed=21), rand(2, 6, 2, 8, seed=22)
    torch.testing.assert_close(sdpa_attention(q, k, v).double(), naive_attention(q, k, v), **TOL)
    mask = rand(2, 5, 6, seed=23) > 0
    mask[..., 0] = True  # every query sees at least one key
    out = sdpa_attention(q, k, v, attn_mask=mask[:, None])
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, mask), **TOL)


def test_packed_equals_dense_per_document_batch():
    """Equal-length documents packed == the same documents as a dense batch."""
    docs = rand(3, 5, 2, 8, seed=24), rand(3, 5, 2, 8, seed=25), rand(3, 5, 2, 8, seed=26)
    dense = sdpa_attention(*docs)
    cu = PackedSequence.from_lengths([5, 5, 5]).cu_seqlens()
    packed = sdpa_attention(*(d.reshape(15, 2, 8) for d in docs), cu_seqlens_q=cu)
    torch.testing.assert_close(packed.reshape(3, 5, 2, 8), dense, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"cu_seqlens_q": torch.tensor([1, 4])}, r"cu_seqlens_q\[0\] must be 0"),
    ({"cu_seqlens_q": torch.tensor([0, 5, 3, 6])}, "non-decreasing"),
    ({"cu_seqlens_q": torch.tensor([0, 9])}, "exceeds the packed length 6"),
    ({"cu_seqlens_q": torch.tensor([[0, 6]])}, "1-D tensor"),
    ({"cu_seqlens_q": torch.tensor([0])}, "at least 2 entries"),
    ({"cu_seqlens_q": torch.tensor([0, 6]), "cu_seqlens_k": torch.tensor([0, 3, 6])}, "1 documents but"),
    ({"cu_seqlens_q": torch.tensor([0, 3, 6]), "cu_seqlens_k": torch.tensor([0, 3, 3])}, "document 1 has 3 queries but no keys"),
    ({"cu_seqlens_q": torch.tensor([0, 6]), "attn_mask": torch.ones(6, 6, dtype=torch.bool)}, "takes no attn_mask"),
    ({"cu_seqlens_k": torch.tensor([0, 6])}, "cu_seqlens_k given without cu_seqlens_q"),
])
def test_packed_errors_name_the_problem(kwargs, message):
    q = k = v = rand(6, 2, 4, seed=27)
    with pytest.raises(ValueError, match=message):
        sdpa_attention(q, k, v, **kwargs)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"packed attention takes \[T, H, D\] \(or a batch of one\)"):
        sdpa_attention(rand(2, 6, 2, 4), rand(2, 6, 2, 4), rand(2, 6, 2, 4), cu_seqlens_q=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match=r"packed attention expects q, k, v as \[T, H, D\]"):
        sdpa_attention(rand(6, 2, 4), rand(6, 2), rand(6, 2), cu_seqlens_q=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match=r"dense attention expects q as \[B, S, H, D\]"):
        sdpa_attention(rand(6, 2, 4), rand(6, 2, 4), rand(6, 2, 4))
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"):
        sdpa_attention(rand(1, 4, 3, 4), rand(1, 4, 2, 4), rand(1, 4, 2, 4))


# ------------------------------------------------------------------------------------------- PackedSequence


def test_packed_sequence_metadata():
    ps = PackedSequence.from_lengths([3, 1, 4], pad_to_multiple=4)
    assert ps.offsets == (0, 3, 4, 8) and ps.valid_length == 8 and ps.padded_length == 8
    assert ps.max_seqlen == 4
    cu = ps.cu_seqlens()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 8]
    ps = PackedSequence.from_lengths([3, 2], pad_to_multiple=4)
    assert ps.padded_length == 8 and ps.valid_length == 5
    assert PackedSequence.from_lengths([5]).padded_length == 5


def test_pack_and_split_round_trip_with_zero_padding():
    ps = PackedSequence.from_lengths([2, 3], pad_to_multiple=8)
    docs = [rand(2, 4, seed=30), rand(3, 4, seed=31)]
    packed = ps.pack(docs)
    assert packed.shape == (8, 4)
    assert torch.count_nonzero(packed[5:]) == 0
    parts = ps.split(packed)
    assert len(parts) == 2 and all(torch.equal(a, b) for a, b in zip(parts, docs))


@pytest.mark.parametrize("lengths, multiple, message", [
    ([], 1, "non-empty"),
    ([3, -1], 1, "non-negative"),
    ([3], 0, "pad_to_multiple must be >= 1"),
])
def test_packed_sequence_rejects_bad_lengths(lengths, multiple, message):
    with pytest.raises(ValueError, match=message):
        PackedSequence.from_lengths(lengths, pad_to_multiple=multiple)


def test_pack_rejects_documents_that_do_not_match_the_lengths():
    with pytest.raises(ValueError, match="do not match"):
        PackedSequence.from_lengths([2, 3]).pack([rand(3, 4), rand(2, 4)])


def test_packed_sequence_drives_sdpa_end_to_end():
    ps = PackedSequence.from_lengths([3, 6, 1], pad_to_multiple=16)
    docs_q = [rand(n, 2, 8, seed=40 + i) for i, n in enumerate(ps.lengths)]
    docs_kv = [rand(n, 2, 8, seed=50 + i) for i, n in enumerate(ps.lengths)]
    out = sdpa_attention(ps.pack(docs_q), ps.pack(docs_kv), ps.pack(docs_kv), cu_seqlens_q=ps.cu_seqlens())
    for part, dq, dkv in zip(ps.split(out), docs_q, docs_kv):
        torch.testing.assert_close(part.double(), naive_attention(dq[None], dkv[None], dkv[None])[0], **TOL)
