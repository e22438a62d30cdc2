"""The AdaLN projection of MiniMax-H3 blocks: the core's :class:`AdaLNProjection`, with a CPU-device offload.

The core projection offloads its weights by copying them to host memory, which frees device memory on an
accelerator. When the model itself runs on the CPU that copy frees nothing, so here the weights are *spilled*
to a temporary safetensors file instead (and read back by ``restore``); everything else — table path, cursor,
byte accounting, rollback on failure — keeps the core's contract (seed-contracts §1.4). Accelerator-resident
projections use the core behaviour unchanged.
"""

from __future__ import annotations

import os
import tempfile
import weakref

import torch
from omnicore.plugin import AdaLNProjection


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class H3AdaLNProjection(AdaLNProjection):
    """``AdaLNProjection`` whose weight offload spills to a file when the weights live on the CPU."""

    _spill: tuple[str, dict[str, tuple[torch.Size, torch.dtype]], int, weakref.finalize] | None = None

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
        shapes = {n: (p.shape, p.dtype) for n, p in params.items()}
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
        for name, (shape, dtype) in shapes.items():
            params[name].data = loaded[name].to(dtype).reshape(shape)
        self._spill = None
        finalizer()

    def projection_bytes(self) -> int:
        if self._spill is not None:
            return self._spill[2]
        return super().projection_bytes()
