"""Rank function of the 2-process gloo test of ``omnicore.parallel.host_text_encoder.shared_encode`` (spawned
children import it by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups
from omnicore.parallel.host_text_encoder import SharedEncodeFailed, shared_encode


def _rows() -> list[torch.Tensor]:
    """What the driver's encoder computes: bf16 rows, int64 tags, a float32 scalar (the same seed everywhere, so
    each rank can check what it received against its own copy)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randn(7, 5, generator=g).to(torch.bfloat16), torch.arange(7) % 2, torch.tensor(0.25)]


def shared_encode_rank(rank: int, init_file: str) -> None:
    """Rank 0 encodes, rank 1 passes ``compute=None`` and receives the same tensors (dtype, shape and bits); a
    failing encode on rank 0 raises its own error there and ``SharedEncodeFailed`` on rank 1; the group stays
    usable afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(ParallelConfig(ulysses=2), rank)
        calls: list[int] = []

        def compute() -> list[torch.Tensor]:
            calls.append(rank)
            return _rows()

        got = shared_encode(ctx, compute if rank == 0 else None, device="cpu")
        assert calls == ([0] if rank == 0 else []), calls
        expected = _rows()
        assert [t.dtype for t in got] == [t.dtype for t in expected]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        sent = ctx.stats.snapshot()["sent_bytes"].get("encode_broadcast", 0)
        assert sent == (sum(t.numel() * t.element_size() for t in expected) if rank == 0 else 0), sent

        def failing() -> list[torch.Tensor]:
            raise KeyError("bad image")

        try:
            shared_encode(ctx, failing if rank == 0 else None, device="cpu")
        except KeyError:
            assert rank == 0
        except SharedEncodeFailed:
            assert rank == 1
        else:
            raise AssertionError("a failing encode must raise on every rank")
        again = shared_encode(ctx, compute if rank == 0 else None, device="cpu")  # still in step
        assert torch.equal(again[0], expected[0])
    finally:
        dist.destroy_process_group()
