"""``omnicore serve --checkpoint-every K`` where it would silently do nothing is refused before listening, naming
the flag (step checkpoints are written and resumed by replicas sharing a PostgreSQL store, one model per server,
one process, for models that declare checkpointable step state)."""

from __future__ import annotations

import pytest
from omnicore.cli.serve_cmd import check_step_checkpoints
from omnicore.config import Settings
from omnicore.errors import ConfigError
from omnicore.parallel.config import ParallelConfig
from omnicore.specs import ModelCapabilities, ModelSpec

PG = "postgresql://omnicore@127.0.0.1:5432/jobs"


def _spec(checkpointable: bool) -> ModelSpec:
    capabilities = ModelCapabilities(checkpointable=checkpointable)
    return ModelSpec(name="m", impl="m.pipeline:Pipeline", capabilities=capabilities)


@pytest.mark.parametrize(("settings", "spec", "several", "parallel", "rule"), [
    (Settings(checkpoint_every=2), _spec(True), False, None, "needs a shared job store"),
    (Settings(checkpoint_every=2, store="sqlite"), _spec(True), False, None, "needs a shared job store"),
    (Settings(checkpoint_every=2, store=PG), None, True, None, "several models"),
    (Settings(checkpoint_every=2, store=PG), _spec(True), False, ParallelConfig.parse("cfg=2"), "--parallel"),
    (Settings(checkpoint_every=2, store=PG), _spec(False), False, None, "model m does not declare checkpointable"),
])
def test_where_checkpoints_cannot_take_effect_the_flag_is_refused(settings, spec, several, parallel, rule):
    with pytest.raises(ConfigError) as info:
        check_step_checkpoints(settings, spec, several=several, parallel=parallel)
    assert info.value.name == "--checkpoint-every" and rule in str(info.value)


@pytest.mark.parametrize("settings", [Settings(), Settings(checkpoint_every=3, store=PG)])
def test_off_or_a_shared_store_with_a_checkpointable_model_passes(settings):
    check_step_checkpoints(settings, _spec(True), several=False, parallel=None)
