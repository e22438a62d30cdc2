"""Tensor parallelism (``--parallel tp=N``): a model's sharding plan, and the core code that applies it at load.

A model declares a :class:`TensorParallelPlan`: module-name patterns, each ``column`` (the ``nn.Linear``'s output
features split across the TP ranks: weight rows and bias), ``row`` (its input features split: weight columns; the
bias, if any, is added once after the reduction) or ``replicated`` (every rank keeps it whole; the default for any
module no rule names). ``chunks`` says how many equal fused outputs a column layer stacks (``[Q; K; V]`` = 3,
``[gate | up]`` = 2), ``parts`` their relative sizes when unequal (grouped-query ``[Q; K; V]``: ``(heads,
kv_heads, kv_heads)``): each part is split on its own, so rank ``r`` holds ``[Q_r; K_r; V_r]`` and its heads stay
whole. A module that is not an ``nn.Linear`` (stacked MoE experts) names its parameters' split dimensions in
``params``; the model reduces its outputs itself (:func:`parallelize` only wires ``nn.Linear``). ``divisors``
lists the counts the degree must divide (heads, key/value heads, FFN width); :meth:`check` refuses any other
degree at load, naming the numbers.

Applying a plan has two halves, usable separately:

* :func:`shard_module` narrows every matched ``nn.Linear``'s parameters to this rank's share, in place. It needs
  no process group and works on a **meta-device** module: build the model under ``torch.device("meta")``, call
  ``shard_module(model, plan, rank=r, degree=N)`` and every parameter has the shape rank ``r`` holds, so
  ``sum(p.numel() * p.element_size() for p in model.parameters())`` is that rank's resident bytes
  (:func:`local_parameter_bytes` does exactly this, and :func:`sharded_parameter_bytes` does it analytically from
  the shapes without changing the module). A loader that read only its shard (:func:`read_sharded_state_dict`,
  ``safe_open(...).get_slice``) builds on meta, calls :func:`shard_module`, then ``load_strict(..., assign=True)``.
* :func:`parallelize` (a process group needed) wraps each local shard as a ``DTensor`` (``Shard(0)`` for
  column, ``Shard(1)`` for row) over the TP group's ``DeviceMesh`` and installs DTensor's own
  ``ColwiseParallel`` / ``RowwiseParallel`` with ``torch.distributed.tensor.parallel.parallelize_module``: column
  outputs stay local (this rank's heads / FFN columns), a row layer all-reduces its partial sums (one all-reduce
  per attention and one per MLP, as usual). Module attributes that hold sizes (head counts, FFN width) are the
  model's to divide by the degree.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

STYLES = ("column", "row", "replicated")


# typed converters (``converter=tuple`` would type the fields' constructor arguments as ``Iterable[_T_co]``)
def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _named_ints(value: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    return tuple(value)


def _rules(value: Iterable[ShardRule]) -> tuple[ShardRule, ...]:
    return tuple(value)


@attrs.frozen
class ShardRule:
    """``pattern`` (``fnmatch`` over a module's qualified name, e.g. ``"blocks.*.attn.qkv_proj"``) -> ``style``."""

    pattern: str
    style: str
    chunks: int = 1  # equal fused outputs stacked along the split dimension, each split on its own
    parts: tuple[int, ...] = attrs.field(default=(), converter=_ints)  # unequal fused parts' relative sizes
    params: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_named_ints)  # non-Linear: (name, dim)

    def __attrs_post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"ShardRule style must be one of {STYLES}, got {self.style!r}")
        if type(self.chunks) is not int or self.chunks < 1:
            raise ValueError(f"ShardRule chunks must be a positive integer, got {self.chunks!r}")
        if any(type(n) is not int or n < 1 for n in self.parts):
            raise ValueError(f"ShardRule parts must be positive integers, got {self.parts!r}")

    @property
    def sizes(self) -> tuple[int, ...]:
        """Relative sizes of the fused parts."""
        return self.parts or (1,) * self.chunks


@attrs.frozen
class TensorParallelPlan:
    """The rules (first match wins; unmatched modules are replicated) and the counts the degree must divide."""

    rules: tuple[ShardRule, ...] = attrs.field(converter=_rules)
    divisors: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_named_ints)

    def rule_for(self, module_name: str) -> ShardRule | None:
        """The rule sharding ``module_name`` (``None``: replicated)."""
        for rule in self.rules:
            if fnmatch.fnmatchcase(module_name, rule.pattern):
                return None if rule.style == "replicated" else rule
        return None

    def check(self, degree: int) -> None:
        """Refuse a degree that does not divide every declared count (a ConfigError naming ``parallel``)."""
        for what, count in self.divisors:
            if count % degree:
                raise ConfigError("parallel", f"tp={degree} must divide the model's {what} ({count}); choose a "
                                              f"degree among the divisors of {count}")

    def param_split(self, module_name: str, param_name: str) -> tuple[int, tuple[int, ...]] | None:
        """``(dim, part sizes)`` along which ``module_name.param_name`` is split, or ``None`` (kept whole)."""
        rule = self.rule_for(module_name)
        if rule is None:
            return None
        if rule.params:
            dims = dict(rule.params)
            return (dims[param_name], rule.sizes) if param_name in dims else None
        if rule.style == "column":
            return 0, rule.sizes  # weight [out, in] rows, bias [out]
        if param_name == "weight":
            return 1, rule.sizes  # row: weight [out, in] columns
        return None  # a row layer's bias is added once, after the reduction


def local_ranges(size: int, chunks: int | Sequence[int], rank: int, degree: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges of a dimension of ``size`` that ``rank`` holds: ``chunks`` equal fused parts,
    or parts of these relative sizes, each split in ``degree`` equal shares."""
    sizes = (1,) * chunks if isinstance(chunks, int) else tuple(chunks)
    unit, rest = divmod(size, sum(sizes))
    if rest or any((n * unit) % degree for n in sizes):
        raise ConfigError("parallel", f"tp={degree} does not divide a dimension of {size} in parts {sizes}")
    out, start = [], 0
    for n in sizes:
        per = n * unit // degree
        out.append((start + rank * per, start + (rank + 1) * per))
        start += n * unit
    return out


def take_shard(tensor: torch.Tensor, dim: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``tensor``'s rows (``dim``) in ``ranges``, concatenated (a view when there is one range; works on meta)."""
    import torch

    parts = [tensor.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _linears(module: nn.Module, plan: TensorParallelPlan) -> Iterable[tuple[str, nn.Module, ShardRule]]:
    for name, sub in module.named_modules():
        rule = plan.rule_for(name)
        if rule is not None:
            yield name, sub, rule


def sharded_parameter_bytes(module: nn.Module, plan: TensorParallelPlan, degree: int,
                            dtype_bytes: Callable[[torch.Tensor], int] | None = None) -> int:
    """Bytes of parameters one TP rank holds, from the (full-size, e.g. meta-device) module's shapes alone.

    ``dtype_bytes(param)`` overrides the element size (e.g. to price a meta fp32 model in bf16)."""
    plan.check(degree)
    total = 0
    for mod_name, sub in module.named_modules():
        for p_name, p in sub.named_parameters(recurse=False):
            size = dtype_bytes(p) if dtype_bytes is not None else p.element_size()
            split = plan.param_split(mod_name, p_name)
            numel = p.numel() if split is None else p.numel() // degree
            total += numel * size
    return total


def local_parameter_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this process holds (a DTensor counts its local shard)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def shard_module(module: nn.Module, plan: TensorParallelPlan, *, rank: int, degree: int) -> nn.Module:
    """Narrow every planned ``nn.Linear`` of ``module`` to ``rank``'s share, in place (no process group; works on
    the meta device). Each sharded linear remembers its full shape as ``_omnicore_tp_full`` (``parallelize``
    reads it) and ``(style, part sizes, rank, degree)`` as ``_omnicore_tp_shard``. Returns ``module``."""
    from torch import nn

    plan.check(degree)
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} outside a TP group of {degree}")
    for name, sub, rule in _linears(module, plan):
        if not isinstance(sub, nn.Linear) and not rule.params:
            raise TypeError(f"tensor-parallel plan names {name!r}, a {type(sub).__name__}: a module that is not "
                            "an nn.Linear needs the rule's params (its parameters' split dimensions)")
        if getattr(sub, "_omnicore_tp_full", None) is not None:
            continue  # already sharded (e.g. built from a sharded checkpoint read)
        full = {p_name: tuple(p.shape) for p_name, p in sub.named_parameters(recurse=False)}
        object.__setattr__(sub, "_omnicore_tp_full", full)  # a plain attribute, not a submodule or buffer
        # what this rank holds, for code that narrows other tensors alike (LoRA adapters: omnicore.lora.targets)
        object.__setattr__(sub, "_omnicore_tp_shard", (rule.style, rule.sizes, rank, degree))
        for p_name, p in list(sub.named_parameters(recurse=False)):
            split = plan.param_split(name, p_name)
            if split is None:
                continue
            dim, sizes = split
            local = take_shard(p.data, dim, local_ranges(p.shape[dim], sizes, rank, degree)).contiguous()
            setattr(sub, p_name, nn.Parameter(local, requires_grad=p.requires_grad))
        if isinstance(sub, nn.Linear):
            sub.in_features, sub.out_features = sub.weight.shape[1], sub.weight.shape[0]
    return module


def parallelize(module: nn.Module, plan: TensorParallelPlan, mesh: Any, stats: Any = None) -> nn.Module:
    """Run ``module``'s sharded linears (after :func:`shard_module`) through DTensor's tensor parallelism over
    ``mesh`` (the TP group's 1-D ``DeviceMesh``): ``ColwiseParallel`` / ``RowwiseParallel`` via
    ``parallelize_module``, local tensors in and out. ``stats`` (a :class:`~.context.CommStats`) counts each row
    layer's all-reduce as a ring all-reduce sends it: ``2 (P - 1) / P`` of the output's bytes. Returns ``module``."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles: dict[str, Any] = {}
    for name, sub, rule in _linears(module, plan):
        if not isinstance(sub, nn.Linear):
            continue  # sharded by shard_module; the model reduces its output
        full = getattr(sub, "_omnicore_tp_full", None)
        if full is None:
            raise RuntimeError(f"{name!r} is not sharded yet: call shard_module() first")
        for p_name, p in list(sub.named_parameters(recurse=False)):
            if isinstance(p.data, DTensor):
                continue
            split = plan.param_split(name, p_name)
            placement = Replicate() if split is None else Shard(split[0])
            shape = torch.Size(full[p_name])
            stride = torch.empty(shape, device="meta").stride()
            dt = DTensor.from_local(p.data, mesh, [placement], run_check=False, shape=shape, stride=stride)
            setattr(sub, p_name, nn.Parameter(dt, requires_grad=False))
        styles[name] = ColwiseParallel() if rule.style == "column" else RowwiseParallel()
        if stats is not None and rule.style == "row":
            sub.register_forward_hook(_count_all_reduce(stats, mesh.size()))
            object.__setattr__(sub, "_omnicore_tp_stats", stats)  # kept by .local_linear.localize (quantization)
    if styles:
        parallelize_module(module, mesh, styles)
    return module


def _count_all_reduce(stats: Any, degree: int) -> Callable[..., None]:
    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        stats.record("all_reduce", output.numel() * output.element_size() * 2 * (degree - 1) // degree)
    return hook


def read_sharded_state_dict(folder: Path | str, plan: TensorParallelPlan, *, rank: int, degree: int, plugin: str,
                            component: str | None = None,
                            weights_name: str | None = None,
                            keep: Callable[[str], bool] | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of a component folder with every planned linear read as ``rank``'s shard only
    (``safe_open(...).get_slice``: the other ranks' rows never leave the file), and the bytes read. The files are
    :func:`omnicore.checkpoint.weight_files`' (``weights_name`` as there). ``keep(stored name)`` false: the tensor
    is not read at all (e.g. the layers past the one a text encoder reads, or its LM head).

    ``plan``'s patterns are matched against the *stored* names (the tensor name less ``.weight`` / ``.bias``), so
    a model whose checkpoint layout differs from its modules declares a plan for that layout."""
    import torch
    from safetensors import safe_open

    from ..checkpoint import CheckpointError, aligned, weight_files

    plan.check(degree)
    state: dict[str, torch.Tensor] = {}
    nbytes = 0
    for file in weight_files(folder, plugin=plugin, component=component, weights_name=weights_name):
        with safe_open(str(file), framework="pt") as handle:
            for stored in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if keep is not None and not keep(stored):
                    continue
                if stored in state:
                    raise CheckpointError(plugin, folder, f"weight {stored} appears in more than one shard",
                                          component=component)
                mod_name, _, p_name = stored.rpartition(".")
                split = plan.param_split(mod_name, p_name)
                view = handle.get_slice(stored)
                shape = list(view.get_shape())
                if split is None:
                    tensor = handle.get_tensor(stored)
                else:
                    dim, sizes = split
                    parts = []
                    for a, b in local_ranges(shape[dim], sizes, rank, degree):
                        index = tuple(slice(a, b) if d == dim else slice(None) for d in range(len(shape)))
                        parts.append(view[index])
                    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
                nbytes += tensor.numel() * tensor.element_size()
                state[stored] = aligned(tensor)
    return state, nbytes


__all__ = ["STYLES", "ShardRule", "TensorParallelPlan", "local_parameter_bytes", "local_ranges", "parallelize",
           "read_sharded_state_dict", "shard_module", "sharded_parameter_bytes", "take_shard"]
