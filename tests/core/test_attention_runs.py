"""The ``sdpa`` reference's run decomposition (one SDPA per run of queries sharing a key prefix) against ONE
explicit dense-mask computation over the whole packed sequence: random spans, several documents, GQA, prefix
K/V, ``[real | pad]`` packing, overlapping spans, row-blocked masks — plus the run planner itself."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from omnicore.attention import reference
from omnicore.attention.metadata import AttentionMetadata, AttentionSpan, QueryRun, query_runs
from omnicore.attention.packed import PackedSequence
from omnicore.attention.reference import sdpa_attention

TOL = {"atol": 2e-5, "rtol": 2e-5}


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dense_allowed(md: AttentionMetadata, total_q: int, total_k: int) -> torch.Tensor:
    """``[Tq, Tk]`` bool written from the definition, cell by cell: a query at document position ``p`` sees key
    ``j`` of its own document when ``j <= p`` or some span holds both; keys and self-attention queries at or
    past ``valid_kv_length`` take part in nothing."""
    allowed = torch.zeros(total_q, total_k, dtype=torch.bool)
    cq, ck = md.cu_seqlens_q, md.cu_k
    valid = md.valid_kv_length if md.valid_kv_length is not None else total_k
    for d in range(md.num_docs):
        lq, lk = cq[d + 1] - cq[d], ck[d + 1] - ck[d]
        spans = md.spans[d] if md.spans is not None else ()
        for i in range(lq):
            p = lk - lq + i
            if md.cu_seqlens_k is None and cq[d] + i >= valid:
                continue
            for j in range(lk):
                if ck[d] + j >= valid:
                    continue
                sees = not md.causal or j <= p or any(s.start <= p < s.end and s.start <= j < s.end for s in spans)
                allowed[cq[d] + i, ck[d] + j] = sees
    return allowed


def masked_float64(q, k, v, allowed, scale=None):
    """Softmax attention with an explicit ``[Tq, Tk]`` mask in float64; GQA by repeating K/V heads."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).double() for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    w = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", w, v)


def random_spans(rng: random.Random, length: int, overlapping: bool = False) -> tuple[AttentionSpan, ...]:
    spans, p = [], 0
    while p < length and rng.random() < 0.8:
        start = rng.randrange(p, length)
        end = rng.randrange(start + 1, length + 1)
        spans.append(AttentionSpan(start, end))
        p = rng.randrange(start + 1, end + 1) if overlapping else end
    return tuple(spans)


def check(md: AttentionMetadata, heads: int, kv_heads: int, seed: int, scale=None):
    total_q, total_k = md.total_q + 3, md.total_k + 3  # rows past the last document stay untouched (zeros)
    q, k, v = rand(total_q, heads, 16, seed=seed), rand(total_k, kv_heads, 16, seed=seed + 1), \
        rand(total_k, kv_heads, 16, seed=seed + 2)
    allowed = dense_allowed(md, total_q, total_k)
    out = sdpa_attention(q, k, v, metadata=md, scale=scale)
    seen = allowed.any(dim=1)
    assert out.shape == (total_q, heads, 16)
    torch.testing.assert_close(out[seen].double(), masked_float64(q, k, v, allowed, scale)[seen], **TOL)
    assert torch.count_nonzero(out[~seen]) == 0
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_random_spans_in_several_documents_match_the_dense_mask(seed, heads, kv_heads):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 5, 17, 40]) for _ in range(rng.randint(2, 5))]
    spans = tuple(random_spans(rng, n) for n in lengths)
    md = AttentionMetadata.from_lengths(lengths, causal=True, spans=spans)
    check(md, heads, kv_heads, seed=10 * seed, scale=0.2 if seed % 2 else None)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_kv_documents_with_spans_are_bottom_right_aligned(seed):
    rng = random.Random(100 + seed)
    lk = [rng.choice([6, 23, 31]) for _ in range(3)]
    lq = [rng.randint(1, n) for n in lk]
    md = AttentionMetadata.from_lengths(lq, lk, causal=True, spans=tuple(random_spans(rng, n) for n in lk))
    check(md, 8, 2, seed=seed)


def test_real_pad_packing_with_spans_cuts_keys_and_queries_at_valid_kv_length():
    ps = PackedSequence.from_lengths([9, 12], pad_to_multiple=8)  # 21 real rows -> 24
    spans = ((AttentionSpan(2, 6),), (AttentionSpan(4, 12),))
    check(AttentionMetadata.from_packed(ps, causal=True, spans=spans), 4, 2, seed=7)
    # one document whose keys past valid_kv_length are padding while a span runs into them
    md = AttentionMetadata(cu_seqlens_q=(0, 20), valid_kv_length=13, causal=True, spans=((AttentionSpan(8, 18),),))
    check(md, 4, 2, seed=8)
    cross = AttentionMetadata(cu_seqlens_q=(0, 5, 9), cu_seqlens_k=(0, 10, 20), valid_kv_length=16, causal=True,
                              spans=((AttentionSpan(6, 10),), (AttentionSpan(3, 9),)))
    check(cross, 4, 1, seed=9)


@pytest.mark.parametrize("seed", range(3))
def test_overlapping_spans_see_the_union(seed):
    rng = random.Random(200 + seed)
    spans = random_spans(rng, 30, overlapping=True)
    check(AttentionMetadata.from_lengths([30, 7], causal=True, spans=(spans, (AttentionSpan(1, 3),))), 4, 2, seed)


def test_more_queries_than_keys_leaves_the_unseeing_rows_zero():
    md = AttentionMetadata(cu_seqlens_q=(0, 6), cu_seqlens_k=(0, 4), causal=True, spans=((AttentionSpan(1, 3),),))
    check(md, 2, 2, seed=11)


def test_long_causal_runs_are_masked_in_row_blocks_and_spans_take_no_mask(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[-2], k.shape[-2], None if attn_mask is None else attn_mask.numel(), kwargs))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(reference.F, "scaled_dot_product_attention", spy)
    spans = ((AttentionSpan(4, 20), AttentionSpan(30, 50)),)
    md = AttentionMetadata(cu_seqlens_q=(0, 40), cu_seqlens_k=(0, 64), causal=True, spans=spans)  # queries 24..63
    check(md, 8, 2, seed=12)
    assert [c[:3] for c in calls] == [(6, 30, 6 * 30), (20, 50, None), (14, 64, 14 * 64)]
    assert all(c[3]["enable_gqa"] for c in calls)  # K/V heads are never repeated
    calls.clear()
    monkeypatch.setattr(reference, "MASK_BLOCK_ELEMENTS", 200)  # at most 200 mask cells a call
    check(md, 8, 2, seed=12)
    masks = [c[2] for c in calls if c[2] is not None]
    assert len(masks) > 2 and max(masks) <= 200
    calls.clear()
    check(AttentionMetadata(cu_seqlens_q=(0, 30), causal=True), 2, 2, seed=13)  # plain causal: is_causal, no mask
    assert [(c[0], c[1], c[2], c[3]["is_causal"]) for c in calls] == [(30, 30, None, True)]


def test_dense_bottom_right_causal_uses_the_runs_and_matches_the_mask():
    q, k, v = rand(2, 5, 4, 8, seed=14), rand(2, 9, 2, 8, seed=15), rand(2, 9, 2, 8, seed=16)
    allowed = torch.arange(9)[None, :] <= (torch.arange(5) + 4)[:, None]
    out = sdpa_attention(q, k, v, causal=True)
    for b in range(2):
        torch.testing.assert_close(out[b].double(), masked_float64(q[b], k[b], v[b], allowed), **TOL)


def test_query_runs_plan():
    s = AttentionSpan
    assert query_runs(0, 6, (s(2, 4),)) == (QueryRun(0, 2, 2, causal=True), QueryRun(2, 4, 4), QueryRun(4, 6, 6, True))
    assert query_runs(3, 6, (s(2, 4),)) == (QueryRun(3, 4, 4), QueryRun(4, 6, 6, causal=True))  # starts in a span
    assert query_runs(0, 4, (s(0, 4),)) == (QueryRun(0, 4, 4),)
    # a single causal token needs no mask; equal prefixes merge
    assert query_runs(0, 5, (s(0, 2), s(3, 5))) == (QueryRun(0, 2, 2), QueryRun(2, 3, 3), QueryRun(3, 5, 5))
    # overlapping spans: the longest reach wins; keys past key_limit are cut
    assert query_runs(0, 8, (s(1, 6), s(4, 8)), key_limit=7) == (QueryRun(0, 1, 1), QueryRun(1, 4, 6),
                                                                QueryRun(4, 8, 7))
    assert query_runs(2, 9, key_limit=5) == (QueryRun(2, 5, 5, causal=True), QueryRun(5, 9, 5))
    assert query_runs(4, 4) == ()
    with pytest.raises(ValueError, match="0 <= start <= end"):
        query_runs(-1, 3)
