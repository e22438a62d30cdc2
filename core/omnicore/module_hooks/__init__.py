"""Module-hook substrate shared by caches, offload and parallelism techniques (see ``_base``)."""

from ._base import (
    HookRegistry,
    ModelHook,
    StateManager,
    current_context,
    get_hook,
    hook_context,
    register_hook,
    remove_hook,
)

__all__ = [
    "HookRegistry", "ModelHook", "StateManager", "current_context", "get_hook", "hook_context",
    "register_hook", "remove_hook",
]
