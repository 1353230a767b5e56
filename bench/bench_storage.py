"""Storage benchmark: writer vs numpy.tofile, validate vs hashlib, chunk sizes, compression.

Prints one JSON object. Every figure is a ratio against a baseline measured in the same run on the
same tokens (real GPT-2 tokens of the dev corpus when ../shared is present, else the standard
library's sources as byte ids):

* ``writer``: ShardWriter (buffer, chunked HDF5 appends, inline sha256, rename) vs ``ndarray.tofile``.
* ``write_share_of_build``: writer seconds / tokenizer seconds for the same tokens (tiktoken GPT-2,
  the fastest tokenizer we use): the share of a build spent storing (target <= 5%).
* ``validate``: validate_corpus bytes/s vs hashlib.sha256 bytes/s x workers, for 1 and 2 workers; also
  vs hashlib in N forked processes, and CPU seconds per GB of each (robust to other load).
* ``chunk_tokens``: write MB/s, sequential read MB/s and random 4,097-token window reads per chunk size.
* ``compression``: none / gzip / lzf / zstd (hdf5plugin): write MB/s, read MB/s, size ratio.
* ``open``: ``open_corpus`` per shard (the reader's checks at open + the index read) vs bare h5py
  opening each shard and reading its index.
* ``disk`` (``--only-disk``): bytes on disk per token of real builds (``build_corpus`` of the dev
  corpus with its defaults, and a many-task build of it with 1 MiB tasks), with the breakdown per
  part (raw token chunks, compressed final chunks, offsets, ids, flags, checksums, HDF5 metadata),
  the structural figure that counts every final chunk's tokens at their raw 2 bytes instead of
  compressed, and what peers' formats store for the same documents (computed from their layouts).

Usage: python bench/bench_storage.py [--tokens N] [--out FILE] [--repeat N] [--only-validate] [--only-disk]
"""

from __future__ import annotations

import argparse
import hashlib
import json
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

from h5corpus.storage.manifest import Manifest, write_manifest  # noqa: E402
from h5corpus.storage.writer import ShardWriter  # noqa: E402
from testkit.corpora import BYTE_IDENTITY, byte_encode, gpt2_tiktoken, read_jsonl_texts, stdlib_texts  # noqa: E402


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
    """Write ``docs`` as one train shard under ``root`` with its manifest; return (ShardRecord, Corpus)."""
    from h5corpus.storage.reader import open_corpus

    info = write_shard(root / "shards" / "train.h5", docs, ident, chunk_tokens, **kw)
    m = Manifest(
        tokenizer=ident,
        dtype="uint16" if ident.vocab_size <= 65536 else "uint32",
        chunk_tokens=chunk_tokens,
        shards=[info.relative_to(root / "manifests")],
    )
    write_manifest(root / "manifests" / "shards.json", m)
    return info, open_corpus(root / "manifests" / "shards.json")


# Timed in a fresh, small process like the CLI's (the bench process holds GBs of arrays). Prints
# JSON: per repeat, wall seconds and CPU seconds (user + sys, all threads and children) of one call.
_VALIDATE_TIMER = """
import json, resource, sys, time
from h5corpus.storage.validate import validate_corpus
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
runs = []
for _ in range(int(sys.argv[3])):
    c, t = cpu(), time.perf_counter()
    r = validate_corpus(sys.argv[1], workers=int(sys.argv[2]))
    runs.append((time.perf_counter() - t, cpu() - c))
    assert r.ok, r.findings
print(json.dumps({"runs": runs, "bytes": r.bytes_hashed}))
"""


def _forked_hashlib(setup: str, child: str) -> str:
    """A timing script: ``setup`` once, then per repeat N forked processes each running ``child``
    (with ``i`` = its index, ``n`` = N), timed from the first fork to the last exit. Arguments:
    N, repeats, then the script's own. Prints JSON like _VALIDATE_TIMER."""
    body = "\n".join("            " + line for line in child.strip().splitlines())
    return f"""
import hashlib, json, os, resource, sys, time
n = int(sys.argv[1])
args = sys.argv[3:]
{setup.strip()}
runs = []
for _ in range(int(sys.argv[2])):
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
{body}
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    w = time.perf_counter() - t
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    runs.append((w, c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime))
print(json.dumps({{"runs": runs, "bytes": nbytes}}))
"""


# The second baseline: the same bytes, loaded in a fresh process, hashed by N forked processes
# (one contiguous 1/N slice each).
_FORKED_HASHLIB = _forked_hashlib(
    "import numpy as np\nbuf = np.fromfile(args[0], dtype=np.uint8)\nnbytes = int(buf.size)\n"
    "cuts = [buf.size * k // n for k in range(n + 1)]",
    "hashlib.sha256(buf[cuts[i] : cuts[i + 1]]).digest()",
)

# ``ls shards/*.h5 | xargs -P N sha256sum`` in Python: N forked processes, each hashing whole shard
# files (assigned round-robin) with hashlib.file_digest, which reads them through a reused buffer.
_FILE_HASHLIB = _forked_hashlib(
    "nbytes = sum(os.path.getsize(p) for p in args)",
    "for p in args[i::n]:\n    with open(p, 'rb') as fh:\n        hashlib.file_digest(fh, 'sha256').digest()",
)


def _best_run(script: str, *argv) -> tuple[float, float, int]:
    """Run a timing script in a fresh interpreter; (best wall s, CPU s of that run, bytes)."""
    res = subprocess.run(
        [sys.executable, "-c", script, *map(str, argv)], capture_output=True, text=True, check=True, cwd=REPO
    )
    got = json.loads(res.stdout)
    wall, cpu = min(got["runs"])
    return wall, cpu, got["bytes"]


def bench_validate(
    vroot: Path, docs, flat: np.ndarray, ident, repeat: int, shards: int = 4, shard_tokens: int | None = None
) -> list[dict]:
    """validate_corpus (1 and 2 workers) vs hashlib.sha256 over ``shards`` shards of ``shard_tokens``
    tokens (default: the build's default shard size, 2^27 tokens = 256 MiB of uint16; 4 of them).

    Hashing speed does not depend on content: the tokens are repeated to fill the shards, which
    have the size a build writes, so per-shard costs weigh what they weigh in a real corpus (with
    8 shards of 50 MB they cost ~7% more). Two baselines over the same bytes in memory: single-process
    ``hashlib`` x workers (the target: ratio_per_worker >= 0.8) and ``hashlib`` in N forked
    processes (what N cores really sustain here); and one over the shard files as they lie on disk
    (page cache): ``xargs -P N sha256sum``, i.e. the reading a file hash cannot avoid, which the
    in-memory baselines leave out. CPU seconds per GB (user + sys, every
    thread and child) are reported too: they are robust to other load on the machine, wall is not.
    """
    from h5corpus.build.run.runner import DEFAULT_SHARD_TOKENS
    from h5corpus.storage.format import DEFAULT_CHUNK_TOKENS

    per = int(shard_tokens or DEFAULT_SHARD_TOKENS)
    copies = -(-shards * per // flat.size)
    vdocs = docs * copies
    m = Manifest(tokenizer=ident, dtype=str(flat.dtype), chunk_tokens=DEFAULT_CHUNK_TOKENS)
    k = acc = 0
    part = []
    for d in vdocs + [None]:
        if d is not None:
            part.append(d)
            acc += d.size
        if part and (acc >= per or d is None):
            info = write_shard(vroot / "shards" / "train" / f"train-{k:05d}.h5", part, ident, DEFAULT_CHUNK_TOKENS)
            m.shards.append(info.relative_to(vroot / "manifests"))
            part, acc, k = [], 0, k + 1
    write_manifest(vroot / "manifests" / "shards.json", m)
    vflat = np.concatenate([flat] * copies)
    raw = vroot / "tokens.bin"  # outside shards/: validate would report it as unlisted otherwise
    vflat.tofile(raw)
    t_hash = best(lambda: hashlib.sha256(vflat).hexdigest(), repeat=repeat)
    hash_Bps = vflat.nbytes / t_hash
    c = time.process_time()
    hashlib.sha256(vflat).hexdigest()
    hash_cpu = (time.process_time() - c) / vflat.nbytes * 1e9
    vflat = None  # free the copy before the timed runs (it is 2x the corpus)
    rows = []
    for workers in (1, 2):
        t_v, cpu_v, nbytes = _best_run(_VALIDATE_TIMER, vroot / "manifests" / "shards.json", workers, repeat)
        t_f, cpu_f, fbytes = _best_run(_FORKED_HASHLIB, workers, repeat, raw)
        assert fbytes == nbytes
        files = [str(vroot / "manifests" / e.path) for e in m.shards]
        t_s, cpu_s, sbytes = _best_run(_FILE_HASHLIB, workers, repeat, *files)
        v_Bps, f_Bps = nbytes / t_v, nbytes / t_f
        rows.append(
            {
                "workers": workers,
                "shards": len(m.shards),
                "shard_tokens": per,
                "bytes": nbytes,
                "validate_MBps": round(v_Bps / 1e6, 1),
                "hashlib_MBps_x_workers": round(hash_Bps * workers / 1e6, 1),
                "ratio_per_worker": round(v_Bps / (hash_Bps * workers), 3),
                "hashlib_forked_MBps": round(f_Bps / 1e6, 1),
                "ratio_vs_forked_hashlib": round(v_Bps / f_Bps, 3),
                # sha256sum of the shard files (whole files, HDF5 metadata included: sbytes >= bytes)
                "sha256sum_files_MBps": round(sbytes / t_s / 1e6, 1),
                "ratio_vs_sha256sum_files": round(v_Bps / (sbytes / t_s), 3),
                "cpu_s_per_GB": {
                    "validate": round(cpu_v / nbytes * 1e9, 3),
                    "hashlib": round(hash_cpu, 3),
                    "hashlib_forked": round(cpu_f / nbytes * 1e9, 3),
                },
            }
        )
    return rows


def bench_open(root: Path, docs, ident, shards: int, repeat: int) -> dict:
    """``open_corpus`` (manifest, every shard's checks at open, index read) per shard vs the least
    an open must do: h5py opening each file and reading its three index datasets."""
    import h5py

    from h5corpus.storage.reader import open_corpus

    m = Manifest(tokenizer=ident, dtype="uint16" if ident.vocab_size <= 65536 else "uint32", chunk_tokens=4096)
    per = max(1, len(docs) // shards)
    for k in range(shards):
        part = docs[k * per : (k + 1) * per] or docs[:1]
        info = write_shard(root / "shards" / "train" / f"train-{k:05d}.h5", part, ident, 4096)
        m.shards.append(info.relative_to(root / "manifests"))
    write_manifest(root / "manifests" / "shards.json", m)
    paths = [root / "manifests" / e.path for e in m.shards]

    def bare() -> None:
        for p in paths:
            with h5py.File(p, "r") as f:
                f["doc_offsets"][()]
                if "doc_ids" in f:  # format version 3; version 4: ids and flags in the sidecar
                    f["doc_ids"][()], f["doc_flags"][()]
                else:
                    Path(str(p) + ".docs").read_bytes()

    t_open = best(lambda: open_corpus(root / "manifests" / "shards.json", "train"), repeat=repeat)
    t_bare = best(bare, repeat=repeat)
    return {
        "shards": shards,
        "documents_per_shard": per,
        "open_ms_per_shard": round(t_open / shards * 1e3, 3),
        "bare_h5py_index_ms_per_shard": round(t_bare / shards * 1e3, 3),
        "ratio_bare_vs_open": round(t_bare / t_open, 3),
    }


def shard_breakdown(path: Path) -> dict[str, int]:
    """Bytes of one shard file by part, from HDF5's own storage sizes (the rest is metadata)."""
    import h5py

    from h5corpus.storage import format as fmt

    size = path.stat().st_size
    with h5py.File(path, "r") as f:
        stored = {k: int(f[k].id.get_storage_size()) for k in f}
        t = f[fmt.TOKENS]
        n, C = t.shape[0], t.chunks[0]
        tail = n - (n // C) * C
        offsets, _ = fmt.chunk_byte_layout(t, n, size)
        compressed_tail = offsets is not None and offsets.size > 0 and offsets[-1] < 0
        tail_stored = t.id.get_chunk_info_by_coord(((n // C) * C,)).size if compressed_tail else 0
    out = {
        "file": size,
        "tokens": n,
        "tail_tokens": tail if compressed_tail else 0,
        "raw_chunks": stored[fmt.TOKENS] - tail_stored,
        "compressed_tail": tail_stored,
        "offsets": stored[fmt.DOC_OFFSETS],
        "ids": stored.get(fmt.DOC_IDS, 0),  # format version 4: 0 (in the sidecar)
        "flags": stored.get(fmt.DOC_FLAGS, 0),
        "sidecar": fmt.docs_path(path).stat().st_size if fmt.docs_path(path).exists() else 0,
        "checksums": stored.get(fmt.CHUNK_CHECKSUMS, 0),
    }
    out["metadata"] = size - sum(stored.values())
    return out


def bench_disk(root: Path) -> dict:
    """Bytes per token of the dev corpus built with the defaults and with 1 MiB tasks (many shards)."""
    from h5corpus.build import BuildConfig, build_corpus
    from h5corpus.storage.manifest import read_manifest

    shared = Path(os.environ.get("H5CORPUS_SHARED", REPO.parent / "shared"))
    dev, tok = shared / "corpora" / "dev", shared / "tokenizers" / "gpt2" / "tokenizer.json"
    if not dev.is_dir() or not tok.exists():
        return {"skipped": f"needs the dev corpus and GPT-2 tokenizer under {shared}"}
    out: dict = {}
    for name, task_bytes in (("dev_default_build", None), ("dev_many_task_build", 1 << 20)):
        where = root / name
        kw = {} if task_bytes is None else {"task_bytes": task_bytes}
        cfg = BuildConfig(
            sources=[str(dev)],
            tokenizer=str(tok),
            shards_dir=where / "shards",
            manifest=where / "manifests" / "shards.json",
            workers=2,
            **kw,
        )
        build_corpus(cfg)
        m = read_manifest(where / "manifests" / "shards.json")
        parts: dict[str, int] = {}
        for sh in m.shards:
            for k, v in shard_breakdown(m.shard_path(sh)).items():
                parts[k] = parts.get(k, 0) + v
        T, D = parts["tokens"], sum(sh.documents for sh in m.shards)
        structural = parts["file"] - parts["compressed_tail"] + 2 * parts["tail_tokens"]
        out[name] = {
            "shards": len(m.shards),
            "tasks_bytes": task_bytes or "default",
            "tokens": T,
            "documents": D,
            "tokens_per_document": round(T / D, 1),
            "bytes": parts["file"],
            "bytes_per_token": round(parts["file"] / T, 4),
            "bytes_per_token_without_ids": round((parts["file"] - parts["ids"] - parts["flags"]) / T, 4),
            "bytes_per_token_with_sidecars": round((parts["file"] + parts["sidecar"]) / T, 4),  # format v4
            "structural_bytes_per_token": round(structural / T, 4),
            "structural_bytes_per_token_without_ids": round((structural - parts["ids"] - parts["flags"]) / T, 4),
            "final_chunk_tokens_share": round(parts["tail_tokens"] / T, 4),
            "compressed_final_chunk_bytes_per_token": round(parts["compressed_tail"] / max(parts["tail_tokens"], 1), 3),
            "per_token": {k: round(v / T, 5) for k, v in parts.items() if k not in ("file", "tokens", "tail_tokens")},
            "metadata_bytes_per_shard": round(parts["metadata"] / len(m.shards)),
            # What other formats store for the same tokens and documents (from their layouts):
            # nanoGPT: the uint16 tokens alone; datatrove: + one uint64 end per document; Megatron
            # (.bin + .idx): + int32 size, int64 pointer and int64 document index per document.
            "peers_bytes_per_token": {
                "nanogpt_bin": 2.0,
                "datatrove": round((2 * T + 8 * D) / T, 4),
                "megatron_bin_idx": round((2 * T + 20 * D + 8) / T, 4),
            },
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repeat", type=int, default=5, help="validate section: timed runs per figure (best is kept)")
    ap.add_argument("--only-validate", action="store_true", help="run only the validate section")
    ap.add_argument("--only-open", action="store_true", help="run only the reader's open-cost section")
    ap.add_argument("--only-disk", action="store_true", help="run only the bytes-per-token section (real builds)")
    ap.add_argument("--open-shards", type=int, default=64, help="open section: number of shards")
    ap.add_argument("--validate-shards", type=int, default=4, help="validate section: number of shards")
    ap.add_argument(
        "--validate-shard-tokens",
        type=int,
        default=None,
        help="validate section: tokens per shard (default: the build's default shard size)",
    )
    args = ap.parse_args()
    if args.only_disk:
        tmp = Path(tempfile.mkdtemp(prefix="h5corpus-bench-disk-"))
        try:
            emit({"bench": "storage", "format_version": 2, "disk": bench_disk(tmp)}, args.out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return

    docs, ident, enc_s, source = load_tokens(args.tokens)
    flat = np.concatenate(docs).astype(np.uint16 if ident.vocab_size <= 65536 else np.uint32)
    n_tokens, nbytes = flat.size, flat.nbytes
    tmp = Path(tempfile.mkdtemp(prefix="h5corpus-bench-"))
    out: dict = {
        "bench": "storage",
        "format_version": 2,
        "tokens": int(n_tokens),
        "bytes": int(nbytes),
        "source": source,
        "cpus": os.cpu_count(),
    }
    try:
        if args.only_open:
            out["open"] = bench_open(tmp / "o", docs, ident, args.open_shards, args.repeat)
            emit(out, args.out)
            return
        if args.only_validate:
            out["validate"] = bench_validate(
                tmp / "v", docs, flat, ident, args.repeat, args.validate_shards, args.validate_shard_tokens
            )
            emit(out, args.out)
            return

        # -- writer vs tofile ------------------------------------------------------------------
        def tofile():
            flat.tofile(tmp / "flat.bin")

        def tofile_hash():
            flat.tofile(tmp / "flat.bin")
            hashlib.sha256(flat).hexdigest()

        t_tofile = best(tofile)
        t_tofile_hash = best(tofile_hash)
        from h5corpus.storage.format import DEFAULT_CHUNK_TOKENS

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
            rows.append(
                {
                    "chunk_tokens": ct,
                    "chunk_KiB": ct * flat.itemsize // 1024,
                    "write_MBps": round(nbytes / t_w / 1e6, 1),
                    "seq_read_MBps": round(nbytes / t_seq / 1e6, 1),
                    "random_4097_windows_per_s": round(len(starts) / t_rand),
                    "random_ratio_vs_memmap": round(t_mm / t_rand, 3),
                    "file_bytes": info.bytes,
                }
            )
            c.close()
        out["chunk_tokens"] = rows

        out["open"] = bench_open(tmp / "o", docs, ident, args.open_shards, args.repeat)

        # -- validate vs hashlib ----------------------------------------------------------------
        out["validate"] = bench_validate(
            tmp / "v", docs, flat, ident, args.repeat, args.validate_shards, args.validate_shard_tokens
        )

        # -- compression (seed exercise) ----------------------------------------------------------
        filters = [
            ("none", {}),
            ("gzip-4", dict(compression="gzip", compression_opts=4)),
            ("lzf", dict(compression="lzf")),
        ]
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
            crow.append(
                {
                    "filter": name,
                    "write_MBps": round(nbytes / t_w / 1e6, 1),
                    "read_MBps": round(nbytes / t_r / 1e6, 1),
                    "size_ratio": round(nbytes / info.bytes, 3),
                }
            )
            c.close()
        out["compression"] = crow
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    emit(out, args.out)


if __name__ == "__main__":
    main()
