"""Paged KV-cache blocks: allocation, ref counts and the hashed prefix cache.

A block holds ``block_size`` consecutive tokens of one sequence. A *full* block's key is
``hash(parent key, its token ids, extra keys)``, so equal keys mean equal prefixes; the extra
keys are the request's cache salt and the hashes of the images whose tokens the block holds
(two prompts with the same text and different images share no block). Freed
blocks keep their key and stay reusable until evicted, least recently freed first:

    free queue (LRU order)   [oldest-freed ......................... newest-freed]
                               ^ evicted first when a new block is needed

A request's block ids are kept on the request (``request.block_ids``); this manager owns ref
counts, keys and the free queue.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from framework.engine.multimodal_step import image_keys
from framework.engine.request import Request

if TYPE_CHECKING:
    from framework.config import CacheConfig


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


def hash_block(parent_hash: int | None, token_ids: list[int] | tuple[int, ...], extra_keys: tuple = ()) -> int:
    """The prefix-cache key of a full block: a 64-bit xxhash over the chain."""
    hasher = xxhash.xxh64()
    hasher.update(b"\x00" * 9 if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little"))
    hasher.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    if extra_keys:
        hasher.update(repr(extra_keys).encode())
    return hasher.intdigest()


class KVCacheManager:
    """Hands out blocks to requests; reuses cached full blocks when prefixes match.

    Invariants: a block is in the free queue iff its ref count is 0; ``hash_to_block`` maps
    each cached key to exactly one block holding that key; at most ``max_cached_blocks`` blocks
    hold a key.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, max_cached_blocks: int | None = None
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.max_cached_blocks = num_blocks if max_cached_blocks is None else max_cached_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_queried_tokens = 0  # prefix-cache lookups, in tokens
        self.num_hit_tokens = 0

    @classmethod
    def for_cache(cls, num_blocks: int, cache: CacheConfig) -> KVCacheManager:
        """A manager of ``num_blocks`` blocks with ``cache``'s block size and prefix-caching settings
        (``prefix_cache_max_tokens`` rounded down to whole blocks)."""
        max_tokens = cache.prefix_cache_max_tokens
        max_cached = None if max_tokens is None else max_tokens // cache.block_size
        return cls(num_blocks, cache.block_size, cache.enable_prefix_caching, max_cached)

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """How many more blocks ``request`` needs to hold ``num_new_tokens`` more tokens."""
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.num_free_blocks

    # --- prefix cache ----------------------------------------------------------------------
    def _full_block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Keys of the request's full blocks over its first ``num_tokens`` tokens (memoised)."""
        hashes = request.block_hashes
        full = num_tokens // self.block_size
        if len(hashes) < full:
            extra = (
                (request.sampling_params.cache_salt,) if getattr(request.sampling_params, "cache_salt", None) else ()
            )
            for index in range(len(hashes), full):
                start = index * self.block_size
                parent = hashes[-1] if hashes else None
                keys = extra + image_keys(request, start, start + self.block_size) if request.images else extra
                hashes.append(hash_block(parent, request.token_ids_at(start, start + self.block_size), keys))
        return hashes[:full]

    def allocate_cached_prefix(self, request: Request) -> int:
        """Attach cached blocks matching the request's prefix; return the tokens they cover.

        Called once when a waiting request (new or preempted) is first scheduled. At least one
        token is always left to compute, so the step produces logits to sample from.
        """
        assert not request.block_ids and request.num_computed_tokens == 0
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None or request.pooling:
            return 0  # prompt logprobs and pooling need every prompt position computed
        lookup_tokens = request.num_tokens - 1
        self.num_queried_tokens += request.num_tokens
        hits = []
        for block_hash in self._full_block_hashes(request, lookup_tokens):
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        for block_id in hits:
            self._ref(block_id)
        request.block_ids.extend(hits)
        num_hit = len(hits) * self.block_size
        self.num_hit_tokens += num_hit
        return num_hit

    def cache_full_blocks(self, request: Request) -> None:
        """Give keys to the request's blocks that became full of computed tokens (each block is
        considered once: one that finds its key taken or no room in the cache stays unkeyed).

        The one place that decides whether a request's blocks are keyed: every request's are,
        pooling and prompt-logprob requests included (they skip the lookup, in
        :meth:`allocate_cached_prefix`, because they need every position computed; the KV they
        write is the same causal KV that a generation request would reuse).
        """
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_keyed_blocks:
            return  # no block filled since the last call (the usual decode step)
        hashes = self._full_block_hashes(request, request.num_computed_tokens)
        start, request.num_keyed_blocks = request.num_keyed_blocks, full
        for index in range(start, full):
            block_hash = hashes[index]
            block = self.blocks[request.block_ids[index]]
            if block.block_hash is not None:
                continue
            if block_hash in self.hash_to_block or not self._make_room_in_cache():
                continue
            block.block_hash = block_hash
            self.hash_to_block[block_hash] = block.block_id

    def _make_room_in_cache(self) -> bool:
        """Keep the number of keyed blocks under the cap by dropping keys of the LRU free blocks."""
        if len(self.hash_to_block) < self.max_cached_blocks:
            return True
        for block_id in self.free_queue:
            if self.blocks[block_id].block_hash is not None:
                self._forget(self.blocks[block_id])
                return True
        return False

    def reset_prefix_cache(self) -> None:
        """Drop every key (e.g. after weights change)."""
        for block in self.blocks:
            block.block_hash = None
        self.hash_to_block.clear()

    # --- allocation ----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give ``request`` the blocks for ``num_new_tokens`` more tokens; False if too few are free."""
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._forget(block)
            block.ref_count = 1
            request.block_ids.append(block_id)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks; the last blocks of the sequence are evicted first."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        request.block_ids = []  # a new list: BlockTableSync tells a reallocated table by its identity
        request.num_keyed_blocks = 0

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == block.block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
