"""Recognise a MiniMax-H3 repository on disk from its JSON metadata (no torch: the engine calls this while it
chooses a model for a path)."""

from __future__ import annotations

import json
from pathlib import Path

from .plugin import PIPELINE_CLASS, TRANSFORMER_CLASS

#: Pipeline class names of the layouts we load (diffusers' modular pipeline; the official partitions).
PIPELINE_NAMES = (PIPELINE_CLASS, "MiniMaxH3Pipeline")
TRANSFORMER_NAMES = (TRANSFORMER_CLASS, "MiniMaxH3DiTModel")


def _class_name(path: Path) -> str | None:
    try:
        value = json.loads(path.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def detect(path: str | Path) -> bool:
    """True for a diffusers-layout repository (``model_index.json``, diffusers' modular
    ``modular_model_index.json`` or a ``transformer[_ref]/config.json`` naming MiniMax-H3) or an official one
    (``FL2VA/`` / ``Ref2VA/`` partitions with such metadata)."""
    root = Path(path)
    for base in (root, root / "FL2VA", root / "Ref2VA"):
        for index in ("model_index.json", "modular_model_index.json"):  # the latter: ModularPipeline.save_pretrained
            if _class_name(base / index) in PIPELINE_NAMES:
                return True
        for sub in ("transformer", "transformer_ref"):
            if _class_name(base / sub / "config.json") in TRANSFORMER_NAMES:
                return True
        try:
            if "_minimax_h3" in json.loads((base / "model_index.json").read_text()):
                return True
        except (OSError, ValueError, TypeError):
            pass
    return False
