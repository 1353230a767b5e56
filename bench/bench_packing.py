"""Packing benchmark: pack fill, packer speed, loader tokens/s vs the sliding-window loader.

Prints one JSON object. Figures are ratios against baselines measured in the same run on the same
tokens (the dev corpus tokenized with GPT-2 when ../shared is present, else the standard library's
sources as byte ids):

* ``fill``: real input tokens / pack capacity at ``max_seq_len`` 4,096 and 35 packs per microbatch,
  for the train split the loader reads and for all dev documents (train + validation, the lengths a
  plain simulation of the packing algorithm uses), with mode ``buffer`` at packing_buffer 64 and
  1,024, ``bfd`` with its default 16,384-chunk blocks and ``bfd`` over the whole epoch at once.
  Three ways of counting: ``fill`` (every pack, the epoch's final partial microbatch included),
  ``fill_full_microbatches`` (final partial microbatch excluded) and ``fill_padded_last`` (the final
  microbatch charged ``batch_size`` packs). Targets: >= 0.998 at buffer 64, >= 0.9995 with BFD.
* ``packer``: chunks/s of the packers on the epoch's chunk lengths, as a speedup over the naive
  O(n x buffer) / O(n x packs) scans of the same algorithms (``tests/helpers.py``'s reference
  packers, measured on a prefix); BFD chunks/s on
  10^4 and 10^5 synthetic chunks (a ratio near 1 = per-chunk cost independent of the buffer size).
* ``loader``: BestFitDataset tokens/s as a ratio to SlidingWindowDataset over the same corpus at
  seq_len 4,096 and 35 windows per batch (without and with ``document_mask``), measured three ways:
  ``in_process`` (whole epochs iterated in this process: the loaders' own CPU cost per token, compact
  batches as yielded), ``in_process_fields_cpu`` (the same with the int64 fields materialized on the
  CPU), ``in_process_cpu_time`` (whole epochs per second of this process's CPU time, the least
  noisy on a shared machine) and ``dataloader_2_workers`` (torch DataLoader, 2 worker processes,
  after the first batch: what a training loop receives). Target: best-fit >= 0.5x the window
  loader. Every measurement is interleaved (each repetition runs every loader once) and the best
  repetition counts.
* ``verify``: what verified reads (format v2: each chunk checked against its xxh3 checksum the
  first time a process touches it) cost the loaders: whole epochs of the window loader and of the
  best-fit loader (buffer 64 and BFD) in this process, on a corpus opened fresh for every epoch
  (so every chunk is verified again and the first-touch cost counts in full) with ``verify=True``
  vs ``verify=False``, interleaved, best of 7, in wall time (``cost_pct``) and in this process's CPU
  time (``cpu_cost_pct``, less sensitive to other jobs). Target: <= 5% cost.

Usage: python bench/bench_packing.py [--manifest PATH] [--out FILE] [--only-verify]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _report import emit  # bench/ is on sys.path when a bench runs as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from h5corpus.loaders.chunking import chunk_layout  # noqa: E402
from h5corpus.loaders.packers import best_fit_packs, bfd_packs  # noqa: E402
from h5corpus.loaders.plan import epoch_order, pack_fill  # noqa: E402
from h5corpus.storage import format as fmt  # noqa: E402
from h5corpus.storage.reader import open_corpus  # noqa: E402
from tests.helpers import (  # noqa: E402
    BYTE_IDENTITY,
    byte_encode,
    gpt2_tiktoken,
    naive_bfd_packs,
    naive_buffer_packs,
    read_jsonl_texts,
    stdlib_texts,
    write_corpus,
)

L, B = 4096, 35


def best(fn, repeat=3):
    """(best wall seconds of ``repeat`` runs, last result)."""
    t_best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        t_best = min(t_best, time.perf_counter() - t)
    return t_best, out


def build_corpus(root: Path) -> tuple[Path, str]:
    """Write the dev corpus (GPT-2 via tiktoken) or, without ../shared, stdlib byte ids."""
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


def verify_cost(manifest: Path, reps: int = 7) -> dict:
    """Whole in-process epochs on a freshly opened corpus, verify=True vs verify=False."""
    from h5corpus.loaders.bestfit import BestFitDataset
    from h5corpus.loaders.window import SlidingWindowDataset

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

    inf = float("inf")
    wall, cpu = (
        {(k, v): inf for k in makers for v in (True, False)},
        {(k, v): inf for k in makers for v in (True, False)},
    )
    for _ in range(reps):  # interleaved: both variants of every loader see the same machine load
        for k, make in makers.items():
            for v in (True, False):
                w, c = epoch(make, v)
                wall[k, v], cpu[k, v] = min(wall[k, v], w), min(cpu[k, v], c)
    return {
        k: {
            "verified_s": round(wall[k, True], 4),
            "unverified_s": round(wall[k, False], 4),
            "cost_pct": round((wall[k, True] / wall[k, False] - 1) * 100, 2),
            "verified_cpu_s": round(cpu[k, True], 4),
            "unverified_cpu_s": round(cpu[k, False], 4),
            "cpu_cost_pct": round((cpu[k, True] / cpu[k, False] - 1) * 100, 2),
        }
        for k in makers
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--manifest", type=Path, help="an already built corpus (default: build the dev corpus in a temp dir)"
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only-verify", action="store_true", help="run only the verified-reads cost section")
    args = ap.parse_args()
    out: dict = {"bench": "packing", "format_version": fmt.FORMAT_VERSION, "max_seq_len": L, "batch_size": B}
    with tempfile.TemporaryDirectory() as tmp:
        if args.manifest:
            manifest, source = args.manifest, str(args.manifest)
        else:
            t = time.perf_counter()
            manifest, source = build_corpus(Path(tmp))
            out["build_seconds"] = round(time.perf_counter() - t, 1)
        out["source"] = source
        train = open_corpus(manifest, "train")
        lengths = train.doc_lengths
        out["train"] = {"documents": train.num_documents, "tokens": train.num_tokens, "pairs": int((lengths - 1).sum())}
        out["verify"] = verify_cost(manifest)
        if args.only_verify:
            train.close()
            emit(out, args.out, indent=1)
            return

        # -- fill ----------------------------------------------------------------------------------
        out["fill"] = {"train": fill_rows(lengths)}
        try:
            val = open_corpus(manifest, "validation").doc_lengths
            out["fill"]["all_documents"] = fill_rows(np.concatenate([lengths, val]))
        except Exception as e:  # a corpus without a validation split
            out["fill"]["all_documents"] = f"unavailable: {e}"

        # -- packer speed ----------------------------------------------------------------------------
        _, _, clen = chunk_layout(lengths[epoch_order(lengths.size, 0, 0)], L)
        cl = clen.tolist()
        prefix = cl[:3000]
        pk: dict = {"chunks": len(cl)}
        for buf in (64, 1024):
            t_fast, packs = best(lambda: best_fit_packs(clen, L, buf))
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
        out["packer"] = pk

        # -- loader tokens/s ---------------------------------------------------------------------------
        from torch.utils.data import DataLoader

        from h5corpus.loaders.bestfit import BestFitDataset
        from h5corpus.loaders.window import SlidingWindowDataset

        loaders = {
            "window": SlidingWindowDataset(train, seq_len=L, batch_size=B),
            "window_document_mask": SlidingWindowDataset(train, seq_len=L, batch_size=B, document_mask=True),
            "bestfit_buffer_64": BestFitDataset(train, L, B, 64, mode="buffer"),
            "bestfit_bfd": BestFitDataset(train, L, B, mode="bfd"),
        }

        def in_process(ds):
            """Tokens/s of one whole epoch iterated in this process (the loader's own CPU cost)."""
            t, n = time.perf_counter(), 0
            for b in ds:
                n += b.num_tokens
            return n / (time.perf_counter() - t)

        def in_process_cpu(ds):
            """The same per second of this process's CPU time (time.process_time): insensitive to
            other jobs taking the cores, still sensitive to their use of caches and memory."""
            t, n = time.process_time(), 0
            for b in ds:
                n += b.num_tokens
            return n / (time.process_time() - t)

        def fields_cpu(ds):
            """Tokens/s of one whole epoch with input_ids, targets and position_ids materialized
            as int64 on the CPU (what a CPU consumer pays; a GPU consumer widens on the device)."""
            t, n = time.perf_counter(), 0
            for b in ds:
                b.input_ids, b.targets, b.position_ids  # noqa: B018
                n += b.num_tokens
            return n / (time.perf_counter() - t)

        def with_workers(ds, workers=2):
            """Tokens/s through a DataLoader with ``workers`` processes, after the first batch
            (steady state: worker start-up excluded)."""
            it = iter(DataLoader(ds, batch_size=None, num_workers=workers))
            next(it)
            t, n = time.perf_counter(), 0
            for b in it:
                n += b.num_tokens
            return n / (time.perf_counter() - t)

        ld: dict = {}
        for how, fn, reps in (
            ("in_process", in_process, 7),
            ("in_process_cpu_time", in_process_cpu, 7),
            ("in_process_fields_cpu", fields_cpu, 5),
            ("dataloader_2_workers", with_workers, 3),
        ):
            rate = {k: 0.0 for k in loaders}
            for _ in range(reps):  # interleaved, best of reps: all loaders see the same machine load
                for k, ds in loaders.items():
                    rate[k] = max(rate[k], fn(ds))
            ld[how] = {
                k: {"tokens_per_s": round(v), "ratio_vs_window": round(v / rate["window"], 3)} for k, v in rate.items()
            }
        out["loader"] = ld
        train.close()

    emit(out, args.out, indent=1)


if __name__ == "__main__":
    main()
