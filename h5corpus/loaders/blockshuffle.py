"""Epoch orders that read a bounded set of shards at a time: shard blocks and the rolling shard
window (:func:`window_order`, the best-fit loader's default; docs/PACKING.md, section 4).

Shard blocks (docs/READING.md, "Corpora on object storage"; MosaicML streaming's
``shuffle_block_size`` is the same idea): shuffled over the whole split, the first batches of an
epoch already touch most shards, so from a cold object-storage cache the epoch waits for nearly
the whole download before it starts. With ``shuffle_block_shards=K`` the epoch's order is instead:

1. the split's shards permuted by the epoch's generator;
2. consecutive groups of ``K`` shards of that permutation form the epoch's **blocks**;
3. each block's items (every item of its shards) shuffled among themselves by the same generator,
   and the blocks laid end to end.

It is still a permutation of every item (every next-token pair once per epoch), a pure function of
``(seed, epoch, K)`` and of the shard layout, and so the same global sequence on any world size and
worker count; only its items' mixing is bounded: a batch draws from the ``K`` shards of its block
(two blocks where it straddles one's end) instead of from all of them. A loader then needs the
shards block by block and prefetches the next block while it reads one (:class:`ShardBlocks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .partition import distinct_sorted, integer_arg

#: Tokens a block-shuffled loader keeps asking for beyond the blocks it reads: the next block,
#: then more until the blocks ahead hold this many tokens (256 MiB of 2-byte ids), so small
#: shards keep several downloads in flight (the cache's ``prefetch_workers`` bounds how many run
#: at once) while large ones are not all fetched at once, sharing the link, before the first
#: block is there.
PREFETCH_TOKENS = 1 << 27

#: Separates the block order's random stream from the global shuffle's.
TAG_BLOCKS = 0x424C4B53  # "BLKS"


def check_block_shards(value: Any) -> int | None:
    """``shuffle_block_shards`` as given (None: the global shuffle), or ValueError / TypeError
    naming it."""
    return None if value is None else integer_arg("shuffle_block_shards", value, 1)


def block_generator(seed: int, epoch: int, tag: int | None = None) -> np.random.Generator:
    """The generator of a block-shuffled epoch: ``default_rng([seed, epoch, (tag,) TAG_BLOCKS])``."""
    key = [int(seed), int(epoch)] + ([int(tag)] if tag is not None else []) + [TAG_BLOCKS]
    return np.random.default_rng(key)


def block_order(
    item_bounds: np.ndarray, shards_per_block: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(order, shard order) of a block-shuffled epoch (module docstring). ``item_bounds`` is the
    (shards + 1,) cumulative item count: shard ``s`` holds items ``item_bounds[s] ..
    item_bounds[s + 1] - 1``. ``order`` holds every item id once (uint32 below 2**32 items, else
    int64); ``shard order`` the (shards,) shards in the order the epoch reads them."""
    bounds = np.asarray(item_bounds, dtype=np.int64)
    counts = np.diff(bounds)
    S, K = counts.size, int(shards_per_block)
    perm = rng.permutation(S)
    n = counts[perm]
    total = int(n.sum())
    ends = np.cumsum(n)
    first = ends - n
    ids = np.arange(total, dtype=np.int64) + np.repeat(bounds[perm] - first, n)  # shard after shard
    order = ids.astype(np.uint32) if total < 2**32 else ids
    del ids
    for b in range(0, S, K):  # each block's items among themselves (one C shuffle per block)
        rng.shuffle(order[int(first[b]) : int(ends[min(b + K, S) - 1])])
    return order, perm


class ShardBlocks:
    """Which shards a block-shuffled epoch reads when: block ``b`` is shards
    ``shard_order[b * K : (b + 1) * K]``."""

    @classmethod
    def of(
        cls, shard_tokens: np.ndarray, shards_per_block: int, seed: int, epoch: int, tag: int | None = None
    ) -> ShardBlocks:
        """The blocks of the epoch :func:`block_order` orders with ``block_generator(seed, epoch,
        tag)`` (``shard_tokens``: tokens per shard): its shard order is that generator's first
        draw, ``permutation(shards)``."""
        n = int(np.asarray(shard_tokens).size)
        return cls(block_generator(seed, epoch, tag).permutation(n), shards_per_block, shard_tokens)

    def __init__(self, shard_order: np.ndarray, shards_per_block: int, shard_tokens: np.ndarray | None = None) -> None:
        self.order = np.asarray(shard_order, dtype=np.int64)
        #: tokens per shard (None: only the next block is asked for ahead)
        self.tokens = None if shard_tokens is None else np.asarray(shard_tokens, dtype=np.int64)
        self.K = int(shards_per_block)
        self.block = np.empty(self.order.size, dtype=np.int64)
        self.block[self.order] = np.arange(self.order.size) // self.K
        self.num_blocks = -(-self.order.size // self.K)

    def ahead(self, shards: np.ndarray, tokens: int | None = None) -> np.ndarray:
        """The shards to prefetch when ``shards`` are read next, in the order they are needed:
        those of every block ``shards`` touch (earliest first), then those of the next blocks:
        the next one, and more while the blocks ahead hold fewer than ``tokens`` (default
        :data:`PREFETCH_TOKENS`; only the next block when tokens per shard are unknown)."""
        want = PREFETCH_TOKENS if tokens is None else tokens
        blocks = distinct_sorted(self.block[np.asarray(shards, dtype=np.int64)]).tolist()
        if not blocks:
            return np.zeros(0, np.int64)
        last, have = blocks[-1], 0
        for nxt in range(last + 1, self.num_blocks):
            if nxt > last + 1 and (self.tokens is None or have >= want):
                break
            blocks.append(nxt)
            if self.tokens is not None:
                have += int(self.tokens[self.order[nxt * self.K : (nxt + 1) * self.K]].sum())
        return np.concatenate([self.order[b * self.K : (b + 1) * self.K] for b in blocks])


# -- the rolling shard window ------------------------------------------------------------------------

#: The best-fit loader's default ``shuffle_window_shards`` (docs/PACKING.md, section 4, "Why the
#: window is the default"):
#: at most half of the shards a reading process keeps open (``reader.MAX_OPEN_SHARDS``), so the
#: shards of the window stay open from batch to batch.
DEFAULT_WINDOW_SHARDS = 64

#: Separates the window order's random stream from the global shuffle's and the blocks'.
TAG_WINDOW = 0x57494E44  # "WIND"


def check_window_shards(value: Any) -> int | None:
    """``shuffle_window_shards`` as given (None: no window), or ValueError / TypeError naming it."""
    return None if value is None else integer_arg("shuffle_window_shards", value, 1)


def window_generator(seed: int, epoch: int) -> np.random.Generator:
    """The generator of a window-shuffled epoch: ``default_rng([seed, epoch, TAG_WINDOW])``."""
    return np.random.default_rng([int(seed), int(epoch), TAG_WINDOW])


def window_order(item_bounds: np.ndarray, window: int, rng: np.random.Generator) -> np.ndarray:
    """Every item id once, in a rolling-window order over ``window`` shards (``K``; needs
    ``K < shards``): the shards are permuted; shard ``s`` at rank ``r`` of that permutation
    deals its items, shuffled, to the ``K`` buckets ``r, r + 1, .. r + K - 1`` (mod shards) in
    multinomial shares; each bucket's items are shuffled among themselves and the buckets laid end
    to end. So every bucket mixes ``K`` shards, consecutive buckets share ``K - 1`` of them, and a
    batch inside a bucket reads at most ``K`` shards (``K + 1`` where it straddles two).
    ``item_bounds``: the (shards + 1,) cumulative item count. uint32 below 2**32 items, else
    int64; 8 bytes per item at most while it runs (the items, then the order)."""
    bounds = np.asarray(item_bounds, dtype=np.int64)
    counts = np.diff(bounds)
    S, K = counts.size, int(window)
    if not 0 < K < S:
        raise ValueError(f"window_order: window {K} needs 0 < window < shards ({S})")
    perm = rng.permutation(S)
    total = int(counts.sum())
    dt = np.uint32 if total < 2**32 else np.int64
    n = counts[perm]
    ends = np.cumsum(n)
    items = np.empty(total, dtype=dt)
    for r in range(S):  # shard after shard, each one's items shuffled: its share of a bucket is a slice
        seg = items[int(ends[r] - n[r]) : int(ends[r])]
        seg[:] = np.arange(bounds[perm[r]], bounds[perm[r] + 1], dtype=np.int64)
        rng.shuffle(seg)
    share = rng.multinomial(n, np.full(K, 1.0 / K))  # (S, K): items shard rank r gives bucket r + k
    cut = np.concatenate([(ends - n)[:, None], (ends - n)[:, None] + np.cumsum(share, axis=1)], axis=1)
    order = np.empty(total, dtype=dt)
    at = 0
    for b in range(S):
        start = at
        for k in range(K):
            r = (b - k) % S
            lo, hi = int(cut[r, k]), int(cut[r, k + 1])
            order[at : at + hi - lo] = items[lo:hi]
            at += hi - lo
        rng.shuffle(order[start:at])
    return order
