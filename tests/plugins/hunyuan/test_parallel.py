"""HunyuanImage-3 over a worker group (``--parallel tp=2`` / ``cfg=2``, gloo, 2 processes; ``cfg=2,tp=2``, 4): the
image of a single guided request and of a batch equals the single-process engine's (same seeds), with the prompt
K/V reused per rank; the routed experts, the shared and dense MLPs and the grouped K/V heads are split; rank 0
holds the analytic share of the parameters and read only its rows of the checkpoint; a head count the degree does
not divide is refused at load, naming the numbers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _worker_group_helpers import planned_file_bytes
from omnicore.engine.api import Engine, make_request
from omnicore.errors import ConfigError

PARAMS = {"height": 64, "width": 64, "num_inference_steps": 3, "guidance_scale": 4.0}
PROMPTS = ("a lighthouse at dusk", "a red fox in the snow")


def _engine(path: Path, parallel: str | None = None, **options: Any) -> Engine:
    from omnicore.plugin_host.host import default_host

    settings = default_host().settings.evolve(request_batch_max_wait_ms=400.0)  # lets two submits form a batch
    return Engine(str(path), settings=settings, parallel=parallel, model_options=options or None)


def _images(engine: Engine, *prompts: str, seed: int = 7) -> list[np.ndarray]:
    jobs = [engine.submit(make_request(p, seed=seed + i, **PARAMS)) for i, p in enumerate(prompts)]
    outputs = [job.result(600)[0] for job in jobs]
    assert {o.metrics["batch_requests"] for o in outputs} == {len(prompts)}
    return [o.frames for o in outputs]


def _assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        assert np.abs(g.astype(int) - e.astype(int)).max() <= 1  # fp32 reassociation: one uint8 level at most


@pytest.fixture(scope="module")
def reference(micro_dir: Path) -> dict[str, list[np.ndarray]]:
    with _engine(micro_dir) as engine:
        return {"single": _images(engine, PROMPTS[0]), "batch": _images(engine, *PROMPTS)}


def test_a_degree_that_does_not_divide_the_heads_is_refused_at_load(pipe: Any) -> None:
    heads = pipe.model.config.num_attention_heads  # 4 in the tiny preset
    with pytest.raises(ConfigError, match=rf"tp=3 must divide the model's attention heads \({heads}\)"):
        pipe.model.enable_tensor_parallel(SimpleNamespace(tp=3, tp_rank=0))
    assert pipe.model.tensor_parallel is None


@pytest.mark.slow
def test_tp_image_matches_single_process_and_each_rank_holds_its_share(micro_dir: Path, reference: Any) -> None:
    import torch
    from omni_hunyuan.transformer.config import HunyuanConfig
    from omni_hunyuan.transformer.model import HunyuanImage3
    from omni_hunyuan.transformer.tensor_parallel import checkpoint_plan, module_plan
    from omnicore.plugin import local_parameter_bytes, sharded_parameter_bytes

    config = HunyuanConfig.from_file(micro_dir / "config.json")
    with _engine(micro_dir, "tp=2") as engine:
        model = engine.pipeline.model
        attn = model.model.layers[0].self_attn
        assert (attn.heads, attn.kv_heads) == (config.num_attention_heads // 2, config.num_key_value_heads // 2)
        _assert_same(_images(engine, PROMPTS[0]), reference["single"])
        calls = engine.group.ctx.stats.snapshot()["calls"]["all_reduce"]
        # per layer and step: attention, and (MoE layers) the shared MLP and the experts, or the dense MLP
        moe = sum(config.layer_is_moe(i) for i in range(config.num_hidden_layers))
        per_step = 2 * config.num_hidden_layers + moe
        assert calls == per_step * PARAMS["num_inference_steps"], calls
        _assert_same(_images(engine, *PROMPTS), reference["batch"])
        with torch.device("meta"):
            meta = HunyuanImage3(config)
        analytic = sharded_parameter_bytes(meta, module_plan(config), 2)
        assert local_parameter_bytes(model) == analytic < local_parameter_bytes(meta)
        # the checkpoint reads covered this rank's rows only: the files less half of every split tensor
        total, split = planned_file_bytes(micro_dir, checkpoint_plan())
        assert split > 0 and model.tp_bytes_read == total - split // 2


@pytest.mark.slow
def test_cfg_parallel_image_matches_single_process(micro_dir: Path, reference: Any) -> None:
    """cfg=2: each rank runs one of the guided rows (keeping that row's prompt K/V), the predictions are
    exchanged once per step."""
    with _engine(micro_dir, "cfg=2") as engine:
        _assert_same(_images(engine, PROMPTS[0]), reference["single"])
        calls = engine.group.ctx.stats.snapshot()["calls"]
        assert calls == {"all_gather": PARAMS["num_inference_steps"]}, calls
        _assert_same(_images(engine, *PROMPTS), reference["batch"])


@pytest.mark.slow
def test_cfg_times_tp_on_four_processes(micro_dir: Path, reference: Any) -> None:
    with _engine(micro_dir, "cfg=2,tp=2") as engine:
        assert len(engine.group.processes) == 3
        _assert_same(_images(engine, *PROMPTS), reference["batch"])
        calls = engine.group.ctx.stats.snapshot()["calls"]
        assert calls["all_gather"] > 0 and calls["all_reduce"] > 0


def test_an_expert_count_the_ep_degree_does_not_divide_is_refused(pipe: Any) -> None:
    experts = pipe.model.config.num_experts  # 4 in the tiny preset
    with pytest.raises(ConfigError, match=rf"ep=3 must divide the model's routed experts \({experts}\)"):
        pipe.model.enable_expert_parallel(SimpleNamespace(ep=3, ep_rank=0))
    assert pipe.model.expert_parallel is None


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_reduce"])
def test_expert_parallel_image_matches_single_process(micro_dir: Path, reference: Any, dispatch: str) -> None:
    """ep=2: each rank keeps half the routed experts of every MoE layer (same top-k routing); per MoE layer and
    step either token copies go to their experts' rank and back by all-to-all (rows, ids, outputs) and the token
    slices are all-gathered, or one all-reduce adds the shares."""
    from omni_hunyuan.transformer.config import HunyuanConfig

    config = HunyuanConfig.from_file(micro_dir / "config.json")
    with _engine(micro_dir, "ep=2", ep_dispatch=dispatch) as engine:
        experts = engine.pipeline.model.model.layers[0].mlp.experts
        assert experts.w_gate.shape[0] == config.num_experts // 2 and experts.first == 0
        _assert_same(_images(engine, PROMPTS[0]), reference["single"])
        moe = sum(config.layer_is_moe(i) for i in range(config.num_hidden_layers))
        calls = engine.group.ctx.stats.snapshot()["calls"]
        per_step = moe * PARAMS["num_inference_steps"]
        if dispatch == "all_to_all":
            assert calls == {"all_to_all": 3 * per_step, "all_gather": per_step}, calls
        else:
            assert calls == {"all_reduce": per_step}, calls
        _assert_same(_images(engine, *PROMPTS), reference["batch"])
        # rank 0 never read the other rank's experts: the files less half of the routed experts' bytes
        from omni_hunyuan.loader import _EXPERT
        from safetensors import safe_open

        total = routed = 0
        for file in sorted(micro_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    t = f.get_tensor(name)
                    total += t.numel() * t.element_size()
                    routed += t.numel() * t.element_size() if _EXPERT.match(name) else 0
        assert routed > 0 and engine.pipeline.model.tp_bytes_read == total - routed // 2
