"""The best-fit loader's epoch plan: document lengths + settings -> microbatches of chunk indices.

No tokens are read here. For one epoch and one consumer (DDP rank x DataLoader worker,
:mod:`~h5corpus.loaders.partition`) the plan is:

1. **Order** (:func:`epoch_order`): ``numpy.random.default_rng([seed, epoch]).permutation(N)`` of
   the split's ``N`` documents (``shuffle=False``: corpus order). Consumer ``c`` of ``n`` takes
   ``order[c::n]`` (:func:`consumer_documents`): consumers read disjoint documents whose union is
   the epoch.
2. **Chunking** of those documents, in that order (:func:`~h5corpus.loaders.chunking.chunk_layout`).
3. **Packing** of the chunk stream (:mod:`~h5corpus.loaders.packers`): ``mode="buffer"``, one
   :class:`~h5corpus.loaders.packers.BufferPacker` over the whole stream; ``mode="bfd"``, blocks of
   ``packing_buffer`` consecutive chunks, each packed best-fit-decreasing with its packs shuffled
   (:func:`~h5corpus.loaders.packers.shuffled_bfd_block`) by one generator per epoch and consumer,
   ``numpy.random.default_rng([seed, epoch, c, n, 0x9ACC])``, drawn once per block.
4. **Microbatches**: ``batch_size`` consecutive packs; only an epoch's last holds fewer.

:func:`plan_epoch` is that function of (document lengths, :class:`PlanSettings`, epoch, consumer);
:class:`EpochPlan` runs it lazily, a group of microbatches at a time, and its :meth:`~EpochPlan.state`
is where it stands. :func:`pack_fill` simulates one epoch to report how full the packs are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from .chunking import chunk_layout
from .packers import BufferPacker, decode_keys, shuffled_bfd_block
from .partition import Consumer

MODES = ("buffer", "bfd")

#: Bumped whenever the plan (order, chunking, packing) for the same settings changes; stored in
#: ``BestFitDataset.state_dict()`` so a checkpoint of an older plan is refused instead of silently
#: continuing elsewhere.
PLAN_VERSION = 1

#: Default ``packing_buffer`` per mode, in chunks: the candidate buffer of best fit, the block
#: best-fit-decreasing sorts.
DEFAULT_PACKING_BUFFER = {"buffer": 64, "bfd": 16384}

_BFD_STREAM_TAG = 0x9ACC  # separates the BFD pack shuffle's random stream from the document order's

#: The consumer of a single-process epoch (no DDP, no DataLoader workers).
SINGLE_CONSUMER = Consumer(0, 1, 0, 1)


def default_packing_buffer(mode: str, packing_buffer: int | None) -> int:
    """``packing_buffer`` if given, else the mode's default (:data:`DEFAULT_PACKING_BUFFER`)."""
    if packing_buffer is not None:
        return int(packing_buffer)
    return DEFAULT_PACKING_BUFFER["buffer" if mode == "buffer" else "bfd"]


@dataclass(frozen=True)
class PlanSettings:
    """Everything a best-fit plan depends on besides the document lengths, the epoch and the consumer."""

    max_seq_len: int = 4096
    """Pack capacity and longest segment, in input tokens."""
    batch_size: int = 35
    """Packs per microbatch."""
    packing_buffer: int | None = None
    """Chunks considered at once: the candidate buffer (``"buffer"``) or the block BFD sorts
    (``"bfd"``); None: the mode's default (64 / 16,384). Always an int after construction."""
    seed: int = 0
    """Seeds the document order and BFD's pack shuffle."""
    mode: str = "buffer"
    """``"buffer"`` (bounded-buffer best fit) or ``"bfd"`` (best-fit-decreasing over blocks)."""
    shuffle: bool = True
    """Shuffle the document order per epoch; False keeps corpus order."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_seq_len < 1 or self.batch_size < 1:
            raise ValueError(f"max_seq_len ({self.max_seq_len}) and batch_size ({self.batch_size}) must be >= 1")
        buf = default_packing_buffer(self.mode, self.packing_buffer)
        if buf < 1:
            raise ValueError(f"packing_buffer must be >= 1 chunk, got {buf}")
        for name, value in (
            ("max_seq_len", int(self.max_seq_len)),
            ("batch_size", int(self.batch_size)),
            ("packing_buffer", buf),
            ("seed", int(self.seed)),
            ("shuffle", bool(self.shuffle)),
        ):
            object.__setattr__(self, name, value)

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain values (what a checkpoint records and compares)."""
        return dataclasses.asdict(self)


def epoch_order(num_documents: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's document order, int64: ``default_rng([seed, epoch]).permutation(num_documents)``
    (``shuffle=False``: ``arange``). A pure function of its arguments, identical in every process."""
    if not shuffle:
        return np.arange(num_documents, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_documents).astype(np.int64)


def consumer_documents(order: np.ndarray, consumer: Consumer) -> np.ndarray:
    """The documents consumer ``c`` of ``n`` reads: ``order[c::n]`` (disjoint, union = epoch)."""
    return order[consumer.index :: consumer.count]


def plan_epoch(
    doc_lengths: np.ndarray, settings: PlanSettings, *, epoch: int = 0, consumer: Consumer = SINGLE_CONSUMER
) -> EpochPlan:
    """The plan of ``consumer``'s share of ``epoch``: order, share, chunks, packs (see the module
    docstring). ``doc_lengths``: tokens per document of the split, EOS included."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    order = epoch_order(lengths.size, settings.seed, epoch, settings.shuffle)
    return EpochPlan(lengths, consumer_documents(order, consumer), settings, epoch=epoch, consumer=consumer)


class Microbatch(NamedTuple):
    """One microbatch of a plan: which chunks, how long, and where each pack begins."""

    chunks: np.ndarray
    """(S,) int64 chunk indices into the plan's ``chunk_doc``/``chunk_start``/``chunk_len``,
    pack after pack, each pack's chunks in pick (placement) order."""
    lengths: np.ndarray
    """(S,) int64 inputs per chunk (= ``chunk_len[chunks]``)."""
    pack_starts: np.ndarray
    """(P,) int64 offset in ``chunks`` of each pack's first chunk (``pack_starts[0] == 0``)."""

    @property
    def pack_lengths(self) -> np.ndarray:
        """(P,) int64 real input tokens per pack."""
        return np.add.reduceat(self.lengths, self.pack_starts)


class MicrobatchGroup(NamedTuple):
    """Consecutive microbatches planned in one go, flat (so that per-microbatch numpy work is
    done once per group): microbatch ``j`` holds packs ``mb_packs[j]:mb_packs[j + 1]``."""

    chunks: np.ndarray
    """(S,) int64 chunk indices, every microbatch's packs end to end."""
    lengths: np.ndarray
    """(S,) int64 inputs per chunk."""
    pack_starts: np.ndarray
    """(P,) int64 offset in ``chunks`` of each pack's first chunk."""
    mb_packs: list[int]
    """(K + 1,) offsets into ``pack_starts``."""
    snapshots: list[tuple]
    """(K,) the plan's position right after each microbatch (for :meth:`EpochPlan.consume`)."""

    def microbatch(self, j: int) -> Microbatch:
        p0, p1 = self.mb_packs[j], self.mb_packs[j + 1]
        a = int(self.pack_starts[p0])
        b = int(self.pack_starts[p1]) if p1 < self.pack_starts.size else self.chunks.size
        return Microbatch(self.chunks[a:b], self.lengths[a:b], self.pack_starts[p0:p1] - a)


class EpochPlan:
    """Order -> chunks -> packs -> microbatches for one consumer and epoch; pure over document lengths.

    ``docs`` is the consumer's documents in order (:func:`consumer_documents`; a checkpoint's saved
    order on resume). Chunk ``i`` of the plan is ``chunk_len[i]`` inputs of document
    ``chunk_doc[i]`` (a corpus document index) from offset ``chunk_start[i]``.
    :meth:`next_microbatch` plans one microbatch, :meth:`next_group` several at once. The plan may
    run ahead of its consumer: :meth:`state` describes the position after the last microbatch
    passed to :meth:`consume` (which ``next_microbatch`` does itself).
    """

    def __init__(
        self, doc_lengths: np.ndarray, docs: np.ndarray, settings: PlanSettings, *, epoch: int, consumer: Consumer
    ) -> None:
        self.settings = settings
        self.docs = np.asarray(docs, dtype=np.int64)
        d, self.chunk_start, self.chunk_len = chunk_layout(np.asarray(doc_lengths)[self.docs], settings.max_seq_len)
        self.chunk_doc = self.docs[d]
        self.rng = np.random.default_rng(
            [int(settings.seed), int(epoch), consumer.index, consumer.count, _BFD_STREAM_TAG]
        )
        self._rng_state = self.rng.bit_generator.state
        #: BFD: packs made but not yet planned into microbatches, flat (chunk indices, chunks per
        #: pack); the next pack is ``_pend_sizes[_pend_pack]``, its first chunk ``_pend_chunks[_pend_at]``
        self._pend_chunks = np.zeros(0, np.int64)
        self._pend_sizes = np.zeros(0, np.int64)
        self._pend_pack = self._pend_at = 0
        #: BFD: next chunk not yet packed (buffer mode keeps its cursor in the packer)
        self.cursor = 0
        self.packer = (
            BufferPacker(self.chunk_len, settings.max_seq_len, settings.packing_buffer)
            if settings.mode == "buffer"
            else None
        )
        self._consumed = self._snapshot()

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_len.size)

    def _snapshot(self) -> tuple:
        if self.packer is not None:
            return self.packer.snapshot()
        return (self.cursor, self._pend_chunks, self._pend_sizes, self._pend_pack, self._pend_at, self._rng_state)

    def consume(self, snapshot: tuple) -> None:
        """Mark the microbatch whose snapshot this is as yielded (what :meth:`state` describes)."""
        self._consumed = snapshot

    def next_microbatch(self) -> Microbatch | None:
        """Up to ``batch_size`` packs; None once the consumer's epoch is used up. Only the last
        microbatch of an epoch may hold fewer than ``batch_size`` packs."""
        g = self.next_group(1)
        if g is None:
            return None
        self.consume(g.snapshots[0])
        return g.microbatch(0)

    def next_group(self, k: int) -> MicrobatchGroup | None:
        """The next ``k`` microbatches (fewer at the end of the epoch); None when none is left."""
        if self.packer is not None:
            return self._buffer_group(self.packer, k)
        return self._bfd_group(k)

    def _buffer_group(self, packer: BufferPacker, k: int) -> MicrobatchGroup | None:
        B = self.settings.batch_size
        snaps: list[tuple] = []
        mb_packs = [0]
        keys: list[int] = []
        ends: list[int] = []
        marks = [packer.mark]
        for _ in range(k):
            packer.append_packs(B, keys, ends, marks)
            if len(ends) == mb_packs[-1]:
                break
            mb_packs.append(len(ends))
            snaps.append(packer.snapshot())
        if not ends:
            return None
        chunks, lens = decode_keys(np.fromiter(keys, dtype=np.int64, count=len(keys)), marks)
        starts = np.empty(len(ends), dtype=np.int64)
        starts[0] = 0
        starts[1:] = ends[:-1]
        return MicrobatchGroup(chunks, lens, starts, mb_packs, snaps)

    def _bfd_group(self, k: int) -> MicrobatchGroup | None:
        B = self.settings.batch_size
        snaps: list[tuple] = []
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
            snaps.append(self._snapshot())
        if not parts:
            return None
        chunks = np.concatenate(parts) if len(parts) > 1 else parts[0]
        sizes = np.concatenate(sizes_l) if len(sizes_l) > 1 else sizes_l[0]
        starts = np.cumsum(sizes) - sizes
        return MicrobatchGroup(chunks, self.chunk_len[chunks], starts, mb_packs, snaps)

    def _pack_block(self) -> None:
        """BFD over the next ``packing_buffer`` chunks; its packs, shuffled, join the pending ones."""
        stop = min(self.cursor + self.settings.packing_buffer, self.num_chunks)
        chunks, sizes = shuffled_bfd_block(self.chunk_len[self.cursor : stop], self.settings.max_seq_len, self.rng)
        self._rng_state = self.rng.bit_generator.state
        chunks += self.cursor
        self._pend_chunks = np.concatenate([self._pend_chunks[self._pend_at :], chunks])
        self._pend_sizes = np.concatenate([self._pend_sizes[self._pend_pack :], sizes])
        self._pend_pack = self._pend_at = 0
        self.cursor = stop

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The position after the last consumed microbatch: ``cursor`` (next chunk not yet packed or
        buffered), ``buffer`` (buffer mode: waiting chunks, ascending), ``pending_chunks`` /
        ``pending_lengths`` (BFD: packs made but not yet yielded, flat, and chunks per pack) as int64
        tensors, and ``rng`` (the numpy bit generator's state dict, plain ints)."""
        snap = self._consumed
        if self.packer is not None:
            cursor, buffer = snap.cursor, np.asarray(snap.buffer, dtype=np.int64)
            pend_chunks, pend_sizes, rng = np.zeros(0, np.int64), np.zeros(0, np.int64), self._rng_state
        else:
            cursor, chunks, sizes, p, a, rng = snap
            buffer, pend_chunks, pend_sizes = np.zeros(0, np.int64), chunks[a:].copy(), sizes[p:].copy()
        return {
            "cursor": int(cursor),
            "buffer": torch.from_numpy(buffer),
            "pending_chunks": torch.from_numpy(pend_chunks),
            "pending_lengths": torch.from_numpy(pend_sizes),
            "rng": rng,
        }

    def restore(self, st: dict[str, Any]) -> None:
        """Continue from a :meth:`state` of the same plan; ValueError if it does not fit it."""
        cursor = int(st["cursor"])
        if not 0 <= cursor <= self.num_chunks:
            raise ValueError(f"state cursor {cursor} outside [0, {self.num_chunks}] chunks")
        if self.packer is not None:
            self.packer = BufferPacker(
                self.chunk_len,
                self.settings.max_seq_len,
                self.settings.packing_buffer,
                cursor=cursor,
                buffer=np.asarray(st["buffer"], dtype=np.int64),
            )
        else:
            self.cursor = cursor
        chunks = np.asarray(st["pending_chunks"], dtype=np.int64).reshape(-1)
        sizes = np.asarray(st["pending_lengths"], dtype=np.int64).reshape(-1)
        if (
            int(sizes.sum()) != chunks.size
            or (sizes < 1).any()
            or (chunks.size and not 0 <= chunks.min() <= chunks.max() < self.num_chunks)
        ):
            raise ValueError("state's pending packs do not fit this plan")
        self._pend_chunks, self._pend_sizes = chunks.copy(), sizes.copy()
        self._pend_pack = self._pend_at = 0
        self.rng.bit_generator.state = st["rng"]
        self._rng_state = self.rng.bit_generator.state
        self._consumed = self._snapshot()


# --------------------------------------------------------------------------------------------
# Fill statistics (what `h5corpus inspect` reports)
# --------------------------------------------------------------------------------------------
@dataclass
class PackFill:
    """Packing statistics of one simulated epoch (no tokens read). Fill = real input tokens /
    capacity, counted three ways that differ only in the epoch's final, partial microbatch
    (``fill``, ``fill_full_microbatches``, ``fill_padded_last``). Counts are of one consumer's
    epoch (the whole epoch with one process)."""

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
    """(packs,) float64 real tokens / max_seq_len per pack, in emission order."""


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
) -> PackFill:
    """Simulate one epoch of :class:`~h5corpus.loaders.bestfit.BestFitDataset` (one consumer)
    over document lengths.

    ``lengths`` are tokens per document, EOS included (``Corpus.doc_lengths``). The plan is the
    dataset's own (:func:`plan_epoch`), so the packs are exactly those the dataset yields with
    ``num_workers=0`` and ``world_size=1``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    settings = PlanSettings(max_seq_len, batch_size, packing_buffer, seed, mode, shuffle)
    plan = plan_epoch(lengths, settings, epoch=epoch)
    loads: list[np.ndarray] = []
    mbs: list[int] = []
    while (mb := plan.next_microbatch()) is not None:
        mbs.append(mb.pack_starts.size)
        loads.append(mb.pack_lengths)
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
