"""Recognise a HunyuanImage-3 repository on disk by its ``config.json`` (no torch import)."""

from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURE = "HunyuanImage3ForCausalMM"


def detect(path: str | Path) -> bool:
    """True when ``config.json`` lists the HunyuanImage-3 architecture."""
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = data.get("architectures") if isinstance(data, dict) else None
    return isinstance(archs, list) and ARCHITECTURE in archs
