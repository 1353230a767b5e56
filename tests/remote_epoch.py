"""One rank's epoch over a corpus URL through a shared node cache, with DataLoader workers.

Run by ``tests/test_remote.py`` (and ``bench/bench_remote.py``): ``python tests/remote_epoch.py
URL CACHE_DIR CACHE_LIMIT RANK WORLD WORKERS OUT [LOADER [BLOCK_SHARDS]]``; the storage configuration (endpoint,
credentials) comes from the environment, as in production. Writes OUT (JSON): every batch's digest
in yield order, the tokens read and the epoch's seconds. CACHE_LIMIT 0 means no limit; BLOCK_SHARDS
is the loaders' ``shuffle_block_shards`` (default: the global shuffle).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from torch.utils.data import DataLoader

from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus
from tests.helpers import batch_digest


def loader(kind: str, corpus, rank: int, world: int, blocks: int | None = None):
    if kind == "bestfit":
        return BestFitDataset(corpus, 512, 4, 16, seed=3, rank=rank, world_size=world, shuffle_block_shards=blocks)
    return SlidingWindowDataset(corpus, 256, 8, seed=3, rank=rank, world_size=world, shuffle_block_shards=blocks)


def main(argv: list[str]) -> None:
    url, cache, limit, rank, world, workers, out = argv[:7]
    kind = argv[7] if len(argv) > 7 else "window"
    blocks = int(argv[8]) if len(argv) > 8 else None
    t0 = time.perf_counter()
    corpus = open_corpus(url, cache_dir=cache, cache_limit=int(limit) or None)
    ds = loader(kind, corpus, int(rank), int(world), blocks)
    dl = DataLoader(ds, batch_size=None, num_workers=int(workers))
    digests, tokens = [], 0
    for b in dl:
        digests.append(batch_digest(b))
        tokens += int(b.num_tokens)
    Path(out).write_text(json.dumps({"digests": digests, "tokens": tokens, "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main(sys.argv[1:])
