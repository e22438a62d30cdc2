"""The adaptable linears of one loaded model (:class:`TargetMap`), built from its spec's :class:`LoRATargets`.

Adapter files are checked and converted against this map (module names, ``in``/``out`` features), so the same
adapter is refused or accepted identically at admission and when it runs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from .records import LoRATargets

if TYPE_CHECKING:
    from torch import nn


def _frozen_shapes(value: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {str(k): (int(v[0]), int(v[1])) for k, v in value.items()}


@attrs.frozen
class TargetMap:
    """``shapes``: qualified name (under the targets' root) -> ``(in_features, out_features)`` of every adaptable
    ``nn.Linear``; ``adaln``: those the AdaLN schedule cache precomputes; ``linears``: every linear of the root
    (to tell "not adaptable" from "no such module"); ``model`` names the model in messages; ``itemsize`` is the
    bytes per element of the compute dtype (device bytes of an adapter)."""

    model: str
    targets: LoRATargets
    shapes: dict[str, tuple[int, int]] = attrs.field(converter=_frozen_shapes)
    adaln: frozenset[str] = frozenset()
    linears: frozenset[str] = frozenset()
    itemsize: int = 4
    #: the network's ``config`` attribute (what a model's LoRA converter may need: head counts, ...)
    config: Any = attrs.field(default=None, eq=False, repr=False)
    #: every other module of the root with parameters of its own -> its class name (a router, stacked experts):
    #: an adapter naming one, or a name inside one, is told it is not a linear layer
    others: dict[str, str] = attrs.field(factory=dict, eq=False, repr=False)
    #: tensor-parallel linears (``--parallel tp=N``) -> ``(style, ranges)``: ``"column"`` holds the output rows in
    #: ``ranges`` (``B`` is narrowed to them), ``"row"`` the input columns (``A`` is narrowed); ``shapes`` stay the
    #: full linears', so an adapter is checked and converted alike on every rank
    shards: dict[str, tuple[str, tuple[tuple[int, int], ...]]] = attrs.field(factory=dict)

    def not_linear(self, name: str) -> tuple[str, str] | None:
        """``(module, class name)`` when ``name`` is, or lies inside, a module that is not an ``nn.Linear``."""
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            prefix = ".".join(parts[:end])
            if prefix in self.others:
                return prefix, self.others[prefix]
        return None

    @property
    def key(self) -> tuple[object, ...]:
        """Identity of the conversion (an adapter converted for one map is valid for an equal one)."""
        return (self.model, self.targets, tuple(sorted(self.shapes.items())), self.itemsize,
                tuple(sorted(self.shards.items())))

    @property
    def kohya_names(self) -> dict[str, str]:
        """kohya's flattened name (``blocks_0_attn_to_q``) -> dotted module name, for every adaptable module and
        every name the model's converter reads (``LoRATargets.kohya_names``)."""
        names = {name.replace(".", "_"): name for name in self.shapes}
        if self.targets.kohya_names:
            from .._lazy import resolve

            for name in resolve(self.targets.kohya_names)(sorted(self.shapes), self.config):
                names.setdefault(str(name).replace(".", "_"), str(name))
        return names

    @classmethod
    def build(cls, root: nn.Module, targets: LoRATargets, model: str) -> TargetMap:
        """Scan ``root`` (an ``nn.Module``) for the ``nn.Linear`` modules the patterns name."""
        from torch import nn

        shapes: dict[str, tuple[int, int]] = {}
        shards: dict[str, tuple[str, tuple[tuple[int, int], ...]]] = {}
        linears = set()
        others: dict[str, str] = {}
        itemsize = 4
        for name, module in root.named_modules():
            if not isinstance(module, nn.Linear):
                if name and any(True for _ in module.parameters(recurse=False)):
                    others[name] = type(module).__name__
                continue
            linears.add(name)
            if any(fnmatch.fnmatchcase(name, p) for p in targets.modules):
                shapes[name] = (module.in_features, module.out_features)
                shard = _tp_shard(module)
                if shard is not None:
                    shapes[name], shards[name] = shard
                weight = module.weight
                if weight.is_floating_point():
                    itemsize = weight.element_size()
        if not shapes:
            raise ValueError(f"model {model!r}: LoRATargets.modules {list(targets.modules)} match no nn.Linear "
                             f"under {targets.root!r}")
        adaln = frozenset(n for n in shapes if any(fnmatch.fnmatchcase(n, p) for p in targets.adaln))
        return cls(model=model, targets=targets, shapes=shapes, adaln=adaln, linears=frozenset(linears),
                   itemsize=itemsize, config=getattr(root, "config", None), others=others, shards=shards)


def _tp_shard(module: nn.Module) -> tuple[tuple[int, int], tuple[str, tuple[tuple[int, int], ...]]] | None:
    """``((in, out) of the full linear, (style, this rank's ranges))`` of a linear that
    :func:`omnicore.parallel.tensor_parallel.shard_module` narrowed, else ``None``."""
    full, shard = getattr(module, "_omnicore_tp_full", None), getattr(module, "_omnicore_tp_shard", None)
    if full is None or shard is None:
        return None
    from ..parallel.tensor_parallel import local_ranges

    style, sizes, rank, degree = shard
    fan_out, fan_in = full["weight"]
    size = fan_out if style == "column" else fan_in
    return (fan_in, fan_out), (style, tuple(local_ranges(size, sizes, rank, degree)))


def resolve_roots(pipeline: Any, targets: LoRATargets) -> list[nn.Module]:
    """The network(s) at ``targets.root`` on ``pipeline``: one module, or every value of a mapping of modules
    (a pipeline with one DiT per task, e.g. ``transformers = {"fl2va": ..., "ref2va": ...}``); an
    AttributeError names the missing part."""
    obj = pipeline
    for part in targets.root.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, Mapping) or hasattr(obj, "values") and not hasattr(obj, "named_modules"):
        return list(obj.values())
    return [obj]


__all__ = ["TargetMap", "resolve_roots"]
