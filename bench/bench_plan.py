"""The loaders' per-process cost at scale: the best-fit plan computed in every process vs shared
through a plan file, the window loader with document masking, and rank 0 of 1 vs of 512.

    flock /work/.bench.lock python bench/bench_plan.py [--docs 2000000] [--shards 200]
        [--root /tmp/h5corpus-plan-bench] [--out bench/results/plan.json]

Writes (once, reused) a synthetic corpus through the real :class:`~h5corpus.storage.writer.ShardWriter`:
``--docs`` documents of lognormal lengths (median ~120 tokens, mean ~160), random byte ids, in
``--shards`` shards. Then each figure in a fresh process (``--probe``): ``open_corpus`` seconds
and ``RssAnon`` (anonymous resident memory, /proc/self/status) after it; best-fit first batch and
``RssAnon`` with the plan computed in the process (no ``plan_dir``); the plan file's one-off
write (``write_plans``) in seconds and per million documents, and its size; with the plan file:
``len()``, the first batch, ``RssAnon``; rank 0 of 1 and of 512 per yielded microbatch (the 10
microbatches after the first, one pack each); the window loader's first batch with ``document_mask=True``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _report import emit  # bench/ is on sys.path when a bench runs as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus  # noqa: E402
from h5corpus.loaders.bestfit import write_plans  # noqa: E402
from h5corpus.loaders.planfile import open_plan_file, plan_file_name  # noqa: E402
from h5corpus.storage.format import TokenizerIdentity  # noqa: E402
from h5corpus.storage.manifest import Manifest, write_manifest  # noqa: E402
from h5corpus.storage.writer import ShardWriter  # noqa: E402

IDENTITY = TokenizerIdentity(name="bench-bytes", revision="local", sha256="0" * 64, vocab_size=257, eos_id=256)
SETTINGS = dict(max_seq_len=4096, batch_size=35, packing_buffer=64, seed=0)


def rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_corpus(root: Path, docs: int, shards: int) -> Path:
    """The synthetic corpus's manifest, written once per (docs, shards)."""
    manifest = root / f"d{docs}-s{shards}" / "manifests" / "shards.json"
    if manifest.exists():
        return manifest
    rng = np.random.default_rng(0)
    m = Manifest(tokenizer=IDENTITY, dtype="uint16", chunk_tokens=1 << 16, shards_dir="../shards")
    per = -(-docs // shards)
    for s in range(shards):
        n = min(per, docs - s * per)
        lengths = np.clip(rng.lognormal(4.8, 0.8, size=n).astype(np.int64), 2, 50_000)
        flat = rng.integers(0, 256, size=int(lengths.sum()), dtype=np.uint16)
        flat[np.cumsum(lengths) - 1] = IDENTITY.eos_id
        w = ShardWriter(manifest.parent.parent / "shards" / "train" / f"train-{s:05d}.h5", split="train",
                        tokenizer=IDENTITY, chunk_tokens=1 << 16, fsync=False)  # fmt: skip
        w.add_documents(flat, lengths, rng.integers(0, 256, size=(n, 32), dtype=np.uint8))
        m.shards.append(w.close().relative_to(manifest.parent))
    m.splits["train"] = {"documents": docs, "tokens": sum(e.tokens for e in m.shards_of("train"))}
    write_manifest(manifest, m)
    return manifest


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def probe(kind: str, manifest: Path, plan_dir: Path) -> dict:
    """One figure, measured in this (fresh) process."""
    t_open, corpus = timed(lambda: open_corpus(manifest, "train"))
    out = {"open_s": t_open, "rss_anon_after_open_mb": rss_anon_mb()}
    if kind == "memory":
        out["first_batch_s"] = timed(lambda: next(iter(BestFitDataset(corpus, **SETTINGS))))[0]
    elif kind == "write":
        out["write_s"] = timed(lambda: write_plans(corpus, plan_dir, [0], rebuild=True, **SETTINGS))[0]
        out["file_mb"] = sum(p.stat().st_size for p in plan_dir.glob("*.h5cplan")) / 2**20
    elif kind == "file":
        ds = BestFitDataset(corpus, **SETTINGS, plan_dir=plan_dir)
        out["len_s"], out["len"] = timed(lambda: len(ds))
        out["first_batch_s"] = timed(lambda: next(iter(ds)))[0]
    elif kind.startswith("rank"):
        # one pack per microbatch, so rank 0 of 512 has 10 microbatches after its first on 2 M documents
        one = {**SETTINGS, "batch_size": 1}
        ds = BestFitDataset(corpus, **one, plan_dir=plan_dir, rank=0, world_size=int(kind[4:]))
        it = iter(ds)
        next(it)  # (writes the plan file of these settings in the first probe: not timed)
        out["per_microbatch_s"] = timed(lambda: [next(it) for _ in range(10)])[0] / 10
        # the plan's part alone, from a fresh mapping: the same 10 microbatches' segments
        W = ds.world_size
        ident = ds.plan_identity(0)
        fresh = open_plan_file(plan_dir / plan_file_name(ident["fingerprint"], ident["settings"], 0), ident)
        out["plan_per_microbatch_s"] = timed(lambda: [fresh.microbatch(g * W) for g in range(1, 11)])[0] / 10
    elif kind == "window":
        ds = SlidingWindowDataset(corpus, 4096, 35, document_mask=True)
        out["first_batch_s"] = timed(lambda: next(iter(ds)))[0]
    out["rss_anon_mb"] = rss_anon_mb()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=2_000_000)
    ap.add_argument("--shards", type=int, default=200)
    ap.add_argument("--root", type=Path, default=Path("/tmp/h5corpus-plan-bench"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    manifest = make_corpus(a.root, a.docs, a.shards)
    plan_dir = manifest.parent.parent / "plans"
    if a.probe:
        print(json.dumps(probe(a.probe, manifest, plan_dir)))
        return
    report: dict = {"docs": a.docs, "shards": a.shards, "settings": SETTINGS, "probes": {}}
    for kind in ("memory", "write", "file", "rank1", "rank512", "window"):
        p = subprocess.run([sys.executable, __file__, "--docs", str(a.docs), "--shards", str(a.shards),
                            "--root", str(a.root), "--probe", kind], capture_output=True, text=True, check=True)  # fmt: skip
        report["probes"][kind] = json.loads(p.stdout.strip().splitlines()[-1])
    pr = report["probes"]
    report["plan_write_s_per_million_docs"] = pr["write"]["write_s"] / (a.docs / 1e6)
    report["plan_file_mb_per_million_docs"] = pr["write"]["file_mb"] / (a.docs / 1e6)
    report["rank512_over_rank1"] = pr["rank512"]["per_microbatch_s"] / pr["rank1"]["per_microbatch_s"]
    report["rank512_over_rank1_plan_only"] = (
        pr["rank512"]["plan_per_microbatch_s"] / pr["rank1"]["plan_per_microbatch_s"]
    )
    emit(report, a.out)


if __name__ == "__main__":
    main()
