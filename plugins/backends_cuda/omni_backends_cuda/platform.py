"""The ``cuda`` platform: device, synchronisation, memory statistics, streams/events and pinned host memory."""

from __future__ import annotations

from typing import Any

import torch
from omnicore.plugin import Platform


class CudaPlatform(Platform):
    """NVIDIA GPUs through ``torch.cuda`` (selected automatically over the CPU when the probe passes)."""

    name = "cuda"
    device_type = "cuda"

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cuda", index)

    def synchronize(self) -> None:
        """Wait for every queued kernel on the current device (timings, benchmarks)."""
        torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated())

    def max_memory_allocated(self) -> int | None:
        """Peak bytes held by tensors since :meth:`reset_peak_memory` (the caching allocator's window)."""
        return int(torch.cuda.max_memory_allocated())

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def default_dtype(self) -> torch.dtype:
        """bf16 where the device computes it natively (Ampere and newer), else fp16."""
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    # ------------------------------------------------------------------ services for offload and benchmarks
    def memory_stats(self) -> dict[str, int]:
        """Allocated, reserved and peak bytes plus the device's free/total memory."""
        free, total = torch.cuda.mem_get_info()
        return {"allocated": int(torch.cuda.memory_allocated()), "reserved": int(torch.cuda.memory_reserved()),
                "max_allocated": int(torch.cuda.max_memory_allocated()), "free": int(free), "total": int(total)}

    def device_info(self, index: int = 0) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(index)
        return {"name": props.name, "capability": f"{props.major}.{props.minor}",
                "total_memory": int(props.total_memory), "multiprocessors": int(props.multi_processor_count)}

    def stream(self, index: int = 0) -> torch.cuda.Stream:
        """A new side stream (weight prefetch overlapping compute)."""
        return torch.cuda.Stream(device=self.device(index))

    def current_stream(self, index: int = 0) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device(index))

    def event(self, *, timing: bool = False) -> torch.cuda.Event:
        """An event to order streams (``stream.wait_event``) or, with ``timing``, to time device work."""
        return torch.cuda.Event(enable_timing=timing)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked host copy of ``tensor`` (asynchronous host-to-device copies need one)."""
        return tensor if tensor.is_pinned() else tensor.pin_memory()
