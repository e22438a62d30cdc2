"""Rank function of the 2-process gloo test of MiniMax-H3's tensor-parallel Qwen3-VL text encoder (spawned children
import it by name)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups
from PIL import Image

PROMPT = "rain on a tin roof, then thunder far away"


def keyframe_image() -> Image.Image:
    """A 64 x 96 noise image (the vision tower and DeepStack run too when an item carries it)."""
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))


def encodings(encoder: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A text-only presentation and one with a labelled keyframe."""
    return [encoder.encode(PROMPT),  # type: ignore[attr-defined]
            encoder.encode(PROMPT, [("<Picture 1>: ", keyframe_image())])]  # type: ignore[attr-defined]


def h3_text_rank(rank: int, init_file: str, root: str, out_dir: str, layer: int) -> None:
    """Load this rank's shard of the text encoder (tp=2), join the shards, encode; write the rows, the bytes read
    and held, layer 0's query and key shards and the all-reduces run."""
    from omni_minimax_h3.text_encoder import H3TextEncoder
    from omnicore.plugin import local_parameter_bytes

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(ParallelConfig(tp=2), rank)
        folder = Path(root)
        encoder = H3TextEncoder.from_pretrained(folder / "text_encoder", folder / "tokenizer", folder / "processor",
                                                device="cpu", dtype=torch.float32, layer=layer, tp=(rank, 2))
        read = encoder.model.tp_bytes_read
        encoder.enable_tensor_parallel(ctx)
        ctx.stats.reset()
        rows = encodings(encoder)
        attn = encoder.model.language_model.layers[0].self_attn
        torch.save({"rows": rows, "read": read, "held": local_parameter_bytes(encoder.model),
                    "q": attn.q_proj.weight.to_local().clone(), "k": attn.k_proj.weight.to_local().clone(),
                    "all_reduce": ctx.stats.snapshot()["calls"].get("all_reduce", 0)},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
