"""Attention metadata (host-int lengths, cached device cu_seqlens) and the ``sdpa`` reference's handling of it:
documents, ``valid_kv_length`` ([real | pad]), prefix K/V, causal, bidirectional spans, GQA, sparse plans — checked
against independent masked computations, with no device read on the host."""

from __future__ import annotations

import attrs
import pytest
import torch
from omnicore.attention.metadata import AttentionMetadata, AttentionSpan
from omnicore.attention.packed import PackedSequence
from omnicore.attention.reference import sdpa_attention


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def masked(q, k, v, allowed, scale=None):
    """Independent dense computation: ``allowed [Sq, Sk]`` bool; GQA by repeating kv heads; float64."""
    h, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hkv, dim=1).double()
    v = v.repeat_interleave(h // hkv, dim=1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).float()


# ------------------------------------------------------------------------------------------- the record


def test_lengths_are_host_ints_and_defaults_derive_from_them():
    md = AttentionMetadata(cu_seqlens_q=[0, 5, 8])
    assert md.cu_seqlens_q == (0, 5, 8) and md.cu_seqlens_k is None and md.cu_k == (0, 5, 8)
    assert (md.max_seqlen_q, md.max_seqlen_k, md.num_docs, md.total_q) == (5, 5, 2, 8)
    md = AttentionMetadata.from_lengths([3, 4], [7, 1])
    assert md.cu_seqlens_q == (0, 3, 7) and md.cu_seqlens_k == (0, 7, 8) and md.max_seqlen_k == 7
    assert md.doc_lengths() == [(3, 7), (4, 1)]


@pytest.mark.parametrize("kwargs, message", [
    ({"cu_seqlens_q": torch.tensor([0, 4])}, "host ints"),
    ({"cu_seqlens_q": (1, 4)}, r"cu_seqlens_q\[0\] must be 0"),
    ({"cu_seqlens_q": (0, 4, 2)}, "non-decreasing"),
    ({"cu_seqlens_q": (0, 4.0)}, "Python ints"),
    ({"cu_seqlens_q": (0, 4), "cu_seqlens_k": (0, 2, 4)}, "1 documents but cu_seqlens_k has 2"),
    ({"cu_seqlens_q": (0, 8), "max_seqlen_q": 5.0}, "max_seqlen_q must be a non-negative Python int"),
    ({"cu_seqlens_q": (0, 8), "valid_kv_length": 9}, r"valid_kv_length must be a Python int in \(0, 8\]"),
    ({"cu_seqlens_q": (0, 8), "valid_kv_length": 0}, "valid_kv_length"),
    ({"cu_seqlens_q": (0, 8), "spans": ((AttentionSpan(0, 2),),)}, "set causal=True"),
    ({"cu_seqlens_q": (0, 8), "causal": True, "spans": ()}, "one tuple per document"),
    ({"cu_seqlens_q": (0, 8), "causal": True, "spans": (((2, 9),),)}, "exceeds its 8 keys"),
    ({"cu_seqlens_q": (0, 8), "latent_grid": (2, 0, 4)}, "latent_grid"),
])
def test_invalid_metadata_is_rejected_naming_the_field(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        AttentionMetadata(**kwargs)
    with pytest.raises(ValueError, match="start < end"):
        AttentionSpan(4, 4)


def test_device_copies_are_made_once_and_shared():
    md = AttentionMetadata(cu_seqlens_q=(0, 3, 9))
    t = md.cu_seqlens_q_tensor("cpu")
    assert t.dtype == torch.int32 and t.tolist() == [0, 3, 9]
    assert md.cu_seqlens_q_tensor("cpu") is t and md.cu_seqlens_k_tensor("cpu") is t  # shared when k = q
    assert md.cu_seqlens_q_tensor("cpu", torch.int64).dtype == torch.int64
    cross = AttentionMetadata(cu_seqlens_q=(0, 3), cu_seqlens_k=(0, 5))
    assert cross.cu_seqlens_k_tensor().tolist() == [0, 5]
    assert md == AttentionMetadata(cu_seqlens_q=(0, 3, 9)) and hash(md) == hash(AttentionMetadata(cu_seqlens_q=(0, 3, 9)))


def test_from_packed_makes_padding_a_trailing_document():
    ps = PackedSequence.from_lengths([5], pad_to_multiple=8)
    md = AttentionMetadata.from_packed(ps)
    assert (md.cu_seqlens_q, md.max_seqlen_q, md.valid_kv_length) == ((0, 5, 8), 5, 5)  # the (8, 2, 4) [real | pad] shape
    plain = AttentionMetadata.from_packed(ps, pad_document=False)
    assert plain.cu_seqlens_q == (0, 5) and plain.valid_kv_length is None
    exact = AttentionMetadata.from_packed(PackedSequence.from_lengths([3, 5]))
    assert exact.cu_seqlens_q == (0, 3, 8) and exact.valid_kv_length is None


# ------------------------------------------------------------------------------------------- the reference


def test_valid_kv_length_matches_a_padding_mask_and_needs_no_device_read(monkeypatch):
    q, k, v = rand(8, 2, 4, seed=1), rand(8, 2, 4, seed=2), rand(8, 2, 4, seed=3)
    md = AttentionMetadata(cu_seqlens_q=(0, 5, 8), max_seqlen_q=5, max_seqlen_k=5, valid_kv_length=5)
    allowed = (torch.arange(8) < 5)[None, :].expand(5, 8)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a device tensor was read on the host"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a device tensor was read on the host"))
    out = sdpa_attention(q, k, v, metadata=md)
    monkeypatch.undo()
    torch.testing.assert_close(out[:5], masked(q[:5], k, v, allowed), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
    single = AttentionMetadata(cu_seqlens_q=(0, 8), valid_kv_length=5)  # one document with a padded key tail
    torch.testing.assert_close(sdpa_attention(q, k, v, metadata=single)[:5], out[:5])
    batched = sdpa_attention(q[None], k[None], v[None], metadata=md)  # a leading batch of one
    assert batched.shape == (1, 8, 2, 4) and torch.equal(batched[0], out)


def test_prefix_kv_documents_causal_is_bottom_right_aligned():
    md = AttentionMetadata(cu_seqlens_q=(0, 3, 7), cu_seqlens_k=(0, 6, 10), causal=True)
    q, k, v = rand(7, 4, 8, seed=4), rand(10, 2, 8, seed=5), rand(10, 2, 8, seed=6)  # GQA 4 over 2
    out = sdpa_attention(q, k, v, metadata=md)
    for (qs, qe), (ks, ke) in (((0, 3), (0, 6)), ((3, 7), (6, 10))):
        lq, lk = qe - qs, ke - ks
        allowed = torch.arange(lk)[None, :] <= (torch.arange(lq) + lk - lq)[:, None]
        torch.testing.assert_close(out[qs:qe], masked(q[qs:qe], k[ks:ke], v[ks:ke], allowed), atol=1e-5, rtol=1e-5)
    # the causal keyword and metadata.causal mean the same
    plain = attrs.evolve(md, causal=False)
    torch.testing.assert_close(sdpa_attention(q, k, v, metadata=plain, causal=True), out)
    # without causal, a prefix document attends to all its keys
    torch.testing.assert_close(sdpa_attention(q, k, v, metadata=plain)[0:3],
                               masked(q[0:3], k[0:6], v[0:6], torch.ones(3, 6, dtype=torch.bool)), atol=1e-5, rtol=1e-5)


def test_spans_are_bidirectional_islands_in_causal_documents():
    spans = ((AttentionSpan(2, 6),), ())  # document 0: an "image" at positions 2..5; document 1: plain causal
    md = AttentionMetadata(cu_seqlens_q=(0, 9, 14), causal=True, spans=spans)
    q, k, v = (rand(14, 2, 8, seed=s) for s in (7, 8, 9))
    out = sdpa_attention(q, k, v, metadata=md, scale=0.3)
    pos = torch.arange(9)
    allowed = pos[None, :] <= pos[:, None]
    image = (pos >= 2) & (pos < 6)
    allowed |= image[:, None] & image[None, :]
    assert allowed[2, 5] and not allowed[1, 2] and not allowed[6, 7]  # image tokens see later image tokens only
    torch.testing.assert_close(out[:9], masked(q[:9], k[:9], v[:9], allowed, 0.3), atol=1e-5, rtol=1e-5)
    causal5 = torch.arange(5)[None, :] <= torch.arange(5)[:, None]
    torch.testing.assert_close(out[9:], masked(q[9:], k[9:], v[9:], causal5, 0.3), atol=1e-5, rtol=1e-5)


def test_sparse_plan_is_ignored_by_the_dense_reference_and_legacy_keywords_still_work():
    md = AttentionMetadata(cu_seqlens_q=(0, 4, 10))
    q, k, v = (rand(10, 2, 8, seed=s) for s in (10, 11, 12))
    base = sdpa_attention(q, k, v, metadata=md)
    assert torch.equal(sdpa_attention(q, k, v, metadata=attrs.evolve(md, sparse_plan={"blocks": [1]})), base)
    assert torch.equal(sdpa_attention(q, k, v, cu_seqlens_q=torch.tensor([0, 4, 10])), base)
    with pytest.raises(ValueError, match="either metadata= or the legacy"):
        sdpa_attention(q, k, v, metadata=md, cu_seqlens_q=torch.tensor([0, 4, 10]))


def test_dense_causal_with_more_keys_is_bottom_right():
    q, k, v = rand(1, 3, 2, 8, seed=13), rand(1, 5, 2, 8, seed=14), rand(1, 5, 2, 8, seed=15)
    allowed = torch.arange(5)[None, :] <= (torch.arange(3) + 2)[:, None]
    torch.testing.assert_close(sdpa_attention(q, k, v, causal=True)[0], masked(q[0], k[0], v[0], allowed),
                               atol=1e-5, rtol=1e-5)
