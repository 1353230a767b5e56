"""Build throughput vs the raw tokenizers, on the same documents and cores, in one run.

    python bench/bench_build.py [--corpus ../shared/corpora/dev] [--tokenizer ../shared/tokenizers/gpt2/tokenizer.json]
                                [--rounds 5] [--hf-rounds 1] [--task-bytes N] [--out bench/results/build.json]

Measures, best of ``--rounds`` interleaved rounds (``--hf-rounds`` for the slow ``tokenizers``
measurements, 0 skips them; the machine may be shared, and best-of filters the noise):

* raw tiktoken (the fast path's encoding, built from the same tokenizer.json, the same
  ``encode_to_numpy`` call): 1 process and 2 forked processes on chunks balanced by characters --
  texts already in memory, no I/O, no EOS, no hashing, process start-up not timed;
* raw Hugging Face ``tokenizers`` ``encode_batch_fast`` with ``RAYON_NUM_THREADS`` = 1 and 2 (each in
  a fresh subprocess, since Rayon's pool size is fixed at first use);
* ``h5corpus.build`` end to end (tokenizer load, planning, fast-path proof, reading JSONL, sha256
  ids, dedup, tokenizing, HDF5 shards, manifest) with 1 and 2 workers:
  ``build_fast_N`` -- a first build: an empty h5corpus cache (``H5CORPUS_CACHE_DIR``), so the
  vocabulary conversion and the fast-path proof run; ``build_fast_warm_N`` -- the same build again
  with the cache of an earlier one (the proof's verdict and the converted vocabulary are reused);
  ``build_tokenizers_N`` -- forced onto ``tokenizers`` (what HF-bound peers do). Builds run in this
  process, so after the first round a "first build" no longer pays ``import tokenizers`` (~15 ms).

Prints JSON: tokens, seconds and tokens/s per measurement, the ratios the issue targets
(build(2) / raw tiktoken(2) >= 0.85, build(2) / 0.85 M tokens/s >= 3, build(2) / build(1) >= 1.8),
for the first build and the warm re-run, with pass/fail, and the load average around the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _report import emit  # bench/ is on sys.path when a bench runs as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PEERS_TOKENS_PER_S = 0.85e6

_HF_SCRIPT = r"""
import json, sys, time
from tokenizers import Tokenizer
texts = [json.loads(l)["text"] for p in sys.argv[2:] for l in open(p, encoding="utf-8")]
tok = Tokenizer.from_file(sys.argv[1]); tok.encode_special_tokens = True
t0 = time.perf_counter()
n = sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t0}))
"""


def load_texts(files: list[Path]) -> list[str]:
    return [json.loads(line)["text"] for p in files for line in open(p, encoding="utf-8")]


_RAW: dict = {}


def _raw_chunk(i: int) -> int:
    enc, chunks = _RAW["enc"], _RAW["chunks"]
    none: set[str] = set()
    return sum(enc.encode_to_numpy(t, allowed_special=none, disallowed_special=()).size for t in chunks[i])


def raw_tiktoken(enc, texts: list[str], procs: int) -> tuple[int, float]:
    """Encode every text, in ``procs`` chunks balanced by characters, one process each (the way the
    build parallelizes; tiktoken 0.14 releases the GIL, so threads would scale about as well).
    Processes are forked before timing; only the encoding is timed."""
    import multiprocessing as mp

    chunks: list[list[str]] = [[] for _ in range(procs)]
    load = np.zeros(procs)
    for t in sorted(texts, key=len, reverse=True):  # longest first onto the lightest chunk
        k = int(np.argmin(load))
        chunks[k].append(t)
        load[k] += len(t)
    _RAW.update(enc=enc, chunks=chunks)
    if procs == 1:
        t0 = time.perf_counter()
        n = _raw_chunk(0)
        return n, time.perf_counter() - t0
    with mp.get_context("fork").Pool(procs) as pool:
        pool.map(abs, range(procs))  # workers are up
        t0 = time.perf_counter()
        n = sum(pool.map(_raw_chunk, range(procs), chunksize=1))
        return n, time.perf_counter() - t0


def raw_hf(tokenizer_json: Path, files: list[Path], threads: int) -> tuple[int, float]:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    p = subprocess.run(
        [sys.executable, "-c", _HF_SCRIPT, str(tokenizer_json), *map(str, files)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    d = json.loads(p.stdout)
    return d["tokens"], d["seconds"]


def run_build(
    corpus: Path, tokenizer_json: Path, workers: int, fast: bool, tmp: Path, cache: Path, task_bytes: int | None
) -> tuple[int, float, str]:
    """One fresh build (deleting the old output is not timed) with ``cache`` as h5corpus's cache."""
    import shutil

    from h5corpus.build import BuildConfig, build_corpus

    shutil.rmtree(tmp, ignore_errors=True)
    os.environ["H5CORPUS_CACHE_DIR"] = str(cache)
    extra = {} if task_bytes is None else {"task_bytes": task_bytes}
    rep = build_corpus(
        BuildConfig(
            sources=[str(corpus)],
            tokenizer=str(tokenizer_json),
            workers=workers,
            fast_path=fast,
            shards_dir=tmp / "shards",
            manifest=tmp / "manifests" / "shards.json",
            **extra,
        )
    )
    return rep.tokens - rep.documents, rep.elapsed_s, rep.encoder  # text tokens (EOS excluded), like the raw runs


def main() -> None:
    shared = Path(os.environ.get("H5CORPUS_SHARED", REPO.parent / "shared"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=shared / "corpora" / "dev")
    ap.add_argument("--tokenizer", type=Path, default=shared / "tokenizers" / "gpt2" / "tokenizer.json")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the tiktoken / fast-path measurements")
    ap.add_argument(
        "--hf-rounds", type=int, default=1, help="rounds of the (slow) tokenizers measurements; 0 skips them"
    )
    ap.add_argument(
        "--task-bytes", type=int, default=None, help="BuildConfig.task_bytes (default: the build's default)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from h5corpus.build.encoders import TiktokenEncoder, fast_encoder
    from h5corpus.build.tokenizer import load_tokenizer

    best: dict[str, tuple[int, float]] = {}
    encoders: dict[str, str] = {}

    def keep(name: str, n: int, s: float) -> None:
        if name not in best or s < best[name][1]:
            best[name] = (n, s)

    load_before = os.getloadavg()
    saved_cache = os.environ.get("H5CORPUS_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bench-build-") as td:
        os.environ["H5CORPUS_CACHE_DIR"] = str(Path(td) / "cache-setup")  # never the user's cache
        files = sorted(args.corpus.glob("*.jsonl"))
        texts = load_texts(files)
        enc = fast_encoder(load_tokenizer(str(args.tokenizer)))[0]
        assert isinstance(enc, TiktokenEncoder), "the fast path does not apply to this tokenizer"
        enc = enc.encoding
        tmp = Path(td) / "out"
        warm = Path(td) / "cache-warm"
        cold = 0
        for r in range(max(args.rounds, args.hf_rounds)):
            for fast in (True, False):
                if r >= (args.rounds if fast else args.hf_rounds):
                    continue
                for n in (1, 2):
                    if fast:
                        keep(f"raw_tiktoken_{n}", *raw_tiktoken(enc, texts, n))
                    else:
                        keep(f"raw_tokenizers_{n}", *raw_hf(args.tokenizer, files, n))
                for workers in (1, 2):
                    # first build: an empty cache; warm: the cache an earlier build of this run left
                    kinds = [("fast", True), ("fast_warm", False)] if fast else [("tokenizers", True)]
                    for kind, fresh in kinds:
                        cold += 1
                        cache = Path(td) / f"cache-cold-{cold}" if fresh else warm
                        if kind == "fast_warm" and not warm.exists():
                            run_build(args.corpus, args.tokenizer, workers, fast, tmp, warm, args.task_bytes)  # fill it
                        name = f"build_{kind}_{workers}"
                        n, s, e = run_build(args.corpus, args.tokenizer, workers, fast, tmp, cache, args.task_bytes)
                        keep(name, n, s)
                        encoders[name] = e
    if saved_cache is None:
        os.environ.pop("H5CORPUS_CACHE_DIR", None)
    else:
        os.environ["H5CORPUS_CACHE_DIR"] = saved_cache
    rate = {k: n / s for k, (n, s) in best.items()}

    def ratio(a: str, b: str) -> float | None:
        return round(rate[a] / rate[b], 3) if a in rate and b in rate else None

    ratios = {
        "build_fast_2_vs_raw_tiktoken_2": ratio("build_fast_2", "raw_tiktoken_2"),
        "build_fast_2_vs_build_fast_1": ratio("build_fast_2", "build_fast_1"),
        "build_fast_2_vs_peers_0.85M": round(rate["build_fast_2"] / PEERS_TOKENS_PER_S, 3),
        "build_fast_warm_2_vs_raw_tiktoken_2": ratio("build_fast_warm_2", "raw_tiktoken_2"),
        "build_fast_warm_2_vs_build_fast_warm_1": ratio("build_fast_warm_2", "build_fast_warm_1"),
        "build_fast_warm_2_vs_peers_0.85M": round(rate["build_fast_warm_2"] / PEERS_TOKENS_PER_S, 3),
        "build_fast_1_vs_raw_tiktoken_1": ratio("build_fast_1", "raw_tiktoken_1"),
        "build_fast_warm_1_vs_raw_tiktoken_1": ratio("build_fast_warm_1", "raw_tiktoken_1"),
        "build_tokenizers_2_vs_raw_tokenizers_2": ratio("build_tokenizers_2", "raw_tokenizers_2"),
        "build_tokenizers_2_vs_build_tokenizers_1": ratio("build_tokenizers_2", "build_tokenizers_1"),
        "build_fast_2_vs_build_tokenizers_2": ratio("build_fast_2", "build_tokenizers_2"),
    }
    checks = {}
    for run in ("build_fast", "build_fast_warm"):
        for key, want in (
            (f"{run}_2_vs_raw_tiktoken_2", 0.85),
            (f"{run}_2_vs_peers_0.85M", 3.0),
            (f"{run}_2_vs_{run}_1", 1.8),
        ):
            checks[f"{key} >= {want}"] = "pass" if (ratios[key] or 0) >= want else "FAIL"
    out = {
        "corpus": str(args.corpus),
        "documents": len(texts),
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "hf_rounds": args.hf_rounds,
        "task_bytes": args.task_bytes,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "measurements": {
            k: {"tokens": n, "seconds": round(s, 3), "tokens_per_s": round(n / s)} for k, (n, s) in best.items()
        },
        "encoders": encoders,
        "ratios": {k: v for k, v in ratios.items() if v is not None},
        "targets": checks,
    }
    emit(out, args.out)


if __name__ == "__main__":
    main()
