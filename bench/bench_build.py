"""Build throughput vs the raw encoders, on the same documents and cores, in one run.

    python bench/bench_build.py [--corpus ../shared/corpora/dev] [--tokenizer ../shared/tokenizers/gpt2/tokenizer.json]
                                [--copies 5] [--rounds 3] [--hf-copies 1] [--procs 2] [--out bench/results/build.json]
    python bench/bench_build.py --families [--procs 2] [--out bench/results/build-families.json]

``--families`` measures each tokenizer family instead (bench/_families.py: the build with its fast
encoder vs the build on ``tokenizers`` alone, raw ``tokenizers`` and the raw fast encoder, one run each).

The documents: ``--copies`` copies of the corpus (5 copies of the dev corpus: ~53 K documents, ~50 M
GPT-2 tokens), each copy's documents ending in a line of their own (``[copy k]``) so that exact
dedup keeps them, written once as one JSONL file and once as one FineWeb-schema parquet file
(row groups of 2,048 rows): large files, as real corpora come. Best of ``--rounds`` interleaved
rounds of:

* raw fastokens (``encode_batch_flat``), raw tiktoken (``encode_to_numpy``) on 1 and ``--procs``
  forked processes; raw ``tokenizers`` (``encode_batch_fast``, one Rayon thread per process) on
  ``--procs`` processes over ``--hf-copies`` copies only (it is ~40x slower), once. Texts are in
  memory, split into per-process chunks balanced by characters; only the encoding is timed, with
  each process's encoder as fresh as a build worker's (forked before its first use);
* ``h5corpus.build`` end to end (tokenizer load, planning, reading and parsing, sha256 ids, split,
  dedup, encoding, HDF5 shards, manifest) with 1 and ``--procs`` workers, from the JSONL and from
  the parquet file, with a warm h5corpus cache (the fast path's proof passed in an earlier build of
  this run), plus one first build (empty cache: the proof runs) with ``--procs`` workers from JSONL;
* CPU seconds per 10 M tokens of each part: the workers' own steps (``BuildReport.seconds``), the
  main process (``getrusage``), and, measured alone on the same documents in one process, reading
  and splitting lines, JSON parsing, UTF-8 encoding, sha256 ids, the split hash, fastokens encoding,
  EOS assembly and the HDF5 appends. ``read_rest`` is the workers' read step minus the parts of it
  measured alone: the per-document Python work, the tasks' set-up, and closing their shards.

Prints JSON: measurements (tokens, seconds, tokens/s), ratios, the issue's targets (build(2) /
raw fastokens(2) >= 0.5, parquet / JSONL >= 0.9, build(2) / build(1) >= 1.8) with pass/FAIL, parts,
and the load average around the run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import resource
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

from testkit.corpora import shared_dir, write_fineweb_parquet  # noqa: E402

_HF_SCRIPT = r"""
import json, sys, time
from tokenizers import Tokenizer
texts = json.load(open(sys.argv[2]))
tok = Tokenizer.from_file(sys.argv[1]); tok.encode_special_tokens = True
tok.encode_batch_fast(texts[:10], add_special_tokens=False)
t0 = time.perf_counter()
n = sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t0}))
"""


def make_corpus(corpus: Path, copies: int, out: Path) -> tuple[Path, Path, list[str]]:
    """One JSONL and one FineWeb-schema parquet file of ``copies`` marked copies of ``corpus``."""
    import orjson

    texts = []
    for k in range(copies):
        for p in sorted(corpus.glob("*.jsonl")):
            with open(p, "rb") as fh:
                texts += [orjson.loads(line)["text"] + f"\n[copy {k}]" for line in fh if line.strip()]
    jsonl = out / "corpus.jsonl"
    with open(jsonl, "wb") as fh:
        for i, t in enumerate(texts):
            fh.write(orjson.dumps({"id": f"d{i}", "text": t}) + b"\n")
    parquet = write_fineweb_parquet(out / "corpus.parquet", texts, row_group_size=2048)
    return jsonl, parquet, texts


def balanced(texts: list[str], procs: int) -> list[list[str]]:
    """``procs`` chunks of ``texts`` balanced by characters (longest first onto the lightest)."""
    chunks: list[list[str]] = [[] for _ in range(procs)]
    load = np.zeros(procs)
    for t in sorted(texts, key=len, reverse=True):
        k = int(np.argmin(load))
        chunks[k].append(t)
        load[k] += len(t)
    return chunks


_RAW: dict = {}


def _raw_encode(i: int) -> tuple[int, float]:
    """Encode chunk ``i`` with the encoder named in ``_RAW``; (tokens, seconds)."""
    kind, enc, texts = _RAW["kind"], _RAW["enc"], _RAW["chunks"][i]
    # Touching every text once copies the pages a fork shares with the parent (reference counts are
    # writes); a build worker reads its texts from files, so that copy is not part of encoding.
    sum(map(len, texts))
    t0 = time.perf_counter()
    if kind == "fastokens":
        n = 0
        for a in range(0, len(texts), 2048):  # the build's encode batches
            ids, _ = enc.encode_batch_flat(texts[a : a + 2048], add_special_tokens=False, split_special_tokens=True)
            n += len(ids) // 4
    else:
        none: set[str] = set()
        n = sum(enc.encode_to_numpy(t, allowed_special=none, disallowed_special=()).size for t in texts)
    return n, time.perf_counter() - t0


def raw(kind: str, enc, texts: list[str], procs: int) -> tuple[int, float]:
    """Encode ``texts`` on ``procs`` forked processes, all started together; (tokens, seconds of
    the slowest)."""
    _RAW.update(kind=kind, enc=enc, chunks=balanced(texts, procs))
    with mp.get_context("fork").Pool(procs) as pool:
        pool.map(abs, range(procs))  # workers are up
        res = pool.map(_raw_encode, range(procs), chunksize=1)
    return sum(n for n, _ in res), max(s for _, s in res)


def raw_hf(tokenizer: Path, texts: list[str], procs: int, tmp: Path) -> tuple[int, float]:
    """``tokenizers`` on ``procs`` processes (one Rayon thread each); (tokens, slowest seconds)."""
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="true")
    runs = []
    for i, chunk in enumerate(balanced(texts, procs)):
        f = tmp / f"hf-{i}.json"
        f.write_text(json.dumps(chunk))
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", _HF_SCRIPT, str(tokenizer), str(f)], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    res = [json.loads(p.communicate()[0]) for p in runs]
    return sum(r["tokens"] for r in res), max(r["seconds"] for r in res)


def run_build(src: Path, tokenizer: Path, workers: int, out: Path, cache: Path):
    """One fresh build (removing the old output is not timed); (text tokens, seconds, report,
    main-process CPU seconds)."""
    from h5corpus.build import BuildConfig, build_corpus

    shutil.rmtree(out, ignore_errors=True)
    os.environ["H5CORPUS_CACHE_DIR"] = str(cache)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    rep = build_corpus(
        BuildConfig(
            sources=[str(src)],
            tokenizer=str(tokenizer),
            workers=workers,
            shards_dir=out / "shards",
            manifest=out / "manifests" / "shards.json",
        )
    )
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    main_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return rep.tokens - rep.documents, rep.elapsed_s, rep, main_cpu


def _parts(args: tuple) -> dict[str, float]:
    """CPU seconds of each part of the read stage, alone, on ``jsonl``'s documents (one process)."""
    jsonl, tokenizer_json = args
    import orjson

    from h5corpus.build.config import SplitRule
    from h5corpus.build.tokenize.encoders import FastokensEncoder
    from h5corpus.build.tokenize.tokenizer import load_tokenizer
    from h5corpus.storage.format import token_dtype
    from h5corpus.storage.writer import ShardWriter

    clock = time.process_time
    out: dict[str, float] = {}

    def timed(name, fn):
        c0 = clock()
        r = fn()
        out[name] = clock() - c0
        return r

    def lines():
        with open(jsonl, "rb") as fh:
            return [x for x in fh.read().split(b"\n") if x]

    ls = timed("read_and_split_lines", lines)
    texts = timed("json_parse", lambda: [orjson.loads(x)["text"] for x in ls])
    datas = timed("utf8_encode", lambda: [t.encode("utf-8") for t in texts])
    ids = timed("sha256_ids", lambda: [hashlib.sha256(d).digest() for d in datas])
    timed("split_hash", lambda: SplitRule().indices(ids))
    tok = load_tokenizer(str(tokenizer_json))
    enc = FastokensEncoder.load(tok)[0]
    flats = timed("encode", lambda: [enc.encode_flat(texts[a : a + 2048]) for a in range(0, len(texts), 2048)])
    dtype, eos = token_dtype(tok.vocab_size), tok.eos_id

    def with_eos():
        res = []
        for flat, offs in flats:
            k = offs.size - 1
            t = np.empty(flat.size + k, dtype=dtype)
            at = offs[1:] + np.arange(k)
            keep = np.ones(t.size, dtype=bool)
            keep[at] = False
            t[keep] = flat
            t[at] = eos
            res.append((t, np.diff(offs) + 1))
        return res

    stored = timed("eos_assembly", with_eos)
    id_rows = np.frombuffer(b"".join(ids), dtype=np.uint8).reshape(-1, 32)
    tmp = Path(tempfile.mkdtemp(prefix="bench-parts-"))
    tokens = sum(int(lens.sum()) for _, lens in stored)
    files = max(1, round(tokens / 1e7 * 5))  # about the build's shard files per 10 M tokens (16 MiB tasks)

    def appends():
        at, w, per = 0, None, -(-len(stored) // files)
        for i, (t, lens) in enumerate(stored):
            if i % per == 0:
                if w is not None:
                    w.close()
                w = ShardWriter(tmp / f"s{i}.h5", split="train", tokenizer=tok.identity, fsync=False)
            w.add_documents(t, lens, id_rows[at : at + lens.size], np.zeros(lens.size, np.uint8))
            at += lens.size
        w.close()

    timed("hdf5_appends", appends)
    shutil.rmtree(tmp, ignore_errors=True)
    out["tokens"] = tokens
    return out


def main() -> None:
    shared = shared_dir()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=shared / "corpora" / "dev")
    ap.add_argument("--tokenizer", type=Path, default=shared / "tokenizers" / "gpt2" / "tokenizer.json")
    ap.add_argument("--copies", type=int, default=5, help="copies of the corpus (5 x dev: ~50 M GPT-2 tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hf-copies", type=int, default=1, help="copies raw tokenizers encodes (0 skips it)")
    ap.add_argument("--procs", type=int, default=2, help="processes / workers of the parallel measurements")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--families",
        action="store_true",
        help="instead: each tokenizer family's build vs its tokenizers-only build and the raw encoders (_families.py)",
    )
    args = ap.parse_args()
    if args.families:
        from _families import family_rows

        with tempfile.TemporaryDirectory() as tmp:
            load = os.getloadavg()
            rows = family_rows(args.corpus, args.procs, Path(tmp), raw_hf, balanced)
            figures = {
                f"{r['family']} ({r['encoder']}) {args.procs}-worker build vs tokenizers-only build": (
                    f"{r['build_speedup']:.2f}x ({r['build_tokens_per_s'] / 1e6:.2f} M vs "
                    f"{r['build_tokenizers_only_tokens_per_s'] / 1e6:.2f} M tokens/s)"
                )
                for r in rows
            }
            report = {
                "benchmark": "build_families",
                "procs": args.procs,
                "load_before": load,
                "load_after": os.getloadavg(),
                "families": rows,
            }
            emit(report, args.out, figures=figures)
        return

    import fastokens

    from h5corpus.build.tokenize.encoders import fast_encoder, fastokens_on_one_thread
    from h5corpus.build.tokenize.tokenizer import load_tokenizer

    load_before = os.getloadavg()
    saved_cache = os.environ.get("H5CORPUS_CACHE_DIR")
    best: dict[str, tuple[int, float]] = {}
    seconds: dict[str, dict[str, float]] = {}
    main_cpu: dict[str, float] = {}
    encoders: dict[str, str] = {}

    def keep(name: str, n: int, s: float) -> None:
        if name not in best or s < best[name][1]:
            best[name] = (n, s)

    P = args.procs
    with tempfile.TemporaryDirectory(prefix="bench-build-") as td:
        tmp = Path(td)
        os.environ["H5CORPUS_CACHE_DIR"] = str(tmp / "cache-setup")  # never the user's cache
        jsonl, parquet, texts = make_corpus(args.corpus, args.copies, tmp)
        one_copy = texts[: len(texts) // args.copies]
        fastokens_on_one_thread()
        ft = fastokens.Tokenizer.from_file(str(args.tokenizer))  # loaded here, first used in each child
        tk = fast_encoder(load_tokenizer(str(args.tokenizer)), ["tiktoken"])[0].encoding
        warm = tmp / "cache-warm"
        run_build(jsonl, args.tokenizer, P, tmp / "out", warm)  # fills the warm cache (proof passed)
        if args.hf_copies:
            n, s = raw_hf(args.tokenizer, one_copy * args.hf_copies, P, tmp)
            keep(f"raw_tokenizers_{P}", n, s)
        for r in range(args.rounds):
            for procs in sorted({1, P}):
                keep(f"raw_fastokens_{procs}", *raw("fastokens", ft, texts, procs))
                keep(f"raw_tiktoken_{procs}", *raw("tiktoken", tk, texts, procs))
            runs = [
                (f"build_{fmt}_{w}", src, w, warm)
                for w in sorted({1, P})
                for fmt, src in (("jsonl", jsonl), ("parquet", parquet))
            ]
            runs.append((f"build_first_jsonl_{P}", jsonl, P, tmp / f"cache-cold-{r}"))
            for name, src, w, cache in runs:
                n, s, rep, cpu = run_build(src, args.tokenizer, w, tmp / "out", cache)
                keep(name, n, s)
                if best[name][1] == s:
                    seconds[name], main_cpu[name], encoders[name] = dict(rep.seconds), cpu, rep.encoder
        # A fresh interpreter: a forked child of this process pays copy-on-write faults on the
        # parent's heap (the texts above) in every part it times.
        with mp.get_context("spawn").Pool(1) as pool:
            parts = pool.map(_parts, [(jsonl, args.tokenizer)])[0]
    if saved_cache is None:
        os.environ.pop("H5CORPUS_CACHE_DIR", None)
    else:
        os.environ["H5CORPUS_CACHE_DIR"] = saved_cache
    emit(report(args, best, seconds, main_cpu, encoders, parts, len(texts), load_before), args.out)


def report(args, best, seconds, main_cpu, encoders, parts, documents, load_before) -> dict:
    P = args.procs
    rate = {k: n / s for k, (n, s) in best.items()}

    def ratio(a: str, b: str) -> float | None:
        return round(rate[a] / rate[b], 3) if a in rate and b in rate else None

    ratios = {
        f"build_jsonl_{P}_vs_raw_fastokens_{P}": ratio(f"build_jsonl_{P}", f"raw_fastokens_{P}"),
        f"build_parquet_{P}_vs_raw_fastokens_{P}": ratio(f"build_parquet_{P}", f"raw_fastokens_{P}"),
        f"build_first_jsonl_{P}_vs_raw_fastokens_{P}": ratio(f"build_first_jsonl_{P}", f"raw_fastokens_{P}"),
        f"build_parquet_{P}_vs_build_jsonl_{P}": ratio(f"build_parquet_{P}", f"build_jsonl_{P}"),
        "build_parquet_1_vs_build_jsonl_1": ratio("build_parquet_1", "build_jsonl_1"),
        f"build_jsonl_{P}_vs_build_jsonl_1": ratio(f"build_jsonl_{P}", "build_jsonl_1"),
        f"build_parquet_{P}_vs_build_parquet_1": ratio(f"build_parquet_{P}", "build_parquet_1"),
        f"build_jsonl_{P}_vs_raw_tiktoken_{P}": ratio(f"build_jsonl_{P}", f"raw_tiktoken_{P}"),
        f"build_jsonl_{P}_vs_raw_tokenizers_{P}": ratio(f"build_jsonl_{P}", f"raw_tokenizers_{P}"),
        f"raw_fastokens_{P}_vs_raw_tiktoken_{P}": ratio(f"raw_fastokens_{P}", f"raw_tiktoken_{P}"),
        f"raw_fastokens_{P}_vs_raw_fastokens_1": ratio(f"raw_fastokens_{P}", "raw_fastokens_1"),
    }
    targets = {}
    for key, want in (
        (f"build_jsonl_{P}_vs_raw_fastokens_{P}", 0.5),
        (f"build_parquet_{P}_vs_build_jsonl_{P}", 0.9),
        (f"build_jsonl_{P}_vs_build_jsonl_1", 1.8),
        (f"build_parquet_{P}_vs_build_parquet_1", 1.8),
    ):
        targets[f"{key} >= {want}"] = "pass" if (ratios[key] or 0) >= want else "FAIL"
    per10m = {}
    for name, sec in seconds.items():
        toks = best[name][0] + documents  # the workers' steps cover the stored tokens (EOS included)
        per10m[name] = {k: round(v * 1e7 / toks, 3) for k, v in sec.items()} | {
            "main_process": round(main_cpu[name] * 1e7 / toks, 3)
        }
    alone = {k: round(v * 1e7 / parts["tokens"], 3) for k, v in parts.items() if k != "tokens"}
    for name in (f"build_jsonl_{P}", "build_jsonl_1"):
        if name in per10m:
            read_alone = sum(
                alone[k] for k in ("read_and_split_lines", "json_parse", "utf8_encode", "sha256_ids", "split_hash")
            )
            per10m[name]["read_rest"] = round(per10m[name]["read"] - read_alone, 3)
    return {
        "corpus": str(args.corpus),
        "copies": args.copies,
        "documents": documents,
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "measurements": {
            k: {"tokens": n, "seconds": round(s, 3), "tokens_per_s": round(n / s)} for k, (n, s) in best.items()
        },
        "encoders": encoders,
        "ratios": {k: v for k, v in ratios.items() if v is not None},
        "targets": targets,
        "cpu_s_per_10M_tokens": {"build_steps": per10m, "parts_alone": alone},
    }


if __name__ == "__main__":
    main()
