"""The pipeline hooks through the host's keyword-only facade: core defaults, tryfirst overrides, wrappers."""

from __future__ import annotations

import pytest
from omnicore import hookimpl
from omnicore.config import Settings
from omnicore.plugin_host import PluginHost


class RecordingPipeline:
    """Stands in for a model pipeline: records what the core's default hook implementations call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def preprocess(self, request):
        self.calls.append(("preprocess", request))
        return f"prepared({request})"

    def denoise_step(self, state, step):
        self.calls.append(("denoise_step", state, step))
        return state + [step]


@pytest.fixture
def host() -> PluginHost:
    return PluginHost(Settings(), autoload=False)


def test_omnicore_preprocess_default_calls_the_pipeline_once(host):
    pipe = RecordingPipeline()
    assert host.preprocess(request="r1", pipeline=pipe) == "prepared(r1)"
    assert pipe.calls == [("preprocess", "r1")]


def test_omnicore_preprocess_wrapper_transforms_the_prepared_request(host):
    class Rewriter:
        @hookimpl(wrapper=True)
        def omnicore_preprocess(self, request, pipeline):
            prepared = yield
            return prepared.upper()

    host.add_plugin(Rewriter(), "rewriter")
    pipe = RecordingPipeline()
    assert host.preprocess(request="r1", pipeline=pipe) == "PREPARED(R1)"
    assert len(pipe.calls) == 1


def test_omnicore_denoise_default_runs_the_model_step(host):
    pipe = RecordingPipeline()
    assert host.denoise(pipeline=pipe, state=[], step=0) == [0]
    assert pipe.calls == [("denoise_step", [], 0)]


def test_omnicore_denoise_tryfirst_cache_may_skip_the_model_or_fall_through(host):
    class EveryOtherStepCache:
        def __init__(self) -> None:
            self.hits = 0

        @hookimpl(tryfirst=True)
        def omnicore_denoise(self, pipeline, state, step):
            if step % 2:
                self.hits += 1
                return state + [f"reused{step}"]
            return None

    cache = EveryOtherStepCache()
    host.add_plugin(cache, "cache")
    pipe = RecordingPipeline()
    state: list = []
    for step in range(4):
        state = host.denoise(pipeline=pipe, state=state, step=step)
    assert state == [0, "reused1", 2, "reused3"]
    assert [c[2] for c in pipe.calls] == [0, 2]  # the model ran only on the steps the cache did not take
    assert cache.hits == 2


def test_omnicore_denoise_wrapper_observes_every_step_even_cached_ones(host):
    seen: list[tuple[int, object]] = []

    class Skipper:
        @hookimpl(tryfirst=True)
        def omnicore_denoise(self, pipeline, state, step):
            return "cached" if step == 1 else None

    class Progress:
        @hookimpl(wrapper=True)
        def omnicore_denoise(self, pipeline, state, step):
            result = yield
            seen.append((step, result))
            return result

    host.add_plugin(Skipper(), "skipper")
    host.add_plugin(Progress(), "progress")
    pipe = RecordingPipeline()
    host.denoise(pipeline=pipe, state=[], step=0)
    host.denoise(pipeline=pipe, state=[], step=1)
    assert seen == [(0, [0]), (1, "cached")]


def test_omnicore_denoise_wrapper_sees_the_model_exception(host):
    class Failing(RecordingPipeline):
        def denoise_step(self, state, step):
            raise FloatingPointError("nan in latents")

    caught: list[BaseException] = []

    class Guard:
        @hookimpl(wrapper=True)
        def omnicore_denoise(self, pipeline, state, step):
            try:
                return (yield)
            except FloatingPointError as exc:
                caught.append(exc)
                raise

    host.add_plugin(Guard(), "guard")
    with pytest.raises(FloatingPointError):
        host.denoise(pipeline=Failing(), state=[], step=0)
    assert len(caught) == 1


def test_omnicore_postprocess_default_is_identity_and_filters_chain(host):
    out = object()
    assert host.postprocess(request="r", output=out) is out

    class Watermark:
        @hookimpl(wrapper=True)
        def omnicore_postprocess(self, request, output):
            result = yield
            return ("wm", result)

    class Replace:
        @hookimpl(tryfirst=True)
        def omnicore_postprocess(self, request, output):
            return ("converted", output) if request == "convert" else None

    host.add_plugin(Watermark(), "wm")
    host.add_plugin(Replace(), "replace")
    assert host.postprocess(request="r", output=1) == ("wm", 1)
    assert host.postprocess(request="convert", output=1) == ("wm", ("converted", 1))


def test_facade_passes_every_argument_by_keyword(host):
    seen: dict = {}

    class Spy:
        @hookimpl(tryfirst=True)
        def omnicore_denoise(self, pipeline, state, step):
            seen.update(pipeline=pipeline, state=state, step=step)
            return "x"

    host.add_plugin(Spy(), "spy")
    host.denoise("P", "S", 7)  # positional at the facade, keywords into pluggy
    assert seen == {"pipeline": "P", "state": "S", "step": 7}
