"""The collectives the parallel dimensions use, each counting the bytes this rank sends.

``all_to_all_4d`` is Ulysses' exchange (a ``[P, ...]`` tensor whose chunk ``j`` goes to rank ``j`` of the group);
``all_gather_rows`` concatenates equal-shaped tensors of every rank of a group (CFG branches, sequence shards,
data-parallel batch slices); ``all_reduce_sum`` sums partial results (tensor-parallel layers a model reduces
itself, such as stacked MoE experts). Bytes counted are those that leave the rank (the chunk kept locally is not sent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from .context import CommStats


#: The device type each process-group backend moves tensors on (any other backend, gloo included: the CPU).
BACKEND_DEVICES = {"nccl": "cuda", "hccl": "npu"}


def group_device_type(group: ProcessGroup | None = None) -> str:
    """``"cuda"`` / ``"npu"`` / ``"cpu"``: where tensors given to a collective over ``group`` (default: the default
    group) must live. NCCL and HCCL take only device tensors; gloo takes CPU tensors."""
    import torch.distributed as dist

    return BACKEND_DEVICES.get(str(dist.get_backend(group)), "cpu")


def group_device(group: ProcessGroup | None = None) -> torch.device:
    """The device of this rank's collectives over ``group``: its current accelerator for NCCL / HCCL (each worker
    sees its own device as index 0), else the CPU."""
    import torch

    kind = group_device_type(group)
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    return torch.device(kind, module.current_device())


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_to_all_chunks(send: torch.Tensor, group: ProcessGroup | None, stats: CommStats | None = None) -> torch.Tensor:
    """``send [P, ...]`` -> ``recv [P, ...]`` where ``recv[j]`` is what rank ``j`` put in its ``send[me]``."""
    import torch.distributed as dist

    send = send.contiguous()
    recv = send.new_empty(send.shape)
    dist.all_to_all_single(recv, send, group=group)
    if stats is not None:
        p = send.shape[0]
        stats.record("all_to_all", _bytes(send) * (p - 1) // p)
    return recv


def all_gather_rows(local: torch.Tensor, group: ProcessGroup | None, stats: CommStats | None = None,
                    dim: int = 0) -> torch.Tensor:
    """Concatenate every group member's ``local`` (equal shapes) along ``dim``, in group-rank order."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    local = local.contiguous()
    parts = [local.new_empty(local.shape) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    if stats is not None:
        stats.record("all_gather", _bytes(local) * (size - 1))
    return torch.cat(parts, dim=dim)


def all_reduce_sum(local: torch.Tensor, group: ProcessGroup | None, stats: CommStats | None = None) -> torch.Tensor:
    """The sum of every group member's ``local`` (equal shapes), on every member; counted as a ring all-reduce
    sends it (``2 (P - 1) / P`` of the tensor's bytes)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    out = local.contiguous().clone()
    dist.all_reduce(out, group=group)
    if stats is not None:
        stats.record("all_reduce", _bytes(out) * 2 * (size - 1) // size)
    return out


__all__ = ["BACKEND_DEVICES", "all_gather_rows", "all_reduce_sum", "all_to_all_chunks", "group_device",
           "group_device_type"]
