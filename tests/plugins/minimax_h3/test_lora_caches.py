"""Per-request LoRA with MiniMax-H3's TeaCache: the cache decides per batch (its relative-L1 criterion sums over
the batch's rows, on the modulated input, which no adapter touches here: the patch projections and AdaLN are not
adaptable), and a reused step adds each row's own block residual, computed with that row's adapters. So under the
same decisions (a threshold that reuses every step it may) each request of a mixed batch (two adapters and a row
without) ends with the latents it has alone with the cache, and the adapters still change them. A batch whose rows
differ can decide otherwise than each request alone would (as without adapters): equal decisions, equal latents.
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

PARAMS = {"num_inference_steps": 4, "height": 64, "width": 64, "duration": 4.0, "extra": {"aspect_ratio": "1:1"}}
BATCH = [("a",), (), ("b",)]


def _latents_of(state: Any) -> list[torch.Tensor]:
    items = state.extras["items"]
    video = state.latents[0].split([it.video_rows for it in items])
    audio = state.latents[1].split([it.audio_rows for it in items])
    return [torch.cat([v.flatten(), a.flatten()]) for v, a in zip(video, audio)]


@pytest.mark.slow
def test_a_mixed_batch_under_teacache_equals_each_alone_under_the_same_decisions(
        tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("loras")
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("cache")), max_num_seqs=8,
                        request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    capture = FinalLatents(_latents_of)
    host.pm.register(capture, name="final-latents")
    with Engine(str(tiny_dir), host=host, settings=settings, lora_registry=AdapterRegistry(lora_dirs=[root]),
                cache_methods=[("teacache", {"rel_l1_thresh": 1e9})]) as engine:
        dit = next(iter(engine.pipeline.transformers.values()))
        blocks = [f"blocks.{i}.{m}" for i in range(len(dit.blocks)) for m in ("attn.qkv_proj", "mlp.fc2")]
        make_peft_adapter(dit, blocks, root / "a", rank=4, seed=1)
        make_peft_adapter(dit, blocks[:1], root / "b", rank=8, seed=2)
        requests = [make_request(f"rain {i}", seed=5 + i, loras=[LoRA(n) for n in names], **PARAMS)
                    for i, names in enumerate(BATCH)]
        outputs = submit_together(engine, requests)
        reused = {o[0].metrics["cache_reused_steps"] for o in outputs}
        assert {o[0].metrics["batch_requests"] for o in outputs} == {3} and reused == {2}  # steps 2, 3 reused
        for i, names in enumerate(BATCH):
            alone = make_request(f"rain {i}", seed=5 + i, loras=[LoRA(n) for n in names], **PARAMS)
            [out] = engine.submit(alone).result(300)
            assert out.metrics["cache_reused_steps"] == 2
            torch.testing.assert_close(capture.latents[requests[i].request_id], capture.latents[alone.request_id],
                                       atol=1e-5, rtol=0)
        plain = make_request("rain 0", seed=5, **PARAMS)
        engine.submit(plain).result(300)
        assert (capture.latents[requests[0].request_id] - capture.latents[plain.request_id]).abs().max() > 1e-4
