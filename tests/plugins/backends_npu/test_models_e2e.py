"""LingBot and MiniMax-H3 tiny presets end to end through npu_varlen and npu_laser on the CPU op seam: the final
latents match the core sdpa backend within fp32 tolerance (the models publish correct packed metadata, and the
[real | pad] resolution never mistakes a real document for padding), and the packed ops were really used."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from _npu_helpers import OPS, npu_laser_on_cpu, npu_varlen_on_cpu
from omnicore.attention.reference import sdpa_attention
from omnicore.engine.protocol import LoadOptions
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.platforms.cpu import CpuPlatform

BACKENDS = {"sdpa": sdpa_attention, "npu_varlen": npu_varlen_on_cpu, "npu_laser": npu_laser_on_cpu}


class Switch:
    """The attention function handed to the model: forwards to whichever backend the test selected."""

    def __init__(self) -> None:
        self.backend = "sdpa"
        self.requirements: list[Any] = []

    def select(self, requirement: Any) -> Any:
        self.requirements.append(requirement)
        return self

    def __call__(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        return BACKENDS[self.backend](q, k, v, **kwargs)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in _tensors(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _denoise(pipe: Any, *requests: GenerationRequest) -> list[torch.Tensor]:
    prepared = [pipe.preprocess(r) for r in requests]
    state = pipe.encode(prepared)
    for step in range(state.num_steps):
        state = pipe.denoise_step(state, step)
    latents = _tensors(state.latents)
    assert latents, "the pipeline state holds no latent tensors"
    return [t.detach().clone() for t in latents]


def _compare(pipe: Any, switch: Switch, backend: str, *requests: GenerationRequest) -> Counter:
    switch.backend = "sdpa"
    want = _denoise(pipe, *requests)
    switch.backend = backend
    OPS.calls.clear()
    got = _denoise(pipe, *requests)
    ops = Counter(c.kwargs.get("op_type", c.op) for c in OPS.calls)
    OPS.calls.clear()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    return ops


# ---------------------------------------------------------------------------------------------- LingBot
@pytest.fixture(scope="module")
def lingbot(tmp_path_factory):
    from omni_lingbot.pipeline import LingBotPipeline
    from omni_lingbot.presets import build_tiny_lingbot

    switch = Switch()
    path = build_tiny_lingbot(tmp_path_factory.mktemp("tiny-lingbot-npu"))
    pipe = LingBotPipeline.from_pretrained(path, LoadOptions(platform=CpuPlatform(), attention=switch.select))
    assert switch.requirements and all(r.packed_varlen for r in switch.requirements)
    return pipe, switch


def _lingbot_request(batch_cfg: bool) -> GenerationRequest:
    params = SamplingParams(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=2.0, seed=5)
    return GenerationRequest("a red fox", params, modalities=("video",), extra={"batch_cfg": batch_cfg})


@pytest.mark.parametrize("backend", ["npu_varlen", "npu_laser"])
def test_lingbot_single_documents_take_the_packed_op(lingbot, backend):
    pipe, switch = lingbot
    ops = _compare(pipe, switch, backend, _lingbot_request(batch_cfg=False))
    packed = "varlen_attention" if backend == "npu_varlen" else "ascend_laser_attention"
    assert ops[packed] > 0 and ops["fused_attn_score"] == 0, ops


@pytest.mark.parametrize("backend", ["npu_varlen", "npu_laser"])
def test_lingbot_batch_cfg_two_real_documents(lingbot, backend):
    """cu = [0, a, b] with both documents real: never read as [real | pad] (npu_varlen passes both documents to
    the varlen op, npu_laser masks); same latents."""
    pipe, switch = lingbot
    ops = _compare(pipe, switch, backend, _lingbot_request(batch_cfg=True))
    assert ops["ascend_laser_attention"] == 0, ops
    if backend == "npu_varlen":
        assert ops["varlen_attention"] > 0 and ops["fused_attn_score"] == 0, ops
    else:
        assert ops["fused_attn_score"] > 0 and ops["varlen_attention"] == 0, ops


# ---------------------------------------------------------------------------------------------- MiniMax-H3
@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    from omni_minimax_h3.pipeline import MiniMaxH3Pipeline
    from omni_minimax_h3.presets import build_tiny_fl2va

    switch = Switch()
    path = build_tiny_fl2va(tmp_path_factory.mktemp("tiny-h3-npu"))
    pipe = MiniMaxH3Pipeline.from_pretrained(path, LoadOptions(platform=CpuPlatform(), attention=switch.select))
    assert switch.requirements and all(r.packed_varlen and r.packed_mask_free for r in switch.requirements)
    return pipe, switch


def _h3_request(seed: int = 7, duration: float = 4.0) -> GenerationRequest:
    return GenerationRequest("rain on a tin roof", SamplingParams(num_inference_steps=2, seed=seed,
                                                                  duration=duration),
                             extra={"aspect_ratio": "16:9"})


@pytest.mark.parametrize("backend", ["npu_varlen", "npu_laser"])
def test_minimax_h3_single_request(h3, backend):
    pipe, switch = h3
    ops = _compare(pipe, switch, backend, _h3_request())
    packed = "varlen_attention" if backend == "npu_varlen" else "ascend_laser_attention"
    assert ops[packed] > 0, ops


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["npu_varlen", "npu_laser"])
def test_minimax_h3_packed_batch_of_two_requests(h3, backend):
    pipe, switch = h3
    ops = _compare(pipe, switch, backend, _h3_request(seed=7), _h3_request(seed=8, duration=5.0))
    assert ops["varlen_attention" if backend == "npu_varlen" else "fused_attn_score"] > 0, ops
