"""``omnicore.parallel``: the ``--parallel`` setting, the model checks before any process starts, the platform's
collective backend, and (2 gloo processes, slow) the Ulysses and CFG collectives against single-process results."""

from __future__ import annotations

from pathlib import Path

import pytest
from omnicore.errors import ConfigError, UnsupportedFeature
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.launch import check_parallel
from omnicore.parallel.ulysses import SequenceShard, check_heads, padded_length
from omnicore.platforms.base import Platform
from omnicore.platforms.cpu import CpuPlatform
from omnicore.specs import ModelCapabilities, ModelSpec


def test_parse_degrees_and_rank_grid() -> None:
    c = ParallelConfig.parse("cfg=2, ulysses=2")
    assert (c.cfg, c.ulysses, c.world_size, c.dims(), str(c)) == (2, 2, 4, ("cfg", "ulysses"), "cfg=2,ulysses=2")
    assert [c.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # ulysses fastest
    assert c.cfg_peers(1) == [1, 3] and c.ulysses_peers(3) == [2, 3]
    assert not ParallelConfig.parse(None).enabled and not ParallelConfig.parse("none").enabled
    assert ParallelConfig.parse({"ulysses": 4}) == ParallelConfig(ulysses=4)


@pytest.mark.parametrize("text, why", [("pp=2", "DIM=N"), ("cfg=3", "cfg must be 1 or 2"), ("ulysses=0", "positive"),
                                       ("ulysses=x", "integer degree"), ("cfg=2,cfg=2", "twice"), ("cfg", "DIM=N")])
def test_bad_parallel_settings_name_the_setting(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        ParallelConfig.parse(text)
    assert info.value.name == "parallel"


def _spec(parallel: tuple[str, ...]) -> ModelSpec:
    return ModelSpec(name="m", impl="x:y", capabilities=ModelCapabilities(parallel=parallel))


def test_model_must_declare_each_dimension_and_caches_are_allowed() -> None:
    check_parallel(ParallelConfig(cfg=2, ulysses=2), _spec(("cfg", "ulysses")))
    with pytest.raises(UnsupportedFeature, match=r"does not implement ulysses.*declares: cfg"):
        check_parallel(ParallelConfig(cfg=2, ulysses=2), _spec(("cfg",)))
    check_parallel(ParallelConfig(cfg=2), _spec(("cfg",)), ["first_block_cache"])  # every rank runs the caches


def test_heads_the_degree_does_not_divide_are_a_config_error() -> None:
    check_heads(8, 2, kv_heads=2)
    with pytest.raises(ConfigError, match=r"ulysses=3 must divide the model's attention heads \(8\)"):
        check_heads(8, 3)
    with pytest.raises(ConfigError, match=r"key/value heads \(2\)"):  # GQA: the K/V heads are split too
        check_heads(8, 4, kv_heads=2)


def test_sequence_shard_rows_and_document_pieces() -> None:
    assert padded_length(13, 2) == 14 and padded_length(12, 4) == 12
    cu = (0, 5, 6, 13)
    first, second = SequenceShard(14, 0, 2), SequenceShard(14, 1, 2)
    assert (first.start, first.end, second.start, second.end) == (0, 7, 7, 14)
    assert first.pieces(cu) == [(0, 0, 5), (1, 5, 6), (2, 6, 7)]
    assert second.pieces(cu) == [(2, 0, 6)]  # rows 7..12 of document 2; row 13 is padding
    with pytest.raises(ValueError, match="evenly"):
        SequenceShard(13, 0, 2)


def test_platform_names_its_collective_backend() -> None:
    class Cuda(Platform):
        device_type = "cuda"

    class Npu(Platform):
        device_type = "npu"

    assert (CpuPlatform().dist_backend(), Cuda().dist_backend(), Npu().dist_backend()) == ("gloo", "nccl", "hccl")


@pytest.mark.slow
@pytest.mark.parametrize("dims", ["ulysses=2", "cfg=2"])
def test_collectives_match_single_process_on_gloo(tmp_path: Path, dims: str) -> None:
    import torch.multiprocessing as mp
    from _parallel_helpers import collectives_rank

    mp.spawn(collectives_rank, args=(str(tmp_path / "rendezvous"), dims), nprocs=2, join=True)


def test_engine_refuses_parallel_for_a_model_that_does_not_declare_it_before_any_process_starts(toy_host) -> None:
    import multiprocessing

    from omnicore.engine.api import Engine

    with pytest.raises(UnsupportedFeature, match=r"does not implement cfg parallelism") as info:
        Engine("tiny:toy", host=toy_host, parallel="cfg=2")
    assert info.value.feature == "parallel"
    assert multiprocessing.active_children() == []
    with pytest.raises(ConfigError, match="DIM=N"):
        Engine("tiny:toy", host=toy_host, parallel="pipeline=2")


@pytest.mark.slow  # spawned processes with torch: > 10 s on a busy host
@pytest.mark.parametrize("dims", ["ulysses=2", "cfg=2"])
def test_cache_criteria_agree_over_the_group(tmp_path: Path, dims: str) -> None:
    """The relative L1 summed over a Ulysses group equals the full tensors' (each CFG rank keeps its branch's);
    rank 0's flag reaches every rank."""
    import torch.multiprocessing as mp
    from _parallel_cache_helpers import consensus_rank

    mp.spawn(consensus_rank, args=(str(tmp_path / "rendezvous"), dims), nprocs=2, join=True)
