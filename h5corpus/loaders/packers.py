"""Packers: pure functions over chunk lengths (no I/O) that group chunks into packs.

A *pack* is a logical row of capacity ``capacity`` tokens holding whole chunks (their lengths sum
to at most the capacity; no chunk is ever cut to fill space). Every function here sees only
lengths, is deterministic, and returns indices into the lengths it was given.

* Buffer best fit (:class:`BufferPacker`, :func:`best_fit_packs`): chunks arrive in stream order
  and wait in a bounded candidate buffer; each pack repeatedly takes the longest buffered chunk
  that fits its remaining space (oldest first among equal lengths; the buffer is topped up from
  the stream before every pick) until none fits.
* Best-fit-decreasing (:func:`bfd_flat`, :func:`bfd_packs`, :func:`shuffled_bfd_block`): the
  algorithm of "Fewer Truncations Improve Language Modeling" (Ding et al. 2024; OLMo-core's
  segment-tree packer is the reference point): chunks longest first, each into the open pack with
  the smallest remaining space that still fits it, else into a new pack.

Units: lengths and capacities are in tokens (a chunk's length is its number of inputs).
docs/PACKING.md has the measured speeds.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np


def _check_lengths(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """``lengths`` as a 1-D integer array (int32 and int64 kept as they are, without a copy; others
    become int64), every entry in ``[1, capacity]``; else ValueError naming the chunk."""
    a = np.asarray(lengths)
    if a.dtype not in (np.int32, np.int64):
        a = a.astype(np.int64)
    if a.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {a.shape}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 token, got {capacity}")
    if a.size and (a.min() < 1 or a.max() > capacity):
        bad = int(np.flatnonzero((a < 1) | (a > capacity))[0])
        raise ValueError(
            f"chunk {bad:,} has {int(a[bad]):,} tokens; every chunk must hold 1..{capacity:,} "
            "(split documents with document_chunks first)"
        )
    return a


def _split(flat: Sequence[int], ends: Sequence[int]) -> list[list[int]]:
    """``flat`` cut into lists at the end offsets ``ends``."""
    starts = [0, *ends[:-1]]
    return [list(flat[a:b]) for a, b in zip(starts, ends)]


#: A packer key is ``length << A | (2**A - 1 - (index - base))`` (see :class:`BufferPacker`);
#: a *mark* ``(offset, base, A)`` says which encoding the keys from ``offset`` on use.
Mark = tuple[int, int, int]


def decode_keys(keys: np.ndarray, marks: Sequence[Mark]) -> tuple[np.ndarray, np.ndarray]:
    """(stream indices, lengths), int64, of the int64 keys :meth:`BufferPacker.append_packs`
    produced, decoded piecewise: ``marks[j]`` gives the encoding of ``keys[marks[j][0]:]`` up to
    the next mark (the first mark is at offset 0)."""
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
    ``buffer_size`` pointers (:meth:`packs` and :meth:`append_packs` run many packs in one tight
    loop). Keys are made ``_BLOCK`` stream chunks at a time (bounded memory on any stream). They
    fit 30 bits (one CPython digit: the bisections' comparisons are cheapest) with
    ``A = 30 - capacity.bit_length()`` age bits while every buffered chunk is less than ``2**A``
    stream positions older than the newest: ``base`` moves up at each block (the buffered keys
    shift by a constant, order kept). Otherwise (a chunk waiting that long, or a capacity of
    2**17 tokens or more) the packer uses 32 age bits from then on; :attr:`mark` tells which.
    The memmoves grow with the buffer: for pools of many thousands of candidates use
    best-fit-decreasing (:func:`bfd_packs`).
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
        return (self.lengths[idx].astype(np.int64) << A) | ((1 << A) - 1 - (idx - self._base))

    @property
    def mark(self) -> Mark:
        """The current key encoding, as a mark at offset 0: ``(0, base, age bits)``."""
        return (0, self._base, self._A)

    def snapshot(self) -> BufferSnapshot:
        """The packer's position now (between packs), cheap enough to take after every
        microbatch; its :attr:`~BufferSnapshot.cursor` and :attr:`~BufferSnapshot.buffer` are what
        the constructor takes to resume there."""
        return BufferSnapshot(self._admitted(), list(self._keys), self._tight, self.mark)

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

    def _top_up(self, out: list[int], marks: list[Mark]) -> None:
        """Fill the buffer to ``buffer_size`` keys from the stream (a new or restored packer)."""
        keys, nxt = self._keys, None if self._it is None else self._it.__next__
        while nxt is not None and len(keys) < self.buffer_size:
            try:
                insort(keys, nxt())
            except StopIteration:
                nxt = self._next_block(len(out), marks)

    def append_packs(self, count: int, out: list[int], ends: list[int], marks: list[Mark]) -> None:
        """Append the keys of the next ``count`` packs' chunks (fewer at the stream's end) to
        ``out`` in pick order, each pack's end offset in ``out`` to ``ends``, and a mark to
        ``marks`` wherever the key encoding changes (start ``marks`` with :attr:`mark`; decode
        with :func:`decode_keys`). Keys, not indices, because many calls can share one decode."""
        keys = self._keys
        if count < 1:
            return
        bis, ins, pop, app, eapp = bisect_right, insort, keys.pop, out.append, ends.append
        self._top_up(out, marks)
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
        self.append_packs(count, out, ends, marks)
        idx, lens = decode_keys(np.fromiter(out, dtype=np.int64, count=len(out)), marks)
        return idx, lens, ends

    def next_pack(self) -> list[int]:
        """Stream indices of the next pack's chunks in pick order (longest first); ``[]`` when
        the stream and the buffer are both empty."""
        return self.packs(1)[0].tolist()


class BufferSnapshot(NamedTuple):
    """A :class:`BufferPacker`'s position between two packs (:meth:`BufferPacker.snapshot`)."""

    admitted: int
    """Stream chunks that entered the buffer so far."""
    keys: list[int]
    """The buffered chunks' keys, sorted (a copy)."""
    tight: bool
    """The last pack ended exactly full after one chunk more was admitted (see :attr:`cursor`)."""
    mark: Mark
    """The encoding of ``keys``."""

    @property
    def cursor(self) -> int:
        """Next stream chunk to enter the buffer."""
        return self.admitted - self.tight

    @property
    def buffer(self) -> list[int]:
        """Stream indices of the waiting chunks, ascending."""
        return _buffer_of(self.admitted, self.keys, self.tight, self.mark)


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


def shuffled_bfd_block(lengths: np.ndarray, capacity: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing over one block of chunks (:func:`bfd_flat`), its packs then put in the
    order of ``rng.permutation(number of packs)`` (position ``j`` holds BFD's pack ``perm[j]``;
    one draw from ``rng``). Returns ``(chunks, sizes)`` flat like :func:`bfd_flat`: indices into
    ``lengths``, pack after pack, and the chunks per pack."""
    chunks, sizes = bfd_flat(lengths, capacity)
    perm = rng.permutation(sizes.size)
    rank = np.empty_like(perm)
    rank[perm] = np.arange(perm.size)
    pack_of = np.repeat(rank, sizes)  # position of each chunk's pack in the shuffled order
    return chunks[np.argsort(pack_of, kind="stable")], sizes[perm]
