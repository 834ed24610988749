"""Block allocator invariants and preemption under a tiny pool."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.core.blocks import BlockAllocator, BlockTable, OutOfBlocks


def _check(alloc: BlockAllocator, tables: list[BlockTable]) -> None:
    held = [b for t in tables for b in t.blocks]
    assert len(held) == len(set(held)), "a block is in two tables"
    assert len(held) + alloc.num_free == alloc.num_blocks, "blocks leaked"
    for b in held:
        assert alloc.refcount(b) == 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),
            st.sampled_from(["ensure", "truncate", "release"]),
            st.integers(0, 70),
        ),
        max_size=80,
    )
)
def test_random_alloc_truncate_free_never_double_allocates_or_leaks(ops):
    alloc = BlockAllocator(12, 4)
    tables = [BlockTable(alloc) for _ in range(6)]
    for i, op, n in ops:
        t = tables[i]
        if op == "ensure":
            before = list(t.blocks)
            try:
                t.ensure(n)
                assert t.capacity >= n
            except OutOfBlocks:
                assert t.blocks == before  # all-or-nothing
        elif op == "truncate":
            t.truncate(n)
            assert t.capacity < n + alloc.block_size or n == 0
        else:
            t.release()
        _check(alloc, tables)
    for t in tables:
        t.release()
    assert alloc.num_free == alloc.num_blocks


def test_slots_map_positions_into_blocks():
    alloc = BlockAllocator(8, 4)
    a, b = BlockTable(alloc), BlockTable(alloc)
    a.ensure(5)
    b.ensure(3)
    a.ensure(9)
    slots = a.slots(0, 9)
    assert len(set(slots)) == 9
    assert all(s // 4 in a.blocks for s in slots)
    assert not set(slots) & set(b.slots(0, 3))


def test_refcounts_and_double_free():
    alloc = BlockAllocator(2, 4)
    blk = alloc.allocate()
    alloc.incref(blk)
    alloc.free(blk)
    assert alloc.num_free == 1
    alloc.free(blk)
    assert alloc.num_free == 2
    try:
        alloc.free(blk)
    except ValueError:
        pass
    else:
        raise AssertionError("double free not detected")
