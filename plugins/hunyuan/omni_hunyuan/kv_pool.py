"""Paged prefix-KV block pool (docs/contracts-status.md C5), owned by the pipeline.

The prefix of a CFG row (positions before the generated image's ``<timestep>``) is cut into ``block_size``
token blocks. Block ``i``'s hash chains the previous block's hash, the row's *identity* (reference-image
content, condition-image grids and the VAE sampling seed for edits; empty for text-to-image) and the block's
tokens, so equal hashes mean equal K/V at every layer. Only full blocks inside the prefix are published — the
target span (``<timestep>``, ``<img>``*N) changes every step and never enters the pool. Blocks are reference
counted while a request uses them and evicted least-recently-used when the pool exceeds its budget.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import attrs
import torch

HASH_VERSION = "hunyuan-reference-v1"


def row_identity(*parts: object) -> str:
    """Identity of a row's non-token content (hashed once, shared by the CFG rows)."""
    if not parts:
        return ""
    h = hashlib.sha256(HASH_VERSION.encode())
    for p in parts:
        h.update(b"\x1f" + repr(p).encode())
    return h.hexdigest()


def block_hashes(tokens: Sequence[int], prefix_len: int, block_size: int, identity: str = "") -> tuple[str, ...]:
    """Hashes of the full blocks inside ``tokens[:prefix_len]``."""
    out: list[str] = []
    prev = identity
    for i in range(prefix_len // block_size):
        h = hashlib.sha256(prev.encode())
        h.update(b"|" + ",".join(map(str, tokens[i * block_size:(i + 1) * block_size])).encode())
        prev = h.hexdigest()
        out.append(prev)
    return tuple(out)


@attrs.define
class _Block:
    keys: list[torch.Tensor]  # per layer [block_size, Hkv, D]
    values: list[torch.Tensor]
    refs: int = 0


@attrs.define
class PoolStats:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    published: int = 0
    evicted: int = 0
    skipped: int = 0  # blocks not published because every resident block was in use

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


class PrefixKVPool:
    """Content-addressed K/V blocks with an LRU budget of ``max_blocks``."""

    def __init__(self, block_size: int = 16, max_blocks: int = 256) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size and max_blocks must be positive, got {block_size}, {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[str, _Block] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = PoolStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._blocks

    def acquire(self, hashes: Sequence[str]) -> int:
        """Count the leading resident blocks of ``hashes``, pin them and mark them recently used."""
        with self._lock:
            self.stats.lookups += 1
            n = 0
            for h in hashes:
                block = self._blocks.get(h)
                if block is None:
                    break
                block.refs += 1
                self._blocks.move_to_end(h)
                n += 1
            self.stats.hit_blocks += n
            self.stats.miss_blocks += len(hashes) - n
            return n

    def release(self, hashes: Sequence[str]) -> None:
        with self._lock:
            for h in hashes:
                block = self._blocks.get(h)
                if block is not None and block.refs > 0:
                    block.refs -= 1
            self._evict()

    def gather(self, hashes: Sequence[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the concatenated ``[n * block_size, Hkv, D]`` keys and values of pinned blocks."""
        blocks = [self._blocks[h] for h in hashes]
        layers = len(blocks[0].keys)
        keys = [torch.cat([b.keys[i] for b in blocks]) for i in range(layers)]
        values = [torch.cat([b.values[i] for b in blocks]) for i in range(layers)]
        return keys, values

    def gather_rows(self, rows: Sequence[Sequence[str]], capacity: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, ``(k, v)`` of shape ``[len(rows), max(n * block_size, capacity), Hkv, D]`` whose first
        ``n * block_size`` positions are the pinned blocks (every row lists ``n`` hashes), copied once."""
        first = self._blocks[rows[0][0]]
        n, bs = len(rows[0]), self.block_size
        size = max(n * bs, capacity)
        out = []
        for i, (k0, v0) in enumerate(zip(first.keys, first.values)):
            k = k0.new_empty(len(rows), size, *k0.shape[1:])
            v = v0.new_empty(len(rows), size, *v0.shape[1:])
            for r, hashes in enumerate(rows):
                for j, h in enumerate(hashes):
                    block = self._blocks[h]
                    k[r, j * bs:(j + 1) * bs] = block.keys[i]
                    v[r, j * bs:(j + 1) * bs] = block.values[i]
            out.append((k, v))
        return out

    def publish(self, hashes: Sequence[str], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> int:
        """Store the blocks of one row (``keys/values`` per layer ``[>= len(hashes) * block_size, Hkv, D]``,
        position 0 first); returns how many new blocks were stored."""
        bs = self.block_size
        stored = 0
        with self._lock:
            for i, h in enumerate(hashes):
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
                if len(self._blocks) >= self.max_blocks and not self._evict(room=1):
                    self.stats.skipped += len(hashes) - i
                    break
                self._blocks[h] = _Block([k[i * bs:(i + 1) * bs].clone() for k in keys],
                                         [v[i * bs:(i + 1) * bs].clone() for v in values])
                stored += 1
            self.stats.published += stored
        return stored

    def _evict(self, room: int = 0) -> bool:
        """Drop unpinned least-recently-used blocks until the pool is within budget with ``room`` free slots."""
        while len(self._blocks) + room > self.max_blocks:
            victim = next((h for h, b in self._blocks.items() if b.refs == 0), None)
            if victim is None:
                return False
            del self._blocks[victim]
            self.stats.evicted += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
