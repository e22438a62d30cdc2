"""``text_encoder_offload=cpu`` in the core: the option's reading, ``shared_encode`` on one process and over two
gloo ranks, and the planner taking the text encoder off every rank's device bytes (``host_components``)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from omnicore.parallel.host_text_encoder import (  # noqa: E402
    TEXT_ENCODER_OFFLOAD_OPTION,
    holds_text_encoder,
    shared_encode,
    text_encoder_on_host,
)
from omnicore.planning.estimate import host_components  # noqa: E402


class _Ctx:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def test_the_option_and_who_holds_the_encoder() -> None:
    assert TEXT_ENCODER_OFFLOAD_OPTION.default == "none" and TEXT_ENCODER_OFFLOAD_OPTION.choices == ("none", "cpu")
    assert not text_encoder_on_host(None) and not text_encoder_on_host({"text_encoder_offload": "none"})
    assert text_encoder_on_host({"text_encoder_offload": "cpu"})
    cpu = {"text_encoder_offload": "cpu"}
    assert holds_text_encoder(None, cpu) and holds_text_encoder(_Ctx(0, 4), cpu)
    assert not holds_text_encoder(_Ctx(3, 4), cpu)
    assert holds_text_encoder(_Ctx(3, 4), {})  # resident: every rank holds its copy (or its TP shard)


def test_one_process_computes_and_moves_to_the_device() -> None:
    rows = torch.randn(3, 4, dtype=torch.bfloat16)
    [got] = shared_encode(None, lambda: [rows], device="cpu")
    assert torch.equal(got, rows)
    with pytest.raises(ValueError, match="must compute"):
        shared_encode(None, None, device="cpu")


def test_host_components_follow_the_option_and_the_platform() -> None:
    profile = {"text_encoder": "text_encoder"}
    cpu = {"text_encoder_offload": "cpu"}
    assert host_components(profile, cpu) == ("text_encoder",)
    assert host_components(profile, cpu, "cuda") == ("text_encoder",)
    assert host_components(profile, cpu, "cpu") == ()  # the CPU "device" is host memory: nothing leaves it
    assert host_components(profile, {"text_encoder_offload": "none"}) == ()
    assert host_components({}, cpu) == ()  # a model that names no separable text encoder


@pytest.mark.slow  # two spawned processes importing torch: ~10 s on a busy host
def test_rank0_encodes_and_every_rank_receives_the_same_tensors(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from _text_encoder_offload_helpers import shared_encode_rank

    mp.spawn(shared_encode_rank, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)
