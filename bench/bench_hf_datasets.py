"""Builds from Hugging Face ``datasets`` sources vs the JSONL route over the same rows, in one run.

    python bench/bench_hf_datasets.py [--corpus ../shared/corpora/dev] [--rounds 2] [--workers 2]
                                      [--out bench/results/hf_datasets.json]

Each measurement is ``build_corpus`` end to end (planning, reading, ids, dedup, tokenizing with the
``bytes`` tokenizer so that reading weighs most, shards, manifest), best of ``--rounds``
interleaved rounds, in this process (``datasets`` imported once, before timing):

* ``jsonl`` -- the baseline: the corpus's JSONL files, read by the build's own reader;
* ``dataset_arrow`` -- ``load_dataset("json", ...)``'s Dataset (Arrow cache files:
  ``datasets-table`` tasks reopened with pyarrow);
* ``dataset_memory`` -- the same rows in memory (``keep_in_memory=True``: ``datasets-object`` tasks);
* ``iterable_8`` -- ``Dataset.to_iterable_dataset(num_shards=8)`` (one task per shard);
* ``hub_jsonl`` -- the JSONL files in a local hub snapshot through ``hf://`` (``datasets``' json
  builder, one task per file).

Preparing the datasets (``load_dataset``, the snapshot) is not timed. Prints JSON: seconds, tokens
and tokens/s per measurement, ``ratio_vs_jsonl`` (``jsonl``'s seconds / the route's: above 1 is
faster), a check that every route stored the same documents and tokens per split, and the load
average around the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _report import emit  # bench/ is on sys.path when a bench runs as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

REV = "0" * 40


def _sources(files: list[Path], tmp: Path) -> dict:
    """Every route's SOURCE list (and the hub cache it needs), built from the same JSONL files."""
    import datasets

    features = datasets.Features({k: datasets.Value("string") for k in ("id", "text", "source", "url")})
    paths = [str(f) for f in files]
    arrow = datasets.load_dataset("json", data_files=paths, split="train", cache_dir=str(tmp / "c"), features=features)
    memory = datasets.load_dataset(
        "json", data_files=paths, split="train", cache_dir=str(tmp / "c"), features=features, keep_in_memory=True
    )
    snap = tmp / "hub" / "datasets--bench--dev" / "snapshots" / REV / "data"
    snap.mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, snap / f.name)
    return {
        "jsonl": paths,
        "dataset_arrow": [arrow],
        "dataset_memory": [memory],
        "iterable_8": [arrow.to_iterable_dataset(num_shards=8)],
        "hub_jsonl": [f"hf://datasets/bench/dev@{REV}/data"],
    }


def _build(name: str, sources: list, tmp: Path, workers: int) -> tuple[float, int, list]:
    from h5corpus.build import BuildConfig, build_corpus

    out = tmp / "out" / name
    shutil.rmtree(out, ignore_errors=True)
    cfg = BuildConfig(
        sources=sources,
        tokenizer="bytes",
        workers=workers,
        shards_dir=out / "shards",
        manifest=out / "shards.json",
        hf_cache_dir=tmp / "hub",
    )
    t0 = time.perf_counter()
    rep = build_corpus(cfg)
    seconds = time.perf_counter() - t0
    splits = json.loads((out / "shards.json").read_text())["splits"]
    return seconds, int(rep.tokens), [(s, d["documents"], d["tokens"]) for s, d in sorted(splits.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path(os.environ.get("H5CORPUS_SHARED", "../shared")) / "corpora/dev")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    files = sorted(a.corpus.glob("*.jsonl"))
    if not files:
        sys.exit(f"no *.jsonl under {a.corpus} (give --corpus or set H5CORPUS_SHARED)")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="h5corpus-bench-hfds-") as d:
        tmp = Path(d)
        os.environ["HF_DATASETS_CACHE"] = str(tmp / "c")
        os.environ["HF_HUB_OFFLINE"] = "1"
        routes = _sources(files, tmp)
        best: dict[str, float] = {}
        stored: dict[str, list] = {}
        tokens = 0
        for _ in range(a.rounds):
            for name, srcs in routes.items():
                seconds, tokens, stored[name] = _build(name, srcs, tmp, a.workers)
                best[name] = min(best.get(name, seconds), seconds)
    base = best["jsonl"]
    report = {
        "corpus": str(a.corpus),
        "files": len(files),
        "workers": a.workers,
        "rounds": a.rounds,
        "tokens": tokens,
        "same_stored_counts": all(v == stored["jsonl"] for v in stored.values()),
        "seconds": {k: round(v, 3) for k, v in best.items()},
        "tokens_per_s": {k: round(tokens / v) for k, v in best.items()},
        "ratio_vs_jsonl": {k: round(base / v, 3) for k, v in best.items()},
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    emit(report, a.out)


if __name__ == "__main__":
    main()
