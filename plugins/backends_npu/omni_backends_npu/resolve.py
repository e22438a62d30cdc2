"""Host-side decisions of the NPU attention paths (docs/contracts-status.md C3.3-C3.6): pure Python, no torch,
no device.

**Packed-sequence resolution**. :func:`resolve_packed_sequence` says whether a packed call is a
``[real | pad]`` packing the varlen and laser kernels can take without a mask, and returns ``(seq_q, seq_k)``:
cumulative document ends without the leading 0 (``([T_q], [T_k])`` for one document, ``([used_q, T_q],
[used_k, T_k])`` for a real document followed by a padding document), or ``None`` = take the masked path. As in the
contract, the lengths come from ``max_seqlen_*`` (the real length of a ``[real | pad]`` packing) and every ``None``
case of the table holds:

================================================================  ==========================
condition                                                         result
================================================================  ==========================
causal attention                                                  None
any of cu_seqlens_q/k, max_seqlen_q/k missing                     None
q or k batch != 1                                                 None
max_seqlen_* not a Python int (``5.0``)                           None
``len(cu_q) != len(cu_k)``, or more than 3 entries                None
used outside ``(0, total]``                                       None
used == total for q and k                                         ``([T_q], [T_k])``
3 entries, real >= pad for q and k                                ``([used_q, T_q], [used_k, T_k])``
pad longer than real, or 2 entries with used < total              None
================================================================  ==========================

omnicore's ``cu_seqlens`` are host ints (the contract could only read tensor *shapes*), so two facts the contract
had to assume are checked instead, which is what keeps multi-document callers correct:

* the offsets must put the boundary where ``max_seqlen`` says (a single document really is one: ``cu == [0, T]``
  or ``[0, T, T]``; a pair really is ``[0, used, T]``);
* a trailing document is read as padding **only when ``valid_kv_length`` says so** (``valid_kv_length == used``).
  ``valid_kv_length=None`` means every document is real: LingBot's batch CFG sends two real documents
  ``cu = [0, a, b]``, which must never be turned into "keep the first, drop the rest" — it resolves to ``None`` and
  takes the masked path, whose mask isolates the documents. A single document whose keys stop at
  ``valid_kv_length < T`` resolves to ``None`` too (the mask drops those keys).

**Mask rebuild / refusal**: :func:`check_valid_kv_length` is the guard before a mask is rebuilt for
a packed call that resolved to ``None``. **Laser input scale**: :func:`laser_scale_factor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Resolved = tuple[list[int], list[int]]

#: the mask-rebuild refusal (``ValueError``); formatted with ``valid`` and ``seq_len``
UNUSABLE_PACKED_METADATA = (
    "npu packed attention metadata is unusable and no attention mask was built (valid_kv_length={valid!r}, "
    "seq_len={seq_len}); refusing to run unmasked attention over padding rows"
)


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool and float (5.0) are not lengths


def resolve_packed_sequence(
    cu_seqlens_q: Sequence[int] | None,
    cu_seqlens_k: Sequence[int] | None,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    *,
    valid_kv_length: Any = None,
    q_batch: int = 1,
    k_batch: int = 1,
    causal: bool = False,
) -> Resolved | None:
    """``(seq_q, seq_k)`` for the mask-free packed paths, or ``None`` (see the module docstring's table)."""
    if causal:
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
        return None
    if q_batch != 1 or k_batch != 1:
        return None
    if not (_is_int(max_seqlen_q) and _is_int(max_seqlen_k)):
        return None
    cu_q, cu_k = tuple(cu_seqlens_q), tuple(cu_seqlens_k)
    if len(cu_q) != len(cu_k) or not 2 <= len(cu_q) <= 3:
        return None
    total_q, total_k = cu_q[-1], cu_k[-1]
    used_q, used_k = max_seqlen_q, max_seqlen_k
    if not (0 < used_q <= total_q and 0 < used_k <= total_k):
        return None
    if used_q == total_q and used_k == total_k:
        # one document: no boundary inside it, and no key padding inside it either
        if cu_q[1] != total_q or cu_k[1] != total_k:
            return None
        if valid_kv_length is not None and valid_kv_length != total_k:
            return None
        return [total_q], [total_k]
    if len(cu_q) == 3 and used_q >= total_q - used_q and used_k >= total_k - used_k:
        if cu_q[1] != used_q or cu_k[1] != used_k:
            return None  # the offsets disagree with max_seqlen: not the [real | pad] packing it claims
        if not _is_int(valid_kv_length) or valid_kv_length != used_k:
            return None  # the trailing document is real (or its status unknown): never drop it
        return [used_q, total_q], [used_k, total_k]
    return None


def resolve_metadata(metadata: Any, *, q_batch: int = 1, k_batch: int = 1, causal: bool = False) -> Resolved | None:
    """:func:`resolve_packed_sequence` on an :class:`~omnicore.attention.metadata.AttentionMetadata` (or any object
    with its field names; missing fields count as missing). ``cu_seqlens_k=None`` means "same as q" there."""
    cu_q = getattr(metadata, "cu_seqlens_q", None)
    cu_k = getattr(metadata, "cu_seqlens_k", None)
    if cu_k is None:
        cu_k = cu_q
    return resolve_packed_sequence(
        cu_q, cu_k, getattr(metadata, "max_seqlen_q", None), getattr(metadata, "max_seqlen_k", None),
        valid_kv_length=getattr(metadata, "valid_kv_length", None), q_batch=q_batch, k_batch=k_batch,
        causal=causal or bool(getattr(metadata, "causal", False)))


def check_valid_kv_length(valid_kv_length: Any, seq_len: int) -> int | None:
    """The guard of the mask rebuild: ``valid_kv_length`` must be ``None`` (every document real) or a Python int
    with ``0 < used <= seq_len``; anything else raises the refusal (``ValueError``)."""
    if valid_kv_length is None:
        return None
    if not _is_int(valid_kv_length) or not 0 < valid_kv_length <= seq_len:
        raise ValueError(UNUSABLE_PACKED_METADATA.format(valid=valid_kv_length, seq_len=seq_len))
    return valid_kv_length


def laser_scale_factor(value: Any) -> float | None:
    """The laser scale factor ``f``: the value when it is an int or float greater than 1, else ``None`` (no scaling).

    With ``f``: ``q, k, v <- q/f, k/f, v/f``, kernel scale ``<- scale * f**2``, output ``<- output * f`` — exact for
    powers of two. The laser kernel keeps the unscaled ``QK^T`` in an fp16 workspace (max 65504); pre-scaling keeps
    outlier rows from overflowing to inf and turning NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value > 1 else None
