"""One epoch of a loader under a real ``torchrun`` (gloo, CPU), an all-reduce per step.

Run by ``tests/test_torchrun.py``: ``torchrun --standalone --nproc_per_node N tests/ddp_epoch.py
MANIFEST OUT LOADER SAVE_AT WORKERS``. Rank and world size come from ``torch.distributed`` (the
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

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus
from tests.helpers import batch_digest


def make(loader: str, corpus):
    if loader == "bestfit":
        return BestFitDataset(corpus, 1024, 6, 32, seed=5)
    return SlidingWindowDataset(corpus, 700, 6, seed=5, document_mask=True)


def main() -> None:
    manifest, out, loader_name, save_at, workers = sys.argv[1:6]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    ds = make(loader_name, open_corpus(manifest, "train"))
    # spawned workers have no process group: the dataset carries the rank it resolved here
    kw = {"multiprocessing_context": "spawn"} if int(workers) else {}
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=int(workers), **kw)
    digests, step_tokens = [], []
    for step, b in enumerate(loader):
        t = torch.tensor([b.num_tokens], dtype=torch.int64)
        dist.all_reduce(t)  # the collective every DDP step makes
        digests.append(batch_digest(b))
        step_tokens.append(int(t))
        if step + 1 == int(save_at):
            torch.save(loader.state_dict(), Path(out) / f"{loader_name}-{rank}.pt")
    dist.barrier()
    record = {"digests": digests, "len": len(ds), "step_tokens": step_tokens}
    (Path(out) / f"{loader_name}-{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
