"""A model's transformer-block loop, declared once and used by every technique that walks blocks.

First-block cache, layer-wise offload and (later) sequence parallelism all need to know which module list
holds the blocks and which tensors flow through them; a pipeline states it with one :class:`BlockLoop`.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import attrs

from .errors import ConfigError

if TYPE_CHECKING:
    from torch import nn


@attrs.frozen(kw_only=True)
class BlockLoop:
    """A model's block loop: ``blocks`` is the dotted path from the pipeline to the module list of
    transformer blocks; ``streams`` names the tensors each block takes (as keyword, else positionally in this
    order) and returns (one tensor, or a tuple in this order). The first stream is the one compared."""

    blocks: str
    streams: tuple[str, ...] = ("hidden_states",)

    def resolve(self, pipeline: object) -> list[nn.Module]:
        """The block modules this loop names on ``pipeline`` (``ConfigError`` when the path is wrong)."""
        try:
            blocks = operator.attrgetter(self.blocks)(pipeline)
        except AttributeError:
            raise ConfigError("block_loop.blocks", f"{self.blocks!r} does not name an attribute of "
                                                   f"{type(pipeline).__name__}") from None
        if not hasattr(blocks, "__getitem__") or not hasattr(blocks, "__len__"):
            raise ConfigError("block_loop.blocks", f"{self.blocks!r} is not a sequence of blocks")
        return list(blocks)
