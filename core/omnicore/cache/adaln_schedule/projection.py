"""The AdaLN projection module with an optional exact per-schedule table and weight offload.

Direct path: ``SiLU(t_emb)`` → linear (in the linear weight's dtype) → ``[M·modality_num, expand_ratio·H]``
→ ``expand_ratio`` chunks. Table path (after :meth:`install`): rows of the step chosen by a shared 0-dim
int64 *device* cursor are index-selected from a precomputed ``[steps, max_rows, expand_ratio·H]`` table —
no linear call, bit-identical to the direct path because each step's rows were produced by the very same
computation at that step's real shape. Selecting by a device cursor means a new step needs no recompile.

With a table installed the projection weights may be offloaded: copied to CPU and replaced by zero-element
tensors of the same dtype on the same device, so the parameter objects survive but their storage is freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import attrs
import torch
from torch import nn

# compile boundary: the table lookup must not be captured into a graph (the cursor changes per step);
# torch.compiler.disable exists in every torch the core supports (>= 2.4)
from torch.compiler import disable as _compile_disable

from ...parallel.local_linear import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _local_nbytes(t: torch.Tensor) -> int:
    if is_dtensor(t):
        t = cast("DTensor", t).to_local()  # a DTensor (checked just above)
    return t.numel() * t.element_size()


@attrs.frozen
class _Offloaded:
    cpu: torch.Tensor
    device: torch.device
    shape: torch.Size
    stride: tuple[int, ...]

    def restored(self) -> torch.Tensor:
        """A new device tensor with the original shape, strides and dtype (a fresh, allocator-aligned storage),
        so kernels that pick their path by layout or alignment treat it exactly as the original weight."""
        out = torch.empty_strided(self.shape, self.stride, dtype=self.cpu.dtype, device=self.device)
        out.copy_(self.cpu.reshape(self.shape))
        return out


class AdaLNProjection(nn.Module):
    """``linear`` maps ``t_emb [M, in]`` to ``[M, modality_num·expand_ratio·H]``; see the module docstring."""

    table: torch.Tensor | None

    def __init__(self, in_features: int, hidden: int, expand_ratio: int = 6, modality_num: int = 1, *,
                 bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden = hidden
        self.expand_ratio = expand_ratio
        self.modality_num = modality_num
        self.linear = nn.Linear(in_features, modality_num * expand_ratio * hidden, bias=bias,
                                device=device, dtype=dtype)
        self.register_buffer("table", None, persistent=False)
        self.cursor: torch.Tensor | None = None
        self._offloaded: dict[str, _Offloaded] | None = None

    @property
    def width(self) -> int:
        return self.expand_ratio * self.hidden

    @property
    def offloaded(self) -> bool:
        return self._offloaded is not None

    # ------------------------------------------------------------------ compute
    def compute_flat(self, t_emb: torch.Tensor) -> torch.Tensor:
        weight = self.linear.weight
        h = nn.functional.silu(t_emb).to(weight.dtype)
        return self.linear(h).reshape(t_emb.shape[0] * self.modality_num, self.width)

    @_compile_disable
    def forward(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        table = self.table
        if table is None:
            flat = self.compute_flat(t_emb)
        else:
            if self.cursor is None:
                raise RuntimeError("AdaLN projection table installed without a step cursor")
            rows = t_emb.shape[0] * self.modality_num
            if rows > table.shape[1]:
                raise ValueError(f"AdaLN table row capacity is too small: {table.shape[1]} < {rows}")
            flat = table.index_select(0, self.cursor.reshape(1))[0, :rows]
        return flat.chunk(self.expand_ratio, dim=-1)

    def build_table(self, t_embs: Sequence[torch.Tensor]) -> torch.Tensor:
        """``compute_flat`` of every step at its real shape, zero-padded to the most rows, stacked."""
        flats = [self.compute_flat(t) for t in t_embs]
        max_rows = max(f.shape[0] for f in flats)
        table = flats[0].new_zeros((len(flats), max_rows, self.width))
        for i, f in enumerate(flats):
            table[i, : f.shape[0]] = f
        return table

    # ------------------------------------------------------------------ table install / clear
    def install(self, table: torch.Tensor, cursor: torch.Tensor) -> None:
        if table.dim() != 3 or table.shape[-1] != self.width:
            raise ValueError(f"AdaLN table must be [steps, rows, W] with W = {self.width}, "
                             f"got {tuple(table.shape)}")
        if table.dtype != self.linear.weight.dtype:
            raise ValueError(f"AdaLN table dtype {table.dtype} differs from the projection weight dtype "
                             f"{self.linear.weight.dtype}")
        if not isinstance(cursor, torch.Tensor) or cursor.dim() != 0 or cursor.dtype != torch.int64:
            raise ValueError("AdaLN step cursor must be a 0-dim int64 tensor")
        if table.device != cursor.device:
            raise ValueError(f"AdaLN table ({table.device}) and step cursor ({cursor.device}) must share a device")
        self.table = table
        self.cursor = cursor

    def clear(self) -> None:
        """Restore offloaded weights and drop the table and cursor (checkpoint parameters unchanged)."""
        self.restore()
        self.table = None
        self.cursor = None

    # ------------------------------------------------------------------ weight offload
    def offload_eligible(self) -> bool:
        if self._offloaded is not None:
            return True
        params = list(self.parameters())
        return bool(params) and all(
            not is_dtensor(p) and p.device.type != "meta" and p.numel() > 0 for p in params)

    def offload(self) -> int:
        """Move the projection weights to CPU, freeing their device storage; returns the bytes moved."""
        if self._offloaded is not None:
            return 0
        if self.table is None:
            raise RuntimeError("AdaLN projection weights require an installed precomputed table before offload")
        if not self.offload_eligible():
            raise RuntimeError("AdaLN projection offload does not support DTensor, meta, or empty parameters")
        record: dict[str, _Offloaded] = {}
        params = dict(self.named_parameters())
        try:
            for name, p in params.items():
                cpu = p.detach().to("cpu", copy=True)
                record[name] = _Offloaded(cpu=cpu, device=p.device, shape=p.shape, stride=p.stride())
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        except BaseException:
            for name, rec in record.items():
                params[name].data = rec.restored()
            raise
        self._offloaded = record
        return sum(r.cpu.numel() * r.cpu.element_size() for r in record.values())

    def restore(self) -> None:
        record = self._offloaded
        if record is None:
            return
        params = dict(self.named_parameters())
        for name, rec in record.items():
            params[name].data = rec.restored()
        self._offloaded = None

    # ------------------------------------------------------------------ accounting
    def projection_bytes(self) -> int:
        if self._offloaded is not None:
            return sum(r.cpu.numel() * r.cpu.element_size() for r in self._offloaded.values())
        return sum(_local_nbytes(p) for p in self.parameters())

    def table_bytes(self) -> int:
        t = self.table
        return 0 if t is None else t.numel() * t.element_size()
