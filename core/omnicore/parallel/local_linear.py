"""A tensor-parallel linear on plain local tensors, for the weights DTensor cannot hold (quantized shards).

:func:`omnicore.parallel.tensor_parallel.parallelize` runs a sharded ``nn.Linear`` through DTensor's
``ColwiseParallel`` / ``RowwiseParallel``: its weight is a ``DTensor`` over the TP mesh. Weight-only quantization
replaces a weight by int8/fp8 data and scales (torchao's tensor subclasses or omnicore's reference module), which
DTensor does not wrap. :func:`localize` turns such a linear back into plain tensors with the same arithmetic:

* a **column** linear (weight ``Shard(0)``: this rank's output features) is a plain linear over the local rows;
  its input is the full activation, its output this rank's features (what ``ColwiseParallel`` hands on);
* a **row** linear (weight ``Shard(1)``: this rank's input features) multiplies its input shard by the local
  columns, all-reduces the partial sums over the TP group, then adds the bias once (``RowwiseParallel``'s output).

The local ``nn.Linear`` sits at ``<name>.local``, so a quantizer replaces it like any other linear and the
all-reduce stays outside it. Only the forward of a linear is served (no backward: inference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .collectives import all_reduce_sum

if TYPE_CHECKING:
    from .context import CommStats


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` (a parameter or its data) is a ``torch.distributed.tensor.DTensor``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without distributed
        return False
    return isinstance(t, DTensor) or isinstance(getattr(t, "data", None), DTensor)


class ShardedLinear(nn.Linear):
    """One rank's share of a tensor-parallel linear, on plain tensors (see the module docstring).

    It is an ``nn.Linear`` to code that looks for linears by type (LoRA targets, the tensor-parallel markers
    ``_omnicore_tp_*`` of the linear it replaces are kept): ``in_features`` / ``out_features`` are the local
    shard's, ``weight`` is the local linear's. Its parameters live in ``local`` (and a row layer's ``bias``)."""

    def __init__(self, local: nn.Module, style: str, group: Any, *, bias: torch.Tensor | None = None,
                 stats: CommStats | None = None) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the weight is the local linear's, not a parameter of this one
        if style not in ("column", "row"):
            raise ValueError(f"style must be 'column' or 'row', got {style!r}")
        self.local = local
        self.in_features = int(getattr(local, "in_features"))  # noqa: B009 - any linear-like module
        self.out_features = int(getattr(local, "out_features"))  # noqa: B009
        self.style = style
        self.group = group
        self.stats = stats
        # a row layer's bias is added once, after the reduction (a column layer's is the local linear's own)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))

    @property  # type: ignore[override, unused-ignore]
    def weight(self) -> torch.Tensor:  # type: ignore[override, unused-ignore]
        """This rank's weight (dequantized when the local linear is quantized; for code reading ``.weight``)."""
        w: torch.Tensor = getattr(self.local, "weight")  # noqa: B009
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.local(x)
        if self.style == "row":
            y = all_reduce_sum(y, self.group, self.stats)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"style={self.style}"


def localize(linear: nn.Linear, stats: CommStats | None = None) -> ShardedLinear | None:
    """The :class:`ShardedLinear` of a DTensor-parallelized ``linear`` (its weight's local shard, not a copy),
    or ``None`` when its weight is not a DTensor sharded on dim 0 or 1. ``stats`` counts the row all-reduces
    (default: what :func:`~.tensor_parallel.parallelize` recorded on the linear)."""
    from torch.distributed.tensor import DTensor, Shard

    weight = linear.weight
    data = weight.data if isinstance(weight.data, DTensor) else weight
    if not isinstance(data, DTensor) or len(data.placements) != 1 or not isinstance(data.placements[0], Shard):
        return None
    dim = data.placements[0].dim
    if dim not in (0, 1):
        return None
    style = "column" if dim == 0 else "row"
    local_w = data.to_local()
    bias = linear.bias
    local_b = None
    if bias is not None:
        b = bias.data if isinstance(bias.data, DTensor) else bias
        local_b = b.to_local() if isinstance(b, DTensor) else b.detach()
    local = nn.Linear(local_w.shape[1], local_w.shape[0], bias=style == "column" and local_b is not None,
                      device="meta", dtype=local_w.dtype)
    local.weight = nn.Parameter(local_w, requires_grad=False)
    if style == "column" and local_b is not None:
        local.bias = nn.Parameter(local_b, requires_grad=False)
    group = data.device_mesh.get_group()
    stats = stats if stats is not None else getattr(linear, "_omnicore_tp_stats", None)
    out = ShardedLinear(local, style, group, bias=local_b if style == "row" else None, stats=stats)
    for key, value in vars(linear).items():  # shard_module's markers (full shape, this rank's ranges)
        if key.startswith("_omnicore_tp_"):
            object.__setattr__(out, key, value)
    return out


def localize_named(module: nn.Module, names: list[str]) -> dict[str, str]:
    """Replace each DTensor-parallelized ``nn.Linear`` among ``names`` (qualified names in ``module``) by its
    :class:`ShardedLinear`; returns ``{name: name of its local linear}`` for those replaced."""
    moved: dict[str, str] = {}
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        sub = getattr(parent, leaf)
        if not isinstance(sub, nn.Linear) or isinstance(sub, ShardedLinear) or not is_dtensor(sub.weight):
            continue
        sharded = localize(sub)
        if sharded is None:
            continue
        setattr(parent, leaf, sharded)
        moved[name] = f"{name}.local"
    return moved


__all__ = ["ShardedLinear", "is_dtensor", "localize", "localize_named"]
