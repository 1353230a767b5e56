"""Pretraining scale: what one reading process pays before its first batch, at 1 M to 20 M documents
and at 10,000 shards (issue 24).

    nice -n 10 flock /work/.bench.lock python bench/bench_pretrain_scale.py
        [--corpora 1M:100 10M:1000 20M:2000 2M:10000] [--rounds 1] [--drop]
        [--cache /tmp/harness] [--out bench/results/pretrain_scale.json]

Corpora: ``DOCS:SHARDS`` each, written once through the real writer
(:class:`~h5corpus.storage.writer.ShardWriter`, one ``add_documents`` call per shard, no fsync) and
:func:`~h5corpus.storage.manifest.write_manifest` and
:func:`~h5corpus.storage.reader.write_layout_file` and
:func:`~h5corpus.storage.manifest.write_table_file` (as a build's commit), then cached under ``--cache`` keyed by documents,
shards, seed and format version. Document lengths are lognormal (median 100 tokens, sigma 0.7:
mean ~128 tokens, a tail past 4,096), token ids uniform below the GPT-2 EOS id, every document ends
with EOS. About 2 bytes per token on disk: 20 M documents take ~5 GB.

Every figure is taken in a fresh process (``probe`` subcommand) so nothing is cached between them:

* ``open``: seconds of :func:`~h5corpus.storage.reader.open_corpus` of the train split;
* ``window_first``: the first batch of a :class:`~h5corpus.loaders.window.SlidingWindowDataset`
  (``seq_len`` 2,048, 8 windows), seconds after the open;
* ``plan``: :func:`~h5corpus.loaders.bestfit.write_plans` of epoch 0 into ``plans/`` beside the
  shards (rewritten), seconds; then, untimed, the per-rank figures' plan;
* ``bestfit_first``: the first microbatch of a :class:`~h5corpus.loaders.bestfit.BestFitDataset`
  (4,096 x 35, buffer 64, ``plan_dir`` = that folder), seconds after the open;
  the loader's defaults, so its chunk order is the rolling window over 64 shards;
  ``bestfit_first_global``: the same with ``shuffle_window_shards=None`` (chunks shuffled over the
  whole split: a microbatch reads from most of the split's shards); ``bestfit_next_global`` /
  ``bestfit_next``: seconds per microbatch over the 8 after the first, global and default;
  ``bestfit_first_blocks``: the same with ``shuffle_block_shards=16`` (these plans written with the
  others, untimed): a microbatch then reads from 16 shards;
  ``bestfit_first_frozen``: ``bestfit_first`` after ``gc.freeze()`` (the objects held after the
  imports and the open left out of the garbage collector's passes); each of these with
  ``<figure>_gc_s``, the seconds of it spent in the collector (``gc.callbacks``);
* ``window_len`` / ``bestfit_len``: ``len()`` of each, seconds after the open;
* ``rss_anon_mb``: ``RssAnon`` of ``/proc/self/status`` after the first batch (page cache of the
  memory-mapped shards is shared and not counted); ``rss_anon_mb_over_torch``: that minus
  ``rss_anon_mb_torch_alone``, a fresh interpreter's after ``import torch`` (what h5corpus adds);
* ``rank_1`` / ``rank_512``: seconds per yielded microbatch of rank 0 of 1 and of 512 (2 packs
  per microbatch), over its first 16 microbatches, reads included; ``rank_1_plan`` /
  ``rank_512_plan``: the planning per yielded microbatch, the issue's figure (``PlanFile.microbatch``,
  the microbatch's record read from the plan file and verified, for the same microbatches, from a
  fresh open of the file, nothing else running between them); ``rank_*_plan_in_loop``: the time
  spent in the same calls inside the iteration, where the token reads between them leave the
  CPU's caches cold (more for rank 0 of 512: it reads shards rank 0 of 1 has open);
  ``rank_512_vs_1`` (the target, <= 1.3x), ``rank_512_vs_1_in_loop`` and
  ``rank_512_vs_1_total``: their ratios (reported; rank 0 of 512 reads microbatches 512 apart in
  the epoch, so it opens more shards of the rolling window than rank 0 of 1, which reads
  consecutive ones);
* ``plan_s_per_million_docs``: the plan's one-off cost (``plan``), per million documents, and
  ``plan_peak_rss_anon_mb``, the highest ``RssAnon`` of the process writing it;
* ``inspect`` / ``inspect_peak_rss_anon_mb``: :func:`~h5corpus.inspection.inspect_corpus` of the
  train split, seconds and the highest ``RssAnon`` sampled every 20 ms while it runs.

Growth ratios divide each figure by the first corpus's (the 1 M one). Figures: min over ``--rounds``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Only what a training process imports is imported here: a probe's RssAnon is a reader's. The
# writer (h5py) and inspect are imported where the corpora are written or inspected.
from h5corpus.loaders.bestfit import BestFitDataset, write_plans  # noqa: E402
from h5corpus.loaders.window import SlidingWindowDataset  # noqa: E402
from h5corpus.storage import format as fmt  # noqa: E402
from h5corpus.storage.format import TokenizerIdentity  # noqa: E402
from h5corpus.storage.reader import open_corpus, write_layout_file  # noqa: E402

#: The synthetic corpora's tokenizer identity: GPT-2's id space (uint16 tokens, EOS 50,256).
IDENTITY = TokenizerIdentity(
    name="synthetic-gpt2",
    revision="local",
    sha256=hashlib.sha256(b"synthetic").hexdigest(),
    vocab_size=50257,
    eos_id=50256,
)
LENGTH_MEDIAN = 100.0  # tokens, EOS included
LENGTH_SIGMA = 0.7  # of log(length)
LONGEST_DOC = 65536  # tokens
WINDOW = dict(seq_len=2048, batch_size=8)
BESTFIT = dict(max_seq_len=4096, batch_size=35)
#: ``bestfit_first_blocks``: the best-fit loader with the shard-block shuffle (docs/PACKING.md)
BLOCKS = dict(shuffle_block_shards=16)
#: ``bestfit_first_global``: the best-fit loader shuffling over the whole split (no window)
GLOBAL = dict(shuffle_window_shards=None)
NEXT_STEPS = 8  # microbatches timed after the first for ``bestfit_next*``
#: The per-rank figures use 2 packs per microbatch, so that rank 0 of 512 still yields RANK_STEPS
#: microbatches of the 1 M-document corpus (~15,600 microbatches in its epoch).
RANKS = dict(max_seq_len=4096, batch_size=2)
RANK_STEPS = 16  # microbatches timed from the start for the per-rank figures
#: "plan" first: it writes the plan files every best-fit figure then reads.
FIGURES = (
    "plan",
    "open",
    "window_first",
    "window_len",
    "bestfit_first",
    "bestfit_first_global",
    "bestfit_next",
    "bestfit_next_global",
    "bestfit_first_blocks",
    "bestfit_first_frozen",
    "bestfit_len",
    "rank_1",
    "rank_512",
    "inspect",
)
RSS_POLL_S = 0.02  # seconds between RssAnon samples while inspect runs
TARGETS = {
    "open": 0.5,
    "window_first": 0.5,
    "bestfit_first": 1.0,
    "rss_anon_mb": 150.0,
    "inspect_peak_rss_anon_mb": 300.0,
}


# -- corpora -----------------------------------------------------------------------------------------------


def parse_spec(spec: str) -> tuple[int, int]:
    """``"20M:2000"`` -> (20,000,000 documents, 2,000 shards)."""
    docs, _, shards = spec.partition(":")
    scale = {"K": 1_000, "M": 1_000_000}.get(docs[-1:].upper(), 1)
    n = int(float(docs[:-1] if scale > 1 else docs) * scale)
    if n < 1 or not shards.isdigit() or not 1 <= int(shards) <= n:
        raise SystemExit(f"--corpora: {spec!r} is not DOCS:SHARDS with 1 <= SHARDS <= DOCS")
    return n, int(shards)


def doc_lengths(n: int, seed: int) -> np.ndarray:
    """(n,) int64 document lengths in tokens (EOS included): lognormal, clipped to [2, LONGEST_DOC]."""
    rng = np.random.default_rng([seed, 1])
    x = rng.lognormal(np.log(LENGTH_MEDIAN), LENGTH_SIGMA, size=n)
    return np.clip(np.rint(x), 2, LONGEST_DOC).astype(np.int64)


def write_shard(path: Path, lengths: np.ndarray, rng: np.random.Generator) -> Any:
    """One shard of documents of ``lengths``: uniform ids below EOS, EOS at each end; its record."""
    from h5corpus.storage.writer import ShardWriter

    total = int(lengths.sum())
    flat = rng.integers(0, IDENTITY.eos_id, size=total, dtype=np.uint16)
    flat[np.cumsum(lengths) - 1] = IDENTITY.eos_id
    ids = np.frombuffer(rng.bytes(lengths.size * fmt.DOC_ID_BYTES), np.uint8).reshape(-1, fmt.DOC_ID_BYTES)
    with ShardWriter(path, split="train", tokenizer=IDENTITY, fsync=False) as w:
        w.add_documents(flat, lengths, ids)
    return w.info


def corpus(cache: Path, docs: int, shards: int, seed: int = 0) -> tuple[Path, float]:
    """The manifest of the cached corpus of ``docs`` documents in ``shards`` shards (written if absent),
    and the seconds writing it took (0 when cached)."""
    from h5corpus.storage.manifest import Manifest, write_manifest, write_table_file

    # "-st": final chunks in stored deflate blocks (an older cache decoded them into memory)
    root = cache / f"d{docs}-s{shards}-seed{seed}-v{fmt.FORMAT_VERSION}-st"
    mpath = root / "manifests" / "shards.json"
    if mpath.exists():  # the manifest is written last, then the layout and table files
        if not fmt.layout_path(mpath).exists():
            write_layout_file(mpath)
        if not fmt.table_path(mpath).exists():
            write_table_file(mpath)
        return mpath, 0.0
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    lengths = doc_lengths(docs, seed)
    bounds = np.linspace(0, docs, shards + 1).astype(np.int64)
    rng = np.random.default_rng([seed, 2])
    m = Manifest(tokenizer=IDENTITY, dtype="uint16", chunk_tokens=fmt.DEFAULT_CHUNK_TOKENS, shards_dir="../shards")
    for k in range(shards):
        rec = write_shard(root / "shards" / "train" / f"train-{k:05d}.h5", lengths[bounds[k] : bounds[k + 1]], rng)
        m.shards.append(rec.relative_to(mpath.parent))
    m.splits["train"] = {"documents": docs, "tokens": int(lengths.sum())}
    write_manifest(mpath, m)
    write_layout_file(mpath)  # as the build's commit does
    write_table_file(mpath)
    return mpath, time.perf_counter() - t0


# -- one figure in this process ----------------------------------------------------------------------------


def rss_anon_mb() -> float:
    """Anonymous resident memory of this process (``RssAnon``), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def gc_timed(fn: Any) -> tuple[float, float]:
    """(seconds of ``fn()``, seconds of it spent in Python's cyclic garbage collector)."""
    spent, began = [0.0], [0.0]

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - began[0]

    gc.callbacks.append(note)
    try:
        seconds = timed(fn)[1]
    finally:
        gc.callbacks.remove(note)
    return seconds, spent[0]


def plan_dir(manifest: Path) -> Path:
    """The plan files' folder of the corpus of ``manifest`` (beside its shards)."""
    return manifest.parent.parent / "plans"


def peak_rss(fn: Any) -> tuple[float, float]:
    """(seconds of ``fn()``, highest RssAnon in MB sampled every RSS_POLL_S while it ran)."""
    peak = [rss_anon_mb()]
    done = threading.Event()

    def poll() -> None:
        while not done.wait(RSS_POLL_S):
            peak[0] = max(peak[0], rss_anon_mb())

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        _, seconds = timed(fn)
    finally:
        done.set()
        t.join()
    return seconds, max(peak[0], rss_anon_mb())


def probe(manifest: Path, figure: str) -> dict[str, Any]:
    """Open the corpus and take ``figure``: {"open": s, figure: s, "rss_anon_mb": MB after it}."""
    out: dict[str, Any] = {"rss_anon_mb_imports": rss_anon_mb()}
    c, out["open"] = timed(lambda: open_corpus(manifest, "train"))
    if figure.startswith("window"):
        ds = SlidingWindowDataset(c, seed=0, rank=0, world_size=1, **WINDOW)
        out[figure] = timed(lambda: len(ds) if figure == "window_len" else next(iter(ds)))[1]
    elif figure.startswith("bestfit_"):
        out.update(bestfit_probe(c, manifest, figure))
    elif figure.startswith("rank_"):
        out.update(rank_probe(c, manifest, int(figure[5:])))
    elif figure == "plan":  # epoch 0's plan files, written afresh; the per-rank settings' untimed
        out[figure], out["plan_peak_rss_anon_mb"] = peak_rss(
            lambda: write_plans(c, plan_dir(manifest), [0], rebuild=True, seed=0, **BESTFIT)
        )
        write_plans(c, plan_dir(manifest), [0], rebuild=True, seed=0, **RANKS)
        write_plans(c, plan_dir(manifest), [0], rebuild=True, seed=0, **BESTFIT, **BLOCKS)
        write_plans(c, plan_dir(manifest), [0], rebuild=True, seed=0, **BESTFIT, **GLOBAL)
    elif figure == "inspect":
        from h5corpus.inspection import inspect_corpus

        out[figure], out["inspect_peak_rss_anon_mb"] = peak_rss(lambda: inspect_corpus(manifest, splits=["train"]))
    out["rss_anon_mb"] = rss_anon_mb()
    out["num_documents"] = c.num_documents
    return out


def rank_probe(c: Any, manifest: Path, world: int) -> dict[str, float]:
    """``rank_<world>``, ``rank_<world>_plan`` and ``rank_<world>_plan_in_loop`` of :func:`probe`
    (``c``: the corpus, just opened; the plan file exists)."""
    from h5corpus.loaders.planfile import PlanFile, open_plan_file, plan_file_name

    ds = BestFitDataset(c, seed=0, rank=0, world_size=world, plan_dir=plan_dir(manifest), **RANKS)
    spent, read = [0.0], []
    inner = PlanFile.microbatch

    def microbatch(self: Any, g: int) -> Any:  # this probe process only: the planning part, timed
        read.append(g)
        t = time.perf_counter()
        try:
            return inner(self, g)
        finally:
            spent[0] += time.perf_counter() - t

    PlanFile.microbatch = microbatch  # type: ignore[method-assign]
    it = iter(ds)
    total = timed(lambda: [next(it) for _ in range(RANK_STEPS)])[1]
    PlanFile.microbatch = inner  # type: ignore[method-assign]
    ident = ds.plan_identity(0)  # the same microbatches' plan alone, from a fresh open of the file
    fresh = open_plan_file(plan_dir(manifest) / plan_file_name(ident["fingerprint"], ident["settings"], 0), ident)
    alone = timed(lambda: [fresh.microbatch(g) for g in read])[1]
    return {
        f"rank_{world}": total / RANK_STEPS,
        f"rank_{world}_plan": alone / RANK_STEPS,
        f"rank_{world}_plan_in_loop": spent[0] / RANK_STEPS,
    }


def bestfit_probe(c: Any, manifest: Path, figure: str) -> dict[str, float]:
    """The ``bestfit_*`` figures of :func:`probe` (``c``: the corpus, just opened)."""
    kind = {"bestfit_first_blocks": BLOCKS, "bestfit_first_global": GLOBAL, "bestfit_next_global": GLOBAL}
    if figure == "bestfit_first_frozen":
        gc.freeze()  # what a worker_init_fn may do after the imports (docs/SCALING.md)
    ds = BestFitDataset(c, seed=0, rank=0, world_size=1, plan_dir=plan_dir(manifest), **BESTFIT, **kind.get(figure, {}))
    if figure.startswith("bestfit_next"):
        it = iter(ds)
        next(it)
        return {figure: timed(lambda: [next(it) for _ in range(NEXT_STEPS)])[1] / NEXT_STEPS}
    t, gc_s = gc_timed(lambda: len(ds) if figure == "bestfit_len" else next(iter(ds)))
    return {figure: t, f"{figure}_gc_s": gc_s}


# -- the driver --------------------------------------------------------------------------------------------


def torch_rss_anon_mb() -> float:
    """``RssAnon`` of a fresh interpreter that imports torch and nothing else, in MB: the floor of
    any process that runs the loaders (what h5corpus adds is a probe's ``rss_anon_mb`` minus it)."""
    code = "import torch, pathlib; print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('RssAnon:')][0].split()[1])"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return round(int(p.stdout.strip()) / 1024, 1)


#: A probe process: this module imported from its compiled bytecode (run as a script, its source
#: would be compiled in every probe, ~1 MB of freed compiler memory in RssAnon), then :func:`probe`.
PROBE = (
    f"import sys; sys.path[:0] = [{str(Path(__file__).resolve().parent)!r}]; import json, bench_pretrain_scale as b; "
    "print(json.dumps(b.probe(b.Path(sys.argv[1]), sys.argv[2])))"
)


def run_probe(manifest: Path, figure: str, timeout: float) -> dict[str, Any]:
    """``probe`` in a fresh interpreter; {"error": ...} when it fails or runs past ``timeout`` seconds."""
    cmd = [sys.executable, "-c", PROBE, str(manifest), figure]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"{figure}: over {timeout:.0f} s"}
    if p.returncode != 0:
        return {"error": f"{figure}: exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(manifest: Path, figures: list[str], rounds: int, timeout: float) -> dict[str, Any]:
    """Every figure of one corpus, each the minimum over ``rounds`` fresh processes."""
    row: dict[str, Any] = {}
    rss: list[float] = []
    opens: list[float] = []
    imports: list[float] = []
    for figure in figures:
        runs = [run_probe(manifest, figure, timeout) for _ in range(rounds)]
        good = [r for r in runs if "error" not in r]
        if not good:
            row[figure] = runs[0]["error"]
            continue
        row[figure] = round(min(r[figure] for r in good), 6)
        opens += [r["open"] for r in good]
        imports += [r["rss_anon_mb_imports"] for r in good]
        if figure in ("window_first", "bestfit_first", "bestfit_first_global", "bestfit_first_blocks"):
            rss += [r["rss_anon_mb"] for r in good]
        if figure.startswith("bestfit_first") or figure == "bestfit_len":  # the collector's share of the fastest run
            row[f"{figure}_gc_s"] = round(min(good, key=lambda r: r[figure])[f"{figure}_gc_s"], 6)
        if figure.startswith("rank_"):
            for part in ("_plan", "_plan_in_loop"):
                row[f"{figure}{part}"] = round(min(r[f"{figure}{part}"] for r in good), 9)  # ~10 us: ns kept
        if figure == "inspect":
            row["inspect_peak_rss_anon_mb"] = round(max(r["inspect_peak_rss_anon_mb"] for r in good), 1)
        if figure == "plan":
            row["plan_peak_rss_anon_mb"] = round(max(r["plan_peak_rss_anon_mb"] for r in good), 1)
            row["plan_s_per_million_docs"] = round(row["plan"] / (good[0]["num_documents"] / 1e6), 4)
    row["open"] = round(min(opens), 6) if opens else row.get("open")
    row["rss_anon_mb"] = round(max(rss), 1) if rss else None
    row["rss_anon_mb_imports"] = round(min(imports), 1) if imports else None
    for suffix, name in (
        ("_plan", "rank_512_vs_1"),
        ("_plan_in_loop", "rank_512_vs_1_in_loop"),
        ("", "rank_512_vs_1_total"),
    ):
        one, many = row.get(f"rank_1{suffix}"), row.get(f"rank_512{suffix}")
        if isinstance(one, float) and isinstance(many, float) and one > 0:
            row[name] = round(many / one, 3)
    return row


def growth(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each corpus's figures divided by the first corpus's (numbers only)."""
    base = next(iter(rows.values()))
    out = {}
    for name, row in rows.items():
        out[name] = {
            k: round(v / base[k], 3)
            for k, v in row.items()
            if isinstance(v, float) and isinstance(base.get(k), float) and base[k] > 0 and k != "write_s"
        }
    return out


def targets_met(row: dict[str, Any], ratio: dict[str, float]) -> dict[str, bool]:
    """The issue's targets for one corpus: absolute bound and growth <= 1.3x per figure taken."""
    taken = [k for k in TARGETS if isinstance(row.get(k), float)]  # figures left out have no verdict
    met = {k: row[k] <= TARGETS[k] for k in taken}
    met.update({f"{k}_growth": ratio.get(k, float("inf")) <= 1.3 for k in taken})
    if "rank_512_vs_1" in row:
        met["rank_512_vs_1"] = row["rank_512_vs_1"] <= 1.3
    return met


def headline(rows: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The figures docs/BENCHMARKS.md shows: each corpus's open, first batches, RssAnon and the per-rank ratios."""
    units = {
        "open": "s",
        "window_first": "s",
        "bestfit_first": "s",
        "bestfit_first_global": "s",
        "bestfit_first_blocks": "s",
        "rss_anon_mb": "MB",
        "inspect_peak_rss_anon_mb": "MB",
        "rank_512_vs_1": "x",
        "rank_512_vs_1_in_loop": "x",
        "rank_512_vs_1_total": "x",
    }
    return {
        f"{name} {k}": f"{row[k]} {u}"
        for name, row in rows.items()
        for k, u in units.items()
        if isinstance(row.get(k), float)
    }


def main(argv: list[str] | None = None) -> int:
    import argparse
    import compileall

    from _report import emit  # bench/ is on sys.path when a bench runs as a script

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", nargs="+", default=["1M:100", "10M:1000", "20M:2000", "2M:10000"])
    ap.add_argument("--rounds", type=int, default=1, help="fresh processes per figure (the minimum is kept)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one probe process may take")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/harness"))
    ap.add_argument("--drop", action="store_true", help="delete each corpus once measured")
    ap.add_argument("--write-only", action="store_true", help="write the missing corpora, measure nothing")
    ap.add_argument("--figures", nargs="+", choices=FIGURES, default=list(FIGURES), help="figures to take")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pretrain_scale.json")
    args = ap.parse_args(argv)
    rows: dict[str, dict[str, Any]] = {}
    # The probes import compiled bytecode, as from an installed package: compiling sources in each
    # process (a checkout run with PYTHONDONTWRITEBYTECODE) leaves ~2 MB of freed heap in RssAnon.
    compileall.compile_dir(str(REPO / "h5corpus"), quiet=1)
    compileall.compile_file(str(Path(__file__).resolve()), quiet=1)
    load0 = list(os.getloadavg())
    torch_mb = None if args.write_only else torch_rss_anon_mb()
    for spec in args.corpora:
        docs, shards = parse_spec(spec)
        mpath, write_s = corpus(args.cache, docs, shards)
        if args.write_only:
            print(f"{spec}: {mpath} ({write_s:.1f} s)", file=sys.stderr, flush=True)
            continue
        row = {"documents": docs, "shards": shards, "write_s": round(write_s, 1)}
        row.update(measure(mpath, args.figures, args.rounds, args.timeout))
        if isinstance(row.get("rss_anon_mb"), float) and torch_mb is not None:
            row["rss_anon_mb_over_torch"] = round(row["rss_anon_mb"] - torch_mb, 1)
        rows[spec] = row
        print(json.dumps({spec: row}), file=sys.stderr, flush=True)
        if args.drop:
            shutil.rmtree(mpath.parent.parent, ignore_errors=True)
    if args.write_only:
        return 0
    ratios = growth(rows)
    report = {
        "load_average": {"before": load0, "after": list(os.getloadavg())},
        "rss_anon_mb_torch_alone": torch_mb,
        "bytecode": "compiled (compileall) before the probes, as an installed package's; probes import this module's bytecode",
        "settings": {"window": WINDOW, "bestfit": BESTFIT, "ranks": RANKS, "length_median": LENGTH_MEDIAN},
        "corpora": rows,
        "growth_vs_first": ratios,
        "targets_met": {k: targets_met(rows[k], ratios[k]) for k in rows},
    }
    emit(report, args.out, figures=headline(rows))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "probe":
        print(json.dumps(probe(Path(sys.argv[2]), sys.argv[3])))
    else:
        sys.exit(main())
