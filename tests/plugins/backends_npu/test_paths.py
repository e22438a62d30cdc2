"""The MindIE-SD dispatch paths through the op seam: what each path hands MindIE-SD (shapes, views, scale,
op type, layout, mask) and what it returns, checked with the CPU implementation of the documented op semantics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _npu_helpers import needs_npu
from omni_backends_npu import seam
from omni_backends_npu.attention import npu_laser_attention, npu_varlen_attention, packed_mask
from omni_backends_npu.cpu_reference import CpuReferenceOps
from omnicore.attention.metadata import AttentionMetadata
from omnicore.attention.reference import sdpa_attention


@pytest.fixture
def ops():
    with seam.use_ops(CpuReferenceOps()) as installed:
        yield installed


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


H3 = AttentionMetadata(cu_seqlens_q=(0, 5, 8), max_seqlen_q=5, max_seqlen_k=5, valid_kv_length=5)


def _ref_real_rows(q, k, v, used, scale=None):
    return sdpa_attention(q[:used], k[:used], v[:used], metadata=AttentionMetadata(cu_seqlens_q=(0, used)),
                          scale=scale)


# ---------------------------------------------------------------------------------------------- dispatch step 3
@pytest.mark.parametrize("backend", [npu_varlen_attention, npu_laser_attention])
def test_models_that_do_not_pack_take_only_the_masked_path(ops, backend):
    q, k, v = rand(2, 7, 2, 4, seed=1), rand(2, 7, 2, 4, seed=2), rand(2, 7, 2, 4, seed=3)
    mask = torch.rand(2, 1, 7, 7, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[..., 0] = True
    out = backend(q, k, v, attn_mask=mask, scale=0.3)
    (call,) = ops.calls  # neither packed branch: one op call
    assert call.op == "attention" and call.kwargs["op_type"] == "fused_attn_score"
    assert call.query is q and call.key is k and call.value is v and call.kwargs["attn_mask"] is mask
    assert call.kwargs["scale"] == 0.3
    assert out is call.output  # returned unchanged
    torch.testing.assert_close(out, sdpa_attention(q, k, v, attn_mask=mask, scale=0.3))


# ---------------------------------------------------------------------------------------------- laser path
@pytest.mark.parametrize("batched", [False, True])
def test_varlen_path_must_case(ops, batched):
    """(8, 2, 4), cu = [0, 5, 8], max 5: TND with host lists [0, 5, 8], the softmax scale, no mask built."""
    q, k, v = rand(8, 2, 4, seed=5), rand(8, 2, 4, seed=6), rand(8, 2, 4, seed=7)
    args = (q[None], k[None], v[None]) if batched else (q, k, v)
    out = npu_varlen_attention(*args, metadata=H3, scale=0.5)
    (call,) = ops.calls
    assert call.op == "varlen_attention"
    assert tuple(call.query.shape) == (8, 2, 4) and call.query.data_ptr() == q.data_ptr()  # batch dim dropped
    assert call.kwargs["cu_seqlens_q"] == [0, 5, 8] and call.kwargs["cu_seqlens_k"] == [0, 5, 8]
    assert all(type(x) is int for x in call.kwargs["cu_seqlens_q"])
    assert call.kwargs["scale"] == 0.5 and "attn_mask" not in call.kwargs
    assert tuple(out.shape) == ((1, 8, 2, 4) if batched else (8, 2, 4))  # batch dim restored
    got = out[0] if batched else out
    torch.testing.assert_close(got[:5], _ref_real_rows(q, k, v, 5, 0.5))


def test_varlen_default_scale_is_one_over_sqrt_d(ops):
    q = rand(8, 2, 4, seed=8)
    npu_varlen_attention(q, q, q, metadata=H3)
    assert ops.calls[0].kwargs["scale"] == 0.5


# ---------------------------------------------------------------------------------------------- laser scale
def test_laser_path_must_case_with_input_scale(ops):
    """q (1, 8, 2, 4), cu = [0, 5, 8], max 5, f = 256: K/V (1, 5, 2, 4), Q (1, 8, 2, 4), mask None, query q/256,
    key q[:, :5]/256, scale 0.5 * 256**2, output = kernel output * 256."""
    q = rand(1, 8, 2, 4, seed=9)
    out = npu_laser_attention(q, q, q, metadata=H3, laser_input_scale=256)
    (call,) = ops.calls
    assert call.op == "attention" and call.kwargs["attn_mask"] is None
    assert tuple(call.query.shape) == (1, 8, 2, 4) and tuple(call.key.shape) == (1, 5, 2, 4)
    assert tuple(call.value.shape) == (1, 5, 2, 4)
    assert torch.equal(call.query, q / 256) and torch.equal(call.key, q[:, :5] / 256)
    assert torch.equal(call.value, q[:, :5] / 256)
    assert call.kwargs["scale"] == 0.5 * 256 ** 2
    assert call.kwargs["layout"] == "BNSD"  # forced: the laser kernel supports only BNSD; inputs stay BSND
    assert call.kwargs["op_type"] == "ascend_laser_attention"
    assert torch.equal(out, call.output * 256)
    torch.testing.assert_close(out[0, :5], _ref_real_rows(q[0], q[0], q[0], 5))


def test_laser_path_must_case_without_input_scale(ops):
    q, k, v = rand(1, 8, 2, 4, seed=10), rand(1, 8, 2, 4, seed=11), rand(1, 8, 2, 4, seed=12)
    out = npu_laser_attention(q, k, v, metadata=H3)
    (call,) = ops.calls
    assert call.query.data_ptr() == q.data_ptr() and tuple(call.query.shape) == (1, 8, 2, 4)  # unchanged
    # K/V are zero-copy views [:, :used_k]
    assert call.key.data_ptr() == k.data_ptr() and call.key._base is not None and tuple(call.key.shape) == (1, 5, 2, 4)
    assert call.value.data_ptr() == v.data_ptr() and tuple(call.value.shape) == (1, 5, 2, 4)
    assert call.kwargs["scale"] == 0.5 and call.kwargs["attn_mask"] is None
    assert out.data_ptr() == call.output.data_ptr() and torch.equal(out, call.output)  # unscaled, not copied
    torch.testing.assert_close(out[0, :5], _ref_real_rows(q[0], k[0], v[0], 5))


@pytest.mark.parametrize("f", [2, 256, 1024])
def test_power_of_two_input_scale_is_exact(ops, f):
    q, k, v = rand(8, 2, 4, seed=13), rand(8, 2, 4, seed=14), rand(8, 2, 4, seed=15)
    plain = npu_laser_attention(q, k, v, metadata=H3)
    scaled = npu_laser_attention(q, k, v, metadata=H3, laser_input_scale=f)
    torch.testing.assert_close(scaled[:5], plain[:5], atol=1e-6, rtol=1e-6)


def test_dropping_the_padding_document_equals_masking_it(ops):
    q, k, v = rand(8, 2, 4, seed=16), rand(8, 2, 4, seed=17), rand(8, 2, 4, seed=18)
    laser = npu_laser_attention(q, k, v, metadata=H3)
    k2, v2 = k.clone(), v.clone()
    k2[5:], v2[5:] = 1e4, -1e4
    assert torch.equal(npu_laser_attention(q, k2, v2, metadata=H3)[:5], laser[:5])


# ---------------------------------------------------------------------------------------------- dispatch step 1
@pytest.mark.parametrize("env", [None, "ascend_laser_attention", "prompt_flash_attn", "fused_attn_score",
                                 "ascend_laser_atention", "garbage"])
def test_the_path_follows_the_backend_not_the_environment(ops, monkeypatch, env):
    """The seed switched on MINDIE_SD_FA_TYPE; here the backend name decides and the variable is ignored."""
    if env is None:
        monkeypatch.delenv("MINDIE_SD_FA_TYPE", raising=False)
    else:
        monkeypatch.setenv("MINDIE_SD_FA_TYPE", env)
    q = rand(8, 2, 4, seed=19)
    npu_varlen_attention(q, q, q, metadata=H3)
    npu_laser_attention(q, q, q, metadata=H3)
    assert [c.op for c in ops.calls] == ["varlen_attention", "attention"]
    assert ops.calls[1].kwargs["op_type"] == "ascend_laser_attention"


# ---------------------------------------------------------------------------------------------- dispatch step 2
FALLBACKS = [
    # (metadata, rows, used): layouts that do not resolve, with one real document then padding
    (AttentionMetadata(cu_seqlens_q=(0, 24), max_seqlen_q=17, max_seqlen_k=17, valid_kv_length=17), 24, 17),
    (AttentionMetadata(cu_seqlens_q=(0, 3, 8), max_seqlen_q=3, max_seqlen_k=3, valid_kv_length=3), 8, 3),
]


@pytest.mark.parametrize(("backend", "causal"), [(npu_laser_attention, False), (npu_varlen_attention, True)])
@pytest.mark.parametrize(("metadata", "rows", "used"), FALLBACKS)
def test_unresolved_packing_rebuilds_the_mask_from_valid_kv_length(ops, backend, causal, metadata, rows, used):
    """npu_laser for every unresolved layout; npu_varlen for causal ones (see the next test for the others)."""
    q, k, v = rand(rows, 2, 4, seed=20), rand(rows, 2, 4, seed=21), rand(rows, 2, 4, seed=22)
    out = backend(q, k, v, metadata=metadata, causal=causal)
    (call,) = ops.calls
    assert call.op == "attention" and call.kwargs["op_type"] == "fused_attn_score"
    mask = call.kwargs["attn_mask"]
    want = (torch.arange(rows) < used).expand(1, 1, rows, rows)  # arange(S) < used, broadcast
    if causal:
        want = want & packed_mask(metadata, rows, rows, causal=True, device="cpu")
        want[..., used:, :used] = True  # padding rows see every real key
        assert torch.equal(mask, want)
        ref = sdpa_attention(q[:used], k[:used], v[:used], metadata=AttentionMetadata(cu_seqlens_q=(0, used)),
                             causal=True)
        torch.testing.assert_close(out[:used], ref)
        return
    (call,) = ops.calls
    assert call.op == "attention" and call.kwargs["op_type"] == "fused_attn_score"
    mask = call.kwargs["attn_mask"]
    want = (torch.arange(rows) < used).expand(1, 1, rows, rows)  # arange(S) < used, broadcast
    assert mask.dtype == torch.bool and torch.equal(mask.expand(1, 1, rows, rows), want)
    assert tuple(call.query.shape) == (1, rows, 2, 4)
    torch.testing.assert_close(out[:used], _ref_real_rows(q, k, v, used))


@pytest.mark.parametrize(("metadata", "rows", "used"), FALLBACKS)
def test_npu_varlen_takes_unresolved_non_causal_layouts_as_documents(ops, metadata, rows, used):
    """Host-int offsets let the varlen op take the real documents directly: keys clipped at valid_kv_length, a
    trailing padding document left out (zeros), no mask."""
    q, k, v = rand(rows, 2, 4, seed=20), rand(rows, 2, 4, seed=21), rand(rows, 2, 4, seed=22)
    out = npu_varlen_attention(q, k, v, metadata=metadata)
    (call,) = ops.calls
    assert call.op == "varlen_attention" and "attn_mask" not in call.kwargs
    real_q = metadata.cu_seqlens_q[1] if len(metadata.cu_seqlens_q) == 3 else rows
    assert call.kwargs["cu_seqlens_q"] == [0, real_q] and call.kwargs["cu_seqlens_k"] == [0, used]
    assert call.query.data_ptr() == q.data_ptr() and call.query.shape[0] == real_q
    torch.testing.assert_close(out[:used], _ref_real_rows(q, k, v, used))
    assert torch.equal(out[real_q:], torch.zeros(rows - real_q, 2, 4))


@pytest.mark.parametrize("backend", [npu_varlen_attention, npu_laser_attention])
def test_two_real_documents_are_never_read_as_real_and_padding(ops, backend):
    """LingBot's batch CFG: cu = [0, 5, 9], no valid_kv_length. The laser slice would let the second document
    attend to the first one's keys; npu_laser isolates them with the masked path, npu_varlen passes both documents
    to the varlen op; both match the reference on every row."""
    md = AttentionMetadata(cu_seqlens_q=(0, 5, 9), max_seqlen_q=5, max_seqlen_k=5)
    q, k, v = rand(9, 2, 4, seed=23), rand(9, 2, 4, seed=24), rand(9, 2, 4, seed=25)
    out = backend(q, k, v, metadata=md)
    (call,) = ops.calls
    if backend is npu_varlen_attention:
        assert call.op == "varlen_attention" and call.kwargs["cu_seqlens_q"] == call.kwargs["cu_seqlens_k"] == [0, 5, 9]
    else:
        assert call.op == "attention" and call.kwargs["op_type"] == "fused_attn_score"
        block = torch.zeros(9, 9, dtype=torch.bool)
        block[:5, :5] = block[5:, 5:] = True
        assert torch.equal(call.kwargs["attn_mask"][0, 0], block)
    torch.testing.assert_close(out, sdpa_attention(q, k, v, metadata=md))


@pytest.mark.parametrize("valid", [5.0, 0, 9, "5"])
def test_unusable_metadata_is_refused_not_run_unmasked(ops, valid):
    md = SimpleNamespace(cu_seqlens_q=(0, 5, 8), cu_seqlens_k=None, cu_k=(0, 5, 8), max_seqlen_q=5,
                         max_seqlen_k=5, valid_kv_length=valid, causal=False, has_spans=False)
    q = rand(8, 2, 4, seed=26)
    for backend in (npu_varlen_attention, npu_laser_attention):
        with pytest.raises(ValueError, match=rf"valid_kv_length={valid!r}, seq_len=8\); refusing to run unmasked "
                                             r"attention over padding rows"):
            backend(q, q, q, metadata=md)
    assert ops.calls == []


def test_rebuilt_mask_for_causal_prefix_documents():
    md = AttentionMetadata(cu_seqlens_q=(0, 2, 5), cu_seqlens_k=(0, 4, 7), causal=True)
    mask = packed_mask(md, 5, 7, causal=True, device="cpu")[0, 0]
    want = torch.zeros(5, 7, dtype=torch.bool)
    want[0, :3] = True  # document 0: 2 queries at key positions 2, 3 of 4
    want[1, :4] = True
    want[2, 4:5] = True  # document 1: 3 queries over its 3 keys
    want[3, 4:6] = True
    want[4, 4:7] = True
    assert torch.equal(mask, want)


# ---------------------------------------------------------------------------------------------- GQA, errors
def test_grouped_query_heads_are_repeated_for_the_op(ops):
    q, k, v = rand(8, 4, 4, seed=27), rand(8, 2, 4, seed=28), rand(8, 2, 4, seed=29)
    out = npu_varlen_attention(q, k, v, metadata=H3)
    assert tuple(ops.calls[0].key.shape) == (8, 4, 4)
    torch.testing.assert_close(out[:5], sdpa_attention(q, k, v, metadata=H3)[:5])


def test_missing_mindiesd_names_the_fix():
    q = rand(8, 2, 4, seed=30)
    with seam.use_ops(seam.MindIESDOps()):
        for call in (lambda: npu_varlen_attention(q, q, q, metadata=H3),
                     lambda: npu_laser_attention(q, q, q, metadata=H3),
                     lambda: npu_varlen_attention(q[None], q[None], q[None])):
            with pytest.raises(ImportError) as err:
                call()
            assert "MindIE-SD" in str(err.value) and seam.MINDIESD_INSTALL_URL in str(err.value)
            assert "--attention-backend sdpa" in str(err.value)


def test_the_seam_rejects_an_incomplete_ops_object():
    class Half:
        def attention(self, *a, **k):
            return None

    with pytest.raises(TypeError, match="varlen_attention"):
        seam.set_ops(Half())
    assert isinstance(seam.current_ops(), seam.MindIESDOps)


def test_laser_input_scale_published_on_the_metadata(ops):
    """A model may publish ``laser_input_scale`` on its metadata record (MiniMax-H3 documents 256)."""
    import attrs

    @attrs.frozen(kw_only=True)
    class ScaledMetadata(AttentionMetadata):
        laser_input_scale: float | None = None

    md = ScaledMetadata(cu_seqlens_q=(0, 5, 8), max_seqlen_q=5, max_seqlen_k=5, valid_kv_length=5,
                        laser_input_scale=256)
    q = rand(8, 2, 4, seed=31)
    npu_laser_attention(q, q, q, metadata=md)
    npu_laser_attention(q, q, q, metadata=md, laser_input_scale=4)  # the keyword wins
    assert [c.kwargs["scale"] for c in ops.calls] == [0.5 * 256 ** 2, 0.5 * 16]


@needs_npu
@pytest.mark.parametrize("backend", [npu_varlen_attention, npu_laser_attention])
def test_mindiesd_kernels_match_the_reference_on_an_npu(backend):  # pragma: no cover - Ascend machines only
    """The real MindIE-SD ops (bf16) against the fp32 reference: [real | pad], multi-document and dense calls."""
    q, k, v = (rand(1024, 8, 128, seed=s).to("npu", torch.bfloat16) for s in (40, 41, 42))
    md = AttentionMetadata(cu_seqlens_q=(0, 700, 1024), max_seqlen_q=700, max_seqlen_k=700, valid_kv_length=700)
    for metadata, rows in ((md, 700), (AttentionMetadata(cu_seqlens_q=(0, 300, 1024)), 1024)):
        out = backend(q, k, v, metadata=metadata, **({"laser_input_scale": 256} if backend is npu_laser_attention
                                                     else {}))
        want = sdpa_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), metadata=metadata)
        torch.testing.assert_close(out[:rows].float().cpu(), want[:rows], atol=3e-2, rtol=3e-2)
    dense = backend(q[None], k[None], v[None])
    torch.testing.assert_close(dense.float().cpu(), sdpa_attention(q[None].float().cpu(), k[None].float().cpu(),
                                                                   v[None].float().cpu()), atol=3e-2, rtol=3e-2)
