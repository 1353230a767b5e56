"""Build throughput per tokenizer family (``bench_build.py --families``): for each family of
``testkit.tokenizers.TOKENIZER_FAMILIES``, trained by ``tokenizers`` on a slice of the corpus, on the
same documents and ``--procs`` cores, one run each, side by side:

* raw ``tokenizers`` (``encode_batch_fast``, one Rayon thread per process);
* the raw fast encoder the build chooses for the family (its ``encode_flat`` in the build's
  batches of 2,048 documents), in forked processes (fastokens, kitoken, or the ``unigram`` port of
  ``tokenizers``' Unigram algorithm);
* ``h5corpus.build`` with ``--procs`` workers and ``fast_path=False`` (``tokenizers`` only), then
  the same build with the fast path (an empty h5corpus cache: the proof runs inside the timing).

The target: each family's build with its fast path is at least 3x its ``tokenizers``-only build.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path
from typing import Any

import orjson

_RAW: dict[str, Any] = {}
#: The issue's target: build with the fast path / build on ``tokenizers`` alone, same documents.
TARGET = 3.0


def _encode_chunk(i: int) -> tuple[int, float]:
    enc, texts = _RAW["enc"], _RAW["chunks"][i]
    sum(map(len, texts))  # copy the forked pages first (see bench_build._raw_encode)
    t0 = time.perf_counter()
    n = 0
    for a in range(0, len(texts), 2048):
        flat, _ = enc.encode_flat(texts[a : a + 2048])
        n += flat.size
    return n, time.perf_counter() - t0


def raw_fast(enc: Any, chunks: list[list[str]]) -> tuple[int, float]:
    """``enc`` on one forked process per chunk, all started together; (tokens, slowest seconds)."""
    _RAW.update(enc=enc, chunks=chunks)
    with mp.get_context("fork").Pool(len(chunks)) as pool:
        pool.map(abs, range(len(chunks)))
        res = pool.map(_encode_chunk, range(len(chunks)), chunksize=1)
    return sum(n for n, _ in res), max(s for _, s in res)


def build_once(src: Path, tokenizer: Path, workers: int, out: Path, fast_path: bool) -> tuple[int, float, str]:
    """One fresh build with an empty h5corpus cache; (text tokens, seconds, encoder that ran)."""
    from h5corpus.build import BuildConfig, build_corpus

    shutil.rmtree(out, ignore_errors=True)
    os.environ["H5CORPUS_CACHE_DIR"] = str(out / "cache")
    rep = build_corpus(
        BuildConfig(
            sources=[str(src)],
            tokenizer=str(tokenizer),
            workers=workers,
            shards_dir=out / "shards",
            manifest=out / "manifests" / "shards.json",
            fast_path=fast_path,
        )
    )
    shutil.rmtree(out, ignore_errors=True)
    return rep.tokens - rep.documents, rep.elapsed_s, rep.encoder


def family_rows(corpus: Path, procs: int, tmp: Path, raw_hf: Any, balanced: Any) -> list[dict[str, Any]]:
    """One row per family (see the module docstring); ``raw_hf`` and ``balanced`` are
    bench_build's raw ``tokenizers`` timing and its character-balanced split."""
    from h5corpus.build.tokenize.encoders import fast_encoder
    from h5corpus.build.tokenize.tokenizer import load_tokenizer
    from testkit.tokenizers import TOKENIZER_FAMILIES, train_tokenizer_family

    texts = []
    for p in sorted(corpus.glob("*.jsonl")):
        with open(p, "rb") as fh:
            texts += [orjson.loads(line)["text"] for line in fh if line.strip()]
    src = tmp / "families.jsonl"
    with open(src, "wb") as fh:
        fh.writelines(orjson.dumps({"text": t}) + b"\n" for t in texts)
    train = [t[:20_000] for t in texts[::7]]
    rows = []
    for fam in TOKENIZER_FAMILIES:
        path = tmp / fam / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(train_tokenizer_family(fam, train), encoding="utf-8")
        load = os.getloadavg()  # other work on the machine slows both builds alike: ratios count
        hf_tokens, hf_s = raw_hf(path, texts, procs, tmp)
        enc, _ = fast_encoder(load_tokenizer(str(path)))
        fast_tokens, fast_s = raw_fast(enc, balanced(texts, procs)) if enc is not None else (0, float("nan"))
        ref_tokens, ref_s, _ = build_once(src, path, procs, tmp / "out", fast_path=False)
        b_tokens, b_s, encoder = build_once(src, path, procs, tmp / "out", fast_path=True)
        assert b_tokens == ref_tokens, (fam, b_tokens, ref_tokens)
        speedup = ref_s / b_s
        rows.append(
            {
                "family": fam,
                "encoder": encoder,
                "tokens": b_tokens,
                "build_tokens_per_s": b_tokens / b_s,
                "build_tokenizers_only_tokens_per_s": ref_tokens / ref_s,
                "raw_tokenizers_tokens_per_s": hf_tokens / hf_s,
                "raw_fast_encoder": None if enc is None else enc.name,
                "raw_fast_tokens_per_s": fast_tokens / fast_s if enc is not None else None,
                "build_speedup": speedup,
                "target": f"build / tokenizers-only build >= {TARGET:g}",
                "pass": bool(speedup >= TARGET),
                "load_before": load,
            }
        )
        print(orjson.dumps(rows[-1]).decode(), flush=True)
    return rows
