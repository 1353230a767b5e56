"""Packing benchmark: pack fill, packer speed, plan cost per million documents, loader tokens/s vs
the sliding-window loader, and the same loader figures against another checkout (no regression).

Prints one JSON object. Figures are ratios against baselines measured in the same run on the same
tokens (the dev corpus tokenized with GPT-2 when ../shared is present, else the standard library's
sources as byte ids):

* ``fill``: real input tokens / pack capacity at ``max_seq_len`` 4,096 and 35 packs per microbatch,
  for the train split the loader reads and for all dev documents (train + validation), with mode
  ``buffer`` at packing_buffer 64 and 1,024, ``bfd`` with its default 16,384-chunk blocks and ``bfd``
  over the whole epoch at once. Three ways of counting: ``fill`` (every pack, the epoch's final
  partial microbatch included), ``fill_full_microbatches`` (final partial microbatch excluded) and
  ``fill_padded_last`` (the final microbatch charged ``batch_size`` packs). Targets: >= 0.998 at
  buffer 64, >= 0.9995 with BFD.
* ``packer``: chunks/s of the packers on the epoch's chunk lengths, as a speedup over the naive
  O(n x buffer) / O(n x packs) scans of the same algorithms (``testkit/corpora.py``'s reference
  packers, measured on a prefix); BFD chunks/s on 10^4 and 10^5 synthetic chunks (a ratio near 1 =
  per-chunk cost independent of the buffer size).
* ``plan``: the global plan of one epoch over 1-10 M synthetic documents whose lengths are drawn
  (seeded, with replacement) from the train split's: seconds to the first microbatch (chunk table,
  chunk order, plan set-up, first group), seconds to plan the whole epoch (what ``len()``, a
  resume's check and the last step need; a consumer spreads it over the epoch), per million
  documents; memory per million documents (tracemalloc peak of the set-up, and the plan's arrays).
* ``loader``: BestFitDataset tokens/s as a ratio to SlidingWindowDataset over the same corpus at
  seq_len 4,096 and 35 windows per batch (without and with ``document_mask``): ``in_process``
  (whole epochs in this process), ``in_process_cpu_time`` (per second of this process's CPU time),
  ``in_process_fields_cpu`` (int64 fields materialized on the CPU), ``rank0_of_4`` (rank 0 of a
  4-rank run: its quarter of the global sequence, whose plan it still computes whole) and
  ``dataloader_2_workers`` (torch DataLoader, 2 worker processes, after the first batch). Every
  measurement is interleaved (each repetition runs every loader once); the best repetition counts.
* ``compare`` (``--compare-tree PATH``, e.g. a worktree of the previous commit): PATH's h5corpus
  loaded beside this one (a copy under another package name) and both checkouts' loaders iterated
  in one process, every loader of both once per repetition, best of ``--compare-reps``: tokens/s
  per checkout (wall clock and CPU time), this / other, and each one's ratio to its window loader.
* ``verify``: what verified reads (format v2: each chunk checked against its xxh3 checksum the
  first time a process touches it) cost the loaders: whole epochs of the window loader and of the
  best-fit loader (buffer 64 and BFD) in this process, on a corpus opened fresh for every epoch
  (so every chunk is verified again and the first-touch cost counts in full) with ``verify=True``
  vs ``verify=False``, interleaved (the pair's order alternating per repetition), best of 15, in
  wall time (``cost_pct``) and in this process's CPU time (``cpu_cost_pct``, less sensitive to
  other jobs), and the median over repetitions of each adjacent pair's CPU-time ratio
  (``cpu_cost_pct_paired_median``: the two epochs of a pair see nearly the same machine load, so
  this moves least between runs on a busy machine). Target: <= 5% cost.

Usage: python bench/bench_packing.py [--manifest PATH] [--out FILE] [--sections fill,packer,plan,loader,compare,verify]
       [--plan-docs 1,3,10] [--compare-tree PATH] [--compare-reps 30] [--only-verify]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
from _report import emit  # bench/ is on sys.path when a bench runs as a script

REPO = Path(__file__).resolve().parent.parent

L, B = 4096, 35


def best(fn, repeat=3):
    """(best wall seconds of ``repeat`` runs, last result)."""
    t_best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        t_best = min(t_best, time.perf_counter() - t)
    return t_best, out


def use_tree(tree: Path) -> None:
    """Import h5corpus (and testkit.corpora) from ``tree`` in this process."""
    sys.path.insert(0, str(tree))


def build_corpus(root: Path) -> tuple[Path, str]:
    """Write the dev corpus (GPT-2 via tiktoken) or, without ../shared, stdlib byte ids."""
    from testkit.corpora import BYTE_IDENTITY, byte_encode, gpt2_tiktoken, read_jsonl_texts, stdlib_texts, write_corpus

    gpt2 = gpt2_tiktoken()
    if gpt2 is not None:
        enc, ident, dev = gpt2
        texts = read_jsonl_texts(dev)
        m = write_corpus(
            root,
            texts,
            lambda ts: enc.encode_ordinary_batch(list(ts)),
            ident,
            chunk_tokens=1 << 18,
            shard_tokens=3_000_000,
        )
        return m, "dev corpus, GPT-2 (tiktoken)"
    m = write_corpus(
        root, stdlib_texts(limit=100000), byte_encode, BYTE_IDENTITY, chunk_tokens=1 << 18, shard_tokens=3_000_000
    )
    return m, "stdlib sources, byte ids (../shared absent)"


def fill_rows(lengths: np.ndarray) -> dict:
    from h5corpus.loaders.epochplan import pack_fill

    rows = {}
    for name, mode, buf in (
        ("buffer_64", "buffer", 64),
        ("buffer_1024", "buffer", 1024),
        ("bfd_16384", "bfd", 16384),
        ("bfd_epoch", "bfd", 1 << 40),
    ):
        st = pack_fill(lengths, max_seq_len=L, batch_size=B, packing_buffer=buf, seed=0, mode=mode)
        rows[name] = {
            "fill": round(st.fill, 6),
            "fill_full_microbatches": round(st.fill_full_microbatches, 6),
            "fill_padded_last": round(st.fill_padded_last, 6),
            "packs": st.packs,
            "microbatches": st.microbatches,
            "chunks": st.chunks,
            "p10_pack_fill": round(float(np.quantile(st.pack_fill, 0.1)), 6),
        }
    return rows


def packer_rows(lengths: np.ndarray) -> dict:
    from h5corpus.loaders.chunking import ChunkTable
    from h5corpus.loaders.epochplan import epoch_order
    from h5corpus.loaders.packers import best_fit_packs, bfd_packs
    from testkit.corpora import naive_bfd_packs, naive_buffer_packs

    table = ChunkTable.build(lengths, L)
    clen = table.length[epoch_order(table.num_chunks, 0, 0)].astype(np.int64)  # the epoch's stream
    cl = clen.tolist()
    prefix = cl[:3000]
    pk: dict = {"chunks": len(cl)}
    for buf in (64, 1024):
        t_fast, _ = best(lambda: best_fit_packs(clen, L, buf))
        t_pre, _ = best(lambda: best_fit_packs(np.asarray(prefix), L, buf))
        t_naive, naive = best(lambda: naive_buffer_packs(prefix, L, buf), repeat=1)
        assert naive == best_fit_packs(np.asarray(prefix), L, buf)
        pk[f"buffer_{buf}"] = {
            "chunks_per_s": round(len(cl) / t_fast),
            "speedup_vs_naive_scan": round(t_naive / t_pre, 1),
        }
    t_fast, _ = best(lambda: bfd_packs(clen, L))
    t_pre, pre_packs = best(lambda: bfd_packs(np.asarray(prefix), L))
    t_naive, naive = best(lambda: naive_bfd_packs(prefix, L), repeat=1)
    assert naive == pre_packs
    pk["bfd_epoch"] = {"chunks_per_s": round(len(cl) / t_fast), "speedup_vs_naive_scan": round(t_naive / t_pre, 1)}
    rng = np.random.default_rng(0)
    rate = {}
    for n in (10_000, 100_000):
        x = rng.choice(clen, n)
        t, _ = best(lambda: bfd_packs(x, L))
        rate[n] = n / t
    pk["bfd_synthetic"] = {
        "chunks_per_s_1e4": round(rate[10_000]),
        "chunks_per_s_1e5": round(rate[100_000]),
        "rate_ratio_1e5_vs_1e4": round(rate[100_000] / rate[10_000], 3),
    }
    return pk


def plan_rows(lengths: np.ndarray, millions: list[float]) -> dict:
    """The global plan's cost over synthetic corpora of ``millions`` x 10^6 documents."""
    from h5corpus.loaders.chunking import ChunkTable
    from h5corpus.loaders.epochplan import EpochPlan, PlanSettings, epoch_order

    rows: dict = {}
    rng = np.random.default_rng(0)
    for mil in millions:
        n = int(mil * 1_000_000)
        docs = rng.choice(lengths, n).astype(np.int64)
        row: dict = {"documents": n}
        for mode in ("buffer", "bfd"):
            st = PlanSettings(L, B, None, 0, mode)

            def setup():
                table = ChunkTable.build(docs, L)
                plan = EpochPlan(table, epoch_order(table.num_chunks, 0, 0), st, epoch=0)
                return plan, plan.next_group(1)  # the first microbatch

            tracemalloc.start()
            plan, first = setup()
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            del plan, first
            t0 = time.perf_counter()
            plan, first = setup()
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            M = first.num_microbatches + plan.count_microbatches()
            t_all = time.perf_counter() - t0 + t_first
            held = sum(
                a.nbytes for a in (plan.table.doc, plan.table.length, plan.table.first, plan.stream, plan.lengths)
            )
            row[mode] = {
                "chunks": plan.num_chunks,
                "microbatches": M,
                "first_microbatch_s": round(t_first, 3),
                "whole_epoch_s": round(t_all, 3),
                "whole_epoch_s_per_million_docs": round(t_all / mil, 3),
                "plan_us_per_microbatch": round((t_all - t_first) / M * 1e6, 1),
                "setup_peak_mb_per_million_docs": round(peak / 1e6 / mil, 1),
                "plan_arrays_mb_per_million_docs": round(held / 1e6 / mil, 1),
            }
            del plan
        rows[f"{mil:g}M"] = row
    return rows


def loader_rates(manifest: Path, reps: int, modes: tuple[str, ...]) -> dict:
    """Tokens/s of each loader (best of ``reps`` interleaved repetitions) per way of measuring."""
    from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus

    train = open_corpus(manifest, "train")
    loaders = {
        "window": lambda **kw: SlidingWindowDataset(train, seq_len=L, batch_size=B, **kw),
        "window_document_mask": lambda **kw: SlidingWindowDataset(
            train, seq_len=L, batch_size=B, document_mask=True, **kw
        ),
        "bestfit_buffer_64": lambda **kw: BestFitDataset(train, L, B, 64, mode="buffer", **kw),
        "bestfit_bfd": lambda **kw: BestFitDataset(train, L, B, mode="bfd", **kw),
    }
    built = {k: make() for k, make in loaders.items()}

    def run(ds, clock=time.perf_counter, fields=False):
        t, n = clock(), 0
        for b in ds:
            if fields:
                b.input_ids, b.targets, b.position_ids  # noqa: B018
            n += b.num_tokens
        return n / (clock() - t)

    def with_workers(ds, workers=2):
        from torch.utils.data import DataLoader

        it = iter(DataLoader(ds, batch_size=None, num_workers=workers))
        next(it)  # steady state: worker start-up excluded
        t, n = time.perf_counter(), 0
        for b in it:
            n += b.num_tokens
        return n / (time.perf_counter() - t)

    hows = {
        "in_process": lambda k: run(built[k]),
        "in_process_cpu_time": lambda k: run(built[k], time.process_time),
        "in_process_fields_cpu": lambda k: run(built[k], fields=True),
        "rank0_of_4": lambda k: run(loaders[k](rank=0, world_size=4)),
        "dataloader_2_workers": lambda k: with_workers(built[k]),
    }
    out: dict = {}
    for how in modes:
        rate = {k: 0.0 for k in loaders}
        for _ in range(reps if how != "dataloader_2_workers" else max(reps // 2, 1)):
            for k in loaders:  # interleaved: all loaders see the same machine load
                rate[k] = max(rate[k], hows[how](k))
        out[how] = {
            k: {"tokens_per_s": round(v), "ratio_vs_window": round(v / rate["window"], 3)} for k, v in rate.items()
        }
    return out


def _import_as(tree: Path, name: str, tmp: Path):
    """``tree``'s h5corpus package imported under ``name`` (a copy; it imports itself relatively)."""
    import importlib
    import shutil

    dst = tmp / "pkgs" / name
    shutil.copytree(tree / "h5corpus", dst, ignore=shutil.ignore_patterns("__pycache__"))
    absolute = re.compile(r"^\s*(from h5corpus[ .]|import h5corpus\b)", re.MULTILINE)
    for f in dst.rglob("*.py"):
        if absolute.search(f.read_text()):
            raise RuntimeError(f"{f} imports h5corpus absolutely: it cannot be loaded beside this one")
    sys.path.insert(0, str(tmp / "pkgs"))
    return importlib.import_module(name)


def compare_rows(manifest: Path, other: Path, reps: int, tmp: Path) -> dict:
    """This checkout's loaders against ``other``'s in one process, epochs interleaved (every
    loader of both once per repetition), best of ``reps``: the fairest A/B on a shared machine."""
    import h5corpus as this_pkg

    other_pkg = _import_as(other, "h5corpus_other", tmp)
    made = {}
    for tag, pkg in (("this", this_pkg), ("other", other_pkg)):
        c = pkg.open_corpus(manifest, "train")
        made[tag] = {
            "window": pkg.SlidingWindowDataset(c, L, B),
            "window_document_mask": pkg.SlidingWindowDataset(c, L, B, document_mask=True),
            "bestfit_buffer_64": pkg.BestFitDataset(c, L, B, 64, mode="buffer"),
            "bestfit_bfd": pkg.BestFitDataset(c, L, B, mode="bfd"),
        }
    best: dict = {}
    for _ in range(reps):
        for k in made["this"]:
            for tag in ("this", "other"):
                for clock in (time.perf_counter, time.process_time):
                    t, n = clock(), 0
                    for batch in made[tag][k]:
                        n += batch.num_tokens
                    key = (tag, k, clock.__name__)
                    best[key] = max(best.get(key, 0.0), n / (clock() - t))
    out: dict = {"other_tree": str(other), "repetitions": reps}
    for clock in ("perf_counter", "process_time"):
        row = {}
        for k in made["this"]:
            r = {t: best[(t, k, clock)] for t in ("this", "other")}
            w = {t: best[(t, "window", clock)] for t in ("this", "other")}
            row[k] = {
                "tokens_per_s_this": round(r["this"]),
                "tokens_per_s_other": round(r["other"]),
                "this_over_other": round(r["this"] / r["other"], 3),
                "ratio_vs_window_this": round(r["this"] / w["this"], 3),
                "ratio_vs_window_other": round(r["other"] / w["other"], 3),
            }
        out["wall" if clock == "perf_counter" else "cpu_time"] = row
    return out


def verify_cost(manifest: Path, reps: int = 15) -> dict:
    """Whole in-process epochs on a freshly opened corpus, verify=True vs verify=False."""
    from h5corpus.loaders.bestfit import BestFitDataset
    from h5corpus.loaders.window import SlidingWindowDataset
    from h5corpus.storage.reader import open_corpus

    makers = {
        "window": lambda c: SlidingWindowDataset(c, seq_len=L, batch_size=B),
        "bestfit_buffer_64": lambda c: BestFitDataset(c, L, B, 64, mode="buffer"),
        "bestfit_bfd": lambda c: BestFitDataset(c, L, B, mode="bfd"),
    }

    def epoch(make, verify: bool) -> tuple[float, float]:
        """(wall, CPU) seconds of one epoch, the corpus's open included (both variants open alike)."""
        t, cpu = time.perf_counter(), time.process_time()
        c = open_corpus(manifest, "train", verify=verify)
        assert c.verified == verify
        for _ in make(c):
            pass
        c.close()
        return time.perf_counter() - t, time.process_time() - cpu

    wall: dict = {(k, v): [] for k in makers for v in (True, False)}
    cpu: dict = {(k, v): [] for k in makers for v in (True, False)}
    for rep in range(reps):  # interleaved, the pair's order alternating: neither variant always goes first
        for k, make in makers.items():
            for v in (True, False) if rep % 2 == 0 else (False, True):
                w, c = epoch(make, v)
                wall[k, v].append(w)
                cpu[k, v].append(c)

    def pct(a: float, b: float) -> float:
        return round((a / b - 1) * 100, 2)

    return {
        k: {
            "verified_s": round(min(wall[k, True]), 4),
            "unverified_s": round(min(wall[k, False]), 4),
            "cost_pct": pct(min(wall[k, True]), min(wall[k, False])),
            "verified_cpu_s": round(min(cpu[k, True]), 4),
            "unverified_cpu_s": round(min(cpu[k, False]), 4),
            "cpu_cost_pct": pct(min(cpu[k, True]), min(cpu[k, False])),
            "cpu_cost_pct_paired_median": round(
                float(np.median([pct(a, b) for a, b in zip(cpu[k, True], cpu[k, False])])), 2
            ),
        }
        for k in makers
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--manifest", type=Path, help="an already built corpus (default: build the dev corpus in a temp dir)"
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sections", default="fill,packer,plan,loader,compare,verify")
    ap.add_argument("--only-verify", action="store_true", help="run only the verified-reads cost section")
    ap.add_argument("--plan-docs", default="1,3,10", help="synthetic corpus sizes, in millions of documents")
    ap.add_argument("--compare-tree", type=Path, help="another checkout to measure the loaders against")
    ap.add_argument("--compare-reps", type=int, default=30)
    args = ap.parse_args()
    use_tree(REPO)
    from h5corpus import open_corpus

    sections = {"verify"} if args.only_verify else set(args.sections.split(","))
    out: dict = {"bench": "packing", "format_version": 2, "max_seq_len": L, "batch_size": B}
    with tempfile.TemporaryDirectory() as tmp:
        if args.manifest:
            manifest, source = args.manifest, str(args.manifest)
        else:
            t = time.perf_counter()
            manifest, source = build_corpus(Path(tmp))
            out["build_seconds"] = round(time.perf_counter() - t, 1)
        out["source"] = source
        out["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
        train = open_corpus(manifest, "train")
        lengths = train.doc_lengths()
        out["train"] = {"documents": train.num_documents, "tokens": train.num_tokens, "pairs": int((lengths - 1).sum())}
        if "fill" in sections:
            out["fill"] = {"train": fill_rows(lengths)}
            try:
                val = open_corpus(manifest, "validation").doc_lengths()
                out["fill"]["all_documents"] = fill_rows(np.concatenate([lengths, val]))
            except Exception as e:  # a corpus without a validation split
                out["fill"]["all_documents"] = f"unavailable: {e}"
        if "packer" in sections:
            out["packer"] = packer_rows(lengths)
        if "plan" in sections:
            out["plan"] = plan_rows(lengths, [float(x) for x in args.plan_docs.split(",")])
        if "loader" in sections:
            modes = ("in_process", "in_process_cpu_time", "in_process_fields_cpu", "rank0_of_4", "dataloader_2_workers")
            out["loader"] = loader_rates(manifest, 7, modes)
        if "compare" in sections and args.compare_tree:
            out["compare"] = compare_rows(manifest, args.compare_tree, args.compare_reps, Path(tmp))
        if "verify" in sections:
            out["verify"] = verify_cost(manifest)
        out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        train.close()
    emit(out, args.out, indent=1)


if __name__ == "__main__":
    main()
