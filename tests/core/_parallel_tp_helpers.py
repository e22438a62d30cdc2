"""Rank function of the 2-process gloo test of ``omnicore.parallel.tensor_parallel`` (spawned children import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups
from omnicore.parallel.tensor_parallel import (
    ShardRule,
    TensorParallelPlan,
    local_parameter_bytes,
    parallelize,
    read_sharded_state_dict,
    shard_module,
    sharded_parameter_bytes,
)
from torch import nn

HEADS, HEAD_DIM, HIDDEN, FFN = 4, 3, 8, 6

PLAN = TensorParallelPlan(
    rules=(ShardRule("attn.qkv", "column", chunks=3), ShardRule("attn.out", "row"),
           ShardRule("mlp.fc1", "column", chunks=2), ShardRule("mlp.fc2", "row")),
    divisors=(("attention heads", HEADS), ("FFN width", FFN)))


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM, bias=True)
        self.out = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.heads, HEAD_DIM).unbind(1)
        w = torch.softmax(torch.einsum("thd,shd->hts", q, k), dim=-1)
        return self.out(torch.einsum("hts,shd->thd", w, v).reshape(t, -1))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ffn = FFN
        self.fc1 = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.fc2 = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).split(self.ffn, dim=-1)
        return self.fc2(nn.functional.silu(gate) * up)


class Block(nn.Module):
    """A transformer block in miniature: fused [Q; K; V] heads, a [gate | up] SwiGLU, a replicated norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = Attn()
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(self.norm(x))


def tp_rank(rank: int, init_file: str, checkpoint: str) -> None:
    """Rank ``rank`` of tp=2: read its shard of ``checkpoint``, parallelize, compare with the full block."""
    from safetensors.torch import load_file

    config = ParallelConfig(tp=2)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(config, rank)
        assert ctx.tp_rank == rank and ctx.tp_mesh is not None
        full = Block()
        full.load_state_dict(load_file(checkpoint))
        torch.manual_seed(1)
        x = torch.randn(5, HIDDEN)
        with torch.no_grad():
            expected = full(x)
        state, nbytes = read_sharded_state_dict(checkpoint.rsplit("/", 1)[0], PLAN, rank=rank, degree=2,
                                                plugin="test")
        with torch.device("meta"):
            block = Block()
        shard_module(block, PLAN, rank=rank, degree=2)
        block.load_state_dict(state, assign=True)
        block.attn.heads, block.mlp.ffn = HEADS // 2, FFN // 2  # the model's own size attributes
        parallelize(block, PLAN, ctx.tp_mesh)
        with torch.no_grad():
            got = block(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        resident = local_parameter_bytes(block)
        with torch.device("meta"):
            analytic = sharded_parameter_bytes(Block(), PLAN, 2)
        assert resident == analytic == nbytes, (resident, analytic, nbytes)
        full_bytes = sum(p.numel() * 4 for p in full.parameters())
        sharded = sum(p.numel() * 4 for n, p in full.named_parameters() if not n.startswith("norm")
                      and n != "attn.out.bias")
        assert resident == full_bytes - sharded // 2, (resident, full_bytes, sharded)
    finally:
        dist.destroy_process_group()
