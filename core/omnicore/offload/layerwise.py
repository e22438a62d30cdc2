"""Layer-wise offload: transformer blocks live on the host and visit the device one at a time.

Before block ``i`` runs it is on the device (waiting for its prefetch if one is in flight) and block
``i+1`` (block 0 after the last, ready for the next step) is prefetched on a side stream where the platform
has one; after block ``i`` runs its owned parameters are released again.

Ownership: a block hook owns the parameters whose block-relative names start with none of the excluded
prefixes. Excluded parameters (e.g. ``adaln_proj.linear.`` while the exact-schedule AdaLN cache owns them
and may offload them itself) are moved to the device once, at apply time, and never touched again;
DTensor/meta parameters always stay with their owner; buffers are unaffected.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from ..module_hooks import ModelHook, register_hook, remove_hook
from ._swap import ParamSet, excluded_by, is_distributed, side_stream

logger = logging.getLogger("omnicore.offload")

HOOK_NAME = "omnicore.layerwise_offload"


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.define(kw_only=True)
class LayerwiseOffloadConfig:
    """``device``: where blocks compute; ``excluded_prefixes``: block-relative parameter-name prefixes that
    stay resident outside the transfer set; ``prefetch``: load block ``i+1`` while block ``i`` runs."""

    device: torch.device | str
    excluded_prefixes: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    prefetch: bool = True


class LayerwiseOffloadHook(ModelHook):
    """Per-block hook; ``owned``/``next_owned`` are this block's and the next block's transfer sets."""

    def __init__(self, index: int, sets: list[ParamSet], stream: Any, prefetch: bool) -> None:
        self.index = index
        self._sets = sets
        self._stream = stream
        self._prefetch = prefetch

    @property
    def current(self) -> ParamSet:
        return self._sets[self.index]

    @property
    def next(self) -> ParamSet:
        return self._sets[(self.index + 1) % len(self._sets)]

    @property
    def owned(self) -> frozenset[str]:
        return self.current.names

    @property
    def next_owned(self) -> frozenset[str]:
        return self.next.names

    def pre_forward(self, module: nn.Module, *args: object,
                    **kwargs: object) -> tuple[tuple[object, ...], dict[str, object]]:
        self.current.load()
        self.current.wait()
        if self._prefetch and len(self._sets) > 1:
            self.next.load(stream=self._stream, non_blocking=True)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: object) -> object:  # passed through untouched
        self.offload_current()
        return output

    def offload_current(self) -> None:
        self.current.release()


def move_excluded(blocks: Sequence[nn.Module], prefixes: Sequence[str], device: torch.device | str) -> int:
    """Move every parameter matching ``prefixes`` to ``device``; returns their bytes (only those)."""
    moved = 0
    for block in blocks:
        for name, p in block.named_parameters():
            if excluded_by(name, prefixes) and not is_distributed(p):
                if p.device != torch.device(device):
                    p.data = p.data.to(device, non_blocking=True)
                moved += p.numel() * p.element_size()
    return moved


class LayerwiseOffload:
    """Handle of an applied layer-wise offload; :meth:`remove` puts every block back on the device."""

    def __init__(self, blocks: Sequence[nn.Module], config: LayerwiseOffloadConfig) -> None:
        if len(blocks) == 0:
            raise ValueError("layer-wise offload needs at least one block")
        device = torch.device(config.device)
        self.blocks = list(blocks)
        self.config = config
        self.excluded_bytes = 0
        if config.excluded_prefixes:
            self.excluded_bytes = move_excluded(self.blocks, config.excluded_prefixes, device)
            logger.info("layer-wise offload: %d parameter bytes under %s stay resident",
                        self.excluded_bytes, list(config.excluded_prefixes))
        self.sets = [ParamSet(b, device, config.excluded_prefixes) for b in self.blocks]
        stream = side_stream(device) if config.prefetch else None
        self.hooks: list[LayerwiseOffloadHook] = []
        try:
            for i, block in enumerate(self.blocks):
                hook = LayerwiseOffloadHook(i, self.sets, stream, config.prefetch)
                register_hook(block, HOOK_NAME, hook)
                self.hooks.append(hook)
        except Exception:
            self.remove()
            raise
        for s in self.sets[1:]:
            s.release()
        self.sets[0].load()  # block 0 is ready for the first forward

    def remove(self) -> None:
        for block in self.blocks[: len(self.hooks)]:
            remove_hook(block, HOOK_NAME)
        self.hooks = []
        for s in self.sets:
            s.restore_resident()

    def transfer_bytes(self) -> int:
        """Bytes of all blocks' owned parameters (what moves between host and device)."""
        return sum(s.nbytes() for s in self.sets)


def apply_layerwise_offload(blocks: Sequence[nn.Module], config: LayerwiseOffloadConfig | None = None, *,
                            device: torch.device | str | None = None,
                            excluded_prefixes: Sequence[str] = ()) -> LayerwiseOffload:
    """Offload ``blocks`` layer by layer (give a config, or ``device`` and ``excluded_prefixes``)."""
    if config is None:
        if device is None:
            raise ValueError("apply_layerwise_offload needs a config or a device")
        config = LayerwiseOffloadConfig(device=device, excluded_prefixes=tuple(excluded_prefixes))
    return LayerwiseOffload(blocks, config)


def remove_layerwise_offload(handle: LayerwiseOffload) -> None:
    handle.remove()
