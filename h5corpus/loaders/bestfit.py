"""The best-fit packing dataset: whole documents (chunks of long ones) packed into padding-free microbatches.

Per epoch, :class:`BestFitDataset` yields its share of one global sequence of microbatches:

1. the plan (:mod:`~h5corpus.loaders.epochplan`): chunks of every document, the epoch's chunk order,
   packing (:mod:`~h5corpus.loaders.packers`), microbatches of ``batch_size`` packs: chunk ids only,
   from document lengths, no tokens read, the same in every process;
2. the schedule (:mod:`~h5corpus.loaders.partition`): rank ``r`` of ``W`` takes microbatches
   ``r, r + W, ...``, DataLoader workers take turns within a rank, the remainder rule makes every
   rank's count equal;
3. the reads (:class:`_SegmentReads`, here): each microbatch this process yields becomes one compact
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
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from operator import getitem
from typing import Any, NamedTuple

import numpy as np
import torch

from ..storage.protocols import CorpusLike
from ..storage.reader import open_corpus
from .batch import VarlenBatch, alloc_compact
from .blockshuffle import DEFAULT_WINDOW_SHARDS, ShardBlocks, check_window_shards
from .chunking import ChunkTable
from .epochplan import PLAN_VERSION, EpochPlan, PlanSettings, chunk_stream
from .lossmask import mask_batch
from .mixture import Mixture, mix
from .partition import distinct_sorted, integer_arg
from .planfile import InMemoryPlan, PlanArrays, SharedPlan, ensure_plan_file, materialize
from .sequence import GlobalSequenceDataset, check_epoch


class MappedRuns(NamedTuple):
    """A fully memory-mapped split's run table (:class:`~h5corpus.storage.reader.RunTable`) with a
    byte view of each run, for the loaders' copies (:class:`_SegmentReads`, the window loader)."""

    table: Any
    views: list[memoryview]


#: Microbatches whose shards the best-fit loader asks a (remote) corpus to prefetch at a time.
PREFETCH_AHEAD = 16


def _shards_at(corpus: CorpusLike, starts: np.ndarray) -> np.ndarray:
    """The shard holding each of these global token positions."""
    return np.searchsorted(corpus.shard_token_starts, starts, side="right") - 1


def shards_in_order(corpus: CorpusLike, starts: np.ndarray) -> np.ndarray:
    """The shards holding these global token positions, each once, in order of first need."""
    idx = _shards_at(corpus, starts)
    first = np.unique(idx, return_index=True)[1]
    return idx[np.sort(first)]


def missing_shards(corpus: CorpusLike, starts: np.ndarray, have: np.ndarray) -> np.ndarray:
    """The shards holding these global token positions that ``have`` (bool per shard) lacks."""
    idx = _shards_at(corpus, starts)
    miss = ~have[idx]
    return distinct_sorted(idx[miss]) if miss.any() else np.zeros(0, np.int64)


def await_shards(corpus: CorpusLike, shards: np.ndarray) -> None:
    """Block until these shards are on this node: one token of each read through
    ``Corpus.tokens``, which fetches a missing shard (or waits on the download a prefetch began)."""
    sts = corpus.shard_token_starts
    for s in np.asarray(shards, dtype=np.int64).tolist():
        if int(sts[s + 1]) > int(sts[s]):
            corpus.tokens(int(sts[s]), int(sts[s]) + 1)


def mapped_runs(corpus: CorpusLike, cached: bool = False) -> MappedRuns | None:
    """The runs of ``corpus`` in this process, or None when some shard is read through HDF5
    (then reads go through :meth:`Corpus.gather_ranges`). Call after any fork. ``cached``: only
    the shards on this node now (:meth:`Corpus.cached_run_table`: a cold remote cache is read
    as its shards arrive, the others through ``Corpus.tokens``); else every shard (fetched)."""
    table = corpus.cached_run_table() if cached else corpus.run_table()
    if table is None:
        return None
    return MappedRuns(table, [memoryview(r).cast("B") for r in table.runs])


class _SegmentReads:
    """Token reads of a plan's segments into compact batches: segment ``i`` is ``seg_len[i] + 1``
    consecutive tokens from global token ``seg_start[i]`` (its inputs plus the lookahead).

    Memory-mapped corpus (``table`` given): a microbatch's rows are one byte view per segment
    into the run holding it, joined with the header into the batch's one buffer by
    :meth:`VarlenBatch.from_row_bytes`. A segment that crosses a gap between runs (or a shard end)
    is read through ``Corpus.tokens`` instead. Otherwise (a shard read through HDF5) the batch is
    allocated with :func:`~h5corpus.loaders.batch.alloc_compact` and filled by one
    ``Corpus.gather_ranges`` call. While a remote corpus's cache misses shards, ``table`` maps
    the cached ones (:meth:`Corpus.cached_run_table`, ``have``): before a microbatch that needs
    a shard not mapped yet, the dataset waits for it and rebuilds the table
    (:meth:`BestFitDataset._ready`), so a batch waits only for its own shards and is still
    copied from the maps."""

    def __init__(self, corpus: CorpusLike, table: MappedRuns | None, have: np.ndarray | None = None) -> None:
        self.corpus, self.table = corpus, table
        #: (shards,) bool: the shards ``table`` maps while some are missing (None: all there)
        self.have = have
        self.dtype = np.dtype(corpus.dtype)

    @property
    def cold(self) -> bool:
        """Some shards are not mapped yet (a cold remote cache)."""
        return self.have is not None

    def unmapped(self, seg_start: np.ndarray) -> np.ndarray:
        """The shards holding these segment starts that ``table`` does not map yet (while cold)."""
        if self.have is None or self.table is None:
            return np.zeros(0, np.int64)
        return missing_shards(self.corpus, seg_start, self.have)

    def batch(self, mb: PlanArrays) -> VarlenBatch:
        """The compact batch of one microbatch (:meth:`~h5corpus.loaders.planfile.SharedPlan.microbatch`)."""
        lengths = mb.seg_len.astype(np.int64)
        cum = np.cumsum(lengths)
        total = int(cum[-1])
        if total >= 2**31:
            raise ValueError(f"microbatch of {total:,} tokens is too large for int32 cu_seqlens")
        pack_len = np.add.reduceat(lengths, mb.pack_starts[:-1]).astype(np.int32)
        longest = int(lengths.max())
        if self.table is None:
            parts = alloc_compact(lengths.size, total, self.dtype, packs=pack_len.size)
            parts.row_cu[0] = 0
            parts.row_cu[1:] = cum
            parts.pack_lengths[:] = pack_len
            self.corpus.gather_ranges(mb.seg_start, lengths + 1, out=parts.tokens)
            return parts.batch(longest)
        run, off, room = self.table.table.locate(mb.seg_start)
        w = self.dtype.itemsize
        lo = off * w
        hi = lo + (lengths + 1) * w
        views = self.table.views
        rows = list(map(getitem, map(views.__getitem__, run.tolist()), map(slice, lo.tolist(), hi.tolist())))
        for k in np.flatnonzero(lengths + 1 > room).tolist():  # leaves its first run: read through the corpus
            g = int(mb.seg_start[k])
            rows[k] = self.corpus.tokens(g, g + int(lengths[k]) + 1)
        return VarlenBatch.from_row_bytes(rows, cum.astype(np.int32), pack_len, self.dtype, longest)

    @staticmethod
    def segments(mb: PlanArrays) -> torch.Tensor:
        """(S, 3) int64 ``(document index, start, length)`` of the microbatch's segments."""
        cols = [mb.seg_doc, mb.seg_within, mb.seg_len]
        return torch.from_numpy(np.stack([np.asarray(c, dtype=np.int64) for c in cols], axis=1))


def as_source(corpus: CorpusLike | str | os.PathLike | list | tuple, split: str) -> CorpusLike:
    """A loader's ``corpus`` argument as something it reads: a manifest path opened at ``split``,
    a list or tuple of sources mixed in proportion to their tokens (:func:`~h5corpus.loaders.mixture.mix`),
    anything else (a ``Corpus``, a :class:`~h5corpus.loaders.mixture.Mixture`) as given."""
    if isinstance(corpus, (list, tuple)):
        return mix(list(corpus), split=split)
    if isinstance(corpus, (str, os.PathLike)):
        return open_corpus(corpus, split)
    return corpus


class BestFitDataset(GlobalSequenceDataset):
    """Padding-free microbatches of whole documents (or chunks of long ones), best-fit packed.

    What to iterate (the plan's settings, :class:`~h5corpus.loaders.epochplan.PlanSettings`):
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
        shuffle_window_shards: the chunk order's rolling window, in shards (default 64): on a
            split of more shards than that, every stretch of the epoch mixes chunks of ``K``
            shards, consecutive stretches share all but one, and the window moves over every
            shard (:func:`~h5corpus.loaders.blockshuffle.window_order`), so a microbatch reads
            ``K`` shards at most, which stay open for the next ones, however many the split has.
            None, or a split of ``K`` shards or fewer: chunks shuffled over the whole split.
            Not used with ``shuffle=False``, ``shuffle_block_shards`` or a mixture (whose
            sources are interleaved instead).
        shuffle_block_shards: ``K`` permutes the shards, groups them ``K`` at a time into blocks
            and shuffles chunks only within a block (:mod:`~h5corpus.loaders.blockshuffle`), so
            an epoch from a cold remote cache reads its shards as they arrive (with its plan
            from a plan file: computing a plan reads every shard's index); default None.

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
        plan_dir: a folder for plan files (:mod:`~h5corpus.loaders.planfile`): each epoch's plan
            is computed once, by the first process that needs it (or offline by ``h5corpus
            plan``), and memory-mapped by every rank and worker, so no process pays
            O(documents) for it again; None (default): each process computes it in memory.

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
        plan_dir: str | os.PathLike | None = None,
        shuffle_block_shards: int | None = None,
        shuffle_window_shards: int | None = DEFAULT_WINDOW_SHARDS,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, drop_last=drop_last, epoch=epoch)
        st = PlanSettings(max_seq_len, batch_size, packing_buffer, seed, mode, shuffle, shuffle_block_shards)
        if plan_dir is not None and not isinstance(plan_dir, (str, os.PathLike)):
            raise TypeError(f"plan_dir must be a folder path or None, got {type(plan_dir).__name__}")
        self.corpus = as_source(corpus, split)
        self.mixture: Mixture | None = self.corpus if isinstance(self.corpus, Mixture) else None
        if self.mixture is not None and st.shuffle_block_shards is not None:
            raise ValueError("shuffle_block_shards orders one corpus's shards; a mixture interleaves its sources")
        self.max_seq_len, self.batch_size, self.packing_buffer = st.max_seq_len, st.batch_size, st.packing_buffer
        self.seed, self.mode, self.shuffle = st.seed, st.mode, st.shuffle
        self.shuffle_block_shards = st.shuffle_block_shards
        #: the window asked for (:attr:`settings` holds the one in effect on this corpus)
        self.shuffle_window_shards = check_window_shards(shuffle_window_shards)
        self.with_segments = bool(with_segments)
        self.plan_dir = None if plan_dir is None else os.fspath(plan_dir)
        self._fingerprint: str | None = None
        self._counts: dict[int, int] = {}  # microbatches per epoch (small; travels into workers)
        self._cache: dict[str, Any] = {}  # this process's plans and mapped runs (never pickled)

    # -- configuration --------------------------------------------------------------------------
    @property
    def settings(self) -> PlanSettings:
        """The plan's settings (what a checkpoint must agree on besides the corpus)."""
        return PlanSettings(
            self.max_seq_len,
            self.batch_size,
            self.packing_buffer,
            self.seed,
            self.mode,
            self.shuffle,
            self.shuffle_block_shards,
            self.window_in_effect(),
        )

    def window_in_effect(self) -> int | None:
        """``shuffle_window_shards`` where it orders this corpus's chunks (a single corpus of
        more shards than the window, shuffled, without blocks), else None (the plan's settings
        then record no window, as before the window existed)."""
        K = self.shuffle_window_shards
        if K is None or self.mixture is not None or not self.shuffle or self.shuffle_block_shards is not None:
            return None
        return K if K < self.corpus.num_shards else None

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
        """Hex sha256 of the corpus's own fingerprint (split + shard hashes), its document and
        token counts (O(1)); checkpoints and plan files of another corpus are refused."""
        if self._fingerprint is None:
            c = self.corpus
            key = f"{c.fingerprint}\0{c.num_documents}\0{c.num_tokens}\0plan v{PLAN_VERSION}"
            self._fingerprint = hashlib.sha256(key.encode()).hexdigest()
        return self._fingerprint

    def plan_identity(self, epoch: int) -> dict[str, Any]:
        """What ``epoch``'s plan depends on (a plan file's header): fingerprint, settings, epoch."""
        d = self.settings.as_dict()
        d["mixture"] = None if self.mixture is None else self.mixture.settings()
        return {"fingerprint": self.fingerprint, "settings": d, "epoch": int(epoch)}

    # -- the plan -------------------------------------------------------------------------------
    def chunk_table(self) -> ChunkTable:
        """Every chunk of the corpus in corpus order (O(documents): only to compute a plan)."""
        return ChunkTable.build(self.corpus.doc_lengths(), self.max_seq_len)

    def plan(self, epoch: int | None = None, table: ChunkTable | None = None) -> EpochPlan:
        """A fresh lazy global plan of ``epoch`` (default: the current one) over ``table``
        (default: :meth:`chunk_table`); nothing planned yet. O(documents): iteration reads
        :meth:`shared_plan`."""
        e = self.epoch if epoch is None else check_epoch(epoch)
        table = self.chunk_table() if table is None else table
        settings = self.settings
        if self.mixture is None:
            bounded = settings.shuffle_block_shards is not None or settings.shuffle_window_shards is not None
            stream = chunk_stream(table, settings, e, self.corpus.shard_doc_starts if bounded else None)
        else:
            bases = table.first[self.mixture.doc_bases]
            sel = self.mixture.select(bases, table.length, 1, self.seed, e, self.shuffle)
            stream = sel.items.astype(np.int32 if table.num_chunks < 2**31 else np.int64)
        return EpochPlan(table, stream, settings, epoch=e)

    def plan_arrays(self, epoch: int | None = None) -> PlanArrays:
        """``epoch``'s whole plan as flat arrays (what a plan file holds); O(documents)."""
        if not self.corpus.cached_shards().all():  # a cold remote cache: every shard's index is read
            self.corpus.prefetch(np.arange(self.corpus.num_shards))  # fetched at once, not one by one
        lengths = self.corpus.doc_lengths()
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        plan = self.plan(epoch, ChunkTable.build(lengths, self.max_seq_len))
        return materialize(plan, offsets, None if self.mixture is None else self.mixture.token_bases)

    def shared_plan(self, epoch: int | None = None) -> SharedPlan:
        """``epoch``'s plan in this process: from its plan file in ``plan_dir`` (written by the
        first process that needs it, reused by every other and by later runs), or computed in
        memory without ``plan_dir``. Cached per process for the two latest epochs."""
        e = self.epoch if epoch is None else check_epoch(epoch)
        plans = self._cache.setdefault("plans", {})
        if e not in plans:
            if self.plan_dir is None:
                sp = InMemoryPlan(self.plan_arrays(e))
            else:
                sp, _ = ensure_plan_file(self.plan_dir, self.plan_identity(e), lambda: self.plan_arrays(e))
            for old in sorted(plans)[:-1]:
                del plans[old]
            plans[e] = sp
        return plans[e]

    def _num_microbatches(self, epoch: int) -> int:
        if epoch not in self._counts:
            self._counts[epoch] = self.shared_plan(epoch).num_microbatches
        return self._counts[epoch]

    def _tokens_at(self, epoch: int, position: int) -> tuple[int, tuple[int, ...]]:
        return self.shared_plan(epoch).tokens_at(position)

    def mixture_summary(self, epoch: int | None = None) -> list[dict[str, Any]]:
        """Per mixture source, what ``epoch`` (default: the current one) reads: name, weight,
        target share, chunks and input tokens, realized share, source epochs read (see
        :meth:`~h5corpus.loaders.mixture.Mixture.describe`); raises ValueError for a plain corpus."""
        if self.mixture is None:
            raise ValueError("mixture_summary: this dataset reads one corpus, not a mixture")
        table = self.chunk_table()
        bases = table.first[self.mixture.doc_bases]
        e = self.epoch if epoch is None else check_epoch(epoch)
        return self._with_consumed(
            e, self.mixture.describe(self.mixture.select(bases, table.length, 1, self.seed, e, self.shuffle))
        )

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[VarlenBatch]:
        live = self._begin()
        sp = self.shared_plan(live.epoch)
        live.tokens_at = sp.tokens_at
        return self._run(live, sp, self._segment_reads())

    def _segment_reads(self, old: _SegmentReads | None = None) -> _SegmentReads:
        """The reads through this process's memory maps; while a remote cache misses shards,
        those of the cached shards, rebuilt (when ``old`` is given) once more have arrived."""
        have = self.corpus.cached_shards()
        if have.all():
            return old if old is not None and not old.cold else _SegmentReads(self.corpus, self._table())
        if old is not None and old.have is not None and np.array_equal(old.have, have):
            return old
        return _SegmentReads(self.corpus, mapped_runs(self.corpus, cached=True), have)

    def _ready(self, reads: _SegmentReads, mb: PlanArrays) -> _SegmentReads:
        """``reads`` able to serve ``mb`` from the maps: a cold cache's missing shards of the
        microbatch waited for (their downloads began ahead, in plan order) and the run table
        rebuilt with every shard that arrived, instead of reading their segments one by one."""
        missing = reads.unmapped(mb.seg_start)
        if missing.size == 0:
            return reads
        await_shards(self.corpus, missing)
        return self._segment_reads(reads)

    def _prefetch_ahead(
        self, sched: Any, sp: SharedPlan, j: int, blocks: ShardBlocks | None, have: np.ndarray | None
    ) -> None:
        """Ask a remote corpus for the shards of this consumer's next :data:`PREFETCH_AHEAD`
        microbatches (its own: with many ranks, the microbatches between them are other ranks'),
        in order of need; under a block shuffle also those of the blocks ahead
        (:meth:`ShardBlocks.ahead`) unless the next microbatches' own shards are missing (``have``:
        the cached ones, None: all): those come first, alone on the link, and the blocks ahead are
        asked for once they are here. Nothing for local files."""
        if not self.corpus.remote:
            return
        M, w = sp.num_microbatches, sched.consumer.num_workers
        gs = [sched.global_index(j + k * w) % M for k in range(PREFETCH_AHEAD)]
        parts = [sp.seg_starts(g, g + 1) for g in gs]
        shards = shards_in_order(self.corpus, np.concatenate(parts))
        if blocks is not None and (have is None or have[shards].all()):
            shards = blocks.ahead(shards)
        if have is not None:  # a cold cache: only the shards not here yet (asking costs a stat each)
            shards = shards[~have[shards]]
        if shards.size:
            self.corpus.prefetch(shards)

    def _run(self, live: Any, sp: SharedPlan, reads: _SegmentReads) -> Iterator[VarlenBatch]:
        """This consumer's microbatches in order: the schedule and the remainder rule (a wrapped
        item is microbatch ``g mod M``, :mod:`~h5corpus.loaders.partition`); O(1) per item."""
        sched, M = live.schedule, sp.num_microbatches
        masked = self.corpus.has_loss_mask  # fine-tuning masks (else every target is trained on)
        blocks = None
        if self.shuffle_block_shards is not None and self.corpus.remote:  # what to prefetch (numpy.random: 0.5 MB)
            sizes = np.diff(self.corpus.shard_token_starts)
            blocks = ShardBlocks.of(sizes, self.shuffle_block_shards, self.seed, live.epoch)
        for n, j in enumerate(sched.local_items()):
            if M == 0 or sched.needed(j) > M:
                return
            if n % PREFETCH_AHEAD == 0:  # a remote corpus fetches the shards of the next microbatches
                if reads.cold:  # a cold remote cache: map the shards that arrived since
                    reads = self._segment_reads(reads)
                self._prefetch_ahead(sched, sp, j, blocks, reads.have)
            mb = sp.microbatch(sched.global_index(j) % M)
            if reads.cold:
                reads = self._ready(reads, mb)
            batch = reads.batch(mb)
            if masked:
                batch = mask_batch(batch, self.corpus, mb.seg_start)
            if self.with_segments:
                batch.segments = reads.segments(mb)
            live.yielded += 1
            yield batch

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


def _ensure_one(args: tuple[Any, str, int, dict[str, Any], bool]) -> str:
    corpus, plan_dir, epoch, kw, rebuild = args
    ds = BestFitDataset(corpus, plan_dir=plan_dir, **kw)
    identity = ds.plan_identity(epoch)
    return os.fspath(ensure_plan_file(plan_dir, identity, lambda: ds.plan_arrays(epoch), rebuild=rebuild)[1])


def write_plans(
    corpus: Any,
    plan_dir: str | os.PathLike,
    epochs: Sequence[int],
    *,
    workers: int = 1,
    rebuild: bool = False,
    **settings: Any,
) -> list[str]:
    """Write the plan files of ``epochs`` (what :class:`BestFitDataset` with ``plan_dir`` and the
    same ``settings``, e.g. ``max_seq_len``, ``batch_size``, ``mode``, ``split``, reads), ``workers``
    epochs at once in separate processes; an existing valid file is kept unless ``rebuild``.
    Returns the files' paths, in ``epochs`` order. ``corpus``: a manifest path or an opened corpus."""
    if not isinstance(plan_dir, (str, os.PathLike)):
        raise TypeError(f"plan_dir must be a folder path, got {type(plan_dir).__name__}")
    es = [check_epoch(e, "epochs[]") for e in epochs]
    n = integer_arg("workers", workers, 1)
    BestFitDataset(corpus, **settings)  # validates the settings once, before any process starts
    jobs = [(corpus, os.fspath(plan_dir), e, settings, bool(rebuild)) for e in es]
    if n == 1 or len(jobs) < 2:
        return [_ensure_one(j) for j in jobs]
    from concurrent.futures import ProcessPoolExecutor  # here: a reading process never needs it

    with ProcessPoolExecutor(min(n, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_ensure_one, jobs))
