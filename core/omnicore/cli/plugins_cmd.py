"""``omnicore plugins``: what is installed, its status and what it registered — without importing torch.

Every problem (a failed or incompatible plugin, an unknown name in ``OMNICORE_PLUGINS`` /
``OMNICORE_DISABLE_PLUGINS``, a duplicate) is printed exactly once, as one ``error:`` line on stderr; stdout
carries only the listing (a table, ``--json``, or ``--requirements`` lines), so it stays machine-readable.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from ..plugins import LOADED, PluginHost


def run(args: argparse.Namespace) -> int:
    log = logging.getLogger("omnicore.plugins")
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
    if args.json:
        payload = {
            "plugins": [r.to_json() for r in records],
            "registries": {kind: reg.providers() for kind, reg in host.registries.items()},
            "overrides": overrides,
            "problems": host.problems,
        }
        print(json.dumps(payload, indent=2, sort_keys=True))
        return 0
    header = ("NAME", "DISTRIBUTION", "VERSION", "STATUS", "IMPORT", "REGISTERS")
    rows = [header]
    for rec in records:
        registers = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(rec.registered.items())) or "-"
        status = rec.status.upper() if rec.status != LOADED else rec.status
        rows.append((rec.name, rec.dist or "-", rec.version or "-", status,
                     f"{rec.import_s * 1000:.1f} ms", registers))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    for o in overrides:
        print(f"override: {o['kind']} {o['name']!r} from {o['replaced']!r} replaced by {o['by']!r}")
    return 0


def _overrides(host: PluginHost) -> list[dict[str, Any]]:
    """Every ``register(..., replace=True)`` that took effect, oldest first."""
    return [{"kind": kind, "name": name, "replaced": old, "by": new}
            for kind, reg in host.registries.items() for name, old, new in reg.overrides]
