"""Per-request LoRA on the HunyuanImage-3 micro checkpoint over a tensor-parallel group (``tp=2``, gloo, 2
processes): a mixed batch (an adapter on every layer's attention, a row without, an adapter on the shared MLPs and
one attention) gives the single-process engine's final latents. Each rank holds its share of every adapter like its
base linears: the grouped-query ``qkv_proj``'s ``B`` rows per unequal part (``[Q_r; K_r; V_r]``), ``gate_proj`` /
``up_proj`` rows, the columns of ``A`` of ``o_proj`` / ``down_proj``. Tiny models output noise: only equalities."""

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

ARGS = {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 4.0}
BATCH = [("a",), (), ("b",)]


def _engine(path: Path, root: Path, cache: Path, parallel: str | None = None) -> tuple[Engine, FinalLatents]:
    settings = Settings(cache_dir=str(cache), max_num_seqs=8, request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    capture = FinalLatents()
    host.pm.register(capture, name="final-latents")
    engine = Engine(str(path), host=host, settings=settings, parallel=parallel,
                    model_options={"kv_mode": "dense_legacy"}, lora_registry=AdapterRegistry(lora_dirs=[root]))
    return engine, capture


def _mixed(engine: Engine, capture: FinalLatents) -> list[torch.Tensor]:
    requests = [make_request(f"a lighthouse {i}", seed=7, loras=[LoRA(n) for n in names], **ARGS)
                for i, names in enumerate(BATCH)]
    outputs = submit_together(engine, requests)
    assert all(o[0].metrics["batch_requests"] == len(BATCH) for o in outputs)  # one mixed batch
    return [capture.latents[r.request_id] for r in requests]


@pytest.mark.slow
def test_a_mixed_batch_over_tp_2_equals_the_single_process(micro_dir: Path, pipe: Any,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    root, cache = tmp_path_factory.mktemp("loras"), tmp_path_factory.mktemp("cache")
    model = pipe.model
    layers = len(model.model.layers)
    attn = [f"model.layers.{i}.self_attn.{p}" for i in range(layers) for p in ("qkv_proj", "o_proj")]
    mlp = [f"model.layers.{i}.mlp.shared_mlp.{p}" for i in range(layers) for p in ("gate_proj", "up_proj",
                                                                                    "down_proj")]
    make_peft_adapter(model, attn, root / "a", rank=4, seed=1)
    make_peft_adapter(model, attn[:1] + mlp, root / "b", rank=8, seed=2)
    engine, capture = _engine(micro_dir, root, cache)
    with engine:
        reference = _mixed(engine, capture)
        plain = make_request("a lighthouse 0", seed=7, **ARGS)
        engine.submit(plain).result(300)
        assert (reference[0] - capture.latents[plain.request_id]).abs().max() > 1e-4  # the adapter changes it
    engine, capture = _engine(micro_dir, root, cache, "tp=2")
    with engine:
        shards = engine.lora.target_map.shards
        assert shards["model.layers.0.self_attn.qkv_proj"][0] == "column"
        assert len(shards["model.layers.0.self_attn.qkv_proj"][1]) == 3  # Q, K, V each split on its own
        got = _mixed(engine, capture)
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert multiprocessing.active_children() == []
