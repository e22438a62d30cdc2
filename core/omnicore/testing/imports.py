"""Which omnicore modules a plugin's package imports: only the public ones are a stable contract.

``omnicore.plugin`` (everything a plugin needs), ``omnicore.testing`` (this kit) and the top-level ``omnicore``
package (the user API) are public; every other ``omnicore.*`` module may change in any release, so a plugin that
imports one works today and breaks on an upgrade. The check reads the package's source (every ``.py`` file, imports
inside functions included) without importing it.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Iterator
from pathlib import Path

PUBLIC_MODULES = frozenset({"omnicore", "omnicore.plugin", "omnicore.testing"})


def _package_files(package: str) -> Iterator[Path]:
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ModuleNotFoundError(f"no module named {package!r}")
    if spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            yield from sorted(p for p in Path(root).rglob("*.py") if "build" not in p.relative_to(root).parts)
    elif spec.origin and spec.origin.endswith(".py"):
        yield Path(spec.origin)


def _omnicore_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "omnicore" or alias.name.startswith("omnicore."):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "omnicore" or node.module.startswith("omnicore."):
                yield node.lineno, node.module


def internal_imports(packages: Iterable[str]) -> list[str]:
    """``"path:line: omnicore.x.y"`` for every import of a non-public omnicore module in ``packages``' source.

    The omnicore distribution itself is exempt (its modules are the implementation)."""
    found: list[str] = []
    for package in packages:
        if package == "omnicore" or package.startswith("omnicore."):
            continue
        for path in _package_files(package):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for line, module in _omnicore_modules(tree):
                if module not in PUBLIC_MODULES:
                    found.append(f"{path}:{line}: {module}")
    return found
