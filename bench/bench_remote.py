"""Epoch throughput of a corpus read from an S3-protocol server through the node cache, against
the local path and against a plain s3fs copy of the same bytes (docs/READING.md, "Corpora on
object storage").

    python bench/bench_remote.py [--copies 4] [--repeats 3] [--out bench/results/remote.json]

Starts moto's S3 server on loopback (testkit/objectstores.py), uploads a byte-tokenized corpus
(the standard library's sources, ``--copies`` variants of each) with ``h5corpus upload``'s
library call, then measures side by side, ``--repeats`` rounds, in this one process:

* **local**: one epoch of each loader from the local manifest (tokens/s);
* **cold**: ``open_corpus(s3://...)`` with an empty cache, and the same epoch (downloads, their
  verification and the epoch), plus the GETs each shard took (the server's request log);
* **warm**: the same epoch again through the now-full cache (a new ``Corpus``);
* **copy**: ``s3fs.S3FileSystem.get`` of the split's shard objects into a folder (the link rate
  of a plain copy of the same bytes).

Ratios: warm / local epoch tokens/s (target >= 0.9), and the cold epoch's bytes/s over the
plain copy's (target >= 0.8). The machine's load average is recorded: on a shared machine, read
the ratios of one round, measured back to back.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import RESULTS, emit  # noqa: E402
from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus  # noqa: E402
from h5corpus.storage.manifest import read_manifest  # noqa: E402
from h5corpus.storage.publish import upload_corpus  # noqa: E402
from testkit.corpora import BYTE_IDENTITY, byte_encode, stdlib_texts, write_corpus  # noqa: E402
from testkit.objectstores import MotoS3  # noqa: E402


def epoch(source, loader: str) -> tuple[float, int]:
    """(seconds, tokens) of one epoch of ``loader`` over ``source`` (a path, URL or Corpus)."""
    t0 = time.perf_counter()
    corpus = source if not isinstance(source, (str, Path)) else open_corpus(source)
    if loader == "bestfit":
        ds = BestFitDataset(corpus, 1024, 8, 64, seed=0)
    else:
        ds = SlidingWindowDataset(corpus, 1024, 8, seed=0)
    tokens = 0
    for b in ds:
        tokens += int(b.num_tokens)
    return time.perf_counter() - t0, tokens


def one_round(manifest: Path, url: str, work: Path, s3: MotoS3, loader: str) -> dict:
    import s3fs

    m = read_manifest(manifest)
    train = m.shards_of("train")
    split_bytes = sum(e.bytes for e in train)
    local_s, tokens = epoch(manifest, loader)
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    before = s3.gets("corpora")
    t0 = time.perf_counter()
    cold_s, _ = epoch(open_corpus(url, cache_dir=cache), loader)
    cold_s = time.perf_counter() - t0
    after = s3.gets("corpora")
    gets = [
        after[f"bench/shards/train/{Path(e.path).name}"] - before[f"bench/shards/train/{Path(e.path).name}"]
        for e in train
    ]
    warm_s, _ = epoch(open_corpus(url, cache_dir=cache), loader)
    copy_dir = work / "copy"
    shutil.rmtree(copy_dir, ignore_errors=True)
    copy_dir.mkdir()
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    keys = [f"corpora/bench/shards/train/{Path(e.path).name}" for e in train]
    t0 = time.perf_counter()
    fs.get(keys, str(copy_dir) + "/")
    copy_s = time.perf_counter() - t0
    return {
        "loader": loader,
        "tokens": tokens,
        "split_bytes": split_bytes,
        "shards": len(train),
        "local_s": local_s,
        "cold_s": cold_s,
        "warm_s": warm_s,
        "copy_s": copy_s,
        "warm_over_local": local_s / warm_s,
        "cold_over_copy": copy_s / cold_s,
        "copy_MBps": split_bytes / copy_s / 1e6,
        "gets_per_shard": max(gets),
        "loadavg": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=4, help="variants of each stdlib source (corpus size)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        texts = [f"{t}\n# variant {k}\n" for k in range(args.copies) for t in stdlib_texts(10_000)]
        manifest = write_corpus(
            work / "corpus", texts, byte_encode, BYTE_IDENTITY, chunk_tokens=1 << 16, shard_tokens=4 << 20
        )
        with MotoS3.start(work / "moto") as s3:
            os.environ.update(s3.env())
            import s3fs

            s3fs.S3FileSystem(skip_instance_cache=True).mkdir("corpora")
            upload_corpus(manifest, "s3://corpora/bench")
            url = "s3://corpora/bench/manifests/shards.json"
            rounds = [
                one_round(manifest, url, work, s3, ld) for _ in range(args.repeats) for ld in ("window", "bestfit")
            ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {}
    for ld in ("window", "bestfit"):
        rs = [r for r in rounds if r["loader"] == ld]
        figures[f"{ld}: warm-cache epoch / local path (median of {len(rs)})"] = (
            f"{statistics.median(r['warm_over_local'] for r in rs):.2f}x"
        )
        figures[f"{ld}: cold-cache epoch bytes/s / plain s3fs copy (median of {len(rs)})"] = (
            f"{statistics.median(r['cold_over_copy'] for r in rs):.2f}x"
        )
    figures["GETs per shard, cold (max)"] = str(max(r["gets_per_shard"] for r in rounds))
    figures["plain s3fs copy from moto on loopback (median)"] = (
        f"{statistics.median(r['copy_MBps'] for r in rounds):.0f} MB/s"
    )
    emit({"rounds": rounds}, args.out, figures=figures)


if __name__ == "__main__":
    if "--out" not in sys.argv and os.environ.get("H5CORPUS_BENCH_SAVE"):
        sys.argv += ["--out", str(RESULTS / "remote.json")]
    main()
