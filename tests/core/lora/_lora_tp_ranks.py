"""Rank function of the 2-process gloo test of LoRA under tensor parallelism (spawned children import it by name):
a toy block of column- and row-parallel linears, with and without bias, through omnicore's own TP plan code."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 16
TARGETS = ("up", "down", "gate", "proj")


class Block(nn.Module):
    """``up`` column (bias) -> ``down`` row (bias: DTensor reduces inside the linear); ``gate`` column in two fused
    parts (no bias) -> ``proj`` row (no bias: the output stays a partial sum until DTensor's output hook)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)
        self.gate = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.proj = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.tanh(self.up(x)))
        g = self.gate(x)
        half = g.shape[-1] // 2
        return x + self.proj(torch.tanh(g[..., :half]) * g[..., half:])


class Holder:
    def __init__(self, model: nn.Module) -> None:
        self.transformer = model


def plan() -> object:
    from omnicore.parallel.tensor_parallel import ShardRule, TensorParallelPlan

    return TensorParallelPlan((ShardRule("up", "column"), ShardRule("down", "row"),
                               ShardRule("gate", "column", chunks=2), ShardRule("proj", "row")))


def run(model: nn.Module, root: Path, requests: list[object]) -> torch.Tensor:
    """The model's outputs on a fixed input of one sample per request, with those requests' adapters active, as
    ``[B, L, H]`` samples and as the same rows packed ``[T, H]``."""
    from omnicore.lora import AdapterRegistry, LoRATargets, packed_rows
    from omnicore.lora.runtime import LoRARuntime
    from omnicore.ops.table import PlatformOps
    from omnicore.specs import ModelSpec

    spec = ModelSpec(name="toy-tp", impl="x:y", lora=LoRATargets(modules=TARGETS))
    runtime = LoRARuntime(AdapterRegistry(lora_dirs=[root]), spec, Holder(model), PlatformOps("cpu"))
    x = torch.randn(len(requests), 3, HIDDEN, generator=torch.Generator().manual_seed(1))
    runtime.activate(requests)  # type: ignore[arg-type]
    with torch.inference_mode():
        batched = model(x)  # [B, L, H]: DTensor leaves a row layer's output a partial sum, bias or not
        # packed [T, H] rows: a row layer with a bias sums its output inside the linear (addmm)
        with packed_rows([3 * (i + 1) for i in range(len(requests))], 3 * len(requests)):
            packed = model(x.reshape(-1, HIDDEN)).reshape(x.shape)
    runtime.remove()
    return torch.stack([batched, packed])


def tp_rank(rank: int, init_file: str, root: str, out_dir: str) -> None:
    """Shard the toy block over 2 ranks, run the mixed batch; rank 0 writes its output."""
    from omnicore.engine.request import GenerationRequest
    from omnicore.parallel.config import ParallelConfig
    from omnicore.parallel.context import build_groups
    from omnicore.parallel.tensor_parallel import parallelize, shard_module

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(ParallelConfig(tp=2), rank)
        model = Block()
        shard_module(model, plan(), rank=ctx.tp_rank, degree=2)  # type: ignore[arg-type]
        parallelize(model, plan(), ctx.tp_mesh)  # type: ignore[arg-type]
        requests = [GenerationRequest("x", loras=loras) for loras in batch()]
        out = run(model, Path(root), requests)
        if rank == 0:
            torch.save({"out": out}, Path(out_dir) / "rank0.pt")
    finally:
        dist.destroy_process_group()


def batch() -> list[list[object]]:
    from omnicore.lora import LoRA

    return [[LoRA("a")], [], [LoRA("b", 0.5)], [LoRA("a", 0.7), LoRA("b")]]
