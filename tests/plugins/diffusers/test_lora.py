"""LoRA on the generic adapter: diffusers' own ``load_lora_weights`` / ``set_adapters``, one adapter set per call.

Adapters are made here with peft on the tiny FLUX transformer (random ``lora_A``/``lora_B``, rank 4) and written by
``FluxPipeline.save_lora_weights``. References: the stock pipeline with the same adapter loaded by diffusers (exact),
and a copy whose weights were fused with it (``fuse_lora``, an independent merge: within one uint8 level).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

PROMPT = "a red fox in the snow"
TINY = {"height": 32, "width": 32, "num_inference_steps": 2}


def _adapter(root: Path, name: str, seed: int, targets: tuple[str, ...] = ("to_q", "to_k", "to_v")) -> Path:
    from diffusers import FluxPipeline
    from omni_diffusers.presets import flux_components
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = flux_components()["transformer"]
    torch.manual_seed(seed)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(targets), init_lora_weights=False))
    target = root / name
    FluxPipeline.save_lora_weights(str(target), transformer_lora_layers=get_peft_model_state_dict(transformer))
    return target


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    _adapter(root, "a", 1)
    _adapter(root, "b", 2, ("to_q", "to_out.0"))
    return root


@pytest.fixture(scope="module")
def engine(lora_dir: Path, settings: Any) -> Any:
    from _diffusers_helpers import make_engine
    from omnicore.lora import AdapterRegistry

    eng = make_engine("tiny:diffusers-flux", settings,
                      lora_registry=AdapterRegistry({"style-a": str(lora_dir / "a")}, lora_dirs=[lora_dir]))
    yield eng
    eng.close()


def _stock(engine: Any, adapters: list[tuple[Path, float]], fuse: bool = False) -> np.ndarray:
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(str(engine.resolved.path))
    pipe.set_progress_bar_config(disable=True)
    for i, (path, _) in enumerate(adapters):
        pipe.load_lora_weights(str(path), adapter_name=f"r{i}")
    if adapters:
        pipe.set_adapters([f"r{i}" for i in range(len(adapters))], adapter_weights=[s for _, s in adapters])
        if fuse:
            pipe.fuse_lora(adapter_names=[f"r{i}" for i in range(len(adapters))])
            pipe.unload_lora_weights()
    out = pipe(PROMPT, guidance_scale=3.5, max_sequence_length=32, generator=torch.Generator().manual_seed(7),
               output_type="np", **TINY).images
    return (out * 255).round().astype("uint8")


def test_an_adapter_equals_diffusers_loading_it_and_a_fused_copy(engine: Any, lora_dir: Path) -> None:
    from omnicore.plugin import LoRA

    [out] = engine.generate(PROMPT, seed=7, loras=[LoRA("a", scale=0.8)], **TINY)
    assert np.array_equal(out.frames, _stock(engine, [(lora_dir / "a", 0.8)]))
    fused = _stock(engine, [(lora_dir / "a", 0.8)], fuse=True)
    assert np.abs(out.frames.astype(int) - fused.astype(int)).max() <= 1
    [base] = engine.generate(PROMPT, seed=7, **TINY)  # LoRA disabled again for a batch without adapters
    assert np.array_equal(base.frames, _stock(engine, []))
    assert not np.array_equal(base.frames, out.frames)


def test_two_adapters_compose_and_a_preloaded_name_resolves(engine: Any, lora_dir: Path) -> None:
    from omnicore.plugin import LoRA

    [out] = engine.generate(PROMPT, seed=7, loras=[LoRA("style-a", 0.5), LoRA("b", 1.2)], **TINY)
    assert np.array_equal(out.frames, _stock(engine, [(lora_dir / "a", 0.5), (lora_dir / "b", 1.2)]))


def test_scale_zero_equals_no_adapter(engine: Any) -> None:
    from omnicore.plugin import LoRA

    [zero] = engine.generate(PROMPT, seed=7, loras=[LoRA("a", 0.0)], **TINY)
    [base] = engine.generate(PROMPT, seed=7, **TINY)
    assert np.array_equal(zero.frames, base.frames)


def test_adapter_sets_are_part_of_the_batch_key(engine: Any) -> None:
    from omnicore.engine.api import make_request
    from omnicore.plugin import LoRA

    pipeline = engine.pipeline
    key = lambda *loras: pipeline.batch_key(pipeline.preprocess(make_request(PROMPT, seed=1, loras=loras,  # noqa
                                                                             **TINY)))
    assert key(LoRA("a", 0.8)) == key(LoRA("a", 0.8))
    assert key(LoRA("a", 0.8)) != key(LoRA("a", 0.5)) != key()


@pytest.mark.parametrize(("name", "match"), [
    ("../outside", "outside the allowed|no such adapter"),
    ("nothing-here", "no such adapter"),
])
def test_paths_outside_or_missing_are_refused_before_queueing(engine: Any, name: str, match: str) -> None:
    from omnicore.engine.api import make_request
    from omnicore.plugin import LoRA, LoRAError

    with pytest.raises(LoRAError, match=match):
        engine.submit(make_request(PROMPT, seed=1, loras=[LoRA(name)], **TINY))


def test_bad_files_are_refused_naming_the_key(engine: Any, lora_dir: Path) -> None:
    from omnicore.engine.api import make_request
    from omnicore.plugin import LoRA, LoRAError
    from safetensors.torch import load_file, save_file

    state = load_file(str(lora_dir / "a" / "pytorch_lora_weights.safetensors"))
    (lora_dir / "missing").mkdir()
    bad = {k.replace("to_q", "to_nowhere"): v for k, v in state.items()}
    save_file(bad, str(lora_dir / "missing" / "pytorch_lora_weights.safetensors"))
    with pytest.raises(LoRAError, match="to_nowhere"):
        engine.submit(make_request(PROMPT, seed=1, loras=[LoRA("missing")], **TINY))
    (lora_dir / "shape").mkdir()
    key = next(k for k in state if k.endswith("to_q.lora_A.weight"))
    wrong = dict(state, **{key: torch.zeros(4, 7)})
    save_file(wrong, str(lora_dir / "shape" / "pytorch_lora_weights.safetensors"))
    with pytest.raises(LoRAError, match="to_q"):
        engine.submit(make_request(PROMPT, seed=1, loras=[LoRA("shape")], **TINY))
    (lora_dir / "pickle.bin").write_bytes(b"not safetensors")
    with pytest.raises(LoRAError, match="safetensors"):
        engine.submit(make_request(PROMPT, seed=1, loras=[LoRA("pickle.bin")], **TINY))
    [ok] = engine.generate(PROMPT, seed=7, **TINY)  # the engine still serves
    assert ok.frames.shape == (1, 32, 32, 3)


@pytest.mark.slow
def test_a_rewritten_adapter_file_is_read_again(lora_dir: Path, settings: Any, tmp_path: Path) -> None:
    """The loaded-adapter cache is keyed by path, modification time and size: an adapter file rewritten in place
    (other weights, same path) is loaded again, and the output follows the new file (equal to diffusers loading
    it); the old one is deleted from the pipeline."""
    import os
    import shutil

    from _diffusers_helpers import make_engine
    from omnicore.lora import AdapterRegistry
    from omnicore.plugin import LoRA

    shutil.copytree(lora_dir / "a", tmp_path / "live")
    with make_engine("tiny:diffusers-flux", settings, lora_registry=AdapterRegistry(lora_dirs=[tmp_path])) as eng:
        [first] = eng.generate(PROMPT, seed=7, loras=[LoRA(str(tmp_path / "live"))], **TINY)
        shutil.rmtree(tmp_path / "live")
        shutil.copytree(lora_dir / "b", tmp_path / "live")  # same path, another adapter (other targets, size)
        file = tmp_path / "live" / "pytorch_lora_weights.safetensors"
        os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))  # a later mtime for sure
        [second] = eng.generate(PROMPT, seed=7, loras=[LoRA(str(tmp_path / "live"))], **TINY)
        assert eng.pipeline.adapters.loads == 2 and len(eng.pipeline.adapters._loaded) == 1
        assert len(eng.pipeline.pipe.get_list_adapters()["transformer"]) == 1  # the stale adapter was deleted
    assert np.array_equal(first.frames, _stock(eng, [(lora_dir / "a", 1.0)]))
    assert np.array_equal(second.frames, _stock(eng, [(lora_dir / "b", 1.0)]))
