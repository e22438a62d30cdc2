"""``--parallel tp=N``: the plan record (rules, divisibility, per-rank shapes and bytes on the meta device), the
shard-only checkpoint read, and (2 gloo processes) DTensor's Colwise/Rowwise parallel equal to the full module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _parallel_tp_helpers import FFN, HEADS, PLAN, Block
from omnicore.errors import ConfigError
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.tensor_parallel import (
    ShardRule,
    local_parameter_bytes,
    local_ranges,
    read_sharded_state_dict,
    shard_module,
    sharded_parameter_bytes,
)


def test_tp_is_a_dimension_and_the_grid_puts_it_innermost() -> None:
    c = ParallelConfig.parse("cfg=2,ulysses=2,tp=2")
    assert (c.world_size, c.dims(), str(c)) == (8, ("cfg", "ulysses", "tp"), "cfg=2,ulysses=2,tp=2")
    assert [c.grid(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert c.tp_peers(5) == [4, 5] and c.ulysses_peers(5) == [5, 7] and c.cfg_peers(3) == [3, 7]
    # tp=1 keeps the former cfg x ulysses layout
    assert [ParallelConfig(cfg=2, ulysses=2).coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_fused_chunks_split_each_part_and_bad_degrees_name_the_numbers() -> None:
    assert local_ranges(12, 3, 1, 2) == [(2, 4), (6, 8), (10, 12)]  # [Q1; K1; V1]
    PLAN.check(2)
    with pytest.raises(ConfigError, match=r"tp=3 must divide the model's attention heads \(4\)") as info:
        PLAN.check(3)
    assert info.value.name == "parallel"
    with pytest.raises(ConfigError, match=r"tp=4 must divide the model's FFN width \(6\)"):
        PLAN.check(4)
    with pytest.raises(ValueError, match="style"):
        ShardRule("x", "diagonal")
    # grouped-query [Q; K; V] of 4 query and 2 key/value heads (head_dim 3): rank 1's heads of each part
    assert local_ranges(24, (4, 2, 2), 1, 2) == [(6, 12), (15, 18), (21, 24)]
    with pytest.raises(ConfigError, match=r"tp=4 does not divide"):
        local_ranges(24, (4, 2, 2), 0, 4)  # a key/value part of 6 rows does not split 4 ways


def test_meta_module_shards_to_the_analytic_per_rank_bytes() -> None:
    with torch.device("meta"):
        block = Block()
    full = local_parameter_bytes(block)
    analytic = sharded_parameter_bytes(block, PLAN, 2)
    shard_module(block, PLAN, rank=1, degree=2)
    assert block.attn.qkv.weight.shape == (3 * HEADS // 2 * 3, 8) and block.attn.qkv.weight.is_meta
    assert block.attn.out.weight.shape == (8, HEADS // 2 * 3) and block.attn.out.bias.shape == (8,)
    assert block.mlp.fc1.weight.shape == (FFN, 8) and block.mlp.fc2.in_features == FFN // 2
    assert local_parameter_bytes(block) == analytic < full
    # bf16 pricing of an fp32 meta model
    with torch.device("meta"):
        assert sharded_parameter_bytes(Block(), PLAN, 2, dtype_bytes=lambda p: 2) * 2 == analytic


def test_sharded_read_takes_only_this_ranks_rows(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    block = Block()
    save_file({k: v.contiguous() for k, v in block.state_dict().items()}, str(tmp_path / "model.safetensors"))
    state, nbytes = read_sharded_state_dict(tmp_path, PLAN, rank=1, degree=2, plugin="test")
    w = block.attn.qkv.weight.detach()
    q, k, v = w.chunk(3)
    assert torch.equal(state["attn.qkv.weight"], torch.cat([q[6:], k[6:], v[6:]]))
    assert torch.equal(state["attn.out.weight"], block.attn.out.weight.detach()[:, 6:])
    assert torch.equal(state["attn.out.bias"], block.attn.out.bias.detach())  # a row layer's bias stays whole
    assert nbytes == sum(t.numel() * 4 for t in state.values()) < sum(p.numel() * 4 for p in block.parameters())


@pytest.mark.slow
def test_colwise_rowwise_dtensor_block_matches_the_full_block_on_gloo(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from _parallel_tp_helpers import tp_rank
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt" / "model.safetensors"
    ckpt.parent.mkdir()
    save_file({k: v.contiguous() for k, v in Block().state_dict().items()}, str(ckpt))
    mp.spawn(tp_rank, args=(str(tmp_path / "rendezvous"), str(ckpt)), nprocs=2, join=True)


def test_ep_sits_between_ulysses_and_tp_in_the_grid() -> None:
    c = ParallelConfig.parse("ulysses=2,ep=2,tp=2")
    assert c.world_size == 8 and c.dims() == ("ulysses", "tp", "ep")
    assert c.grid4(3) == (0, 0, 1, 1) and c.grid4(6) == (0, 1, 1, 0)
    assert c.tp_peers(3) == [2, 3] and c.ep_peers(3) == [1, 3] and c.ulysses_peers(3) == [3, 7]
    assert ParallelConfig(ep=2).ep_peers(1) == [0, 1]
