"""Per-request LoRA with LingBot's first-block cache: the cache decides per batch (the relative L1 change of the
first block's residual, summed over the batch's rows, with each row's adapters applied), and a reused step adds
each row's own residual of the remaining blocks, computed with that row's adapters. So under the same decisions
(here a threshold that reuses every step it may) each request of a mixed batch (two adapters and a row without)
ends with the latents it has alone with the cache, and the adapters still change them. A batch whose rows differ
can decide otherwise than each request alone would (as without adapters): equal decisions, equal latents.
Tiny models output noise: only equalities are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _lora_helpers import FinalLatents, make_peft_adapter, submit_together
from omnicore.config import Settings
from omnicore.engine.api import Engine, make_request
from omnicore.lora import AdapterRegistry, LoRA
from omnicore.plugin_host.host import PluginHost

ARGS = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4, "guidance_scale": 2.0}
BATCH = [("a",), (), ("b",)]


@pytest.mark.slow
def test_a_mixed_batch_under_first_block_cache_equals_each_alone_under_the_same_decisions(
        tiny_dir: Path, pipe: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("loras")
    dit = pipe.transformer  # (a network without the cache's hooks: peft copies it)
    attn = [f"blocks.{i}.attn.to_{p}" for i in range(len(dit.blocks)) for p in ("q", "out")]
    make_peft_adapter(dit, attn, root / "a", rank=4, seed=1)
    make_peft_adapter(dit, [f"blocks.{i}.ffn.down_proj" for i in range(len(dit.blocks))], root / "b", rank=8, seed=2)
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("cache")), max_num_seqs=8,
                        request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    capture = FinalLatents()
    host.pm.register(capture, name="final-latents")
    with Engine(str(tiny_dir), host=host, settings=settings, lora_registry=AdapterRegistry(lora_dirs=[root]),
                cache_methods=[("first_block_cache", {"threshold": 1e9})]) as engine:
        requests = [make_request(f"prompt {i}", seed=11 + i, loras=[LoRA(n) for n in names], **ARGS)
                    for i, names in enumerate(BATCH)]
        outputs = submit_together(engine, requests)
        reused: Any = {o[0].metrics["cache_reused_steps"] for o in outputs}
        assert {o[0].metrics["batch_requests"] for o in outputs} == {3} and len(reused) == 1
        assert next(iter(reused)) > 0  # the cache did reuse steps
        for i, names in enumerate(BATCH):
            alone = make_request(f"prompt {i}", seed=11 + i, loras=[LoRA(n) for n in names], **ARGS)
            [out] = engine.submit(alone).result(300)
            assert {out.metrics["cache_reused_steps"]} == reused  # the same decisions
            torch.testing.assert_close(capture.latents[requests[i].request_id], capture.latents[alone.request_id],
                                       atol=1e-5, rtol=0)
        plain = make_request("prompt 0", seed=11, **ARGS)
        engine.submit(plain).result(300)
        assert (capture.latents[requests[0].request_id] - capture.latents[plain.request_id]).abs().max() > 1e-4
