"""Helpers for the HunyuanImage-3 tests (imported by name; pytest puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnicore.engine.protocol import LoadOptions
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.platforms.cpu import CpuPlatform


def load(path: Path, **model_options: Any) -> Any:
    from omni_hunyuan.pipeline import HunyuanImage3Pipeline

    opts = {"kv_mode": "dense_legacy", "kv_block_size": 16, "kv_pool_blocks": 512, "kv_reuse": True,
            **model_options}
    return HunyuanImage3Pipeline.from_pretrained(path, LoadOptions(platform=CpuPlatform(), model_options=opts))


def request(prompt: str = "a lighthouse at dusk", *, images: tuple[Any, ...] = (), extra: dict[str, Any] | None = None,
            negative_prompt: str | None = None, **params: Any) -> GenerationRequest:
    """A 64x64, 3-step request with CFG (guidance 4) for the micro checkpoint; keywords override params."""
    defaults = {"height": 64, "width": 64, "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 7}
    return GenerationRequest(prompt, SamplingParams(**{**defaults, **params}), images=images, extra=extra or {},
                             negative_prompt=negative_prompt)


def run(pipe: Any, *requests: GenerationRequest, decode: bool = True) -> tuple[Any, list[Any]]:
    """Preprocess, encode, every step, decode: what the engine does for one batch."""
    prepared = [pipe.preprocess(r) for r in requests]
    state = pipe.encode(prepared)
    for step in range(state.num_steps):
        state = pipe.denoise_step(state, step)
    return state, (pipe.decode(state) if decode else [])


def square_image(size: int = 96, seed: int = 0) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
