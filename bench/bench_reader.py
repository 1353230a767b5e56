"""Reader benchmark: read paths, whole VarlenBatches, DataLoader workers, chunk size, compression.

Prints one JSON object (and writes it to ``--out`` if given). Every rate comes with a ratio against
a numpy memmap over the *same tokens* (a flat ``.bin`` of the corpus written in this run), measured
in the same run on the same windows, hot page cache unless a section says "cold":

* ``api``: ``Corpus.tokens`` random windows (1,025 and 4,097 tokens) and ``Corpus.document`` (random
  documents by index), verified (format v2), against the bare memmap slice copy of the same ranges
  in the same process (``mm[a:b].copy()`` and ``np.array(mm[a:b])``: the faster is the baseline).
* ``verify``: verification's cost: an epoch of the window loader (epoch mode, 8 x 1,024) and of the
  best-fit loader (buffer mode, 8 x 1,024 packs), through their public API, on a corpus opened fresh
  per round (so every chunk is verified again: the first-touch cost counts) with ``verify=True``
  and ``verify=False``, interleaved; plus the steady state (the same corpus, chunks verified).
* ``read_paths``: one random window (seq_len + 1 tokens) per read, per way of reading HDF5:
  ``ds[a:b]`` with the default 1 MiB or a 64 MiB chunk cache, ``ds[a:b]`` with the cache off,
  one low-level ``H5Dread`` (cache off; the reader's path for compressed/live shards), and the
  reader's memory map at the chunk offsets HDF5 reports (its path for raw shards).
* ``batches``: SlidingWindowDataset yielding whole VarlenBatches (8 windows) vs bare memmap copies of
  the same windows into a fresh (8, seq_len + 1) array, and vs nanoGPT's get_batch (int64 x, y);
  epoch and random mode, seq_len 1024 and 4096, with and without document masking. Two batch rows:
  ``batch_compact`` (the batch as the loader yields it: compact 2-byte rows, what crosses to a worker's
  parent and to the GPU) and ``batch_fields_cpu`` (the same plus ``input_ids``, ``targets`` and
  ``position_ids`` materialized as int64 on the CPU: the cost a CPU consumer pays).
* ``dataloader``: windows/s through ``DataLoader(batch_size=None)`` with 0, 1 and 2 workers (best of
  ``--dl-rounds`` runs; compact batches as received, plus bytes per batch that cross processes).
* ``chunk_size``: the seed's exercise 4, chunks of half, one and two windows (seq_len 1024): hot
  windows/s per read path, and cold-cache windows/s plus bytes the kernel read from storage per window.
* ``compressed``: gzip and lzf shards (HDF5 path) vs the same windows from memmap.

Data: the dev corpus tokenized with GPT-2 (tiktoken) when ../shared is present, else the standard
library's sources as byte ids. Usage: python bench/bench_reader.py [--tokens N] [--out FILE] [--quick] [--sections a,b]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch
from _report import emit  # bench/ is on sys.path when a bench runs as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from h5corpus.loaders.bestfit import BestFitDataset  # noqa: E402
from h5corpus.loaders.window import SlidingWindowDataset  # noqa: E402
from h5corpus.storage import format as fmt  # noqa: E402
from h5corpus.storage.format import TokenizerIdentity  # noqa: E402
from h5corpus.storage.manifest import Manifest, write_manifest  # noqa: E402
from h5corpus.storage.reader import open_corpus  # noqa: E402
from h5corpus.storage.readpaths import H5Tokens  # noqa: E402
from h5corpus.storage.writer import ShardWriter  # noqa: E402
from testkit.corpora import BYTE_IDENTITY, byte_encode, gpt2_tiktoken, read_jsonl_texts, stdlib_texts  # noqa: E402

B = 8  # windows per batch throughout
SECTIONS = ("api", "verify", "read_paths", "batches", "dataloader", "chunk_size", "compressed")


# -- data ----------------------------------------------------------------------------------------------


def load_tokens(limit: int) -> tuple[np.ndarray, np.ndarray, TokenizerIdentity, str]:
    """(flat uint16 tokens with an EOS after each document, document lengths, identity, source)."""
    gpt2 = gpt2_tiktoken()
    if gpt2 is not None:
        enc, ident, dev = gpt2
        ids = enc.encode_ordinary_batch(read_jsonl_texts(dev), num_threads=os.cpu_count() or 1)
        source = "dev corpus, GPT-2 (tiktoken)"
    else:
        ids = byte_encode(stdlib_texts(limit=100000))
        ident = BYTE_IDENTITY
        source = "stdlib sources, byte ids"
    docs, n = [], 0
    for a in ids:
        if not len(a):
            continue
        docs.append(np.append(np.asarray(a, dtype=np.uint16), np.uint16(ident.eos_id)))
        n += docs[-1].size
        if n >= limit:
            break
    lengths = np.array([d.size for d in docs], np.int64)
    return np.concatenate(docs), lengths, ident, source


def write_shards(
    root: Path,
    flat: np.ndarray,
    lengths: np.ndarray,
    ident: TokenizerIdentity,
    *,
    chunk_tokens: int,
    shard_tokens: int,
    compression: str | None = None,
) -> Path:
    """Shards of ``flat`` (documents never split) + manifest under ``root``; returns the manifest."""
    mpath = root / "manifests" / "shards.json"
    m = Manifest(tokenizer=ident, dtype="uint16", chunk_tokens=chunk_tokens)
    ends = np.cumsum(lengths)
    lo_doc, k = 0, 0
    while lo_doc < lengths.size:
        hi_doc = int(np.searchsorted(ends, (ends[lo_doc - 1] if lo_doc else 0) + shard_tokens)) + 1
        hi_doc = min(max(hi_doc, lo_doc + 1), lengths.size)
        a, b = (int(ends[lo_doc - 1]) if lo_doc else 0), int(ends[hi_doc - 1])
        n = hi_doc - lo_doc
        doc_ids = np.frombuffer(
            b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(lo_doc, hi_doc)), np.uint8
        ).reshape(n, 32)
        with ShardWriter(
            root / "shards" / "train" / f"train-{k:05d}.h5",
            split="train",
            tokenizer=ident,
            chunk_tokens=chunk_tokens,
            compression=compression,
        ) as w:
            w.add_documents(flat[a:b], lengths[lo_doc:hi_doc], doc_ids)
        m.shards.append(w.info.relative_to(mpath.parent))
        lo_doc, k = hi_doc, k + 1
    write_manifest(mpath, m)
    return mpath


# -- timing --------------------------------------------------------------------------------------------


def interleaved(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Best (minimum) seconds per call of each fn over ``rounds`` interleaved rounds: other load on
    the machine only ever adds time, and interleaving exposes every fn to the same conditions."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: page cache, chunk maps, lazy opens
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: min(v) for k, v in times.items()}


def read_bytes() -> int:
    """Bytes this process made the kernel fetch from storage (Linux /proc/self/io), or -1."""
    try:
        for line in open("/proc/self/io"):
            if line.startswith("read_bytes"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def drop_page_cache(paths: list[Path]) -> None:
    """Evict the files' pages from the page cache (POSIX_FADV_DONTNEED; no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def memmap_copy(mm: np.ndarray, n: int) -> Callable[[np.ndarray], np.ndarray]:
    """Bare memmap copies: the windows of ``starts`` into a fresh (len, n) array."""

    def run(starts: np.ndarray) -> np.ndarray:
        out = np.empty((starts.size, n), dtype=mm.dtype)
        for j, a in enumerate(starts.tolist()):
            out[j] = mm[a : a + n]
        return out

    return run


def nanogpt_get_batch(mm: np.ndarray, L: int) -> Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]]:
    """nanoGPT's get_batch on the same memmap (x, y as int64 tensors, no pinning)."""

    def run(starts: np.ndarray):
        x = torch.stack([torch.from_numpy(mm[a : a + L].astype(np.int64)) for a in starts.tolist()])
        y = torch.stack([torch.from_numpy(mm[a + 1 : a + 1 + L].astype(np.int64)) for a in starts.tolist()])
        return x, y

    return run


# -- sections --------------------------------------------------------------------------------------------


def bench_api(manifest: Path, mm: np.ndarray, rounds: int, quick: bool) -> dict:
    """Corpus.tokens windows and Corpus.document vs memmap slice copies of the same ranges."""
    c = open_corpus(manifest, "train")
    assert c.verified
    rng = np.random.default_rng(1)
    out: dict = {"verified": c.verified}
    n_calls = 500 if quick else 4000
    for L in (1024, 4096):
        n = L + 1
        starts = rng.integers(0, c.num_tokens - n, n_calls).tolist()

        def corpus_tokens():
            for a in starts:
                c.tokens(a, a + n)

        def memmap_copy_method():
            for a in starts:
                mm[a : a + n].copy()

        def memmap_np_array():
            for a in starts:
                np.array(mm[a : a + n])

        t = interleaved({"tokens": corpus_tokens, "mm_copy": memmap_copy_method, "mm_array": memmap_np_array}, rounds)
        base = min(t["mm_copy"], t["mm_array"])
        out[f"tokens_seq_len_{L}"] = {
            "calls_per_s": round(n_calls / t["tokens"]),
            "memmap_calls_per_s": round(n_calls / base),
            "vs_memmap": round(base / t["tokens"], 3),
            "us_per_call": round(t["tokens"] / n_calls * 1e6, 2),
            "memmap_us_per_call": round(base / n_calls * 1e6, 2),
        }
    docs = rng.integers(0, c.num_documents, n_calls).tolist()
    offs = np.asarray(c.doc_offsets)

    def corpus_document():
        for i in docs:
            c.document(i)

    def memmap_docs_copy():
        for i in docs:
            mm[offs[i] : offs[i + 1]].copy()

    def memmap_docs_array():
        for i in docs:
            np.array(mm[offs[i] : offs[i + 1]])

    t = interleaved({"document": corpus_document, "mm_copy": memmap_docs_copy, "mm_array": memmap_docs_array}, rounds)
    base = min(t["mm_copy"], t["mm_array"])
    out["document"] = {
        "calls_per_s": round(n_calls / t["document"]),
        "memmap_calls_per_s": round(n_calls / base),
        "vs_memmap": round(base / t["document"], 3),
        "us_per_call": round(t["document"] / n_calls * 1e6, 2),
        "memmap_us_per_call": round(base / n_calls * 1e6, 2),
        "mean_tokens": round(float(np.diff(offs)[docs].mean()), 1),
    }
    c.close()
    return out


def bench_verify(manifest: Path, rounds: int, quick: bool) -> dict:
    """Epochs of both loaders on freshly opened corpora, verify=True vs verify=False."""
    L = 1024
    limit = 300 if quick else None  # batches per epoch run

    def window_epoch(verify: bool, corpus=None):
        c = corpus or open_corpus(manifest, "train", verify=verify)
        for _ in itertools.islice(iter(SlidingWindowDataset(c, L, batch_size=B, seed=0)), limit):
            pass

    def bestfit_epoch(verify: bool, corpus=None):
        c = corpus or open_corpus(manifest, "train", verify=verify)
        for _ in itertools.islice(iter(BestFitDataset(c, max_seq_len=L, batch_size=B, seed=0)), limit):
            pass

    steady = {v: open_corpus(manifest, "train", verify=v) for v in (True, False)}
    fns = {
        "window_fresh_verified": lambda: window_epoch(True),
        "window_fresh_unverified": lambda: window_epoch(False),
        "bestfit_fresh_verified": lambda: bestfit_epoch(True),
        "bestfit_fresh_unverified": lambda: bestfit_epoch(False),
        "window_steady_verified": lambda: window_epoch(True, steady[True]),
        "window_steady_unverified": lambda: window_epoch(False, steady[False]),
        "bestfit_steady_verified": lambda: bestfit_epoch(True, steady[True]),
        "bestfit_steady_unverified": lambda: bestfit_epoch(False, steady[False]),
    }
    t = interleaved(fns, rounds)
    out: dict = {"seq_len": L, "batch_size": B, "batches_per_run": limit or "epoch"}
    for loader in ("window", "bestfit"):
        for kind in ("fresh", "steady"):
            v, u = t[f"{loader}_{kind}_verified"], t[f"{loader}_{kind}_unverified"]
            out[f"{loader}_{kind}"] = {
                "verified_s": round(v, 4),
                "unverified_s": round(u, 4),
                "cost_pct": round((v / u - 1) * 100, 1),
            }
    return out


def bench_read_paths(manifest: Path, mm: np.ndarray, rounds: int, quick: bool) -> dict:
    """Per-window read cost of each HDF5 read path vs the memmap, random windows inside shard 0."""
    c = open_corpus(manifest, "train")
    path = c.paths[0]
    n0 = int(c.shard_token_starts[1])
    # plain h5py handles as a user would open them (first: HDF5 wants one SWMR flag per file)
    f_default = h5py.File(path, "r")
    f_64m = h5py.File(path, "r", rdcc_nbytes=64 << 20, rdcc_nslots=100_003)
    f_off = h5py.File(path, "r", rdcc_nbytes=0)
    mmap_reader = c._reader(0)
    assert mmap_reader.kind == "mmap"
    mmap_reader.ensure(0, len(mmap_reader.ready) - 1)  # verified once: the steady state is timed
    out: dict = {"chunk_tokens": c.chunk_tokens}
    low = H5Tokens(path, False, c.chunk_tokens, c.dtype)
    rng = np.random.default_rng(0)
    for L in (1024, 4096):
        n = L + 1
        fast = rng.integers(0, n0 - n, 300 if quick else 2000)
        slow = fast[: max(20, fast.size // 10)]
        buf = np.empty(n, np.uint16)

        def loop(starts, read):
            def run():
                for a in starts.tolist():
                    read(a, buf)

            return run

        ds_d, ds_m, ds_o = f_default["tokens"], f_64m["tokens"], f_off["tokens"]
        arr = np.asarray(mm)  # the same mapping as a plain ndarray: no np.memmap slicing overhead
        fns = {
            "memmap": loop(fast, lambda a, o: o.__setitem__(slice(None), mm[a : a + n])),
            "memmap_as_ndarray": loop(fast, lambda a, o: o.__setitem__(slice(None), arr[a : a + n])),
            "h5py_slice_default_cache": loop(slow, lambda a, o: o.__setitem__(slice(None), ds_d[a : a + n])),
            "h5py_slice_64MiB_cache": loop(slow, lambda a, o: o.__setitem__(slice(None), ds_m[a : a + n])),
            "h5py_slice_cache_off": loop(fast, lambda a, o: o.__setitem__(slice(None), ds_o[a : a + n])),
            "H5Dread_cache_off": loop(fast, lambda a, o: low.read(a, a + n, o)),
            "chunk_mmap": loop(fast, lambda a, o: mmap_reader.read(a, a + n, o)),
        }
        t = interleaved(fns, rounds)
        per_win = {k: v / (slow.size if "default" in k or "64MiB" in k else fast.size) for k, v in t.items()}
        base = per_win["memmap"]
        out[f"seq_len_{L}"] = {
            k: {"windows_per_s": round(1 / v), "vs_memmap": round(base / v, 3)} for k, v in per_win.items()
        }
    for f in (f_default, f_64m, f_off):
        f.close()
    low.close()
    c.close()
    return out


def bench_batches(manifest: Path, mm: np.ndarray, rounds: int, quick: bool) -> dict:
    """Whole VarlenBatches from SlidingWindowDataset vs bare memmap copies of the same windows."""
    c = open_corpus(manifest, "train")
    out: dict = {}
    for L in (1024, 4096):
        K = (150 if quick else 1200) * 1024 // L  # batches per timed run
        for mode in ("epoch", "random"):
            for dm in (False, True):
                ds = SlidingWindowDataset(c, L, batch_size=B, seed=0, mode=mode, document_mask=dm)
                starts = ds.plan()[: K * B]
                base, ngpt = memmap_copy(mm, L + 1), nanogpt_get_batch(mm, L)

                def compact():
                    for _ in itertools.islice(iter(ds), K):
                        pass

                def fields_cpu():
                    for b in itertools.islice(iter(ds), K):
                        b.input_ids, b.targets, b.position_ids  # noqa: B018 (materializes int64 fields)

                fns = {
                    "memmap_bare_copies": lambda: [base(starts[i : i + B]) for i in range(0, starts.size, B)],
                    "nanogpt_get_batch": lambda: [ngpt(starts[i : i + B]) for i in range(0, starts.size, B)],
                    "batch_compact": compact,
                    "batch_fields_cpu": fields_cpu,
                }
                t = interleaved(fns, rounds)
                b0, g0 = t["memmap_bare_copies"], t["nanogpt_get_batch"]
                key = f"seq_len_{L}/{mode}" + ("/document_mask" if dm else "")
                out[key] = {
                    k: {
                        "windows_per_s": round(K * B / v),
                        "tokens_per_s": round(K * B * L / v),
                        "vs_memmap": round(b0 / v, 3),
                        "vs_nanogpt": round(g0 / v, 3),
                    }
                    for k, v in t.items()
                }
    c.close()
    return out


def bench_dataloader(manifest: Path, mm: np.ndarray, quick: bool, rounds: int = 3) -> dict:
    """Windows/s through DataLoader(batch_size=None) with 0, 1, 2 workers (steady state, best of
    ``rounds`` interleaved runs), and the bytes of one batch that cross from a worker."""
    from torch.utils.data import DataLoader

    c = open_corpus(manifest, "train")
    out: dict = {"cpus": os.cpu_count()}
    for L in (1024, 4096):
        K = (100 if quick else 600) * 1024 // L
        ds = SlidingWindowDataset(c, L, batch_size=B, seed=0)
        starts = ds.plan()[: K * B]
        base = memmap_copy(mm, L + 1)
        t = interleaved({"m": lambda: [base(starts[i : i + B]) for i in range(0, starts.size, B)]}, 3)["m"]
        one = next(iter(ds))
        row: dict = {
            "memmap_bare_copies_in_process": {"windows_per_s": round(K * B / t)},
            "bytes_per_batch_crossing": one.nbytes,  # the compact buffer (pickled alone)
            "bytes_per_batch_int64_fields": 3 * 8 * one.num_tokens,
        }
        best = {nw: 0.0 for nw in (0, 1, 2)}
        for _ in range(rounds):
            for nw in (0, 1, 2):
                loader = DataLoader(ds, batch_size=None, num_workers=nw, prefetch_factor=4 if nw else None)
                it = iter(loader)
                for _ in range(10):  # start-up (fork, first opens) is not steady state
                    next(it)
                t0 = time.perf_counter()
                n = 0
                for b in itertools.islice(it, K):
                    n += b.num_packs
                best[nw] = max(best[nw], n / (time.perf_counter() - t0))
                del it, loader
        for nw, rate in best.items():
            row[f"workers_{nw}"] = {
                "windows_per_s": round(rate),
                "tokens_per_s": round(rate * L),
                "vs_memmap": round(rate / (K * B / t), 3),
            }
        out[f"seq_len_{L}"] = row
    c.close()
    return out


def bench_chunk_sizes(flat: np.ndarray, lengths: np.ndarray, ident: TokenizerIdentity, work: Path, quick: bool) -> dict:
    """Exercise 4: chunk = half, one and two windows (seq_len 1024), epoch-mode windows."""
    L = 1024
    n_docs = int(np.searchsorted(np.cumsum(lengths), 4_000_000)) + 1  # ~4M tokens: one shard each
    sub_len = lengths[:n_docs]
    sub = flat[: int(sub_len.sum())]
    base_path = work / "chunk-baseline.bin"
    sub.tofile(base_path)
    out: dict = {"seq_len": L, "tokens": int(sub.size)}
    cold_n = 40  # few enough that read-ahead cannot pull the whole ~8 MB shard into the cache
    hot_n = 400 if quick else 3000
    for chunk in (L // 2, L, 2 * L):
        root = work / f"chunk-{chunk}"
        if root.exists():
            shutil.rmtree(root)
        man = write_shards(root, sub, sub_len, ident, chunk_tokens=chunk, shard_tokens=1 << 40)
        c = open_corpus(man, "train")
        shard = Path(c.paths[0])
        starts = SlidingWindowDataset(c, L, seed=0).plan()
        row: dict = {"chunk_tokens": chunk}

        def readers():
            mm = np.memmap(base_path, dtype=np.uint16, mode="r")
            cm = open_corpus(man, "train")
            f_def = h5py.File(shard, "r")
            low = H5Tokens(str(shard), False, chunk, np.dtype(np.uint16))
            buf = np.empty(L + 1, np.uint16)
            ds = f_def["tokens"]
            fns = {
                "memmap": lambda s: [buf.__setitem__(slice(None), mm[a : a + L + 1]) for a in s.tolist()],
                "chunk_mmap": lambda s: cm.gather(s, L + 1),
                "H5Dread_cache_off": lambda s: [low.read(a, a + L + 1, buf) for a in s.tolist()],
                "h5py_slice_default_cache": lambda s: [
                    buf.__setitem__(slice(None), ds[a : a + L + 1]) for a in s.tolist()
                ],
            }
            return fns, (mm, cm, f_def, low)

        # hot
        fns, handles = readers()
        t = interleaved({k: (lambda f=f: f(starts[:hot_n])) for k, f in fns.items()}, 3)
        b0 = t["memmap"]
        row["hot"] = {k: {"windows_per_s": round(hot_n / v), "vs_memmap": round(b0 / v, 3)} for k, v in t.items()}
        # cold: each path starts from an empty page cache, fresh handles, same windows; best of 3
        row["cold"] = {}
        for k in list(fns):
            best_dt, best_rb = float("inf"), -1
            for _ in range(3):
                del fns, handles  # unmap and close everything, so the eviction below takes effect
                fns, handles = readers()
                fns[k](starts[-1:])  # opens: HDF5 metadata / chunk map in memory, then evict the data
                drop_page_cache([base_path, shard])
                r0, t0 = read_bytes(), time.perf_counter()
                fns[k](starts[:cold_n])
                dt = time.perf_counter() - t0
                if dt < best_dt:
                    best_dt, best_rb = dt, read_bytes() - r0
            row["cold"][k] = {
                "windows_per_s": round(cold_n / best_dt),
                "storage_KiB_per_window": round(best_rb / cold_n / 1024, 1) if best_rb >= 0 else None,
            }
        del fns, handles
        c.close()
        out[f"chunk_{chunk}"] = row
    return out


def bench_compressed(flat: np.ndarray, lengths: np.ndarray, ident: TokenizerIdentity, work: Path, quick: bool) -> dict:
    """gzip and lzf shards through the HDF5 path (chunk cache of 8 chunks) vs memmap windows."""
    L = 1024
    n_docs = int(np.searchsorted(np.cumsum(lengths), 4_000_000)) + 1
    sub_len = lengths[:n_docs]
    sub = flat[: int(sub_len.sum())]
    base_path = work / "chunk-baseline.bin"
    mm = np.memmap(base_path, dtype=np.uint16, mode="r")
    out: dict = {"seq_len": L, "chunk_tokens": fmt.DEFAULT_CHUNK_TOKENS}
    K = 10 if quick else 40
    for comp in ("gzip", "lzf"):
        root = work / f"comp-{comp}"
        if root.exists():
            shutil.rmtree(root)
        man = write_shards(
            root, sub, sub_len, ident, chunk_tokens=fmt.DEFAULT_CHUNK_TOKENS, shard_tokens=1 << 40, compression=comp
        )
        c = open_corpus(man, "train")
        assert c.read_paths() == ["h5py"]
        row = {}
        for mode in ("epoch", "random"):
            ds = SlidingWindowDataset(c, L, batch_size=B, seed=0, mode=mode)
            starts = ds.plan()[: K * B]
            base = memmap_copy(mm, L + 1)
            t = interleaved(
                {
                    "memmap": lambda: [base(starts[i : i + B]) for i in range(0, starts.size, B)],
                    "batch_compact": lambda: [None for _ in itertools.islice(iter(ds), K)],
                },
                3,
            )
            row[mode] = {
                "windows_per_s": round(K * B / t["batch_compact"]),
                "vs_memmap": round(t["memmap"] / t["batch_compact"], 4),
            }
        out[comp] = row
        c.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=12_000_000, help="use at most this many tokens (default 12M)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (best reported)")
    ap.add_argument("--quick", action="store_true", help="small workloads (smoke run, noisy numbers)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    if sections - set(SECTIONS):
        ap.error(f"unknown sections: {sorted(sections - set(SECTIONS))}")

    work = args.workdir or Path(tempfile.mkdtemp(prefix="h5corpus-bench-reader-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        flat, lengths, ident, source = load_tokens(args.tokens)
        base_path = work / "tokens.bin"
        flat.tofile(base_path)
        mm = np.memmap(base_path, dtype=np.uint16, mode="r")
        manifest = write_shards(
            work / "main", flat, lengths, ident, chunk_tokens=fmt.DEFAULT_CHUNK_TOKENS, shard_tokens=4_000_000
        )
        result = {
            "bench": "reader",
            "format_version": fmt.FORMAT_VERSION,
            "source": source,
            "tokens": int(flat.size),
            "documents": int(lengths.size),
            "shards": len(json.loads(manifest.read_text())["shards"]),
            "chunk_tokens": fmt.DEFAULT_CHUNK_TOKENS,
            "windows_per_batch": B,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "numpy": np.__version__,
                "h5py": h5py.__version__,
                "hdf5": h5py.version.hdf5_version,
                "torch": torch.__version__,
            },
            "rounds": args.rounds,
        }
        if "api" in sections:
            result["api"] = bench_api(manifest, mm, args.rounds, args.quick)
        if "verify" in sections:
            result["verify"] = bench_verify(manifest, args.rounds, args.quick)
        if "read_paths" in sections:
            result["read_paths"] = bench_read_paths(manifest, mm, args.rounds, args.quick)
        if "batches" in sections:
            result["batches"] = bench_batches(manifest, mm, args.rounds, args.quick)
        if "dataloader" in sections:
            result["dataloader"] = bench_dataloader(manifest, mm, args.quick)
        if "chunk_size" in sections or "compressed" in sections:  # compressed reuses chunk_size's baseline file
            result["chunk_size"] = bench_chunk_sizes(flat, lengths, ident, work, args.quick)
        if "compressed" in sections:
            result["compressed"] = bench_compressed(flat, lengths, ident, work, args.quick)
        result["seconds"] = round(time.perf_counter() - t_start, 1)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()
