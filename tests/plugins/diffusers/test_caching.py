"""``--cache first_block_cache`` on the adapter: diffusers' own first-block cache hooks, reported steps, no leaks."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from _diffusers_helpers import make_engine

PROMPT = "a red fox in the snow"
RUN = {"seed": 1, "num_inference_steps": 4}


def _run(settings: Any, config: Any) -> tuple[bytes, list[int]]:
    methods = [] if config is None else [("first_block_cache", config)]
    with make_engine("tiny:diffusers-flux", settings, cache_methods=methods) as engine:
        outs = [engine.generate(PROMPT, **RUN)[0] for _ in range(2)]
    assert outs[0].frames.tobytes() == outs[1].frames.tobytes(), "the cache leaked state between requests"
    return outs[0].frames.tobytes(), [o.metrics["cache_reused_steps"] for o in outs]


def test_reuse_is_real_reported_and_a_tiny_threshold_changes_nothing(settings: Any) -> None:
    plain, _ = _run(settings, None)
    always, reused = _run(settings, {"threshold": 1e9})  # every step after the first skips the remaining blocks
    never, none = _run(settings, {"threshold": 1e-12})
    assert reused == [3, 3] and none == [0, 0]
    assert always != plain and never == plain


def test_a_cancelled_call_leaves_no_cache_state_behind(settings: Any) -> None:
    from omnicore.engine.api import make_request

    with make_engine("tiny:diffusers-flux", settings, cache_methods=[("first_block_cache", {"threshold": 1e9})]) \
            as engine:
        [expected] = engine.generate(PROMPT, **RUN)
        jobs: list[Any] = []
        ready = threading.Event()

        def cancel(event: Any) -> None:
            if event.phase == "denoise" and event.step == 1:
                ready.wait(30)
                jobs[0].cancel()

        jobs.append(engine.submit(make_request("another prompt", seed=5, num_inference_steps=6), on_event=cancel))
        ready.set()
        jobs[0].wait(120)
        assert jobs[0].status == "cancelled"
        [again] = engine.generate(PROMPT, **RUN)
    assert again.frames.tobytes() == expected.frames.tobytes()


@pytest.mark.parametrize(("method", "config", "name"), [("first_block_cache", {"force_hits": [2]}, "force_hits"),
                                                        ("first_block_cache", {"threshold": -1}, "threshold"),
                                                        ("teacache", None, "teacache")])
def test_what_diffusers_hooks_cannot_do_is_refused_by_name(settings: Any, method: str, config: Any,
                                                           name: str) -> None:
    from omnicore.errors import OmnicoreError

    with pytest.raises(OmnicoreError) as info:
        make_engine("tiny:diffusers-flux", settings, cache_methods=[(method, config)]).close()
    assert name in str(info.value), str(info.value)


# ------------------------------------------------------------------ diffusers' other hook caches
HOOKED = [("taylorseer_cache", {"cache_interval": 2, "disable_cache_before_step": 1,
                                "taylor_factors_dtype": None}),
          ("pyramid_attention_broadcast", {"spatial_attention_block_skip_range": 2,
                                           "spatial_attention_timestep_skip_range": (-1, 1000)}),
          ("faster_cache", {"spatial_attention_block_skip_range": 2, "is_guidance_distilled": True,
                            "spatial_attention_timestep_skip_range": (-1, 1000)})]


@pytest.mark.parametrize(("method", "config"), HOOKED, ids=[m for m, _ in HOOKED])
def test_hook_caches_equal_diffusers_own_cache_on_the_stock_pipeline(settings: Any, method: str,
                                                                      config: dict[str, Any]) -> None:
    """omnicore's ``--cache <method>`` equals calling the stock pipeline with diffusers' same cache enabled, bit for
    bit, differs from the uncached image (the cache acts), and leaves no state between requests."""
    import diffusers
    import numpy as np
    import torch
    from omni_diffusers.hook_caches import build_config

    config = {k: v for k, v in config.items() if v is not None}
    if method == "taylorseer_cache":
        config["taylor_factors_dtype"] = torch.float32
    run = {"seed": 3, "num_inference_steps": 5, "height": 32, "width": 32}
    with make_engine("tiny:diffusers-flux", settings, cache_methods=[(method, config)]) as engine:
        outs = [engine.generate(PROMPT, **run)[0] for _ in range(2)]
        path = str(engine.resolved.path)
    assert outs[0].frames.tobytes() == outs[1].frames.tobytes(), "the cache leaked state between requests"
    assert outs[0].metrics["cache_reused_steps"] is None  # (decided inside diffusers' hooks: unknown, not 0)
    pipe = diffusers.DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)

    def stock(cached: bool) -> np.ndarray:
        if cached:
            pipe.transformer.enable_cache(build_config(method, config, lambda: pipe.current_timestep))
        try:
            images = pipe(PROMPT, num_inference_steps=5, guidance_scale=3.5, max_sequence_length=32, height=32,
                          width=32, generator=torch.Generator().manual_seed(3)).images
        finally:
            if cached:
                pipe.transformer.disable_cache()
        return np.stack([np.asarray(i) for i in images])

    assert np.array_equal(outs[0].frames, stock(True))
    assert not np.array_equal(outs[0].frames, stock(False))


def test_hook_cache_configs_are_checked_by_field_name(settings: Any) -> None:
    from omnicore.errors import OmnicoreError

    with pytest.raises(OmnicoreError, match="cache_intervall.*TaylorSeerCacheConfig"):
        make_engine("tiny:diffusers-flux", settings,
                    cache_methods=[("taylorseer_cache", {"cache_intervall": 2})]).close()
    with pytest.raises(OmnicoreError, match="current_timestep_callback"):  # the adapter's own
        make_engine("tiny:diffusers-flux", settings,
                    cache_methods=[("faster_cache", {"current_timestep_callback": 1})]).close()
    with pytest.raises(OmnicoreError, match="mag_ratios"):  # model-dependent: diffusers' calibration gives them
        make_engine("tiny:diffusers-flux", settings, cache_methods=[("mag_cache", None)]).close()


def test_hook_caches_are_refused_on_other_models(settings: Any) -> None:
    """A model whose spec does not list diffusers' hook caches refuses them by name at load."""
    import omnicore
    from omnicore.errors import OmnicoreError
    from omnicore.testing import add_loaded, isolated_host

    pytest.importorskip("omni_lingbot")
    host = isolated_host(settings)
    add_loaded(host, "omni_diffusers.plugin")
    add_loaded(host, "omni_lingbot.plugin")
    with pytest.raises(OmnicoreError, match="taylorseer_cache"):
        omnicore.Engine("tiny:lingbot", host=host, settings=settings,
                        cache_methods=[("taylorseer_cache", None)]).close()
