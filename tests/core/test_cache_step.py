"""Step caches on the ``omnicore_denoise`` hook: TeaCache and the rules shared by every step cache.

References are independent: a naive re-implementation of the TeaCache decision loop, ``numpy.polyval`` for
the rescale polynomial, and an uncached run of the same toy pipeline.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnicore.cache import TeaCacheAdapter, TeaCacheConfig, apply_teacache, resolve_threshold
from omnicore.cache.teacache import polyval
from omnicore.engine.protocol import BasePipeline, DenoiseState
from omnicore.errors import ConfigError, UnsupportedFeature
from omnicore.plugin_host.host import PluginHost

N = 12
COEFFS = (0.5, -0.2, 1.3, 0.01)  # highest power first


def _modulated(state: DenoiseState, step: int) -> torch.Tensor:
    return state.latents * (1.0 + 0.1 * step)


class Toy(BasePipeline):
    """Deterministic toy: prediction = tanh(latents * (1 + t)) + t, Euler update."""

    def __init__(self, host: PluginHost | None, default_threshold: float | None = None) -> None:
        self.host = host
        self.calls: list[int] = []
        self.teacache_adapter = TeaCacheAdapter(extract=_modulated, coefficients=COEFFS,
                                                default_threshold=default_threshold)

    def state(self, seed: int = 0, n: int = N) -> DenoiseState:
        g = torch.Generator().manual_seed(seed)
        return DenoiseState(requests=[], num_steps=n, latents=torch.randn(2, 8, generator=g))

    def predict(self, state, step):
        self.calls.append(step)
        t = 1.0 - step / state.num_steps
        return torch.tanh(state.latents * (1.0 + t)) + t

    def update(self, state, step, prediction):
        state.latents = state.latents - prediction / state.num_steps
        return state


def _run(host: PluginHost, pipe: Toy, state: DenoiseState) -> DenoiseState:
    for step in range(state.num_steps):
        state = host.denoise(pipeline=pipe, state=state, step=step)
    return state


def _naive_teacache(pipe: Toy, state: DenoiseState, thresh: float, warmup: int) -> tuple[torch.Tensor, list[int]]:
    """Independent reference of the decision rule and the reuse."""
    prev_in, cached, acc, reused = None, None, 0.0, []
    for step in range(state.num_steps):
        cur = _modulated(state, step)
        hit = False
        if prev_in is not None:
            rel = ((cur - prev_in).abs().mean() / prev_in.abs().mean()).item()
            acc += abs(float(np.polyval(COEFFS, rel)))
            hit = warmup <= step < state.num_steps - 1 and cached is not None and acc < thresh
        if not hit:
            acc = 0.0
        prev_in = cur
        if hit:
            reused.append(step)
            pred = cached
        else:
            t = 1.0 - step / state.num_steps
            pred = torch.tanh(state.latents * (1.0 + t)) + t
            cached = pred
        state.latents = state.latents - pred / state.num_steps
    return state.latents, reused


@pytest.fixture
def host() -> PluginHost:
    return PluginHost(autoload=False)


def test_threshold_resolution_rules():
    assert resolve_threshold(None, None) == 0.2
    assert resolve_threshold(None, 0.17) == 0.17
    assert resolve_threshold(0.2, 0.17) == 0.2
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="rel_l1_thresh must be positive"):
            resolve_threshold(bad, 0.17)
    with pytest.raises(ConfigError, match="rel_l1_thresh must be positive"):
        resolve_threshold(None, -1.0)


def test_handle_resolves_threshold_from_model_default(host):
    assert apply_teacache(Toy(host), {}).threshold == 0.2
    assert apply_teacache(Toy(PluginHost(autoload=False), default_threshold=0.17)).threshold == 0.17
    assert apply_teacache(Toy(PluginHost(autoload=False), 0.17), TeaCacheConfig(rel_l1_thresh=0.2)).threshold == 0.2


def test_polyval_matches_numpy_highest_power_first():
    for x in (0.0, 0.3, 1.7, -2.0):
        assert polyval(COEFFS, x) == pytest.approx(float(np.polyval(COEFFS, x)), rel=1e-12)


@pytest.mark.parametrize("thresh", [0.05, 0.4, 2.0])
def test_teacache_matches_naive_reference(host, thresh):
    pipe = Toy(host)
    expected, expected_reused = _naive_teacache(pipe, pipe.state(), thresh, warmup=1)
    handle = apply_teacache(pipe, TeaCacheConfig(rel_l1_thresh=thresh))
    state = _run(host, pipe, pipe.state())
    stats = handle.stats(state)
    assert stats.reused == expected_reused
    assert sorted(stats.computed + stats.reused) == list(range(N))
    assert pipe.calls == stats.computed
    torch.testing.assert_close(state.latents, expected, rtol=0, atol=0)
    if thresh == 2.0:
        assert expected_reused, "a large threshold must produce reuses (otherwise the test proves nothing)"


def test_forced_pattern_obeys_warmup_and_last_step(host):
    pipe = Toy(host)
    handle = apply_teacache(pipe, TeaCacheConfig(force_hits={0, 1, 2, 3, 5, 6, N - 1}, warmup_steps=3))
    state = _run(host, pipe, pipe.state())
    assert handle.stats(state).reused == [3, 5, 6]
    assert pipe.calls == [s for s in range(N) if s not in (3, 5, 6)]


def test_forced_reuse_equals_sampler_update_with_previous_prediction(host):
    pipe = Toy(host)
    apply_teacache(pipe, TeaCacheConfig(force_hits={4, 5}))
    state = _run(host, pipe, pipe.state())
    ref = Toy(None)
    ref_state = ref.state()
    last = None
    for step in range(N):
        if step in (4, 5):
            pred = last
        else:
            pred = last = ref.predict(ref_state, step)
        ref.update(ref_state, step, pred)
    torch.testing.assert_close(state.latents, ref_state.latents, rtol=0, atol=0)


def test_max_consecutive_hits(host):
    pipe = Toy(host)
    handle = apply_teacache(pipe, TeaCacheConfig(force_hits=set(range(1, N)), max_consecutive_hits=2))
    state = _run(host, pipe, pipe.state())
    assert handle.stats(state).reused == [1, 2, 4, 5, 7, 8, 10]


def test_residual_mode_reuses_residual_over_base(host):
    pipe = Toy(host)
    pipe.teacache_adapter = TeaCacheAdapter(extract=_modulated, coefficients=COEFFS,
                                            residual_base=lambda state, step: state.latents.clone())
    apply_teacache(pipe, TeaCacheConfig(force_hits={3}))
    state = _run(host, pipe, pipe.state())
    ref = Toy(None)
    s = ref.state()
    residual = None
    for step in range(N):
        if step == 3:
            pred = s.latents + residual
        else:
            pred = ref.predict(s, step)
            residual = pred - s.latents
        ref.update(s, step, pred)
    torch.testing.assert_close(state.latents, s.latents, rtol=0, atol=0)


def test_state_is_per_batch_and_resets_for_a_new_state(host):
    pipe = Toy(host)
    handle = apply_teacache(pipe, TeaCacheConfig(force_hits=set(range(1, N))))
    a, b = pipe.state(seed=1), pipe.state(seed=2)
    for step in range(N):  # interleaved batches, as in step mode
        a = host.denoise(pipeline=pipe, state=a, step=step)
        b = host.denoise(pipeline=pipe, state=b, step=step)
    expected = [s for s in range(1, N - 1)]
    assert handle.stats(a).reused == expected and handle.stats(b).reused == expected
    # each batch reused its own prediction: the result equals a solo run of the same batch
    solo_pipe = Toy(PluginHost(autoload=False))
    apply_teacache(solo_pipe, TeaCacheConfig(force_hits=set(range(1, N))))
    solo = _run(solo_pipe.host, solo_pipe, solo_pipe.state(seed=2))
    torch.testing.assert_close(b.latents, solo.latents, rtol=0, atol=0)
    # a fresh state starts with nothing cached: its step 0 and 1 ... are computed again
    c = _run(host, pipe, pipe.state(seed=3))
    assert handle.stats(c).computed == [0, N - 1]


def test_restarting_a_state_resets_its_cache(host):
    pipe = Toy(host)
    handle = apply_teacache(pipe, TeaCacheConfig(force_hits={1, 2}))
    state = pipe.state()
    for step in range(3):
        state = host.denoise(pipeline=pipe, state=state, step=step)
    pipe.calls.clear()
    state = host.denoise(pipeline=pipe, state=state, step=1)  # step did not advance: start afresh
    assert pipe.calls == [1]
    assert handle.stats(state).computed == [1]


def test_apply_then_remove_leaves_pipeline_and_host_unchanged(host):
    pipe = Toy(host)
    before = dict(pipe.__dict__)
    plugins_before = set(host.pm.get_plugins())
    reference = _run(host, pipe, pipe.state()).latents
    handle = apply_teacache(pipe, TeaCacheConfig(force_hits={2, 3}))
    cached = _run(host, pipe, pipe.state()).latents
    assert not torch.equal(cached, reference)
    handle.remove()
    handle.remove()  # idempotent
    assert set(host.pm.get_plugins()) == plugins_before
    pipe.calls.clear()
    after = _run(host, pipe, pipe.state()).latents
    torch.testing.assert_close(after, reference, rtol=0, atol=0)
    assert pipe.calls == list(range(N))
    assert pipe.__dict__.keys() == before.keys()


def test_other_pipelines_on_the_same_host_are_untouched(host):
    cached, other = Toy(host), Toy(host)
    apply_teacache(cached, TeaCacheConfig(force_hits=set(range(N))))
    _run(host, other, other.state())
    assert other.calls == list(range(N))


def test_enable_twice_is_rejected(host):
    pipe = Toy(host)
    apply_teacache(pipe)
    with pytest.raises(ConfigError, match="already enabled"):
        apply_teacache(pipe)


def test_refusing_adapter_enables_nothing(host):
    pipe = Toy(host)

    def refuse():
        raise ValueError("TeaCache only supports the FL2VA partition")

    pipe.teacache_adapter = refuse
    plugins = set(host.pm.get_plugins())
    with pytest.raises(ValueError, match="FL2VA"):
        apply_teacache(pipe)
    assert set(host.pm.get_plugins()) == plugins


def test_missing_adapter_or_host(host):
    pipe = Toy(host)
    pipe.teacache_adapter = None
    with pytest.raises(UnsupportedFeature, match="TeaCacheAdapter"):
        apply_teacache(pipe)
    with pytest.raises(ConfigError, match="host"):
        apply_teacache(Toy(None))


def test_pipeline_without_last_prediction_is_reported(host):
    class NoRecord(Toy):
        def denoise_step(self, state, step):
            return self.update(state, step, self.predict(state, step))

    pipe = NoRecord(host)
    apply_teacache(pipe)
    with pytest.raises(RuntimeError, match="last_prediction"):
        host.denoise(pipeline=pipe, state=pipe.state(), step=0)


def test_enabled_through_the_cache_hook_and_conflicts_rejected(host):
    specs = host.check_cache_methods(["teacache", "adaln_schedule"])
    assert [s.name for s in specs] == ["teacache", "adaln_schedule"]
    with pytest.raises(UnsupportedFeature, match="mutually exclusive"):
        host.check_cache_methods(["teacache", "first_block_cache"])
    pipe = Toy(host)
    handle = host.enable_cache(pipe, host.cache_methods.get("teacache"), TeaCacheConfig(force_hits={4}))
    state = _run(host, pipe, pipe.state())
    assert handle.stats(state).reused == [4]
    handle.remove()


@pytest.mark.parametrize("name", ["teacache", "first_block_cache", "adaln_schedule"])
def test_dict_configs_name_unknown_options_and_bad_types(host, name):
    from omnicore.cache._step import coerce_config

    spec = host.cache_methods.get(name)
    apply = spec.load_impl()
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['rel_l1_thres'\]") as info:
        apply(Toy(host), {"rel_l1_thres": 0.1})
    assert info.value.name == name
    with pytest.raises(ConfigError, match="a dict or None"):
        apply(Toy(host), [("rel_l1_thresh", 0.1)])
    assert coerce_config(TeaCacheConfig, None, "teacache") == TeaCacheConfig()
