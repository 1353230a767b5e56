"""Filter stages vs the GPT-2 tokenization they precede, on the same documents, in one run.

    python bench/bench_filters.py [--corpus ../shared/corpora/dev] [--rounds 3] [--batch 256]
                                  [--build [--workers 1]] [--out bench/results/filters.json]
    python bench/bench_filters.py --perplexity-build [--rounds 3] [--workers 1] [--max-chars N]

Baseline: tiktoken ``encode_ordinary`` of every document, one thread, with the GPT-2 ranks loaded
from ``gpt2.tiktoken`` (``tiktoken.load.load_tiktoken_bpe``) and the GPT-2 split pattern -- the
build's fast-path encoder for GPT-2.

Measured, best of ``--rounds`` interleaved rounds, in CPU seconds of this process
(``time.process_time``: the machine may be shared, and CPU time is what a worker spends):

* each stage alone over every dev document, with ``DocumentFilter.process_batch`` (documents/s):
  HTML detection (the dev corpus is plain text), HTML extraction (dev web articles wrapped in an
  HTML page with navigation and footer), Unicode repair, whitespace normalization, language ID,
  quality rules, perplexity (n-gram models trained here, untimed, on the dev English Wikipedia
  file: order 3 on whole documents and on their first 5,000 characters, order 2), PII scrubbing,
  MinHash signatures, the LSH index;
* the pipeline the issue targets -- ``--clean --quality-filter --lang en --scrub-pii
  --near-dedup`` (signatures and the sequential index included) -- through ``process_batch``
  (``--batch`` documents per call) and through per-document ``process`` + ``signature``;
* ratio = pipeline CPU time / tokenization CPU time of all input documents (target <= 1; best of
  the rounds, and each round's own ratio), and of the documents the pipeline keeps;
* with ``--build``: ``h5corpus.build`` (``--workers``, default 1) on the whole corpus with the
  filters off and all stages on, interleaved: wall time, tokens/s, input MB/s, and the workers'
  seconds per step from the build report (each filter stage, tokenization), so the filter cost
  is compared with the tokenization inside the same build (the build calls ``process_batch``;
  ``filters_vs_tokenize_kept`` is the build report's ``x_tokenize``), with both ratios per round.

With ``--perplexity-build`` (alone; the other measurements are skipped): ``h5corpus.build`` of the
whole corpus with GPT-2, filters off vs ``--perplexity-model`` (order 3, trained here, untimed) +
``--drop-worst-fraction 0.2``, interleaved rounds: the workers' scoring seconds
(``filter:perplexity``) against the tokenization (``encode``) of the same build and of the
filter-free build (the build's proven fast encoder for GPT-2, fastokens; the encoder is reported) --
documents scored per second, wall time on vs off.

Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PAGE = """<!DOCTYPE html><html><head><title>{title}</title><script>var cfg = {{}};</script></head>
<body><header><nav><ul><li><a href="/">Home</a></li><li><a href="/news">News</a></li>
<li><a href="/subscribe">Subscribe now</a></li></ul></nav></header>
<div class="cookie">We use cookies. <button>Accept</button></div>
<main><article><h1>{title}</h1>{body}</article></main>
<aside><h3>Most read</h3><ul><li><a href="/a">Another story</a></li></ul></aside>
<footer><p>Copyright 2025. All rights reserved.</p><a href="/privacy">Privacy</a></footer></body></html>"""


def load_texts(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for p in sorted(corpus.glob("*.jsonl")) for line in open(p, encoding="utf-8")]


def gpt2_encoding(shared: Path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(shared / "tokenizers" / "gpt2" / "gpt2.tiktoken"))
    return tiktoken.Encoding(
        "gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
    )


def cpu(fn) -> tuple[float, float, object]:
    """(CPU seconds, wall seconds, result) of fn()."""
    c0, w0 = time.process_time(), time.perf_counter()
    r = fn()
    return time.process_time() - c0, time.perf_counter() - w0, r


def run_batches(filt, texts, batch: int, signatures: bool = False):
    out = []
    for i in range(0, len(texts), batch):
        out.extend(filt.process_batch(texts[i : i + batch], signatures=signatures))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared = Path(os.environ.get("H5CORPUS_SHARED", REPO.parent / "shared"))
    ap.add_argument("--corpus", type=Path, default=shared / "corpora" / "dev")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--build", action="store_true", help="also time h5corpus.build with filters off/on")
    ap.add_argument("--workers", type=int, default=1, help="build workers for --build (default 1)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--perplexity-build", action="store_true", help="only: the build with the perplexity filter vs without"
    )
    ap.add_argument("--max-chars", type=int, default=None, help="--perplexity-build: perplexity_max_chars")
    a = ap.parse_args()
    if a.perplexity_build:
        with tempfile.TemporaryDirectory(prefix="bench-ppl-") as d:
            lm = train_models(a.corpus, Path(d), orders=(3,))
            report = {
                "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
                "build": bench_build_perplexity(a.corpus, lm["order3"]["path"], a.rounds, a.workers, a.max_chars),
            }
        s = json.dumps(report, indent=2)
        print(s)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(s + "\n")
        return

    from h5corpus.filters import DocumentFilter, FilterConfig

    tiktoken_file = a.corpus.parent.parent / "tokenizers" / "gpt2" / "gpt2.tiktoken"
    if not any(a.corpus.glob("*.jsonl")) or not tiktoken_file.exists():
        raise SystemExit(
            f"bench_filters: needs the dev corpus ({a.corpus}/*.jsonl) and {tiktoken_file}; "
            "set H5CORPUS_SHARED or pass --corpus"
        )
    texts = load_texts(a.corpus)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    enc = gpt2_encoding(a.corpus.parent.parent)
    web = [t for t in texts if 300 <= len(t.split()) <= 3000 and t.isascii()][:200]
    pages = [
        PAGE.format(title=t.split("\n", 1)[0][:80], body="".join(f"<p>{p}</p>" for p in t.split("\n") if p))
        for t in web
    ]

    all_on = FilterConfig(clean=True, quality=True, lang=("en",), scrub_pii=True, near_dedup=True)
    model_dir = tempfile.TemporaryDirectory(prefix="bench-ppl-")
    lm = train_models(a.corpus, Path(model_dir.name))
    stages = {
        "html_detect": (FilterConfig(clean=True), texts),
        "html_extract": (FilterConfig(clean=True), pages),
        "fix_unicode": (FilterConfig(fix_unicode=True), texts),
        "normalize_whitespace": (FilterConfig(normalize_whitespace=True), texts),
        "lang": (FilterConfig(lang=("en",)), texts),
        "quality": (FilterConfig(quality=True), texts),
        "pii": (FilterConfig(scrub_pii=True), texts),
        "perplexity": (FilterConfig(perplexity_model=lm["order3"]["path"]), texts),
        "perplexity_5000_chars": (
            FilterConfig(perplexity_model=lm["order3"]["path"], perplexity_max_chars=5000),
            texts,
        ),
        "perplexity_order2": (FilterConfig(perplexity_model=lm["order2"]["path"]), texts),
    }
    filters = {k: DocumentFilter(c) for k, (c, _) in stages.items()}
    sig_filter = DocumentFilter(FilterConfig(near_dedup=True))
    pipe = DocumentFilter(all_on)
    for f in (*filters.values(), sig_filter, pipe):
        f.warm_up()
    pipe.process_batch(texts[:50], signatures=True)  # first-use costs (power tables, imports)

    best: dict[str, tuple[float, float]] = {}

    def keep(name: str, c: float, w: float) -> None:
        if name not in best or c < best[name][0]:
            best[name] = (c, w)

    n_tokens = kept_tokens = 0
    kept_texts: list[str] = []
    near_dups = 0
    sigs = None
    round_ratios: list[float] = []  # pipeline_batch / tokenize, both measured in the same round
    perplexity_rounds: dict[str, list[float]] = {}  # the same for each perplexity variant
    for _ in range(a.rounds):
        c, w, n_tokens = cpu(lambda: sum(len(enc.encode_ordinary(t)) for t in texts))
        keep("tokenize", c, w)
        tok_round = c
        for name, (_, docs) in stages.items():
            c, w, _r = cpu(lambda: run_batches(filters[name], docs, a.batch))
            keep(name, c, w)
            if name.startswith("perplexity"):
                perplexity_rounds.setdefault(name, []).append(round(c / tok_round, 3))
        c, w, res = cpu(lambda: run_batches(sig_filter, texts, a.batch, signatures=True))
        keep("signature", c, w)
        sigs = [r.signature for r in res]

        def index_all():
            idx = sig_filter.new_near_dedup_index()
            return sum(idx.add(s) for s in sigs)

        c, w, _r = cpu(index_all)
        keep("near_dedup_index", c, w)

        def pipeline_batch():
            idx = pipe.new_near_dedup_index()
            kept = [
                r.text
                for r in run_batches(pipe, texts, a.batch, signatures=True)
                if r.text is not None and not idx.add(r.signature)
            ]
            return kept, idx.duplicates

        c, w, (kept_texts, near_dups) = cpu(pipeline_batch)
        keep("pipeline_batch", c, w)
        round_ratios.append(c / tok_round)

        def pipeline_per_doc():
            idx = pipe.new_near_dedup_index()
            kept = 0
            for t in texts:
                out, _reason = pipe.process(t)
                if out is not None and not idx.add(pipe.signature(out)):
                    kept += 1
            return kept

        c, w, _r = cpu(pipeline_per_doc)
        keep("pipeline_per_doc", c, w)
        c, w, kept_tokens = cpu(lambda: sum(len(enc.encode_ordinary(t)) for t in kept_texts))
        keep("tokenize_kept", c, w)

    tok = best["tokenize"][0]
    per_stage = {}
    for name in (*stages, "signature", "near_dedup_index"):
        docs = stages[name][1] if name in stages else texts
        c, w = best[name]
        per_stage[name] = {
            "documents": len(docs),
            "cpu_s": round(c, 3),
            "docs_per_s": round(len(docs) / c),
            "x_tokenize": round(c / tok, 3) if name != "html_extract" else None,
        }
    report = {
        "bench": "filters",
        "format_version": 1,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "corpus": {"path": str(a.corpus), "documents": len(texts), "bytes": nbytes},
        "baseline": {
            "tokenizer": "tiktoken encode_ordinary, GPT-2 ranks from gpt2.tiktoken, 1 thread",
            "tokens": n_tokens,
            "cpu_s": round(tok, 3),
            "wall_s": round(best["tokenize"][1], 3),
            "docs_per_s": round(len(texts) / tok),
            "MB_per_s": round(nbytes / tok / 1e6, 2),
        },
        "stages": per_stage,
        "html_extract_ms_per_page": round(1000 * best["html_extract"][0] / len(pages), 2),
        "pipeline": {
            "flags": "--clean --quality-filter --lang en --scrub-pii --near-dedup",
            "kept_documents": len(kept_texts),
            "near_duplicates": near_dups,
            "batch_cpu_s": round(best["pipeline_batch"][0], 3),
            "per_doc_cpu_s": round(best["pipeline_per_doc"][0], 3),
            "ratio_batch_vs_tokenize_all": round(best["pipeline_batch"][0] / tok, 3),
            "ratio_per_doc_vs_tokenize_all": round(best["pipeline_per_doc"][0] / tok, 3),
            "ratio_batch_vs_tokenize_kept": round(best["pipeline_batch"][0] / best["tokenize_kept"][0], 3),
            "ratio_batch_vs_tokenize_all_per_round": [round(r, 3) for r in round_ratios],
            "target": "ratio <= 1 (all stages together cost at most the tokenization they precede)",
        },
        "rounds": a.rounds,
        "batch": a.batch,
    }
    report["perplexity"] = perplexity_report(lm, filters, texts, per_stage)
    report["perplexity"]["x_tokenize_per_round"] = perplexity_rounds
    model_dir.cleanup()
    if a.build:
        report["build"] = bench_build(a.corpus, all_on, a.rounds, a.workers)
    s = json.dumps(report, indent=2)
    print(s)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(s + "\n")


def train_models(corpus: Path, out: Path, orders: tuple[int, ...] = (3, 2)) -> dict[str, dict[str, Any]]:
    """Order-3 and order-2 models trained on the corpus's English Wikipedia file (CPU seconds of
    the training, the model's size)."""
    from h5corpus.filters.ngramtrain import train_ngram_model

    wiki = load_texts_of(corpus / "wiki-en-wikiextractor.jsonl")
    models = {}
    for order in orders:
        c, _w, m = cpu(lambda: train_ngram_model(wiki, order=order))
        path = m.save(out / f"wiki-order{order}.npz")
        models[f"order{order}"] = {
            "path": str(path),
            "order": order,
            "train_documents": len(wiki),
            "train_cpu_s": round(c, 3),
            "ngrams": m.header["ngrams"],
            "file_bytes": path.stat().st_size,
        }
    return models


def load_texts_of(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in open(path, encoding="utf-8")]


def perplexity_report(lm: dict, filters: dict, texts: list[str], per_stage: dict) -> dict:
    """The perplexity stage's figures: the models, each variant's cost against the tokenization,
    and how far scoring the first 5,000 characters changes the worst 20% (the decision it feeds)."""
    from h5corpus.filters.perplexity import worst_fraction

    def scores(name: str) -> np.ndarray:
        return np.array([r.info["perplexity"] for r in run_batches(filters[name], texts, 256)])

    full, head = scores("perplexity"), scores("perplexity_5000_chars")
    d_full, d_head = worst_fraction(full, 0.2), worst_fraction(head, 0.2)
    return {
        "models": {k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in lm.items()},
        "x_tokenize": {
            k: per_stage[k]["x_tokenize"] for k in ("perplexity", "perplexity_5000_chars", "perplexity_order2")
        },
        "worst_20_percent_same_with_5000_chars": round(float((d_full & d_head).sum() / d_full.sum()), 4),
        "documents_changed_by_5000_chars": int((full != head).sum()),
        "target": "scoring <= 0.3x the build's tokenization with the fast tokenizer (fastokens, not in this "
        "tree yet); x_tokenize here is against tiktoken",
    }


def bench_build(corpus: Path, cfg, rounds: int, workers: int) -> dict:
    """h5corpus.build on the whole corpus, filters off vs all stages on, interleaved rounds (fresh
    output folders each round; best wall time each). Also the workers' own seconds per step from
    the build report: the filter stages vs the tokenization inside the same build."""
    from h5corpus.build import BuildConfig, build_corpus
    from h5corpus.filters import DocumentFilter

    sources = [str(corpus)]
    tok = str(corpus.parent.parent / "tokenizers" / "gpt2" / "tokenizer.json")
    nbytes = sum(p.stat().st_size for p in corpus.glob("*.jsonl"))
    out: dict = {
        "sources": [str(corpus)],
        "input_bytes": nbytes,
        "workers": workers,
        "flags": "--clean --quality-filter --lang en --scrub-pii --near-dedup",
    }
    best: dict[str, tuple] = {}
    per_round: list[dict[str, float]] = []  # ratios of worker CPU seconds within each round
    for _ in range(rounds):
        this: dict[str, Any] = {}
        for name in ("off", "on"):
            with tempfile.TemporaryDirectory() as d:
                filt = DocumentFilter(cfg) if name == "on" else None
                t0 = time.perf_counter()
                r = build_corpus(
                    BuildConfig(
                        sources=sources,
                        tokenizer=tok,
                        shards_dir=f"{d}/shards",
                        manifest=f"{d}/manifests/shards.json",
                        workers=workers,
                        filters=filt,
                    )
                )
                el = time.perf_counter() - t0
                this[name] = r
                if name not in best or el < best[name][0]:
                    best[name] = (el, r)
        on_s, off_s = this["on"].seconds, this["off"].seconds
        if on_s.get("encode") and off_s.get("encode"):
            per_round.append(
                {
                    "x_tokenize": round(on_s.get("filter", 0.0) / on_s["encode"], 3),
                    "filters_vs_tokenize_all": round(on_s.get("filter", 0.0) / off_s["encode"], 3),
                }
            )
    for name, (el, r) in best.items():
        sec = r.seconds
        out[name] = {
            "wall_s": round(el, 3),
            "tokens": r.tokens,
            "documents": r.documents,
            "tokens_per_s": round(r.tokens / el),
            "input_MB_per_s": round(nbytes / el / 1e6, 2),
            "worker_seconds": {k: round(v, 3) for k, v in sec.items()},
        }
    on, off = best["on"][1], best["off"][1]
    fs, c = on.seconds, on.filter_counters
    filt_s = fs.get("filter", 0.0)
    # documents reaching each stage (the stages run in this order; each drops some)
    reach = {"clean": c.get("docs", 0)}
    reach["lang"] = reach["clean"] - c.get("drop:clean:no_main_text", 0) - c.get("drop:clean:empty", 0)
    reach["quality"] = reach["lang"] - c.get("drop:lang", 0)
    reach["pii"] = reach["quality"] - sum(v for k, v in c.items() if k.startswith("drop:quality:"))
    reach["signature"] = reach["pii"]
    out["stages_in_build"] = {
        k[7:]: {
            "documents": reach.get(k[7:]),
            "seconds": round(v, 3),
            "docs_per_s": round(reach[k[7:]] / v) if v > 0 and reach.get(k[7:]) else None,
        }
        for k, v in fs.items()
        if k.startswith("filter:")
    }
    out["kept_documents"] = on.documents
    out["near_duplicates"] = sum(int(s.get("near_duplicates", 0)) for s in on.splits.values())
    out["wall_ratio_on_vs_off"] = round(best["on"][0] / best["off"][0], 3)
    out["filters_vs_tokenize_kept"] = round(filt_s / fs["encode"], 3) if fs.get("encode") else None
    out["filters_vs_tokenize_all"] = round(filt_s / off.seconds["encode"], 3) if off.seconds.get("encode") else None
    out["per_round"] = per_round
    out["note"] = (
        "worker_seconds are CPU seconds of the workers from the build report (filter = all stages; "
        "encode = tiktoken of the kept documents); filters_vs_tokenize_kept is the build's own "
        "x_tokenize (filter / encode of the same build); filters_vs_tokenize_all divides by the encode "
        "seconds of the filter-free build, i.e. tokenizing every input document; per_round: both "
        "ratios for each interleaved round (the off and on builds of one round)"
    )
    return out


def bench_build_perplexity(corpus: Path, model: str, rounds: int, workers: int, max_chars: int | None) -> dict:
    """h5corpus.build of the whole corpus, filters off vs the perplexity model with the
    worst-fraction rule, interleaved rounds; scoring seconds against the tokenization seconds of
    the same build and of the filter-free one (workers' CPU seconds from the build reports)."""
    from h5corpus.build import BuildConfig, build_corpus
    from h5corpus.filters import DocumentFilter, FilterConfig

    tok = str(corpus.parent.parent / "tokenizers" / "gpt2" / "tokenizer.json")
    cfg = FilterConfig(perplexity_model=model, perplexity_max_chars=max_chars)
    best: dict[str, tuple[float, Any]] = {}
    per_round = []
    for _ in range(rounds):
        this: dict[str, Any] = {}
        for name in ("off", "on"):
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                r = build_corpus(
                    BuildConfig(
                        sources=[str(corpus)],
                        tokenizer=tok,
                        shards_dir=f"{d}/shards",
                        manifest=f"{d}/manifests/shards.json",
                        workers=workers,
                        filters=DocumentFilter(cfg) if name == "on" else None,
                        drop_worst_fraction=0.2 if name == "on" else None,
                    )
                )
                el = time.perf_counter() - t0
                this[name] = (el, r)
                if name not in best or el < best[name][0]:
                    best[name] = (el, r)
        on_s, off_s = this["on"][1].seconds, this["off"][1].seconds
        per_round.append(
            {
                "scoring_vs_tokenize_same_build": round(on_s["filter:perplexity"] / on_s["encode"], 3),
                "scoring_vs_tokenize_all": round(on_s["filter:perplexity"] / off_s["encode"], 3),
                "wall_on_vs_off": round(this["on"][0] / this["off"][0], 3),
            }
        )
    on, off = best["on"][1], best["off"][1]
    scored = int(on.filter_counters.get("docs", 0))
    score_s = on.seconds["filter:perplexity"]
    worst = sum(int(s["dropped"].get("perplexity_worst", 0)) for s in on.splits.values())
    return {
        "workers": workers,
        "tokenizer": f"GPT-2, encoder {on.encoder} (the build's proven fast path)",
        "perplexity_max_chars": max_chars,
        "documents_scored": scored,
        "dropped_worst_20_percent": worst,
        "scoring_cpu_s": round(score_s, 3),
        "scoring_docs_per_s": round(scored / score_s) if score_s else None,
        "tokenize_cpu_s_same_build": round(on.seconds["encode"], 3),
        "tokenize_cpu_s_filter_free_build": round(off.seconds["encode"], 3),
        "scoring_vs_tokenize_same_build": round(score_s / on.seconds["encode"], 3),
        "scoring_vs_tokenize_all": round(score_s / off.seconds["encode"], 3),
        "wall_s": {"off": round(best["off"][0], 3), "on": round(best["on"][0], 3)},
        "wall_on_vs_off": round(best["on"][0] / best["off"][0], 3),
        "per_round": per_round,
        "target": "scoring <= 0.3x the build's tokenization with the fast tokenizer",
        "note": "same build: the read stage encodes every document the read-stage filters keep (the worst "
        "fraction is decided after all are read, so all of them here); all: the filter-free build's encode",
    }


if __name__ == "__main__":
    main()
