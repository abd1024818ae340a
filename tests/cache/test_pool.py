"""BlockPool: O(1) allocate/free from a stack of free ids, loud and atomic on misuse."""

from __future__ import annotations

import pytest

from kvtier.cache import BlockPool, DoubleFreeError


def test_allocate_hands_out_distinct_ids_in_order():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate_one() == 3
    assert (pool.num_free, pool.num_used) == (0, 4)


def test_freed_block_is_reused_first():
    # a stack: free pushes, allocate pops -- constant work per block, no scan of the pool
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    pool.free([blocks[1], blocks[3]])
    pool.free_one(blocks[0])
    assert pool.allocate_one() == blocks[0]
    assert pool.allocate(2) == [blocks[1], blocks[3]]


def test_free_makes_blocks_allocatable_again():
    pool = BlockPool(2)
    pool.free(pool.allocate(2))
    assert pool.num_free == 2 and all(pool.is_free(b) for b in range(2))


def test_double_free_raises():
    pool = BlockPool(4)
    b = pool.allocate_one()
    pool.free_one(b)
    with pytest.raises(DoubleFreeError, match="freed twice"):
        pool.free_one(b)
    with pytest.raises(DoubleFreeError, match="freed twice"):
        pool.free([b])


def test_same_block_twice_in_one_free_raises():
    pool = BlockPool(4)
    b = pool.allocate_one()
    with pytest.raises(DoubleFreeError, match="twice"):
        pool.free([b, b])


@pytest.mark.parametrize("bad", [-1, 4, 100, "1", 1.0, None])
def test_unknown_block_id_is_named(bad):
    pool = BlockPool(4)
    pool.allocate(4)
    with pytest.raises(DoubleFreeError, match="not in 0..3"):
        pool.free([bad])
    with pytest.raises(DoubleFreeError, match="not in 0..3"):
        pool.free_one(bad)


def test_refused_free_leaves_state_unchanged():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free_one(b)
    with pytest.raises(DoubleFreeError):
        pool.free([a, b])  # b is already free: the whole call is refused
    assert not pool.is_free(a) and pool.num_free == 3


def test_refused_allocation_takes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(MemoryError, match="2 blocks requested, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.allocate_one()
    with pytest.raises(MemoryError):
        pool.allocate_one()


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="-1"):
        BlockPool(-1)
    with pytest.raises(ValueError, match="True"):
        BlockPool(True)
    with pytest.raises(ValueError, match="-2"):
        BlockPool(4).allocate(-2)
