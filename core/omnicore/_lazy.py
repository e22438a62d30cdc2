"""The one lazy-import helper: ``"module:attr"`` paths resolved on first use.

Spec records name their implementations this way (so registering a plugin never imports torch), and the public
packages (``omnicore``, ``omnicore.plugin``, ``omnicore.outputs``, ``omnicore.ops``, ``omnicore.testing``) expose
heavy names through a module ``__getattr__`` built by :func:`lazy_getattr`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def resolve(path: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute (``"package.module"`` alone: the module)."""
    module_name, _, attr_path = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr_path.split(".")):
        obj = getattr(obj, part)
    return obj


def lazy_getattr(module_name: str, targets: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module_name``: ``targets`` maps a public name to its ``"module:attr"``
    path; the first access imports it and caches it in the module, so later accesses cost nothing."""

    def getattr_(name: str) -> Any:
        target = targets.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = resolve(target)
        setattr(sys.modules[module_name], name, value)
        return value

    return getattr_
