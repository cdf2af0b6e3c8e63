"""BlockManager: free list, reference counts, chained-hash prefix cache, eviction. No leaks."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from protocol.sampling import SamplingParams
from scheduler.block_manager import BlockManager, hash_block
from scheduler.request import Request

BS = 4
_ids = itertools.count()


def make_req(tokens: list[int]) -> Request:
    return Request(f"r{next(_ids)}", b"c", list(tokens), len(tokens), SamplingParams(), 0, 16, frozenset())


def computed(bm: BlockManager, req: Request) -> Request:
    """Pretend a step computed every known token's KV (what the scheduler reports after a step)."""
    bm.cache_blocks(req, req.num_tokens)
    return req


def run_and_free(bm: BlockManager, tokens: list[int]) -> list[int]:
    """A request that computed all its tokens and finished: its full blocks stay cached, unreferenced."""
    req = make_req(tokens)
    bm.allocate(req)
    computed(bm, req)
    blocks = req.block_table
    bm.free(req)
    return blocks


@pytest.fixture
def bm():
    bm = BlockManager(num_blocks=8, block_size=BS)
    yield bm
    assert bm.num_free_blocks == bm.num_blocks, "a test leaked blocks"


def test_allocate_gives_blocks_for_every_token_and_free_returns_them(bm):
    req = make_req(list(range(10)))
    assert bm.can_allocate(req)
    assert bm.allocate(req) == 0
    assert len(req.block_table) == 3 and len(set(req.block_table)) == 3
    assert bm.num_free_blocks == 5
    bm.free(req)
    assert req.block_table == [] and bm.num_free_blocks == 8


def test_can_allocate_refuses_more_blocks_than_free(bm):
    big = make_req(list(range(6 * BS)))
    bm.allocate(big)
    assert not bm.can_allocate(make_req(list(range(3 * BS))))
    assert bm.can_allocate(make_req(list(range(2 * BS))))
    bm.free(big)


def test_block_hash_is_chained_sha256_of_int32_bytes():
    first = hash_block(b"", [1, 2])
    assert first == hashlib.sha256(b"\x01\0\0\0\x02\0\0\0").digest()
    assert hash_block(first, [3]) == hashlib.sha256(first + b"\x03\0\0\0").digest()


def test_shared_prefix_hits_full_blocks_and_counts_references(bm):
    a = make_req(list(range(10)))
    bm.allocate(a)
    computed(bm, a)
    b = make_req(list(range(9)) + [99, 98])
    assert bm.allocate(b) == 2 * BS
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_cached_tokens == 2 * BS
    bm.free(a)
    assert bm.num_free_blocks == 8 - 3  # the two shared blocks are still held by b
    bm.free(b)


def test_same_block_content_after_a_different_prefix_does_not_hit(bm):
    a = make_req([1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate(a)
    computed(bm, a)
    b = make_req([9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert bm.allocate(b) == 0
    bm.free(a)
    bm.free(b)


def test_whole_prompt_hit_leaves_the_last_block_to_compute_in_a_private_block(bm):
    a = make_req(list(range(2 * BS)))
    bm.allocate(a)
    computed(bm, a)
    b = make_req(list(range(2 * BS)))
    assert bm.allocate(b) == BS
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    bm.free(a)
    bm.free(b)


def test_only_full_blocks_of_computed_tokens_are_cached(bm):
    a = make_req(list(range(BS + 2)))
    bm.allocate(a)
    b = make_req(list(range(BS + 2)) + [7])
    assert bm.allocate(b) == 0  # a's KV is not computed yet: nothing to share
    bm.cache_blocks(a, a.num_tokens)
    c = make_req(list(range(BS + 2)) + [7])
    assert bm.allocate(c) == BS  # the half-filled second block is not cached
    for r in (a, b, c):
        bm.free(r)


def test_freed_cached_blocks_stay_reusable_until_taken(bm):
    run_and_free(bm, list(range(3 * BS)))
    b = make_req(list(range(3 * BS)) + [5])
    assert bm.allocate(b) == 3 * BS
    bm.free(b)


def test_unhashed_free_blocks_are_taken_before_cached_ones(bm):
    cached = run_and_free(bm, list(range(2 * BS)))
    other = make_req([50 + i for i in range(6 * BS)])  # exactly the 6 blocks that were never hashed
    bm.allocate(other)
    assert len(cached) == 2 and not set(other.block_table) & set(cached)
    bm.free(other)
    again = make_req(list(range(2 * BS)) + [1])
    assert bm.allocate(again) == 2 * BS
    bm.free(again)


def test_eviction_drops_the_hash_so_a_reused_block_never_hits(bm):
    run_and_free(bm, list(range(2 * BS)))
    filler = make_req([100 + i for i in range(8 * BS)])  # takes every block, evicting a's
    assert bm.can_allocate(filler)
    bm.allocate(filler)
    bm.free(filler)
    b = make_req(list(range(2 * BS)) + [1])
    assert bm.allocate(b) == 0
    bm.free(b)


def test_can_allocate_counts_free_cached_hits_once(bm):
    run_and_free(bm, list(range(4 * BS)))
    b = make_req(list(range(4 * BS)) + [0] * (4 * BS))  # all 8 blocks, 4 of them cached and free
    assert bm.can_allocate(b)
    assert bm.allocate(b) == 4 * BS
    assert bm.num_free_blocks == 0
    bm.free(b)


def test_append_slot_grows_the_table_only_at_block_boundaries(bm):
    req = make_req(list(range(BS)))
    bm.allocate(req)
    assert bm.may_append(req, BS) and bm.append_slot(req, BS) == []
    new = bm.append_slot(req, BS + 1)
    assert len(new) == 1 and req.block_table[-1] == new[0]
    hog = make_req(list(range(6 * BS)))
    bm.allocate(hog)
    assert not bm.may_append(req, 2 * BS + 1)
    bm.free(hog)
    bm.free(req)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_req(list(range(2 * BS)))
    bm.allocate(a)
    computed(bm, a)
    b = make_req(list(range(2 * BS)) + [1])
    assert bm.allocate(b) == 0 and bm.num_cached_tokens == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
