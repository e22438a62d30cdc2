"""The runtime checks of ``ModelPluginConformance`` (cancellation, progress, batching, attention selection) fail
plugins that break them, in an inner pytest session (``pytester``); they pass the toy in test_testing_kit.py."""

from __future__ import annotations

import pytest
from test_testing_kit import failing, run_inner

pytest_plugins = ["pytester"]

BROKEN_MODELS = {
    "plug_broken_models": """
        import attrs
        from omnicore import hookimpl
        from toy.pipeline import ToyPipeline
        from toy.plugin import TOY_SPEC, ToyPlugin

        class BatchLeak:
            '''A denoise wrapper that lets a batch's rows influence each other (batched != solo).'''

            @hookimpl(wrapper=True)
            def omnicore_denoise(self, pipeline, state, step):
                out = yield
                if len(state.requests) > 1:
                    out.latents = out.latents + out.latents.mean(0, keepdim=True)
                return out

        class WrongRows(ToyPipeline):
            '''Shrinks a batch to the wrong rows when a request is cancelled.'''

            def select_requests(self, state, keep):
                return super().select_requests(state, [len(state.requests) - 1 - keep[0]])

        WRONG_ROWS_SPEC = attrs.evolve(TOY_SPEC, impl="plug_broken_models:WrongRows")
        # claims to run attention through omnicore's selection, but the toy has no attention at all
        CLAIMS_ATTENTION = attrs.evolve(TOY_SPEC, capabilities=attrs.evolve(TOY_SPEC.capabilities,
                                                                            honours_attention_backend=True))
    """,
}

BROKEN_MODEL_TESTS = """
    from omnicore.testing import ModelPluginConformance
    from toy.plugin import ToyPlugin
    from plug_broken_models import CLAIMS_ATTENTION, WRONG_ROWS_SPEC, BatchLeak

    class Base(ModelPluginConformance):
        model = "tiny:toy"
        plugin_module = "toy.plugin:ToyPlugin"
        plugin_name = "toy"
        params = {"num_inference_steps": 2, "height": 16, "width": 16}

    class TestBatchLeak(Base):
        @classmethod
        def make_host(cls, settings):
            host = super().make_host(settings)
            host.add_plugin(BatchLeak(), "leak")
            return host

    class TestWrongRows(Base):
        @classmethod
        def make_host(cls, settings):
            from omnicore.testing import isolated_host
            host = isolated_host(settings)
            host.add_plugin(ToyPlugin(WRONG_ROWS_SPEC), "toy")
            return host

    class TestClaimsAttention(Base):
        @classmethod
        def make_host(cls, settings):
            from omnicore.testing import isolated_host
            host = isolated_host(settings)
            host.add_plugin(ToyPlugin(CLAIMS_ATTENTION), "toy")
            return host

    RUNTIME = ("test_cancellation_mid_run_stops_within_one_step", "test_progress_once_per_step_and_monotone",
               "test_batched_run_equals_solo_runs",
               "test_cancelling_one_of_a_batch_leaves_the_other_equal_to_its_solo_run",
               "test_forced_attention_backend_is_used")
    for _cls in (TestBatchLeak, TestWrongRows, TestClaimsAttention):  # run only the runtime checks
        for _name in dir(ModelPluginConformance):
            if _name.startswith("test_") and _name not in RUNTIME:
                setattr(_cls, _name, None)
"""


@pytest.mark.slow
def test_runtime_checks_fail_each_broken_model(pytester: pytest.Pytester) -> None:
    outcomes = run_inner(pytester, BROKEN_MODELS, BROKEN_MODEL_TESTS)
    # rows of a batch influence each other: both batching checks fail, the solo ones pass
    assert failing(outcomes, "test_inner.py::TestBatchLeak") == {
        "test_batched_run_equals_solo_runs", "test_cancelling_one_of_a_batch_leaves_the_other_equal_to_its_solo_run"}
    # shrinking a batch to the wrong rows on cancellation: only the survivor check notices
    assert failing(outcomes, "test_inner.py::TestWrongRows") == {
        "test_cancelling_one_of_a_batch_leaves_the_other_equal_to_its_solo_run"}
    # claiming to honour the attention backend without calling it
    assert failing(outcomes, "test_inner.py::TestClaimsAttention") == {"test_forced_attention_backend_is_used"}
    for name in ("test_progress_once_per_step_and_monotone", "test_cancellation_mid_run_stops_within_one_step"):
        assert outcomes[f"test_inner.py::TestClaimsAttention::{name}"] == "passed"
