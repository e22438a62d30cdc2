"""``--parallel ep=N``: token dispatch/combine by all-to-all (2 gloo processes) equals the single-process expert
layer, the bytes counted are those the copies carry, and an expert count the degree does not divide is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from _parallel_ep_helpers import dispatch_rank
from omnicore.errors import ConfigError
from omnicore.parallel.experts import ExpertDispatch, check_dispatch, check_expert_degree, expert_bytes_per_layer


def test_expert_count_and_dispatch_mode_are_checked_naming_the_numbers() -> None:
    check_expert_degree(128, 8)
    with pytest.raises(ConfigError, match=r"ep=3 must divide the model's routed experts \(4\)") as info:
        check_expert_degree(4, 3)
    assert info.value.name == "parallel"
    with pytest.raises(ConfigError, match="ep_dispatch"):
        check_dispatch("broadcast")


def test_token_slices_cover_every_token_once() -> None:
    for tokens in (0, 1, 5, 8):
        parts = [ExpertDispatch(rank=r, degree=3, per_rank=1, group=None).token_slice(tokens) for r in range(3)]
        covered = [t for p in parts for t in range(p.start, p.stop)]
        assert covered == list(range(tokens))


def test_all_reduce_moves_fewer_bytes_than_dispatch_when_tokens_are_replicated() -> None:
    one = expert_bytes_per_layer(1000, 1, 2, 64, 2)
    eight = expert_bytes_per_layer(1000, 8, 2, 64, 2)
    assert eight["all_to_all"] > eight["all_reduce"] and eight["all_reduce"] == one["all_reduce"]


@pytest.mark.slow  # two spawned processes with torch: > 10 s on a busy 2-core host
def test_dispatch_over_two_gloo_ranks_equals_the_single_process_layer(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(dispatch_rank, args=(str(tmp_path / "rendezvous"), (7, 12, 1)), nprocs=2, join=True)  # uneven, even
