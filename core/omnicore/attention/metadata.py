"""Packed attention metadata with host-side lengths: what a model hands every attention backend.

Lengths are Python ints (``cu_seqlens`` as tuples, ``max_seqlen``, ``valid_kv_length``), so a backend can plan a
call (choose a kernel, slice K/V, build a varlen launch) without reading a device tensor; device copies of
``cu_seqlens`` are made once per device and cached on the record. A model builds one record per forward layout
(usually once per request branch) and passes it to every attention call as ``metadata=``.

Layout conventions (flash-attention's):

* documents are laid end to end in ``q [Tq, H, D]`` and ``k, v [Tk, Hkv, D]``; document ``i`` owns query rows
  ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``;
* a document may have more keys than queries (a cached prefix): its queries are the *last* ``Lq`` positions of
  the document, which matters for causal attention (bottom-right aligned);
* ``valid_kv_length``: ``[real | pad]`` packing — key rows at or past it are padding and no query attends to
  them; query rows past it are padding and their outputs are unspecified (the reference returns zeros);
* ``causal`` with ``spans``: per document, every query sees the keys at or before its position, plus every key
  of a bidirectional span it sits in (HunyuanImage-3: text causal, each image's tokens see each other).
  Span bounds are document-relative key positions.

Backend hints a model may publish (backends that do not use them ignore them):

* ``sparse_plan``: a block-sparse plan for a backend that executes one (``AttentionCapabilities.sparse``);
  ``latent_grid``: the ``(frames, height, width)`` token grid of the model's video rows, for backends that plan;
* ``laser_input_scale``: a power-of-two factor ``f > 1`` by which a kernel keeping unscaled ``QK^T`` in an fp16
  workspace (the Ascend laser path) pre-divides q, k and v (softmax scale times ``f**2``, output times ``f``) so
  outlier logits cannot overflow 65504 and turn rows into NaN (exact for powers of two, barring underflow).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from .packed import PackedSequence


@attrs.frozen
class AttentionSpan:
    """Positions ``[start, end)`` of one document that attend to each other bidirectionally (causal elsewhere)."""

    start: int
    end: int

    def __attrs_post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.end, int)) or not 0 <= self.start < self.end:
            raise ValueError(f"AttentionSpan needs ints 0 <= start < end, got [{self.start!r}, {self.end!r})")


@attrs.frozen
class QueryRun:
    """Consecutive query positions ``[start, end)`` of one document that share how far they see.

    ``causal=False``: every query of the run sees keys ``[0, keys)``. ``causal=True``: the query at position
    ``p`` sees keys ``[0, p + 1)`` (and ``keys == end``). Positions are document-relative key positions.
    """

    start: int
    end: int
    keys: int
    causal: bool = False


def query_runs(q_start: int, q_end: int, spans: Sequence[AttentionSpan] = (), *,
               key_limit: int | None = None) -> tuple[QueryRun, ...]:
    """Cut the causal queries at positions ``[q_start, q_end)`` of one document into :class:`QueryRun` s.

    A query at ``p`` sees keys ``[0, limit(p))``: ``limit(p)`` is the largest end of a span containing ``p``
    (spans are bidirectional islands), or ``p + 1`` outside every span, and never more than ``key_limit``
    (keys past it are padding). Every visible set is a key prefix, so each run can be computed with no mask
    at all (a fixed prefix, or plain causal from position 0), except a causal run that starts later (a text
    run between images, or queries after a cached prefix), whose mask is ``run x keys``.
    Host ints only; nothing here touches a device.
    """
    if not 0 <= q_start <= q_end:
        raise ValueError(f"query positions must satisfy 0 <= start <= end, got [{q_start}, {q_end})")
    if key_limit is not None and key_limit <= 0:
        raise ValueError(f"key_limit must be positive, got {key_limit}")
    cuts = {q_start, q_end}
    for span in spans:
        cuts.update(x for x in (span.start, span.end) if q_start < x < q_end)
    if key_limit is not None and q_start < key_limit < q_end:
        cuts.add(key_limit)
    runs: list[QueryRun] = []
    for a, b in itertools.pairwise(sorted(cuts)):
        ends = [span.end for span in spans if span.start <= a < span.end]  # constant over [a, b)
        if ends:
            run = QueryRun(a, b, max(ends) if key_limit is None else min(max(ends), key_limit))
        elif key_limit is not None and a >= key_limit:
            run = QueryRun(a, b, key_limit)
        elif b - a == 1:
            run = QueryRun(a, b, b)
        else:
            run = QueryRun(a, b, b, causal=True)
        last = runs[-1] if runs else None
        if last is not None and not last.causal and not run.causal and last.keys == run.keys:
            runs[-1] = QueryRun(last.start, b, run.keys)
        else:
            runs.append(run)
    return tuple(runs)


def _host_offsets(name: str, value: Any) -> tuple[int, ...]:
    if hasattr(value, "device") and hasattr(value, "tolist"):
        raise TypeError(f"{name} must be host ints (a tuple), not a tensor: lengths stay on the host so "
                        "backends never synchronise the device to read them")
    try:
        out = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {value!r}") from None
    if len(out) < 2 or any(type(x) is not int for x in out):
        raise ValueError(f"{name} must hold at least two Python ints, got {value!r}")
    if out[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {out[0]}")
    if any(b < a for a, b in itertools.pairwise(out)):
        raise ValueError(f"{name} must be non-decreasing, got {list(out)}")
    return out


def _max_len(cu: tuple[int, ...]) -> int:
    return max(b - a for a, b in itertools.pairwise(cu))


def _input_scale(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"laser_input_scale must be a positive number or None, got {value!r}")
    return float(value)


def _spans(value: Any) -> tuple[tuple[AttentionSpan, ...], ...] | None:
    if value is None:
        return None
    return tuple(tuple(s if isinstance(s, AttentionSpan) else AttentionSpan(*s) for s in doc) for doc in value)


@attrs.frozen(kw_only=True)
class AttentionMetadata:
    """Host-side description of a packed attention call (see the module docstring for the conventions)."""

    cu_seqlens_q: tuple[int, ...] = attrs.field(converter=lambda v: _host_offsets("cu_seqlens_q", v))
    cu_seqlens_k: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else _host_offsets("cu_seqlens_k", v))
    max_seqlen_q: int = attrs.field(default=attrs.Factory(lambda self: _max_len(self.cu_seqlens_q), takes_self=True))
    max_seqlen_k: int = attrs.field(default=attrs.Factory(
        lambda self: _max_len(self.cu_seqlens_k if self.cu_seqlens_k is not None else self.cu_seqlens_q),
        takes_self=True))
    valid_kv_length: int | None = None
    causal: bool = False
    spans: tuple[tuple[AttentionSpan, ...], ...] | None = attrs.field(default=None, converter=_spans)
    sparse_plan: Any = attrs.field(default=None, eq=False)
    latent_grid: tuple[int, int, int] | None = None
    laser_input_scale: float | None = attrs.field(default=None, converter=_input_scale)
    _device_cache: dict[tuple[str, str, torch.dtype], torch.Tensor] = attrs.field(factory=dict, init=False,
                                                                                  eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        docs = self.num_docs
        if self.cu_seqlens_k is not None and len(self.cu_seqlens_k) != len(self.cu_seqlens_q):
            raise ValueError(f"cu_seqlens_q has {docs} documents but cu_seqlens_k has {len(self.cu_seqlens_k) - 1}")
        for name in ("max_seqlen_q", "max_seqlen_k"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative Python int, got {value!r}")
        if self.valid_kv_length is not None and (
                type(self.valid_kv_length) is not int or not 0 < self.valid_kv_length <= self.cu_k[-1]):
            raise ValueError(f"valid_kv_length must be a Python int in (0, {self.cu_k[-1]}], "
                             f"got {self.valid_kv_length!r}")
        if self.spans is not None:
            if not self.causal:
                raise ValueError("spans describe bidirectional islands in causal attention; set causal=True")
            if len(self.spans) != docs:
                raise ValueError(f"spans must list one tuple per document ({docs}), got {len(self.spans)}")
            for i, doc in enumerate(self.spans):
                length = self.cu_k[i + 1] - self.cu_k[i]
                for span in doc:
                    if span.end > length:
                        raise ValueError(f"span [{span.start}, {span.end}) of document {i} exceeds its "
                                         f"{length} keys")
        if self.latent_grid is not None and (len(self.latent_grid) != 3 or any(
                type(n) is not int or n <= 0 for n in self.latent_grid)):
            raise ValueError(f"latent_grid must be three positive ints (frames, height, width), "
                             f"got {self.latent_grid!r}")

    # ------------------------------------------------------------------ views
    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens_q) - 1

    @property
    def cu_k(self) -> tuple[int, ...]:
        """``cu_seqlens_k``, defaulting to ``cu_seqlens_q``."""
        return self.cu_seqlens_q if self.cu_seqlens_k is None else self.cu_seqlens_k

    @property
    def total_q(self) -> int:
        return self.cu_seqlens_q[-1]

    @property
    def total_k(self) -> int:
        return self.cu_k[-1]

    @property
    def has_spans(self) -> bool:
        return self.spans is not None and any(self.spans)

    def doc_lengths(self) -> list[tuple[int, int]]:
        """``[(Lq_i, Lk_i), ...]`` per document (host ints)."""
        q, k = self.cu_seqlens_q, self.cu_k
        return [(q[i + 1] - q[i], k[i + 1] - k[i]) for i in range(self.num_docs)]

    # ------------------------------------------------------------------ device copies (cached)
    def _tensor(self, which: str, values: tuple[int, ...], device: torch.device | str,
                dtype: torch.dtype) -> torch.Tensor:
        import torch

        key = (which, str(device), dtype)
        cached = self._device_cache.get(key)
        if cached is None:  # a racing first use makes two equal copies and keeps one
            cached = self._device_cache.setdefault(key, torch.tensor(values, dtype=dtype, device=device))
        return cached

    def cu_seqlens_q_tensor(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """``cu_seqlens_q`` as an int32 tensor on ``device``, made once per device and cached."""
        import torch

        return self._tensor("q", self.cu_seqlens_q, device, dtype or torch.int32)

    def cu_seqlens_k_tensor(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """``cu_seqlens_k`` (or ``cu_seqlens_q`` when they are shared) as a cached int32 device tensor."""
        import torch

        return self._tensor("k" if self.cu_seqlens_k is not None else "q", self.cu_k, device, dtype or torch.int32)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_lengths(
        cls,
        lengths_q: Sequence[int],
        lengths_k: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> AttentionMetadata:
        """Metadata of documents with these query (and key) lengths, laid end to end."""
        def offsets(lengths: Sequence[int]) -> tuple[int, ...]:
            out = [0]
            for n in lengths:
                if type(n) is not int and not (hasattr(n, "__index__") and not hasattr(n, "device")):
                    raise TypeError(f"document lengths must be ints, got {n!r}")
                out.append(out[-1] + int(n))
            return tuple(out)

        return cls(cu_seqlens_q=offsets(lengths_q),
                   cu_seqlens_k=None if lengths_k is None else offsets(lengths_k), **kwargs)

    @classmethod
    def from_packed(cls, packed: PackedSequence, *, pad_document: bool = True, **kwargs: Any) -> AttentionMetadata:
        """Self-attention metadata of a :class:`~omnicore.attention.packed.PackedSequence`.

        With padding rows (``padded_length > valid_length``) and ``pad_document`` (default) the padding becomes
        a trailing document (``[real | pad]``: ``cu = [..., valid, T]``, the mask-free layout) and
        ``valid_kv_length = valid``; ``max_seqlen_q/k`` stay the longest *real* document. Without
        ``pad_document`` the padding rows simply lie past ``cu[-1]``.
        """
        offsets = tuple(packed.offsets)
        pad = packed.padded_length - packed.valid_length
        kwargs.setdefault("max_seqlen_q", packed.max_seqlen)
        kwargs.setdefault("max_seqlen_k", packed.max_seqlen)
        if pad and pad_document:
            offsets = (*offsets, packed.padded_length)
            kwargs.setdefault("valid_kv_length", packed.valid_length)
            spans = kwargs.get("spans")
            if spans is not None:
                kwargs["spans"] = (*spans, ())
        return cls(cu_seqlens_q=offsets, **kwargs)


__all__ = ["AttentionMetadata", "AttentionSpan", "QueryRun", "query_runs"]
