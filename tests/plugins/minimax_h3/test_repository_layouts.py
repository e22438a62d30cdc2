"""Every layout a user can download loads, with the settings the repository's own configs carry.

- diffusers' modular layout: written here by diffusers itself (``ModularPipeline.save_pretrained`` writes
  ``modular_model_index.json``, not ``model_index.json``: it was detected as MiniMax-H3 and then refused with
  "missing model_index.json"); its pipeline config's canvas and its two scheduler configs' shifts must reach our
  requests (only a private ``_minimax_h3`` block was read, so a 64-pixel canvas came out 768x1344);
- the official ``FL2VA/`` + ``Ref2VA/`` partition layout (official transformer names, ``video_vae/``, one
  ``model_index.json`` per partition, each with its own shifts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _h3_helpers import image, load, reference, request, run

CANVAS_SHORT_EDGE, CANVAS_MAX_PIXELS = 64, 8192
VIDEO_SHIFT, AUDIO_SHIFT = 7.0, 2.5


def _diffusers_written(source: Path, target: Path) -> Path:
    """diffusers' own ``MiniMaxH3ModularPipeline`` over the tiny components, saved with ``save_pretrained``."""
    from _h3_peer import _strict
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    pipe: Any = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(
        transformer=_strict(MiniMaxH3Transformer3DModel, source / "transformer"),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(str(source / "text_encoder")),
        tokenizer=AutoTokenizer.from_pretrained(str(source / "tokenizer")),
        processor=AutoImageProcessor.from_pretrained(str(source / "processor")),
        vae=_strict(AutoencoderKLMiniMaxH3, source / "vae"),
        audio_vae=_strict(AutoencoderKLMiniMaxH3Audio, source / "audio_vae"),
        scheduler=MiniMaxH3Scheduler(shift=VIDEO_SHIFT), audio_scheduler=MiniMaxH3Scheduler(shift=AUDIO_SHIFT))
    pipe.register_to_config(canvas_short_edge=CANVAS_SHORT_EDGE, canvas_max_pixels=CANVAS_MAX_PIXELS,
                            reference_image_short_edge=64)
    pipe.save_pretrained(str(target), overwrite_modular_index=True)
    return target


@pytest.fixture(scope="module")
def modular_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _diffusers_written(tiny_dir, tmp_path_factory.mktemp("h3-modular") / "repo")


def test_a_diffusers_written_repository_loads_with_its_own_canvas_and_shifts(modular_dir: Path) -> None:
    from diffusers import MiniMaxH3Scheduler
    from omni_minimax_h3.detect import detect

    assert (modular_dir / "modular_model_index.json").is_file() and not (modular_dir / "model_index.json").exists()
    index = json.loads((modular_dir / "modular_model_index.json").read_text())
    assert (index["canvas_short_edge"], index["canvas_max_pixels"]) == (CANVAS_SHORT_EDGE, CANVAS_MAX_PIXELS)
    assert detect(modular_dir)
    pipe = load(modular_dir)
    d = pipe.deployment
    assert d.partitions == ("fl2va",)
    assert (d.canvas_short_edge, d.canvas_max_pixels, d.canvas_multiple) == (CANVAS_SHORT_EDGE, CANVAS_MAX_PIXELS, 32)
    assert (d.video_shift, d.audio_shift) == (VIDEO_SHIFT, AUDIO_SHIFT)
    prepared = pipe.preprocess(request(extra={"aspect_ratio": "16:9"}, num_inference_steps=2))
    r = prepared.plan.resolved
    assert (r.height, r.width) == (64, 128)  # the repo's 64-pixel canvas (its default would be 768x1344)
    assert (r.video_shift, r.audio_shift) == (VIDEO_SHIFT, AUDIO_SHIFT)
    state = pipe.encode([prepared])
    sig_v, sig_a = state.extras["sigmas"]
    for sigmas, folder in ((sig_v, "scheduler"), (sig_a, "audio_scheduler")):
        peer = MiniMaxH3Scheduler.from_pretrained(str(modular_dir / folder))  # diffusers' grid for 2 model calls
        peer.set_timesteps(3)
        torch.testing.assert_close(sigmas.cpu(), peer.sigmas.cpu().float(), rtol=0, atol=0)
    for step in range(state.num_steps):
        state = pipe.denoise_step(state, step)
    (out,) = pipe.decode(state)
    assert out.frames.shape == (107, 64, 128, 3) and out.audio.shape[0] == 2


def _official(source: Path, target: Path) -> Path:
    """The official partition layout from a tiny combined repository: ``FL2VA/`` with the shared components
    (``video_vae/``, official transformer names) and ``Ref2VA/`` with its transformer only; the Ref2VA partition
    has shifts of its own."""
    from omni_minimax_h3.loader import load_transformer, save_transformer

    fl2va, ref2va = target / "FL2VA", target / "Ref2VA"
    for name in ("text_encoder", "tokenizer", "processor", "audio_vae"):
        shutil.copytree(source / name, fl2va / name)
    shutil.copytree(source / "vae", fl2va / "video_vae")
    save_transformer(load_transformer(source / "transformer"), fl2va / "transformer", format="official")
    save_transformer(load_transformer(source / "transformer_ref"), ref2va / "transformer", format="official")
    meta = json.loads((source / "model_index.json").read_text())["_minimax_h3"]
    for folder, partition, shifts in ((fl2va, "fl2va", {"video": 12.0, "audio": 3.0}),
                                      (ref2va, "ref2va", {"video": 9.0, "audio": 2.0})):
        block = {"partition": partition, "sigma_shift_scales": shifts,
                 **{k: meta[k] for k in ("canvas_short_edge", "canvas_max_pixels", "reference_image_short_edge")}}
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline",
                                                             "_minimax_h3": block}))
    return target


@pytest.mark.slow
def test_the_official_partition_layout_loads_both_partitions(tiny_combined_dir: Path, combined: Any,
                                                             tmp_path: Path) -> None:
    from omni_minimax_h3.detect import detect

    root = _official(tiny_combined_dir, tmp_path / "official")
    assert detect(root)
    pipe = load(root)
    d = pipe.deployment
    assert d.partitions == ("fl2va", "ref2va") and d.canvas_short_edge == 64
    assert d.shifts("fl2va") == (12.0, 3.0) and d.shifts("ref2va") == (9.0, 2.0)
    ref2va = request(num_inference_steps=2, extra={"flow_shift": 12.0, "audio_flow_shift": 3.0},
                     inputs=(reference("image", image(320, 256)),))
    _, (ours,) = run(pipe, ref2va)
    _, (theirs,) = run(combined, ref2va)  # same weights, same shifts: the same output as the diffusers layout
    assert (ours.frames == theirs.frames).all() and (ours.audio == theirs.audio).all()
    prepared = pipe.preprocess(request(num_inference_steps=2, extra={}, inputs=(reference("image", image(320, 256)),)))
    assert (prepared.plan.resolved.video_shift, prepared.plan.resolved.audio_shift) == (9.0, 2.0)


def test_a_component_the_index_points_elsewhere_is_named(modular_dir: Path, tmp_path: Path) -> None:
    from omni_minimax_h3.repository import resolve_layout
    from omnicore.plugin import CheckpointError

    moved = tmp_path / "repo"
    shutil.copytree(modular_dir, moved, ignore=shutil.ignore_patterns("text_encoder"))
    index = json.loads((moved / "modular_model_index.json").read_text())
    index["text_encoder"][2].update(pretrained_model_name_or_path="someone/qwen3-vl", subfolder="")
    (moved / "modular_model_index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing the text_encoder/ folder; the index points it at "
                                              "'someone/qwen3-vl'"):
        resolve_layout(moved)
    layout = resolve_layout(modular_dir)
    assert layout.kind == "modular" and layout.video_vae == modular_dir / "vae"
    assert set(layout.transformers) == {"fl2va"}  # transformer_ref is listed unset: no Ref2VA partition
