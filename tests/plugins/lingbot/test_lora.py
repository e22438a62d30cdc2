"""Per-request LoRA on tiny:lingbot through the engine: a mixed batch (4 adapters and a row without) equals each
request alone and peft's merged model (fp32 latents); two adapters equal merging both; scale 0 is bit for bit no
adapter; refusals name the adapter and the key. Tiny models output noise: only equalities are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _lora_helpers import FinalLatents, make_peft_adapter, merged_weights, peft_to_kohya, submit_together
from omnicore.config import Settings
from omnicore.engine.api import Engine, make_request
from omnicore.hookspecs import hookimpl
from omnicore.lora import AdapterRegistry, LoRA, LoRAError
from omnicore.plugin_host.host import PluginHost

ATTN = [f"blocks.{i}.attn.to_{p}" for i in range(2) for p in ("q", "k", "v", "out")]
FFN = [f"blocks.{i}.ffn.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
HEADS = ["patch_embedder", "proj_out", "time_modulation.1", "norm_out_modulation.1"]
ARGS = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 2.0}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("loras")
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("cache")), max_num_seqs=8,
                        request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    capture = FinalLatents()
    host.pm.register(capture, name="final-latents")
    engine = Engine("tiny:lingbot", host=host, settings=settings, lora_registry=AdapterRegistry(lora_dirs=[root]))
    dit = engine.pipeline.transformer
    adapters = {
        "a": make_peft_adapter(dit, ATTN, root / "a", rank=4, seed=1),
        "b": make_peft_adapter(dit, FFN + HEADS[2:], root / "b", rank=8, seed=2),
        "c": make_peft_adapter(dit, ATTN[:4] + HEADS[:2], root / "c", rank=8, seed=3, alpha=4),
        "d": make_peft_adapter(dit, ATTN + FFN, root / "d", rank=4, seed=4),
    }
    adapters["k"] = peft_to_kohya(adapters["d"], root / "d_kohya.safetensors")
    yield engine, capture, adapters
    engine.close()


def _request(prompt: str, *loras: LoRA, **extra: Any) -> Any:
    return make_request(prompt, seed=11, loras=loras, extra=extra or None, **ARGS)


def _latents(engine: Engine, capture: FinalLatents, request: Any) -> torch.Tensor:
    engine.submit(request).result(300)
    return capture.latents[request.request_id]


@pytest.mark.slow
@pytest.mark.parametrize("batch_cfg", [False, True], ids=["two-passes", "packed-cfg"])
def test_mixed_batch_equals_each_alone_and_the_merged_model(setup: Any, batch_cfg: bool) -> None:
    engine, capture, adapters = setup
    names = ["a", "b", None, "c", "k"]
    loras = [(LoRA(n if n != "k" else adapters["k"].name),) if n else () for n in names]
    requests = [_request(f"prompt {i}", *lo, batch_cfg=batch_cfg) for i, lo in enumerate(loras)]
    outputs = submit_together(engine, requests)
    assert all(o[0].metrics["batch_requests"] == 5 for o in outputs)  # one mixed batch
    mixed = [capture.latents[r.request_id] for r in requests]
    for i, (name, lo) in enumerate(zip(names, loras)):
        alone = _latents(engine, capture, _request(f"prompt {i}", *lo, batch_cfg=batch_cfg))
        torch.testing.assert_close(mixed[i], alone, atol=1e-5, rtol=0)
        if name is None:  # (a batch and a lone request round differently: equal within fp32 noise, not bitwise)
            continue
        adapter = adapters["d" if name == "k" else name]
        with merged_weights(engine.pipeline.transformer, [(adapter, 1.0)]):
            merged = _latents(engine, capture, _request(f"prompt {i}", batch_cfg=batch_cfg))
        torch.testing.assert_close(mixed[i], merged, atol=1e-5, rtol=0)
        assert (merged - _latents(engine, capture, _request(f"prompt {i}", batch_cfg=batch_cfg))).abs().max() > 1e-4


@pytest.mark.slow
def test_two_adapters_equal_merging_both_and_scale_zero_is_bit_for_bit(setup: Any) -> None:
    engine, capture, adapters = setup
    both = _latents(engine, capture, _request("x", LoRA("a", 0.5), LoRA("b", 1.5)))
    with merged_weights(engine.pipeline.transformer, [(adapters["a"], 0.5), (adapters["b"], 1.5)]):
        merged = _latents(engine, capture, _request("x"))
    torch.testing.assert_close(both, merged, atol=1e-5, rtol=0)
    plain_req = _request("x")
    zero_req = _request("x", LoRA("a", 0.0), LoRA("c", 0.0))
    plain_out = engine.submit(plain_req).result(300)[0].frames
    zero_out = engine.submit(zero_req).result(300)[0].frames
    assert torch.equal(capture.latents[plain_req.request_id], capture.latents[zero_req.request_id])
    assert (plain_out == zero_out).all()


def test_refusals_name_the_adapter_and_the_key(setup: Any, tmp_path: Path) -> None:
    engine, _, adapters = setup
    with pytest.raises(LoRAError, match="no such adapter"):
        engine.submit(_request("x", LoRA("missing")))
    make_peft_adapter(engine.pipeline.transformer, ["text_embedder.linear_1"], adapters["a"].parent / "bad")
    with pytest.raises(LoRAError, match="not adaptable") as info:
        engine.submit(_request("x", LoRA("bad")))
    assert info.value.key == "base_model.model.text_embedder.linear_1.lora_A.weight"
    with pytest.raises(LoRAError, match="outside the allowed"):
        engine.submit(_request("x", LoRA(str(tmp_path))))
    assert engine.stats()["queued"] == 0  # nothing was queued


def test_generate_takes_loras_and_the_registry_counts(setup: Any) -> None:
    engine, _, _ = setup
    before = engine.lora_registry.stats()
    out = engine.generate("a fox", seed=3, loras=[LoRA("a"), "c"], **{**ARGS, "num_inference_steps": 1})
    assert out[0].frames.shape[0] == 5
    after = engine.lora_registry.stats()
    # each of the two adapters was either loaded now or found in the cache (which one depends on test order)
    used = (after["hits"] + after["loads"]) - (before["hits"] + before["loads"])
    assert used >= 2 and after["device_bytes"] > 0


class CancelAt:
    """Cancels ``job`` when a batch of several requests reaches denoise step ``step`` (the runner then drops its
    row: the survivors' adapters must follow their rows)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.job: Any = None

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline: Any, state: Any, step: int) -> Any:
        if step == self.step and self.job is not None and len(state.requests) > 1:
            self.job.cancel()
        return (yield)


@pytest.mark.slow
def test_cancelling_one_row_of_a_mixed_batch_leaves_the_others_exact(setup: Any) -> None:
    engine, capture, _ = setup
    gate = CancelAt(step=1)
    engine.host.pm.register(gate, name="cancel-at")
    try:
        args = {**ARGS, "num_inference_steps": 3}
        requests = [make_request(f"p{i}", seed=11, loras=lo, **args)
                    for i, lo in enumerate([(LoRA("a"),), (LoRA("b"),), (LoRA("c"),)])]
        jobs = [engine.submit(r) for r in requests]
        gate.job = jobs[1]
        jobs[0].result(300)
        jobs[2].result(300)
        assert jobs[1].status == "cancelled"
        gate.job = None
        for i in (0, 2):
            alone = make_request(f"p{i}", seed=11, loras=requests[i].loras, **args)
            torch.testing.assert_close(capture.latents[requests[i].request_id], _latents(engine, capture, alone),
                                       atol=1e-5, rtol=0)
    finally:
        engine.host.pm.unregister(gate, name="cancel-at")


@pytest.mark.slow
def test_moe_shared_experts_are_adapted_and_routed_experts_refused(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tiny:lingbot-moe (block 1 a top-2 MoE): an adapter on block 1's attention and shared experts equals peft's
    merged DiT; the router and the routed experts (stacked weights, chosen per token) are refused by name."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("moe-loras")
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("moe-cache")), max_num_seqs=4,
                        request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    capture = FinalLatents()
    host.pm.register(capture, name="final-latents")
    with Engine("tiny:lingbot-moe", host=host, settings=settings,
                lora_registry=AdapterRegistry(lora_dirs=[root])) as engine:
        dit = engine.pipeline.transformer
        shared = [f"blocks.1.ffn.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        adapter = make_peft_adapter(dit, ["blocks.1.attn.to_q", *shared], root / "moe", rank=4, seed=5)
        requests = [_request("p0", LoRA("moe")), _request("p1")]
        submit_together(engine, requests)
        with merged_weights(dit, [(adapter, 1.0)]):
            merged = _latents(engine, capture, _request("p0"))
        torch.testing.assert_close(capture.latents[requests[0].request_id], merged, atol=1e-5, rtol=0)
        assert (merged - capture.latents[requests[1].request_id]).abs().max() > 1e-4
        for module, what in (("blocks.1.ffn.router", "'blocks.1.ffn.router' .* is a MoERouter, not an nn.Linear"),
                             ("blocks.1.ffn.experts.0.gate_proj", "'blocks.1.ffn.experts' .* is a MoEExperts")):
            folder = root / module.replace(".", "_")
            folder.mkdir()
            save_file({f"base_model.model.{module}.lora_A.weight": torch.zeros(2, 64),
                       f"base_model.model.{module}.lora_B.weight": torch.zeros(4, 2)},
                      str(folder / "adapter_model.safetensors"))
            (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 2}')
            with pytest.raises(LoRAError, match=what) as info:
                engine.submit(_request("x", LoRA(folder.name)))
            assert info.value.key == f"base_model.model.{module}.lora_A.weight"
