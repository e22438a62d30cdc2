"""Per-request LoRA on tiny:lingbot over a worker group (gloo, 2 processes): a mixed batch (two adapters, a row
without, two adapters composed) under ``cfg=2`` and ``ulysses=2`` gives the single-process engine's final latents
(the adapters are replicated: every rank uploads the versions rank 0 announced with the batch; under Ulysses each
rank's linears see only its shard of the packed rows). Cancelling one request of a running mixed batch leaves the
others as they are alone (every rank drops that row and its adapters). A worker that cannot upload an adapter fails
that batch with its error, naming its rank, and the group keeps serving. Tiny models output noise: only equalities
are checked."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from _lora_helpers import FinalLatents, make_peft_adapter, submit_together
from omnicore.config import Settings
from omnicore.engine.api import Engine, make_request
from omnicore.lora import AdapterRegistry, LoRA, LoRAError
from omnicore.plugin_host.host import PluginHost

ATTN = [f"blocks.{i}.attn.to_{p}" for i in range(2) for p in ("q", "k", "v", "out")]
FFN = [f"blocks.{i}.ffn.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
ARGS = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 2.0}
BATCH = [("a",), (), ("b",), ("a", "b")]


def _engine(path: Path, root: Path, cache: Path, parallel: str | None = None) -> tuple[Engine, FinalLatents]:
    settings = Settings(cache_dir=str(cache), max_num_seqs=8, request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    capture = FinalLatents()
    host.pm.register(capture, name="final-latents")
    engine = Engine(str(path), host=host, settings=settings, parallel=parallel,
                    lora_registry=AdapterRegistry(lora_dirs=[root]))
    return engine, capture


def _mixed(engine: Engine, capture: FinalLatents) -> list[torch.Tensor]:
    requests = [make_request(f"prompt {i}", seed=11, loras=[LoRA(n, 0.5 if len(names) > 1 else 1.0)
                                                             for n in names], **ARGS)
                for i, names in enumerate(BATCH)]
    outputs = submit_together(engine, requests)
    assert all(o[0].metrics["batch_requests"] == len(BATCH) for o in outputs)  # one mixed batch
    return [capture.latents[r.request_id] for r in requests]


@pytest.fixture(scope="module")
def setup(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("loras")
    cache = tmp_path_factory.mktemp("cache")
    engine, capture = _engine(tiny_dir, root, cache)
    with engine:
        dit = engine.pipeline.transformer
        make_peft_adapter(dit, ATTN, root / "a", rank=4, seed=1)
        make_peft_adapter(dit, FFN + ["time_modulation.1", "proj_out"], root / "b", rank=8, seed=2)
        reference = _mixed(engine, capture)
        plain = make_request("prompt 0", seed=11, **ARGS)
        engine.submit(plain).result(300)
        assert (reference[0] - capture.latents[plain.request_id]).abs().max() > 1e-4  # the adapter changes it
    return root, cache, reference


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["cfg=2", "ulysses=2"])
def test_a_mixed_batch_over_the_group_equals_the_single_process(tiny_dir: Path, setup: Any, parallel: str) -> None:
    root, cache, reference = setup
    engine, capture = _engine(tiny_dir, root, cache, parallel)
    with engine:
        got = _mixed(engine, capture)
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
        if parallel == "cfg=2":
            # cancel the middle request of a running mixed batch after its first step: every rank drops its row
            # and its adapters (the worker's select), the other rows end as each does alone
            four = {**ARGS, "num_inference_steps": 4}
            sets = [[LoRA("a")], [LoRA("b")], [LoRA("a", 0.5), LoRA("b", 0.5)]]
            requests = [make_request(f"cancel {i}", seed=3 + i, loras=loras, **four) for i, loras in enumerate(sets)]
            jobs = [engine.submit(r) for r in requests]
            jobs[1].add_listener(lambda e: jobs[1].cancel() if e.phase == "denoise" and e.step == 1 else None)
            for i in (0, 2):
                assert jobs[i].result(300)[0].metrics["batch_requests"] == 2  # what was left of the batch
            assert jobs[1].wait(300) and jobs[1].status == "cancelled"
            assert engine.stats()["last_batch_size"] == 3  # it started as one batch of three
            for i in (0, 2):
                alone = make_request(f"cancel {i}", seed=3 + i, loras=sets[i], **four)
                engine.submit(alone).result(300)
                torch.testing.assert_close(capture.latents[requests[i].request_id],
                                           capture.latents[alone.request_id], atol=1e-5, rtol=1e-5)
        if parallel == "ulysses=2":
            assert engine.group.ctx.stats.snapshot()["calls"]["all_to_all"] > 0
            # a worker that cannot upload the version rank 0 named (a file rewritten in between): the batch fails
            # with that worker's error, naming its rank, and the group keeps serving
            registry = engine.lora_registry
            registry.ref = lambda lora, tmap: attrs.evolve(AdapterRegistry.ref(registry, lora, tmap), ident=(0, 0))
            try:
                job = engine.submit(make_request("x", seed=1, loras=[LoRA("a")], **ARGS))
                with pytest.raises(LoRAError, match="changed on disk while the batch started") as info:
                    job.result(300)
                assert any("rank 1 of 2" in note for note in getattr(info.value, "__notes__", []))
            finally:
                del registry.ref
            assert engine.worker_alive and engine.worker_failure is None
            again = _mixed(engine, capture)
            torch.testing.assert_close(again[1], reference[1], atol=1e-5, rtol=1e-5)
    assert multiprocessing.active_children() == []

