"""KV-cache blocks: free list, per-request block tables, reference counts and the prefix cache. Invariants:
- A block is in `_free` iff its reference count is 0; `_free` evicts unhashed blocks first, then hashed ones
  least recently freed first.
- A hash in `_hash_to_block` names a FULL block whose KV is computed or being computed by a planned step (steps
  run in order and each layer stores KV before attention reads it, so a request of the same step may share it);
  it stays reusable at reference count 0 until taken for another request.
- Only blocks below a request's `num_computed_tokens` are shared and every write goes at or past it, so no request
  writes into a block another one reads."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from itertools import takewhile

import numpy as np

from scheduler.request import Request


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained SHA-256: a block's key covers every token before it."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype="<i4").tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cached_tokens = 0  # tokens served from the prefix cache, over all allocations

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, req: Request) -> bool:
        hits = self._match_prefix(req)
        reclaimed = sum(1 for b in hits if self._ref_counts[b] == 0)  # hits that sit in the free list
        return self.blocks_needed(req.num_tokens) - len(hits) <= len(self._free) - reclaimed

    def allocate(self, req: Request) -> int:
        """Give `req` blocks for all its known tokens; return how many tokens the prefix cache holds."""
        assert not req.block_table, f"request {req.request_id} already holds blocks"
        hits = self._match_prefix(req)
        for b in hits:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1
        fresh = [self._take_free() for _ in range(self.blocks_needed(req.num_tokens) - len(hits))]
        req.block_table, req.num_cached_blocks = hits + fresh, len(hits)
        self.num_cached_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def may_append(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(req.block_table) <= len(self._free)

    def append_slot(self, req: Request, num_tokens: int) -> list[int]:
        new = [self._take_free() for _ in range(self.blocks_needed(num_tokens) - len(req.block_table))]
        req.block_table.extend(new)
        return new

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the full blocks among the first `num_tokens` (computed and known) tokens."""
        full = min(num_tokens // self.block_size, len(req.block_table))
        if not self.enable_prefix_caching or full <= req.num_cached_blocks:
            return  # the common case of a decode step: no block filled
        self._compute_hashes(req, full)
        for i in range(req.num_cached_blocks, full):
            b, h = req.block_table[i], req.block_hashes[i]
            # A block computed twice (two requests missed together) keeps the first one as the key.
            if h not in self._hash_to_block and self._hashes[b] is None:
                self._hash_to_block[h], self._hashes[b] = b, h
        req.num_cached_blocks = full

    def free(self, req: Request) -> None:
        """Last blocks first: a sequence's tail (least likely shared) is evicted before its head."""
        for b in reversed(req.block_table):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None
                if self._hashes[b] is None:
                    self._free.move_to_end(b, last=False)
        req.block_table, req.num_cached_blocks = [], 0

    def _match_prefix(self, req: Request) -> list[int]:
        if not self.enable_prefix_caching or req.wants_prompt_logprobs:  # its every prompt position is computed
            return []
        # Leave the last token to compute, so the step samples (and writes no KV into a block others share).
        usable = (req.num_tokens - 1) // self.block_size
        self._compute_hashes(req, usable)
        return list(takewhile(lambda b: b is not None, map(self._hash_to_block.get, req.block_hashes[:usable])))

    def _compute_hashes(self, req: Request, num_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), num_blocks):
            parent = req.block_hashes[i - 1] if i else b""
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs]))

    def _take_free(self) -> int:
        b, _ = self._free.popitem(last=False)
        if (h := self._hashes[b]) is not None:  # evict: the block's old content is about to be overwritten
            del self._hash_to_block[h]
            self._hashes[b] = None
        self._ref_counts[b] = 1
        return b
