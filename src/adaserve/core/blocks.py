"""Torch-free KV block allocator and per-request block tables.

Invariants (kept by ``BlockAllocator``):
- a block is either on the free list (refcount 0) or referenced (refcount >= 1), never both;
- ``num_free + sum(1 for referenced blocks) == num_blocks`` at all times;
- freeing drops one reference; a block returns to the free list when its count reaches 0.

A request's *slot space* is indexed by position: slot index ``i`` of a request lives in
block ``table[i // block_size]`` at offset ``i % block_size``. Tree candidates take
temporary slot indices past the committed ones and are truncated away after commit.
"""

from __future__ import annotations

import numpy as np


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than a request needs (the engine preempts)."""


class BlockAllocator:
    """Fixed pool of ``num_blocks`` blocks of ``block_size`` slots, with reference counts."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._ref = [0] * num_blocks
        self.reserved = 0  # blocks held back (e.g. simulated KV pressure)

    @property
    def num_free(self) -> int:
        return max(0, len(self._free) - self.reserved)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (0-1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self) -> int:
        if self.num_free <= 0:
            raise OutOfBlocks
        b = self._free.pop()
        self._ref[b] = 1
        return b

    def incref(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._ref[block] += 1

    def free(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._ref[block]


class BlockTable:
    """The blocks backing one request's slot space, in order."""

    def __init__(self, allocator: BlockAllocator):
        self.alloc = allocator
        self.blocks: list[int] = []
        self._base: np.ndarray | None = None  # first slot of each block (cached)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.alloc.block_size

    def blocks_needed(self, num_slots: int) -> int:
        """Additional blocks required to hold ``num_slots`` slots."""
        bs = self.alloc.block_size
        return max(0, -(-num_slots // bs) - len(self.blocks))

    def ensure(self, num_slots: int) -> None:
        """Grow to hold ``num_slots`` slots; all-or-nothing (raises ``OutOfBlocks``)."""
        need = self.blocks_needed(num_slots)
        if need > self.alloc.num_free:
            raise OutOfBlocks
        for _ in range(need):
            self.blocks.append(self.alloc.allocate())
        if need:
            self._base = None

    def truncate(self, num_slots: int) -> None:
        """Release blocks not needed for the first ``num_slots`` slots."""
        keep = -(-num_slots // self.alloc.block_size)
        while len(self.blocks) > keep:
            self.alloc.free(self.blocks.pop())
            self._base = None

    def release(self) -> None:
        self.truncate(0)

    def slot(self, index: int) -> int:
        bs = self.alloc.block_size
        return self.blocks[index // bs] * bs + index % bs

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Physical slots of slot indices ``start..stop-1``: [stop - start] int64.

        Vectorised: the prefix of a long request is hundreds of slots, asked for at
        every draft step and every verification."""
        bs = self.alloc.block_size
        if self._base is None:
            self._base = np.asarray(self.blocks, dtype=np.int64) * bs
        i = np.arange(start, stop, dtype=np.int64)
        return self._base[i // bs] + i % bs
