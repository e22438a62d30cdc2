"""MiniMax-H3 publishes ``laser_input_scale = 256`` through ``AttentionMetadata`` (a declared, validated field), and
the ``npu_laser`` path (CPU op seam) really pre-scales: every laser call gets the softmax scale times 256**2 and
inputs divided by 256, and the denoised latents still equal the ``sdpa`` ones."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _npu_helpers import OPS, npu_laser_on_cpu
from omnicore.attention.metadata import AttentionMetadata
from omnicore.attention.reference import sdpa_attention
from omnicore.engine.protocol import LoadOptions
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.platforms.cpu import CpuPlatform


class Recorder:
    """The attention handed to the model: the selected backend, with the metadata of every call kept."""

    def __init__(self) -> None:
        self.backend: Any = sdpa_attention
        self.metadata: list[Any] = []
        self.queries: list[torch.Tensor] = []

    def select(self, requirement: Any) -> Any:
        return self

    def __call__(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        self.metadata.append(kwargs.get("metadata"))
        self.queries.append(q)
        return self.backend(q, k, v, **kwargs)


def test_metadata_declares_and_checks_laser_input_scale() -> None:
    md = AttentionMetadata(cu_seqlens_q=(0, 5, 8), laser_input_scale=256)
    assert md.laser_input_scale == 256.0 and AttentionMetadata(cu_seqlens_q=(0, 8)).laser_input_scale is None
    for bad in ("256", True, 0, -2.0):
        with pytest.raises(ValueError, match="laser_input_scale must be a positive number"):
            AttentionMetadata(cu_seqlens_q=(0, 8), laser_input_scale=bad)


def test_minimax_h3_documents_publish_the_laser_input_scale() -> None:
    from omni_minimax_h3.transformer.attention import Documents

    docs = Documents([0, 5, 8], torch.device("cpu"), valid_kv_length=5)
    assert docs.metadata.laser_input_scale == 256 and docs.metadata.valid_kv_length == 5


@pytest.mark.slow
@torch.no_grad()
def test_minimax_h3_through_npu_laser_runs_prescaled_and_matches_sdpa(tmp_path_factory) -> None:
    from omni_minimax_h3.pipeline import MiniMaxH3Pipeline
    from omni_minimax_h3.presets import build_tiny_fl2va

    rec = Recorder()
    path = build_tiny_fl2va(tmp_path_factory.mktemp("tiny-h3-laser"))
    pipe = MiniMaxH3Pipeline.from_pretrained(path, LoadOptions(platform=CpuPlatform(), attention=rec.select))
    req = GenerationRequest("rain on a tin roof", SamplingParams(num_inference_steps=1, seed=3, duration=4.0),
                            extra={"aspect_ratio": "16:9"})

    def denoise() -> Any:
        state = pipe.encode([pipe.preprocess(req)])
        state = pipe.denoise_step(state, 0)
        return state.latents

    want = denoise()
    assert rec.metadata and all(m.laser_input_scale == 256 for m in rec.metadata)
    rec.backend, rec.metadata, rec.queries = npu_laser_on_cpu, [], []
    OPS.calls.clear()
    got = denoise()
    laser = [c for c in OPS.calls if c.kwargs.get("op_type") == "ascend_laser_attention"]
    OPS.calls.clear()
    assert laser, "no call took the laser path"
    head_dim = laser[0].query.shape[-1]
    for call in laser:
        assert call.kwargs["scale"] == pytest.approx(256.0 ** 2 / math.sqrt(head_dim), rel=1e-12)
    # the first laser call's query is the model's query divided by 256 (exact: a power of two)
    first = next(q for q in rec.queries if q.shape == laser[0].query.shape[1:])
    torch.testing.assert_close(laser[0].query[0], first / 256, rtol=0, atol=0)
    for g, w in zip(got if isinstance(got, (list, tuple)) else [got], want if isinstance(want, (list, tuple))
                    else [want]):
        if isinstance(w, dict):
            for key in w:
                torch.testing.assert_close(g[key], w[key], atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
