"""One epoch of a loader under a real ``torchrun`` (gloo, CPU), an all-reduce per step.

Run by ``tests/test_torchrun.py``: ``torchrun --standalone --nproc_per_node N tests/ddp_epoch.py
MANIFEST OUT LOADER SAVE_AT WORKERS [PLAN_DIR]``; with PLAN_DIR the plan is
shared through plan files there (loader ``bestfit`` or ``bestfit-large``), and each rank also writes ``OUT/LOADER-RANK.npy``: the (S, 3)
``(document, start, length)`` segments of every batch it yielded, end to end. Rank and world size come from ``torch.distributed`` (the
datasets' default), also inside spawned DataLoader workers. Writes ``OUT/LOADER-RANK.json`` (every batch's digest, ``len()``, the
all-reduced token count of each step) and, after step SAVE_AT, ``OUT/LOADER-RANK.pt`` (the
StatefulDataLoader's state). A rank that ran out early would leave the other one waiting in the
all-reduce until the gloo timeout (60 s) fails the run.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus
from h5corpus.storage.manifest import Manifest, write_manifest, write_table_file
from h5corpus.storage.reader import write_layout_file
from h5corpus.storage.writer import ShardWriter
from tests.helpers import BYTE_IDENTITY, batch_digest


def make(loader: str, corpus, **kw):
    if loader == "bestfit":
        return BestFitDataset(corpus, 1024, 6, 32, seed=5, **kw)
    if loader == "bestfit-large":  # the sizes: few steps per epoch on a large corpus
        return BestFitDataset(corpus, 4096, 35, 64, seed=5, **kw)
    return SlidingWindowDataset(corpus, 700, 6, seed=5, document_mask=True, **kw)


def write_synthetic_corpus(root: Path, docs: int, shards: int, seed: int = 0) -> Path:
    """A corpus of ``docs`` random byte-id documents (lognormal lengths, median ~120 tokens, EOS
    appended) in ``shards`` shards, written through the real ShardWriter, then the manifest and,
    as a build's commit does, its layout and table files (so that ranks and their spawned workers
    open through them); returns the manifest."""
    manifest = Path(root) / "manifests" / "shards.json"
    rng = np.random.default_rng(seed)
    m = Manifest(tokenizer=BYTE_IDENTITY, dtype="uint16", chunk_tokens=1 << 16, shards_dir="../shards")
    per = -(-docs // shards)
    for s in range(shards):
        n = min(per, docs - s * per)
        lengths = np.clip(rng.lognormal(4.8, 0.8, size=n).astype(np.int64), 2, 50_000)
        flat = rng.integers(0, 256, size=int(lengths.sum()), dtype=np.uint16)
        flat[np.cumsum(lengths) - 1] = BYTE_IDENTITY.eos_id
        path = Path(root) / "shards" / "train" / f"train-{s:05d}.h5"
        w = ShardWriter(path, split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=1 << 16, fsync=False)
        w.add_documents(flat, lengths, rng.integers(0, 256, size=(n, 32), dtype=np.uint8))
        m.shards.append(w.close().relative_to(manifest.parent))
    m.splits["train"] = {"documents": docs, "tokens": sum(e.tokens for e in m.shards_of("train"))}
    write_manifest(manifest, m)
    write_layout_file(manifest)
    write_table_file(manifest)
    return manifest


def main() -> None:
    manifest, out, loader_name, save_at, workers = sys.argv[1:6]
    plan_dir = sys.argv[6] if len(sys.argv) > 6 else None
    dist.init_process_group("gloo", timeout=timedelta(seconds=600 if plan_dir else 60))
    rank = dist.get_rank()
    extra = {"plan_dir": plan_dir, "with_segments": True} if plan_dir else {}
    ds = make(loader_name, open_corpus(manifest, "train"), **extra)
    # spawned workers have no process group: the dataset carries the rank it resolved here
    kw = {"multiprocessing_context": "spawn"} if int(workers) else {}
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=int(workers), **kw)
    digests, step_tokens, segments = [], [], []
    for step, b in enumerate(loader):
        t = torch.tensor([b.num_tokens], dtype=torch.int64)
        dist.all_reduce(t)  # the collective every DDP step makes
        digests.append(batch_digest(b))
        if plan_dir:
            segments.append(b.segments.numpy())
        step_tokens.append(int(t))
        if step + 1 == int(save_at):
            torch.save(loader.state_dict(), Path(out) / f"{loader_name}-{rank}.pt")
    dist.barrier()
    if plan_dir:
        np.save(Path(out) / f"{loader_name}-{rank}.npy", np.concatenate(segments))
    record = {"digests": digests, "len": len(ds), "step_tokens": step_tokens}
    if plan_dir:
        record["segment_counts"] = [len(x) for x in segments]
    (Path(out) / f"{loader_name}-{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
