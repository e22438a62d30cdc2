"""The AdaLN projection of MiniMax-H3 blocks: the core's :class:`AdaLNProjection`, with a CPU-device offload.

The core projection offloads its weights by copying them to host memory, which frees device memory on an
accelerator. When the model itself runs on the CPU that copy frees nothing, so here the weights are *spilled*
to a temporary safetensors file instead (and read back by ``restore``); everything else — table path, cursor,
byte accounting, rollback on failure — keeps the core's contract (docs/contracts-status.md C1.4). Accelerator-resident
projections use the core behaviour unchanged.

Under ``--parallel tp=N`` a block's projection holds a contiguous share of its output features
(:mod:`.tensor_parallel`); :meth:`H3AdaLNProjection.gather_outputs` makes :meth:`~H3AdaLNProjection.compute_flat`
all-gather the shares over the TP group, so the direct path, the schedule tables built from it and TeaCache's probe
all see whole rows.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from typing import Any

import torch
from omnicore.plugin import AdaLNProjection, all_gather_rows


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fresh_copy(src: torch.Tensor, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``src`` copied into a new allocation with the original shape, strides and dtype.

    Tensors read back from a safetensors file share the file buffer, where data starts at any 8-byte offset; the
    CPU GEMM kernels choose their code path by the operand's alignment, so such a weight can give results that
    differ in the last bit from the original. The caching allocator's fresh storage is aligned like the original
    weight's was, which makes a restored projection indistinguishable from one that was never offloaded.
    """
    out = torch.empty_strided(shape, stride, dtype=dtype, device=src.device)
    out.copy_(src.reshape(shape))
    return out


class H3AdaLNProjection(AdaLNProjection):
    """``AdaLNProjection`` whose weight offload spills to a file when the weights live on the CPU."""

    _spill: tuple[str, dict[str, tuple[torch.Size, tuple[int, ...], torch.dtype]], int, weakref.finalize] | None = None
    #: ``(TP group, CommStats)`` when this rank holds a contiguous share of the outputs (:meth:`gather_outputs`)
    _tp: tuple[Any, Any] | None = None

    def gather_outputs(self, group: Any, stats: Any = None) -> None:
        """This rank's ``linear`` holds output features ``[r·W/N, (r+1)·W/N)`` of every row (the DiT's TP plan):
        from now on :meth:`compute_flat` all-gathers them over ``group`` (rank order = feature order)."""
        self._tp = (group, stats)

    def compute_flat(self, t_emb: torch.Tensor) -> torch.Tensor:
        if self._tp is None:
            return super().compute_flat(t_emb)
        group, stats = self._tp
        local = self.linear(torch.nn.functional.silu(t_emb).to(self.linear.weight.dtype))
        full = all_gather_rows(local, group, stats, dim=-1)
        return full.reshape(t_emb.shape[0] * self.modality_num, self.width)

    @property
    def offloaded(self) -> bool:
        return self._spill is not None or super().offloaded

    def offload_eligible(self) -> bool:
        return self._spill is not None or super().offload_eligible()

    def offload(self) -> int:
        if self.offloaded:
            return 0
        params = dict(self.named_parameters())
        if not params or any(p.device.type != "cpu" for p in params.values()):
            return super().offload()
        if self.table is None:
            raise RuntimeError("AdaLN projection weights require an installed precomputed table before offload")
        if not self.offload_eligible():
            raise RuntimeError("AdaLN projection offload does not support DTensor, meta, or empty parameters")
        from safetensors.torch import save_file

        fd, path = tempfile.mkstemp(prefix="omni-h3-adaln-", suffix=".safetensors")
        os.close(fd)
        finalizer = weakref.finalize(self, _remove, path)
        try:
            save_file({n: p.detach().contiguous() for n, p in params.items()}, path)
        except BaseException:
            finalizer()
            raise
        shapes = {n: (p.shape, p.stride(), p.dtype) for n, p in params.items()}
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._spill = (path, shapes, nbytes, finalizer)
        return nbytes

    def restore(self) -> None:
        spill = self._spill
        if spill is None:
            super().restore()
            return
        from safetensors.torch import load_file

        path, shapes, _, finalizer = spill
        loaded = load_file(path)
        params = dict(self.named_parameters())
        for name, (shape, stride, dtype) in shapes.items():
            params[name].data = _fresh_copy(loaded[name], shape, stride, dtype)
        self._spill = None
        finalizer()

    def projection_bytes(self) -> int:
        if self._spill is not None:
            return self._spill[2]
        return super().projection_bytes()
