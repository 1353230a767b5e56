"""A real ``torchrun --nproc_per_node 2`` (gloo, CPU): an epoch of each loader (best-fit through a
spawned DataLoader worker, windows in-process) with an all-reduce per step completes on both ranks
with equal counts and no timeout, the ranks' batches interleave into
the single process's global sequence, and a checkpoint taken mid-epoch resumes on 1 process with
the next global batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from h5corpus import open_corpus
from tests.ddp_epoch import make
from tests.helpers import REPO, batch_digest, interleave_ranks, subprocess_env

pytest.importorskip("torchdata.stateful_dataloader")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, stdlib_corpus_texts):
    from tests.helpers import BYTE_IDENTITY, byte_encode, write_corpus

    root = tmp_path_factory.mktemp("ddp")
    manifest = write_corpus(
        root, stdlib_corpus_texts, byte_encode, BYTE_IDENTITY, chunk_tokens=4096, shard_tokens=400_000
    )
    out = root / "out"
    out.mkdir()
    for loader, workers in (("bestfit", 1), ("window", 0)):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(REPO / "tests" / "ddp_epoch.py"),
            str(manifest),
            str(out),
            loader,
            "7",
            str(workers),
        ]
        r = subprocess.run(cmd, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"torchrun {loader} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return manifest, out


@pytest.mark.parametrize("loader", ["bestfit", "window"])
def test_torchrun_two_ranks_complete_an_epoch_and_resume_on_one_process(ddp_runs, loader):
    manifest, out = ddp_runs
    ranks = [json.loads((out / f"{loader}-{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]["digests"]) == len(ranks[1]["digests"]) == ranks[0]["len"] == ranks[1]["len"]
    assert ranks[0]["step_tokens"] == ranks[1]["step_tokens"]  # both ranks took part in every all-reduce
    ref = [batch_digest(b) for b in make(loader, open_corpus(manifest, "train"))]
    M = len(ref)
    got = interleave_ranks([r["digests"] for r in ranks])
    assert got == [ref[i % M] for i in range(len(got))] and len(got) >= M
    state = torch.load(out / f"{loader}-0.pt", weights_only=True)
    ds = make(loader, open_corpus(manifest, "train"))
    ds.load_state_dict(state)  # rank 0's DataLoader state: the global position after 7 steps of 2 ranks
    assert [batch_digest(b) for b in ds] == ref[14:]
