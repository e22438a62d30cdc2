"""A forced attention backend (``--attention-backend``) never passes silently: refused for a model that declares it
picks its own attention, and a warning when a model that claims to honour it asked for none while loading."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import pytest
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.errors import UnsupportedFeature
from omnicore.specs import AttentionRequirement
from toy import ToyPipeline, toy_host
from toy.plugin import TOY_SPEC, ToyPlugin


class AskingToy(ToyPipeline):
    """The toy, but it asks for an attention backend while loading (as a real DiT does)."""

    chosen: Any = None

    @classmethod
    def from_pretrained(cls, path: Any, options: Any) -> AskingToy:
        pipe = super().from_pretrained(path, options)
        pipe.chosen = options.attention(AttentionRequirement(platform=options.platform.name, head_dim=16))
        return pipe


def _spec(honours: bool, impl: str = TOY_SPEC.impl) -> Any:
    return attrs.evolve(TOY_SPEC, impl=impl, capabilities=attrs.evolve(TOY_SPEC.capabilities,
                                                                       honours_attention_backend=honours))


def _engine(tmp_path: Any, spec: Any, forced: str | None) -> Engine:
    settings = Settings(cache_dir=str(tmp_path), attention_backend=forced)
    return Engine("tiny:toy", host=toy_host(settings, plugin=ToyPlugin(spec)), settings=settings)


def test_forcing_a_backend_on_a_model_that_picks_its_own_is_refused(tmp_path: Any) -> None:
    with pytest.raises(UnsupportedFeature) as info:
        _engine(tmp_path, _spec(False), "sdpa")
    assert info.value.feature == "attention_backend" and "toy" in info.value.reason
    _engine(tmp_path, _spec(False), None).close()  # without forcing, the same model loads


def test_a_model_that_asks_for_no_backend_while_loading_gets_a_warning(tmp_path: Any, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="omnicore.engine"):
        _engine(tmp_path, _spec(True), "sdpa").close()
    assert any("asked for no attention backend" in r.getMessage() for r in caplog.records)


def test_a_model_that_asks_gets_the_forced_backend_and_no_warning(tmp_path: Any, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="omnicore.engine"):
        engine = _engine(tmp_path, _spec(True, impl="test_engine_attention_choice:AskingToy"), "sdpa")
    try:
        from omnicore.attention.reference import sdpa_attention

        assert engine.pipeline.chosen is sdpa_attention
    finally:
        engine.close()
    assert not any("asked for no attention backend" in r.getMessage() for r in caplog.records)
