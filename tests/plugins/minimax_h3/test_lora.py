"""Per-request LoRA on tiny:minimax-h3 (packed documents, one per output): a mixed batch equals each request alone
and peft's merged DiT, blocks and token refiner; adapters in the release's names are read in its layout (fused
``qkv_proj`` rows grouped per head) and converted exactly; an adapter trained on diffusers'
``MiniMaxH3Transformer3DModel`` (separate q/k/v, ``[up | gate]``) converts exactly to the fused DiT (reference: peft
merges it into the diffusers model, the checkpoint converter maps the merged weights); the AdaLN projections are not
adaptable. Tiny models output noise: only equalities are checked."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _lora_helpers import FinalLatents, make_peft_adapter, merged_copy, merged_weights, plain_copy, submit_together
from omnicore.config import Settings
from omnicore.engine.api import Engine, make_request
from omnicore.lora import AdapterRegistry, LoRA, LoRAError
from omnicore.plugin_host.host import PluginHost
from safetensors.torch import load_file, save_file

PARAMS = {"num_inference_steps": 2, "height": 64, "width": 64, "duration": 4.0, "extra": {"aspect_ratio": "1:1"}}
OURS = [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")]
REFINER = ["token_refiner.blocks.0.attn.qkv_proj", "token_refiner.blocks.0.mlp.fc2"]
THEIRS = [f"transformer_blocks.{i}.{m}" for i in range(2)
          for m in ("attn.to_q", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")]
THEIRS_REFINER = ["token_refiner.refiner_blocks.0.attn.to_k", "token_refiner.refiner_blocks.0.ff.net.0.proj"]


def official_layout(adapter: Path, out: Path, config: Any) -> Path:
    """The same adapter as the release lays its weights out: the fused ``qkv_proj``'s B rows grouped per head
    (the loader's own ``ours_to_official``)."""
    from omni_minimax_h3.loader import ours_to_official

    state = load_file(str(adapter / "adapter_model.safetensors"))
    for key, value in list(state.items()):
        if ".attn.qkv_proj.lora_B." in key:
            state[key] = ours_to_official({"attn.qkv_proj.weight": value}, config)["attn.qkv_proj.weight"]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"))
    shutil.copy(adapter / "adapter_config.json", out / "adapter_config.json")
    return out


def _latents_of(state: Any) -> list[torch.Tensor]:
    """One output per request here: its video rows then its audio rows, flattened."""
    items = state.extras["items"]
    video = state.latents[0].split([it.video_rows for it in items])
    audio = state.latents[1].split([it.audio_rows for it in items])
    return [torch.cat([v.flatten(), a.flatten()]) for v, a in zip(video, audio)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("loras")
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("cache")), max_num_seqs=8,
                        request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    capture = FinalLatents(_latents_of)
    host.pm.register(capture, name="final-latents")
    engine = Engine("tiny:minimax-h3", host=host, settings=settings, lora_registry=AdapterRegistry(lora_dirs=[root]))
    dit = next(iter(engine.pipeline.transformers.values()))
    n_blocks = len(dit.blocks)
    ours = [m for m in OURS if int(m.split(".")[1]) < n_blocks]
    adapters = {  # made by peft on our DiT (the merged references) ...
        "a": make_peft_adapter(dit, ours + REFINER, root / "ours_a", rank=4, seed=1),
        "b": make_peft_adapter(dit, ours[:2], root / "ours_b", rank=8, seed=2),
        "c": make_peft_adapter(dit, ours[2:], root / "ours_c", rank=8, seed=3, alpha=2),
    }
    for name, path in adapters.items():  # ... and served as the release would lay them out
        official_layout(path, root / name, dit.config)
    yield engine, capture, adapters, dit, root
    engine.close()


def _request(prompt: str, *loras: LoRA) -> Any:
    return make_request(prompt, seed=5, loras=loras, **PARAMS)


def _latents(engine: Engine, capture: FinalLatents, request: Any) -> torch.Tensor:
    engine.submit(request).result(300)
    return capture.latents[request.request_id]


@pytest.mark.slow
def test_mixed_batch_equals_each_alone_and_the_merged_dit(setup: Any) -> None:
    engine, capture, adapters, dit, _ = setup
    names = ["a", None, "b", "c"]
    requests = [_request(f"rain {i}", *((LoRA(n),) if n else ())) for i, n in enumerate(names)]
    outputs = submit_together(engine, requests)
    assert all(o[0].metrics["batch_requests"] == 4 for o in outputs)
    for i, name in enumerate(names):
        mixed = capture.latents[requests[i].request_id]
        alone = _latents(engine, capture, _request(f"rain {i}", *((LoRA(name),) if name else ())))
        torch.testing.assert_close(mixed, alone, atol=1e-5, rtol=0)
        if name is None:
            continue
        with merged_weights(dit, [(adapters[name], 1.0)]):
            merged = _latents(engine, capture, _request(f"rain {i}"))
        torch.testing.assert_close(mixed, merged, atol=1e-5, rtol=0)
        assert (merged - _latents(engine, capture, _request(f"rain {i}"))).abs().max() > 1e-4


@pytest.mark.slow
def test_a_diffusers_adapter_converts_exactly_to_the_fused_dit(setup: Any) -> None:
    from diffusers import MiniMaxH3Transformer3DModel
    from omni_minimax_h3.loader import diffusers_to_ours, ours_to_diffusers

    engine, capture, _, dit, root = setup
    reference = MiniMaxH3Transformer3DModel(**dit.config.to_dict()).float().eval()
    missing, unexpected = reference.load_state_dict(ours_to_diffusers(plain_copy(dit).float().state_dict()),
                                                    strict=False)
    assert not unexpected, unexpected
    theirs = [m for m in THEIRS if int(m.split(".")[1]) < len(dit.blocks)] + THEIRS_REFINER
    adapter = make_peft_adapter(reference, theirs, root / "theirs", rank=4, seed=9)
    merged_theirs = merged_copy(reference, [(adapter, 0.8)])
    merged_ours = plain_copy(dit)
    state = diffusers_to_ours(merged_theirs.state_dict())
    merged_ours.load_state_dict({k: state[k].to(v.dtype) if k in state else v
                                 for k, v in merged_ours.state_dict().items()})
    got = _latents(engine, capture, _request("rain", LoRA("theirs", 0.8)))
    with merged_weights(dit, [], merged=merged_ours):
        want = _latents(engine, capture, _request("rain"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (want - _latents(engine, capture, _request("rain"))).abs().max() > 1e-4


def test_the_adaln_projections_are_not_adaptable(setup: Any) -> None:
    engine, _, _, dit, root = setup
    make_peft_adapter(dit, ["blocks.0.attn.out_proj", "blocks.0.adaln_proj.linear"], root / "adaln", rank=2)
    with pytest.raises(LoRAError, match="not adaptable") as info:
        engine.submit(_request("rain", LoRA("adaln")))
    assert info.value.key == "base_model.model.blocks.0.adaln_proj.linear.lora_A.weight"
    assert engine.stats()["queued"] == 0


def test_the_converter_fuses_q_k_v_and_swaps_the_mlp_halves() -> None:
    from types import SimpleNamespace

    from omni_minimax_h3.lora import checkpoint_to_ours

    config = SimpleNamespace(num_attention_heads=2, attention_head_dim=4)  # what the converter reads
    g = torch.Generator().manual_seed(0)
    aq, bq, av, bv = (torch.randn(s, generator=g) for s in ((2, 8), (8, 2), (3, 8), (8, 3)))
    a1, b1 = torch.randn(2, 8, generator=g), torch.randn(12, 2, generator=g)  # [up | gate] rows
    out = checkpoint_to_ours({"transformer_blocks.0.attn.to_q": (aq, bq), "transformer_blocks.0.attn.to_v": (av, bv),
                              "transformer_blocks.0.ff.net.0.proj": (a1, b1)}, config)
    a, b = out["blocks.0.attn.qkv_proj"]
    x = torch.randn(5, 8, generator=g)
    delta = x @ a.T @ b.T
    torch.testing.assert_close(delta[:, :8], x @ aq.T @ bq.T)
    assert torch.equal(delta[:, 8:16], torch.zeros(5, 8))  # no k adapter: no k delta
    torch.testing.assert_close(delta[:, 16:], x @ av.T @ bv.T)
    assert torch.equal(out["blocks.0.mlp.fc1"][1], torch.cat([b1[6:], b1[:6]]))
    with pytest.raises(ValueError, match="two adapters"):
        checkpoint_to_ours({"transformer_blocks.0.attn.to_out.0": (aq, bq), "blocks.0.attn.out_proj": (aq, bq)},
                           config)


@pytest.mark.slow
def test_the_adaln_schedule_cache_stays_exact_with_adapters(setup: Any) -> None:
    """The AdaLN projections take no adapters, so the adaln_schedule cache (weights offloaded to its tables) gives
    an adapted request the latents it has without the cache, and the adapter still changes them."""
    engine, capture, _, _, root = setup
    want = _latents(engine, capture, _request("rain", LoRA("a")))
    settings = Settings(cache_dir=engine.settings.cache_dir, max_num_seqs=8, request_batch_max_wait_ms=2000)
    host = PluginHost(settings)
    cached_capture = FinalLatents(_latents_of)
    host.pm.register(cached_capture, name="final-latents")
    with Engine("tiny:minimax-h3", host=host, settings=settings, lora_registry=AdapterRegistry(lora_dirs=[root]),
                cache_methods=[("adaln_schedule", {"offload_weights": True})]) as cached:
        got = _latents(cached, cached_capture, _request("rain", LoRA("a")))
        plain = _latents(cached, cached_capture, _request("rain"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got - plain).abs().max() > 1e-4


@pytest.mark.slow
def test_generate_on_the_command_line_with_two_adapters(setup: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``omnicore generate tiny:minimax-h3 "rain" --lora ./a --lora ./b:0.5 -o x.mp4`` writes the clip (video and
    its audio track), which differs from the clip without adapters."""
    import av
    import numpy as np
    from omnicore.cli.main import main

    engine, _, _, _, root = setup
    monkeypatch.setenv("OMNICORE_CACHE", engine.settings.cache_dir)
    monkeypatch.chdir(root)
    args = ["generate", "tiny:minimax-h3", "rain", "--height", "64", "--width", "64", "--duration", "4", "--steps",
            "2", "--seed", "5", "--extra", "aspect_ratio=1:1", "--no-progress"]
    assert main([*args, "--lora", "./a", "--lora", "./b:0.5", "-o", str(tmp_path / "x.mp4")]) == 0
    assert main([*args, "-o", str(tmp_path / "plain.mp4")]) == 0

    def frames(path: Path) -> np.ndarray:
        with av.open(str(path)) as container:
            assert container.streams.audio, "the clip has its audio track"
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])

    adapted, plain = frames(tmp_path / "x.mp4"), frames(tmp_path / "plain.mp4")
    assert adapted.shape == plain.shape and not np.array_equal(adapted, plain)


@pytest.mark.slow
def test_http_with_preloaded_adapters_equals_the_command_line(setup: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``/v1/videos/sync`` with ``lora: [{"name": "a"}, {"name": "b", "scale": 0.5}]`` on a server whose adapters
    are preloaded by name (``--lora-modules``) decodes to the frames ``omnicore generate --lora ./a --lora
    ./b:0.5`` writes; ``/v1/models`` lists the adapters."""
    import io

    import av
    import httpx
    import numpy as np
    from _server_helpers import LiveServer
    from omnicore.cli.main import main
    from omnicore.server import ServerSettings, create_app

    engine, _, _, _, root = setup
    monkeypatch.setenv("OMNICORE_CACHE", engine.settings.cache_dir)
    monkeypatch.chdir(root)
    assert main(["generate", "tiny:minimax-h3", "rain", "--height", "64", "--width", "64", "--duration", "4",
                 "--steps", "2", "--seed", "5", "--extra", "aspect_ratio=1:1", "--no-progress", "--lora", "./a",
                 "--lora", "./b:0.5", "-o", str(tmp_path / "cli.mp4")]) == 0

    def frames(data: bytes) -> np.ndarray:
        with av.open(io.BytesIO(data)) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])

    settings = Settings(cache_dir=engine.settings.cache_dir)
    served = Engine("tiny:minimax-h3", host=PluginHost(settings), settings=settings,
                    lora_registry=AdapterRegistry(modules={"a": str(root / "a"), "b": str(root / "b")}))
    server = LiveServer(create_app(served, ServerSettings(state_dir=tmp_path / "state"))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            card = c.get("/v1/models").json()["data"][0]["omnicore"]
            assert [x["name"] for x in card["loras"]] == ["a", "b"]
            body = {"prompt": "rain", "seconds": "4", "seed": "5", "num_inference_steps": "2", "size": "64x64",
                    "model_params": {"aspect_ratio": "1:1"}, "lora": [{"name": "a"}, {"name": "b", "scale": 0.5}]}
            r = c.post("/v1/videos/sync", json=body)
            assert r.status_code == 200, r.text
            plain = c.post("/v1/videos/sync", json={**body, "lora": []})
            assert plain.status_code == 200, plain.text
    finally:
        server.stop()
    over_http = frames(r.content)
    assert np.array_equal(over_http, frames((tmp_path / "cli.mp4").read_bytes()))
    assert not np.array_equal(over_http, frames(plain.content))
