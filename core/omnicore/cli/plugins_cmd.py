"""``omnicore plugins``: what is installed, its status and what it registered — without importing torch.

Also lists every platform with its availability (and the reason when it cannot run here) and the platform ops
each backend provides (fast kernels registered through ``omnicore_register_ops``). ``--check`` also imports every
registered implementation in a child process (:mod:`omnicore.cli.plugin_check`) and exits 1 when one cannot import.

Every problem (a failed or incompatible plugin, an unknown name in ``OMNICORE_PLUGINS`` /
``OMNICORE_DISABLE_PLUGINS``, a duplicate) is printed exactly once, as one ``error:`` line on stderr; stdout
carries only the listing (a table, ``--json``, or ``--requirements`` lines), so it stays machine-readable.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

from ..plugin_host import LOADED, PluginHost
from .models_cmd import preset_card

if TYPE_CHECKING:
    from ..plugin_host.host import PlatformRow


def run(args: argparse.Namespace) -> int:
    log = logging.getLogger("omnicore.plugin_host")
    previous = log.level
    log.setLevel(logging.ERROR)  # this command prints each problem itself, exactly once
    try:
        host = PluginHost()
    finally:
        log.setLevel(previous)
    for line in host.problems:
        print(f"error: {line}", file=sys.stderr)
    records = list(host.records.values())
    if args.requirements:
        for rec in records:
            if rec.dist and rec.version and rec.dist != "omnicore":
                print(f"{rec.dist}=={rec.version}")
        return 0
    overrides = _overrides(host)
    platforms = host.platform_availability()
    checks = None
    if getattr(args, "check", False):
        from .plugin_check import check_paths, registered_paths

        checks = check_paths(registered_paths(host))
        for c in checks:
            if not c.ok:
                print(f"error: plugin {c.plugin}: {c.kind} {c.name!r}: cannot import {c.path}: {c.error}",
                      file=sys.stderr)
    failed_plugins = {c.plugin for c in checks or () if not c.ok}
    if args.json:
        payload = {
            "plugins": [r.to_json() for r in records],
            "platforms": platforms,
            "presets": _presets(host),
            "registries": {kind: reg.providers() for kind, reg in host.registries.items()},
            "overrides": overrides,
            "problems": host.problems,
        }
        if checks is not None:
            payload["checks"] = [c.to_json() for c in checks]
        print(json.dumps(payload, indent=2, sort_keys=True))
        return 1 if failed_plugins else 0
    header = ("NAME", "DISTRIBUTION", "VERSION", "STATUS", "IMPORT", "REGISTERS")
    rows = [header]
    for rec in records:
        registers = "; ".join(f"{k}: {', '.join(_labels(host, k, v))}"
                              for k, v in sorted(rec.registered.items())) or "-"
        status = rec.status.upper() if rec.status != LOADED else rec.status
        if rec.name in failed_plugins:
            status = "FAILED (--check)"
        elif checks is not None and rec.status == LOADED:
            status = "loaded, checked"
        rows.append((rec.name, rec.dist or "-", rec.version or "-", status,
                     f"{rec.import_s * 1000:.1f} ms", registers))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    for o in overrides:
        print(f"override: {o['kind']} {o['name']!r} from {o['replaced']!r} replaced by {o['by']!r}")
    print()
    _platform_table(platforms)
    return 1 if failed_plugins else 0


def _presets(host: PluginHost) -> list[dict[str, Any]]:
    """Every registered tiny preset: its ``tiny:`` name, model, provider, description and request defaults."""
    return [{**preset_card(p), "model": spec.name, "provider": spec.provider}
            for spec in host.models for p in spec.presets]


def _labels(host: PluginHost, kind: str, keys: list[str]) -> list[str]:
    """Registered names as listed: ops as ``op@platform`` (their registry key also names the provider), models
    with their presets."""
    if kind == "model":
        presets: dict[str, list[str]] = {}
        for p in _presets(host):
            presets.setdefault(p["model"], []).append(p["name"])
        return [f"{k} (presets {', '.join(presets[k])})" if presets.get(k) else k for k in keys]
    if kind != "op":
        return keys
    return [f"{spec.name}@{spec.platform}" for spec in (host.ops.get(k) for k in keys)]


def _platform_table(platforms: list[PlatformRow]) -> None:
    header = ("PLATFORM", "PROVIDER", "PRIORITY", "AVAILABLE", "FAST OPS")
    rows = [header]
    for p in platforms:
        available = "yes" if p["available"] else f"no: {p['reason']}"
        ops = ", ".join(f"{op} ({', '.join(by)})" for op, by in p["ops"].items()) or "-"
        rows.append((p["name"], p["provider"], str(p["priority"]), available, ops))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


def _overrides(host: PluginHost) -> list[dict[str, str]]:
    """Every ``register(..., replace=True)`` that took effect, oldest first."""
    return [{"kind": kind, "name": name, "replaced": old, "by": new}
            for kind, reg in host.registries.items() for name, old, new in reg.overrides]
