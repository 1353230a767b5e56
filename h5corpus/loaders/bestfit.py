"""The best-fit packing dataset: whole documents (chunks of long ones) packed into padding-free microbatches.

Per consumer (DDP rank x DataLoader worker) and epoch, :class:`BestFitDataset` runs

1. the plan (:mod:`~h5corpus.loaders.plan`): document order, this consumer's share, chunking
   (:mod:`~h5corpus.loaders.chunking`), packing (:mod:`~h5corpus.loaders.packers`), grouped into
   microbatches of ``batch_size`` packs: chunk indices only, from document lengths, no tokens read;
2. the reads (:class:`_ChunkReads`, here): each planned microbatch becomes one compact
   :class:`~h5corpus.loaders.batch.VarlenBatch` of real tokens only: ``cu_seqlens`` over every
   segment, positions restarting per segment, ``pack_lengths`` per pack, each segment's inputs plus
   its lookahead token copied from the memory-mapped shards by one ``bytearray.join`` of byte views
   (:meth:`~h5corpus.loaders.batch.VarlenBatch.from_row_bytes`), or by :meth:`Corpus.gather_ranges`
   when a shard is read through HDF5. Unused capacity is never materialized.

Units: every length and capacity is in tokens; a chunk's length is its number of *inputs* (= its
number of next-token pairs).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from operator import getitem
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset

from .batch import VarlenBatch, alloc_compact
from .partition import Consumer, current_consumer
from .plan import PLAN_VERSION, EpochPlan, MicrobatchGroup, PlanSettings, consumer_documents, epoch_order


class _MappedRuns(NamedTuple):
    """A fully memory-mapped split's run table (:class:`~h5corpus.storage.reader.RunTable`) with a
    byte view of each run, for :class:`_ChunkReads`."""

    table: Any
    views: list[memoryview]


def _mapped_runs(corpus: Any) -> _MappedRuns | None:
    """The runs of ``corpus`` in this process, or None when some shard is read through HDF5
    (then reads go through :meth:`Corpus.gather_ranges`). Call after any fork."""
    if not hasattr(corpus, "run_table"):
        return None
    table = corpus.run_table()
    if table is None:
        return None
    return _MappedRuns(table, [memoryview(r).cast("B") for r in table.runs])


class _ChunkReads:
    """Token reads of one plan's chunks into compact batches: chunk ``i`` is ``chunk_len[i] + 1``
    consecutive tokens of its document (its inputs plus the lookahead).

    Memory-mapped corpus (``table`` given): a microbatch's rows are one byte view per segment
    into the run holding it, joined with the header into the batch's one buffer by
    :meth:`VarlenBatch.from_row_bytes`. A segment that crosses a gap between runs (or a shard end)
    is read through ``Corpus.tokens`` instead. Otherwise (a shard read through HDF5) the batch is
    allocated with :func:`~h5corpus.loaders.batch.alloc_compact` and filled by one
    ``Corpus.gather_ranges`` call."""

    def __init__(self, corpus: Any, plan: EpochPlan, table: _MappedRuns | None) -> None:
        self.corpus, self.plan, self.table = corpus, plan, table
        self.dtype = np.dtype(corpus.dtype)

    def _starts(self, chunks: np.ndarray) -> np.ndarray:
        """Global token position of each chunk's first input."""
        plan = self.plan
        return np.asarray(self.corpus.doc_offsets, dtype=np.int64)[plan.chunk_doc[chunks]] + plan.chunk_start[chunks]

    def prepare(self, g: MicrobatchGroup) -> list[_Prepared]:
        """Per-microbatch inputs of :meth:`batch` for a whole group, with one numpy call per
        quantity for the group instead of one per microbatch."""
        S, K = g.chunks.size, len(g.mb_packs) - 1
        seg = np.empty(K + 1, dtype=np.int64)  # each microbatch's first segment
        seg[:K] = g.pack_starts[g.mb_packs[:-1]]
        seg[K] = S
        cum = np.cumsum(g.lengths)
        before = np.zeros(K + 1, dtype=np.int64)  # inputs before each microbatch
        before[1:] = cum[seg[1:] - 1]
        row_ends = (cum - np.repeat(before[:-1], np.diff(seg))).astype(np.int32)
        pack_len = np.add.reduceat(g.lengths, g.pack_starts).astype(np.int32)
        longest = np.maximum.reduceat(g.lengths, seg[:-1]).tolist()
        tokens = np.diff(before).tolist()
        bounds = seg.tolist()
        t = self.table
        if t is not None:
            pos = self._starts(g.chunks)
            run, off, room = t.table.locate(pos)
            w = self.dtype.itemsize
            lo = off * w
            hi = lo + (g.lengths + 1) * w
            # A chunk that crosses a gap between runs is read through the corpus instead (its
            # slice of its first run is replaced in the batch's rows: see :meth:`batch`).
            cross = np.flatnonzero(g.lengths + 1 > room)
            run_l, lo_l, hi_l = run.tolist(), lo.tolist(), hi.tolist()
            cut = np.searchsorted(cross, seg).tolist()
            if cross.size:
                cross_starts = pos[cross].tolist()
                cross_l = cross.tolist()
        out = []
        for j in range(K):
            a, b = bounds[j], bounds[j + 1]
            ranges = None
            if t is not None:
                c0, c1 = cut[j], cut[j + 1]
                patch = [(k - a, cross_starts[m]) for m, k in enumerate(cross_l[c0:c1], c0)] if c1 > c0 else None
                ranges = (run_l[a:b], lo_l[a:b], hi_l[a:b], patch)
            out.append(
                _Prepared(
                    g.chunks[a:b],
                    g.lengths[a:b],
                    row_ends[a:b],
                    pack_len[g.mb_packs[j] : g.mb_packs[j + 1]],
                    tokens[j],
                    longest[j],
                    ranges,
                )
            )
        return out

    def batch(self, mb: _Prepared) -> VarlenBatch:
        """The compact batch of one prepared microbatch."""
        if mb.ranges is None:
            parts = alloc_compact(mb.lengths.size, mb.num_tokens, self.dtype, packs=mb.pack_lengths.size)
            parts.row_cu[0] = 0
            parts.row_cu[1:] = mb.row_ends
            parts.pack_lengths[:] = mb.pack_lengths
            self.corpus.gather_ranges(self._starts(mb.chunks), mb.lengths + 1, out=parts.tokens)
            return parts.batch(mb.max_seqlen)
        run, lo, hi, patch = mb.ranges
        views = self.table.views  # type: ignore[union-attr]
        rows = list(map(getitem, map(views.__getitem__, run), map(slice, lo, hi)))
        if patch is not None:  # segments that leave their first run: read through the corpus
            tokens, w = self.corpus.tokens, self.dtype.itemsize
            for k, g in patch:
                rows[k] = tokens(g, g + (hi[k] - lo[k]) // w)
        return VarlenBatch.from_row_bytes(rows, mb.row_ends, mb.pack_lengths, self.dtype, mb.max_seqlen)

    def segments(self, mb: _Prepared) -> torch.Tensor:
        """(S, 3) int64 ``(document index, start, length)`` of the microbatch's segments."""
        plan = self.plan
        return torch.from_numpy(np.stack([plan.chunk_doc[mb.chunks], plan.chunk_start[mb.chunks], mb.lengths], axis=1))


class _Prepared(NamedTuple):
    """One microbatch of a group, with what :meth:`_ChunkReads.batch` needs."""

    chunks: np.ndarray
    """(S,) int64 chunk indices."""
    lengths: np.ndarray
    """(S,) int64 inputs per segment."""
    row_ends: np.ndarray
    """(S,) int32 cumulative inputs after each segment (``cu_seqlens[1:]``)."""
    pack_lengths: np.ndarray
    """(P,) int32 real inputs per pack."""
    num_tokens: int
    """T, real inputs of the microbatch."""
    max_seqlen: int
    """Its longest segment, in inputs."""
    ranges: tuple[list[int], list[int], list[int], list[tuple[int, int]] | None] | None
    """Memory-mapped corpus: run, first byte and end byte of every segment in its run's view,
    then ``(segment, global start token)`` of the segments that leave their first run (read
    through the corpus instead), or None."""


class BestFitDataset(IterableDataset):
    """Padding-free microbatches of whole documents (or chunks of long ones), best-fit packed.

    What to iterate (the plan's settings, :class:`~h5corpus.loaders.plan.PlanSettings`):
        corpus: a :class:`~h5corpus.storage.reader.Corpus` (or a manifest path, opened with ``split``).
        max_seq_len: pack capacity and longest segment, in input tokens (default 4096).
        batch_size: packs per microbatch (default 35); only an epoch's last microbatch may hold
            fewer. A microbatch holds at most ``batch_size * max_seq_len`` real tokens.
        packing_buffer: candidate chunks considered at once; default 64 for ``mode="buffer"`` and
            16,384 for ``mode="bfd"`` (the block size best-fit-decreasing sorts).
        seed: seeds the document order (a pure function of ``seed`` and the epoch) and BFD's
            pack shuffle.
        mode: ``"buffer"`` (bounded-buffer best fit) or ``"bfd"`` (best-fit-decreasing).

    How to iterate:
        shuffle: shuffle document order per epoch (default True); False keeps corpus order.
        rank, world_size: DDP position; default from ``torch.distributed`` when initialized.
            Consumers (rank x DataLoader worker, :mod:`~h5corpus.loaders.partition`) read disjoint
            documents of the epoch's order whose union is the epoch; their microbatch counts
            can differ by one or more, so stop a DDP epoch at the shortest rank.
        with_segments: set ``batch.segments`` of every yielded batch to an (S, 3) int64 tensor
            of ``(document index, start, length)`` per segment (start = offset of its first input
            in the document, in tokens); otherwise it is None.

    Yields one :class:`~h5corpus.loaders.batch.VarlenBatch` per microbatch; use with
    ``torch.utils.data.DataLoader`` or torchdata's ``StatefulDataLoader`` with ``batch_size=None``.
    ``state_dict()`` / ``load_state_dict()`` (torchdata's Stateful protocol) capture the epoch,
    this consumer's document order, the chunk cursor, the candidate buffer, BFD's pending packs and
    the RNG state (plain Python and int64 tensors: a checkpoint holding it loads with
    ``torch.load(..., weights_only=True)``); a restored dataset yields the identical next batch.
    Call :meth:`set_epoch` before each epoch.
    """

    def __init__(
        self,
        corpus: Any,
        max_seq_len: int = 4096,
        batch_size: int = 35,
        packing_buffer: int | None = None,
        seed: int = 0,
        mode: str = "buffer",
        *,
        split: str = "train",
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        with_segments: bool = False,
    ) -> None:
        super().__init__()
        if not hasattr(corpus, "doc_offsets"):
            from ..storage.reader import open_corpus

            corpus = open_corpus(corpus, split)
        st = PlanSettings(max_seq_len, batch_size, packing_buffer, seed, mode, shuffle)  # validates
        self.corpus = corpus
        self.max_seq_len, self.batch_size, self.packing_buffer = st.max_seq_len, st.batch_size, st.packing_buffer
        self.seed, self.mode, self.shuffle = st.seed, st.mode, st.shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = int(epoch)
        self.with_segments = bool(with_segments)
        self._fingerprint: str | None = None
        self._live: dict[str, Any] | None = None  # the iteration in progress (plan, reads, counters)
        self._resume: dict[str, Any] | None = None  # a loaded state the next __iter__ continues
        self._cache: dict[str, Any] = {}  # this process's epoch order and mapped runs (never pickled)

    # -- configuration --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` plays (order = f(seed, epoch))."""
        self.epoch = int(epoch)

    @property
    def settings(self) -> PlanSettings:
        """The plan's settings (what a checkpoint must agree on besides the corpus)."""
        return PlanSettings(self.max_seq_len, self.batch_size, self.packing_buffer, self.seed, self.mode, self.shuffle)

    def _config(self) -> dict[str, Any]:
        return self.settings.as_dict()

    @property
    def fingerprint(self) -> str:
        """Hex sha256 of the corpus's own fingerprint (split + shard hashes) and the split's
        document boundaries (what the plan depends on); checkpoints from another corpus are refused."""
        if self._fingerprint is None:
            h = hashlib.sha256(str(getattr(self.corpus, "fingerprint", "")).encode())
            h.update(np.ascontiguousarray(self.corpus.doc_offsets, dtype="<i8").tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[VarlenBatch]:
        consumer = current_consumer(self.rank, self.world_size)
        st, self._resume = self._resume, None
        resumed = st is not None and bool(st.get("started"))
        if resumed:
            if tuple(st["consumer"]) != (consumer.index, consumer.count):
                raise ValueError(
                    f"state belongs to consumer {tuple(st['consumer'])} (index, count) but this is "
                    f"consumer ({consumer.index}, {consumer.count}): resume with the same world size "
                    "and num_workers"
                )
            epoch = int(st["epoch"])
            docs = np.asarray(st["order"], dtype=np.int64)
        else:
            epoch = int(st["epoch"]) if st is not None else self.epoch
            docs = consumer_documents(self._order(epoch), consumer)
        plan = EpochPlan(self.corpus.doc_lengths, docs, self.settings, epoch=epoch, consumer=consumer)
        reads = _ChunkReads(self.corpus, plan, self._table())
        live = {"plan": plan, "reads": reads, "epoch": epoch, "consumer": consumer, "batches": 0, "tokens": 0}
        if resumed:
            plan.restore(st["plan"])
            live["batches"], live["tokens"] = int(st["batches_yielded"]), int(st["tokens_yielded"])
        self._live = live
        return self._run(live)

    #: Microbatches planned and prepared together (numpy work per group, not per microbatch)
    GROUP = 8

    def _run(self, live: dict[str, Any]) -> Iterator[VarlenBatch]:
        plan: EpochPlan = live["plan"]
        reads: _ChunkReads = live["reads"]
        while True:
            g = plan.next_group(self.GROUP)
            if g is None:
                return
            for mb, snap in zip(reads.prepare(g), g.snapshots):
                out = self._read(reads, mb)
                plan.consume(snap)
                live["batches"] += 1
                live["tokens"] += mb.num_tokens
                yield out

    def _read(self, reads: _ChunkReads, mb: _Prepared) -> VarlenBatch:
        """Tokens of one microbatch's segments -> compact VarlenBatch.

        Each segment is one row of the batch's row storage: its ``n`` inputs plus the one-token
        lookahead, ``n + 1`` consecutive tokens of its document, copied straight into the batch
        (the corpus's own width, no int64 copies; :class:`_ChunkReads`). ``row_cu`` =
        ``cu_seqlens`` = cumulative inputs per segment, ``pack_lengths`` per pack, nothing ignored
        (a chunk's lookahead is still inside its document). The int64 fields materialize lazily
        where the batch is used (:class:`~h5corpus.loaders.batch.VarlenBatch`).
        """
        if mb.num_tokens >= 2**31:
            raise ValueError(f"microbatch of {mb.num_tokens:,} tokens is too large for int32 cu_seqlens")
        batch = reads.batch(mb)
        if self.with_segments:
            batch.segments = reads.segments(mb)
        return batch

    def _table(self) -> _MappedRuns | None:
        """This process's mapped runs of the corpus (cached per process and corpus size)."""
        key = (os.getpid(), self.corpus.num_documents, self.corpus.num_tokens)
        hit = self._cache.get("table")
        if hit is None or hit[0] != key:
            hit = self._cache["table"] = (key, _mapped_runs(self.corpus))
        return hit[1]

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's document order (cached: one permutation per epoch and process)."""
        key = (self.seed, epoch, self.shuffle, self.corpus.num_documents)
        hit = self._cache.get("order")
        if hit is None or hit[0] != key:
            hit = self._cache["order"] = (key, epoch_order(self.corpus.num_documents, self.seed, epoch, self.shuffle))
        return hit[1]

    # -- state (torchdata Stateful protocol) ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the identical next batch: plan version, corpus
        fingerprint, config, epoch, consumer, this consumer's document order, the plan's cursor,
        candidate buffer, pending packs and RNG state, and counters. Plain Python values, int64
        tensors and the numpy bit generator's state dict (plain ints): ``torch.save`` /
        ``torch.load(weights_only=True)`` round-trip it."""
        base = {"plan_version": PLAN_VERSION, "fingerprint": self.fingerprint, "config": self._config()}
        live = self._live
        if live is None:
            if self._resume is not None:
                return dict(self._resume)
            return {**base, "started": False, "epoch": self.epoch}
        c: Consumer = live["consumer"]
        plan: EpochPlan = live["plan"]
        return {
            **base,
            "started": True,
            "epoch": live["epoch"],
            "consumer": (c.index, c.count),
            "order": torch.from_numpy(plan.docs.copy()),
            "plan": plan.state(),
            "batches_yielded": live["batches"],
            "tokens_yielded": live["tokens"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``iter()`` continues where it was taken.
        Raises ValueError if the corpus, the config or the plan version differ."""
        if int(state.get("plan_version", -1)) != PLAN_VERSION:
            raise ValueError(
                f"state has plan_version {state.get('plan_version')!r}, this h5corpus plans version {PLAN_VERSION}"
            )
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(
                "state was taken on a different corpus split (fingerprint "
                f"{str(state.get('fingerprint'))[:12]} != {self.fingerprint[:12]})"
            )
        if state.get("config") != self._config():
            raise ValueError(f"state was taken with config {state.get('config')}, this dataset has {self._config()}")
        self._resume = dict(state)
        self._live = None
        self.epoch = int(state["epoch"])

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_live"] = None  # an iteration never travels into a worker; its state does, via load_state_dict
        d["_cache"] = {}
        return d

    # -- counts ---------------------------------------------------------------------------------
    @property
    def skipped_documents(self) -> int:
        """Documents of the split with fewer than 2 tokens (no next-token pair; never yielded)."""
        return int(np.count_nonzero(self.corpus.doc_lengths < 2))

    def __repr__(self) -> str:
        return (
            f"BestFitDataset(mode={self.mode!r}, max_seq_len={self.max_seq_len}, batch_size={self.batch_size}, "
            f"packing_buffer={self.packing_buffer}, seed={self.seed}, epoch={self.epoch}, corpus={self.corpus!r})"
        )
