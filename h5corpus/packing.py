"""Best-fit packing of whole documents into padding-free varlen microbatches.

The data flow, one stage per block below:

1. **Chunking** (:func:`split_tokens`, :func:`chunk_layout`). A document of ``N`` tokens (EOS
   included, unless it was truncated at build time) has ``N - 1`` next-token pairs. A document
   whose pairs do not fit ``max_seq_len`` inputs becomes consecutive chunks of at most
   ``max_seq_len`` inputs; each chunk's targets look one token ahead, so every pair of the document
   appears exactly once and no target is lost at a cut. Positions restart at 0 in every chunk and
   chunks never attend to each other. Documents of one token have no pair and are skipped.
2. **Packing** (:class:`BufferPacker`, :func:`best_fit_packs`, :func:`bfd_packs`). Pure functions
   over chunk lengths (no I/O). A *pack* is a logical row of capacity ``max_seq_len`` holding whole
   chunks; a *microbatch* is ``batch_size`` packs.

   * ``mode="buffer"``: chunks arrive in a seeded shuffled document order and wait in a bounded
     candidate buffer of ``packing_buffer`` chunks. Each pack repeatedly takes the longest buffered
     chunk that fits its remaining space (oldest first among equal lengths; the buffer is topped up
     from the stream before every pick) until none fits.
   * ``mode="bfd"``: best-fit-decreasing over blocks of ``packing_buffer`` chunks (the algorithm of
     "Fewer Truncations Improve Language Modeling", Ding et al. 2024; OLMo-core's segment-tree
     packer is the reference point): chunks longest first, each into the open pack with the
     smallest remaining space that still fits it, else into a new pack. The bin choice is
     O(log L) in the capacity ``L`` (a 64-ary occupancy tree over remaining capacities), so
     blocks of 10^4-10^5 chunks stay fast. Each block's packs are shuffled with the seeded RNG.
3. **Batches** (:class:`BestFitDataset`). Reads the tokens of each microbatch's chunks (one
   :meth:`Corpus.gather_ranges` call per microbatch, each chunk's inputs plus its lookahead token)
   into a compact :class:`~h5corpus.batch.VarlenBatch` of real tokens only: ``cu_seqlens`` over
   every segment, positions restarting per segment, ``pack_lengths`` per pack. Unused capacity is
   never materialized.

Units: every length and capacity is in tokens; a chunk's length is its number of *inputs* (= its
number of next-token pairs).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right, insort
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from .batch import VarlenBatch, alloc_compact
from .partition import Consumer, current_consumer

MODES = ("buffer", "bfd")

#: Bumped whenever the plan (order, chunking, packing) for the same config changes; stored in
#: ``state_dict()`` so a checkpoint from an older plan is refused instead of silently diverging.
PLAN_VERSION = 1

DEFAULT_BFD_BUFFER = 16384


# --------------------------------------------------------------------------------------------
# 1. Chunking
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """One independent segment of a document: ``inputs[i]`` predicts ``targets[i]``."""

    inputs: np.ndarray
    """(n,) token ids the model reads; ``1 <= n <= max_seq_len``."""
    targets: np.ndarray
    """(n,) the token following each input in the document (one token of lookahead)."""
    position_ids: np.ndarray
    """(n,) int64 ``0 .. n-1``: positions restart in every chunk."""
    start: int
    """Offset of ``inputs[0]`` inside the document, in tokens."""
    doc: Any = None
    """The document id passed to :func:`split_tokens`, if any."""


def chunk_layout(doc_lengths: np.ndarray, max_seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorized chunking of many documents at once.

    ``doc_lengths`` are tokens per document (EOS included). Returns three equal-length arrays with
    one entry per chunk, documents in the given order and chunks in document order:
    ``(doc, start, length)`` = index into ``doc_lengths`` (int64), offset of the chunk's first
    input inside its document (int64) and number of inputs = pairs (int64). A document of ``N``
    tokens yields ``ceil((N - 1) / max_seq_len)`` chunks, all of ``max_seq_len`` inputs except the
    last; documents with fewer than 2 tokens yield none.
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    pairs = np.maximum(np.asarray(doc_lengths, dtype=np.int64) - 1, 0)
    n_chunks = -(-pairs // max_seq_len)
    doc = np.repeat(np.arange(pairs.size, dtype=np.int64), n_chunks)
    first = np.cumsum(n_chunks) - n_chunks  # index of each document's first chunk
    k = np.arange(doc.size, dtype=np.int64) - np.repeat(first, n_chunks)  # chunk number inside its doc
    start = k * max_seq_len
    length = np.minimum(pairs[doc] - start, max_seq_len)
    return doc, start, length


def split_tokens(*args: Any, max_seq_len: int = 4096) -> list[Chunk]:
    """Split one document into independent chunks of at most ``max_seq_len`` inputs.

    Call as ``split_tokens(tokens, max_seq_len=...)`` or, as in the seed article,
    ``split_tokens(doc_id, tokens, max_seq_len=...)``. ``tokens`` is the whole document (EOS
    included). Every next-token pair of the document appears in exactly one chunk:
    ``concat(inputs) == tokens[:-1]`` and ``concat(targets) == tokens[1:]``.

    >>> [len(c.inputs) for c in split_tokens([11, 12, 13, 14, 15, 99], max_seq_len=4)]
    [4, 1]
    """
    if len(args) == 1:
        doc, tokens = None, args[0]
    elif len(args) == 2:
        doc, tokens = args
    else:
        raise TypeError("split_tokens(tokens, *, max_seq_len) or split_tokens(doc_id, tokens, *, max_seq_len)")
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {a.shape}")
    _, start, length = chunk_layout(np.array([a.size]), max_seq_len)
    out = []
    for s, n in zip(start.tolist(), length.tolist()):
        out.append(Chunk(inputs=a[s : s + n], targets=a[s + 1 : s + n + 1],
                         position_ids=np.arange(n, dtype=np.int64), start=s, doc=doc))
    return out


# --------------------------------------------------------------------------------------------
# 2. Packing (pure functions over lengths)
# --------------------------------------------------------------------------------------------
def _low_bit(m: int) -> int:
    return (m & -m).bit_length() - 1


class _OccupancyTree:
    """Set of integers in ``[0, size)`` with O(log_64 size) insert, delete and successor
    (smallest member >= x): a segment tree of fan-out 64 whose nodes are 64-bit occupancy masks (a leaf bit
    says "some bin/chunk has this value", an inner bit says "this child is non-empty")."""

    __slots__ = ("levels",)

    def __init__(self, size: int) -> None:
        self.levels: list[list[int]] = []
        n = max(int(size), 1)
        while True:
            words = (n + 63) >> 6
            self.levels.append([0] * words)
            if words == 1:
                break
            n = words

    def add(self, x: int) -> None:
        for words in self.levels:
            w = x >> 6
            old = words[w]
            words[w] = old | (1 << (x & 63))
            if old:
                return
            x = w

    def discard(self, x: int) -> None:
        for words in self.levels:
            w = x >> 6
            words[w] &= ~(1 << (x & 63))
            if words[w]:
                return
            x = w

    def next_ge(self, x: int) -> int:
        """Smallest member ``>= x``, or -1."""
        levels = self.levels
        lvl = 0
        while True:
            if lvl == len(levels):
                return -1
            words = levels[lvl]
            w = x >> 6
            if w >= len(words):
                return -1
            m = words[w] >> (x & 63)
            if m:
                x += _low_bit(m)
                break
            x = w + 1
            lvl += 1
        while lvl:
            lvl -= 1
            x = (x << 6) + _low_bit(levels[lvl][x])
        return x


def _check_lengths(lengths: np.ndarray, capacity: int) -> np.ndarray:
    a = np.asarray(lengths, dtype=np.int64)
    if a.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {a.shape}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 token, got {capacity}")
    if a.size and (a.min() < 1 or a.max() > capacity):
        bad = int(np.flatnonzero((a < 1) | (a > capacity))[0])
        raise ValueError(f"chunk {bad:,} has {int(a[bad]):,} tokens; every chunk must hold 1..{capacity:,} "
                         "(split documents with chunk_layout first)")
    return a


class BufferPacker:
    """Best fit from a bounded candidate buffer (``mode="buffer"``), one pack at a time.

    ``lengths[i]`` is the length of chunk ``i`` of the stream (stream order = arrival order).
    Before every pick the buffer is topped up to ``buffer_size`` chunks from the stream; a pack
    takes the longest buffered chunk that fits its remaining space (the oldest among equal
    lengths) until none fits. Pure: no I/O, deterministic. Its whole state is ``cursor`` (next
    stream chunk) and ``buffer`` (stream indices of waiting chunks), which the constructor accepts
    to resume.

    The buffer is a sorted list of integer keys ``length << 32 | (2**32 - 1 - index)``: a pick is
    one C-level bisection, an insert/remove one C memmove of at most ``buffer_size`` pointers (fast
    up to ~10^4 candidates; for larger pools use best-fit-decreasing, :func:`bfd_packs`).
    """

    _SHIFT = 32
    _LOW = (1 << 32) - 1

    def __init__(self, lengths: np.ndarray, capacity: int, buffer_size: int, *, cursor: int = 0,
                 buffer: Sequence[int] = ()) -> None:
        if buffer_size < 1:
            raise ValueError(f"packing_buffer must be >= 1 chunk, got {buffer_size}")
        self.lengths = _check_lengths(lengths, capacity)
        if self.lengths.size > self._LOW:
            raise ValueError(f"at most {self._LOW:,} chunks per stream, got {self.lengths.size:,}")
        self._len = self.lengths.tolist()
        self.capacity = int(capacity)
        self.buffer_size = int(buffer_size)
        if not 0 <= cursor <= self.lengths.size:
            raise ValueError(f"cursor {cursor} outside [0, {self.lengths.size}]")
        self.cursor = int(cursor)
        for i in buffer:
            if not 0 <= int(i) < cursor:
                raise ValueError(f"buffered chunk {int(i)} was never admitted (cursor {cursor})")
        self._keys = sorted((self._len[int(i)] << self._SHIFT) | (self._LOW - int(i)) for i in buffer)

    @property
    def buffer(self) -> list[int]:
        """Stream indices of the waiting chunks, in arrival order."""
        return sorted(self._LOW - (k & self._LOW) for k in self._keys)

    @property
    def exhausted(self) -> bool:
        return not self._keys and self.cursor >= len(self._len)

    def next_pack(self) -> list[int]:
        """Stream indices of the next pack's chunks in pick order (longest first); ``[]`` when
        the stream and the buffer are both empty."""
        keys, lens, n, B = self._keys, self._len, len(self._len), self.buffer_size
        SH, LOW = self._SHIFT, self._LOW
        pos = self.cursor
        pack: list[int] = []
        room = self.capacity
        while room:
            while len(keys) < B and pos < n:  # top up before every pick
                insort(keys, (lens[pos] << SH) | (LOW - pos))
                pos += 1
            i = bisect_right(keys, (room << SH) | LOW) - 1  # the longest that fits, oldest among equals
            if i < 0:
                break
            k = keys.pop(i)
            pack.append(LOW - (k & LOW))
            room -= k >> SH
        self.cursor = pos
        return pack


def best_fit_packs(lengths: np.ndarray, capacity: int, packing_buffer: int = 64) -> list[list[int]]:
    """All packs of :class:`BufferPacker` over ``lengths`` (indices into ``lengths``).

    >>> best_fit_packs([6, 4, 3, 2], capacity=8)
    [[0, 3], [1, 2]]
    """
    p = BufferPacker(np.asarray(lengths), capacity, packing_buffer)
    out = []
    while True:
        pack = p.next_pack()
        if not pack:
            return out
        out.append(pack)


def bfd_packs(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit-decreasing: indices into ``lengths`` grouped into packs of total ``<= capacity``.

    Chunks are placed longest first (ties in index order), each into the open pack with the
    smallest remaining space that fits it, else into a new pack. Packs are returned in opening
    order, chunks in placement order. Chunks longer than half the capacity each open their own
    pack (no two fit together), which is done vectorized; the rest go through an O(log L)
    occupancy tree over remaining capacities.
    """
    a = _check_lengths(lengths, capacity)
    cap = int(capacity)
    order = np.argsort(-a, kind="stable")
    sl = a[order]
    nbig = int(np.count_nonzero(sl * 2 > cap))
    packs: list[list[int]] = [[i] for i in order[:nbig].tolist()]
    room0 = cap - sl[:nbig]
    stacks: list[list[int]] = [[] for _ in range(cap + 1)]  # pack ids per remaining space
    tree = _OccupancyTree(cap + 1)
    for b, r in enumerate(room0.tolist()):
        if r:
            if not stacks[r]:
                tree.add(r)
            stacks[r].append(b)
    for i, n in zip(order[nbig:].tolist(), sl[nbig:].tolist()):
        r = tree.next_ge(n)
        if r < 0:
            b = len(packs)
            packs.append([i])
            r = cap
        else:
            st = stacks[r]
            b = st.pop()
            if not st:
                tree.discard(r)
            packs[b].append(i)
        r -= n
        if r:
            st = stacks[r]
            if not st:
                tree.add(r)
            st.append(b)
    return packs


# --------------------------------------------------------------------------------------------
# Plans: order + chunking + packing, still without I/O
# --------------------------------------------------------------------------------------------
def epoch_order(num_documents: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's document order: a permutation of ``[0, num_documents)``, a pure function of
    ``(seed, epoch)``, identical in every process."""
    if not shuffle:
        return np.arange(num_documents, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_documents).astype(np.int64)


def consumer_documents(order: np.ndarray, consumer: Consumer) -> np.ndarray:
    """The documents consumer ``c`` of ``n`` reads: ``order[c::n]`` (disjoint, union = epoch)."""
    return order[consumer.index :: consumer.count]


class _Plan:
    """Order -> chunks -> packs -> microbatches for one consumer; pure over document lengths.

    ``next_microbatch()`` returns a list of packs, each a list of chunk indices into
    ``(chunk_doc, chunk_start, chunk_len)`` (``chunk_doc`` holds corpus document indices).
    """

    def __init__(self, doc_lengths: np.ndarray, docs: np.ndarray, *, max_seq_len: int, batch_size: int,
                 packing_buffer: int, mode: str, rng_seed: Sequence[int]) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 pack, got {batch_size}")
        self.docs = np.asarray(docs, dtype=np.int64)
        d, self.chunk_start, self.chunk_len = chunk_layout(np.asarray(doc_lengths)[self.docs], max_seq_len)
        self.chunk_doc = self.docs[d]
        self.max_seq_len, self.batch_size, self.mode = int(max_seq_len), int(batch_size), mode
        self.packing_buffer = int(packing_buffer)
        self.rng = np.random.default_rng(list(rng_seed))
        if self.packing_buffer < 1:
            raise ValueError(f"packing_buffer must be >= 1 chunk, got {packing_buffer}")
        #: BFD: packs made but not yet yielded (chunk indices), in yield order
        self.pending: deque[list[int]] = deque()
        #: BFD: next chunk not yet packed (buffer mode keeps its cursor in the packer)
        self.cursor = 0
        self.packer = BufferPacker(self.chunk_len, max_seq_len, packing_buffer) if mode == "buffer" else None

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_len.size)

    def next_microbatch(self) -> list[list[int]]:
        """Up to ``batch_size`` packs; ``[]`` once the consumer's epoch is used up. Only the last
        microbatch of an epoch may hold fewer than ``batch_size`` packs."""
        if self.packer is not None:
            out = []
            while len(out) < self.batch_size:
                p = self.packer.next_pack()
                if not p:
                    break
                out.append(p)
            return out
        while len(self.pending) < self.batch_size and self.cursor < self.num_chunks:
            stop = min(self.cursor + self.packing_buffer, self.num_chunks)
            packs = bfd_packs(self.chunk_len[self.cursor:stop], self.max_seq_len)
            perm = self.rng.permutation(len(packs))
            base = self.cursor
            self.pending.extend([base + i for i in packs[j]] for j in perm.tolist())
            self.cursor = stop
        return [self.pending.popleft() for _ in range(min(self.batch_size, len(self.pending)))]

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        if self.packer is not None:
            cursor, buffer = self.packer.cursor, np.asarray(self.packer.buffer, dtype=np.int64)
        else:
            cursor, buffer = self.cursor, np.zeros(0, np.int64)
        flat = [i for p in self.pending for i in p]
        return {
            "cursor": int(cursor),
            "buffer": torch.from_numpy(buffer),
            "pending_chunks": torch.tensor(flat, dtype=torch.int64),
            "pending_lengths": torch.tensor([len(p) for p in self.pending], dtype=torch.int64),
            "rng": self.rng.bit_generator.state,
        }

    def restore(self, st: dict[str, Any]) -> None:
        cursor = int(st["cursor"])
        if not 0 <= cursor <= self.num_chunks:
            raise ValueError(f"state cursor {cursor} outside [0, {self.num_chunks}] chunks")
        if self.packer is not None:
            self.packer = BufferPacker(self.chunk_len, self.max_seq_len, self.packing_buffer, cursor=cursor,
                                       buffer=np.asarray(st["buffer"]).tolist())
        else:
            self.cursor = cursor
        flat = np.asarray(st["pending_chunks"], dtype=np.int64).tolist()
        self.pending = deque()
        pos = 0
        for n in np.asarray(st["pending_lengths"], dtype=np.int64).tolist():
            self.pending.append(flat[pos : pos + n])
            pos += n
        self.rng.bit_generator.state = st["rng"]


# --------------------------------------------------------------------------------------------
# Fill statistics (what `h5corpus inspect` reports)
# --------------------------------------------------------------------------------------------
@dataclass
class PackFill:
    """Packing statistics of one simulated epoch (no tokens read). Fill = real input tokens /
    capacity, counted three ways that differ only in the epoch's final, partial microbatch
    (``fill``, ``fill_full_microbatches``, ``fill_padded_last``)."""

    packs: int
    microbatches: int
    chunks: int
    skipped_documents: int
    """Documents with fewer than 2 tokens (no next-token pair)."""
    real_tokens: int
    """Input tokens = next-token pairs packed."""
    capacity: int
    """``packs * max_seq_len``."""
    fill: float
    """``real_tokens / capacity`` over every pack, the final microbatch's included."""
    fill_full_microbatches: float
    """Fill over the microbatches holding ``batch_size`` packs (the final partial one excluded)."""
    fill_padded_last: float
    """Fill if the final partial microbatch were charged ``batch_size`` packs of capacity."""
    pack_fill: np.ndarray = field(repr=False)
    """(packs,) float64 real tokens / max_seq_len per pack, in emission order."""


def pack_fill(lengths: np.ndarray, max_seq_len: int = 4096, batch_size: int = 35, packing_buffer: int | None = None,
              seed: int = 0, mode: str = "buffer", *, epoch: int = 0, shuffle: bool = True) -> PackFill:
    """Simulate one epoch of :class:`BestFitDataset` (one consumer) over document lengths.

    ``lengths`` are tokens per document, EOS included (``Corpus.doc_lengths``). The plan is the
    dataset's own (same order, chunking and packer), so the packs are exactly those the dataset
    would yield with ``num_workers=0`` and ``world_size=1``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    buf = default_packing_buffer(mode, packing_buffer)
    order = epoch_order(lengths.size, seed, epoch, shuffle)
    plan = _Plan(lengths, order, max_seq_len=max_seq_len, batch_size=batch_size, packing_buffer=buf, mode=mode,
                 rng_seed=_rng_seed(seed, epoch, Consumer(0, 1, 0, 1)))
    loads: list[int] = []
    mbs = []
    while True:
        mb = plan.next_microbatch()
        if not mb:
            break
        mbs.append(len(mb))
        loads.extend(int(plan.chunk_len[p].sum()) for p in mb)
    load = np.asarray(loads, dtype=np.int64)
    real, cap = int(load.sum()), int(load.size) * int(max_seq_len)
    full = np.asarray(mbs) == batch_size
    n_full_packs = int(np.asarray(mbs)[full].sum()) if mbs else 0
    real_full = int(load[:n_full_packs].sum())  # only the final microbatch can be partial
    padded_cap = len(mbs) * batch_size * int(max_seq_len)
    return PackFill(
        packs=int(load.size), microbatches=len(mbs), chunks=plan.num_chunks,
        skipped_documents=int(np.count_nonzero(lengths < 2)), real_tokens=real, capacity=cap,
        fill=real / cap if cap else 0.0,
        fill_full_microbatches=real_full / (n_full_packs * max_seq_len) if n_full_packs else 0.0,
        fill_padded_last=real / padded_cap if padded_cap else 0.0,
        pack_fill=load / float(max_seq_len),
    )


def default_packing_buffer(mode: str, packing_buffer: int | None) -> int:
    if packing_buffer is not None:
        return int(packing_buffer)
    return 64 if mode == "buffer" else DEFAULT_BFD_BUFFER


def _rng_seed(seed: int, epoch: int, consumer: Consumer) -> list[int]:
    return [int(seed), int(epoch), consumer.index, consumer.count, 0x9ACC]


# --------------------------------------------------------------------------------------------
# 3. The dataset: plan + token reads -> VarlenBatch
# --------------------------------------------------------------------------------------------
class BestFitDataset(IterableDataset):
    """Padding-free microbatches of whole documents (or chunks of long ones), best-fit packed.

    What to iterate:
        corpus: a :class:`~h5corpus.reader.Corpus` (or a manifest path, opened with ``split``).
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
            Consumers (rank x DataLoader worker, :mod:`h5corpus.partition`) read disjoint
            documents of the epoch's order whose union is the epoch; their microbatch counts
            can differ by one or more, so stop a DDP epoch at the shortest rank.
        with_segments: also yield an (S, 3) int64 tensor of ``(document index, start, length)``
            per segment (start = offset of its first input in the document, in tokens).

    Use with ``torch.utils.data.DataLoader`` or torchdata's ``StatefulDataLoader`` with
    ``batch_size=None``. ``state_dict()`` / ``load_state_dict()`` (torchdata's Stateful protocol)
    capture the epoch, this consumer's document order, the chunk cursor, the candidate buffer,
    BFD's pending packs and the RNG state (plain Python and int64 tensors: a checkpoint holding it
    loads with ``torch.load(..., weights_only=True)``); a restored dataset yields the identical
    next batch.
    Call :meth:`set_epoch` before each epoch.
    """

    def __init__(self, corpus: Any, max_seq_len: int = 4096, batch_size: int = 35, packing_buffer: int | None = None,
                 seed: int = 0, mode: str = "buffer", *, split: str = "train", shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None, epoch: int = 0,
                 with_segments: bool = False) -> None:
        super().__init__()
        if not hasattr(corpus, "doc_offsets"):
            from .reader import open_corpus

            corpus = open_corpus(corpus, split)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_seq_len < 1 or batch_size < 1:
            raise ValueError(f"max_seq_len ({max_seq_len}) and batch_size ({batch_size}) must be >= 1")
        self.corpus = corpus
        self.max_seq_len = int(max_seq_len)
        self.batch_size = int(batch_size)
        self.packing_buffer = default_packing_buffer(mode, packing_buffer)
        if self.packing_buffer < 1:
            raise ValueError(f"packing_buffer must be >= 1 chunk, got {self.packing_buffer}")
        self.seed = int(seed)
        self.mode = mode
        self.shuffle = bool(shuffle)
        self.rank, self.world_size = rank, world_size
        self.epoch = int(epoch)
        self.with_segments = bool(with_segments)
        self._fingerprint: str | None = None
        self._live: dict[str, Any] | None = None  # the iteration in progress (plan, counters)
        self._resume: dict[str, Any] | None = None  # a loaded state the next __iter__ continues

    # -- configuration --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` plays (order = f(seed, epoch))."""
        self.epoch = int(epoch)

    def _config(self) -> dict[str, Any]:
        return {"max_seq_len": self.max_seq_len, "batch_size": self.batch_size, "packing_buffer": self.packing_buffer,
                "seed": self.seed, "mode": self.mode, "shuffle": self.shuffle}

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
    def __iter__(self) -> Iterator[Any]:
        consumer = current_consumer(self.rank, self.world_size)
        st, self._resume = self._resume, None
        lengths = self.corpus.doc_lengths
        if st is not None and st.get("started"):
            if tuple(st["consumer"]) != (consumer.index, consumer.count):
                raise ValueError(f"state belongs to consumer {tuple(st['consumer'])} (index, count) but this is "
                                 f"consumer ({consumer.index}, {consumer.count}): resume with the same world size "
                                 "and num_workers")
            epoch = int(st["epoch"])
            docs = np.asarray(st["order"], dtype=np.int64)
        else:
            epoch = int(st["epoch"]) if st is not None else self.epoch
            docs = consumer_documents(epoch_order(lengths.size, self.seed, epoch, self.shuffle), consumer)
        plan = _Plan(lengths, docs, max_seq_len=self.max_seq_len, batch_size=self.batch_size,
                     packing_buffer=self.packing_buffer, mode=self.mode, rng_seed=_rng_seed(self.seed, epoch, consumer))
        live = {"plan": plan, "epoch": epoch, "consumer": consumer, "batches": 0, "tokens": 0}
        if st is not None and st.get("started"):
            plan.restore(st["plan"])
            live["batches"], live["tokens"] = int(st["batches_yielded"]), int(st["tokens_yielded"])
        self._live = live
        return self._run(live)

    def _run(self, live: dict[str, Any]) -> Iterator[Any]:
        plan: _Plan = live["plan"]
        while True:
            mb = plan.next_microbatch()
            if not mb:
                return
            out = self._read(plan, mb)
            live["batches"] += 1
            live["tokens"] += (out[0] if self.with_segments else out).num_tokens
            yield out

    def _read(self, plan: _Plan, mb: list[list[int]]) -> Any:
        """Tokens of one microbatch's segments -> compact VarlenBatch.

        Each segment is one row of the batch's row storage: its ``n`` inputs plus the one-token
        lookahead, ``n + 1`` consecutive tokens of its document, copied by one
        :meth:`Corpus.gather_ranges` call straight into the batch (the corpus's own width, no
        int64 copies). ``row_cu`` = ``cu_seqlens`` = cumulative inputs per segment, ``pack_lengths``
        per pack, nothing ignored (a chunk's lookahead is still inside its document). The int64
        fields materialize lazily where the batch is used (:class:`~h5corpus.batch.VarlenBatch`).
        """
        corpus = self.corpus
        seg = np.fromiter(chain.from_iterable(mb), dtype=np.int64)
        per_pack = np.fromiter(map(len, mb), dtype=np.int64, count=len(mb))
        doc, start, n = plan.chunk_doc[seg], plan.chunk_start[seg], plan.chunk_len[seg]
        T = int(n.sum())
        if T >= 2**31:
            raise ValueError(f"microbatch of {T:,} tokens is too large for int32 cu_seqlens")
        parts = alloc_compact(seg.size, T, corpus.dtype, packs=len(mb))
        corpus.gather_ranges(corpus.doc_offsets[doc] + start, n + 1, out=parts.tokens)
        parts.row_cu[0] = 0
        np.cumsum(n, out=parts.row_cu[1:])
        parts.pack_lengths[:] = np.add.reduceat(n, np.cumsum(per_pack) - per_pack)
        batch = parts.batch(int(n.max()))
        if self.with_segments:
            return batch, torch.from_numpy(np.stack([doc, start, n], axis=1))
        return batch

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
        plan: _Plan = live["plan"]
        return {**base, "started": True, "epoch": live["epoch"], "consumer": (c.index, c.count), "order": torch.from_numpy(plan.docs.copy()),
                "plan": plan.state(), "batches_yielded": live["batches"], "tokens_yielded": live["tokens"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``iter()`` continues where it was taken.
        Raises ValueError if the corpus, the config or the plan version differ."""
        if int(state.get("plan_version", -1)) != PLAN_VERSION:
            raise ValueError(f"state has plan_version {state.get('plan_version')!r}, this h5corpus plans version {PLAN_VERSION}")
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError("state was taken on a different corpus split (fingerprint "
                             f"{str(state.get('fingerprint'))[:12]} != {self.fingerprint[:12]})")
        if state.get("config") != self._config():
            raise ValueError(f"state was taken with config {state.get('config')}, this dataset has {self._config()}")
        self._resume = dict(state)
        self._live = None
        self.epoch = int(state["epoch"])

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_live"] = None  # an iteration never travels into a worker; its state does, via load_state_dict
        return d

    # -- counts ---------------------------------------------------------------------------------
    @property
    def skipped_documents(self) -> int:
        """Documents of the split with fewer than 2 tokens (no next-token pair; never yielded)."""
        return int(np.count_nonzero(self.corpus.doc_lengths < 2))

    def __repr__(self) -> str:
        return (f"BestFitDataset(mode={self.mode!r}, max_seq_len={self.max_seq_len}, batch_size={self.batch_size}, "
                f"packing_buffer={self.packing_buffer}, seed={self.seed}, epoch={self.epoch}, corpus={self.corpus!r})")
