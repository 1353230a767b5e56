"""Filter stages vs the GPT-2 tokenization they precede, on the same documents, in one run.

    python bench/bench_filters.py [--corpus ../shared/corpora/dev] [--rounds 3] [--batch 256]
                                  [--build] [--out bench/results/filters.json]

Baseline: tiktoken ``encode_ordinary`` of every document, one thread, with the GPT-2 ranks loaded
from ``gpt2.tiktoken`` (``tiktoken.load.load_tiktoken_bpe``) and the GPT-2 split pattern -- the
build's fast-path encoder for GPT-2.

Measured, best of ``--rounds`` interleaved rounds, in CPU seconds of this process
(``time.process_time``: the machine may be shared, and CPU time is what a worker spends):

* each stage alone over every dev document, with ``DocumentFilter.process_batch`` (documents/s):
  HTML detection (the dev corpus is plain text), HTML extraction (dev web articles wrapped in an
  HTML page with navigation and footer), Unicode repair, whitespace normalization, language ID,
  quality rules, PII scrubbing, MinHash signatures, the LSH index;
* the pipeline the issue targets -- ``--clean --quality-filter --lang en --scrub-pii
  --near-dedup`` (signatures and the sequential index included) -- through ``process_batch``
  (``--batch`` documents per call) and through per-document ``process`` + ``signature``;
* ratio = pipeline CPU time / tokenization CPU time of all input documents (target <= 1), and of
  the documents the pipeline keeps;
* with ``--build``: ``h5corpus.build`` (1 worker) on a Reuters + UDHR + Wikipedia subset with the
  filters off and on, tokens/s (the build calls ``process`` per document).

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
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def cpu(fn) -> tuple[float, float, object]:
    """(CPU seconds, wall seconds, result) of fn()."""
    c0, w0 = time.process_time(), time.perf_counter()
    r = fn()
    return time.process_time() - c0, time.perf_counter() - w0, r


def run_batches(filt, texts, batch: int, signatures: bool = False):
    out = []
    for i in range(0, len(texts), batch):
        out.extend(filt.process_batch(texts[i:i + batch], signatures=signatures))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared = Path(os.environ.get("H5CORPUS_SHARED", REPO.parent / "shared"))
    ap.add_argument("--corpus", type=Path, default=shared / "corpora" / "dev")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--build", action="store_true", help="also time h5corpus.build with filters off/on")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    from h5corpus.filters import DocumentFilter, FilterConfig
    from h5corpus.quality import QualityThresholds

    tiktoken_file = a.corpus.parent.parent / "tokenizers" / "gpt2" / "gpt2.tiktoken"
    if not any(a.corpus.glob("*.jsonl")) or not tiktoken_file.exists():
        raise SystemExit(f"bench_filters: needs the dev corpus ({a.corpus}/*.jsonl) and {tiktoken_file}; "
                         "set H5CORPUS_SHARED or pass --corpus")
    texts = load_texts(a.corpus)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    enc = gpt2_encoding(a.corpus.parent.parent)
    web = [t for t in texts if 300 <= len(t.split()) <= 3000 and t.isascii()][:200]
    pages = [PAGE.format(title=t.split("\n", 1)[0][:80], body="".join(f"<p>{p}</p>" for p in t.split("\n") if p))
             for t in web]

    all_on = FilterConfig(clean=True, quality=True, lang=("en",), scrub_pii=True, near_dedup=True)
    stages = {
        "html_detect": (FilterConfig(clean=True), texts),
        "html_extract": (FilterConfig(clean=True), pages),
        "fix_unicode": (FilterConfig(fix_unicode=True), texts),
        "normalize_whitespace": (FilterConfig(normalize_whitespace=True), texts),
        "lang": (FilterConfig(lang=("en",)), texts),
        "quality": (FilterConfig(quality=True), texts),
        "pii": (FilterConfig(scrub_pii=True), texts),
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
    for _ in range(a.rounds):
        c, w, n_tokens = cpu(lambda: sum(len(enc.encode_ordinary(t)) for t in texts))
        keep("tokenize", c, w)
        for name, (_, docs) in stages.items():
            c, w, _r = cpu(lambda: run_batches(filters[name], docs, a.batch))
            keep(name, c, w)
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
            kept = [r.text for r in run_batches(pipe, texts, a.batch, signatures=True)
                    if r.text is not None and not idx.add(r.signature)]
            return kept, idx.duplicates

        c, w, (kept_texts, near_dups) = cpu(pipeline_batch)
        keep("pipeline_batch", c, w)

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
        per_stage[name] = {"documents": len(docs), "cpu_s": round(c, 3), "docs_per_s": round(len(docs) / c),
                           "x_tokenize": round(c / tok, 3) if name != "html_extract" else None}
    report = {
        "bench": "filters", "format_version": 1,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "corpus": {"path": str(a.corpus), "documents": len(texts), "bytes": nbytes},
        "baseline": {"tokenizer": "tiktoken encode_ordinary, GPT-2 ranks from gpt2.tiktoken, 1 thread",
                     "tokens": n_tokens, "cpu_s": round(tok, 3), "wall_s": round(best["tokenize"][1], 3),
                     "docs_per_s": round(len(texts) / tok), "MB_per_s": round(nbytes / tok / 1e6, 2)},
        "stages": per_stage,
        "html_extract_ms_per_page": round(1000 * best["html_extract"][0] / len(pages), 2),
        "pipeline": {
            "flags": "--clean --quality-filter --lang en --scrub-pii --near-dedup",
            "kept_documents": len(kept_texts), "near_duplicates": near_dups,
            "batch_cpu_s": round(best["pipeline_batch"][0], 3),
            "per_doc_cpu_s": round(best["pipeline_per_doc"][0], 3),
            "ratio_batch_vs_tokenize_all": round(best["pipeline_batch"][0] / tok, 3),
            "ratio_per_doc_vs_tokenize_all": round(best["pipeline_per_doc"][0] / tok, 3),
            "ratio_batch_vs_tokenize_kept": round(best["pipeline_batch"][0] / best["tokenize_kept"][0], 3),
            "target": "ratio <= 1 (all stages together cost at most the tokenization they precede)",
        },
        "rounds": a.rounds, "batch": a.batch,
    }
    if a.build:
        report["build"] = bench_build(a.corpus, all_on, a.rounds)
    s = json.dumps(report, indent=2)
    print(s)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(s + "\n")


def bench_build(corpus: Path, cfg, rounds: int) -> dict:
    """h5corpus.build, 1 worker, filters off vs on (fresh output folders each round)."""
    from h5corpus.build import BuildConfig, build
    from h5corpus.filters import DocumentFilter

    sources = [str(corpus / n) for n in ("news-reuters-21578.jsonl", "multi-udhr.jsonl", "wiki-en-wikiextractor.jsonl")]
    tok = str(corpus.parent.parent / "tokenizers" / "gpt2" / "tokenizer.json")
    out: dict = {"sources": [Path(s).name for s in sources], "workers": 1}
    for name in ("off", "on"):
        best = None
        for _ in range(rounds):
            with tempfile.TemporaryDirectory() as d:
                filt = DocumentFilter(cfg) if name == "on" else None
                t0 = time.perf_counter()
                r = build(BuildConfig(sources=sources, tokenizer=tok, shards_dir=f"{d}/shards",
                                      manifest=f"{d}/manifests/shards.json", workers=1, filters=filt))
                el = time.perf_counter() - t0
                toks = sum(s["tokens"] for s in r.splits.values())
                if best is None or el < best[0]:
                    best = (el, toks, sum(s["documents"] for s in r.splits.values()))
        out[name] = {"wall_s": round(best[0], 3), "tokens": best[1], "documents": best[2],
                     "tokens_per_s": round(best[1] / best[0])}
    out["wall_ratio_on_vs_off"] = round(out["on"]["wall_s"] / out["off"]["wall_s"], 3)
    return out


if __name__ == "__main__":
    main()
