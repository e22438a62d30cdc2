"""Where a MiniMax-H3 repository keeps its components, and the settings its own configs carry (no torch).

Three on-disk layouts load:

- **diffusers modular** (what ``ModularPipeline.save_pretrained`` writes): ``modular_model_index.json`` whose
  top level carries the pipeline config (``canvas_short_edge``, ``canvas_max_pixels``,
  ``reference_image_short_edge``) next to one ``[library, class, {pretrained_model_name_or_path, subfolder}]``
  entry per component; folders ``transformer/`` (FL2VA), ``transformer_ref/`` (Ref2VA), ``text_encoder/``,
  ``tokenizer/``, ``processor/``, ``vae/``, ``audio_vae/``, ``scheduler/`` (video shift) and
  ``audio_scheduler/`` (audio shift).
- **diffusers-style with ``model_index.json``** (our tiny presets): the same folders, plus a ``_minimax_h3``
  block (partition(s), ``sigma_shift_scales``, canvas).
- **official partitions**: ``FL2VA/`` (t2va, fl2va) and ``Ref2VA/`` (ref2va), each with its own
  ``model_index.json`` and ``_minimax_h3`` block (``sigma_shift_scales``); the shared components (text encoder,
  tokenizer, processor, ``video_vae/``, ``audio_vae/``) live in ``FL2VA/`` (in ``Ref2VA/`` for a Ref2VA-only
  download).

Settings, each from the first source that has it: shifts from the scheduler configs, else the partition's
``_minimax_h3.sigma_shift_scales``, else 12 / 3; canvas and reference short edge from the pipeline config at the
index's top level, else the ``_minimax_h3`` block, else the release's 768 / 768·1344 / 2048. Two sources that
disagree are logged (the first one wins).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from omnicore.plugin import CheckpointError, read_json

from .request_rules import CANVAS_MAX_PIXELS, CANVAS_SHORT_EDGE, DEFAULT_AUDIO_SHIFT, DEFAULT_VIDEO_SHIFT

logger = logging.getLogger("omni_minimax_h3")

PLUGIN = "minimax_h3"
MODULAR_INDEX = "modular_model_index.json"
INDEX = "model_index.json"
PARTITION_DIRS = {"fl2va": "FL2VA", "ref2va": "Ref2VA"}
DEFAULT_REFERENCE_SHORT_EDGE = 2048
DEFAULT_TEXT_LAYER = 50


@attrs.frozen
class RepoSettings:
    """What the repository's own configs say about serving it."""

    canvas_short_edge: int = CANVAS_SHORT_EDGE
    canvas_max_pixels: int = CANVAS_MAX_PIXELS
    reference_image_short_edge: int = DEFAULT_REFERENCE_SHORT_EDGE
    video_shift: float = DEFAULT_VIDEO_SHIFT
    audio_shift: float = DEFAULT_AUDIO_SHIFT
    #: partition -> (video, audio), where a partition's own metadata gives its shifts (official layout)
    partition_shifts: Mapping[str, tuple[float, float]] = attrs.field(factory=dict)
    text_encoder_layer: int = DEFAULT_TEXT_LAYER


@attrs.frozen
class RepoLayout:
    """Component folders of one repository (see the module docstring) and its settings."""

    root: Path
    kind: str  # "modular", "diffusers" or "official"
    transformers: Mapping[str, Path]  # partition -> transformer folder
    text_encoder: Path
    tokenizer: Path
    processor: Path
    video_vae: Path
    audio_vae: Path
    settings: RepoSettings


def _maybe_json(path: Path) -> dict[str, Any] | None:
    return read_json(path, plugin=PLUGIN) if path.is_file() else None


def _component_dir(root: Path, index: Mapping[str, Any] | None, name: str, *fallbacks: str) -> Path | None:
    """The folder of component ``name``: ``root/<subfolder>`` (the index entry's, else the name, else each
    fallback name), or the local directory the modular index points the entry at."""
    entry = index.get(name) if index is not None else None
    spec = entry[2] if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict) else {}
    sub = spec.get("subfolder") or name
    for candidate in (sub, name, *fallbacks):
        if (root / candidate).is_dir():
            return root / candidate
    repo = spec.get("pretrained_model_name_or_path")
    if isinstance(repo, (str, os.PathLike)) and Path(repo).is_dir() and (Path(repo) / sub).is_dir():
        return Path(repo) / sub
    return None


def _number(sources: list[tuple[str, Any]], what: str, default: Any, cast: Any) -> Any:
    """The first source's value of ``what`` (``(source name, value or None)`` in order), warning on conflicts."""
    found = [(where, cast(v)) for where, v in sources if v is not None]
    if not found:
        return default
    for where, value in found[1:]:
        if value != found[0][1]:
            logger.warning("MiniMax-H3 repository: %s says %s = %s but %s says %s; using %s", found[0][0], what,
                           found[0][1], where, value, found[0][1])
    return found[0][1]


def _scheduler_shift(folder: Path | None) -> float | None:
    if folder is None or not (folder / "scheduler_config.json").is_file():
        return None
    shift = read_json(folder / "scheduler_config.json", plugin=PLUGIN, component=folder.name).get("shift")
    return None if shift is None else float(shift)


def _meta(index: Mapping[str, Any] | None) -> dict[str, Any]:
    meta = index.get("_minimax_h3") if index is not None else None
    return meta if isinstance(meta, dict) else {}


def _transformer_dirs(root: Path, index: Mapping[str, Any] | None) -> dict[str, Path]:
    found: dict[str, Path] = {}
    ref = _component_dir(root, index, "transformer_ref")
    if ref is not None and (ref / "config.json").is_file():
        found["ref2va"] = ref
    main = _component_dir(root, index, "transformer")
    if main is not None and (main / "config.json").is_file():
        found.setdefault("ref2va" if _meta(index).get("partition") == "ref2va" else "fl2va", main)
    return found


def _index(folder: Path) -> dict[str, Any] | None:
    modular = _maybe_json(folder / MODULAR_INDEX)
    return modular if modular is not None else _maybe_json(folder / INDEX)


def _partition_dirs(root: Path) -> dict[str, Path]:
    """``FL2VA/`` / ``Ref2VA/`` partitions of an official repository (none when the root has its own index)."""
    if (root / INDEX).is_file() or (root / MODULAR_INDEX).is_file():
        return {}
    return {p: root / d for p, d in PARTITION_DIRS.items()
            if any((root / d / f).is_file() for f in (INDEX, MODULAR_INDEX, "transformer/config.json"))}


def transformer_folders(path: Path | str) -> dict[str, Path]:
    """The transformer folders by partition (``"fl2va"``, ``"ref2va"``) of any layout: ``FL2VA/transformer/`` +
    ``Ref2VA/transformer/``; or ``transformer/`` (FL2VA, or the partition ``_minimax_h3.partition`` names) +
    ``transformer_ref/`` (Ref2VA), at the index's subfolders."""
    root = Path(path)
    partitions = _partition_dirs(root)
    if not partitions:
        return _transformer_dirs(root, _index(root))
    found = {}
    for part, folder in partitions.items():
        tdir = _component_dir(folder, _index(folder), "transformer")
        if tdir is not None and (tdir / "config.json").is_file():
            found[part] = tdir
    return found


def resolve_layout(path: Path | str) -> RepoLayout:
    """The layout of the repository at ``path``; a :class:`CheckpointError` names what is missing."""
    root = Path(path)
    partitions = _partition_dirs(root)
    if partitions:
        return _official(root, partitions)
    modular = _maybe_json(root / MODULAR_INDEX)
    index = modular if modular is not None else _maybe_json(root / INDEX)
    if index is None:
        raise CheckpointError(PLUGIN, root, f"no {MODULAR_INDEX} (diffusers' modular layout), {INDEX}, nor FL2VA/ "
                                            f"or Ref2VA/ partitions")
    transformers = _transformer_dirs(root, index)
    meta = _meta(index)
    video = _scheduler_shift(_component_dir(root, index, "scheduler"))
    audio = _scheduler_shift(_component_dir(root, index, "audio_scheduler"))
    scales = meta.get("sigma_shift_scales") or {}
    sources = {"config": root.name + "/" + (MODULAR_INDEX if modular is not None else INDEX)}
    settings = RepoSettings(
        canvas_short_edge=_number([(sources["config"], index.get("canvas_short_edge")),
                                   ("_minimax_h3", meta.get("canvas_short_edge"))], "canvas_short_edge",
                                  CANVAS_SHORT_EDGE, int),
        canvas_max_pixels=_number([(sources["config"], index.get("canvas_max_pixels")),
                                   ("_minimax_h3", meta.get("canvas_max_pixels"))], "canvas_max_pixels",
                                  CANVAS_MAX_PIXELS, int),
        reference_image_short_edge=_number([(sources["config"], index.get("reference_image_short_edge")),
                                            ("_minimax_h3", meta.get("reference_image_short_edge"))],
                                           "reference_image_short_edge", DEFAULT_REFERENCE_SHORT_EDGE, int),
        video_shift=_number([("scheduler/scheduler_config.json", video),
                             ("_minimax_h3.sigma_shift_scales", scales.get("video"))], "the video shift",
                            DEFAULT_VIDEO_SHIFT, float),
        audio_shift=_number([("audio_scheduler/scheduler_config.json", audio),
                             ("_minimax_h3.sigma_shift_scales", scales.get("audio"))], "the audio shift",
                            DEFAULT_AUDIO_SHIFT, float),
        text_encoder_layer=int(meta.get("text_encoder_layer", DEFAULT_TEXT_LAYER)),
    )
    return _assemble(root, "modular" if modular is not None else "diffusers", transformers, root, index, settings)


def _official(root: Path, partitions: dict[str, Path]) -> RepoLayout:
    """``FL2VA/`` + ``Ref2VA/``: each partition's transformer and shifts; the shared components from the first
    partition that has a text encoder."""
    transformers = transformer_folders(root)
    shifts: dict[str, tuple[float, float]] = {}
    metas: dict[str, dict[str, Any]] = {}
    for part, folder in partitions.items():
        index = _index(folder)
        meta = metas[part] = _meta(index)
        scales = meta.get("sigma_shift_scales") or {}
        video = _scheduler_shift(_component_dir(folder, index, "scheduler"))
        audio = _scheduler_shift(_component_dir(folder, index, "audio_scheduler"))
        shifts[part] = (_number([("scheduler", video), ("sigma_shift_scales", scales.get("video"))],
                                f"the {part} video shift", DEFAULT_VIDEO_SHIFT, float),
                        _number([("audio_scheduler", audio), ("sigma_shift_scales", scales.get("audio"))],
                                f"the {part} audio shift", DEFAULT_AUDIO_SHIFT, float))
    shared_part = next((p for p in ("fl2va", "ref2va") if p in partitions and
                        (partitions[p] / "text_encoder").is_dir()), next(iter(partitions)))
    shared = partitions[shared_part]
    meta = metas[shared_part]
    index = _index(shared)
    first = shifts[shared_part]
    settings = RepoSettings(
        canvas_short_edge=int(meta.get("canvas_short_edge", CANVAS_SHORT_EDGE)),
        canvas_max_pixels=int(meta.get("canvas_max_pixels", CANVAS_MAX_PIXELS)),
        reference_image_short_edge=int(meta.get("reference_image_short_edge", DEFAULT_REFERENCE_SHORT_EDGE)),
        video_shift=first[0], audio_shift=first[1], partition_shifts=shifts,
        text_encoder_layer=int(meta.get("text_encoder_layer", DEFAULT_TEXT_LAYER)),
    )
    return _assemble(root, "official", transformers, shared, index, settings)


def _assemble(root: Path, kind: str, transformers: dict[str, Path], shared: Path, index: Mapping[str, Any] | None,
              settings: RepoSettings) -> RepoLayout:
    if not transformers:
        raise CheckpointError(PLUGIN, root, "no transformer/ or transformer_ref/ (nor FL2VA/ / Ref2VA/) partition")
    folders: dict[str, Path] = {}
    for name, fallbacks in (("text_encoder", ()), ("vae", ("video_vae",)), ("audio_vae", ()),
                            ("tokenizer", ("processor",)), ("processor", ("tokenizer",))):
        folder = _component_dir(shared, index, name, *fallbacks)
        if folder is None:
            where = "" if shared == root else f" (under {shared.name}/)"
            entry = index.get(name) if index is not None else None
            spec = entry[2] if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict) else {}
            elsewhere = spec.get("pretrained_model_name_or_path")
            hint = (f"; the index points it at {elsewhere!r} (subfolder {spec.get('subfolder') or '-'}), which is "
                    f"not here: download it into {name}/") if elsewhere else ""
            raise CheckpointError(PLUGIN, root, f"missing the {name}/ folder{where}{hint}", component=name)
        folders[name] = folder
    return RepoLayout(root=root, kind=kind, transformers=transformers, text_encoder=folders["text_encoder"],
                      tokenizer=folders["tokenizer"], processor=folders["processor"], video_vae=folders["vae"],
                      audio_vae=folders["audio_vae"], settings=settings)
