"""Which checkpoint directories the generic adapter claims (no torch import: runs while a model is resolved).

A directory is claimed when its ``model_index.json`` (or ``modular_model_index.json``) names a pipeline class
that diffusers exports, **and no dedicated plugin claims it**. The host runs detectors before it matches
declared class names, so a detector answering "yes" for every diffusers class would shadow a dedicated plugin
that recognises its checkpoints by ``aliases``. The adapter therefore asks every other installed ``omnicore``
entry point (their entry modules are cheap by contract) whether one of their model specs claims the directory
by alias or detector, and steps aside when one does.
"""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger("omni_diffusers")
INDEX_FILES = ("model_index.json", "modular_model_index.json")
OWN_ENTRY_POINT = "diffusers"


def pipeline_class(path: str | Path) -> tuple[str, str] | None:
    """``(index file name, class name)`` of a diffusers checkpoint directory, or ``None``."""
    root = Path(path)
    for name in INDEX_FILES:
        try:
            data = json.loads((root / name).read_text())
        except (OSError, ValueError):
            continue
        cls = data.get("_class_name") if isinstance(data, dict) else None
        if isinstance(cls, str):
            return name, cls
    return None


@lru_cache(maxsize=512)
def is_diffusers_class(name: str) -> bool:
    """Whether diffusers exports ``name`` (its top-level module is lazy: this imports no model code)."""
    try:
        import diffusers
    except ImportError:
        return False
    return name in getattr(diffusers, "_import_structure", {}).get("pipelines", ()) or name in dir(diffusers)


def _names(variable: str) -> frozenset[str] | None:
    value = os.environ.get(variable)
    return None if value is None else frozenset(n.strip().lower() for n in value.split(",") if n.strip())


def dedicated_claimant(path: str | Path, class_name: str) -> str | None:
    """The name of another installed plugin's model that claims ``path`` (alias or detector), or ``None``.

    Plugins the user's ``OMNICORE_PLUGINS`` / ``OMNICORE_DISABLE_PLUGINS`` lists keep from loading are not asked:
    the adapter must not step aside for a plugin that will not be there to serve the checkpoint."""
    for entry, spec in _other_specs(_names("OMNICORE_PLUGINS"), _names("OMNICORE_DISABLE_PLUGINS") or frozenset()):
        if class_name.lower() in (spec.name, *(a.lower() for a in spec.aliases)):
            return f"{spec.name} ({entry})"
        if spec.detect is not None:
            try:
                from importlib import import_module

                module, _, attr = spec.detect.partition(":")
                if getattr(import_module(module), attr)(path):
                    return f"{spec.name} ({entry})"
            except Exception as exc:  # a broken detector is that plugin's problem; the host reports it too
                logger.debug("detector of %s raised: %s", spec.name, exc)
    return None


@lru_cache(maxsize=8)
def _other_specs(allow: frozenset[str] | None, deny: frozenset[str]) -> tuple[tuple[str, Any], ...]:
    from importlib import import_module
    from importlib.metadata import entry_points

    found: list[tuple[str, Any]] = []
    for ep in entry_points(group="omnicore"):
        dist = (ep.dist.name if ep.dist is not None else "").lower()
        names = {ep.name.lower(), dist}
        if ep.name == OWN_ENTRY_POINT or "*" in deny or names & deny or (allow is not None and not names & allow):
            continue
        try:
            module = import_module(ep.value.partition(":")[0])
            hook = getattr(module, "omnicore_register_models", None)
            if hook is not None:
                hook(register=lambda spec, _name=ep.name, **_: found.append((_name, spec)))
        except Exception as exc:
            logger.debug("entry point %s could not be read: %s", ep.name, exc)
    return tuple(found)


def detect(path: str | Path) -> bool:
    """True for a diffusers pipeline directory that no dedicated plugin claims."""
    found = pipeline_class(path)
    if found is None or not is_diffusers_class(found[1]):
        return False
    claimant = dedicated_claimant(path, found[1])
    if claimant is not None:
        logger.info("%s (%s) is left to the dedicated model %s", path, found[1], claimant)
        return False
    return True
