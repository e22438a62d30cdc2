"""``omnicore plugins --check``: import every implementation a plugin registered, before a request needs it.

``omnicore plugins`` never imports torch, so a plugin whose entry module loads but whose pipeline module cannot
import (a missing dependency, a renamed internal it still imports) shows ``loaded`` and fails only when a request
loads it. ``--check`` imports each registered lazy path (``spec.impl``, a model's ``detect``, a platform's ``probe``,
a cache method's ``resident``, an op's ``applies``, a preset's builder) in one child process
with the full stack, so the check cannot leave torch loaded in (or crash) the caller, and reports each failure as
the plugin, the path and the error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from ..plugin_host.host import PluginHost

#: Run in the child: resolve each path, print one JSON line per path as it finishes (so a crash names the path).
_CHILD = r"""
import json, sys, traceback
from omnicore._lazy import resolve
for line in sys.stdin:
    path = line.strip()
    if not path:
        continue
    try:
        resolve(path)
        print(json.dumps({"path": path, "ok": True}), flush=True)
    except BaseException as exc:  # noqa: BLE001 - any failure, ImportError or not, is the report
        print(json.dumps({"path": path, "ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


@attrs.frozen
class ImplCheck:
    """One registered lazy path and whether it imports."""

    plugin: str
    kind: str
    name: str
    path: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {"plugin": self.plugin, "kind": self.kind, "name": self.name, "path": self.path, "ok": self.ok,
                "error": self.error}


def registered_paths(host: PluginHost) -> list[tuple[str, str, str, str]]:
    """``(plugin, kind, name, path)`` for every lazy implementation path in the host's registries."""
    from ..specs import lazy_paths

    rows: list[tuple[str, str, str, str]] = []
    for kind, registry in host.registries.items():
        for spec in registry:
            provider = getattr(spec, "provider", "") or "?"
            for field, path in lazy_paths(spec):  # the class first, then its detector / probe / applies ...
                rows.append((provider, kind if field == "impl" else f"{kind} {field}", spec.name, path))
            for preset in getattr(spec, "presets", ()) or ():
                rows.extend((provider, f"{kind} preset", preset.name, path) for _, path in lazy_paths(preset))
    return rows


def check_paths(rows: Iterable[tuple[str, str, str, str]], *, timeout: float = 300.0) -> list[ImplCheck]:
    """Import each path in one child process; a path the child never reported (it crashed there) fails too."""
    rows = list(rows)
    paths = list(dict.fromkeys(path for *_, path in rows))
    results: dict[str, str | None] = {}
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], input="\n".join(paths) + "\n", capture_output=True,
                              text=True, timeout=timeout)
        for line in proc.stdout.splitlines():
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue
            results[item["path"]] = None if item.get("ok") else str(item.get("error"))
        crash = f"the check process ended with code {proc.returncode} while importing it" if proc.returncode else None
    except subprocess.TimeoutExpired:
        crash = f"importing took longer than {timeout:g} s"
    missing = crash or "not reported by the check process"
    return [ImplCheck(plugin, kind, name, path, results[path] if path in results else missing)
            for plugin, kind, name, path in rows]
