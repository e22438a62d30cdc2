"""The LingBot DiT calls its RMSNorm, modulation, gated residuals and SwiGLU through the platform ops it was loaded
with (``options.platform.ops``): a backend's kernel runs where its ``applies`` accepts the inputs, the eager
reference elsewhere, and with the eager references the outputs are bit-identical to the pre-seam model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _lingbot_helpers import request, run
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.ops import reference as ref
from omnicore.ops.table import PlatformOps
from omnicore.testing.plugin import add_to_host, isolated_host
from toy import ops_backend

PROMPT = "a red fox"
PARAMS = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 2.0, "seed": 5}


class CountingTable(PlatformOps):
    """An op table that records which ops the model called (eager values)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        fn = PlatformOps.eager(name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted


@torch.no_grad()
def test_the_dit_routes_its_elementwise_math_through_the_bound_ops(pipe):
    model = pipe.transformer
    table = CountingTable()
    from omni_lingbot.transformer.norm import bind_ops

    x = torch.randn(1, model.config.in_channels, 1, 4, 4)
    text = torch.randn(1, 6, model.config.text_dim)
    t = torch.tensor([500.0])
    before = model(x, t, text)
    try:
        bind_ops(model, table)
        after = model(x, t, text)
    finally:
        bind_ops(model, ref)
    assert torch.equal(before, after)  # same math, routed through the table
    depth = model.config.depth
    assert table.calls["modulate"] == depth and table.calls["gated_residual"] == depth
    assert table.calls["gated_residual_norm_modulate"] == depth  # attention residual + norm2 + FFN modulation
    assert table.calls["rms_norm"] >= 5 * depth  # norm1, post-attn/ffn, q/k per block
    assert table.calls["swiglu"] >= 1


@pytest.fixture(scope="module")
def engines(tiny_dir, tmp_path_factory):
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("omnicore-cache")))
    plain = isolated_host(settings)
    assert add_to_host(plain, "omni_lingbot.plugin", "lingbot").status == "loaded"
    fast = isolated_host(settings)
    assert add_to_host(fast, "omni_lingbot.plugin", "lingbot").status == "loaded"
    assert add_to_host(fast, "toy.ops_backend:ToyOpsBackend", "toy-ops").status == "loaded"
    with Engine(tiny_dir, host=plain, settings=settings) as a, Engine(tiny_dir, host=fast, settings=settings) as b:
        yield a, b


def test_a_backend_kernel_is_used_where_it_applies_and_eager_elsewhere(engines, pipe):
    plain, fast = engines
    assert fast.platform.ops.provided() == {"rms_norm": ["toy-ops"], "swiglu": ["toy-ops"]}
    ops_backend.CALLS.clear()
    (with_kernels,) = fast.generate(PROMPT, **PARAMS)
    calls = dict(ops_backend.CALLS)
    assert calls["rms_norm.fast"] == calls["rms_norm.applies"] > 0  # [T, H] rows: the kernel
    assert calls["rms_norm.fallback"] > 0  # per-head q/k norms on [T, heads, D]: eager fallback
    assert calls["swiglu.fast"] > 0
    ops_backend.CALLS.clear()
    (eager,) = plain.generate(PROMPT, **PARAMS)
    assert not ops_backend.CALLS  # the other engine's platform has eager ops only
    # the toy kernels compute the same values by other formulas: equal within float32 rounding, not bitwise
    diff = np.abs(with_kernels.frames.astype(int) - eager.frames.astype(int))
    assert diff.max() <= 2
    _, (reference,) = run(pipe, request(PROMPT, **PARAMS))  # the pipeline on an unbound (eager) platform
    assert np.array_equal(eager.frames, reference.frames)


@pytest.mark.parametrize("lengths, pad", [((5,), 1), ((5, 3), 1), ((5, 3), 8)])
def test_fused_residual_norm_modulate_equals_the_three_steps_bitwise(lengths, pad):
    from omni_lingbot.transformer.layout import JointLayout

    layout = JointLayout.build((1, 2, 2), lengths, torch.device("cpu"), pad)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(layout.total, 16, generator=g) for _ in range(2))
    gate, shift, scale = (torch.randn(len(lengths), 16, generator=g) for _ in range(3))
    weight = torch.randn(16, generator=g)
    want_x = layout.gated_add(x, gate, y)
    want_h = layout.modulate(ref.rms_norm(want_x, weight, 1e-6), shift, scale)
    got_x, got_h = layout.gated_add_norm_modulate(x, gate, y, shift, scale, weight, 1e-6)
    assert torch.equal(got_x, want_x) and torch.equal(got_h, want_h)
