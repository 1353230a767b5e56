"""Experiment, not a shipped path: how fast would the best-fit loader be with its per-chunk loops
compiled? Evidence for the in-process target of docs/PACKING.md (best-fit >= 0.5x the window
loader), which the pure-Python loader does not reach.

    PYTHONPATH=/path/to/numba python bench/experiment_compiled_packer.py [--reps 7] [--out FILE]

Needs ``numba``, which the package itself does not depend on (it is only in the ``unigram`` and
``dev`` extras): install it, or apart, e.g. ``pip install --target /tmp/nb numba llvmlite`` with that
folder on PYTHONPATH. Without it, it prints ``{"available": false, ...}`` and exits 0.

The experimental loader does what ``BestFitDataset(corpus, 4096, 35, 64, mode="buffer")`` does for one
epoch: same order, chunking, buffer best fit and compact ``VarlenBatch`` layout. Its pack loop
(bisect / pop / insert on a sorted int64 array) is compiled with numba. The segment copy runs two
ways: ``compiled_packer`` uses the shipped copy (``VarlenBatch.from_row_bytes``: one
``bytearray.join`` of a view per segment), and ``compiled_packer_and_copy`` uses a numba loop of
slice copies into ``alloc_compact``'s buffer. Everything else (epoch order, chunking, run lookup)
is numpy code like the shipped loader's, through the public API.

It checks that both variants' batches equal the shipped loader's bit for bit. Then it times whole
epochs in process, interleaved with the window loader and the shipped best-fit loader (best of
``--reps``), and prints JSON ratios to the window loader.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from operator import getitem
from pathlib import Path

import numpy as np
from _report import emit  # bench/ is on sys.path when a bench runs as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

L, B, BUF = 4096, 35, 64


def compiled_loader(corpus, nb):
    """A function ``epoch(seed, ep, copy) -> iterator of VarlenBatch`` with a compiled pack loop;
    ``copy``: ``"join"`` (the shipped segment copy) or ``"numba"`` (a compiled copy loop)."""

    from h5corpus.loaders.batch import VarlenBatch, alloc_compact
    from h5corpus.loaders.chunking import document_chunks as chunk_layout
    from h5corpus.loaders.epochplan import epoch_order

    @nb.njit(cache=True)
    def admit(lengths, keys, nk, pos):
        """Insert stream chunk ``pos`` into the sorted keys[:nk]; key = length << 32 | (2**32 - 1 - pos)."""
        k = (lengths[pos] << 32) | ((1 << 32) - 1 - pos)
        j = np.searchsorted(keys[:nk], k)
        keys[j + 1 : nk + 1] = keys[j:nk].copy()
        keys[j] = k

    @nb.njit(cache=True)
    def pack(lengths, keys, state, capacity, count, out, ends):
        """Up to ``count`` packs of buffer best fit: picks' keys into ``out``, each pack's end into
        ``ends``. state = [buffered keys, next stream chunk]. Returns (picks, packs)."""
        n, size = lengths.size, keys.size
        nk, pos = state[0], state[1]
        no = ne = 0
        full = (capacity << 32) | ((1 << 32) - 1)
        q = full
        while nk < size and pos < n:  # top up
            admit(lengths, keys, nk, pos)
            nk += 1
            pos += 1
        while ne < count:
            i = np.searchsorted(keys[:nk], q, side="right")
            if i == 0:  # nothing fits: the pack is done (or, with an empty pack, the stream is)
                if q == full:
                    break
                ends[ne] = no
                ne += 1
                q = full
                continue
            k = keys[i - 1]
            keys[i - 1 : nk - 1] = keys[i:nk].copy()
            nk -= 1
            out[no] = k
            no += 1
            q -= (k >> 32) << 32
            if pos < n:  # the arrival that replaces the pick
                admit(lengths, keys, nk, pos)
                nk += 1
                pos += 1
        state[0], state[1] = nk, pos
        return no, ne

    @nb.njit(cache=True)
    def gather(runs, run, first, lens, out):
        o = 0
        for s in range(run.size):
            m = lens[s] + 1
            if run[s] >= 0:
                out[o : o + m] = runs[run[s]][first[s] : first[s] + m]
            o += m

    table = corpus.run_table()  # every shard memory-mapped (the bench corpus is raw)
    views = [memoryview(r).cast("B") for r in table.runs]
    runs = tuple(table.runs)  # a numba UniTuple
    offsets = np.asarray(corpus.doc_offsets, dtype=np.int64)
    w = np.dtype(corpus.dtype).itemsize

    def epoch(seed: int, ep: int, copy: str = "join"):
        d, start, clen = chunk_layout(corpus.doc_lengths(), L)  # chunks in corpus order
        order = epoch_order(clen.size, seed, ep)  # the epoch's chunk order (docs/PACKING.md, section 4)
        cdoc, start, clen = d[order], start[order], clen[order]
        keys = np.zeros(BUF, np.int64)
        state = np.zeros(2, np.int64)
        out = np.empty(B * L, np.int64)
        ends = np.empty(B, np.int64)
        while True:
            no, ne = pack(clen, keys, state, L, B, out, ends)
            if not no:
                return
            idx = (2**32 - 1) - (out[:no] & (2**32 - 1))
            lens = clen[idx]
            S, P, T = no, ne, int(lens.sum())
            pos = offsets[cdoc[idx]] + start[idx]
            run, first, room = table.locate(pos)
            row_ends = np.cumsum(lens).astype(np.int32)
            pack_lengths = np.add.reduceat(lens, np.concatenate([[0], ends[: ne - 1]])).astype(np.int32)
            if copy == "numba":  # one compiled loop of slice copies into the batch's buffer
                run[lens + 1 > room] = -1
                parts = alloc_compact(S, T, corpus.dtype, packs=P)
                parts.row_cu[0] = 0
                parts.row_cu[1:] = row_ends
                parts.pack_lengths[:] = pack_lengths
                gather(runs, run, first, lens, parts.tokens)
                at = np.cumsum(lens + 1) - (lens + 1)
                for s in np.flatnonzero(run < 0).tolist():
                    n = int(lens[s]) + 1
                    corpus.tokens(int(pos[s]), int(pos[s]) + n, out=parts.tokens[at[s] : at[s] + n])
                yield parts.batch(int(lens.max()))
            else:  # the shipped copy: one bytearray.join of the header and a view per segment
                lo = first * w
                hi = lo + (lens + 1) * w
                rows = list(map(getitem, map(views.__getitem__, run.tolist()), map(slice, lo.tolist(), hi.tolist())))
                for s in np.flatnonzero(lens + 1 > room).tolist():
                    rows[s] = corpus.tokens(int(pos[s]), int(pos[s] + lens[s] + 1))
                yield VarlenBatch.from_row_bytes(rows, row_ends, pack_lengths, corpus.dtype, int(lens.max()))

    return epoch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    try:
        import numba as nb
    except ImportError as e:
        emit({"experiment": "compiled_packer", "available": False, "why": f"numba not importable: {e}"}, args.out)
        return
    from bench_packing import build_corpus

    from h5corpus.loaders.bestfit import BestFitDataset
    from h5corpus.loaders.window import SlidingWindowDataset
    from h5corpus.storage.reader import open_corpus

    with tempfile.TemporaryDirectory() as tmp:
        manifest, source = build_corpus(Path(tmp))
        train = open_corpus(manifest, "train")
        epoch = compiled_loader(train, nb)
        shipped = BestFitDataset(train, L, B, BUF, mode="buffer", rank=0, world_size=1)
        window = SlidingWindowDataset(train, seq_len=L, batch_size=B, rank=0, world_size=1)
        t = time.perf_counter()
        list(epoch(0, 0, "numba"))  # compiles (or loads numba's cache)
        compile_s = time.perf_counter() - t
        ref = list(shipped)
        for copy in ("join", "numba"):
            got = list(epoch(0, 0, copy))
            assert len(got) == len(ref), (copy, len(got), len(ref))
            for a, b in zip(got, ref):
                for f in ("input_ids", "targets", "position_ids", "cu_seqlens", "pack_lengths"):
                    assert np.array_equal(getattr(a, f).numpy(), getattr(b, f).numpy()), (copy, f)
                assert a.max_seqlen == b.max_seqlen

        def rate(it) -> float:
            t, n = time.perf_counter(), 0
            for b in it:
                n += b.num_tokens
            return n / (time.perf_counter() - t)

        runs = {
            "window": lambda: window,
            "bestfit_buffer_64_shipped": lambda: shipped,
            "bestfit_buffer_64_compiled_packer": lambda: epoch(0, 0, "join"),
            "bestfit_buffer_64_compiled_packer_and_copy": lambda: epoch(0, 0, "numba"),
        }
        best = dict.fromkeys(runs, 0.0)
        for _ in range(args.reps):  # interleaved: all see the same machine load
            for k, make in runs.items():
                best[k] = max(best[k], rate(make()))
        train.close()
    emit(
        {
            "experiment": "compiled_packer",
            "available": True,
            "numba": nb.__version__,
            "source": source,
            "microbatches": len(ref),
            "batches_equal_shipped": True,
            "first_epoch_with_compile_s": round(compile_s, 2),
            "in_process": {
                k: {"tokens_per_s": round(v), "ratio_vs_window": round(v / best["window"], 3)} for k, v in best.items()
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
