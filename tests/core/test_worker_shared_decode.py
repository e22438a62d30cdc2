"""A worker rank taking part in a shared (parallel) VAE decode sets the VAE fast-path gate as rank 0's runner does
for the batch: a ``quality="high"`` batch's tiles all take the fast ops, any other batch's none (before, only rank 0
turned the gate on, so a high-quality image mixed fast-path tiles from rank 0 with exact ones from the others)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omnicore.parallel.worker import _Batch, _serve
from omnicore.vae_fast_paths import fast_path_gate
from torch import nn


class _Pipeline:
    def __init__(self) -> None:
        self.vae = nn.Module()
        self.gate = fast_path_gate(self.vae)
        self.seen: list[bool] = []

    def decode(self, state: object) -> list[object]:
        self.seen.append(self.gate.enabled)
        return []


@pytest.mark.parametrize(("qualities", "fast"), [(["high", "high"], True), (["standard"], False),
                                                 (["high", "standard"], False)])
def test_the_worker_decode_uses_the_batch_gate(qualities, fast):
    pipe = _Pipeline()
    batch = _Batch(state=object(), requests=[SimpleNamespace(quality=q) for q in qualities])
    _serve(("decode", True), batch, None, pipe, None, None, 1.0, lambda text: None)  # type: ignore[arg-type]
    assert pipe.seen == [fast] and pipe.gate.enabled is False  # on for the decode only


def test_a_decode_rank_0_keeps_to_itself_runs_nothing_here():
    pipe = _Pipeline()
    _serve(("decode", False), _Batch(state=object(), requests=[SimpleNamespace(quality="high")]), None, pipe, None,
           None, 1.0, lambda text: None)  # type: ignore[arg-type]
    assert pipe.seen == []
