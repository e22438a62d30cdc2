"""A text encoder kept in host memory (the model option ``text_encoder_offload=cpu``).

A prompt encoder is used once per request, before the denoise loop, yet a resident one holds device memory for
the whole run: MiniMax-H3's Qwen3-VL conditioner is 51.5 GB in bf16, more than half of what a ``ulysses=4`` rank
holds. With ``text_encoder_offload=cpu`` a model plugin loads its text encoder into host memory and runs it on the
CPU; only the encoded rows (a few MB) move to the device. The device never holds the encoder, not even while
loading, so every rank's device bytes drop by its size (``omnicore plan --model-option text_encoder_offload=cpu``
prices it so, and so does memory admission).

Under ``--parallel`` only the driver rank (rank 0) loads and runs the encoder; :func:`shared_encode` broadcasts
its result to every other rank, which computes nothing but receives the same tensors. So one host copy serves
the whole worker group (not one per rank), and the encoder is never split over tensor-parallel ranks (its rows
are the single-process ones).

Cost: the encode runs at host speed, seconds per prompt for a 30 B-class encoder (its FLOPs are ``2 x params x
tokens``) rather than milliseconds on the device. The other way to free the device, moving the weights to the
device for each encode, would copy the whole encoder over PCIe per request (about 2 s for 51.5 GB at 25 GB/s)
and would still need room for the encoder and the resident DiT at the same time, so it lowers the steady state
but not the peak; it is not offered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..specs import ModelOption

if TYPE_CHECKING:
    import torch

    from .context import ParallelContext

#: ``--model-option text_encoder_offload=cpu``: keep the text encoder in the driver's host memory and encode there.
TEXT_ENCODER_OFFLOAD_OPTION = ModelOption(
    "text_encoder_offload", "str", "none", choices=("none", "cpu"),
    help="none: the text encoder lives on the device with the DiT; cpu: it is loaded into host memory and encodes "
         "there (rank 0 only under --parallel, its rows broadcast to the other ranks): the device never holds it, "
         "each prompt takes host time (seconds for a 30B-class encoder)")

#: the dtypes a shared result may have (their index + 1 travels in the header; 0 marks a failed encode)
_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool")
_MAX_DIMS = 6


def text_encoder_on_host(model_options: Mapping[str, Any] | None) -> bool:
    """Whether the deployment asked for ``text_encoder_offload=cpu``."""
    value = (model_options or {}).get(TEXT_ENCODER_OFFLOAD_OPTION.name) or TEXT_ENCODER_OFFLOAD_OPTION.default
    return str(value) == "cpu"


def holds_text_encoder(ctx: ParallelContext | None, model_options: Mapping[str, Any] | None) -> bool:
    """Whether this rank loads the text encoder: always when it is resident; with ``cpu``, the driver only."""
    return not text_encoder_on_host(model_options) or ctx is None or ctx.is_driver


class SharedEncodeFailed(RuntimeError):
    """The driver's encoder raised: every other rank raises this instead of waiting for rows that never come."""


def shared_encode(ctx: ParallelContext | None, compute: Callable[[], Sequence[torch.Tensor]] | None, *,
                  device: torch.device | str) -> list[torch.Tensor]:
    """``compute()``'s tensors on ``device``, on every rank: run here without a worker group (or a group of one);
    under one, run on the driver only (the others pass ``compute=None``) and broadcast over the default process
    group (a header with each tensor's dtype and shape, then the tensors). A failing ``compute`` on the driver is
    announced in the header, so the other ranks raise :class:`SharedEncodeFailed` rather than hang."""
    import torch
    import torch.distributed as dist

    if ctx is None or ctx.world_size <= 1 or not dist.is_initialized():
        if compute is None:
            raise ValueError("shared_encode: a process without a worker group must compute the encode itself")
        return [t.to(device) for t in compute()]
    from .collectives import group_device

    link = group_device()
    header = torch.zeros(16, 2 + _MAX_DIMS, dtype=torch.int64)
    result: list[torch.Tensor] = []
    error: BaseException | None = None
    if ctx.is_driver:
        if compute is None:
            raise ValueError("shared_encode: the driver rank must compute the encode")
        try:
            result = [t.contiguous() for t in compute()]
            if len(result) > header.shape[0]:
                raise ValueError(f"shared_encode: at most {header.shape[0]} tensors travel, got {len(result)}")
            for i, t in enumerate(result):
                name = str(t.dtype).removeprefix("torch.")
                if name not in _DTYPES or t.ndim > _MAX_DIMS:
                    raise ValueError(f"shared_encode: tensor {i} ({t.dtype}, {t.ndim} dims) cannot travel")
                header[i, 0], header[i, 1] = _DTYPES.index(name) + 1, t.ndim
                header[i, 2:2 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others were told
            error = exc
            header.fill_(0)
            header[0, 0] = -1
    header = header.to(link)
    dist.broadcast(header, src=0)
    header = header.cpu()
    if error is not None:
        raise error
    if int(header[0, 0]) == -1:
        raise SharedEncodeFailed("the driver rank's text encoder failed on this batch (see rank 0's error)")
    out: list[torch.Tensor] = []
    for i in range(header.shape[0]):
        code, ndim = int(header[i, 0]), int(header[i, 1])
        if code == 0:
            break
        dtype = getattr(torch, _DTYPES[code - 1])
        shape = tuple(int(d) for d in header[i, 2:2 + ndim].tolist())
        buf = result[i].to(link) if ctx.is_driver else torch.empty(shape, dtype=dtype, device=link)
        dist.broadcast(buf, src=0)
        if ctx.is_driver:
            ctx.stats.record("encode_broadcast", buf.numel() * buf.element_size() * (ctx.world_size - 1))
        out.append(buf.to(device))
    return out


__all__ = ["TEXT_ENCODER_OFFLOAD_OPTION", "SharedEncodeFailed", "holds_text_encoder", "shared_encode",
           "text_encoder_on_host"]
