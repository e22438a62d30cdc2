"""The reference system's packed-sequence rules as a table: packed-sequence resolution on host ints (every ``None`` case), the omnicore
guards that keep multi-document callers correct, the refusal guard and the laser scale factor."""

from __future__ import annotations

import sys

import pytest
from omni_backends_npu.resolve import (
    check_valid_kv_length,
    laser_scale_factor,
    resolve_metadata,
    resolve_packed_sequence,
)
from omnicore.attention.metadata import AttentionMetadata

#: (cu_q, cu_k, max_q, max_k, valid_kv_length, keywords, expected)
TABLE = [
    # rows: H3's [real | pad] packing (valid_kv_length = used, as H3 publishes)
    ((0, 5, 8), (0, 5, 8), 5, 5, 5, {}, ([5, 8], [5, 8])),
    ((0, 8), (0, 8), 8, 8, None, {}, ([8], [8])),
    ((0, 8), (0, 8), 8, 8, 8, {}, ([8], [8])),
    ((0, 8, 8), (0, 8, 8), 8, 8, 8, {}, ([8], [8])),  # an empty padding document
    ((0, 5, 8), (0, 5, 8), 5, 5, 5, {"causal": True}, None),
    (None, (0, 5, 8), 5, 5, 5, {}, None),
    ((0, 5, 8), None, 5, 5, 5, {}, None),
    ((0, 5, 8), (0, 5, 8), None, 5, 5, {}, None),
    ((0, 5, 8), (0, 5, 8), 5, None, 5, {}, None),
    ((0, 5, 8), (0, 5, 8), 5, 5, 5, {"q_batch": 2}, None),
    ((0, 5, 8), (0, 5, 8), 5, 5, 5, {"k_batch": 2}, None),
    ((0, 5, 8), (0, 5, 8), 5.0, 5, 5, {}, None),
    ((0, 5, 8), (0, 5, 8), 5, 5.0, 5, {}, None),
    ((0, 5, 8), (0, 5, 8), True, True, 5, {}, None),
    ((0, 3, 5, 8), (0, 3, 5, 8), 5, 5, 5, {}, None),
    ((0, 5, 8), (0, 8), 5, 5, 5, {}, None),
    ((0, 5, 8), (0, 5, 8), 0, 0, 5, {}, None),
    ((0, 5, 8), (0, 5, 8), 9, 9, 5, {}, None),
    ((0, 3, 8), (0, 3, 8), 3, 3, 3, {}, None),  # pad longer than real
    ((0, 8), (0, 8), 5, 5, 5, {}, None),  # 2 entries with used < total
    # omnicore guards (host ints): the trailing document is padding only when valid_kv_length says so
    ((0, 5, 8), (0, 5, 8), 5, 5, None, {}, None),  # LingBot batch CFG: two real documents
    ((0, 4, 8), (0, 4, 8), 4, 4, None, {}, None),  # two real documents of equal length
    ((0, 5, 8), (0, 5, 8), 5, 5, 8, {}, None),
    ((0, 5, 8), (0, 5, 8), 8, 8, None, {}, None),  # max_seqlen would merge two documents into one
    ((0, 6, 8), (0, 6, 8), 5, 5, 5, {}, None),  # offsets disagree with max_seqlen
    ((0, 8), (0, 8), 8, 8, 5, {}, None),  # one document whose keys stop at valid_kv_length
]


@pytest.mark.parametrize(("cu_q", "cu_k", "max_q", "max_k", "valid", "keywords", "expected"), TABLE)
def test_resolution_table(cu_q, cu_k, max_q, max_k, valid, keywords, expected):
    assert resolve_packed_sequence(cu_q, cu_k, max_q, max_k, valid_kv_length=valid, **keywords) == expected


def test_resolution_reads_no_tensor_and_imports_no_torch():
    """Pure host logic: the module imports without torch, and the answer comes from Python ints alone."""
    import omni_backends_npu.resolve as module

    source = open(module.__file__).read()
    assert "import torch" not in source and ".item()" not in source and ".tolist()" not in source


def test_resolution_from_metadata_records():
    h3 = AttentionMetadata(cu_seqlens_q=(0, 5, 8), max_seqlen_q=5, max_seqlen_k=5, valid_kv_length=5)
    assert resolve_metadata(h3) == ([5, 8], [5, 8])
    assert resolve_metadata(h3, causal=True) is None
    assert resolve_metadata(AttentionMetadata(cu_seqlens_q=(0, 5, 8))) is None  # from_lengths-style: two real docs
    assert resolve_metadata(AttentionMetadata(cu_seqlens_q=(0, 8))) == ([8], [8])
    lingbot_single = AttentionMetadata.from_lengths([12])
    assert resolve_metadata(lingbot_single) == ([12], [12])
    from omnicore.attention.packed import PackedSequence

    padded = AttentionMetadata.from_packed(PackedSequence.from_lengths([6], pad_to_multiple=8))  # cu [0, 6, 8]
    assert resolve_metadata(padded) == ([6, 8], [6, 8])
    cfg = AttentionMetadata.from_packed(PackedSequence.from_lengths([6, 6], pad_to_multiple=16))  # [0, 6, 12, 16]
    assert resolve_metadata(cfg) is None

    class Partial:  # an object missing max_seqlen_k counts as missing
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, valid_kv_length = (0, 5, 8), None, 5, 5

    assert resolve_metadata(Partial()) is None


@pytest.mark.parametrize(("valid", "seq_len", "ok"), [
    (None, 8, True), (5, 8, True), (8, 8, True), (1, 8, True),
    (0, 8, False), (9, 8, False), (-1, 8, False), (5.0, 8, False), (True, 8, False), ("5", 8, False),
])
def test_mask_rebuild_guard(valid, seq_len, ok):
    if ok:
        assert check_valid_kv_length(valid, seq_len) == valid
    else:
        with pytest.raises(ValueError, match=r"refusing to run unmasked attention over padding rows") as err:
            check_valid_kv_length(valid, seq_len)
        assert f"valid_kv_length={valid!r}" in str(err.value) and f"seq_len={seq_len}" in str(err.value)


@pytest.mark.parametrize(("value", "factor"), [
    (256, 256.0), (256.0, 256.0), (2, 2.0), (1.5, 1.5), (1, None), (1.0, None), (0.5, None), (0, None),
    (-256, None), (None, None), ("256", None), (True, None),
])
def test_laser_scale_factor(value, factor):
    assert laser_scale_factor(value) == factor


def test_resolve_module_is_torch_free_in_a_fresh_interpreter():
    import subprocess

    code = "import sys, omni_backends_npu.resolve, omni_backends_npu.rainfusion as r; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
