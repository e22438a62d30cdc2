"""LoRA under tensor parallelism (2 gloo processes): adapters sharded like their base linears give the unsharded
model's output for a mixed batch — column-parallel linears (one part, and two fused parts) with and without bias,
row-parallel ones whose DTensor output is already summed (a bias) or still a partial sum (no bias) — and the
target map checks adapters against the full linears while each rank uploads only its share."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from _lora_helpers import make_peft_adapter
from _lora_tp_ranks import TARGETS, Block, batch, run, tp_rank


@pytest.mark.slow
def test_a_mixed_batch_under_tp_2_equals_the_unsharded_model(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from omnicore.engine.request import GenerationRequest

    root = tmp_path / "loras"
    make_peft_adapter(Block(), TARGETS, root / "a", rank=4, seed=1, std=0.2)
    make_peft_adapter(Block(), TARGETS[1:], root / "b", rank=6, seed=2, std=0.2)
    want = run(Block(), root, [GenerationRequest("x", loras=loras) for loras in batch()])
    plain = run(Block(), root, [GenerationRequest("x") for _ in batch()])
    assert (want - plain).abs().max() > 1e-2  # the adapters change every adapted row
    mp.start_processes(tp_rank, args=(str(tmp_path / "init"), str(root), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    got = torch.load(tmp_path / "rank0.pt")["out"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert multiprocessing.active_children() == []


def test_the_target_map_keeps_the_full_shapes_and_each_rank_its_share() -> None:
    """On the meta device (no process group): a sharded linear's adapter is checked against the full linear, and
    the device copy holds the rank's rows of B (column) or columns of A (row)."""
    from _lora_tp_ranks import plan
    from omnicore.lora import LoRATargets, TargetMap
    from omnicore.lora.registry import _local_share
    from omnicore.parallel.tensor_parallel import shard_module

    model = Block()
    shard_module(model, plan(), rank=1, degree=2)  # type: ignore[arg-type]
    tmap = TargetMap.build(model, LoRATargets(modules=TARGETS), "toy-tp")
    assert tmap.shapes["up"] == (16, 64) and model.up.out_features == 32
    assert tmap.shards["up"] == ("column", ((32, 64),))
    assert tmap.shards["gate"] == ("column", ((16, 32), (48, 64)))  # each fused part split on its own
    assert tmap.shards["down"] == ("row", ((32, 64),))
    a, b = torch.arange(2 * 64.0).reshape(2, 64), torch.arange(64 * 2.0).reshape(64, 2)
    a_gate, b_gate = _local_share(a[:, :16], b, tmap.shards["gate"])
    assert torch.equal(b_gate, torch.cat([b[16:32], b[48:64]])) and torch.equal(a_gate, a[:, :16])
    a_down, b_down = _local_share(a, b[:16], tmap.shards["down"])
    assert torch.equal(a_down, a[:, 32:]) and torch.equal(b_down, b[:16])
