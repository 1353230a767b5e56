"""The best-fit packing dataset: whole documents (chunks of long ones) packed into padding-free microbatches.

Per epoch, :class:`BestFitDataset` yields its share of one global sequence of microbatches:

1. the plan (:mod:`~h5corpus.loaders.plan`): chunks of every document, the epoch's chunk order,
   packing (:mod:`~h5corpus.loaders.packers`), microbatches of ``batch_size`` packs: chunk ids only,
   from document lengths, no tokens read, the same in every process;
2. the schedule (:mod:`~h5corpus.loaders.partition`): rank ``r`` of ``W`` takes microbatches
   ``r, r + W, ...``, DataLoader workers take turns within a rank, the remainder rule makes every
   rank's count equal;
3. the reads (:class:`_ChunkReads`, here): each microbatch this process yields becomes one compact
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

from .batch import VarlenBatch, alloc_compact
from .chunking import ChunkTable
from .mixture import Mixture, mix
from .plan import EpochPlan, MicrobatchGroup, PlanSettings, epoch_order
from .sequence import GlobalSequenceDataset


class MappedRuns(NamedTuple):
    """A fully memory-mapped split's run table (:class:`~h5corpus.storage.reader.RunTable`) with a
    byte view of each run, for the loaders' copies (:class:`_ChunkReads`, the window loader)."""

    table: Any
    views: list[memoryview]


def mapped_runs(corpus: Any) -> MappedRuns | None:
    """The runs of ``corpus`` in this process, or None when some shard is read through HDF5
    (then reads go through :meth:`Corpus.gather_ranges`). Call after any fork."""
    if not hasattr(corpus, "run_table"):
        return None
    table = corpus.run_table()
    if table is None:
        return None
    return MappedRuns(table, [memoryview(r).cast("B") for r in table.runs])


class _ChunkReads:
    """Token reads of one plan's chunks into compact batches: chunk ``i`` is ``chunk_len[i] + 1``
    consecutive tokens of its document (its inputs plus the lookahead).

    Memory-mapped corpus (``table`` given): a microbatch's rows are one byte view per segment
    into the run holding it, joined with the header into the batch's one buffer by
    :meth:`VarlenBatch.from_row_bytes`. A segment that crosses a gap between runs (or a shard end)
    is read through ``Corpus.tokens`` instead. Otherwise (a shard read through HDF5) the batch is
    allocated with :func:`~h5corpus.loaders.batch.alloc_compact` and filled by one
    ``Corpus.gather_ranges`` call."""

    def __init__(self, corpus: Any, chunks: ChunkTable, table: MappedRuns | None) -> None:
        self.corpus, self.chunks, self.table = corpus, chunks, table
        self.dtype = np.dtype(corpus.dtype)
        self.doc_offsets = np.asarray(corpus.doc_offsets, dtype=np.int64)

    def _starts(self, chunks: np.ndarray) -> np.ndarray:
        """Global token position of each chunk's first input."""
        t = self.chunks
        doc = t.doc[chunks]
        return self.doc_offsets[doc] + (chunks - t.first[doc]) * t.max_seq_len

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
        t = self.chunks
        doc = t.doc[mb.chunks].astype(np.int64)
        return torch.from_numpy(np.stack([doc, t.starts(mb.chunks), mb.lengths], axis=1))


class _Prepared(NamedTuple):
    """One microbatch of a group, with what :meth:`_ChunkReads.batch` needs."""

    chunks: np.ndarray
    """(S,) chunk ids (:class:`~h5corpus.loaders.chunking.ChunkTable` rows)."""
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


def as_source(corpus: Any, split: str) -> Any:
    """A loader's ``corpus`` argument as something it reads: a ``Corpus`` or a
    :class:`~h5corpus.loaders.mixture.Mixture` as given, a manifest path opened at ``split``, a
    list or tuple of sources mixed in proportion to their tokens (:func:`~h5corpus.loaders.mixture.mix`)."""
    if hasattr(corpus, "doc_offsets"):
        return corpus
    if isinstance(corpus, (list, tuple)):
        return mix(list(corpus), split=split)
    from ..storage.reader import open_corpus

    return open_corpus(corpus, split)


class BestFitDataset(GlobalSequenceDataset):
    """Padding-free microbatches of whole documents (or chunks of long ones), best-fit packed.

    What to iterate (the plan's settings, :class:`~h5corpus.loaders.plan.PlanSettings`):
        corpus: a :class:`~h5corpus.storage.reader.Corpus`, a manifest path (opened with ``split``),
            a :class:`~h5corpus.loaders.mixture.Mixture` (:func:`h5corpus.mix`), or a list of
            sources (mixed in proportion to their tokens).
        max_seq_len: pack capacity and longest segment, in input tokens (default 4096).
        batch_size: packs per microbatch (default 35); only an epoch's last microbatch may hold
            fewer. A microbatch holds at most ``batch_size * max_seq_len`` real tokens.
        packing_buffer: candidate chunks considered at once; default 64 for ``mode="buffer"`` and
            16,384 for ``mode="bfd"`` (the block size best-fit-decreasing sorts).
        seed: seeds the chunk order (a pure function of ``seed`` and the epoch) and BFD's pack
            shuffle.
        mode: ``"buffer"`` (bounded-buffer best fit) or ``"bfd"`` (best-fit-decreasing).
        shuffle: shuffle the chunk order per epoch (default True); False keeps corpus order.

    How to iterate:
        rank, world_size: DDP position; default from ``torch.distributed`` when initialized. Rank
            ``r`` yields microbatches ``r, r + world_size, ...`` of the epoch's global sequence,
            DataLoader workers take turns within a rank (:mod:`~h5corpus.loaders.partition`).
        drop_last: the remainder rule: False (default) completes the last step with the epoch's
            first microbatches, True drops the incomplete step; every rank yields ``len(ds)``.
        epoch: the first epoch (:meth:`set_epoch`).
        with_segments: set ``batch.segments`` of every yielded batch to an (S, 3) int64 tensor
            of ``(document index, start, length)`` per segment (start = offset of its first input
            in the document, in tokens); otherwise it is None.

    Yields one :class:`~h5corpus.loaders.batch.VarlenBatch` per microbatch; use with
    ``torch.utils.data.DataLoader`` or torchdata's ``StatefulDataLoader`` with ``batch_size=None``.
    ``state_dict()`` / ``load_state_dict()`` (torchdata's Stateful protocol; the format:
    :mod:`~h5corpus.loaders.state`) record the epoch and the global position; a restored dataset
    continues at that position on any world size and worker count. ``seek()`` starts at a given
    global microbatch, ``len()`` is this rank's count per epoch.
    """

    LOADER = "BestFitDataset"

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
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        with_segments: bool = False,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, drop_last=drop_last, epoch=epoch)
        st = PlanSettings(max_seq_len, batch_size, packing_buffer, seed, mode, shuffle)  # validates
        self.corpus = as_source(corpus, split)
        self.mixture: Mixture | None = self.corpus if isinstance(self.corpus, Mixture) else None
        self.max_seq_len, self.batch_size, self.packing_buffer = st.max_seq_len, st.batch_size, st.packing_buffer
        self.seed, self.mode, self.shuffle = st.seed, st.mode, st.shuffle
        self.with_segments = bool(with_segments)
        self._fingerprint: str | None = None
        self._counts: dict[int, int] = {}  # microbatches per epoch (small; travels into workers)
        self._cache: dict[str, Any] = {}  # this process's chunk table, probe plan, mapped runs (never pickled)

    # -- configuration --------------------------------------------------------------------------
    @property
    def settings(self) -> PlanSettings:
        """The plan's settings (what a checkpoint must agree on besides the corpus)."""
        return PlanSettings(self.max_seq_len, self.batch_size, self.packing_buffer, self.seed, self.mode, self.shuffle)

    def settings_dict(self) -> dict[str, Any]:
        d = self.settings.as_dict()
        d["drop_last"] = self.drop_last
        d["mixture"] = None if self.mixture is None else self.mixture.settings()
        return d

    @property
    def num_sources(self) -> int:
        return 1 if self.mixture is None else self.mixture.num_sources

    @property
    def fingerprint(self) -> str:
        """Hex sha256 of the corpus's own fingerprint (split + shard hashes) and the split's
        document boundaries (what the plan depends on); checkpoints from another corpus are refused."""
        if self._fingerprint is None:
            h = hashlib.sha256(str(getattr(self.corpus, "fingerprint", "")).encode())
            h.update(np.ascontiguousarray(self.corpus.doc_offsets, dtype="<i8").tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    # -- the plan -------------------------------------------------------------------------------
    def chunk_table(self) -> ChunkTable:
        """Every chunk of the corpus in corpus order (this process's, cached)."""
        key = (self.corpus.num_documents, self.corpus.num_tokens, self.max_seq_len)
        hit = self._cache.get("chunks")
        if hit is None or hit[0] != key:
            hit = self._cache["chunks"] = (key, ChunkTable.build(self.corpus.doc_lengths(), self.max_seq_len))
        return hit[1]

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """A fresh global plan of ``epoch`` (default: the current one); nothing planned yet."""
        e = self.epoch if epoch is None else int(epoch)
        table = self.chunk_table()
        if self.mixture is None:
            stream, bases = epoch_order(table.num_chunks, self.seed, e, self.shuffle), None
        else:
            bases = table.first[self.mixture.doc_bases]
            sel = self.mixture.select(bases, table.length, 1, self.seed, e, self.shuffle)
            stream = sel.items.astype(np.int32 if table.num_chunks < 2**31 else np.int64)
        return EpochPlan(table, stream, self.settings, epoch=e, source_bases=bases)

    def _probe(self, epoch: int) -> EpochPlan:
        """This process's fully planned epoch (counts and tokens; no microbatch kept)."""
        hit = self._cache.get("probe")
        if hit is None or hit[0] != (epoch, self.chunk_table().num_chunks):
            plan = self.plan(epoch)
            plan.plan_all()
            hit = self._cache["probe"] = ((epoch, self.chunk_table().num_chunks), plan)
        return hit[1]

    def _num_microbatches(self, epoch: int) -> int:
        if epoch not in self._counts:
            self._counts[epoch] = int(self._probe(epoch).total or 0)
        return self._counts[epoch]

    def _tokens_at(self, epoch: int, position: int) -> tuple[int, tuple[int, ...]]:
        return self._probe(epoch).tokens_at(position)

    def mixture_summary(self, epoch: int | None = None) -> list[dict[str, Any]]:
        """Per mixture source, what ``epoch`` (default: the current one) reads: name, weight,
        target share, chunks and input tokens, realized share, source epochs read (see
        :meth:`~h5corpus.loaders.mixture.Mixture.describe`); raises ValueError for a plain corpus."""
        if self.mixture is None:
            raise ValueError("mixture_summary: this dataset reads one corpus, not a mixture")
        table = self.chunk_table()
        bases = table.first[self.mixture.doc_bases]
        e = self.epoch if epoch is None else int(epoch)
        return self._with_consumed(
            e, self.mixture.describe(self.mixture.select(bases, table.length, 1, self.seed, e, self.shuffle))
        )

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[VarlenBatch]:
        live = self._begin()
        plan = self.plan(live.epoch)
        first, stride = live.schedule.first_wanted()
        plan.want(first, stride)
        live.tokens_at = plan.tokens_at
        reads = _ChunkReads(self.corpus, plan.table, self._table())
        return self._run(live, plan, reads)

    #: Microbatches read per group (numpy work per group, not per microbatch)
    GROUP = 8

    def _indices(self, live: Any, plan: EpochPlan) -> Iterator[tuple[int, bool]]:
        """(global microbatch, wrapped) of every item this consumer yields, in order: the schedule
        and the remainder rule (a wrapped one is microbatch ``g mod M`` of the epoch's start).
        Checked a group of items at a time while the epoch is far from its end."""
        sched = live.schedule
        K, G = sched.consumer.num_workers, self.GROUP
        items = sched.local_items()
        for j in items:
            last = j + K * (G - 1)
            if plan.reach(sched.needed(last) + sched.consumer.world_size):  # the whole group is inside the epoch
                yield from ((sched.global_index(i), False) for i in range(j, last + 1, K))
                for _ in range(G - 1):
                    next(items)
                continue
            if not plan.reach(sched.needed(j)):
                return
            g = sched.global_index(j)
            if plan.reach(g + 1):
                yield g, False
            else:
                yield g % int(plan.total or 1), True

    def _groups(self, live: Any, plan: EpochPlan) -> Iterator[MicrobatchGroup]:
        """This consumer's microbatches in yield order, up to :attr:`GROUP` per group."""
        wrapped: EpochPlan | None = None
        items = self._indices(live, plan)
        while True:
            batch = [x for _, x in zip(range(self.GROUP), items)]
            if not batch:
                return
            main = [g for g, w in batch if not w]
            if main:
                yield plan.take_group(main)
            late = [g for g, w in batch if w]
            if late:
                if wrapped is None:  # the epoch's last step: at most world_size - 1 microbatches again
                    rest = list(items)  # all wrapped too
                    items = iter(rest)
                    wrapped = self.plan(live.epoch)
                    wrapped.want_only(late + [g for g, _ in rest])
                wrapped.reach(max(late) + 1)
                yield wrapped.take_group(late)

    def _run(self, live: Any, plan: EpochPlan, reads: _ChunkReads) -> Iterator[VarlenBatch]:
        for group in self._groups(live, plan):
            for mb in reads.prepare(group):
                out = self._read(reads, mb)
                live.yielded += 1
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

    def _table(self) -> MappedRuns | None:
        """This process's mapped runs of the corpus (cached per process and corpus size)."""
        key = (os.getpid(), self.corpus.num_documents, self.corpus.num_tokens)
        hit = self._cache.get("table")
        if hit is None or hit[0] != key:
            hit = self._cache["table"] = (key, mapped_runs(self.corpus))
        return hit[1]

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_cache"] = {}
        return d

    # -- counts ---------------------------------------------------------------------------------
    @property
    def skipped_documents(self) -> int:
        """Documents of the split with fewer than 2 tokens (no next-token pair; never yielded)."""
        return int(np.count_nonzero(self.corpus.doc_lengths() < 2))

    def __repr__(self) -> str:
        return (
            f"BestFitDataset(mode={self.mode!r}, max_seq_len={self.max_seq_len}, batch_size={self.batch_size}, "
            f"packing_buffer={self.packing_buffer}, seed={self.seed}, epoch={self.epoch}, corpus={self.corpus!r})"
        )
