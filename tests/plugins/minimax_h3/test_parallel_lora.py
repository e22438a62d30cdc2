"""Per-request LoRA on tiny:minimax-h3 over a tensor-parallel group (``tp=2``, gloo, 2 processes): a mixed batch
(an adapter on every block linear and the token refiner, a row without, an adapter on attention only, both
composed) gives the single-process engine's final latents. Each rank holds its share of every adapter like its
base linears: a column-parallel ``qkv_proj`` / ``fc1`` the rows of ``B`` it computes (per fused part), a
row-parallel ``out_proj`` / ``fc2`` the columns of ``A`` (the rank-sized ``x A^T`` summed over the ranks).
Tiny models output noise: only equalities are checked."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from _lora_helpers import FinalLatents, make_peft_adapter, submit_together
from omnicore.config import Settings
from omnicore.engine.api import Engine, make_request
from omnicore.lora import AdapterRegistry, LoRA
from omnicore.plugin_host.host import PluginHost

PARAMS = {"num_inference_steps": 2, "height": 64, "width": 64, "duration": 4.0, "extra": {"aspect_ratio": "1:1"}}
BLOCK = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
REFINER = ["token_refiner.blocks.0.attn.qkv_proj", "token_refiner.blocks.0.mlp.fc2"]
BATCH = [("a",), (), ("b",), ("a", "b")]


def _latents_of(state: Any) -> list[torch.Tensor]:
    """One output per request: its video rows then its audio rows, flattened."""
    items = state.extras["items"]
    video = state.latents[0].split([it.video_rows for it in items])
    audio = state.latents[1].split([it.audio_rows for it in items])
    return [torch.cat([v.flatten(), a.flatten()]) for v, a in zip(video, audio)]


def _engine(path: Path, root: Path, cache: Path, parallel: str | None = None) -> tuple[Engine, FinalLatents]:
    settings = Settings(cache_dir=str(cache), max_num_seqs=8, request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    capture = FinalLatents(_latents_of)
    host.pm.register(capture, name="final-latents")
    engine = Engine(str(path), host=host, settings=settings, parallel=parallel,
                    lora_registry=AdapterRegistry(lora_dirs=[root]))
    return engine, capture


def _mixed(engine: Engine, capture: FinalLatents) -> list[torch.Tensor]:
    requests = [make_request(f"rain {i}", seed=5, loras=[LoRA(n, 0.5 if len(names) > 1 else 1.0) for n in names],
                             **PARAMS) for i, names in enumerate(BATCH)]
    outputs = submit_together(engine, requests)
    assert all(o[0].metrics["batch_requests"] == len(BATCH) for o in outputs)  # one mixed batch
    return [capture.latents[r.request_id] for r in requests]


@pytest.mark.slow
def test_a_mixed_batch_over_tp_2_equals_the_single_process(tiny_dir: Path,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    root, cache = tmp_path_factory.mktemp("loras"), tmp_path_factory.mktemp("cache")
    engine, capture = _engine(tiny_dir, root, cache)
    with engine:
        dit = next(iter(engine.pipeline.transformers.values()))
        ours = [f"blocks.{i}.{m}" for i in range(len(dit.blocks)) for m in BLOCK]
        make_peft_adapter(dit, ours + REFINER, root / "a", rank=4, seed=1)
        make_peft_adapter(dit, [m for m in ours if ".attn." in m], root / "b", rank=8, seed=2)
        reference = _mixed(engine, capture)
        plain = make_request("rain 0", seed=5, **PARAMS)
        engine.submit(plain).result(300)
        assert (reference[0] - capture.latents[plain.request_id]).abs().max() > 1e-4  # the adapter changes it
    engine, capture = _engine(tiny_dir, root, cache, "tp=2")
    with engine:
        dit = next(iter(engine.pipeline.transformers.values()))
        assert engine.lora.target_map.shards["blocks.0.attn.out_proj"][0] == "row"
        got = _mixed(engine, capture)
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
        stats = engine.lora_registry.stats()
        assert stats["batch_bytes"] > 0 or stats["device_bytes"] > 0
    assert multiprocessing.active_children() == []
