"""``omnicore plan``: weight bytes of a plan equal what a real load holds (tiny presets, float32 on CPU); plans
read headers and configs only; real-size presets give the released parameter counts; the JSON is stable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from omnicore.cli.plan_cmd import build_plan, format_table  # noqa: E402
from omnicore.config import resolve_settings  # noqa: E402
from omnicore.engine.protocol import LoadOptions  # noqa: E402
from omnicore.planning import SCHEMA_VERSION  # noqa: E402
from omnicore.planning.source import read_safetensors_header  # noqa: E402
from omnicore.platforms.cpu import CpuPlatform  # noqa: E402
from omnicore.plugin_host.host import PluginHost  # noqa: E402

H3_REQUEST = {"duration": 5, "extra": {"aspect_ratio": "16:9"}}


def _bytes(module: Any) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _settings(tmp: Path) -> Any:
    return resolve_settings({"cache_dir": str(tmp)})


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plan-cache")


def _loaded_components(model: str, root: Path) -> dict[str, Any]:
    """The modules a real CPU load of ``root`` holds, named as the plan names them."""
    opts = LoadOptions(platform=CpuPlatform())
    if model.startswith("tiny:minimax-h3"):
        from omni_minimax_h3.pipeline import MiniMaxH3Pipeline

        p = MiniMaxH3Pipeline.from_pretrained(root, opts)
        return {"transformer": p.transformers["fl2va"], "text_encoder": p.text_encoder.model,
                "vae": p.video_vae.vae, "audio_vae": p.audio_vae.vae}
    if model.startswith("tiny:lingbot"):
        from omni_lingbot.pipeline import LingBotPipeline

        lp = LingBotPipeline.from_pretrained(root, opts)
        out = {"transformer": lp.transformer, "text_encoder": lp.text_encoder.model, "vae": lp.vae.vae}
        if lp.refiner is not None:
            out["refiner"] = lp.refiner
        return out
    from omni_hunyuan.pipeline import HunyuanImage3Pipeline
    from omni_hunyuan.presets import HEADS

    m = HunyuanImage3Pipeline.from_pretrained(root, opts).model
    out = {"language_model": m.model, "vae": m.vae,
           "heads": torch.nn.ModuleList([getattr(m, n) for n in HEADS if hasattr(m, n)])}
    if hasattr(m, "vision_model"):
        out["vision"] = torch.nn.ModuleList([m.vision_model, m.vision_aligner])
    assert _bytes(m) == sum(_bytes(v) for v in out.values())  # the four groups cover the whole model
    return out


TINY = ["tiny:minimax-h3", "tiny:lingbot", "tiny:lingbot-moe", "tiny:hunyuan-image3"]


@pytest.mark.slow
@pytest.mark.parametrize("model", TINY)
def test_plan_weight_bytes_equal_a_real_load(model: str, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per component, the plan's bytes (meta build, float32) == the bytes of the modules a CPU load holds; and
    the plan read nothing of the weight files but their headers."""
    import builtins

    settings = _settings(cache)
    host = PluginHost(settings)
    request = H3_REQUEST if "minimax" in model else {}
    build_plan(model, request=request, dtype="float32", host=host, settings=settings)  # builds the preset
    opened: dict[str, int] = {}
    real_open = builtins.open

    def counting_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        f = real_open(file, mode, *a, **k)
        if str(file).endswith(".safetensors"):
            opened[str(file)] = opened.get(str(file), 0) + 1
        return f

    monkeypatch.setattr(builtins, "open", counting_open)
    plan = build_plan(model, request=request, dtype="float32", host=host, settings=settings)
    monkeypatch.setattr(builtins, "open", real_open)
    root = next(p for p in (cache / "presets").iterdir() if p.name == model.split(":", 1)[1])
    files = sorted(root.rglob("*.safetensors"))
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    assert files and set(opened) == {str(f) for f in files}
    assert plan.header_bytes_read == headers  # exactly the headers ...
    assert headers < sum(f.stat().st_size for f in files) / 2  # ... which are far from the whole files
    loaded = _loaded_components(model, root)
    planned = {k: v["bytes"] for k, v in plan.components.items()}
    assert planned == {k: _bytes(m) for k, m in loaded.items()}
    for name, comp in plan.components.items():  # declared shapes in the checkpoint = the built modules
        if comp.get("checkpoint_params") is not None and name != "text_encoder":
            assert comp["checkpoint_params"] >= comp["params"] * 0.5


def _real_counts(name: str, cache: Path) -> dict[str, int]:
    settings = _settings(cache)
    plan = build_plan(name, devices=4, device_memory_gib=141, request=H3_REQUEST if "minimax" in name else {},
                      host=PluginHost(settings), settings=settings)
    return {k: v["params"] for k, v in plan.components.items()}


@pytest.mark.slow
def test_real_presets_give_the_released_parameter_counts(cache: Path) -> None:
    h3 = _real_counts("real:minimax-h3", cache)
    assert h3["transformer"] == 33_122_992_896
    hy = _real_counts("real:hunyuan-image3", cache)
    assert hy["language_model"] == 80_413_470_720
    dense = _real_counts("real:lingbot", cache)
    assert 1.2e9 < dense["transformer"] < 1.6e9  # "1.3B": the class defaults are the dense release


ACCEPTANCE = {  # the three acceptance commands: model, devices, GiB each, request, rows that must be listed
    "real:minimax-h3": (4, 141, H3_REQUEST, {"tp=2", "tp=4", "ulysses=4", "tp=2,ulysses=2"}),
    "real:hunyuan-image3": (4, 80, {}, {"tp=4", "tp=4+fp8", "tp=2,ep=2"}),
    "real:lingbot-moe": (2, 80, {}, {"ep=2", "cfg=2"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(ACCEPTANCE))
def test_acceptance_table_and_json_are_deterministic(model: str, cache: Path) -> None:
    """Each acceptance command prints a table with a pick, and its JSON is stable (same keys, same values twice).
    The wall time is printed, not asserted (this host is shared)."""
    devices, memory, request, names = ACCEPTANCE[model]
    env = {**os.environ, "OMNICORE_CACHE": str(cache)}
    argv = [str(Path(sys.executable).parent / "omnicore"), "plan", model, "--devices", str(devices),
            "--device-memory", str(memory), "--request", json.dumps(request)]
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=300)  # first run writes the configs
    start = time.perf_counter()
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    assert "<- auto" in out.stdout and "fits" in out.stdout
    print(f"omnicore plan {model}: {elapsed:.1f} s wall on this host")
    one = json.loads(subprocess.run(argv + ["--json"], env=env, check=True, capture_output=True, text=True).stdout)
    two = json.loads(subprocess.run(argv + ["--json"], env=env, check=True, capture_output=True, text=True).stdout)
    assert one == two
    assert one["schema_version"] == SCHEMA_VERSION
    assert set(one) == {"schema_version", "model", "spec", "source", "dtype", "devices", "device_memory_bytes",
                        "request", "components", "placements", "auto", "cost_model", "notes", "header_bytes_read",
                        "model_options"}
    row = one["placements"][0]
    assert set(row) == {"name", "devices", "ulysses", "tp", "cfg", "ep", "offload", "quantization", "weights_bytes",
                        "cache_bytes", "activation_bytes", "reserve_bytes", "per_rank_bytes", "per_rank_gib",
                        "host_bytes", "host_weights_bytes", "load_peak_bytes", "step_seconds_estimate", "fits",
                        "runnable", "auto"}
    assert sum(p["auto"] for p in one["placements"]) == 1
    auto = next(p for p in one["placements"] if p["auto"])
    assert auto["runnable"] and auto["fits"] and auto["name"] == one["auto"]
    assert {p["name"] for p in one["placements"]} >= names
    if model == "real:minimax-h3":
        assert one["request"]["num_frames"] == 124 and one["request"]["height"] == 768


def test_header_reader_reads_the_header_only(tmp_path: Path) -> None:
    from omnicore.planning.source import ByteCounter
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(256, 256), "b": torch.zeros(3, dtype=torch.bfloat16)}, str(path))
    counter = ByteCounter()
    header = read_safetensors_header(path, counter)
    assert header["a"]["shape"] == [256, 256] and header["b"]["dtype"] == "BF16"
    assert counter.read == 8 + int.from_bytes(path.read_bytes()[:8], "little") < 1000 < path.stat().st_size


def test_quantized_rows_and_placements_follow_the_rules(cache: Path) -> None:
    """On the tiny H3: int8/fp8 rows hold less than bf16 (quantizable linears at 1 byte + scales), ulysses keeps
    the weights and divides the activations, an impossible memory budget fits nothing and picks no auto row."""
    settings = _settings(cache)
    host = PluginHost(settings)
    plan = build_plan("tiny:minimax-h3", devices=2, device_memory_gib=1e-4, request=H3_REQUEST, host=host,
                      settings=settings)
    rows = {p.name: p for p in plan.placements}
    assert not any(p.fits for p in plan.placements) and plan.auto is None
    assert sum(rows["single+int8"].weights.values()) < sum(rows["single"].weights.values())
    int8, fp8 = sum(rows["single+int8"].weights.values()), sum(rows["single+fp8"].weights.values())
    assert fp8 <= int8  # the same bytes, less torchao's int8 zero point (one byte per row) when it is installed
    assert rows["ulysses=2"].weights == rows["single"].weights
    assert rows["ulysses=2"].activations * 2 == pytest.approx(rows["single"].activations, rel=0.01)
    text = format_table(plan, show_all=True)
    assert "single+int8" in text and "no placement fits" in text


@pytest.mark.slow
def test_plan_tp_bytes_equal_a_two_rank_tp_load(cache: Path) -> None:
    """tiny:minimax-h3 with --parallel tp=2 (gloo, 2 ranks): rank 0's DiT holds exactly the plan's tp=2 bytes
    (the plan shards with the plan the loader uses)."""
    import omnicore
    from omnicore.parallel.tensor_parallel import local_parameter_bytes

    settings = _settings(cache)
    host = PluginHost(settings)
    plan = build_plan("tiny:minimax-h3", devices=2, request=H3_REQUEST, dtype="float32", host=host, settings=settings)
    row = next(p for p in plan.placements if p.name == "tp=2")
    assert row.runnable and row.weights["transformer"] < plan.components["transformer"]["bytes"]
    with omnicore.Engine("tiny:minimax-h3", parallel="tp=2", host=host, settings=settings) as engine:
        dit = engine.pipeline.transformers["fl2va"]
        held = local_parameter_bytes(dit) + sum(b.numel() * b.element_size() for b in dit.buffers())
    assert held == row.weights["transformer"]


def test_parallel_auto_refuses_what_cannot_fit(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--parallel auto`` with too little device memory: an error naming ``parallel``, the estimate and the limit,
    raised before any model loads; with enough, the cheapest runnable placement's keywords."""
    import argparse

    from omnicore.cli import plan_cmd
    from omnicore.errors import InvalidRequest

    monkeypatch.setenv("OMNICORE_CACHE", str(cache))
    args = argparse.Namespace(model="tiny:lingbot", prompt="a fox", height=48, width=48, num_frames=None,
                              duration=None, num_inference_steps=1, guidance_scale=None, fps=None, offload="none",
                              quantization="none")
    monkeypatch.setattr(plan_cmd, "visible_devices", lambda: (1, 1e-3, "float32", "cpu"))
    with pytest.raises(InvalidRequest, match=r"parallel.*no placement.*GiB per rank"):
        plan_cmd.resolve_auto(args, {})
    monkeypatch.setattr(plan_cmd, "visible_devices", lambda: (1, 64.0, "float32", "cpu"))
    picked = plan_cmd.resolve_auto(args, {})
    assert picked["_auto_placement"] == "single" and not picked["parallel"].enabled
    assert picked["device_memory"] == 64.0  # the engine refuses later requests over the limit auto planned with
    args.device_memory = 1e-3  # an explicit limit is what auto plans with (and the engine keeps it itself)
    with pytest.raises(InvalidRequest, match=r"parallel.*no placement"):
        plan_cmd.resolve_auto(args, {})


def test_parallel_auto_keeps_every_degree_of_the_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Engine keywords of an auto pick carry all four degrees: a ``cfg=2,ep=2`` pick loads 4 ranks with the
    experts split (before the fix, ep was dropped and every rank held every expert on a 2-rank group)."""
    import argparse

    import attrs
    from omnicore.cli import plan_cmd
    from omnicore.errors import InvalidRequest
    from omnicore.planning.estimate import CostModel, Placement, Plan

    row = Placement(name="cfg=2,ep=2", devices=4, cfg=2, ep=2, fits=True, auto=True)
    others = [Placement(name="cfg=2,tp=2,ulysses=2", devices=8, cfg=2, tp=2, ulysses=2, fits=True)]
    seen: dict[str, Any] = {}

    def fake_plan(model: str, **kwargs: Any) -> Plan:
        seen.update(kwargs, model=model)
        return Plan(model=model, spec="x", source="real", dtype="bfloat16", devices=4, device_memory_bytes=1,
                    request={}, components={}, placements=(row, *others), cost_model=kwargs["cost"])

    monkeypatch.setattr(plan_cmd, "build_plan", fake_plan)
    monkeypatch.setattr(plan_cmd, "visible_devices", lambda: (4, 80.0, "bfloat16", "cuda"))
    args = argparse.Namespace(model=["tiny:lingbot-moe"], prompt=None)
    picked = plan_cmd.resolve_auto(args, None)
    par = picked["parallel"]
    assert (par.cfg, par.ulysses, par.tp, par.ep, par.world_size) == (2, 1, 1, 2, 4)
    assert seen["model"] == "tiny:lingbot-moe" and seen["cost"] == CostModel.for_platform("cuda")
    for p in others:  # every dimension reaches the ParallelConfig
        cfg = plan_cmd.placement_parallel(p)
        assert (cfg.cfg, cfg.ulysses, cfg.tp, cfg.ep) == (p.cfg, p.ulysses, p.tp, p.ep)
    assert plan_cmd.placement_parallel(attrs.evolve(row, cfg=1, ep=1)).enabled is False
    args.model = ["tiny:lingbot", "tiny:minimax-h3"]  # several models: one plan each (serve_pool), never a list
    with pytest.raises(InvalidRequest, match=r"parallel.*one model at a time"):
        plan_cmd.resolve_auto(args, None)


def test_cpu_reserve_is_the_same_in_auto_and_admission(cache: Path) -> None:
    """``--parallel auto`` and the engine's admission price a CPU rank with the same (zero) reserve and an
    accelerator rank with the same 1.5 GiB, so a placement auto picks is not refused by the engine for it."""
    from omnicore.planning.admission import build_guard
    from omnicore.planning.estimate import GIB, CostModel
    from omnicore.platforms.cpu import CpuPlatform

    assert CostModel.for_platform("cpu").runtime_reserve_gib == 0.0
    assert CostModel.for_platform("cuda").runtime_reserve_gib == CostModel().runtime_reserve_gib == 1.5
    settings = _settings(cache)
    host = PluginHost(settings)
    plan = build_plan("tiny:lingbot", request={"height": 48, "width": 48}, dtype="float32", host=host,
                      settings=settings, cost=CostModel.for_platform("cpu"))
    from omnicore.engine.loading import resolve_model

    resolved = resolve_model("tiny:lingbot", host, settings)
    guard = build_guard(resolved.spec, resolved.path, platform=CpuPlatform(), dtype=torch.float32,
                        device_memory_gib=1.0)
    single = next(p for p in plan.placements if p.name == "single")
    assert guard is not None and guard.row.reserve == 0 == single.reserve
    assert guard.limit == GIB


@pytest.mark.slow
def test_cli_generate_parallel_auto(tmp_path: Path) -> None:
    env = {**os.environ, "OMNICORE_CACHE": str(tmp_path)}
    out = tmp_path / "a.png"
    done = subprocess.run([str(Path(sys.executable).parent / "omnicore"), "generate", "tiny:lingbot", "a fox",
                           "--height", "48", "--width", "48", "--steps", "1", "--parallel", "auto", "--no-progress",
                           "-o", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "parallel auto: single" in done.stderr and out.stat().st_size > 0


_MEASURE = r"""
import json, os, sys, torch
torch.set_num_threads(1)
from omni_lingbot.transformer.config import LingBotTransformerConfig
from omni_lingbot.transformer.model import LingBotVideoTransformer3DModel
from omnicore.planning.estimate import activation_bytes, tensor_bytes

def rss(kind):
    for line in open("/proc/self/status"):
        if line.startswith(kind + ":"):
            return int(line.split()[1]) * 1024

cfg = {"hidden_size": 1024, "num_attention_heads": 8, "depth": 8, "intermediate_size": 3072, "text_dim": 1024,
       "freq_dim": 256, "axes_dims": [32, 48, 48], "in_channels": 16, "out_channels": 16}
t = torch.tensor([500.0])
with torch.no_grad():
    torch.randn(64, 64) @ torch.randn(64, 64)
    before = rss("VmRSS")
    model = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(cfg)).float().eval()
    weights = rss("VmRSS") - before
    model(torch.randn(1, 16, 1, 4, 4), t, torch.randn(1, 8, 1024))  # kernels warmed
    lat, text = torch.randn(1, 16, 8, 48, 48), torch.randn(1, 64, 1024)
    pre = rss("VmRSS")
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    model(lat, t, text)
    peak = rss("VmHWM") - pre
rows = 8 * 24 * 24 + 64
shape = {"hidden": 1024, "heads": 8, "head_dim": 128, "ffn": 3072}
print(json.dumps({"weights_rss": weights, "weights_plan": tensor_bytes(model), "act_peak": peak,
                  "act_estimate": activation_bytes(shape, rows, 4)}))
"""


@pytest.mark.slow
def test_estimates_against_measured_cpu_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """Memory truth on CPU: a mid-size LingBot DiT's RSS rise equals the plan's weight bytes within 5 %, and the
    peak RSS rise of one forward (4,672 rows, fp32) is within 15 % of the activation estimate."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc (VmHWM reset)")
    out = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=600, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\nweights: RSS {m['weights_rss'] / 2**20:.1f} MiB, plan {m['weights_plan'] / 2**20:.1f} MiB; "
              f"activations: peak {m['act_peak'] / 2**20:.1f} MiB, estimate {m['act_estimate'] / 2**20:.1f} MiB")
    assert m["weights_rss"] == pytest.approx(m["weights_plan"], rel=0.05)
    assert m["act_peak"] == pytest.approx(m["act_estimate"], rel=0.15)


@pytest.mark.slow
def test_quantized_and_offload_rows_price_the_load_peak(cache: Path) -> None:
    """The engine quantizes and offloads after the whole load, so a +int8 or offload row's load peak is the
    unquantized weights (plus the reserve); a limit between the steady state and that peak does not fit, and the
    engine's admission refuses such a placement before loading."""
    from omnicore.engine.limits import MemoryLimitExceeded
    from omnicore.planning.admission import MemoryGuard

    settings = _settings(cache)
    plan = build_plan("real:lingbot", request={"height": 256, "width": 256, "num_frames": 1}, host=PluginHost(settings),
                      settings=settings, fast_init=True)
    rows = {p.name: p for p in plan.placements}
    single, quant = rows["single"], rows["single+int8"]
    assert single.load_peak == 0 and quant.load_peak == sum(single.weights.values()) + quant.reserve
    assert rows["offload=layerwise"].load_peak == sum(single.weights.values()) + single.reserve
    assert sum(quant.weights.values()) < sum(single.weights.values())
    limit = (quant.per_rank + quant.load_peak) // 2  # the quantized model fits, its load does not
    assert quant.per_rank < limit < quant.load_peak
    replanned = build_plan("real:lingbot", request={"height": 256, "width": 256, "num_frames": 1},
                           device_memory_gib=limit / 2**30, host=PluginHost(settings), settings=settings,
                           fast_init=True)
    assert not next(p for p in replanned.placements if p.name == "single+int8").fits
    guard = MemoryGuard(profile=None, root=cache, limit=limit, limit_source="test", row=quant, shape={},
                        dtype_bytes=2)
    with pytest.raises(MemoryLimitExceeded, match="unquantized weights"):
        guard.check_resident()
