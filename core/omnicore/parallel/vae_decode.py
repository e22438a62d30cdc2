"""Parallel VAE decode: the tiles of a tiled decode shared out over the ranks of the worker group.

A tiled VAE decode is a list of independent tile decodes followed by a blend of the overlaps. Under ``--parallel``
every rank holds the same latents after the last step, so :func:`decode_tiles` lets rank ``r`` decode tiles
``r, r + W, r + 2W, ...`` (round-robin over the ``W`` ranks of the group) and gathers every decoded tile, in tile
order, on rank 0 (``gather="driver"``) or on every rank (``gather="all"``). The caller then blends them with the
VAE's own stitching code, so the frames are those of the single-rank tiled decode: each tile is decoded by the same
module from the same latent slice, and the gather moves its bits unchanged. With one rank (or ``ctx=None``) it is the
plain loop ``[decode(t) for t in tiles]``.

Transport is ``torch.distributed``'s: one ``all_reduce`` of a small int64 table (every tile's dtype and shape, so
ranks with no tile this time know what they will receive), then one ``gather`` / ``all_gather`` of each rank's tiles
flattened into one buffer (padded to the longest rank's). Tensors stay on ``device``: the VAE's device under
NCCL/HCCL, the CPU under gloo.

Every rank of the group must call it with the same number of tiles (they do: the latents and the tile geometry are
the same everywhere); a rank that returns early would leave its peers waiting in the collective, so the engine does
not offer cancellation points inside a parallel decode.

A deployment turns it off with the model option :data:`PARALLEL_VAE_DECODE_OPTION` (``parallel_vae_decode=false``):
rank 0 then decodes alone, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ..specs import ModelOption

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from .context import ParallelContext

T = TypeVar("T")

#: ``--model-option parallel_vae_decode=false`` keeps the VAE decode on rank 0 alone under ``--parallel``.
PARALLEL_VAE_DECODE_OPTION = ModelOption(
    "parallel_vae_decode", "bool", True,
    help="--parallel: share the tiles of a tiled VAE decode out over every rank (round-robin) and gather them on "
         "rank 0; false decodes on rank 0 alone (the frames are the same either way)")

#: the dtypes a decoded tile may have (their index + 1 travels in the shape table; 0 marks "not mine")
_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64", "uint8", "int32", "int64")
_MAX_DIMS = 8


def parallel_vae_decode_enabled(ctx: ParallelContext | None, model_options: Mapping[str, Any] | None) -> bool:
    """Whether this pipeline shares its tile decodes over the ranks: a worker group of more than one rank, and the
    deployment did not set ``parallel_vae_decode=false``."""
    if ctx is None or ctx.world_size <= 1:
        return False
    value = (model_options or {}).get(PARALLEL_VAE_DECODE_OPTION.name, PARALLEL_VAE_DECODE_OPTION.default)
    return value is None or bool(value)


def tile_owner(index: int, world_size: int) -> int:
    """The rank that decodes tile ``index`` (round-robin)."""
    return index % world_size


def decode_tiles(tiles: Sequence[T], decode: Callable[[T], torch.Tensor], ctx: ParallelContext | None, *,
                 device: torch.device | str, gather: Literal["driver", "all"] = "driver",
                 group: ProcessGroup | None = None,
                 placeholders: bool = False) -> list[torch.Tensor] | None:
    """Every tile of ``tiles`` decoded by ``decode``, in order, on the ranks that receive them (see the module
    docstring); ``None`` on a rank that does not (``gather="driver"``, rank > 0 of the group) -- or, with
    ``placeholders=True``, zeros of each tile's shape and dtype there (expanded, no memory of their own), so a
    caller can run the same stitching code on every rank and drop what the non-receiving ranks compute.

    ``tiles`` are whatever ``decode`` takes (latent slices, or their coordinates); ``decode`` returns one tensor per
    tile, all of one dtype and at most 8 dims. ``group`` defaults to the whole worker group (the default process
    group); ``ctx=None`` or one rank decodes the tiles here."""
    import torch
    import torch.distributed as dist

    if gather not in ("driver", "all"):
        raise ValueError(f"gather must be 'driver' or 'all', got {gather!r}")
    world = 1 if ctx is None or not dist.is_initialized() else dist.get_world_size(group)
    if world == 1:
        return [decode(t) for t in tiles]
    rank = dist.get_rank(group)
    n = len(tiles)
    mine = {i: decode(tiles[i]).contiguous() for i in range(rank, n, world)}

    table = torch.zeros(n, 2 + _MAX_DIMS, dtype=torch.int64)
    for i, tile in mine.items():
        name = str(tile.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"decode_tiles: tile {i} has dtype {tile.dtype}, not one of {', '.join(_DTYPES)}")
        if tile.ndim > _MAX_DIMS:
            raise ValueError(f"decode_tiles: tile {i} has {tile.ndim} dims, at most {_MAX_DIMS} travel")
        table[i, 0], table[i, 1] = _DTYPES.index(name) + 1, tile.ndim
        table[i, 2:2 + tile.ndim] = torch.tensor(tile.shape, dtype=torch.int64)
    table = table.to(device)
    dist.all_reduce(table, group=group)  # each row is filled by exactly one rank
    table = table.cpu()
    if n == 0:
        return [] if gather == "all" or rank == 0 or placeholders else None
    codes = set(table[:, 0].tolist())
    if len(codes) != 1 or 0 in codes:
        raise ValueError(f"decode_tiles: the tiles' dtypes differ or a tile is missing ({sorted(codes)})")
    dtype = getattr(torch, _DTYPES[int(table[0, 0]) - 1])
    shapes = [tuple(int(d) for d in table[i, 2:2 + int(table[i, 1])].tolist()) for i in range(n)]
    numel = [int(torch.tensor(s, dtype=torch.int64).prod()) if s else 1 for s in shapes]
    per_rank = [sum(numel[i] for i in range(q, n, world)) for q in range(world)]
    longest = max(per_rank)

    payload = torch.zeros(longest, dtype=dtype, device=device)
    if mine:
        flat = torch.cat([mine[i].reshape(-1).to(device) for i in sorted(mine)])
        payload[:flat.numel()] = flat
    receives = gather == "all" or rank == 0
    buffers = [torch.empty_like(payload) for _ in range(world)] if receives else None
    if gather == "all":
        assert buffers is not None  # every rank receives
        dist.all_gather(buffers, payload, group=group)
        sent = per_rank[rank] * (world - 1)
    else:
        dst = 0 if group is None else dist.get_global_rank(group, 0)
        dist.gather(payload, buffers, dst=dst, group=group)
        sent = 0 if rank == 0 else per_rank[rank]
    if ctx is not None:
        ctx.stats.record("vae_gather", sent * payload.element_size())
    if buffers is None:
        if not placeholders:
            return None
        zero = torch.zeros((), dtype=dtype, device=device)
        return [zero.expand(shape) for shape in shapes]
    out: list[torch.Tensor | None] = [None] * n
    for q in range(world):
        offset = 0
        for i in range(q, n, world):
            out[i] = mine[i] if q == rank else buffers[q][offset:offset + numel[i]].view(shapes[i])
            offset += numel[i]
    return [t for t in out if t is not None]


__all__ = ["PARALLEL_VAE_DECODE_OPTION", "decode_tiles", "parallel_vae_decode_enabled", "tile_owner"]
