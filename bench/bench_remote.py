"""Epoch throughput of a corpus read from an S3-protocol server through the node cache, against
the local path and against a plain s3fs copy of the same bytes (docs/READING.md, "Corpora on
object storage").

    python bench/bench_remote.py [--copies 4] [--repeats 3] [--out bench/results/remote.json]

Starts moto's S3 server on loopback (testkit/objectstores.py), uploads a byte-tokenized corpus
(the standard library's sources, ``--copies`` variants of each) with ``h5corpus upload``'s
library call, then measures back to back, ``--repeats`` rounds, in this one process:

* **copy**: ``s3fs.S3FileSystem.get`` of the split's shard objects into a folder (the link rate
  of a plain copy of the same bytes, client start included);
* **fill**: ``open_corpus(s3://...)`` with an empty cache and ``run_table()``: every shard fetched
  (``prefetch_workers`` at once), proven against the manifest (the published manifest's
  ``file_sha256``, hashed while the bytes arrive), renamed and opened; **cold**: fill plus the
  window loader's epoch; GETs per shard from the server's request log; the fill again from the
  same shards under a manifest without file hashes (the fallback proofs: ``"sha256"``, validate's
  checks, and ``"checksums"``);
* **local / warm**: each loader's epoch over the corpus opened from the local manifest and over
  the one opened through the full cache (opening timed apart: one GET of the manifest);
* **cold epochs**: ``open_corpus`` on an empty cache and straight into an epoch (no fill first),
  each loader with the global shuffle and with ``shuffle_block_shards=--block-shards`` (the
  best-fit loader's plans from plan files written from the local manifest beforehand, as
  ``h5corpus plan`` does), with the time to the first batch and the shards cached by then; each
  beside the same loader's epoch with the same settings from the local path.

Figures are medians over rounds of ratios measured back to back within a round (every round is
in the JSON with the load average; also this process's CPU seconds for the copy and the fill,
and the time to sha256 the split's bytes in memory): warm / local epoch on open corpora (target
>= 0.9), fill and cold bytes/s over the plain copy's (target >= 0.8). A cold epoch can beat
neither the link nor the local epoch: it is also stated over the slower of the two (max of the
copy's and the local epoch's seconds over its own) and over downloading everything first, then
running locally (their sum over its own; above 1: the epoch overlaps its downloads). The server's
CPU seconds beside the client's tell what bounds the link on a small machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import RESULTS, emit  # noqa: E402
from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus  # noqa: E402
from h5corpus.loaders.bestfit import write_plans  # noqa: E402
from h5corpus.storage.cache import verify_shard  # noqa: E402
from h5corpus.storage.format import ShardExpectation  # noqa: E402
from h5corpus.storage.manifest import read_manifest  # noqa: E402
from h5corpus.storage.publish import upload_corpus  # noqa: E402
from h5corpus.storage.remote import RemoteOptions  # noqa: E402
from testkit.corpora import BYTE_IDENTITY, byte_encode, stdlib_texts, write_corpus  # noqa: E402
from testkit.objectstores import MotoS3  # noqa: E402


def cpu_s() -> float:
    """CPU seconds of this process so far (every thread: the client's side of a transfer)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def dataset(corpus, loader: str, blocks: int | None = None, plan_dir: Path | None = None):
    if loader == "bestfit":
        return BestFitDataset(corpus, 1024, 8, 64, seed=0, shuffle_block_shards=blocks, plan_dir=plan_dir)
    return SlidingWindowDataset(corpus, 1024, 8, seed=0, shuffle_block_shards=blocks)


def epoch(source, loader: str) -> tuple[float, int]:
    """(seconds, tokens) of one epoch of ``loader`` over ``source`` (a path, URL or Corpus)."""
    t0 = time.perf_counter()
    corpus = source if not isinstance(source, (str, Path)) else open_corpus(source)
    tokens = 0
    for b in dataset(corpus, loader):
        tokens += int(b.num_tokens)
    return time.perf_counter() - t0, tokens


def cold_epoch(url: str, cache: Path, loader: str, blocks: int | None, plans: Path) -> dict:
    """One epoch from an empty cache: open, then the loader's epoch while its shards arrive."""
    shutil.rmtree(cache, ignore_errors=True)
    os.sync()
    t0, c0 = time.perf_counter(), cpu_s()
    corpus = open_corpus(url, cache_dir=cache)
    it = iter(dataset(corpus, loader, blocks, plans if loader == "bestfit" else None))
    tokens = int(next(it).num_tokens)
    first_s, cached = time.perf_counter() - t0, int(corpus.cached_shards().sum())
    for b in it:
        tokens += int(b.num_tokens)
    out = {
        "s": time.perf_counter() - t0,
        "cpu_s": cpu_s() - c0,
        "first_batch_s": first_s,
        "cached_at_first": cached,
        "tokens": tokens,
    }
    corpus.close()
    return out


def server_cpu_s(s3: MotoS3) -> float:
    """CPU seconds the S3 server process has used so far (the other side of every transfer)."""
    fields = Path(f"/proc/{s3.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cold_epochs(url: str, manifest: Path, work: Path, blocks: int, plans: Path, flip: bool) -> dict:
    """Both loaders' cold epochs, global shuffle and block shuffle (order alternating by round),
    each beside the same loader's epoch with the same settings from the local path."""
    out = {}
    order = [(ld, b) for ld in ("window", "bestfit") for b in ((None, blocks) if not flip else (blocks, None))]
    for ld, b in order:
        tag = "global" if b is None else "block"
        for k, v in cold_epoch(url, work / "cache-cold", ld, b, plans).items():
            out[f"cold_{ld}_{tag}_{k}"] = v
        t0 = time.perf_counter()
        for _ in dataset(open_corpus(manifest), ld, b, plans if ld == "bestfit" else None):
            pass
        out[f"local_{ld}_{tag}_s"] = time.perf_counter() - t0
    return out


def plain_copy(keys: list[str], copy_dir: Path) -> tuple[float, float]:
    """(seconds, CPU seconds) of ``s3fs.S3FileSystem.get`` of ``keys`` into an empty ``copy_dir``."""
    import s3fs

    shutil.rmtree(copy_dir, ignore_errors=True)
    copy_dir.mkdir()
    os.sync()  # each timed transfer starts with no dirty pages of the previous one to write back
    t0, c0 = time.perf_counter(), cpu_s()
    s3fs.S3FileSystem(skip_instance_cache=True).get(keys, str(copy_dir) + "/")
    return time.perf_counter() - t0, cpu_s() - c0


def one_round(manifest: Path, url: str, work: Path, s3: MotoS3, hash_first: bool, blocks: int, plans: Path) -> dict:
    """One round, back to back: the plain copy, the cold epoch (cache filled, then the window
    loader's epoch), then each loader's epoch from the local path and through the warm cache."""

    train = read_manifest(manifest).shards_of("train")
    keys = [f"corpora/bench/shards/train/{Path(e.path).name}" for e in train]
    copy_dir, cache, fb_cache = work / "copy", work / "cache", work / "cache-fallback"
    for d in (cache, fb_cache):
        shutil.rmtree(d, ignore_errors=True)
    srv0 = server_cpu_s(s3)
    copy_s, copy_cpu_s = plain_copy(keys, copy_dir)
    copy_server_cpu_s = server_cpu_s(s3) - srv0
    blobs = [(copy_dir / Path(e.path).name).read_bytes() for e in train]
    t0 = time.perf_counter()
    for b in blobs:
        hashlib.sha256(b).digest()
    sha256_s = time.perf_counter() - t0
    del blobs
    m = read_manifest(manifest)
    expect = ShardExpectation.of(m.tokenizer, m.chunk_tokens, m.dtype, m.version)
    t0 = time.perf_counter()
    assert not any(verify_shard(str(copy_dir / Path(e.path).name), e, expect) for e in train)
    verify_s = time.perf_counter() - t0
    fallback: dict[str, float] = {}

    def fill_fallbacks() -> None:
        for proof in ("sha256", "checksums"):  # the same fill under a manifest without file hashes
            shutil.rmtree(fb_cache, ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            open_corpus(
                url.replace("shards.json", "plain.json"), cache_dir=fb_cache, remote=RemoteOptions(proof=proof)
            ).run_table()
            fallback[proof] = time.perf_counter() - t0

    if not hash_first:  # the order alternates between rounds: neither fill always follows the copy
        fill_fallbacks()
    before = s3.gets("corpora")
    os.sync()
    t0, c0 = time.perf_counter(), cpu_s()
    corpus = open_corpus(url, cache_dir=cache)
    corpus.run_table()  # the split fits: every shard fetched (prefetch_workers at once), verified, opened
    fill_s, fill_cpu_s = time.perf_counter() - t0, cpu_s() - c0
    cold_s = fill_s + epoch(corpus, "window")[0]
    after = s3.gets("corpora")
    corpus.close()
    if hash_first:
        fill_fallbacks()
    out = {
        "split_bytes": sum(e.bytes for e in train),
        "shards": len(train),
        "copy_s": copy_s,
        "fill_s": fill_s,
        "file_hash_fill_first": hash_first,
        "copy_cpu_s": copy_cpu_s,
        "copy_server_cpu_s": copy_server_cpu_s,
        "fill_cpu_s": fill_cpu_s,
        "sha256_s": sha256_s,
        "fill_fallback_sha256_s": fallback["sha256"],
        "fill_fallback_checksums_s": fallback["checksums"],
        "verify_s": verify_s,
        "cold_window_s": cold_s,
        "gets_per_shard": max(after[k.split("/", 1)[1]] - before[k.split("/", 1)[1]] for k in keys),
        "loadavg": os.getloadavg(),
    }
    t0 = time.perf_counter()
    warm = open_corpus(url, cache_dir=cache)
    out["open_warm_s"] = time.perf_counter() - t0  # one GET of the manifest, the client's start
    t0 = time.perf_counter()
    local = open_corpus(manifest)
    out["open_local_s"] = time.perf_counter() - t0
    for ld in ("window", "bestfit"):  # epochs on open corpora: the first one also opens every shard
        out[f"local_{ld}_s"], out[f"tokens_{ld}"] = epoch(local, ld)
        out[f"warm_{ld}_s"] = epoch(warm, ld)[0]
    warm.close()
    out["copy2_s"] = plain_copy(keys, copy_dir)[0]  # the plain copy once more, beside the cold epochs
    shutil.rmtree(copy_dir, ignore_errors=True)
    out.update(cold_epochs(url, manifest, work, blocks, plans, not hash_first))
    out["loadavg_end"] = os.getloadavg()
    return out


def cold_figures(rounds: list[dict], K: int) -> dict[str, str]:
    """The cold epochs' figures: bytes/s over the plain copy's (the mean of the round's two
    copies, one before the fill and one just before the cold epochs); over the slower of the
    link and the local epoch (a cold epoch can beat neither: max(copy, local epoch) / cold);
    over downloading first and then running locally (copy + local epoch) / cold; first batch,
    shards cached then. The local epoch has the cold one's settings (plan file, blocks)."""

    def med(f) -> float:
        return statistics.median(f(r) for r in rounds)

    def copy(r: dict) -> float:
        return (r["copy_s"] + r["copy2_s"]) / 2

    out = {}
    for ld in ("window", "bestfit"):
        plan = " (plan file)" if ld == "bestfit" else ""
        for tag, name in (("global", "global shuffle"), ("block", f"shuffle_block_shards={K}")):
            key, local = f"cold_{ld}_{tag}", f"local_{ld}_{tag}_s"
            out[f"cold epoch, {ld}{plan}, {name}, from an empty cache / plain s3fs copy"] = (
                f"{med(lambda r: copy(r) / r[key + '_s']):.2f}x"
            )
            out[f"cold epoch, {ld}{plan}, {name} / min(link rate, local epoch rate)"] = (
                f"{med(lambda r: max(copy(r), r[local]) / r[key + '_s']):.2f}x"
            )
            out[f"cold epoch, {ld}{plan}, {name} / download first, then the local epoch"] = (
                f"{med(lambda r: (copy(r) + r[local]) / r[key + '_s']):.2f}x"
            )
            out[f"cold epoch, {ld}{plan}, {name}: first batch after, shards cached then"] = (
                f"{med(lambda r: r[key + '_first_batch_s']):.2f} s, {med(lambda r: r[key + '_cached_at_first']):.0f}"
                f" of {rounds[0]['shards']}"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=24, help="variants of each stdlib source (corpus size)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--shard-tokens", type=int, default=4 << 20, help="tokens per shard (the build's default is 1 << 27: 256 MiB)"
    )
    ap.add_argument("--block-shards", type=int, default=1, help="shuffle_block_shards of the cold block epochs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        texts = [f"{t}\n# variant {k}\n" for k in range(args.copies) for t in stdlib_texts(10_000)]
        manifest = write_corpus(
            work / "corpus", texts, byte_encode, BYTE_IDENTITY, chunk_tokens=1 << 16, shard_tokens=args.shard_tokens
        )
        with MotoS3.start(work / "moto") as s3:
            os.environ.update(s3.env())
            import s3fs

            s3fs.S3FileSystem(skip_instance_cache=True).mkdir("corpora")
            upload_corpus(manifest, "s3://corpora/bench")  # the published manifest has file hashes
            plain = manifest.read_bytes()  # the same corpus under a manifest without them
            s3fs.S3FileSystem(skip_instance_cache=True).pipe_file("corpora/bench/manifests/plain.json", plain)
            url = "s3://corpora/bench/manifests/shards.json"
            plans = work / "plans"  # the best-fit plans, written offline from the local manifest
            for b in (None, args.block_shards):
                write_plans(manifest, plans, [0], max_seq_len=1024, batch_size=8, packing_buffer=64, seed=0,
                            shuffle_block_shards=b)  # fmt: skip
            rounds = [
                one_round(manifest, url, work, s3, k % 2 == 0, args.block_shards, plans) for k in range(args.repeats)
            ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = rounds[0]["split_bytes"] / 1e6

    def med(f) -> float:  # the median over rounds of a ratio measured back to back in each
        return statistics.median(f(r) for r in rounds)

    n = len(rounds)
    figures = {
        f"window: warm-cache epoch / local path (median of {n})": f"{med(lambda r: r['local_window_s'] / r['warm_window_s']):.2f}x",
        f"bestfit: warm-cache epoch / local path (median of {n})": f"{med(lambda r: r['local_bestfit_s'] / r['warm_bestfit_s']):.2f}x",
        "open_corpus, warm cache (manifest GET, client start)": f"{med(lambda r: r['open_warm_s']) * 1e3:.0f} ms",
        "cache fill (fetch + prove by file_sha256 + open) / plain s3fs copy, bytes/s": f"{med(lambda r: r['copy_s'] / r['fill_s']):.2f}x",
        "cache fill, no file hashes, proof='sha256' / plain s3fs copy": f"{med(lambda r: r['copy_s'] / r['fill_fallback_sha256_s']):.2f}x",
        "cache fill, no file hashes, proof='checksums' / plain s3fs copy": f"{med(lambda r: r['copy_s'] / r['fill_fallback_checksums_s']):.2f}x",
        "cold epoch (fill + window epoch) / plain s3fs copy, bytes/s": f"{med(lambda r: r['copy_s'] / r['cold_window_s']):.2f}x",
        **cold_figures(rounds, args.block_shards),
        "proving the split against its manifest (validate's checks, one thread)": f"{med(lambda r: mb / r['verify_s']):.0f} MB/s",
        "sha256 of the split's bytes in memory, one thread (file_sha256's cost)": f"{med(lambda r: mb / r['sha256_s']):.0f} MB/s",
        "client CPU seconds, fill / plain copy": f"{med(lambda r: r['fill_cpu_s'] / r['copy_cpu_s']):.2f}x",
        "CPU seconds of a plain copy, client + server (2 cores shared)": f"{med(lambda r: r['copy_cpu_s']):.1f} + {med(lambda r: r['copy_server_cpu_s']):.1f} s in {med(lambda r: r['copy_s']):.1f} s",
        "GETs per shard, cold (max)": str(max(r["gets_per_shard"] for r in rounds)),
        "plain s3fs copy from moto on loopback": f"{med(lambda r: mb / r['copy_s']):.0f} MB/s ({mb:.0f} MB, {rounds[0]['shards']} shards)",
    }
    emit({"rounds": rounds}, args.out, figures=figures)


if __name__ == "__main__":
    if "--out" not in sys.argv and os.environ.get("H5CORPUS_BENCH_SAVE"):
        sys.argv += ["--out", str(RESULTS / "remote.json")]
    main()
