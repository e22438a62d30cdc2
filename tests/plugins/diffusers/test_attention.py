"""``--attention-backend`` on the adapter: routed pipelines run omnicore's selected backend, others refuse it.

FLUX's and Wan's processors hand attention to diffusers' dispatcher, which the adapter binds to omnicore's
selection per processor (omni_diffusers.attention); SD3's joint processor calls SDPA itself, so a forced backend
is refused naming the pipeline. The forced backend here is the conformance kit's spy over the core's SDPA
reference: it counts its calls, and the pixels must equal the stock pipeline's bit for bit (same math).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

PROMPT = "a red fox in the snow"
TINY = {"height": 32, "width": 32}


def _spy_engine(name: str, settings: Any) -> Any:
    import omnicore
    from _diffusers_helpers import PLUGIN
    from omnicore.testing import add_loaded, isolated_host
    from omnicore.testing.runtime import SPY_BACKEND, SpyAttentionPlugin

    forced = settings.evolve(attention_backend=SPY_BACKEND)
    host = isolated_host(forced)
    add_loaded(host, PLUGIN)
    record = host.add_plugin(SpyAttentionPlugin(host.attention_backends.get("sdpa")), "spy")
    assert record.status == "loaded", record.error
    return omnicore.Engine(f"tiny:diffusers-{name}", host=host, settings=forced)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "call"), [
    ("flux", {"guidance_scale": 3.5}),
    ("wan", {"num_frames": 5, "guidance_scale": 5.0, "output_type": "np"}),
])
def test_a_forced_backend_runs_every_attention_of_the_denoiser(settings: Any, direct: Any, engines: Any,
                                                               name: str, call: dict) -> None:
    from omnicore.testing.runtime import spy_calls

    with _spy_engine(name, settings) as engine:
        assert engine.spec.capabilities.honours_attention_backend
        modules = engine.pipeline.attention.routed
        assert modules >= 2 and not engine.pipeline.attention.unrouted
        before = spy_calls()
        [out] = engine.generate(PROMPT, seed=3, **TINY)
        calls = spy_calls() - before
    cfg = 2 if name == "wan" else 1  # Wan's guidance runs the transformer twice per step
    assert calls >= modules * 2 * cfg, (calls, modules)  # every routed module, at both steps
    ref = direct(engines[name])(PROMPT, num_inference_steps=2, max_sequence_length=32, generator=torch.Generator()
                                .manual_seed(3), **call, **TINY)
    pixels = ref.frames[0] if name == "wan" else np.stack([np.asarray(i) for i in ref.images])
    if name == "wan":
        pixels = (pixels * 255).round().astype("uint8")
    assert np.array_equal(out.frames, pixels)


def test_a_pipeline_whose_attention_cannot_be_routed_refuses_a_forced_backend(settings: Any) -> None:
    from omnicore.errors import UnsupportedFeature

    with pytest.raises(UnsupportedFeature) as info:
        _spy_engine("sd3", settings).close()
    assert info.value.feature == "attention_backend"
    assert "StableDiffusion3Pipeline" in str(info.value) and "JointAttnProcessor2_0" in str(info.value)


def test_what_omnicore_backends_do_not_express_stays_with_diffusers() -> None:
    """Dropout, an additive float mask, a diffusers backend set on the module: diffusers' own dispatcher."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from omni_diffusers.attention import RoutedDispatch

    chosen: list[Any] = []

    class Options:
        attention = object()

        @staticmethod
        def select_attention(dtype: Any, head_dim: int) -> Any:
            from omnicore.attention.reference import sdpa_attention

            chosen.append((dtype, head_dim))
            return sdpa_attention

    dispatch = RoutedDispatch(Options(), dispatch_attention_fn)  # type: ignore[arg-type]
    q, k, v = (torch.randn(2, 5, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    keep = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(9)) > 0.3
    keep[..., 0] = True
    torch.testing.assert_close(dispatch(q, k, v, attn_mask=keep), dispatch_attention_fn(q, k, v, attn_mask=keep))
    assert chosen == [(torch.float32, 8)] and dispatch.fallback_calls == 0
    bias = torch.where(keep, 0.0, -1e4)
    assert torch.equal(dispatch(q, k, v, attn_mask=bias), dispatch_attention_fn(q, k, v, attn_mask=bias))
    assert dispatch.fallback_calls == 1
