"""Storage benchmark: writer vs numpy.tofile, validate vs hashlib, chunk sizes, compression.

Prints one JSON object. Every figure is a ratio against a baseline measured in the same run on the
same tokens (real GPT-2 tokens of the dev corpus when ../shared is present, else the standard
library's sources as byte ids):

* ``writer``: ShardWriter (buffer, chunked HDF5 appends, inline sha256, rename) vs ``ndarray.tofile``.
* ``write_share_of_build``: writer seconds / tokenizer seconds for the same tokens (tiktoken GPT-2,
  the fastest tokenizer we use): the share of a build spent storing (target <= 5%).
* ``validate``: validate_corpus bytes/s vs hashlib.sha256 bytes/s x workers, for 1 and 2 workers.
* ``chunk_tokens``: write MB/s, sequential read MB/s and random 4,097-token window reads per chunk size.
* ``compression``: none / gzip / lzf / zstd (hdf5plugin): write MB/s, read MB/s, size ratio.

Usage: python bench/bench_storage.py [--tokens N] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _report import emit  # bench/ is on sys.path when a bench runs as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from corpus_util import gpt2_tiktoken, BYTE_IDENTITY, byte_encode, read_jsonl_texts, stdlib_texts  # noqa: E402
from h5corpus.manifest import Manifest, ShardEntry, write_manifest  # noqa: E402
from h5corpus.writer import ShardWriter  # noqa: E402


def best(fn, repeat=3):
    """Best wall time of ``repeat`` runs (hot cache), seconds."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def load_tokens(limit_tokens: int):
    """(docs as int arrays with EOS, identity, encode seconds, source name)."""
    gpt2 = gpt2_tiktoken()
    if gpt2 is not None:
        enc, ident, dev = gpt2
        texts = read_jsonl_texts(dev)
        t0 = time.perf_counter()
        ids = enc.encode_ordinary_batch(texts, num_threads=1)
        enc_s = time.perf_counter() - t0
        source = "dev corpus, GPT-2 (tiktoken, 1 thread)"
    else:
        texts = stdlib_texts(limit=100000)
        t0 = time.perf_counter()
        ids = byte_encode(texts)
        enc_s = time.perf_counter() - t0
        ident = BYTE_IDENTITY
        source = "stdlib sources, byte ids"
    docs, n = [], 0
    for a in ids:
        d = np.append(np.asarray(a, dtype=np.int64), ident.eos_id)
        docs.append(d)
        n += d.size
        if n >= limit_tokens:
            break
    enc_s *= n / max(sum(len(a) + 1 for a in ids), 1)
    return docs, ident, enc_s, source


def write_shard(path: Path, docs, ident, chunk_tokens, **kw):
    flat = np.concatenate(docs)
    lengths = np.fromiter((d.size for d in docs), dtype=np.int64)
    ids = np.zeros((len(docs), 32), np.uint8)
    ids[:, :8] = np.arange(len(docs), dtype="<u8").view(np.uint8).reshape(-1, 8)
    w = ShardWriter(path, split="train", tokenizer=ident, chunk_tokens=chunk_tokens, **kw)
    # feed in batches of ~256 documents like the build does
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(0, len(docs), 256):
        j = min(i + 256, len(docs))
        w.add_documents(flat[starts[i] : starts[j]], lengths[i:j], ids[i:j])
    return w.close()


def single_shard_corpus(root: Path, docs, ident, chunk_tokens: int, **kw):
    """Write ``docs`` as one train shard under ``root`` with its manifest; return (ShardInfo, Corpus)."""
    from h5corpus.reader import open_corpus

    info = write_shard(root / "shards" / "train.h5", docs, ident, chunk_tokens, **kw)
    m = Manifest(tokenizer=ident, dtype="uint16" if ident.vocab_size <= 65536 else "uint32", chunk_tokens=chunk_tokens,
                 shards=[ShardEntry.from_info(info, root / "manifests")])
    write_manifest(root / "manifests" / "shards.json", m)
    return info, open_corpus(root / "manifests" / "shards.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    docs, ident, enc_s, source = load_tokens(args.tokens)
    flat = np.concatenate(docs).astype(np.uint16 if ident.vocab_size <= 65536 else np.uint32)
    n_tokens, nbytes = flat.size, flat.nbytes
    tmp = Path(tempfile.mkdtemp(prefix="h5corpus-bench-"))
    out: dict = {"bench": "storage", "format_version": 1, "tokens": int(n_tokens), "bytes": int(nbytes), "source": source,
                 "cpus": os.cpu_count()}
    try:
        # -- writer vs tofile ------------------------------------------------------------------
        def tofile():
            flat.tofile(tmp / "flat.bin")

        def tofile_hash():
            flat.tofile(tmp / "flat.bin")
            hashlib.sha256(flat).hexdigest()

        t_tofile = best(tofile)
        t_tofile_hash = best(tofile_hash)
        from h5corpus.format import DEFAULT_CHUNK_TOKENS

        t_writer = best(lambda: write_shard(tmp / "w.h5", docs, ident, DEFAULT_CHUNK_TOKENS))
        out["writer"] = {
            "chunk_tokens": DEFAULT_CHUNK_TOKENS,
            "writer_MBps": round(nbytes / t_writer / 1e6, 1),
            "tofile_MBps": round(nbytes / t_tofile / 1e6, 1),
            "ratio_vs_tofile": round(t_tofile / t_writer, 3),
            "ratio_vs_tofile_plus_sha256": round(t_tofile_hash / t_writer, 3),
        }
        out["write_share_of_build"] = {
            "tokenizer_seconds": round(enc_s, 3),
            "writer_seconds": round(t_writer, 3),
            "share": round(t_writer / (enc_s + t_writer), 4),
            "note": "writer time (appends + sha256 + rename) as a fraction of tokenize+write for the same tokens, 1 core",
        }

        # -- chunk size ------------------------------------------------------------------------
        from h5corpus.reader import open_corpus

        rows = []
        rng = np.random.default_rng(0)
        for ct in (1 << 14, 1 << 16, 1 << 18, 1 << 20):
            root = tmp / f"c{ct}"
            t_w = best(lambda: write_shard(root / "shards" / "train.h5", docs, ident, ct), repeat=2)
            info, c = single_shard_corpus(root, docs, ident, ct)
            buf = np.empty(n_tokens, dtype=flat.dtype)
            t_seq = best(lambda: c.tokens(0, n_tokens, out=buf))
            starts = rng.integers(0, n_tokens - 4097, 2000)
            t_rand = best(lambda: [c.tokens(int(s), int(s) + 4097) for s in starts])
            mm = np.memmap(tmp / "flat.bin", dtype=flat.dtype, mode="r")
            t_mm = best(lambda: [np.array(mm[int(s) : int(s) + 4097]) for s in starts])
            rows.append({
                "chunk_tokens": ct, "chunk_KiB": ct * flat.itemsize // 1024,
                "write_MBps": round(nbytes / t_w / 1e6, 1),
                "seq_read_MBps": round(nbytes / t_seq / 1e6, 1),
                "random_4097_windows_per_s": round(len(starts) / t_rand),
                "random_ratio_vs_memmap": round(t_mm / t_rand, 3),
                "file_bytes": info.bytes,
            })
            c.close()
        out["chunk_tokens"] = rows

        # -- validate vs hashlib ----------------------------------------------------------------
        vroot = tmp / "v"
        # hashing speed does not depend on content: 20 copies give ~400 MB in 8 shards, enough that
        # the worker pool's start-up (tens of ms) does not dominate
        copies = 20
        vdocs = docs * copies
        per = max(n_tokens * copies // 8, 1)
        m = Manifest(tokenizer=ident, dtype=str(flat.dtype), chunk_tokens=DEFAULT_CHUNK_TOKENS)
        k = 0
        acc = 0
        part = []
        for d in vdocs:
            part.append(d)
            acc += d.size
            if acc >= per:
                info = write_shard(vroot / "shards" / "train" / f"train-{k:05d}.h5", part, ident, DEFAULT_CHUNK_TOKENS)
                m.shards.append(ShardEntry.from_info(info, vroot / "manifests"))
                part, acc, k = [], 0, k + 1
        if part:
            info = write_shard(vroot / "shards" / "train" / f"train-{k:05d}.h5", part, ident, DEFAULT_CHUNK_TOKENS)
            m.shards.append(ShardEntry.from_info(info, vroot / "manifests"))
        write_manifest(vroot / "manifests" / "shards.json", m)
        vflat = np.concatenate([flat] * copies)
        t_hash = best(lambda: hashlib.sha256(vflat).hexdigest())
        hash_Bps = vflat.nbytes / t_hash
        vrows = []
        # Timed in a fresh, small process like the CLI's (this bench process holds GBs of arrays,
        # which would make forking the worker pool itself the cost being measured).
        timer = ("import sys, time; from h5corpus.validate import validate_corpus; ts = []\n"
                 "for _ in range(3):\n"
                 "    t = time.perf_counter(); r = validate_corpus(sys.argv[1], workers=int(sys.argv[2]))\n"
                 "    ts.append(time.perf_counter() - t); assert r.ok, r.findings\n"
                 "print(min(ts))")
        for workers in (1, 2):
            res = subprocess.run([sys.executable, "-c", timer, str(vroot / "manifests" / "shards.json"), str(workers)],
                                 capture_output=True, text=True, check=True, cwd=REPO)
            t_v = float(res.stdout.strip())
            vrows.append({
                "workers": workers, "shards": len(m.shards),
                "validate_MBps": round(vflat.nbytes / t_v / 1e6, 1),
                "hashlib_MBps_x_workers": round(hash_Bps * workers / 1e6, 1),
                "ratio_per_worker": round((vflat.nbytes / t_v) / (hash_Bps * workers), 3),
            })
        out["validate"] = vrows

        # -- compression (seed exercise) ----------------------------------------------------------
        filters = [("none", {}), ("gzip-4", dict(compression="gzip", compression_opts=4)), ("lzf", dict(compression="lzf"))]
        try:
            import hdf5plugin

            filters.append(("zstd-3", dict(compression=hdf5plugin.Zstd(clevel=3))))
        except ImportError:
            out["compression_note"] = "hdf5plugin not installed: zstd skipped"
        crow = []
        for name, kw in filters:
            root = tmp / f"z-{name}"
            p = root / "shards" / "train.h5"
            t_w = best(lambda: write_shard(p, docs, ident, DEFAULT_CHUNK_TOKENS, **kw), repeat=2)
            info, c = single_shard_corpus(root, docs, ident, DEFAULT_CHUNK_TOKENS, **kw)
            buf = np.empty(n_tokens, dtype=flat.dtype)
            t_r = best(lambda: c.tokens(0, n_tokens, out=buf))
            assert np.array_equal(buf, flat)
            crow.append({
                "filter": name, "write_MBps": round(nbytes / t_w / 1e6, 1), "read_MBps": round(nbytes / t_r / 1e6, 1),
                "size_ratio": round(nbytes / info.bytes, 3),
            })
            c.close()
        out["compression"] = crow
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    emit(out, args.out)


if __name__ == "__main__":
    main()
