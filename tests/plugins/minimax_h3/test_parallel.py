"""MiniMax-H3 over a worker group (``--parallel``, gloo, 2 and 4 processes): the frames and the audio of a single
request and of a batch equal the single-process engine's (same seeds) under ``ulysses=2``, ``tp=2`` (DiT and text
encoder split) and ``tp=2,ulysses=2``; ``cfg=2`` is refused before any process starts, with the reason (H3 is
guidance-distilled); a head count the degree does not divide is refused at load, naming the numbers."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _worker_group_helpers import planned_file_bytes
from omnicore.engine.api import Engine, make_request
from omnicore.errors import ConfigError, UnsupportedFeature

PARAMS = {"num_inference_steps": 2, "height": 64, "width": 64, "duration": 4.0, "extra": {"aspect_ratio": "1:1"}}
PROMPTS = ("rain on a tin roof", "a dog barking at the sea")


def _engine(path: Path, parallel: str | None = None) -> Engine:
    from omnicore.plugin_host.host import default_host

    settings = default_host().settings.evolve(request_batch_max_wait_ms=400.0)  # lets two submits form a batch
    return Engine(str(path), settings=settings, parallel=parallel)


def _outputs(engine: Engine, *prompts: str, seed: int = 5) -> list[Any]:
    """One output per prompt, submitted together so they run as one batch (checked)."""
    jobs = [engine.submit(make_request(p, seed=seed + i, **PARAMS)) for i, p in enumerate(prompts)]
    outputs = [job.result(600)[0] for job in jobs]
    assert {o.metrics["batch_requests"] for o in outputs} == {len(prompts)}
    return outputs


def _assert_same(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.frames.shape == e.frames.shape and g.audio.shape == e.audio.shape
        # uint8 frames: fp32 reassociation may move a value across a rounding boundary, never further
        assert np.abs(g.frames.astype(int) - e.frames.astype(int)).max() <= 1
        np.testing.assert_allclose(g.audio, e.audio, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> dict[str, list[Any]]:
    with _engine(tiny_dir) as engine:
        return {"single": _outputs(engine, PROMPTS[0]), "batch": _outputs(engine, *PROMPTS)}


def test_cfg_parallel_is_refused_with_the_reason_before_any_process_starts(tiny_dir: Path) -> None:
    with pytest.raises(UnsupportedFeature, match=r"does not implement cfg.*guidance-distilled") as info:
        _engine(tiny_dir, "cfg=2")
    assert info.value.feature == "parallel"
    assert multiprocessing.active_children() == []


def test_cfg_rank_is_refused_by_the_pipeline_too(pipe: Any) -> None:
    with pytest.raises(ConfigError, match="guidance-distilled"):
        pipe.enable_parallel(SimpleNamespace(cfg=2, ulysses=1, tp=1))
    pipe.enable_parallel(None)


def test_head_count_the_ulysses_degree_does_not_divide_is_refused_at_load(pipe: Any) -> None:
    heads = pipe.transformer.config.num_attention_heads  # 4 in the tiny preset
    with pytest.raises(ConfigError, match=rf"ulysses=3 must divide the model's attention heads \({heads}\)"):
        pipe.transformer.enable_ulysses(SimpleNamespace(ulysses=3))
    assert pipe.transformer.sequence_parallel is None


@pytest.mark.slow
def test_ulysses_frames_and_audio_match_single_process(tiny_dir: Path, reference: Any) -> None:
    with _engine(tiny_dir, "ulysses=2") as engine:
        assert engine.pipeline.transformer.sequence_parallel.ulysses == 2
        assert engine.pipeline.seq_align % 2 == 0
        _assert_same(_outputs(engine, PROMPTS[0]), reference["single"])
        stats = engine.group.ctx.stats.snapshot()
        assert stats["calls"]["all_to_all"] > 0 and stats["calls"]["all_gather"] > 0
        _assert_same(_outputs(engine, *PROMPTS), reference["batch"])


def test_head_count_the_tp_degree_does_not_divide_is_refused_at_load(tiny_dir: Path) -> None:
    from omni_minimax_h3.loader import load_transformer

    with pytest.raises(ConfigError, match=r"tp=3 must divide the model's attention heads \(4\)"):
        load_transformer(tiny_dir / "transformer", tp=(0, 3))


@pytest.mark.slow
def test_tp_frames_and_audio_match_single_process_and_each_rank_holds_its_share(tiny_dir: Path,
                                                                                  reference: Any) -> None:
    import torch
    from omni_minimax_h3.loader import detect_transformer_format, read_transformer_config
    from omni_minimax_h3.transformer.model import MiniMaxH3DiT
    from omni_minimax_h3.transformer.tensor_parallel import checkpoint_plan, module_plan
    from omnicore.plugin import local_parameter_bytes, sharded_parameter_bytes

    folder = tiny_dir / "transformer"
    config = read_transformer_config(folder)
    with _engine(tiny_dir, "tp=2") as engine:
        dit = engine.pipeline.transformer
        assert dit.tensor_parallel.tp == 2 and dit.blocks[0].attn.heads == config.num_attention_heads // 2
        _assert_same(_outputs(engine, PROMPTS[0]), reference["single"])
        calls = engine.group.ctx.stats.snapshot()["calls"]
        # one all-reduce per attention and per MLP, in every DiT block and refiner block, at every step, and in
        # every text-encoder layer read (the prompt is encoded once)
        text = engine.pipeline.text_encoder
        assert text.tensor_parallel.tp == 2
        blocks = config.num_layers * PARAMS["num_inference_steps"] + config.num_refiner_layers + text.layer
        assert calls["all_reduce"] == 2 * blocks, calls
        # each DiT block's AdaLN projection holds half its outputs and all-gathers its few rows once per step
        assert dit.blocks[0].adaln_proj.linear.weight.shape[0] == 18 * config.hidden_size // 2
        assert calls["all_gather"] == config.num_layers * PARAMS["num_inference_steps"], calls
        _assert_same(_outputs(engine, *PROMPTS), reference["batch"])
        # resident parameter bytes of rank 0 = the analytic share; bytes read = the file less half the split rows
        with torch.device("meta"):
            meta = MiniMaxH3DiT(config)
        full = local_parameter_bytes(meta)
        analytic = sharded_parameter_bytes(meta, module_plan(config), 2)
        assert local_parameter_bytes(dit) == analytic < full
        total, split = planned_file_bytes(folder, checkpoint_plan(config, detect_transformer_format(folder)))
        assert split > 0 and dit.tp_bytes_read == total - split // 2
        # the text encoder read only its share too (test_parallel_text_encoder.py checks the bytes exactly)
        files = sum(f.stat().st_size for f in (tiny_dir / "text_encoder").glob("*.safetensors"))
        assert 0 < text.model.tp_bytes_read < files


@pytest.mark.slow
def test_tp_times_ulysses_on_four_processes(tiny_dir: Path, reference: Any) -> None:
    """tp=2,ulysses=2: each rank holds half the DiT's heads (2 of the tiny preset's 4) and runs half of those again
    under Ulysses; a single request and a batch give the single-process frames and audio."""
    with _engine(tiny_dir, "tp=2,ulysses=2") as engine:
        assert len(engine.group.processes) == 3
        dit = engine.pipeline.transformer
        assert dit.blocks[0].attn.heads == 2 and dit.sequence_parallel.ulysses == 2
        _assert_same(_outputs(engine, PROMPTS[0]), reference["single"])
        _assert_same(_outputs(engine, *PROMPTS), reference["batch"])
        calls = engine.group.ctx.stats.snapshot()["calls"]
        assert calls["all_reduce"] > 0 and calls["all_to_all"] > 0
