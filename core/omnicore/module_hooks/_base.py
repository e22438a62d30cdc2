"""A small module-hook substrate (in the spirit of diffusers' ``hooks/hooks.py``, our own code).

A :class:`HookRegistry` is attached to one ``nn.Module``; it owns an ordered set of named :class:`ModelHook`
objects and installs a composed ``forward`` as an *instance* attribute of the module. Removing the last hook
deletes that attribute again, so a module with its hooks removed is exactly the module it was before
(class ``forward`` back in charge, no leftover attributes).

Composition: hooks registered later wrap the ones registered earlier. Each hook runs ``pre_forward`` (may
rewrite the arguments), then either its ``new_forward`` (which receives the inner forward and may skip it) or
the inner forward, then ``post_forward`` (may rewrite the output).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from torch import nn

T = TypeVar("T")

_REGISTRY_ATTR = "_omnicore_hook_registry"


class ModelHook:
    """Base class of module hooks; override only what a technique needs.

    ``new_forward(module, forward, *args, **kwargs)`` replaces the call to ``forward`` (the wrapped inner
    forward); define it only when the hook may skip or re-route the module's computation.
    """

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        """Called once when the hook is registered on ``module``."""
        return module

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called once when the hook is removed from ``module`` (undo what ``initialize_hook`` did)."""
        return module

    def pre_forward(self, module: nn.Module, *args: object,
                    **kwargs: object) -> tuple[tuple[object, ...], dict[str, object]]:
        return args, kwargs

    def post_forward(self, module: nn.Module, output: object) -> object:
        return output

    def reset_state(self, module: nn.Module) -> nn.Module:
        """Forget per-request state (called between requests by the technique that owns the hook)."""
        return module

    new_forward: Callable[..., object] | None = None


def _compose(hook: ModelHook, module: nn.Module, inner: Callable[..., object]) -> Callable[..., object]:
    new_forward = hook.new_forward

    def forward(*args: object, **kwargs: object) -> object:
        args, kwargs = hook.pre_forward(module, *args, **kwargs)
        out = new_forward(module, inner, *args, **kwargs) if new_forward is not None else inner(*args, **kwargs)
        return hook.post_forward(module, out)

    return forward


class HookRegistry:
    """The named hooks of one module. Get it with :meth:`for_module`; never construct it directly."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.hooks: dict[str, ModelHook] = {}

    @classmethod
    def for_module(cls, module: nn.Module, *, create: bool = True) -> HookRegistry | None:
        registry = module.__dict__.get(_REGISTRY_ATTR)
        if registry is None and create:
            registry = cls(module)
            object.__setattr__(module, _REGISTRY_ATTR, registry)
        return registry

    def register(self, name: str, hook: ModelHook) -> ModelHook:
        if name in self.hooks:
            raise ValueError(f"hook with name {name!r} already exists on {type(self.module).__name__}; "
                             f"remove it before registering it again")
        hook.initialize_hook(self.module)
        self.hooks[name] = hook
        self._install()
        return hook

    def get(self, name: str) -> ModelHook | None:
        return self.hooks.get(name)

    def remove(self, name: str) -> ModelHook | None:
        hook = self.hooks.pop(name, None)
        if hook is not None:
            hook.detach_hook(self.module)
            self._install()
        return hook

    def reset_state(self) -> None:
        for hook in self.hooks.values():
            hook.reset_state(self.module)

    def _install(self) -> None:
        module = self.module
        if not self.hooks:
            module.__dict__.pop("forward", None)
            module.__dict__.pop(_REGISTRY_ATTR, None)
            return
        forward = type(module).forward.__get__(module)
        for hook in self.hooks.values():
            forward = _compose(hook, module, forward)
        object.__setattr__(module, "forward", forward)


def register_hook(module: nn.Module, name: str, hook: ModelHook) -> ModelHook:
    """Attach ``hook`` to ``module`` under ``name`` (a duplicate name is an error, never a silent overwrite)."""
    registry = HookRegistry.for_module(module)
    assert registry is not None
    return registry.register(name, hook)


def remove_hook(module: nn.Module, name: str) -> ModelHook | None:
    """Detach the hook ``name`` from ``module``; returns it, or ``None`` if there was none."""
    registry = HookRegistry.for_module(module, create=False)
    return registry.remove(name) if registry is not None else None


def get_hook(module: nn.Module, name: str) -> ModelHook | None:
    registry = HookRegistry.for_module(module, create=False)
    return registry.get(name) if registry is not None else None


# ---------------------------------------------------------------------------------------------- contexts

_CONTEXT: contextvars.ContextVar[str | None] = contextvars.ContextVar("omnicore_hook_context", default=None)


@contextlib.contextmanager
def hook_context(name: str) -> Iterator[None]:
    """Name the branch being computed (e.g. ``"cond"`` / ``"uncond"`` under CFG) for stateful hooks.

    Pipelines that call a hooked model more than once per step wrap each call in a named context so that
    per-branch state is chosen explicitly rather than by counting calls.
    """
    token = _CONTEXT.set(name)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> str | None:
    return _CONTEXT.get()


class StateManager(Generic[T]):
    """Per-context state objects created on demand by ``factory`` (one per named branch)."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._states: dict[str, T] = {}

    def get(self, context: str) -> T:
        state = self._states.get(context)
        if state is None:
            state = self._states[context] = self._factory()
        return state

    def reset(self) -> None:
        self._states.clear()

    def __len__(self) -> int:
        return len(self._states)
