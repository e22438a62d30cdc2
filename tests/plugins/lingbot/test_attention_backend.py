"""The DiT runs on the attention backend the engine selects, asked for with a requirement that
declares ``packed_varlen``; it calls it with ``cu_seqlens`` documents and never with a mask, and batch CFG is one
call per block over both documents."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _lingbot_helpers import ATTENTION_CALLS, request, run
from omnicore import hookimpl
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.specs import AttentionBackendSpec, AttentionCapabilities
from omnicore.testing.plugin import add_to_host, isolated_host

PROMPT = "a red fox"
PARAMS = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 2.0, "seed": 5}


class RecordingBackends:
    """Registers a higher-priority backend that cannot do packed documents and a packed one that records its
    calls; remembers every requirement the host is asked to serve."""

    def __init__(self) -> None:
        self.requirements: list[Any] = []

    @hookimpl
    def omnicore_register_attention_backends(self, register: Any) -> None:
        register(AttentionBackendSpec(name="dense_only", impl="_lingbot_helpers:unusable_attention", priority=200,
                                      capabilities=AttentionCapabilities(platforms=("cpu",))))
        register(AttentionBackendSpec(name="recording_packed", impl="_lingbot_helpers:recording_attention",
                                      priority=100, capabilities=AttentionCapabilities(
                                          platforms=("cpu",), packed_varlen=True, packed_mask_free=True)))

    @hookimpl(tryfirst=True)
    def omnicore_attention_backend(self, requirement: Any, candidates: Any) -> None:
        self.requirements.append(requirement)  # observe only; the core's implementation chooses


@pytest.fixture(scope="module")
def engine_and_backends(tiny_dir, tmp_path_factory):
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("omnicore-cache")))
    host = isolated_host(settings)
    assert add_to_host(host, "omni_lingbot.plugin", "lingbot").status == "loaded"
    backends = RecordingBackends()
    host.add_plugin(backends, "recording-backends")
    engine = Engine(tiny_dir, host=host, settings=settings)
    try:
        yield engine, backends
    finally:
        engine.close()


def test_the_engine_selected_packed_backend_reaches_the_dit(engine_and_backends):
    engine, backends = engine_and_backends
    (requirement,) = backends.requirements
    assert requirement.packed_varlen and requirement.platform == "cpu"
    assert (requirement.head_dim, requirement.dtype) == (32, "float32")  # hidden 64 / 2 heads
    assert engine.pipeline.transformer.attention.__name__ == "recording_attention"


@pytest.mark.parametrize("batch_cfg", [False, True])
def test_attention_calls_are_packed_documents_without_a_mask(engine_and_backends, pipe, batch_cfg):
    engine, _ = engine_and_backends
    ATTENTION_CALLS.clear()
    (out,) = engine.generate(PROMPT, extra={"batch_cfg": batch_cfg}, **PARAMS)
    depth, steps = 2, PARAMS["num_inference_steps"]
    assert len(ATTENTION_CALLS) == depth * steps * (1 if batch_cfg else 2)
    for call in ATTENTION_CALLS:
        assert "attn_mask" not in call["keywords"] and call["cu_seqlens"] is not None
        assert call["cu_seqlens"][-1] == call["rows"]
        assert len(call["cu_seqlens"]) - 1 == (2 if batch_cfg else 1)  # [cond ; uncond] documents in one call
    # the recording backend is the reference math: same bytes as the pipeline on its built-in default
    _, (expected,) = run(pipe, request(PROMPT, extra={"batch_cfg": batch_cfg}, **PARAMS))
    assert np.array_equal(out.frames, expected.frames)
