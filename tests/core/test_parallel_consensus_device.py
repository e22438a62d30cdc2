"""The cache consensus collectives (``omnicore.parallel.consensus``) put their tensors on the process group's device:
NCCL and HCCL reduce device tensors only, so a CPU tensor there would fail every cached step under ``--parallel``.
No accelerator here: the group's device is stood in by the meta device and the collective by a recorder, which is
enough to see where the tensors are built (the real gloo path runs in test_parallel.py; NCCL is unverified)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from omnicore.parallel import collectives, consensus
from omnicore.parallel.context import CommStats


class _Stop(Exception):
    pass


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    seen: list[torch.device] = []

    def collective(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        seen.append(tensor.device)
        raise _Stop  # a meta tensor holds no value to read back

    monkeypatch.setattr(collectives, "group_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", collective)
    monkeypatch.setattr(dist, "broadcast", collective)
    return seen


def _ctx(cfg: int = 1) -> Any:
    return SimpleNamespace(cfg=cfg, cfg_rank=0, stats=CommStats(), world_size=2)


def test_agreed_relative_l1_reduces_on_the_group_device(recorded: list[torch.device]) -> None:
    with pytest.raises(_Stop):
        consensus.agreed_relative_l1(torch.ones(4), torch.zeros(4), _ctx(cfg=2))
    assert recorded == [torch.device("meta")]


def test_rank0_flag_broadcasts_on_the_group_device(recorded: list[torch.device]) -> None:
    with pytest.raises(_Stop):
        consensus.rank0_flag(True, _ctx())
    assert recorded == [torch.device("meta")]


@pytest.mark.parametrize(("backend", "expected"), [("gloo", "cpu"), ("nccl", "cuda:0"), ("mpi", "cpu")])
def test_the_group_device_follows_the_backend(monkeypatch: pytest.MonkeyPatch, backend: str, expected: str) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert collectives.group_device() == torch.device(expected)
