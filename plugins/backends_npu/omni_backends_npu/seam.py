"""The one op seam through which every MindIE-SD / torch_npu call of this plugin goes.

The attention paths (:mod:`omni_backends_npu.attention`) never import MindIE-SD themselves: they call the ops
object returned by :func:`current_ops`, which is :class:`MindIESDOps` (the real kernels, imported on first call)
unless something else was installed with :func:`use_ops`. Tests install
:class:`omni_backends_npu.cpu_reference.CpuReferenceOps`, a CPU implementation of the documented op semantics, and
check what each path hands the ops (shapes, views, scale, layout, mask) and what it returns.

The three ops (tensors are BSND ``[B, S, N, D]`` unless noted; scales are always resolved floats):

``attention(query, key, value, *, attn_mask, scale, op_type, layout)``
    MindIE-SD ``attention_forward`` in manual mode. ``layout`` is the op-internal layout (``"BNSD"`` or
    ``"BSND"``); the inputs stay BSND whatever it says. ``attn_mask`` is ``None`` or a boolean tensor
    broadcastable to ``[B, N, Sq, Sk]``, True = attend. ``op_type``: ``"fused_attn_score"`` (masked path),
    ``"ascend_laser_attention"`` (laser path).
``varlen_attention(query, key, value, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)``
    MindIE-SD ``attention_forward_varlen``: TND ``[T, N, D]`` tensors, host lists of cumulative offsets with the
    leading 0; every document attends to its own keys only. Never reads or builds a mask.
``sparse_attention(query, key, value, *, plan, scale)``
    MindIE-SD ``sparse_attention(sparse_type="rf_v2")`` over ``plan.used_len`` rows: rows ``[0, prefix_len)``
    dense, the video rows block-sparse in 128-row blocks (see :mod:`omni_backends_npu.rainfusion`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

#: where MindIE-SD comes from, and what to run instead (named in the ImportError)
MINDIESD_INSTALL_URL = "https://gitcode.com/Ascend/MindIE-SD"
MISSING_MINDIESD = (
    "the npu attention backends call MindIE-SD, which is not installed: install it (see "
    f"{MINDIESD_INSTALL_URL}), or run on the reference backend with --attention-backend sdpa "
    "(OMNICORE_ATTENTION_BACKEND=sdpa)"
)

#: op types of MindIE-SD's attention_forward used here
MASKED_OP_TYPE = "fused_attn_score"
LASER_OP_TYPE = "ascend_laser_attention"
OP_TYPES = ("fused_attn_score", "ascend_laser_attention", "prompt_flash_attn")
LAYOUTS = ("BNSD", "BSND")


class NpuAttentionOps(Protocol):
    """What the attention paths call (see the module docstring for the semantics)."""

    name: str

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                  attn_mask: torch.Tensor | None, scale: float, op_type: str, layout: str) -> torch.Tensor: ...

    def varlen_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                         cu_seqlens_q: list[int], cu_seqlens_k: list[int], max_seqlen_q: int, max_seqlen_k: int,
                         scale: float) -> torch.Tensor: ...

    def sparse_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, plan: Any,
                         scale: float) -> torch.Tensor: ...


def import_mindiesd() -> Any:
    """``import mindiesd``, or an :class:`ImportError` naming the install page and the fallback backend."""
    try:
        import mindiesd
    except ImportError as exc:
        raise ImportError(MISSING_MINDIESD) from exc
    return mindiesd


class MindIESDOps:
    """The real kernels: MindIE-SD (which brings torch_npu). Imported on the first call, never before."""

    name = "mindiesd"

    def attention(self, query: Any, key: Any, value: Any, *, attn_mask: Any, scale: float, op_type: str,
                  layout: str) -> Any:
        mindiesd = import_mindiesd()
        return mindiesd.attention_forward(query, key, value, attn_mask=attn_mask, scale=scale, opt_mode="manual",
                                          op_type=op_type, layout=layout)

    def varlen_attention(self, query: Any, key: Any, value: Any, *, cu_seqlens_q: list[int],
                         cu_seqlens_k: list[int], max_seqlen_q: int, max_seqlen_k: int, scale: float) -> Any:
        mindiesd = import_mindiesd()
        return mindiesd.attention_forward_varlen(query, key, value, cu_seqlens_q=cu_seqlens_q,
                                                 cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                                 max_seqlen_k=max_seqlen_k, softmax_scale=scale)

    def sparse_attention(self, query: Any, key: Any, value: Any, *, plan: Any, scale: float) -> Any:
        mindiesd = import_mindiesd()
        shape = list(plan.latent_shape)
        return mindiesd.sparse_attention(query, key, value, scale=scale, head_num=query.shape[-2],
                                         input_layout="BSND", sparse_type="rf_v2", txt_len=plan.prefix_len,
                                         block_size=plan.block_size, latent_shape_q=shape, latent_shape_k=shape,
                                         sparsity=plan.sparsity)


_lock = threading.Lock()
_ops: NpuAttentionOps = MindIESDOps()


def current_ops() -> NpuAttentionOps:
    """The ops the attention paths call now."""
    return _ops


def set_ops(ops: NpuAttentionOps) -> NpuAttentionOps:
    """Install ``ops`` process-wide; returns the previous ones."""
    global _ops
    for name in ("attention", "varlen_attention", "sparse_attention"):
        if not callable(getattr(ops, name, None)):
            raise TypeError(f"{type(ops).__name__} lacks the op {name!r} of the npu op seam")
    with _lock:
        previous, _ops = _ops, ops
    return previous


@contextlib.contextmanager
def use_ops(ops: NpuAttentionOps) -> Iterator[NpuAttentionOps]:
    """Install ``ops`` for the duration of a ``with`` block (tests)."""
    previous = set_ops(ops)
    try:
        yield ops
    finally:
        set_ops(previous)
