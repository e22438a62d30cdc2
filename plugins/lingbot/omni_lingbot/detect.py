"""Recognise a LingBot repository on disk by its JSON metadata (no torch import: the engine calls this
while choosing a model for a path)."""

from __future__ import annotations

import json
from pathlib import Path

PIPELINE_CLASS = "LingBotVideoPipeline"
TRANSFORMER_CLASS = "LingBotVideoTransformer3DModel"


def detect(path: str | Path) -> bool:
    """True when ``model_index.json`` names the LingBot pipeline or ``transformer/config.json`` its DiT."""
    root = Path(path)
    for candidate, name in ((root / "model_index.json", PIPELINE_CLASS),
                            (root / "transformer" / "config.json", TRANSFORMER_CLASS)):
        try:
            if json.loads(candidate.read_text()).get("_class_name") == name:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False
