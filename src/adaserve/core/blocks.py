"""Torch-free KV block allocator, per-request block tables and the prefix cache.

Invariants (kept by ``BlockAllocator``):
- a block is free (refcount 0) or referenced (refcount >= 1), never both; a free block
  is either plain (on the free list) or *cached* (it holds a committed, hashed block
  of some earlier request and waits in the eviction order until it is needed);
- ``free blocks + referenced blocks == num_blocks`` at all times;
- freeing drops one reference; a block becomes free when its count reaches 0;
- a hash maps to at most one block, and a cached block's KV is never written: only
  full blocks of committed tokens are hashed, and a request maps cached blocks only
  below its last token, whose slot is always in a block of its own.

A request's *slot space* is indexed by position: slot index ``i`` of a request lives in
block ``table[i // block_size]`` at offset ``i % block_size``. Tree candidates take
temporary slot indices past the committed ones and are truncated away after commit.

Prefix caching (vLLM's automatic prefix caching): block ``i`` of a request is named by
a digest of its ``block_size`` token ids, the digest of block ``i - 1`` and, for the
first block, the request's cache salt (its tenant's, unless the operator shares a
prefix on purpose). A new request maps its longest run of cached blocks, with
reference counts, and computes only the rest. The target and the draft share slot
addresses, so a block also says whether the draft's KV of it was computed
(``draft_ok``): the draft then skips it as well.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

# eviction orders of cached blocks
EVICTION = ("lru", "slo")


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than a request needs (the engine preempts)."""


def block_digest(parent: bytes, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """The name of a full block: its token ids after the block ``parent`` names
    (``b""`` for the first block, which also carries the cache ``salt``). A
    cryptographic digest, so no tenant can make another's block collide with its own."""
    h = hashlib.blake2b(parent, digest_size=16)
    if not parent and salt:
        h.update(b"salt\0" + salt.encode("utf-8", "surrogatepass") + b"\0")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class CacheStats:
    """Prefix-cache lookups since start: prompt tokens queried and found, by class."""

    __slots__ = ("queries", "hits", "by_class", "evictions")

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0
        self.evictions = 0
        self.by_class: dict[str, list[int]] = {}  # class -> [queried, hit, requests, hit reqs]

    def count(self, cls: str, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit
        c = self.by_class.setdefault(cls, [0, 0, 0, 0])
        c[0] += queried
        c[1] += hit
        c[2] += 1
        c[3] += 1 if hit else 0

    def summary(self) -> dict[str, Any]:
        """Totals and per class: queried and cached prompt tokens, the token hit rate."""

        def one(q: int, h: int, n: int, nh: int) -> dict[str, Any]:
            return {
                "queried_tokens": q,
                "cached_tokens": h,
                "computed_tokens": q - h,
                "hit_rate": h / q if q else 0.0,
                "lookups": n,
                "lookups_hit": nh,
            }

        out = one(self.queries, self.hits, 0, 0)
        out["lookups"] = sum(c[2] for c in self.by_class.values())
        out["lookups_hit"] = sum(c[3] for c in self.by_class.values())
        out["evictions"] = self.evictions
        out["by_class"] = {k: one(*v) for k, v in sorted(self.by_class.items())}
        return out


class BlockAllocator:
    """Fixed pool of ``num_blocks`` blocks of ``block_size`` slots, with reference counts
    and (``caching``) a content-addressed cache of freed full blocks.

    ``eviction``: ``"lru"`` evicts the least recently used cached block; ``"slo"`` also
    weighs the strictest class that used a block: a block an interactive request used
    counts as ``slo_bonus_s`` seconds more recent per class rank than a batch job's
    (``now`` is set by the scheduler each step)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        caching: bool = False,
        eviction: str = "lru",
        slo_bonus_s: float = 30.0,
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if eviction not in EVICTION:
            raise ValueError(f"eviction must be one of {EVICTION}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.eviction = eviction
        self.slo_bonus_s = float(slo_bonus_s)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._ref = [0] * num_blocks
        self.reserved = 0  # blocks held back (e.g. simulated KV pressure)
        # the prefix cache
        self._hash: list[bytes | None] = [None] * num_blocks
        self._draft_ok = [False] * num_blocks
        self._rank = [0] * num_blocks  # the strictest class rank that used the block
        self._used_at = [0.0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        # free cached blocks by rank ("slo") or in one order ("lru"): oldest first
        self._idle: dict[int, OrderedDict[int, None]] = {}
        self.now = 0.0
        self.stats = CacheStats()

    # ------------------------------------------------------------------ counts
    @property
    def num_idle(self) -> int:
        """Free blocks that hold a cached block."""
        return sum(len(q) for q in self._idle.values())

    @property
    def num_free(self) -> int:
        return max(0, len(self._free) + self.num_idle - self.reserved)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (0-1): cached blocks no request holds count as
        free, as in vLLM."""
        return 1.0 - (len(self._free) + self.num_idle) / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks the cache names (held or idle)."""
        return len(self._by_hash)

    # ------------------------------------------------------------------ blocks
    def allocate(self) -> int:
        """A block for new KV: a plain free one, else the first cached block in the
        eviction order (its name forgotten)."""
        if self.num_free <= 0:
            raise OutOfBlocks
        if self._free:
            b = self._free.pop()
        else:
            b = self._evict()
        self._ref[b] = 1
        return b

    def _evict(self) -> int:
        if self.eviction == "lru" or len(self._idle) == 1:
            key = min((k for k, q in self._idle.items() if q), key=lambda k: self._head_age(k, 0.0))
        else:
            top = max(k for k, q in self._idle.items() if q)
            key = min(
                (k for k, q in self._idle.items() if q),
                key=lambda k: self._head_age(k, (top - k) * self.slo_bonus_s),
            )
        b, _ = self._idle[key].popitem(last=False)
        self._forget(b)
        self.stats.evictions += 1
        return b

    def _head_age(self, key: int, bonus: float) -> float:
        return self._used_at[next(iter(self._idle[key]))] + bonus

    def _forget(self, b: int) -> None:
        h = self._hash[b]
        if h is not None and self._by_hash.get(h) == b:
            del self._by_hash[h]
        self._hash[b] = None
        self._draft_ok[b] = False

    def incref(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._ref[block] += 1

    def free(self, block: int, rank: int = 0) -> None:
        if self._ref[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self._ref[block] -= 1
        if self._hash[block] is not None:
            self._rank[block] = min(self._rank[block], rank)
            self._used_at[block] = self.now
        if self._ref[block] == 0:
            if self._hash[block] is None:
                self._free.append(block)
            else:
                key = self._rank[block] if self.eviction == "slo" else 0
                self._idle.setdefault(key, OrderedDict())[block] = None

    def refcount(self, block: int) -> int:
        return self._ref[block]

    # ------------------------------------------------------------------ the cache
    def match(self, digests: list[bytes]) -> list[int]:
        """The blocks of the longest cached run of ``digests`` (no side effect)."""
        out = []
        for h in digests:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, block: int, rank: int = 0) -> None:
        """Hold a cached block for one more request (out of the eviction order when
        no request held it)."""
        if self._ref[block] == 0:
            key = self._rank[block] if self.eviction == "slo" else 0
            del self._idle[key][block]
            self._rank[block] = rank
        else:
            self._rank[block] = min(self._rank[block], rank)
        self._ref[block] += 1
        self._used_at[block] = self.now

    def register(self, block: int, digest: bytes) -> bool:
        """Name a held block that now holds ``digest``'s committed tokens; False when
        another block already holds them (this one stays unnamed and is freed plainly)."""
        if not self.caching or self._hash[block] is not None:
            return self._hash[block] == digest
        if digest in self._by_hash:
            return False
        self._by_hash[digest] = block
        self._hash[block] = digest
        self._draft_ok[block] = False
        self._rank[block] = 1 << 30
        return True

    def named(self, block: int) -> bytes | None:
        return self._hash[block]

    def draft_ok(self, block: int) -> bool:
        return self._draft_ok[block]

    def mark_draft(self, block: int) -> None:
        """The draft's KV of this (named) block is computed."""
        if self._hash[block] is not None:
            self._draft_ok[block] = True

    def reset_cache(self) -> int:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): idle ones become
        plain free blocks, held ones stay with their requests unnamed. Returns the
        blocks forgotten."""
        n = len(self._by_hash)
        for b in list(self._by_hash.values()):
            self._forget(b)
        for q in self._idle.values():
            self._free.extend(q)
        self._idle.clear()
        return n


class BlockTable:
    """The blocks backing one request's slot space, in order.

    ``named``: leading blocks already named in the prefix cache (mapped from it or
    registered); ``drafted``: leading named blocks whose draft KV is marked computed.
    ``rank``: the request's class rank, for the ``slo`` eviction order."""

    def __init__(self, allocator: BlockAllocator, rank: int = 0):
        self.alloc = allocator
        self.blocks: list[int] = []
        self._base: np.ndarray | None = None  # first slot of each block (cached)
        self.named = 0
        self.drafted = 0
        self.rank = rank

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

    def map_cached(self, blocks: list[int]) -> None:
        """Start an empty table with cached ``blocks`` (held, one reference each)."""
        if self.blocks:
            raise ValueError("map_cached needs an empty table")
        for b in blocks:
            self.alloc.take(b, self.rank)
        self.blocks = list(blocks)
        self.named = len(blocks)
        self.drafted = 0
        while self.drafted < len(blocks) and self.alloc.draft_ok(blocks[self.drafted]):
            self.drafted += 1
        self._base = None

    def truncate(self, num_slots: int) -> None:
        """Release blocks not needed for the first ``num_slots`` slots."""
        keep = -(-num_slots // self.alloc.block_size)
        while len(self.blocks) > keep:
            self.alloc.free(self.blocks.pop(), self.rank)
            self._base = None
        self.named = min(self.named, keep)
        self.drafted = min(self.drafted, self.named)

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
