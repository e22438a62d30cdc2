"""Components pre-quantized by diffusers / transformers (``TorchAoConfig``, saved with ``save_pretrained``).

The checkpoints here are written by the libraries' own save path: a tiny model loaded with
``from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))`` and saved, which writes
``quantization_config`` into ``config.json`` and the torchao tensors flattened into safetensors with torchao's
metadata. A component omnicore loads through transformers (the Qwen3-VL text encoder) comes back quantized from
that file: the same tensors as the library's online quantization, the same outputs, int8-sized. A component one of
our loaders converts (the MiniMax-H3 DiT: diffusers' ``to_q/to_k/to_v`` fused into ``qkv_proj``) is refused at
load, naming the component, the method and what to use instead.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao", reason="torchao is not installed (extra: quantization)")

from omnicore.checkpoint import CheckpointError, library_quantization, refuse_library_quantized  # noqa: E402
from omnicore.config import resolve_settings  # noqa: E402
from omnicore.engine.api import Engine, make_request  # noqa: E402
from omnicore.plugin_host.host import PluginHost  # noqa: E402
from omnicore.quantization import library_quantized, resident_bytes, row_overhead  # noqa: E402

REQUEST = {"height": 32, "width": 32, "num_frames": 1, "num_inference_steps": 2, "seed": 3}


def _torchao_int8() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.quantization import Int8WeightOnlyConfig
    return Int8WeightOnlyConfig()


def _quantized_save(cls: Any, source: Path, target: Path, config_cls: Any, **kwargs: Any) -> Any:
    """Load ``source`` with the library quantizing at load, save it to ``target``; the quantized model."""
    model = cls.from_pretrained(str(source), quantization_config=config_cls(_torchao_int8()), **kwargs)
    model.save_pretrained(str(target))
    return model


def test_refusal_names_component_and_method(tmp_path: Path) -> None:
    """A diffusers ``TorchAoConfig`` save of the MiniMax-H3 DiT (diffusers' own class) is refused by our loader,
    which fuses its projections; a plain folder passes."""
    pytest.importorskip("omni_minimax_h3", reason="the MiniMax-H3 plugin is not installed")
    from diffusers import MiniMaxH3Transformer3DModel, TorchAoConfig
    from omni_minimax_h3.loader import load_transformer
    from omni_minimax_h3.presets import build_transformer

    plain, quantized = tmp_path / "transformer_plain", tmp_path / "transformer"
    build_transformer(plain, 0)
    refuse_library_quantized(plain, plugin="minimax_h3", component="transformer")  # nothing to refuse
    assert library_quantization(plain) is None
    _quantized_save(MiniMaxH3Transformer3DModel, plain, quantized, TorchAoConfig, torch_dtype=torch.bfloat16)
    config = library_quantization(quantized)
    assert config is not None and config["quant_method"] == "torchao"
    with pytest.raises(CheckpointError) as err:
        load_transformer(quantized)
    message = str(err.value)
    assert err.value.component == "transformer" and err.value.plugin == "minimax_h3"
    for part in ("transformer", "pre-quantized by torchao", "Int8WeightOnlyConfig", "--quantization int8|fp8",
                 "quantized/<mode>/"):
        assert part in message, (part, message)
    # every raw-tensor reader goes through weight_files, so the readers of other components refuse it too
    from omnicore.checkpoint import read_state_dict

    with pytest.raises(CheckpointError, match="pre-quantized by torchao"):
        read_state_dict(quantized, plugin="minimax_h3", component="transformer")


def test_engine_refuses_prequantized_dit(tmp_path: Path) -> None:
    """Through the engine: a tiny MiniMax-H3 repository whose ``transformer/`` is a ``TorchAoConfig`` save is
    refused at load, naming the component."""
    pytest.importorskip("omni_minimax_h3", reason="the MiniMax-H3 plugin is not installed")
    from diffusers import MiniMaxH3Transformer3DModel, TorchAoConfig
    from omni_minimax_h3.presets import build_tiny

    root = build_tiny(tmp_path / "h3", ("fl2va",))
    shutil.move(str(root / "transformer"), str(tmp_path / "plain"))
    _quantized_save(MiniMaxH3Transformer3DModel, tmp_path / "plain", root / "transformer", TorchAoConfig,
                    torch_dtype=torch.bfloat16)
    settings = resolve_settings({"cache_dir": str(tmp_path / "cache")})
    with pytest.raises(CheckpointError, match=r"transformer \(.*\): holds weights pre-quantized by torchao"):
        Engine(str(root), settings=settings)


def _linears(module: Any) -> dict[str, Any]:
    return {n: m for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}


def test_text_encoder_loads_quantized_through_transformers(tmp_path: Path) -> None:
    """tiny:lingbot with its Qwen3-VL text encoder replaced by a transformers ``TorchAoConfig`` (int8 weight-only)
    save: the engine loads it quantized (transformers reads the torchao layout), its tensors equal the library's
    online quantization of the unquantized encoder bit for bit, its resident bytes are the analytic int8 size, the
    frames equal (bit for bit) those of the same quantization applied online after the load, and
    ``quantization="int8"`` does not quantize those linears a second time."""
    pytest.importorskip("omni_lingbot", reason="the LingBot plugin is not installed")
    from transformers import Qwen3VLForConditionalGeneration, TorchAoConfig

    settings = resolve_settings({"cache_dir": str(tmp_path / "cache")})
    host = PluginHost(settings)
    with Engine("tiny:lingbot", host=host, settings=settings) as plain:
        source = Path(plain.resolved.path)
        float_bytes = resident_bytes(plain.pipeline.text_encoder.model)
        float_linears = {n: tuple(m.weight.shape) for n, m in _linears(plain.pipeline.text_encoder.model).items()}
        dtype = next(plain.pipeline.text_encoder.model.parameters()).dtype
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization import quantize_
        quantize_(plain.pipeline.text_encoder.model, _torchao_int8())  # the same quantization, online
        online_state = {k: v for k, v in plain.pipeline.text_encoder.model.state_dict().items()}
        online = plain.submit(make_request("a red fox", **REQUEST)).result(600)[0].frames
    root = tmp_path / "prequantized"
    shutil.copytree(source, root)
    shutil.rmtree(root / "text_encoder")
    _quantized_save(Qwen3VLForConditionalGeneration, source / "text_encoder", root / "text_encoder", TorchAoConfig,
                    dtype=dtype)
    assert library_quantization(root / "text_encoder") is not None
    with Engine(str(root), host=host, settings=settings) as loaded:
        model = loaded.pipeline.text_encoder.model
        quantized = {n for n, m in _linears(model).items() if library_quantized(m.weight)}
        assert quantized == set(float_linears)  # every linear of the encoder came back int8
        state = model.state_dict()
        assert state.keys() == online_state.keys()
        for key, value in online_state.items():
            got = state[key]
            if library_quantized(value):
                assert type(got) is type(value), key
                assert torch.equal(got.qdata, value.qdata) and torch.equal(got.scale, value.scale), key
            else:
                assert torch.equal(got, value), key
        overhead = row_overhead("int8", backend="torchao")
        itemsize = torch.empty((), dtype=dtype).element_size()
        analytic = float_bytes - sum(o * i * itemsize - o * i - o * overhead for o, i in float_linears.values())
        assert resident_bytes(model) == analytic < float_bytes
        frames = loaded.submit(make_request("a red fox", **REQUEST)).result(600)[0].frames
    assert np.array_equal(np.asarray(online), np.asarray(frames))  # the same int8 tensors, the same kernels
    with Engine(str(root), host=host, settings=settings, quantization="int8") as both:
        report = both.quantization_report
        assert report["text_encoder"].linears == ()  # already int8 from the file: not quantized twice
        assert report["transformer"].linears  # the DiT is quantized at load as usual
        both.submit(make_request("a red fox", **REQUEST)).result(600)
    # LingBot's DiT (our class, no library to save it) with the quantization_config transformers wrote: the loader
    # and the planner both refuse it before parsing the config strictly
    import json

    from omni_lingbot.loader import load_transformer
    from omni_lingbot.presets import plan_model

    written = json.loads((root / "text_encoder" / "config.json").read_text())["quantization_config"]
    dit = json.loads((root / "transformer" / "config.json").read_text())
    (root / "transformer" / "config.json").write_text(json.dumps({**dit, "quantization_config": written}))
    for call in (lambda: load_transformer(root / "transformer", device=torch.device("cpu"), dtype=dtype),
                 lambda: plan_model(root, dtype)):
        with pytest.raises(CheckpointError, match=r"transformer \(.*\): holds weights pre-quantized by torchao"):
            call()
