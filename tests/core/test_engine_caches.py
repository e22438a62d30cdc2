"""Cache methods enabled through ``Engine(cache_methods=...)`` join the engine's denoise loop end to end."""

from __future__ import annotations

import numpy as np
import pytest
from omnicore.cache.teacache import TeaCacheConfig
from omnicore.errors import UnsupportedFeature
from toy import toy_engine


def _count_predicts(engine):
    calls = []
    original = engine.pipeline.predict

    def counting(state, step):
        calls.append(step)
        return original(state, step)

    engine.pipeline.predict = counting
    return calls


def test_teacache_forced_hits_skip_the_model_and_change_nothing_else(tmp_path):
    steps = 8
    with toy_engine(tmp_path) as plain:
        calls_plain = _count_predicts(plain)
        ref = plain.generate("a fox", num_inference_steps=steps, seed=3)[0].frames
    config = TeaCacheConfig(force_hits={2, 3, 5}, warmup_steps=1)
    engine = toy_engine(tmp_path, host=None)
    engine.close()
    from omnicore.engine.api import Engine

    with Engine("tiny:toy", host=engine.host, settings=engine.settings,
                cache_methods=[("teacache", config)]) as cached:
        calls_cached = _count_predicts(cached)
        out = cached.generate("a fox", num_inference_steps=steps, seed=3)[0].frames
    assert calls_plain == list(range(steps))
    assert calls_cached == [s for s in range(steps) if s not in {2, 3, 5}]
    assert out.shape == ref.shape and out.dtype == np.uint8
    assert not np.array_equal(out, ref)  # reused predictions really were used for the skipped steps


def test_teacache_with_a_zero_effective_threshold_reuses_nothing(tmp_path):
    from omnicore.engine.api import Engine

    base = toy_engine(tmp_path)
    base.close()
    with toy_engine(tmp_path) as plain:
        ref = plain.generate("a fox", num_inference_steps=6, seed=5)[0].frames
    with Engine("tiny:toy", host=base.host, settings=base.settings,
                cache_methods=[("teacache", TeaCacheConfig(rel_l1_thresh=1e-12))]) as cached:
        calls = _count_predicts(cached)
        out = cached.generate("a fox", num_inference_steps=6, seed=5)[0].frames
    assert calls == list(range(6))
    assert np.array_equal(out, ref)


def test_a_cache_method_the_model_does_not_declare_is_rejected_before_loading(tmp_path):
    from omnicore.engine.api import Engine

    base = toy_engine(tmp_path)
    base.close()
    with pytest.raises(UnsupportedFeature, match="first_block_cache"):
        Engine("tiny:toy", host=base.host, settings=base.settings, cache_methods=["first_block_cache"])


def test_closing_the_engine_removes_its_cache_from_the_host(tmp_path):
    from omnicore.engine.api import Engine

    base = toy_engine(tmp_path)
    base.close()
    before = {name for name, _ in base.host.pm.list_name_plugin()}
    engine = Engine("tiny:toy", host=base.host, settings=base.settings,
                    cache_methods=[("teacache", TeaCacheConfig(force_hits={1}))])
    during = {name for name, _ in base.host.pm.list_name_plugin()}
    assert during - before, "the step cache should register itself on the host's denoise hook"
    assert engine.close()
    assert {name for name, _ in base.host.pm.list_name_plugin()} == before
