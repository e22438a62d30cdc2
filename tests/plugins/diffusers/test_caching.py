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
