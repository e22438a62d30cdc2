"""Per-request LoRA on the HunyuanImage-3 micro checkpoint (CFG rows per request, one forward per request): a
mixed batch equals each request alone and peft's merged model; adapters are read in the released checkpoint's
layout (``qkv_proj`` rows grouped per key/value head, MLPs ``gate_and_up_proj`` fused ``[up | gate]``) and
converted exactly. Tiny models output noise: only equalities are checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _lora_helpers import FinalLatents, make_peft_adapter, merged_weights, submit_together
from omnicore.config import Settings
from omnicore.engine.api import Engine, make_request
from omnicore.lora import AdapterRegistry, LoRA, LoRAError
from omnicore.plugin_host.host import PluginHost
from safetensors.torch import load_file, save_file

ARGS = {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 4.0}


def hf_layout(adapter: Path, out: Path, config: Any) -> Path:
    """The same adapter as the released checkpoint lays it out: ``qkv_proj``'s B rows grouped per kv head, and a
    ``gate_proj`` adapter as one on the fused ``gate_and_up_proj`` (rows ``[up | gate]``: zero up rows)."""
    from omni_hunyuan.loader import group_qkv

    state = load_file(str(adapter / "adapter_model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    for key, value in list(state.items()):
        if ".self_attn.qkv_proj.lora_B." in key:
            state[key] = group_qkv(value, config.num_key_value_heads, config.groups, config.attention_head_dim)
        elif ".gate_proj.lora_" in key:
            fused = key.replace(".gate_proj.", ".gate_and_up_proj.")
            value = state.pop(key)
            state[fused] = torch.cat([torch.zeros_like(value), value]) if ".lora_B." in key else value
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"))
    shutil.copy(adapter / "adapter_config.json", out / "adapter_config.json")
    return out


@pytest.fixture(scope="module")
def setup(micro_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("loras")
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("cache")), max_num_seqs=8,
                        request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    capture = FinalLatents()
    host.pm.register(capture, name="final-latents")
    engine = Engine(str(micro_dir), host=host, settings=settings, model_options={"kv_mode": "dense_legacy"},
                    lora_registry=AdapterRegistry(lora_dirs=[root]))
    model = engine.pipeline.model
    layers = len(model.model.layers)
    attn = [f"model.layers.{i}.self_attn.{p}" for i in range(layers) for p in ("qkv_proj", "o_proj")]
    mlp = [f"model.layers.{i}.mlp.shared_mlp.{p}" for i in range(layers) for p in ("gate_proj", "down_proj")]
    ours = {"a": make_peft_adapter(model, attn, root / "ours_a", rank=4, seed=1),
            "b": make_peft_adapter(model, attn[:1] + mlp, root / "ours_b", rank=8, seed=2)}
    files = {name: hf_layout(path, root / name, model.config) for name, path in ours.items()}
    yield engine, capture, ours, files
    engine.close()


def _request(prompt: str, *loras: LoRA, **extra: Any) -> Any:
    return make_request(prompt, seed=7, loras=loras, extra=extra or None, **ARGS)


def _latents(engine: Engine, capture: FinalLatents, request: Any) -> torch.Tensor:
    engine.submit(request).result(300)
    return capture.latents[request.request_id]


@pytest.mark.slow
def test_mixed_batch_equals_each_alone_and_the_merged_model(setup: Any) -> None:
    engine, capture, ours, _ = setup
    names = ["a", None, "b"]
    requests = [_request(f"a lighthouse {i}", *((LoRA(n),) if n else ())) for i, n in enumerate(names)]
    outputs = submit_together(engine, requests)
    assert all(o[0].metrics["batch_requests"] == 3 for o in outputs)
    for i, name in enumerate(names):
        mixed = capture.latents[requests[i].request_id]
        alone = _latents(engine, capture, _request(f"a lighthouse {i}", *((LoRA(name),) if name else ())))
        torch.testing.assert_close(mixed, alone, atol=1e-5, rtol=0)
        if name is None:
            continue
        with merged_weights(engine.pipeline.model, [(ours[name], 1.0)]):
            merged = _latents(engine, capture, _request(f"a lighthouse {i}"))
        torch.testing.assert_close(mixed, merged, atol=1e-5, rtol=0)
        assert (merged - _latents(engine, capture, _request(f"a lighthouse {i}"))).abs().max() > 1e-4


def test_the_fused_mlp_layout_converts_to_gate_and_up() -> None:
    from omni_hunyuan.lora import checkpoint_to_ours

    a, b = torch.randn(4, 8), torch.randn(12, 4)  # rows [up | gate] of a fused 6-wide MLP
    out = checkpoint_to_ours({"model.layers.0.mlp.gate_and_up_proj": (a, b)}, None)
    assert torch.equal(out["model.layers.0.mlp.up_proj"][1], b[:6])
    assert torch.equal(out["model.layers.0.mlp.gate_proj"][1], b[6:])
    assert out["model.layers.0.mlp.gate_proj"][0] is a


def test_experts_are_not_adaptable(setup: Any, tmp_path: Path) -> None:
    engine, _, _, files = setup
    bad = files["a"].parent / "experts"
    shutil.copytree(files["a"], bad)
    state = load_file(str(bad / "adapter_model.safetensors"))
    state["base_model.model.model.layers.0.mlp.gate.lora_A.weight"] = torch.zeros(4, 32)
    state["base_model.model.model.layers.0.mlp.gate.lora_B.weight"] = torch.zeros(4, 4)
    save_file(state, str(bad / "adapter_model.safetensors"))
    json.loads((bad / "adapter_config.json").read_text())
    with pytest.raises(LoRAError, match="not adaptable"):
        engine.submit(_request("x", LoRA("experts")))


@pytest.mark.slow
def test_generate_on_the_command_line_with_two_adapters_equals_the_python_api(setup: Any, micro_dir: Path,
                                                                              tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``omnicore generate <checkpoint> "x" --lora ./a --lora ./b:0.5 -o x.png`` writes the image the Python API
    makes with the same adapters (PNG: lossless), which differs from the image without them."""
    import numpy as np
    from omnicore.cli.main import main
    from PIL import Image

    engine, _, _, files = setup
    monkeypatch.setenv("OMNICORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(files["a"].parent)
    args = ["generate", str(micro_dir), "a lighthouse", "--height", "64", "--width", "64", "--steps", "2",
            "--guidance", "4.0", "--seed", "7", "--model-option", "kv_mode=dense_legacy", "--no-progress"]
    assert main([*args, "--lora", "./a", "--lora", "./b:0.5", "-o", str(tmp_path / "x.png")]) == 0
    assert main([*args, "-o", str(tmp_path / "plain.png")]) == 0
    with Image.open(tmp_path / "x.png") as im:
        adapted = np.asarray(im.convert("RGB"))
    with Image.open(tmp_path / "plain.png") as im:
        plain = np.asarray(im.convert("RGB"))
    out = engine.generate("a lighthouse", seed=7, loras=[LoRA("a"), LoRA("b", 0.5)], **ARGS)
    frames = out[0].frames  # an image is one frame: [1, H, W, 3] uint8
    assert np.array_equal(adapted, frames.reshape(frames.shape[-3:]))
    assert not np.array_equal(adapted, plain)


@pytest.mark.slow
def test_the_prefix_pool_never_mixes_adapted_and_base_k_v(setup: Any, micro_dir: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """With the paged prefix pool, an adapted request neither publishes its K/V (computed with its adapters) nor
    reuses the base K/V a plain request of the same prompt published: it gives the same latents before and after."""
    _, _, _, files = setup
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("pool-cache")), max_num_seqs=1)
    host = PluginHost(settings)
    capture = FinalLatents()
    host.pm.register(capture, name="final-latents")
    with Engine(str(micro_dir), host=host, settings=settings,
                model_options={"kv_mode": "paged_scheduler", "kv_block_size": 8, "kv_pool_blocks": 64},
                lora_registry=AdapterRegistry(lora_dirs=[files["a"].parent])) as engine:
        first = _latents(engine, capture, _request("a lighthouse", LoRA("a")))
        assert engine.pipeline.kv_pool_stats()["resident_blocks"] == 0  # nothing published
        _latents(engine, capture, _request("a lighthouse"))  # publishes the prompt's base K/V
        assert engine.pipeline.kv_pool_stats()["resident_blocks"] > 0
        again = _latents(engine, capture, _request("a lighthouse", LoRA("a")))
    torch.testing.assert_close(again, first, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_the_text_stage_writes_on_the_base_weights(setup: Any) -> None:
    """``bot_task="think"``: the text stage writes the same text for an adapted request as for a plain one (it runs
    on the base weights, batched with plain requests), and the image stage applies the adapter: the adapted image
    equals the same request run alone and differs from the plain one."""
    engine, capture, _, _ = setup
    extra = {"bot_task": "think", "max_new_tokens": 6}
    adapted, plain = _request("a fox", LoRA("a", 4.0), **extra), _request("a fox", **extra)
    outputs = submit_together(engine, [adapted, plain])
    assert outputs[0][0].text == outputs[1][0].text and outputs[0][0].text
    both = capture.latents[adapted.request_id]
    alone = _latents(engine, capture, _request("a fox", LoRA("a", 4.0), **extra))
    torch.testing.assert_close(both, alone, atol=1e-5, rtol=0)
    assert (both - capture.latents[plain.request_id]).abs().max() > 1e-4


@pytest.mark.slow
def test_http_with_preloaded_adapters_equals_the_python_api(setup: Any, micro_dir: Path,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """``/v1/images/generations`` with ``lora: [{"name": "a"}, {"name": "b", "scale": 0.5}]`` on a server whose
    adapters are preloaded by name (``--lora-modules``): the image the Python API makes, listed in ``/v1/models``,
    counted in ``/metrics``; a path is refused (no ``--lora-dir``) before anything is queued."""
    import base64
    import io

    import httpx
    import numpy as np
    from _server_helpers import LiveServer
    from omnicore.server import ServerSettings, create_app
    from PIL import Image

    _, _, _, files = setup
    root = tmp_path_factory.mktemp("lora-http")
    settings = Settings(cache_dir=str(root / "cache"))
    engine = Engine(str(micro_dir), host=PluginHost(settings), settings=settings,
                    model_options={"kv_mode": "dense_legacy"},
                    lora_registry=AdapterRegistry(modules={"a": str(files["a"]), "b": str(files["b"])}))
    server = LiveServer(create_app(engine, ServerSettings(state_dir=root / "state"))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            card = c.get("/v1/models").json()["data"][0]["omnicore"]
            assert [x["name"] for x in card["loras"]] == ["a", "b"]
            body = {"prompt": "a lighthouse", "size": "64x64", "seed": 7, "num_inference_steps": 2,
                    "guidance_scale": 4.0, "lora": [{"name": "a"}, {"name": "b", "scale": 0.5}]}
            r = c.post("/v1/images/generations", json=body)
            assert r.status_code == 200, r.text
            got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).convert("RGB"))
            refused = c.post("/v1/images/generations", json={**body, "lora": [{"path": str(files["a"])}]})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_lora", refused.text
            assert "omnicore_lora_loads_total" in c.get("/metrics").text
        out = engine.generate("a lighthouse", seed=7, loras=[LoRA("a"), LoRA("b", 0.5)], **ARGS)
        frames = out[0].frames
        assert np.array_equal(got, frames.reshape(frames.shape[-3:]))
    finally:
        server.stop()
