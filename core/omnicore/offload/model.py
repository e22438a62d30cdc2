"""Model-level CPU offload: the whole module's parameters visit the device for each forward, then leave.

Implemented by storage swapping (see ``_swap``): parameter objects stay put, their device storage is freed
between forwards and refilled from pinned host copies before the next one. Buffers stay resident (they are
small, and tables installed later by caches must not be dragged along). ``excluded_prefixes`` match at any
dotted boundary of the module-relative name (``adaln_proj.linear.`` matches
``blocks.3.adaln_proj.linear.weight``), so a cache that owns parameters keeps them.

:func:`materialize` runs the hook's pre-forward on demand: caches call it before building anything from the
weights (the AdaLN schedule cache's "prepare for request caches" step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch
from torch import nn

from ..module_hooks import ModelHook, get_hook, register_hook, remove_hook
from ._swap import ParamSet

HOOK_NAME = "omnicore.model_offload"


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.define(kw_only=True)
class ModelOffloadConfig:
    """``device``: where the module computes; ``excluded_prefixes``: parameters that stay resident."""

    device: torch.device | str
    excluded_prefixes: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)


class ModelOffloadHook(ModelHook):
    def __init__(self, params: ParamSet) -> None:
        self.params = params

    def pre_forward(self, module: nn.Module, *args: object,
                    **kwargs: object) -> tuple[tuple[object, ...], dict[str, object]]:
        self.params.load()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: object) -> object:  # passed through untouched
        self.params.release()
        return output


class ModelOffload:
    """Handle of an applied model-level offload; :meth:`remove` leaves the module resident on the device."""

    def __init__(self, module: nn.Module, config: ModelOffloadConfig) -> None:
        self.module = module
        self.params = ParamSet(module, torch.device(config.device), config.excluded_prefixes, anywhere=True)
        self.hook = ModelOffloadHook(self.params)
        register_hook(module, HOOK_NAME, self.hook)
        self.params.release()

    def remove(self) -> None:
        remove_hook(self.module, HOOK_NAME)
        self.params.restore_resident()


def apply_model_offload(module: nn.Module, config: ModelOffloadConfig | None = None, *,
                        device: torch.device | str | None = None,
                        excluded_prefixes: Sequence[str] = ()) -> ModelOffload:
    if config is None:
        if device is None:
            raise ValueError("apply_model_offload needs a config or a device")
        config = ModelOffloadConfig(device=device, excluded_prefixes=tuple(excluded_prefixes))
    return ModelOffload(module, config)


def materialize(module: nn.Module) -> bool:
    """Load an offloaded module's weights now (no-op without a model-offload hook); True if it had one."""
    hook = get_hook(module, HOOK_NAME)
    if hook is None:
        return False
    assert isinstance(hook, ModelOffloadHook)
    hook.pre_forward(module)
    return True
