"""The best-fit loader's epoch plan: one global sequence of microbatches from document lengths alone.

No tokens are read here, and nothing depends on the world size or the DataLoader workers. For an
epoch the plan is (docs/PACKING.md, section 4):

1. **Chunks** of every document in corpus order (:class:`~h5corpus.loaders.chunking.ChunkTable`):
   chunk ids ``0 .. C-1``, a long document's chunks consecutive.
2. **Stream**: the chunk ids in the order ``numpy.random.default_rng([seed, epoch]).permutation(C)``
   (:func:`epoch_order`; ``shuffle=False``: corpus order), so a long document's chunks enter the
   stream as independent segments spread over the epoch. A mixture picks and interleaves chunks of
   its sources instead (:meth:`~h5corpus.loaders.mixture.Mixture.select`); ``shuffle_window_shards``
   orders them in a rolling window over that many shards (:func:`window_stream`, the best-fit
   loader's default on a split of more shards than the window), ``shuffle_block_shards`` shuffles
   chunks only within blocks of shards (:func:`block_stream`).
3. **Packing** of that stream (:mod:`~h5corpus.loaders.packers`): ``mode="buffer"``, one
   :class:`~h5corpus.loaders.packers.BufferPacker` over the whole stream; ``mode="bfd"``, blocks of
   ``packing_buffer`` consecutive stream chunks, each packed best-fit-decreasing with its packs
   shuffled (:func:`~h5corpus.loaders.packers.shuffled_bfd_block`) by one generator per epoch,
   ``numpy.random.default_rng([seed, epoch, 0x9ACC])``, drawn once per block.
4. **Microbatches**: ``batch_size`` consecutive packs; only the epoch's last holds fewer.

:class:`EpochPlan` runs this a group of microbatches at a time (packing is sequential);
:mod:`~h5corpus.loaders.planfile` materializes a whole epoch once into the arrays every process
reads (in memory, or from a shared plan file). :func:`pack_fill` plans a whole epoch to report
how full the packs are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .blockshuffle import (
    block_generator,
    block_order,
    check_block_shards,
    check_window_shards,
    window_generator,
    window_order,
)
from .chunking import ChunkTable
from .packers import BufferPacker, decode_keys, shuffled_bfd_block
from .partition import integer_arg
from .state import STATE_VERSION

MODES = ("buffer", "bfd")

#: The plan's rules (order, chunking, packing) belong to the loader state's version: a state of
#: another version is refused instead of continuing elsewhere.
PLAN_VERSION = STATE_VERSION

#: Default ``packing_buffer`` per mode, in chunks: the candidate buffer of best fit, the block
#: best-fit-decreasing sorts.
DEFAULT_PACKING_BUFFER = {"buffer": 64, "bfd": 16384}

_BFD_STREAM_TAG = 0x9ACC  # separates the BFD pack shuffle's random stream from the chunk order's

#: Microbatches planned per step of the plan (numpy work per group, not per microbatch)
GROUP = 8


def default_packing_buffer(mode: str, packing_buffer: int | None) -> int:
    """``packing_buffer`` if given, else the mode's default (:data:`DEFAULT_PACKING_BUFFER`)."""
    if packing_buffer is not None:
        return integer_arg("packing_buffer", packing_buffer, 1)
    return DEFAULT_PACKING_BUFFER["buffer" if mode == "buffer" else "bfd"]


@dataclass(frozen=True)
class PlanSettings:
    """Everything a best-fit plan depends on besides the document lengths and the epoch."""

    max_seq_len: int = 4096
    """Pack capacity and longest segment, in input tokens."""
    batch_size: int = 35
    """Packs per microbatch."""
    packing_buffer: int | None = None
    """Chunks considered at once: the candidate buffer (``"buffer"``) or the block BFD sorts
    (``"bfd"``); None: the mode's default (64 / 16,384). Always an int after construction."""
    seed: int = 0
    """Seeds the chunk order and BFD's pack shuffle."""
    mode: str = "buffer"
    """``"buffer"`` (bounded-buffer best fit) or ``"bfd"`` (best-fit-decreasing over blocks)."""
    shuffle: bool = True
    """Shuffle the chunk order per epoch; False keeps corpus order."""
    shuffle_block_shards: int | None = None
    """None: the chunk order is shuffled over the whole split; ``K``: shards permuted, ``K`` at a
    time form a block, chunks shuffled only within a block (:mod:`~h5corpus.loaders.blockshuffle`).
    Recorded in :meth:`as_dict` only when set, so plans and states without it stay valid."""
    shuffle_window_shards: int | None = None
    """None: no window; ``K``: the chunk order is a rolling window over ``K`` shards
    (:func:`~h5corpus.loaders.blockshuffle.window_order`; the global shuffle where the split has
    ``K`` shards or fewer). Recorded in :meth:`as_dict` only when set."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        L = integer_arg("max_seq_len", self.max_seq_len, 1, 2**30 - 1)
        B = integer_arg("batch_size", self.batch_size, 1)
        buf = integer_arg("packing_buffer", default_packing_buffer(self.mode, self.packing_buffer), 1)
        seed = integer_arg("seed", self.seed, 0)
        for name, value in (
            ("max_seq_len", L),
            ("batch_size", B),
            ("packing_buffer", buf),
            ("seed", seed),
            ("shuffle", bool(self.shuffle)),
            ("shuffle_block_shards", check_block_shards(self.shuffle_block_shards)),
            ("shuffle_window_shards", check_window_shards(self.shuffle_window_shards)),
        ):
            object.__setattr__(self, name, value)
        if self.shuffle_block_shards is not None and not self.shuffle:
            raise ValueError("shuffle_block_shards shuffles within blocks of shards; it needs shuffle=True")
        if self.shuffle_window_shards is not None and (not self.shuffle or self.shuffle_block_shards is not None):
            raise ValueError("shuffle_window_shards needs shuffle=True and no shuffle_block_shards")

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain values (what a checkpoint records and compares);
        ``shuffle_block_shards`` and ``shuffle_window_shards`` only when set."""
        d = dataclasses.asdict(self)
        for optional in ("shuffle_block_shards", "shuffle_window_shards"):
            if d[optional] is None:
                del d[optional]
        return d


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's item order: ``default_rng([seed, epoch]).permutation(num_items)`` (``shuffle=False``:
    ``arange``), as int32 below 2**31 items (4 bytes per item; the same values). A pure function of
    its arguments, identical in every process."""
    a = np.arange(num_items, dtype=np.int32 if num_items < 2**31 else np.int64)
    if shuffle:
        np.random.default_rng([int(seed), int(epoch)]).shuffle(a)  # = permutation(num_items)
    return a


class Microbatch(NamedTuple):
    """One microbatch of a plan: which chunks, how long, and where each pack begins."""

    chunks: np.ndarray
    """(S,) chunk ids (:class:`~h5corpus.loaders.chunking.ChunkTable` rows; the stream's dtype,
    int32 below 2**31 chunks), pack after pack, each pack's chunks in pick (placement) order."""
    lengths: np.ndarray
    """(S,) int64 inputs per chunk."""
    pack_starts: np.ndarray
    """(P,) int64 offset in ``chunks`` of each pack's first chunk (``pack_starts[0] == 0``)."""

    @property
    def pack_lengths(self) -> np.ndarray:
        """(P,) int64 real input tokens per pack."""
        return np.add.reduceat(self.lengths, self.pack_starts)


class MicrobatchGroup(NamedTuple):
    """Microbatches flat (per-microbatch numpy work done once per group): microbatch ``j`` holds
    packs ``mb_packs[j]:mb_packs[j + 1]``."""

    chunks: np.ndarray
    """(S,) chunk ids (int32 below 2**31 chunks), every microbatch's packs end to end."""
    lengths: np.ndarray
    """(S,) int64 inputs per chunk."""
    pack_starts: np.ndarray
    """(P,) int64 offset in ``chunks`` of each pack's first chunk."""
    mb_packs: list[int]
    """(K + 1,) offsets into ``pack_starts``."""

    @property
    def num_microbatches(self) -> int:
        return len(self.mb_packs) - 1

    def bounds(self) -> np.ndarray:
        """(K + 1,) offset in ``chunks`` of each microbatch's first chunk, then S."""
        ps = self.pack_starts
        return np.append(ps[self.mb_packs[:-1]], self.chunks.size) if ps.size else np.zeros(1, np.int64)

    def microbatch(self, j: int) -> Microbatch:
        p0, p1 = self.mb_packs[j], self.mb_packs[j + 1]
        a = int(self.pack_starts[p0])
        b = int(self.pack_starts[p1]) if p1 < self.pack_starts.size else self.chunks.size
        return Microbatch(self.chunks[a:b], self.lengths[a:b], self.pack_starts[p0:p1] - a)


class EpochPlan:
    """The packing of one epoch's chunk stream into microbatches, from chunk lengths alone, a
    group at a time (:meth:`next_group`; packing is sequential, so a plan is consumed once).
    :func:`~h5corpus.loaders.planfile.materialize` turns a whole epoch of it into the flat arrays
    every process reads; :func:`pack_fill` into fill statistics.

    ``stream`` holds the epoch's chunk ids in stream order (module docstring)."""

    def __init__(self, table: ChunkTable, stream: np.ndarray, settings: PlanSettings, *, epoch: int) -> None:
        self.table, self.settings, self.epoch = table, settings, int(epoch)
        self.stream = stream
        self.lengths = table.length[stream]
        self.rng = np.random.default_rng([int(settings.seed), int(epoch), _BFD_STREAM_TAG])
        self.packer = (
            BufferPacker(self.lengths, settings.max_seq_len, settings.packing_buffer)
            if settings.mode == "buffer"
            else None
        )
        #: BFD: packs made but not yet grouped into microbatches (stream positions, chunks per pack)
        self._pend_chunks = np.zeros(0, np.int64)
        self._pend_sizes = np.zeros(0, np.int64)
        self._pend_pack = self._pend_at = 0
        self.cursor = 0  # BFD: next stream chunk not yet packed

    @property
    def num_chunks(self) -> int:
        return int(self.stream.size)

    def count_microbatches(self) -> int:
        """Plan the rest of the epoch and return how many microbatches that was (M for a fresh plan)."""
        M = 0
        while (g := self.next_group(8 * GROUP)) is not None:
            M += g.num_microbatches
        return M

    def next_group(self, k: int) -> MicrobatchGroup | None:
        """Plan the next ``k`` microbatches (fewer at the end of the epoch); None when none is left.
        Chunk ids are :class:`~h5corpus.loaders.chunking.ChunkTable` rows."""
        g = self._buffer_group(self.packer, k) if self.packer is not None else self._bfd_group(k)
        if g is None:
            return None
        return g._replace(chunks=self.stream[g.chunks])

    def _buffer_group(self, packer: BufferPacker, k: int) -> MicrobatchGroup | None:
        B = self.settings.batch_size
        mb_packs = [0]
        keys: list[int] = []
        ends: list[int] = []
        marks = [packer.mark]
        for _ in range(k):
            packer.append_packs(B, keys, ends, marks)
            if len(ends) == mb_packs[-1]:
                break
            mb_packs.append(len(ends))
        if not ends:
            return None
        chunks, lens = decode_keys(np.fromiter(keys, dtype=np.int64, count=len(keys)), marks)
        starts = np.empty(len(ends), dtype=np.int64)
        starts[0] = 0
        starts[1:] = ends[:-1]
        return MicrobatchGroup(chunks, lens, starts, mb_packs)

    def _bfd_group(self, k: int) -> MicrobatchGroup | None:
        B = self.settings.batch_size
        mb_packs = [0]
        parts, sizes_l = [], []
        for _ in range(k):
            while self._pend_sizes.size - self._pend_pack < B and self.cursor < self.num_chunks:
                self._pack_block()
            p0, a = self._pend_pack, self._pend_at
            sizes = self._pend_sizes[p0 : p0 + B]
            if not sizes.size:
                break
            n = int(sizes.sum())
            parts.append(self._pend_chunks[a : a + n])
            sizes_l.append(sizes)
            self._pend_pack, self._pend_at = p0 + sizes.size, a + n
            mb_packs.append(mb_packs[-1] + sizes.size)
        if not parts:
            return None
        chunks = np.concatenate(parts) if len(parts) > 1 else parts[0]
        sizes = np.concatenate(sizes_l) if len(sizes_l) > 1 else sizes_l[0]
        starts = np.cumsum(sizes) - sizes
        return MicrobatchGroup(chunks, self.lengths[chunks].astype(np.int64), starts, mb_packs)

    def _pack_block(self) -> None:
        """BFD over the next ``packing_buffer`` chunks; its packs, shuffled, join the pending ones."""
        stop = min(self.cursor + self.settings.packing_buffer, self.num_chunks)
        chunks, sizes = shuffled_bfd_block(self.lengths[self.cursor : stop], self.settings.max_seq_len, self.rng)
        chunks = chunks.astype(np.int64) + self.cursor
        self._pend_chunks = np.concatenate([self._pend_chunks[self._pend_at :], chunks])
        self._pend_sizes = np.concatenate([self._pend_sizes[self._pend_pack :], sizes])
        self._pend_pack = self._pend_at = 0
        self.cursor = stop


def block_stream(table: ChunkTable, shard_doc_starts: np.ndarray, settings: PlanSettings, epoch: int) -> np.ndarray:
    """The chunk order of a block-shuffled epoch (``settings.shuffle_block_shards``): shard ``s``
    holds documents ``shard_doc_starts[s] ..`` and so chunks ``table.first[shard_doc_starts[s]] ..``;
    :func:`~h5corpus.loaders.blockshuffle.block_order` with ``block_generator(seed, epoch)``."""
    K = settings.shuffle_block_shards
    if K is None:
        raise ValueError("block_stream: settings.shuffle_block_shards is not set")
    bounds = table.first[np.asarray(shard_doc_starts, dtype=np.int64)]
    order, _ = block_order(bounds, K, block_generator(settings.seed, epoch))
    return order.astype(np.int32 if table.num_chunks < 2**31 else np.int64, copy=False)


def window_stream(table: ChunkTable, shard_doc_starts: np.ndarray, settings: PlanSettings, epoch: int) -> np.ndarray:
    """The chunk order of a window-shuffled epoch (``settings.shuffle_window_shards``, ``K``):
    :func:`~h5corpus.loaders.blockshuffle.window_order` of the shards' chunks with
    ``window_generator(seed, epoch)``; :func:`epoch_order` (the global shuffle) where the split has
    ``K`` shards or fewer (``shard_doc_starts`` as for :func:`block_stream`)."""
    K = settings.shuffle_window_shards
    if K is None:
        raise ValueError("window_stream: settings.shuffle_window_shards is not set")
    starts = np.asarray(shard_doc_starts, dtype=np.int64)
    if K >= starts.size - 1:
        return epoch_order(table.num_chunks, settings.seed, epoch)
    order = window_order(table.first[starts], K, window_generator(settings.seed, epoch))
    return order.astype(np.int32 if table.num_chunks < 2**31 else np.int64, copy=False)


def chunk_stream(
    table: ChunkTable, settings: PlanSettings, epoch: int, shard_doc_starts: np.ndarray | None = None
) -> np.ndarray:
    """The epoch's chunk order over one corpus: :func:`block_stream` with
    ``settings.shuffle_block_shards``, :func:`window_stream` with ``shuffle_window_shards`` (both
    need ``shard_doc_starts``, the (shards + 1,) first document of each shard), else
    :func:`epoch_order`."""
    bounded = (
        ("shuffle_block_shards", settings.shuffle_block_shards, block_stream),
        ("shuffle_window_shards", settings.shuffle_window_shards, window_stream),
    )
    for name, value, stream in bounded:
        if value is not None:
            if shard_doc_starts is None:
                raise ValueError(f"plan_epoch: {name} needs shard_doc_starts (the shards' first documents)")
            return stream(table, shard_doc_starts, settings, epoch)
    return epoch_order(table.num_chunks, settings.seed, epoch, settings.shuffle)


def plan_epoch(
    doc_lengths: np.ndarray, settings: PlanSettings, *, epoch: int = 0, shard_doc_starts: np.ndarray | None = None
) -> EpochPlan:
    """The global plan of ``epoch`` over one corpus (``doc_lengths``: tokens per document of the
    split, EOS included; ``shard_doc_starts``: the (shards + 1,) first document of each shard, needed
    with ``settings.shuffle_block_shards`` or ``shuffle_window_shards``); see the module docstring."""
    table = ChunkTable.build(doc_lengths, settings.max_seq_len)
    return EpochPlan(table, chunk_stream(table, settings, epoch, shard_doc_starts), settings, epoch=epoch)


# --------------------------------------------------------------------------------------------
# Fill statistics (what `h5corpus inspect` reports)
# --------------------------------------------------------------------------------------------
@dataclass
class PackFill:
    """Packing statistics of one planned epoch (no tokens read). Fill = real input tokens /
    capacity, counted three ways that differ only in the epoch's final, partial microbatch
    (``fill``, ``fill_full_microbatches``, ``fill_padded_last``). Counts are of the whole epoch
    (the global sequence, all ranks together)."""

    packs: int
    microbatches: int
    chunks: int
    skipped_documents: int
    """Documents with fewer than 2 tokens (no next-token pair)."""
    real_tokens: int
    """Input tokens = next-token pairs packed."""
    capacity: int
    """``packs * max_seq_len``, in tokens."""
    fill: float
    """``real_tokens / capacity`` over every pack, the final microbatch's included."""
    fill_full_microbatches: float
    """Fill over the microbatches holding ``batch_size`` packs (the final partial one excluded)."""
    fill_padded_last: float
    """Fill if the final partial microbatch were charged ``batch_size`` packs of capacity."""
    pack_fill: np.ndarray = field(repr=False)
    """(packs,) float64 real tokens / max_seq_len per pack, in sequence order."""


def pack_fill(
    lengths: np.ndarray,
    max_seq_len: int = 4096,
    batch_size: int = 35,
    packing_buffer: int | None = None,
    seed: int = 0,
    mode: str = "buffer",
    *,
    epoch: int = 0,
    shuffle: bool = True,
    shuffle_block_shards: int | None = None,
    shard_doc_starts: np.ndarray | None = None,
    shuffle_window_shards: int | None = None,
) -> PackFill:
    """Plan one epoch of :class:`~h5corpus.loaders.bestfit.BestFitDataset` over document lengths.

    ``lengths`` are tokens per document, EOS included (``Corpus.doc_lengths``). The plan is the
    dataset's own (:func:`plan_epoch`), so the packs are exactly those of its global sequence
    (``shard_doc_starts``: the shards' first documents, ``Corpus.shard_doc_starts``, needed with
    ``shuffle_block_shards`` or ``shuffle_window_shards``; the dataset's default window is
    :data:`~h5corpus.loaders.blockshuffle.DEFAULT_WINDOW_SHARDS`, here None: the global shuffle)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    settings = PlanSettings(
        max_seq_len, batch_size, packing_buffer, seed, mode, shuffle, shuffle_block_shards, shuffle_window_shards
    )
    plan = plan_epoch(lengths, settings, epoch=epoch, shard_doc_starts=shard_doc_starts)
    loads: list[np.ndarray] = []
    mbs: list[int] = []
    while (g := plan.next_group(64)) is not None:
        mbs.extend(np.diff(g.mb_packs).tolist())
        loads.append(np.add.reduceat(g.lengths, g.pack_starts))
    load = np.concatenate(loads) if loads else np.zeros(0, np.int64)
    L, B = settings.max_seq_len, settings.batch_size
    real, cap = int(load.sum()), int(load.size) * L
    full = np.asarray(mbs) == B
    n_full_packs = int(np.asarray(mbs)[full].sum()) if mbs else 0
    real_full = int(load[:n_full_packs].sum())  # only the final microbatch can be partial
    padded_cap = len(mbs) * B * L
    return PackFill(
        packs=int(load.size),
        microbatches=len(mbs),
        chunks=plan.num_chunks,
        skipped_documents=int(np.count_nonzero(lengths < 2)),
        real_tokens=real,
        capacity=cap,
        fill=real / cap if cap else 0.0,
        fill_full_microbatches=real_full / (n_full_packs * L) if n_full_packs else 0.0,
        fill_padded_last=real / padded_cap if padded_cap else 0.0,
        pack_fill=load / float(L),
    )
