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
     from the stream before every pick) until none fits. The buffer is a sorted list of integer
     keys: a pick is one C bisection, and many packs run in one tight loop.
   * ``mode="bfd"``: best-fit-decreasing over blocks of ``packing_buffer`` chunks (the algorithm of
     "Fewer Truncations Improve Language Modeling", Ding et al. 2024; OLMo-core's segment-tree
     packer is the reference point): chunks longest first, each into the open pack with the
     smallest remaining space that still fits it, else into a new pack. The bin choice is one C
     ``memchr`` over a byte map of remaining capacities (at most ``L`` bytes), so blocks of
     10^4-10^5 chunks cost the same per chunk. Each block's packs are shuffled with the seeded RNG.
3. **Batches** (:class:`BestFitDataset`). Plans a group of microbatches at once (flat numpy arrays,
   one numpy call per quantity per group) and builds each microbatch's compact
   :class:`~h5corpus.batch.VarlenBatch` of real tokens only: ``cu_seqlens`` over every segment,
   positions restarting per segment, ``pack_lengths`` per pack, each segment's inputs plus its
   lookahead token copied from the memory-mapped shards by one ``bytearray.join`` of byte views
   (:meth:`Corpus.gather_ranges` when a shard is read through HDF5). Unused capacity is never
   materialized.

Units: every length and capacity is in tokens; a chunk's length is its number of *inputs* (= its
number of next-token pairs).
"""

from __future__ import annotations

import hashlib
import os
from bisect import bisect_right, insort
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from operator import getitem
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset

from .batch import _SLOT, _STORAGE, VarlenBatch, alloc_compact
from .batch import _layout as _batch_layout
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
        out.append(
            Chunk(
                inputs=a[s : s + n],
                targets=a[s + 1 : s + n + 1],
                position_ids=np.arange(n, dtype=np.int64),
                start=s,
                doc=doc,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# 2. Packing (pure functions over lengths)
# --------------------------------------------------------------------------------------------
def _check_lengths(lengths: np.ndarray, capacity: int) -> np.ndarray:
    a = np.asarray(lengths, dtype=np.int64)
    if a.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {a.shape}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 token, got {capacity}")
    if a.size and (a.min() < 1 or a.max() > capacity):
        bad = int(np.flatnonzero((a < 1) | (a > capacity))[0])
        raise ValueError(
            f"chunk {bad:,} has {int(a[bad]):,} tokens; every chunk must hold 1..{capacity:,} "
            "(split documents with chunk_layout first)"
        )
    return a


def _split(flat: Sequence[int], ends: Sequence[int]) -> list[list[int]]:
    starts = [0, *ends[:-1]]
    return [list(flat[a:b]) for a, b in zip(starts, ends)]


#: A packer key is ``length << A | (2**A - 1 - (index - base))`` (see :class:`BufferPacker`);
#: a *mark* ``(offset, base, A)`` says which encoding the keys from ``offset`` on use.
Mark = tuple[int, int, int]


def _decode(keys: np.ndarray, marks: Sequence[Mark]) -> tuple[np.ndarray, np.ndarray]:
    """(stream indices, lengths) of int64 packer keys, piecewise per encoding mark."""
    idx, lens = np.empty_like(keys), np.empty_like(keys)
    for j, (lo, base, A) in enumerate(marks):
        hi = marks[j + 1][0] if j + 1 < len(marks) else keys.size
        k, M = keys[lo:hi], (1 << A) - 1
        np.subtract(base + M, k & M, out=idx[lo:hi])
        np.right_shift(k, A, out=lens[lo:hi])
    return idx, lens


class BufferPacker:
    """Best fit from a bounded candidate buffer (``mode="buffer"``).

    ``lengths[i]`` is the length of chunk ``i`` of the stream (stream order = arrival order).
    Before every pick the buffer is topped up to ``buffer_size`` chunks from the stream; a pack
    takes the longest buffered chunk that fits its remaining space (the oldest among equal
    lengths) until none fits. Pure: no I/O, deterministic. Between packs its whole state is
    ``cursor`` (next stream chunk) and ``buffer`` (stream indices of waiting chunks), which the
    constructor accepts to resume.

    The buffer is a sorted list of integer keys ``length << A | (2**A - 1 - (index - base))``, so
    "the longest that fits, oldest among equals" is the largest key ``<= room << A | (2**A - 1)``:
    one C bisection, and a pick plus the arrival that replaces it are two C memmoves of at most
    ``buffer_size`` pointers (:meth:`packs` runs many packs in one tight loop, ~0.3 us per chunk
    on the development machine). Keys are made ``_BLOCK`` stream chunks at a time (bounded
    memory on any stream). They fit 30 bits (one CPython digit: the bisections' comparisons are
    cheapest) with ``A = 30 - capacity.bit_length()`` age bits while every buffered chunk is less
    than ``2**A`` stream positions older than the newest: ``base`` moves up at each block (the
    buffered keys shift by a constant, order kept). Otherwise (a chunk waiting that long, or a
    capacity of 2**17 tokens or more) the packer uses 32 age bits from then on. Fast up to ~10^4
    candidates; for larger pools use best-fit-decreasing (:func:`bfd_packs`).
    """

    _BLOCK = 2048

    def __init__(
        self, lengths: np.ndarray, capacity: int, buffer_size: int, *, cursor: int = 0, buffer: Sequence[int] = ()
    ) -> None:
        if buffer_size < 1:
            raise ValueError(f"packing_buffer must be >= 1 chunk, got {buffer_size}")
        self.lengths = _check_lengths(lengths, capacity)
        n = self.lengths.size
        if n >= 1 << 32:
            raise ValueError(f"at most {(1 << 32) - 1:,} chunks per stream, got {n:,}")
        self.capacity = int(capacity)
        self.buffer_size = int(buffer_size)
        if not 0 <= cursor <= n:
            raise ValueError(f"cursor {cursor} outside [0, {n}]")
        buf = np.asarray(list(buffer), dtype=np.int64).reshape(-1)
        if buf.size and (buf.min() < 0 or buf.max() >= cursor):
            bad = int(buf[(buf < 0) | (buf >= cursor)][0])
            raise ValueError(f"buffered chunk {bad} was never admitted (cursor {cursor})")
        A = 30 - self.capacity.bit_length()
        if (1 << A) < 4 * self._BLOCK:
            A = 32
        self._A, self._base = A, int(buf.min()) if buf.size else int(cursor)
        if buf.size and int(cursor) - self._base > (1 << A) - 4 * self._BLOCK:
            self._A, self._base = 32, 0
        self._keys: list[int] = sorted(self._encode(buf).tolist())
        # arrivals: an iterator over the keys of stream chunks [cursor, _end); None once the stream is used up
        self._end = int(cursor)
        self._it: Iterator[int] | None = iter(())
        #: the last pack ended exactly full and a chunk was admitted after its last pick, which the
        #: algorithm as stated does only before the next pick (reported state excludes it)
        self._tight = False

    def _encode(self, idx: np.ndarray) -> np.ndarray:
        A = self._A
        return (self.lengths[idx] << A) | ((1 << A) - 1 - (idx - self._base))

    @property
    def mark(self) -> Mark:
        """The current key encoding, as a mark at offset 0."""
        return (0, self._base, self._A)

    def _admitted(self) -> int:
        if self._it is None:
            return int(self.lengths.size)
        return self._end - self._it.__length_hint__()  # type: ignore[attr-defined]

    @property
    def cursor(self) -> int:
        """Next stream chunk to enter the buffer."""
        return self._admitted() - self._tight

    @property
    def buffer(self) -> list[int]:
        """Stream indices of the waiting chunks, in arrival order."""
        return _buffer_of(self._admitted(), self._keys, self._tight, self.mark)

    @property
    def exhausted(self) -> bool:
        return not self._keys and self.cursor >= self.lengths.size

    def _next_block(self, at: int, marks: list[Mark]) -> Any:
        """``__next__`` of the following block of stream keys, or None at the stream's end.
        Moves ``base`` up to the oldest waiting chunk first (shifting the buffered keys; a mark
        at offset ``at`` records the new encoding), or switches to 32 age bits."""
        lo = self._end
        hi = min(lo + self._BLOCK, int(self.lengths.size))
        if lo >= hi:
            self._it = None
            return None
        keys, A, M = self._keys, self._A, (1 << self._A) - 1
        if A < 32:
            oldest = self._base + M - max(k & M for k in keys) if keys else lo
            if hi - 1 - oldest <= M:
                keys[:] = [k + (oldest - self._base) for k in keys]  # same shift: order kept
                self._base = oldest
            else:  # a chunk has waited 2**A arrivals: wide keys from now on
                idx = np.asarray([self._base + M - (k & M) for k in keys], dtype=np.int64)
                self._A, self._base = 32, 0
                keys[:] = sorted(self._encode(idx).tolist())
            marks.append((at, self._base, self._A))
        self._it = it = iter(self._encode(np.arange(lo, hi, dtype=np.int64)).tolist())
        self._end = hi
        return it.__next__

    def _pack_keys(self, count: int, out: list[int], ends: list[int], marks: list[Mark]) -> None:
        """Append the keys of the next ``count`` packs' chunks (fewer at the stream's end) to
        ``out`` in pick order, each pack's end offset in ``out`` to ``ends``, and a mark to
        ``marks`` wherever the key encoding changes."""
        keys = self._keys
        if count < 1:
            return
        bis, ins, pop, app, eapp = bisect_right, insort, keys.pop, out.append, ends.append
        B = self.buffer_size
        nxt = None if self._it is None else self._it.__next__
        while nxt is not None and len(keys) < B:  # top up (a new or restored packer)
            try:
                ins(keys, nxt())
            except StopIteration:
                nxt = self._next_block(len(out), marks)
        A, M = self._A, (1 << self._A) - 1
        H = ~M  # key & H == length << A
        full = q = (self.capacity << A) | M  # the largest key that fits the open pack
        npk = 0
        tight = self._tight
        it = self._it
        i = len(keys)  # the next pick's bisection (an empty pack: the longest chunk always fits)
        while it is not None and npk < count:
            for new in it:  # one pick per arrival: the arrival replaces the pick, the buffer stays full
                k = pop(i - 1)
                app(k)
                q -= k & H
                ins(keys, new)
                i = bis(keys, q)
                if not i:  # nothing fits the open pack: it is done
                    eapp(len(out))
                    npk += 1
                    tight = q == M
                    q = full
                    if npk == count:
                        break
                    i = len(keys)
            else:  # the block of arrivals ran out before a pick
                self._next_block(len(out), marks)
                it = self._it
                if self._A != A:  # re-encode the open pack's room
                    q = (q >> A) << self._A | ((1 << self._A) - 1)
                    A, M = self._A, (1 << self._A) - 1
                    H, full = ~M, (self.capacity << A) | M
                i = bis(keys, q)  # the same pick (shifted keys keep their order)
                continue
            break
        while npk < count:  # the stream is used up: drain the buffer
            i = bis(keys, q)
            if i:
                k = pop(i - 1)
                app(k)
                q -= k & H
                continue
            if q == full:  # nothing left (any chunk fits an empty pack)
                break
            eapp(len(out))
            npk += 1
            tight = False
            q = full
        self._tight = tight

    def packs(self, count: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The next ``count`` packs (fewer at the stream's end), flat: ``(indices, lengths,
        ends)`` = stream indices and lengths (int64) of their chunks in pick order and the end
        offset of each pack in them."""
        out: list[int] = []
        ends: list[int] = []
        marks = [self.mark]
        self._pack_keys(count, out, ends, marks)
        idx, lens = _decode(np.fromiter(out, dtype=np.int64, count=len(out)), marks)
        return idx, lens, ends

    def next_pack(self) -> list[int]:
        """Stream indices of the next pack's chunks in pick order (longest first); ``[]`` when
        the stream and the buffer are both empty."""
        return self.packs(1)[0].tolist()


def _buffer_of(admitted: int, keys: list[int], tight: bool, mark: Mark) -> list[int]:
    """Stream indices in a packer's buffer keys, ascending; ``tight``: leave out the newest
    (admitted right after the last pick of a pack that ended exactly full)."""
    _, base, A = mark
    M = (1 << A) - 1
    out = sorted(base + M - (k & M) for k in keys)
    if tight and out and out[-1] == admitted - 1:
        out.pop()
    return out


def best_fit_packs(lengths: np.ndarray, capacity: int, packing_buffer: int = 64) -> list[list[int]]:
    """All packs of :class:`BufferPacker` over ``lengths`` (indices into ``lengths``).

    >>> best_fit_packs([6, 4, 3, 2], capacity=8)
    [[0, 3], [1, 2]]
    """
    p = BufferPacker(np.asarray(lengths), capacity, packing_buffer)
    idx, _, ends = p.packs(len(p.lengths) + 1)
    return _split(idx.tolist(), ends)


def bfd_flat(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing, flat: ``(chunks, sizes)`` = indices into ``lengths`` of every pack's
    chunks, packs in opening order and chunks in placement order, and the number of chunks per
    pack (int64 arrays).

    Chunks are placed longest first (ties in index order), each into the open pack with the
    smallest remaining space that fits it, else into a new pack; among packs with equally small
    space, the one that reached that space last. Chunks longer than half the capacity each open
    their own pack (no two fit together), which is done vectorized. The rest find their pack
    through a byte map over remaining capacities (``map[r] = 1`` if some open pack has ``r``
    tokens of space left, a LIFO stack of packs per ``r``): the smallest fitting space is one C
    ``memchr`` from ``length`` (``bytearray.find``), at most ``capacity`` bytes, so the cost per
    chunk does not grow with the number of chunks or open packs.
    """
    a = _check_lengths(lengths, capacity)
    cap = int(capacity)
    order = np.argsort(-a, kind="stable")
    sl = a[order]
    nbig = int(np.count_nonzero(sl * 2 > cap))
    space = bytearray(cap + 1)
    stacks: list[list[int]] = [[] for _ in range(cap + 1)]  # packs per remaining space, LIFO
    for b, r in enumerate((cap - sl[:nbig]).tolist()):
        if r:
            stacks[r].append(b)
            space[r] = 1
    find = space.find
    placed: list[int] = []  # the pack of each remaining chunk, in placement order
    put = placed.append
    nb = nbig
    for n in sl[nbig:].tolist():
        r = find(1, n)
        if r < 0:
            b = nb
            nb += 1
            r = cap
        else:
            st = stacks[r]
            b = st.pop()
            if not st:
                space[r] = 0
        put(b)
        r -= n
        if r:
            stacks[r].append(b)
            space[r] = 1
    pack_of = np.concatenate([np.arange(nbig, dtype=np.int64), np.asarray(placed, dtype=np.int64)])
    by_pack = np.argsort(pack_of.astype(np.int32 if nb < 2**31 else np.int64), kind="stable")
    return order[by_pack], np.bincount(pack_of, minlength=nb).astype(np.int64)


def bfd_packs(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit-decreasing (:func:`bfd_flat`): indices into ``lengths`` grouped into packs of
    total ``<= capacity``, packs in opening order, chunks in placement order."""
    chunks, sizes = bfd_flat(lengths, capacity)
    return _split(chunks.tolist(), np.cumsum(sizes).tolist())


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


class _Microbatch(NamedTuple):
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


class _Group(NamedTuple):
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
    """(K,) the plan's state right after each microbatch (:meth:`_Plan.consume`)."""

    def microbatch(self, j: int) -> _Microbatch:
        p0, p1 = self.mb_packs[j], self.mb_packs[j + 1]
        a = int(self.pack_starts[p0])
        b = int(self.pack_starts[p1]) if p1 < self.pack_starts.size else self.chunks.size
        return _Microbatch(self.chunks[a:b], self.lengths[a:b], self.pack_starts[p0:p1] - a)


class _Plan:
    """Order -> chunks -> packs -> microbatches for one consumer; pure over document lengths.

    ``next_microbatch()`` returns a :class:`_Microbatch` of chunk indices into
    ``(chunk_doc, chunk_start, chunk_len)`` (``chunk_doc`` holds corpus document indices);
    ``next_group(k)`` plans ``k`` at once. The plan may run ahead of its consumer: :meth:`state`
    describes the position after the last microbatch passed to :meth:`consume` (which
    ``next_microbatch`` does itself).
    """

    def __init__(
        self,
        doc_lengths: np.ndarray,
        docs: np.ndarray,
        *,
        max_seq_len: int,
        batch_size: int,
        packing_buffer: int,
        mode: str,
        rng_seed: Sequence[int],
    ) -> None:
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
        #: BFD: packs made but not yet planned into microbatches, flat (chunk indices, chunks per
        #: pack); the next pack is ``_pend_sizes[_pend_pack]``, its first chunk ``_pend_chunks[_pend_at]``
        self._pend_chunks = np.zeros(0, np.int64)
        self._pend_sizes = np.zeros(0, np.int64)
        self._pend_pack = self._pend_at = 0
        #: BFD: next chunk not yet packed (buffer mode keeps its cursor in the packer)
        self.cursor = 0
        self._rng_state = self.rng.bit_generator.state
        self.packer = BufferPacker(self.chunk_len, max_seq_len, packing_buffer) if mode == "buffer" else None
        self._consumed = self._snapshot()
        #: how the dataset reads this plan's chunks (set by the iterating process)
        self.reads: _ChunkReads | None = None

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_len.size)

    def _snapshot(self) -> tuple:
        if self.packer is not None:
            return (self.packer._admitted(), list(self.packer._keys), self.packer._tight, self.packer.mark)
        return (self.cursor, self._pend_chunks, self._pend_sizes, self._pend_pack, self._pend_at, self._rng_state)

    def consume(self, snapshot: tuple) -> None:
        """Mark the microbatch whose snapshot this is as yielded (what :meth:`state` describes)."""
        self._consumed = snapshot

    def next_microbatch(self) -> _Microbatch | None:
        """Up to ``batch_size`` packs; None once the consumer's epoch is used up. Only the last
        microbatch of an epoch may hold fewer than ``batch_size`` packs."""
        g = self.next_group(1)
        if g is None:
            return None
        self.consume(g.snapshots[0])
        return g.microbatch(0)

    def next_group(self, k: int) -> _Group | None:
        """The next ``k`` microbatches (fewer at the end of the epoch); None when none is left."""
        B = self.batch_size
        snaps: list[tuple] = []
        mb_packs = [0]
        if self.packer is not None:
            keys: list[int] = []
            ends: list[int] = []
            marks = [self.packer.mark]
            for _ in range(k):
                self.packer._pack_keys(B, keys, ends, marks)
                if len(ends) == mb_packs[-1]:
                    break
                mb_packs.append(len(ends))
                snaps.append(self._snapshot())
            if not ends:
                return None
            chunks, lens = _decode(np.fromiter(keys, dtype=np.int64, count=len(keys)), marks)
            starts = np.empty(len(ends), dtype=np.int64)
            starts[0] = 0
            starts[1:] = ends[:-1]
            return _Group(chunks, lens, starts, mb_packs, snaps)
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
        return _Group(chunks, self.chunk_len[chunks], starts, mb_packs, snaps)

    def _pack_block(self) -> None:
        """BFD over the next ``packing_buffer`` chunks; its packs, shuffled, join the pending ones."""
        stop = min(self.cursor + self.packing_buffer, self.num_chunks)
        chunks, sizes = bfd_flat(self.chunk_len[self.cursor : stop], self.max_seq_len)
        perm = self.rng.permutation(sizes.size)
        self._rng_state = self.rng.bit_generator.state
        rank = np.empty_like(perm)
        rank[perm] = np.arange(perm.size)
        pack_of = np.repeat(rank, sizes)  # position of each chunk's pack in the shuffled order
        chunks = chunks[np.argsort(pack_of, kind="stable")] + self.cursor
        self._pend_chunks = np.concatenate([self._pend_chunks[self._pend_at :], chunks])
        self._pend_sizes = np.concatenate([self._pend_sizes[self._pend_pack :], sizes[perm]])
        self._pend_pack = self._pend_at = 0
        self.cursor = stop

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The position after the last consumed microbatch: chunk cursor, candidate buffer
        (stream indices, ascending), pending packs (BFD) and the RNG state."""
        snap = self._consumed
        if self.packer is not None:
            admitted, keys, tight, mark = snap
            cursor, buffer = admitted - tight, np.asarray(_buffer_of(admitted, keys, tight, mark), dtype=np.int64)
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
        cursor = int(st["cursor"])
        if not 0 <= cursor <= self.num_chunks:
            raise ValueError(f"state cursor {cursor} outside [0, {self.num_chunks}] chunks")
        if self.packer is not None:
            self.packer = BufferPacker(
                self.chunk_len,
                self.max_seq_len,
                self.packing_buffer,
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
    """Simulate one epoch of :class:`BestFitDataset` (one consumer) over document lengths.

    ``lengths`` are tokens per document, EOS included (``Corpus.doc_lengths``). The plan is the
    dataset's own (same order, chunking and packer), so the packs are exactly those the dataset
    would yield with ``num_workers=0`` and ``world_size=1``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    buf = default_packing_buffer(mode, packing_buffer)
    order = epoch_order(lengths.size, seed, epoch, shuffle)
    plan = _Plan(
        lengths,
        order,
        max_seq_len=max_seq_len,
        batch_size=batch_size,
        packing_buffer=buf,
        mode=mode,
        rng_seed=_rng_seed(seed, epoch, Consumer(0, 1, 0, 1)),
    )
    loads: list[np.ndarray] = []
    mbs: list[int] = []
    while (mb := plan.next_microbatch()) is not None:
        mbs.append(mb.pack_starts.size)
        loads.append(mb.pack_lengths)
    load = np.concatenate(loads) if loads else np.zeros(0, np.int64)
    real, cap = int(load.sum()), int(load.size) * int(max_seq_len)
    full = np.asarray(mbs) == batch_size
    n_full_packs = int(np.asarray(mbs)[full].sum()) if mbs else 0
    real_full = int(load[:n_full_packs].sum())  # only the final microbatch can be partial
    padded_cap = len(mbs) * batch_size * int(max_seq_len)
    return PackFill(
        packs=int(load.size),
        microbatches=len(mbs),
        chunks=plan.num_chunks,
        skipped_documents=int(np.count_nonzero(lengths < 2)),
        real_tokens=real,
        capacity=cap,
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


class _MappedRuns(NamedTuple):
    """A fully memory-mapped split's run table (:class:`~h5corpus.reader.RunTable`) with a byte
    view of each run, for :class:`_ChunkReads`."""

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


_ZEROS = bytes(16)  # padding: every gap in a compact layout is < 8 bytes, row_cu[0] at offset 0


class _ChunkReads:
    """Token reads of one plan's chunks into compact batches: chunk ``i`` is ``chunk_len[i] + 1``
    consecutive tokens of its document (its inputs plus the lookahead).

    Memory-mapped corpus (``table`` given): a microbatch's batch buffer is built by one
    ``bytearray.join`` (a C loop of memcpys) of its header (``row_cu``, ``pack_lengths``, laid out
    as :func:`~h5corpus.batch.alloc_compact` lays them out) and one byte view per segment, and
    wrapped without a copy. Otherwise (a shard read through HDF5) the batch is allocated with
    :func:`~h5corpus.batch.alloc_compact` and filled by one :meth:`Corpus.gather_ranges` call."""

    def __init__(self, corpus: Any, plan: _Plan, table: _MappedRuns | None) -> None:
        self.corpus, self.plan, self.table = corpus, plan, table
        self.dtype = np.dtype(corpus.dtype)
        self.storage = _STORAGE[self.dtype][0]

    def _starts(self, chunks: np.ndarray) -> np.ndarray:
        """Global token position of each chunk's first input."""
        plan = self.plan
        return np.asarray(self.corpus.doc_offsets, dtype=np.int64)[plan.chunk_doc[chunks]] + plan.chunk_start[chunks]

    def prepare(self, g: _Group) -> list[_Prepared]:
        """Per-microbatch inputs of :meth:`batch` for a whole group, with one numpy call per
        quantity for the group instead of one per microbatch."""
        S, K = g.chunks.size, len(g.mb_packs) - 1
        seg = np.empty(K + 1, dtype=np.int64)  # each microbatch's first segment
        seg[:K] = g.pack_starts[g.mb_packs[:-1]]
        seg[K] = S
        cum = np.cumsum(g.lengths)
        before = np.zeros(K + 1, dtype=np.int64)  # inputs before each microbatch
        before[1:] = cum[seg[1:] - 1]
        row_cu = (cum - np.repeat(before[:-1], np.diff(seg))).astype(np.int32)
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
            # slice of its first run is replaced in the batch's parts: see :meth:`batch`).
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
                    row_cu[a:b],
                    pack_len[g.mb_packs[j] : g.mb_packs[j + 1]],
                    tokens[j],
                    longest[j],
                    ranges,
                )
            )
        return out

    def batch(self, mb: _Prepared) -> VarlenBatch:
        """The compact batch of one prepared microbatch."""
        S, P, T = mb.lengths.size, mb.pack_lengths.size, mb.num_tokens
        if mb.ranges is None:
            parts = alloc_compact(S, T, self.dtype, packs=P)
            parts.row_cu[0] = 0
            parts.row_cu[1:] = mb.row_cu
            parts.pack_lengths[:] = mb.pack_lengths
            self.corpus.gather_ranges(self._starts(mb.chunks), mb.lengths + 1, out=parts.tokens)
            return parts.batch(mb.max_seqlen)
        layout, nbytes = _batch_layout(S, T + S, self.storage, None, P, 0)
        rc, pk, tk = layout[_SLOT["row_cu"]][2], layout[_SLOT["pack_lengths"]][2], layout[_SLOT["tokens"]][2]
        z = _ZEROS  # the header: row_cu = [0, *mb.row_cu], pack_lengths, zero padding between
        head = (z[: rc + 4], mb.row_cu, z[: pk - rc - 4 - 4 * S], mb.pack_lengths, z[: tk - pk - 4 * P])
        tail = z[: nbytes - tk - (T + S) * self.dtype.itemsize]
        run, lo, hi, patch = mb.ranges
        views = self.table.views  # type: ignore[union-attr]
        parts = [*head, *map(getitem, map(views.__getitem__, run), map(slice, lo, hi)), tail]
        if patch is not None:  # segments that leave their first run: read through the corpus
            tokens, w = self.corpus.tokens, self.dtype.itemsize
            for k, g in patch:
                parts[k + len(head)] = tokens(g, g + (hi[k] - lo[k]) // w)
        data = bytearray().join(parts)
        return VarlenBatch._compact(torch.frombuffer(data, dtype=torch.uint8), layout, T, S, mb.max_seqlen, 0, True)


class _Prepared(NamedTuple):
    """One microbatch of a group, with what :meth:`_ChunkReads.batch` needs."""

    chunks: np.ndarray
    """(S,) int64 chunk indices."""
    lengths: np.ndarray
    """(S,) int64 inputs per segment."""
    row_cu: np.ndarray
    """(S,) int32 cumulative inputs after each segment (``cu_seqlens[1:]``)."""
    pack_lengths: np.ndarray
    """(P,) int32 real inputs per pack."""
    num_tokens: int
    max_seqlen: int
    ranges: tuple[list[int], list[int], list[int], list[tuple[int, int]] | None] | None
    """Memory-mapped corpus: run, first byte and end byte of every segment in its run's view,
    then ``(segment, global start token)`` of the segments that leave their first run (read
    through the corpus instead), or None."""


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
        self._cache: dict[str, Any] = {}  # this process's epoch order and mapped runs (never pickled)

    # -- configuration --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` plays (order = f(seed, epoch))."""
        self.epoch = int(epoch)

    def _config(self) -> dict[str, Any]:
        return {
            "max_seq_len": self.max_seq_len,
            "batch_size": self.batch_size,
            "packing_buffer": self.packing_buffer,
            "seed": self.seed,
            "mode": self.mode,
            "shuffle": self.shuffle,
        }

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
        plan = _Plan(
            lengths,
            docs,
            max_seq_len=self.max_seq_len,
            batch_size=self.batch_size,
            packing_buffer=self.packing_buffer,
            mode=self.mode,
            rng_seed=_rng_seed(self.seed, epoch, consumer),
        )
        plan.reads = _ChunkReads(self.corpus, plan, self._table())
        live = {"plan": plan, "epoch": epoch, "consumer": consumer, "batches": 0, "tokens": 0}
        if st is not None and st.get("started"):
            plan.restore(st["plan"])
            live["batches"], live["tokens"] = int(st["batches_yielded"]), int(st["tokens_yielded"])
        self._live = live
        return self._run(live)

    #: Microbatches planned and prepared together (numpy work per group, not per microbatch)
    GROUP = 8

    def _run(self, live: dict[str, Any]) -> Iterator[Any]:
        plan: _Plan = live["plan"]
        reads: _ChunkReads = plan.reads  # type: ignore[assignment]
        while True:
            g = plan.next_group(self.GROUP)
            if g is None:
                return
            for mb, snap in zip(reads.prepare(g), g.snapshots):
                out = self._read(plan, mb)
                plan.consume(snap)
                live["batches"] += 1
                live["tokens"] += mb.num_tokens
                yield out

    def _read(self, plan: _Plan, mb: _Prepared) -> Any:
        """Tokens of one microbatch's segments -> compact VarlenBatch.

        Each segment is one row of the batch's row storage: its ``n`` inputs plus the one-token
        lookahead, ``n + 1`` consecutive tokens of its document, copied straight into the batch
        (the corpus's own width, no int64 copies; :class:`_ChunkReads`). ``row_cu`` =
        ``cu_seqlens`` = cumulative inputs per segment, ``pack_lengths`` per pack, nothing ignored
        (a chunk's lookahead is still inside its document). The int64 fields materialize lazily
        where the batch is used (:class:`~h5corpus.batch.VarlenBatch`).
        """
        if mb.num_tokens >= 2**31:
            raise ValueError(f"microbatch of {mb.num_tokens:,} tokens is too large for int32 cu_seqlens")
        batch = plan.reads.batch(mb)  # type: ignore[union-attr]
        if self.with_segments:
            return batch, torch.from_numpy(
                np.stack([plan.chunk_doc[mb.chunks], plan.chunk_start[mb.chunks], mb.lengths], axis=1)
            )
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
        plan: _Plan = live["plan"]
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
