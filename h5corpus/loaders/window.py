"""Sliding windows over a corpus's token stream, as padding-free :class:`~h5corpus.loaders.batch.VarlenBatch`es.

A window is ``seq_len + 1`` consecutive tokens ``w``; the model reads ``w[:-1]`` and predicts
``w[1:]``. Two ways to choose windows (``mode``):

``"epoch"`` (default)
    Every non-overlapping window exactly once per epoch, in a shuffled order that depends only on
    ``(seed, epoch)``. Windows are laid out per shard: window ``k`` of shard ``s`` starts at
    ``shard_start[s] + k * seq_len``, so consecutive windows share one token and no next-token pair
    inside a window's span is lost. A window never spans two shard files, and when ``chunk_tokens``
    is a multiple of ``seq_len`` every window starts on a chunk boundary or a whole stride inside
    one: it reads one chunk (plus one token of the next for the window that ends a chunk).
    **Dropped**: at the end of each shard, the last ``(shard_tokens - 1) % seq_len`` next-token
    pairs (fewer than ``seq_len`` per shard) and the pair that would cross into the next shard (an
    EOS followed by the next shard's first document: a cross-document pair anyway). A
    :class:`~h5corpus.loaders.mixture.Mixture` picks each epoch's windows from its sources by
    weight instead (its module docstring). ``shuffle_block_shards=K`` shuffles windows only within
    blocks of ``K`` shards instead (:mod:`~h5corpus.loaders.blockshuffle`).

``"random"``
    nanoGPT-style: i.i.d. uniform starts in ``[0, num_tokens - seq_len - 1]`` of the global stream
    (a window may cross shards and documents). An "epoch" is ``windows_per_epoch`` windows (default:
    as many as epoch mode has); the starts depend only on ``(seed, epoch, window index)``.

Optional ``document_mask``: a window is split into segments at every document start inside it
(``cu_seqlens``), ``position_ids`` restart at 0 per segment, and the target that would cross from
one document into the next is :data:`~h5corpus.loaders.batch.IGNORE_INDEX`. Without it each window is one
segment and every target counts.

**The global sequence**: the epoch's windows in that order, ``batch_size`` per microbatch (the
last may hold fewer; ``drop_last=True`` leaves it out). DDP ranks and DataLoader workers share it
by the rule of :mod:`~h5corpus.loaders.partition` (rank ``r`` of ``W`` yields microbatches ``r,
r + W, ...``; the remainder rule makes every rank's count equal), and checkpoints record the
global position (:mod:`~h5corpus.loaders.state`), so a run resumes on any cluster shape with the
next global batch and without reading the skipped ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import numpy as np

from ..storage.protocols import CorpusLike
from .batch import VarlenBatch, alloc_compact
from .bestfit import MappedRuns, as_source, await_shards, mapped_runs, missing_shards, shards_in_order
from .blockshuffle import ShardBlocks, block_generator, block_order, check_block_shards
from .lossmask import mask_batch
from .mixture import Mixture
from .partition import Consumer, Schedule, current_consumer, distinct_sorted, integer_arg
from .permutation import keys as permutation_keys
from .permutation import permute
from .sequence import GlobalSequenceDataset, check_epoch

Mode = Literal["epoch", "random"]
MODES = ("epoch", "random")

#: The epoch order of windows (mode "epoch", no mixture, no blocks): a seeded Feistel permutation
#: computed per window read (:mod:`~h5corpus.loaders.permutation`), recorded in the settings.
ORDER = "feistel6"

#: Random-mode starts are drawn in blocks of this many windows, each from its own seed, so any
#: window's start is computable without drawing the ones before it.
RANDOM_BLOCK = 1 << 16

#: Batches whose window starts (and document masking) are computed in one vectorized call: numpy's
#: per-call overhead, paid per block instead of per batch, would otherwise rival the batch's reads.
PLAN_BLOCK_BATCHES = 64

_TAG_EPOCH = 0x45504F43  # "EPOC": separates the two modes' random streams
_TAG_RANDOM = 0x52414E44  # "RAND"


class _Masks(NamedTuple):
    """Document masking of a block's batches (:meth:`_WindowReads.mask_plan`), in inputs
    of each batch: batch b's segment starts (``cu_seqlens`` without its final T) are
    ``cut[cut_at[b] : cut_at[b + 1]]``, its inputs whose target is ignored
    ``ignore[ignore_at[b] : ignore_at[b + 1]]``, its longest segment ``longest[b]``."""

    cut: np.ndarray
    """int32"""
    cut_at: list[int]
    ignore: np.ndarray
    """int64"""
    ignore_at: list[int]
    longest: list[int]


class SlidingWindowDataset(GlobalSequenceDataset):
    """Windows of ``seq_len + 1`` tokens from ``corpus``, ``batch_size`` per yielded
    :class:`~h5corpus.loaders.batch.VarlenBatch` (use ``DataLoader(ds, batch_size=None)``).

    What to iterate:
        corpus: an open :class:`~h5corpus.storage.reader.Corpus` (pickled into workers without
            handles), a manifest path, a :class:`~h5corpus.loaders.mixture.Mixture` or a list of
            sources (epoch mode).
        seq_len: model inputs per window, in tokens (the window reads ``seq_len + 1``).
        batch_size: windows per batch; a batch holds ``batch_size * seq_len`` inputs.
        mode: ``"epoch"`` (every non-overlapping window once, shuffled) or ``"random"`` (i.i.d. starts).
        document_mask: split windows at document boundaries (see the module docstring).
        windows_per_epoch: random mode only; default = the epoch-mode window count.
        seed: order = f(seed, epoch); same seed, same batches.
        shuffle_block_shards: epoch mode, one corpus: None (default) shuffles the windows over the
            whole split; ``K`` permutes the shards, groups them ``K`` at a time into blocks and
            shuffles windows only within a block (:mod:`~h5corpus.loaders.blockshuffle`), so an
            epoch from a cold remote cache reads its shards as they arrive.

    How to iterate:
        rank, world_size: DDP position; default ``torch.distributed`` if initialized, else 0 of 1.
        drop_last: leave out the epoch's short last batch and drop the incomplete last step
            (default False: the last step wraps around to the epoch's first batches); every rank
            yields ``len(ds)`` batches either way.
        epoch: starting epoch (see :meth:`set_epoch`).
    """

    LOADER = "SlidingWindowDataset"

    def __init__(
        self,
        corpus: Any,
        seq_len: int,
        batch_size: int = 8,
        seed: int = 0,
        mode: Mode = "epoch",
        document_mask: bool = False,
        *,
        split: str = "train",
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        windows_per_epoch: int | None = None,
        epoch: int = 0,
        shuffle_block_shards: int | None = None,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, drop_last=drop_last, epoch=epoch)
        seq_len = integer_arg("seq_len", seq_len, 1)
        batch_size = integer_arg("batch_size", batch_size, 1)
        seed = integer_arg("seed", seed, 0)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if windows_per_epoch is not None:
            windows_per_epoch = integer_arg("windows_per_epoch", windows_per_epoch, 0)
            if mode != "random":
                raise ValueError("windows_per_epoch is for mode='random'")
        blocks = check_block_shards(shuffle_block_shards)
        if blocks is not None and mode != "epoch":
            raise ValueError("shuffle_block_shards orders epoch mode's windows; mode='random' draws starts")
        self.corpus = as_source(corpus, split)
        self.mixture: Mixture | None = self.corpus if isinstance(self.corpus, Mixture) else None
        if self.mixture is not None and mode == "random":
            raise ValueError("mode='random' draws starts over one token stream; mix sources in mode='epoch'")
        if self.mixture is not None and blocks is not None:
            raise ValueError("shuffle_block_shards orders one corpus's shards; a mixture interleaves its sources")
        self.shuffle_block_shards = blocks
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.mode: Mode = mode
        self.document_mask = bool(document_mask)
        self.windows_per_epoch = None if windows_per_epoch is None else int(windows_per_epoch)
        self._cache: dict[Any, Any] = {}  # this epoch's order, random block, counts (never pickled)
        self._layout: tuple[Any, np.ndarray] | None = None

    # -- layout -----------------------------------------------------------------------------------
    def _shard_windows(self) -> np.ndarray:
        """(shards + 1,) cumulative epoch-mode window counts per shard (cached per corpus size)."""
        sts = self.corpus.shard_token_starts
        key = (sts.size, int(sts[-1]))
        hit = self._layout
        if hit is None or hit[0] != key:
            w = np.maximum((np.diff(sts) - 1) // self.seq_len, 0)
            hit = self._layout = (key, np.concatenate([[0], np.cumsum(w)]).astype(np.int64))
        return hit[1]

    @property
    def num_windows(self) -> int:
        """Windows in the epoch-mode layout (every source of a mixture), or random mode's
        windows per epoch."""
        if self.mode == "random":
            if self.windows_per_epoch is not None:
                return self.windows_per_epoch if self.corpus.num_tokens > self.seq_len else 0
        return int(self._shard_windows()[-1])

    def epoch_windows(self, epoch: int | None = None) -> int:
        """Windows of ``epoch``'s global sequence (default: the current epoch), ``drop_last`` applied."""
        e = self.epoch if epoch is None else check_epoch(epoch)
        n = self.num_windows if self.mixture is None else int(self._order(e).size)
        return n // self.batch_size * self.batch_size if self.drop_last else n

    def _order(self, epoch: int) -> np.ndarray:
        """Epoch mode: the epoch's window ids in sequence order (cached: one permutation per
        epoch; a mixture's selection, :meth:`~h5corpus.loaders.mixture.Mixture.select`)."""
        key = ("perm", epoch, self.num_windows)
        hit = self._cache.get("perm")
        if hit is None or hit[0] != key:
            if self.shuffle_block_shards is not None:  # shard blocks (:mod:`~h5corpus.loaders.blockshuffle`)
                rng = block_generator(self.seed, epoch, _TAG_EPOCH)
                perm, shard_order = block_order(self._shard_windows(), self.shuffle_block_shards, rng)
                sizes = np.diff(self.corpus.shard_token_starts)
                self._cache["blocks"] = ShardBlocks(shard_order, self.shuffle_block_shards, sizes)
            elif self.mixture is None:  # only asked for by mixtures and blocks; kept for inspection
                perm = permute(
                    np.arange(self.num_windows), self.num_windows, permutation_keys(self.seed, epoch, _TAG_EPOCH)
                )
            else:
                bases = self._shard_windows()[self.mixture.shard_bases]
                perm = self.mixture.select(bases, None, self.seq_len, self.seed, epoch, True).items
            hit = self._cache["perm"] = (key, perm)
        return hit[1]

    def _starts(self, epoch: int, items: np.ndarray) -> np.ndarray:
        """Global token position where each item's window starts (items: positions in the epoch)."""
        items = items.astype(np.int64, copy=False)
        if self.mode == "epoch":
            if self.mixture is None and self.shuffle_block_shards is None:  # O(1) memory, any corpus size
                ids = permute(items, self.num_windows, permutation_keys(self.seed, epoch, _TAG_EPOCH))
            else:
                ids = self._order(epoch)[items].astype(np.int64)
            cum = self._shard_windows()
            s = np.searchsorted(cum, ids, side="right") - 1
            return self.corpus.shard_token_starts[s] + (ids - cum[s]) * self.seq_len
        blocks = items // RANDOM_BLOCK
        b0 = int(blocks[0]) if items.size else 0
        if items.size and b0 == int(blocks[-1]) and (items.size == 1 or bool((blocks == b0).all())):
            return self._random_block(epoch, b0)[items - b0 * RANDOM_BLOCK]
        out = np.empty(items.size, dtype=np.int64)
        for b in np.unique(blocks).tolist():
            sel = blocks == b
            out[sel] = self._random_block(epoch, b)[items[sel] - b * RANDOM_BLOCK]
        return out

    def _random_block(self, epoch: int, block: int) -> np.ndarray:
        key = ("rand", epoch, block, self.corpus.num_tokens)
        hit = self._cache.get("rand")
        if hit is None or hit[0] != key:
            rng = np.random.default_rng([self.seed, epoch, _TAG_RANDOM, block])
            starts = rng.integers(0, self.corpus.num_tokens - self.seq_len, size=RANDOM_BLOCK, dtype=np.int64)
            hit = self._cache["rand"] = (key, starts)
        return hit[1]

    # -- the global sequence ----------------------------------------------------------------------
    def settings_dict(self) -> dict[str, Any]:
        blocks = {} if self.shuffle_block_shards is None else {"shuffle_block_shards": self.shuffle_block_shards}
        if self.mode == "epoch" and self.mixture is None and self.shuffle_block_shards is None:
            blocks["window_order"] = ORDER  # a checkpoint of the earlier (materialized) shuffle is refused by name
        return blocks | {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "mode": self.mode,
            "document_mask": self.document_mask,
            "drop_last": self.drop_last,
            "windows_per_epoch": self.windows_per_epoch,
            "mixture": None if self.mixture is None else self.mixture.settings(),
        }

    @property
    def fingerprint(self) -> str:
        """Hex sha256 of the corpus's fingerprint (split + shard hashes) and the window layout."""
        h = hashlib.sha256(str(self.corpus.fingerprint).encode())
        h.update(np.ascontiguousarray(self.corpus.shard_token_starts, dtype="<i8").tobytes())
        return h.hexdigest()

    @property
    def num_sources(self) -> int:
        return 1 if self.mixture is None else self.mixture.num_sources

    def _num_microbatches(self, epoch: int) -> int:
        return -(-self.epoch_windows(epoch) // self.batch_size)

    def _windows_at(self, epoch: int, position: int) -> int:
        """Windows in batches ``[0, position)`` (past M the epoch wraps around)."""
        M, N = self._num_microbatches(epoch), self.epoch_windows(epoch)
        q, r = divmod(position, M) if position > M and M else (0, position)
        return q * N + min(r * self.batch_size, N)

    def _tokens_at(self, epoch: int, position: int) -> tuple[int, tuple[int, ...]]:
        n = self._windows_at(epoch, position)
        if self.mixture is None:
            return n * self.seq_len, (n * self.seq_len,)
        src = self._source_prefix(epoch)
        M = self._num_microbatches(epoch)
        q, r = divmod(position, M) if position > M and M else (0, position)
        per = q * src[M] + src[min(r, M)]
        return n * self.seq_len, tuple(int(x) * self.seq_len for x in per)

    def _source_prefix(self, epoch: int) -> np.ndarray:
        """(M + 1, S) windows of each mixture source in batches ``[0, g)``."""
        key = ("src", epoch)
        hit = self._cache.get("src")
        if hit is None or hit[0] != key:
            assert self.mixture is not None
            N, S, B = self.epoch_windows(epoch), self.mixture.num_sources, self.batch_size
            bases = self._shard_windows()[self.mixture.shard_bases]
            src = np.searchsorted(bases, self._order(epoch)[:N].astype(np.int64), side="right") - 1
            M = -(-N // B)
            counts = np.bincount(np.arange(N) // B * S + src, minlength=M * S).reshape(M, S)
            pre = np.zeros((M + 1, S), dtype=np.int64)
            np.cumsum(counts, axis=0, out=pre[1:])
            hit = self._cache["src"] = (key, pre)
        return hit[1]

    def mixture_summary(self, epoch: int | None = None) -> list[dict[str, Any]]:
        """Per mixture source, what ``epoch`` reads (:meth:`~h5corpus.loaders.mixture.Mixture.describe`)."""
        if self.mixture is None:
            raise ValueError("mixture_summary: this dataset reads one corpus, not a mixture")
        e = self.epoch if epoch is None else check_epoch(epoch)
        bases = self._shard_windows()[self.mixture.shard_bases]
        return self._with_consumed(
            e, self.mixture.describe(self.mixture.select(bases, None, self.seq_len, self.seed, e, True))
        )

    @staticmethod
    def _batches_of(sched: Schedule, M: int) -> np.ndarray:
        """The global batches (wrapped: ``mod M``) this consumer yields, in order."""
        c = sched.consumer
        j = np.arange(c.worker_id + c.num_workers * sched.skip, sched.steps(M), c.num_workers, dtype=np.int64)
        return (sched.start + c.rank + j * c.world_size) % max(M, 1)

    def plan(self, epoch: int | None = None, consumer: Consumer | None = None) -> np.ndarray:
        """Global start token of every window ``consumer`` (default: this process's) reads in a
        whole ``epoch`` (default: the current one), in yield order. For inspection and tests."""
        consumer = consumer or current_consumer(self.rank, self.world_size)
        e = self.epoch if epoch is None else check_epoch(epoch)
        M, N, B = self._num_microbatches(e), self.epoch_windows(e), self.batch_size
        gs = self._batches_of(Schedule(consumer, drop_last=self.drop_last), M)
        return self._starts(e, _positions(gs, B, N)[0])

    # -- iteration ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[VarlenBatch]:
        live = self._begin()
        epoch = live.epoch
        live.tokens_at = lambda p: self._tokens_at(epoch, p)
        return self._generate(live)

    def _generate(self, live: Any) -> Iterator[VarlenBatch]:
        epoch, sched = live.epoch, live.schedule
        M, N, B = self._num_microbatches(epoch), self.epoch_windows(epoch), self.batch_size
        batches = self._batches_of(sched, M)
        # this process's memory maps (None: a shard read through HDF5); of the shards on this node
        # while a remote cache is cold (a block waits for its missing shards, prefetched ahead)
        have, remote = self.corpus.cached_shards(), self.corpus.remote
        cold = not have.all()
        runs = mapped_runs(self.corpus, cached=cold)
        reads = self._reads()

        def starts_of(lo: int) -> np.ndarray:
            return self._starts(epoch, _positions(batches[lo : lo + PLAN_BLOCK_BATCHES], B, N)[0])

        nxt = starts_of(0) if batches.size else None
        if cold and nxt is not None:  # read shard by shard as they arrive: fetch the first ones now
            self.corpus.prefetch(self._ahead(epoch, nxt))
        for lo_b in range(0, batches.size, PLAN_BLOCK_BATCHES):  # starts (and masking) for a block at once
            items, offs = _positions(batches[lo_b : lo_b + PLAN_BLOCK_BATCHES], B, N)
            starts = nxt if nxt is not None else self._starts(epoch, items)
            nxt = starts_of(lo_b + PLAN_BLOCK_BATCHES) if lo_b + PLAN_BLOCK_BATCHES < batches.size else None
            if nxt is not None and remote:  # a remote corpus fetches the next block's shards while this one is read
                self.corpus.prefetch(self._ahead(epoch, nxt))
            if cold and runs is not None:  # wait for this block's missing shards (prefetched), then map them
                await_shards(self.corpus, missing_shards(self.corpus, starts, have))
            if cold and int((now := self.corpus.cached_shards()).sum()) != int(have.sum()):  # more arrived
                have, cold = now, not now.all()
                runs = mapped_runs(self.corpus, cached=True)
            for batch in reads.block(starts, offs, runs):
                live.yielded += 1
                yield batch

    def _ahead(self, epoch: int, starts: np.ndarray) -> np.ndarray:
        """The shards to prefetch before windows at ``starts`` are read, in order of need: theirs;
        under a block shuffle, once they are cached, those of their blocks and of the next ones
        (:meth:`ShardBlocks.ahead`)."""
        shards = shards_in_order(self.corpus, starts)
        if self.shuffle_block_shards is None or self.mode != "epoch" or not self.corpus.cached_shards()[shards].all():
            return shards  # missing shards of the windows read next come first, alone on the link
        self._order(epoch)  # the epoch's blocks
        return self._cache["blocks"].ahead(shards)

    # -- batches --------------------------------------------------------------------------------------
    def _reads(self) -> _WindowReads:
        """This process's window reads (cached; never pickled)."""
        hit = self._cache.get("reads")
        if hit is None:
            hit = self._cache["reads"] = _WindowReads(self.corpus, self.seq_len, self.document_mask)
        return hit

    def make_batch(self, starts: np.ndarray) -> VarlenBatch:
        """The compact batch of windows starting at global token positions ``starts`` (see
        :class:`_WindowReads`); IndexError for a start whose window does not fit the corpus."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        last = self.corpus.num_tokens - self.seq_len - 1  # the last start whose window fits
        if starts.size and (int(starts.min()) < 0 or int(starts.max()) > last):
            bad = int(starts[(starts < 0) | (starts > last)][0])
            raise IndexError(f"window start {bad:,} outside [0, {last:,}] (a window reads seq_len + 1 tokens)")
        runs = mapped_runs(self.corpus) if starts.size else None
        return next(self._reads().block(starts, np.array([0, starts.size], dtype=np.int64), runs))

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_cache"] = {}
        d["_layout"] = None
        return d

    def __repr__(self) -> str:
        return (
            f"SlidingWindowDataset(seq_len={self.seq_len}, batch_size={self.batch_size}, mode={self.mode!r}, "
            f"seed={self.seed}, epoch={self.epoch}, document_mask={self.document_mask}, windows={self.num_windows:,})"
        )


class _WindowReads:
    """Windows of one corpus into compact batches (one per process: it holds the row templates).

    Row j of a batch's storage is window j in the corpus's own width (e.g. 2 bytes per uint16
    token; no int64 copies), copied once from the memory maps (:meth:`mapped`) or by one
    ``Corpus.gather`` into the batch (:meth:`gathered`, a shard read through HDF5): ``row_cu`` =
    ``[0, L, 2L, ...]``, one pack per window. With document masking, ``cu_seqlens`` adds every
    document start inside a window and ``ignore`` lists the inputs whose target is the next
    document's first token (:meth:`mask_plan`). The int64 fields materialize lazily where the
    batch is used (:class:`~h5corpus.loaders.batch.VarlenBatch`)."""

    def __init__(self, corpus: CorpusLike, seq_len: int, document_mask: bool) -> None:
        self.corpus, self.seq_len, self.document_mask = corpus, seq_len, document_mask
        self._templates: dict[Any, np.ndarray] = {}  # row_cu per (batch size, seq_len)
        self._bounds = _DocBoundaries(corpus)

    def block(self, starts: np.ndarray, offs: np.ndarray, runs: MappedRuns | None) -> Iterator[VarlenBatch]:
        """The batches of a block (batch b: windows ``offs[b] .. offs[b + 1]`` of ``starts``),
        masking planned for the whole block at once; a fine-tuning corpus's loss mask applied to
        each (:mod:`~h5corpus.loaders.lossmask`)."""
        if not self.corpus.has_loss_mask:
            yield from self._block(starts, offs, runs)
            return
        for b, batch in enumerate(self._block(starts, offs, runs)):
            yield mask_batch(batch, self.corpus, starts[int(offs[b]) : int(offs[b + 1])])

    def _block(self, starts: np.ndarray, offs: np.ndarray, runs: MappedRuns | None) -> Iterator[VarlenBatch]:
        mask = self.mask_plan(starts, offs) if self.document_mask else None
        if runs is not None:
            yield from self.mapped(runs, starts, offs, mask)
            return
        for b, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist())):
            yield self.gathered(starts[lo:hi], mask, b)

    def mapped(
        self, runs: MappedRuns, starts: np.ndarray, offs: np.ndarray, mask: _Masks | None
    ) -> Iterator[VarlenBatch]:
        """The batches of a block (batch b: windows ``offs[b] .. offs[b + 1]`` of ``starts``) of a
        memory-mapped corpus, the same as :meth:`gathered` makes: each window is one byte view into
        the run holding it, joined with the batch's header into its one buffer
        (:meth:`~h5corpus.loaders.batch.VarlenBatch.from_window_rows`); a window that leaves its run
        (a gap between runs, a shard's end, a chunk not verified yet) is read through
        ``corpus.tokens`` instead. A block whose chunks are all verified is located at once,
        others batch by batch, so a corrupt chunk raises at the batch that reads it."""
        L, dtype, table, views, tokens = self.seq_len, self.corpus.dtype, runs.table, runs.views, self.corpus.tokens
        n = (L + 1) * dtype.itemsize  # bytes per window
        bounds = offs.tolist()
        block_rows = None
        if table.verified(starts, L + 1):  # the whole block's views at once (views read nothing)
            run, first, cross = _locate(table, starts, L + 1, dtype.itemsize)
            block_rows = [views[r][a : a + n] for r, a in zip(run, first)]
            for k in cross:
                row = _spliced(table, views, run[k], first[k], n, dtype.itemsize)
                g = int(starts[k])
                block_rows[k] = tokens(g, g + L + 1) if row is None else row
        for b in range(len(bounds) - 1):
            lo, hi = bounds[b], bounds[b + 1]
            if block_rows is None:
                run, first, cross = _locate(table, starts[lo:hi], L + 1, dtype.itemsize)
                rows = [views[r][a : a + n] for r, a in zip(run, first)]
                for k in cross:
                    g = int(starts[lo + k])
                    rows[k] = tokens(g, g + L + 1)
            else:
                rows = block_rows[lo:hi]
            if mask is None:
                yield VarlenBatch.from_window_rows(rows, L, dtype)
            else:
                yield VarlenBatch.from_window_rows(
                    rows,
                    L,
                    dtype,
                    segment_starts=mask.cut[mask.cut_at[b] : mask.cut_at[b + 1]],
                    ignore=mask.ignore[mask.ignore_at[b] : mask.ignore_at[b + 1]],
                    max_seqlen=mask.longest[b],
                )

    def gathered(self, starts: np.ndarray, mask: _Masks | None, b: int) -> VarlenBatch:
        """Batch ``b`` of a block whose document masking was planned at once
        (:meth:`mask_plan`; None without masking), through ``Corpus.gather`` (the path of
        corpora with a shard read through HDF5)."""
        B, L = starts.size, self.seq_len
        T = B * L
        if mask is not None:
            p0, p1, q0, q1 = mask.cut_at[b], mask.cut_at[b + 1], mask.ignore_at[b], mask.ignore_at[b + 1]
            parts = alloc_compact(B, T, self.corpus.dtype, packs=B, segments=p1 - p0, ignored=q1 - q0)
            parts.cu_seqlens[:-1] = mask.cut[p0:p1]
            parts.cu_seqlens[-1] = T
            parts.ignore[:] = mask.ignore[q0:q1]
            max_seqlen = mask.longest[b]
        else:
            parts = alloc_compact(B, T, self.corpus.dtype, packs=B)
            max_seqlen = L
        self.corpus.gather(starts, L + 1, out=parts.tokens.reshape(B, L + 1))
        parts.row_cu[:] = self.row_starts(B)
        parts.pack_lengths[:] = L
        return parts.batch(max_seqlen, row_len=L)

    def mask_plan(self, starts: np.ndarray, offs: np.ndarray) -> _Masks:
        """Document masking of the windows at ``starts`` (batch b: windows ``offs[b] .. offs[b + 1]``),
        all at once: one set of numpy calls per block of batches (:class:`_Masks`). Window k's
        inputs are ``[row_k, row_k + L)`` of its batch; its segments start at ``row_k`` and at every
        document start strictly inside it; the input just before a document start in
        ``(a, a + L]`` (``a`` the window's start) has the next document's first token as target:
        ignored."""
        W, L = starts.size, self.seq_len
        if W == 0:
            return _Masks(np.zeros(0, np.int32), [0] * offs.size, np.zeros(0, np.int64), [0] * offs.size, [0])
        win, rel = _document_starts(self._bounds, starts, L)
        ends = np.cumsum(np.bincount(win, minlength=W))
        row = (np.arange(W, dtype=np.int64) - np.repeat(offs[:-1], np.diff(offs))) * L  # row_k
        at = row[win] + rel
        inner = np.flatnonzero(rel < L)  # a document starting at rel == L starts the next window's row
        per = np.bincount(win[inner], minlength=W) + 1  # segments per window
        cut_ptr = np.zeros(W + 1, dtype=np.int64)
        np.cumsum(per, out=cut_ptr[1:])
        cut = np.empty(int(cut_ptr[-1]), dtype=np.int32)
        cut[cut_ptr[:-1]] = row  # window k's start, then its inner document starts, then window k + 1 ...
        cut[np.arange(inner.size) + win[inner] + 1] = at[inner]
        local = cut - np.repeat(row, per)  # segment starts inside their window, [0, L)
        seg_lens = np.empty_like(local)
        seg_lens[:-1] = local[1:] - local[:-1]
        seg_lens[cut_ptr[1:] - 1] = L - local[cut_ptr[1:] - 1]  # each window's last segment
        longest = np.maximum.reduceat(seg_lens, cut_ptr[offs[:-1]]).tolist()
        ign_ptr = np.zeros(W + 1, dtype=np.int64)
        ign_ptr[1:] = ends
        return _Masks(cut, cut_ptr[offs].tolist(), at - 1, ign_ptr[offs].tolist(), longest)

    def row_starts(self, B: int) -> np.ndarray:
        """(B + 1,) int32 ``[0, L, 2L, ..., B*L]``: ``row_cu`` of a batch of B windows (cached)."""
        key = (B, self.seq_len)
        tpl = self._templates.get(key)
        if tpl is None:
            tpl = self._templates[key] = np.arange(0, B * self.seq_len + 1, self.seq_len, dtype=np.int32)
        return tpl


def _locate(table: Any, starts: np.ndarray, length: int, itemsize: int) -> tuple[list[int], list[int], list[int]]:
    """For windows of ``length`` tokens at global ``starts``: the run of ``table`` holding each
    (:meth:`~h5corpus.storage.readpaths.RunTable.locate`, which verifies their first chunks), its
    first byte in that run, and the (ascending) indices of the windows that do not lie inside
    one run of verified tokens."""
    run, pos, room = table.locate(starts)
    return run.tolist(), (pos * itemsize).tolist(), np.flatnonzero(room < length).tolist()


def _spliced(table: Any, views: list[memoryview], r: int, first: int, n: int, itemsize: int) -> bytes | None:
    """The ``n`` bytes from byte ``first`` of run ``r`` on, when they continue into the next run
    (a gap between runs of one shard, or the next shard's first run) and end there: the two
    views' bytes joined; None otherwise. Only for chunks known to be verified."""
    if r + 1 >= len(views):
        return None
    start, end = int(table.starts[r]), int(table.ends[r])
    have = (end - start) * itemsize - first  # a shard's raw last chunk is stored whole: stop at its end
    nxt = int(table.ends[r + 1]) - int(table.starts[r + 1])
    if have <= 0 or int(table.starts[r + 1]) != end or nxt * itemsize < n - have:
        return None
    return b"".join((views[r][first : first + have], views[r + 1][: n - have]))


class _DocBoundaries:
    """Global token offsets of document boundaries, asked of the corpus lazily
    (:meth:`CorpusLike.doc_offsets_range`), never as the whole O(documents) array up front.

    A corpus of fewer than ``SLOTS * BLOCK`` (1 Mi) documents is cached in blocks of
    :attr:`BLOCK` boundaries as windows touch them (at most 8 MiB), so each batch is one
    vectorized lookup; a larger one is asked once per window for exactly the boundaries inside
    it (random windows of a large corpus touch a new block almost every time, so a block cache
    would only copy more: measured 130-170 us of masking per 35-window batch at 2 M documents
    either way, 45-50 us with the cache, as with the whole array)."""

    BLOCK = 1 << 10
    SLOTS = 1 << 10

    def __init__(self, corpus: CorpusLike) -> None:
        self.corpus = corpus
        self.cached = corpus.num_documents < self.SLOTS * self.BLOCK
        self._table = np.zeros((0, self.BLOCK), dtype=np.int64)  # allocated on first use
        self._slot: dict[int, int] = {}

    def between(self, d0: np.ndarray, d1: np.ndarray) -> np.ndarray:
        """Offsets of boundaries ``d0[k] + 1 .. d1[k]`` for every k, end to end (int64)."""
        counts = d1 - d0
        if not self.cached:
            has = np.flatnonzero(counts).tolist()
            lo, hi = (d0 + 1).tolist(), d1.tolist()
            parts = [self.corpus.doc_offsets_range(lo[k], hi[k]) for k in has]
            return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)
        first = np.cumsum(counts) - counts
        docs = np.repeat(d0 + 1 - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)
        blk = docs // self.BLOCK
        need = distinct_sorted(blk)
        self._fetch(need.tolist())
        slots = np.fromiter((self._slot[b] for b in need.tolist()), dtype=np.int64, count=need.size)
        return self._table[slots[np.searchsorted(need, blk)], docs - blk * self.BLOCK]

    def _fetch(self, blocks: list[int]) -> None:
        if not self._table.size:
            self._table = np.zeros((self.SLOTS, self.BLOCK), dtype=np.int64)
        D = self.corpus.num_documents
        for b in blocks:
            if b not in self._slot:
                lo, hi = b * self.BLOCK, min((b + 1) * self.BLOCK - 1, D)
                k = self._slot[b] = len(self._slot)
                self._table[k, : hi - lo + 1] = self.corpus.doc_offsets_range(lo, hi)


def _document_starts(bounds: _DocBoundaries, starts: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Every document start in ``(a, a + L]`` of each window start ``a``: (window index, start
    relative to ``a``, in ``(0, L]``), window by window in order. Window ``k`` holds documents
    ``d0 .. d1`` (:meth:`CorpusLike.doc_index_at` of ``a`` and ``a + L``); the starts of
    ``d0 + 1 .. d1`` come from ``bounds``."""
    corpus = bounds.corpus
    d0 = np.asarray(corpus.doc_index_at(starts), dtype=np.int64)
    d1 = np.asarray(corpus.doc_index_at(starts + L), dtype=np.int64)
    win = np.repeat(np.arange(starts.size, dtype=np.int64), d1 - d0)
    return win, bounds.between(d0, d1) - starts[win]


def _positions(batches: np.ndarray, batch_size: int, num_windows: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions in the epoch's window order of every window of ``batches``, end to end; (k + 1,)
    offsets of each batch's first): batch ``g`` holds positions ``[g * B, min((g + 1) * B, N))``."""
    lo = batches * batch_size
    n = np.minimum(lo + batch_size, num_windows) - lo
    offs = np.zeros(batches.size + 1, dtype=np.int64)
    np.cumsum(n, out=offs[1:])
    return np.repeat(lo - offs[:-1], n) + np.arange(int(offs[-1])), offs
