"""Per-process read paths of one shard's ``/tokens`` (docs/READING.md).

* :class:`MmapTokens`: a finished shard whose chunks are stored raw, through a read-only memory map
  of the file at the chunk byte offsets HDF5 reports (:func:`~h5corpus.storage.format.chunk_byte_layout`).
  A range inside one run of file-contiguous chunks is one copy from the page cache, no HDF5 call. A
  version 2 shard's compressed final chunk is decoded into memory the first time it is touched.
* :class:`H5Tokens`: compressed shards and shards still being written, through one low-level
  ``H5Dread`` per range (SWMR, so ``.partial`` files work).

Verified reads (version 2 shards): both check each chunk against its ``/chunk_xxh3`` checksum the
first time this process touches it (``ready``), before any of its tokens is served, and raise
:class:`~h5corpus.storage.format.ChunkChecksumError` naming the shard and the chunk otherwise.

:class:`RunTable` lays every memory-mapped run of a split end to end in global token positions (and
verifies chunks as ranges are located in it). None of these objects is ever pickled: a
:class:`~h5corpus.storage.reader.Corpus` opens them lazily in the process that reads.
"""

from __future__ import annotations

import bisect
import mmap
import os
import weakref
from array import array
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from . import format as fmt
from .format import PARTIAL_SUFFIX, ChunkChecksumError, FormatError

ReadPath = Literal["auto", "mmap", "h5py"]
READ_PATHS = ("auto", "mmap", "h5py")

if TYPE_CHECKING:
    import h5py

#: Chunks the HDF5 chunk cache holds per compressed ``/tokens`` dataset (per process).
FILTERED_CACHE_CHUNKS = 8

#: How many forks led to this process: a reader compares it with the count it saw when it opened
#: its handles, instead of calling ``os.getpid()`` (a system call, ~0.4 us) on every read.
FORKS = [0]


def _count_fork() -> None:
    FORKS[0] += 1


os.register_at_fork(after_in_child=_count_fork)


def h5open(path: str | os.PathLike[str], *, live: bool = False) -> h5py.File:
    """Open a shard read-only: in SWMR mode when it is still being written (``live``), else
    plainly, so that HDF5 checks the file's end against its superblock (a truncated shard fails
    here, at once, instead of reading as zeros or looping in SWMR's metadata retries). HDF5 refuses
    a second open with other SWMR flags in one process: a shard already open the other way in
    this process is then opened that way."""
    import h5py  # here, not at import: a memory-mapped read through the layout file never needs it

    try:
        return h5py.File(path, "r", libver=fmt.LIBVER, swmr=live)
    except OSError as e:
        if "SWMR read access flag not the same" not in str(e) or str(path).endswith(PARTIAL_SUFFIX):
            raise
        return h5py.File(path, "r", libver=fmt.LIBVER, swmr=not live)


def check_id_range(view: np.ndarray, vocab_size: int | None, path: str, k: int, lo: int, hi: int) -> None:
    """Refuse chunk ``k`` (tokens ``[lo, hi)`` of the shard, in ``view``) if it holds an id at or
    above ``vocab_size``: a max over the chunk, far cheaper than its checksum."""
    if vocab_size is None or view.size == 0 or vocab_size > np.iinfo(view.dtype).max:
        return
    top = int(view.max())
    if top >= vocab_size:
        raise ChunkChecksumError(path, k, lo, hi, f"holds token id {top:,} >= vocab_size {vocab_size:,}")


def read_checksums(ds: h5py.Dataset) -> np.ndarray:
    """(chunks,) uint64: a version 2 shard's open ``/chunk_xxh3`` dataset, read by one low-level
    ``H5Dread`` (every process pays this once per shard it verifies; h5py's ``ds[()]`` costs
    several times more for these few bytes, docs/READING.md "Verified reads")."""
    import h5py

    sums = np.empty(ds.shape, dtype=fmt.CHECKSUM_DTYPE)
    ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, sums)
    return sums


# -- per-process read paths for one shard's /tokens ----------------------------------------------


class MmapTokens:
    """The chunks of a finished shard stored raw, read through a read-only memory map.

    The writer appends chunks in order, so most chunks sit right after their predecessor in the
    file. Runs of such chunks are exposed as one array (:attr:`runs`), and a range is one copy
    unless it crosses from one run into the next (where HDF5 put an index block between chunks). A
    final chunk stored compressed (``byte_offsets[-1] == -1``) is its own run, an array in memory
    filled from HDF5 when the chunk is first touched.

    ``checksums`` (version 2): each chunk is verified the first time it is touched; ``ready[k]``
    says chunk k may be served (verified, and decoded if it had to be), ``pending`` counts the
    chunks that are not yet."""

    kind = "mmap"
    #: file descriptors it holds (its memory map's)
    fds = 1

    def __init__(
        self,
        path: str,
        chunk_tokens: int,
        byte_offsets: np.ndarray,
        dtype: np.dtype,
        n_tokens: int,
        checksums: np.ndarray | None = None,
        vocab_size: int | None = None,
        tail: tuple[int, int] | None = None,
        *,
        tail_runs: list[tuple[int, int]] | None = None,
    ) -> None:
        self.path = path
        #: ids at or above it are refused when a chunk is verified (None: not checked)
        self.vocab_size = vocab_size
        self.chunk_tokens = C = chunk_tokens
        self.n_tokens = n_tokens
        self.dtype = np.dtype(dtype)
        with open(path, "rb") as fh:
            #: the mapped file's stat (the caller checks it is the file whose index it holds)
            self.stat = os.fstat(fh.fileno())
            size = self.stat.st_size
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        n_chunks = int(byte_offsets.size)
        decoded = bool(n_chunks) and int(byte_offsets[-1]) < 0
        self._map_raw(byte_offsets[:-1] if decoded else byte_offsets)
        #: the final chunk's runs when it is mapped from stored deflate blocks (else empty)
        self._tail_runs: list[np.ndarray] = []
        if decoded:
            self._tail_runs = self._map_tail(tail, tail_runs, n_tokens - (n_chunks - 1) * C)
            decoded = not self._tail_runs
        self._decoded = decoded
        if decoded:  # pages untouched until decoded
            self._tail_runs = [np.empty(n_tokens - (n_chunks - 1) * C, dtype=self.dtype)]
        if self._tail_runs:
            self.runs.extend(self._tail_runs)
            self.chunk_run.append(self._tail_runs[0])
            self.chunk_pos.append(0)
        #: shard-local position of each run's first token (runs cover the shard in order)
        self._run_starts = np.cumsum([0] + [r.size for r in self.runs[:-1]]).tolist()
        #: per chunk: its stored checksum (an array of machine words: ints on indexing, 8 bytes each)
        self.checksums = None if checksums is None else packed_sums(checksums)
        #: per chunk: 1 once it may be served in this process
        self.ready = bytearray(n_chunks) if checksums is not None else bytearray(b"\x01" * n_chunks)
        if decoded:
            self.ready[-1] = 0
        self.pending = n_chunks - sum(self.ready)

    def adopt(self, verified: np.ndarray) -> None:
        """Mark the chunks flagged in ``verified`` ((chunks,) uint8, from an earlier map of this
        same file in this process) ready, except a final chunk decoded into memory (decoded afresh)."""
        v = np.frombuffer(self.ready, np.uint8) | (verified != 0)
        if self._decoded:
            v[-1] = self.ready[-1]
        self.ready = bytearray(v.astype(np.uint8).tobytes())
        self.pending = len(self.ready) - int(np.count_nonzero(v))

    def _map_raw(self, raw: np.ndarray) -> None:
        """Map the raw chunks at byte offsets ``raw``: :attr:`runs`, :attr:`chunk_run`, :attr:`chunk_pos`."""
        C = self.chunk_tokens
        first = np.flatnonzero(np.diff(raw) != C * self.dtype.itemsize) + 1 if raw.size else raw
        bounds = [0, *first.tolist(), int(raw.size)] if raw.size else [0]
        #: zero-copy arrays over runs of file-contiguous chunks, in token order (and the final
        #: chunk's stored blocks, or the array it is decoded into)
        self.runs = [
            np.frombuffer(self._mm, dtype=self.dtype, count=(b - a) * C, offset=int(raw[a]))
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        #: per chunk: its run's array, and the chunk's first token's position inside that run
        self.chunk_run: list[np.ndarray] = []
        self.chunk_pos = array("q")  # 8 bytes per chunk (a list of ints: 36)
        for run, a, b in zip(self.runs, bounds[:-1], bounds[1:]):
            self.chunk_run.extend([run] * (b - a))
            self.chunk_pos.extend(range(0, (b - a) * C, C))

    def _map_tail(self, tail: tuple[int, int] | None, runs: list[tuple[int, int]] | None, n: int) -> list[np.ndarray]:
        """The final chunk's ``n`` tokens as arrays over the file's stored deflate blocks: at
        ``runs`` (``(byte offset, bytes)``, known already), or found from ``tail``, its byte offset
        and stored size (:func:`~h5corpus.storage.format.stored_tail_runs`); [] when it is not
        stored that way (it is then decoded into memory)."""
        w = self.dtype.itemsize
        found = runs or None
        if self._mm is None:
            return []
        if found is None and tail is not None and tail[0] + tail[1] <= len(self._mm):
            found = fmt.stored_tail_runs(self._mm, tail[0], tail[1], n * w, w)
        if not found or sum(b for _, b in found) != n * w or max(o + b for o, b in found) > len(self._mm):
            return []
        return [np.frombuffer(self._mm, dtype=self.dtype, count=b // w, offset=o) for o, b in found]

    @property
    def mapped(self) -> Any:
        """The memory map of the whole file (None for an empty file), for readers of the same
        shard's other datasets (:class:`MappedOffsets`), valid until :meth:`close`."""
        return self._mm

    def _pieces(self, k: int, lo: int, hi: int) -> list[np.ndarray]:
        """Chunk ``k``'s tokens (shard-local ``[lo, hi)``) as arrays: one view, or the final
        chunk's stored blocks."""
        if k == len(self.ready) - 1 and len(self._tail_runs) > 1:
            return self._tail_runs
        return [self.chunk_run[k][self.chunk_pos[k] : self.chunk_pos[k] + hi - lo]]

    def ensure(self, k0: int, k1: int) -> None:
        """Make chunks ``k0..k1`` (inclusive) ready: verify (and decode) those that are not yet."""
        ready = self.ready
        k = ready.find(0, k0, k1 + 1)
        while k >= 0:
            self._prepare(k)
            k = ready.find(0, k + 1, k1 + 1)

    def _prepare(self, k: int) -> None:
        C = self.chunk_tokens
        lo, hi = k * C, min((k + 1) * C, self.n_tokens)
        view = self.chunk_run[k][self.chunk_pos[k] : self.chunk_pos[k] + hi - lo]
        if self._decoded and k == len(self.ready) - 1:
            try:
                with h5open(self.path) as f:
                    f[fmt.TOKENS].read_direct(view, source_sel=np.s_[lo:hi])
            except (OSError, ValueError) as e:
                raise ChunkChecksumError(self.path, k, lo, hi, f"cannot be decoded ({e})") from None
        if self.checksums is not None:
            pieces = self._pieces(k, lo, hi)
            got, want = fmt.pieces_checksum(pieces), self.checksums[k]
            if got != want:
                raise ChunkChecksumError(
                    self.path, k, lo, hi, f"fails its checksum (xxh3 {got:016x}, stored {want:016x})"
                )
            for piece in pieces:
                check_id_range(piece, self.vocab_size, self.path, k, lo, hi)
        if not self.ready[k]:
            self.ready[k] = 1
            self.pending -= 1

    def read(self, lo: int, hi: int, out: np.ndarray) -> None:
        """``out[:] = tokens[lo:hi]`` (shard-local positions; ``out`` may be any integer dtype)."""
        if hi <= lo:
            return
        C = self.chunk_tokens
        k, off = divmod(lo, C)
        if self.pending:
            self.ensure(k, (hi - 1) // C)
        run = self.chunk_run[k]
        p = self.chunk_pos[k] + off
        if p + (hi - lo) <= run.size:  # the common case: inside one run, one copy
            out[:] = run[p : p + hi - lo]
            return
        pos = lo
        while pos < hi:
            j = bisect.bisect_right(self._run_starts, pos) - 1
            run = self.runs[j]
            p = pos - self._run_starts[j]
            n = min(run.size - p, hi - pos)
            out[pos - lo : pos - lo + n] = run[p : p + n]
            pos += n

    def refresh(self) -> None:  # finished shards never change
        pass

    def close(self) -> None:
        self.runs, self.chunk_run, self._tail_runs = [], [], []
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the map closes when it is collected
                pass
            self._mm = None


#: Once no more than this share of a :class:`RunTable`'s chunks is unverified, :meth:`RunTable.locate`
#: verifies them all at once: a position in a chunk may be rare in an epoch's order (a short final
#: chunk), and until the last one is verified every locate pays its per-call check (~20 us, about
#: a third of a best-fit batch's cost from the maps: a 2.8 s epoch of 7 shards takes 1.9 s without).
SWEEP_SHARE = 0.01


class RunTable:
    """Where the tokens of a split whose shards are all memory-mapped lie: the runs of
    file-contiguous HDF5 chunks of every shard, in token order, and the global token range of each.

    :meth:`locate` verifies the chunks it is asked about (version 2) and never reports room past a
    chunk not verified yet, so a caller that copies ``[pos, pos + n)`` out of a run when
    ``n <= room`` only ever serves verified tokens; longer ranges it reads through the corpus.

    A reader may be None (a remote shard not in the node cache yet,
    :meth:`~h5corpus.storage.reader.Corpus.cached_run_table`): its shard is one empty run at its
    first position, so :meth:`locate` finds no room anywhere in it and the caller reads it through
    the corpus (which fetches it)."""

    def __init__(self, readers: list[MmapTokens | None], shard_starts: np.ndarray) -> None:
        runs: list[np.ndarray] = []
        starts: list[np.ndarray] = [np.zeros(0, np.int64)]
        ends: list[np.ndarray] = [np.zeros(0, np.int64)]
        chunk_starts: list[np.ndarray] = [np.zeros(0, np.int64)]
        sts = np.asarray(shard_starts, dtype=np.int64)
        for s, r in enumerate(readers):
            if r is None:  # not here yet: an empty run, no chunks
                starts.append(sts[s : s + 1])
                ends.append(sts[s : s + 1])
                runs.append(np.zeros(0, np.uint8))
                continue
            sizes = np.array([run.size for run in r.runs], dtype=np.int64)
            first = sts[s] + np.cumsum(sizes) - sizes  # a shard's runs hold its chunks in order
            starts.append(first)
            ends.append(np.minimum(first + sizes, sts[s + 1]))  # a raw last chunk is stored whole
            runs.extend(r.runs)
            chunk_starts.append(sts[s] + np.arange(len(r.ready), dtype=np.int64) * r.chunk_tokens)
        #: zero-copy token arrays over the runs
        self.runs = runs
        #: (runs,) int64 global position of each run's first token (ascending)
        self.starts = np.concatenate(starts)
        #: (runs,) int64 global position after each run's last token of its shard
        self.ends = np.concatenate(ends)
        # per chunk of the split: global start and end, shard, chunk in the shard, ready
        n = [0 if r is None else len(r.ready) for r in readers]
        self._readers = readers
        self._chunk_start = np.concatenate(chunk_starts)
        shard = np.repeat(np.arange(len(readers), dtype=np.int64), n)
        C = np.array([1 if r is None else r.chunk_tokens for r in readers], dtype=np.int64)[shard]
        self._chunk_end = np.minimum(self._chunk_start + C, sts[shard + 1])
        self._chunk_shard = shard.tolist()
        self._chunk_local = ((self._chunk_start - sts[shard]) // np.maximum(C, 1)).tolist()
        self._ready = np.concatenate(
            [np.frombuffer(bytes(r.ready), np.uint8) for r in readers if r is not None] or [np.zeros(0, np.uint8)]
        )
        self._ready = self._ready.astype(bool)
        self._pending = int(self._ready.size - np.count_nonzero(self._ready))

    @classmethod
    def concatenate(cls, tables: list[RunTable], token_bases: np.ndarray) -> RunTable:
        """One table over several splits' token streams laid end to end (a mixture): table ``i``'s
        positions shifted by ``token_bases[i]`` tokens. Chunks keep their verification state and
        are verified through their own readers."""
        out = cls.__new__(cls)
        bases = np.asarray(token_bases, dtype=np.int64)
        out.runs = [r for t in tables for r in t.runs]
        out.starts = np.concatenate([t.starts + b for t, b in zip(tables, bases)] or [np.zeros(0, np.int64)])
        out.ends = np.concatenate([t.ends + b for t, b in zip(tables, bases)] or [np.zeros(0, np.int64)])
        out._readers = [r for t in tables for r in t._readers]
        first_reader = np.cumsum([0] + [len(t._readers) for t in tables])
        out._chunk_start = np.concatenate(
            [t._chunk_start + b for t, b in zip(tables, bases)] or [np.zeros(0, np.int64)]
        )
        out._chunk_end = np.concatenate([t._chunk_end + b for t, b in zip(tables, bases)] or [np.zeros(0, np.int64)])
        out._chunk_shard = [s + int(f) for t, f in zip(tables, first_reader) for s in t._chunk_shard]
        out._chunk_local = [c for t in tables for c in t._chunk_local]
        out._ready = np.concatenate([t._ready for t in tables] or [np.zeros(0, bool)])
        out._pending = int(out._ready.size - np.count_nonzero(out._ready))
        return out

    @property
    def pending(self) -> int:
        """Chunks this table has not seen verified yet (0: :meth:`locate` verifies nothing more)."""
        return self._pending

    def verified(self, pos: np.ndarray, length: int) -> bool:
        """Whether every chunk holding a token of a range ``[p, p + length)``, ``p`` in ``pos``
        (int64 global positions, ``length >= 1``), is verified, so that :meth:`locate` of ``pos``
        verifies (and raises) nothing. Chunks their readers verified through another read are
        learned here; the middle chunks of a range over more than two are only known once
        :meth:`locate` saw them (until then the answer may be a conservative False)."""
        if not self._pending:
            return True
        starts, ready = self._chunk_start, self._ready
        first = starts.searchsorted(pos, side="right") - 1
        last = starts.searchsorted(pos + (length - 1), side="right") - 1
        ends = np.concatenate([first, last])
        for j in sorted(set(ends[~ready[ends]].tolist())):
            if self._readers[self._chunk_shard[j]].ready[self._chunk_local[j]]:
                ready[j] = True
                self._pending -= 1
        missing = np.concatenate([[0], np.cumsum(~ready)])
        return bool((missing[last + 1] == missing[first]).all())

    def locate(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For global token positions ``pos`` (int64): the run holding each, its offset in that
        run (tokens), and the tokens from it to the run's end, or, while some chunks are not
        verified yet, to the end of the verified chunks that follow (at most two chunk boundaries
        ahead): ``[pos, pos + n)`` is one slice of one run, of verified tokens, if ``n <= room``.
        Verifies the chunks that hold ``pos`` (raises
        :class:`~h5corpus.storage.format.ChunkChecksumError`)."""
        run = self.starts.searchsorted(pos, side="right") - 1
        room = self.ends[run] - pos
        if self._pending:
            room = self._verify(pos, room)
        return run, pos - self.starts[run], room

    _swept = False  # :meth:`_sweep` ran (once per table)

    def _verify(self, pos: np.ndarray, room: np.ndarray) -> np.ndarray:
        g = self._chunk_start.searchsorted(pos, side="right") - 1
        ready = self._ready
        todo = g[~ready[g]]
        if todo.size:
            for j in sorted(set(todo.tolist())):  # the readers' own state may already say ready
                self._readers[self._chunk_shard[j]].ensure(self._chunk_local[j], self._chunk_local[j])
                ready[j] = True
                self._pending -= 1
        if not self._swept and self._pending <= SWEEP_SHARE * ready.size:
            self._sweep()
        last = ready.size - 1
        g1, g2 = np.minimum(g + 1, last), np.minimum(g + 2, last)
        ok1 = ready[g1] & (g < last)
        ok2 = ok1 & ready[g2] & (g + 1 < last)
        end = self._chunk_end
        limit = np.where(ok2, end[g2], np.where(ok1, end[g1], end[g])) - pos
        return np.minimum(room, limit)

    def _sweep(self) -> None:
        """Verify the few chunks still pending at once (:data:`SWEEP_SHARE`). One that fails (its
        checksum, its ids, a read) stays pending, so the read that touches it raises as before."""
        self._swept = True
        for j in np.flatnonzero(~self._ready).tolist():
            try:
                self._readers[self._chunk_shard[j]].ensure(self._chunk_local[j], self._chunk_local[j])
            except (ChunkChecksumError, OSError):
                continue
            self._ready[j] = True
            self._pending -= 1


class H5Tokens:
    """``/tokens`` through HDF5: one low-level H5Dread per range (SWMR, so ``.partial`` works).

    BEWARE: HDF5 (2.0) returns other chunks' bytes after ``H5Drefresh`` when the same dataset is
    open twice in one process, so a live shard's ``/tokens`` is opened once per process
    (:func:`_live_tokens` shares it between corpora) and the live index is read through
    :attr:`file` (see ``Corpus._refresh_live``)."""

    shared = False  # True for live readers shared between corpora: closed when the last user drops it

    kind = "h5py"
    fds = 1

    def __init__(
        self,
        path: str,
        filtered: bool,
        chunk_tokens: int,
        dtype: np.dtype,
        live: bool = False,
        verify: bool = False,
        *,
        checksums: np.ndarray | None = None,
        vocab_size: int | None = None,
    ) -> None:
        import h5py

        self.dtype = dtype
        self.vocab_size = vocab_size
        self.file = h5open(path, live=live)
        self.path = path
        self.chunk_tokens = chunk_tokens
        dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
        if filtered:
            nbytes = FILTERED_CACHE_CHUNKS * chunk_tokens * dtype.itemsize
            dapl.set_chunk_cache(10007, nbytes, 0.75)
        else:
            dapl.set_chunk_cache(521, 0, 1.0)  # raw chunks: read straight into the caller's buffer
        self.dsid = h5py.h5d.open(self.file.id, fmt.TOKENS.encode(), dapl=dapl)
        self._mtype = h5py.h5t.py_create(dtype)
        self._fspace = self.dsid.get_space()  # re-selected per read; renewed by refresh()
        self._mspace: dict[int, Any] = {}
        #: version 2: the stored checksum of every chunk published so far (read through :attr:`file`)
        self.checksums: array | None = None
        self.ready = bytearray()
        if verify and checksums is not None:  # proven by the caller (a finished shard's checksums)
            self.checksums = packed_sums(checksums)
            self.ready = bytearray(len(self.checksums))
        elif verify:
            self._load_checksums()

    def _load_checksums(self) -> None:
        sums = self.file[fmt.CHUNK_CHECKSUMS]
        if self.checksums is not None:
            sums.refresh()
        self.checksums = packed_sums(sums[()])
        self.ready.extend(bytes(len(self.checksums) - len(self.ready)))

    def read(self, lo: int, hi: int, out: np.ndarray) -> None:
        n = hi - lo
        if n == 0:
            return
        if self.checksums is not None:
            C = self.chunk_tokens
            k0, k1 = lo // C, (hi - 1) // C
            if k1 >= len(self.ready) or self.ready.find(0, k0, k1 + 1) >= 0:
                for k in range(k0, k1 + 1):
                    self._verify(k)
        direct = out.dtype == self.dtype and out.flags.c_contiguous and out.flags.writeable
        dst = out if direct else np.empty(n, dtype=self.dtype)
        try:
            self._read(lo, n, dst)
        except OSError as e:
            C = self.chunk_tokens
            raise FormatError(
                f"{self.path}: cannot read tokens [{lo:,}, {lo + n:,}) (chunks {lo // C:,} to {(lo + n - 1) // C:,}) "
                f"({e}); run h5corpus validate"
            ) from None
        if not direct:
            out[:] = dst

    def _read(self, lo: int, n: int, dst: np.ndarray) -> None:
        mspace = self._mspace.get(n)
        if mspace is None:
            import h5py

            if len(self._mspace) > 64:
                self._mspace.clear()
            mspace = self._mspace[n] = h5py.h5s.create_simple((n,))
        self._fspace.select_hyperslab((lo,), (n,))
        self.dsid.read(mspace, self._fspace, dst, self._mtype)

    def _verify(self, k: int) -> None:
        """Check chunk ``k`` against its checksum (reading the whole chunk: for compressed shards
        the chunk cache then holds it for the read that follows)."""
        assert self.checksums is not None
        if k < len(self.ready) and self.ready[k]:
            return
        if k >= len(self.checksums):
            self._load_checksums()  # a live shard: published since
            if k >= len(self.checksums):
                raise FormatError(
                    f"{self.path}: no checksum published for chunk {k:,} of /tokens; not a shard being written"
                )
        C = self.chunk_tokens
        lo, hi = k * C, min((k + 1) * C, self.dsid.shape[0])
        buf = np.empty(hi - lo, dtype=self.dtype)
        try:
            self._read(lo, hi - lo, buf)
        except OSError as e:
            raise ChunkChecksumError(self.path, k, lo, hi, f"cannot be read ({e})") from None
        got, want = fmt.chunk_checksum(buf), self.checksums[k]
        if got != want:
            raise ChunkChecksumError(self.path, k, lo, hi, f"fails its checksum (xxh3 {got:016x}, stored {want:016x})")
        check_id_range(buf, self.vocab_size, self.path, k, lo, hi)
        self.ready[k] = 1

    def refresh(self) -> None:
        self.dsid.refresh()
        self._fspace = self.dsid.get_space()
        if self.checksums is not None:
            self._load_checksums()

    def close(self) -> None:
        if self.shared:
            return
        try:
            self.dsid.close()
        except Exception:
            pass
        try:
            self.file.close()
        except Exception:
            pass


_LIVE_TOKENS: weakref.WeakValueDictionary[tuple[int, str], H5Tokens] = weakref.WeakValueDictionary()


def live_tokens(
    path: str, filtered: bool, chunk_tokens: int, dtype: np.dtype, verify: bool = False, vocab_size: int | None = None
) -> H5Tokens:
    """This process's one HDF5 reader of a shard being written (see the BEWARE in H5Tokens)."""
    key = (os.getpid(), os.path.realpath(path))
    r = _LIVE_TOKENS.get(key)
    if r is None:
        r = H5Tokens(path, filtered, chunk_tokens, dtype, live=True, verify=verify, vocab_size=vocab_size)
        r.shared = True
        _LIVE_TOKENS[key] = r
    return r


def packed_sums(sums: np.ndarray) -> array:
    """Checksums as an ``array("Q")``: indexing gives Python ints as a list would, at 8 bytes per
    chunk instead of 36 (512 chunks per default shard, up to 256 shards open per process)."""
    out = array("Q")
    out.frombytes(np.ascontiguousarray(sums, dtype=np.uint64).tobytes())
    return out


class IndexChecksumError(FormatError):
    """A chunk of a version 3 shard's ``/doc_offsets`` fails its checksum or its bounds: the shard's
    index is corrupt. Names the shard file (:attr:`path`) and the chunk (:attr:`chunk`)."""

    def __init__(self, path: str, chunk: int, detail: str) -> None:
        self.path, self.chunk = path, chunk
        super().__init__(
            f"{path}: chunk {chunk:,} of /doc_offsets {detail}: the shard's index is corrupt; run h5corpus validate"
        )


class MappedOffsets:
    """A finished version 3 shard's ``/doc_offsets`` (shard-local, int64) through a read-only memory
    map of its raw chunks, consulted lazily: each chunk of :data:`~h5corpus.storage.format.OFFSETS_CHUNK_V3`
    entries is verified against its ``/offsets_xxh3`` checksum (and its entries checked to lie in
    ``[0, num_tokens]``, non-decreasing) the first time this process touches it.

    ``byte_offsets``: file offset of every chunk (:func:`~h5corpus.storage.format.chunk_byte_layout`);
    ``checksums`` None reads unverified (``verify=False``)."""

    def __init__(
        self,
        path: str,
        byte_offsets: np.ndarray,
        n_entries: int,
        checksums: np.ndarray | None,
        num_tokens: int,
        *,
        mapped: Any = None,
    ) -> None:
        self.path, self.n_entries, self.num_tokens = path, int(n_entries), int(num_tokens)
        self.chunk = fmt.OFFSETS_CHUNK_V3
        #: file descriptors it holds: none when it reads ``mapped``, the map of the shard's tokens
        self.fds = 0 if mapped is not None else 1
        self._own = mapped is None
        self.stat: os.stat_result | None = None
        if mapped is None:
            with open(path, "rb") as fh:
                self.stat = os.fstat(fh.fileno())
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._mm = mapped
        base = np.asarray(byte_offsets, dtype=np.int64)
        if base.size and int(base.max()) + self.chunk * fmt.OFFSETS_DTYPE.itemsize > len(mapped):
            raise IndexChecksumError(path, int(np.argmax(base)), "lies past the file's end")
        self._bytes = np.frombuffer(self._mm, np.uint8)
        self._base = np.asarray(byte_offsets, dtype=np.int64)
        self._sums = checksums
        self.ready = np.zeros(self._base.size, bool) if checksums is not None else np.ones(self._base.size, bool)
        #: whether :meth:`check_ends` passed: run before the first entry is served, not at open (a
        #: loader whose plan holds token positions may never read a shard's offsets)
        self._ends_ok = False

    def _view(self, k: int) -> np.ndarray:
        n = min(self.chunk, self.n_entries - k * self.chunk)
        return np.frombuffer(self._mm, fmt.OFFSETS_DTYPE, count=n, offset=int(self._base[k]))

    def ensure(self, chunks: np.ndarray) -> None:
        """Verify every chunk in ``chunks`` (int array) not verified yet in this process (and, the
        first time, :meth:`check_ends`)."""
        if not self._ends_ok:
            self._ends_ok = True  # first: check_ends reads through here
            try:
                self.check_ends()
            except FormatError:
                self._ends_ok = False
                raise
        todo = chunks[~self.ready[chunks]]
        for k in sorted(set(todo.tolist())):
            v = self._view(k)
            assert self._sums is not None
            got, want = fmt.chunk_checksum(v), int(self._sums[k])
            if got != want:
                raise IndexChecksumError(self.path, k, f"fails its checksum (xxh3 {got:016x}, stored {want:016x})")
            if v.size and (int(v[0]) < 0 or int(v[-1]) > self.num_tokens or (np.diff(v) < 0).any()):
                raise IndexChecksumError(self.path, k, f"holds offsets outside [0, {self.num_tokens:,}] or decreasing")
            self.ready[k] = True

    def take(self, j: np.ndarray) -> np.ndarray:
        """Entries at int64 indices ``j`` (any shape), verified."""
        k = j // self.chunk
        self.ensure(k.reshape(-1))
        at = self._base[k] + (j - k * self.chunk) * fmt.OFFSETS_DTYPE.itemsize
        raw = self._bytes[at.reshape(-1, 1) + np.arange(fmt.OFFSETS_DTYPE.itemsize)]
        return raw.view(fmt.OFFSETS_DTYPE).reshape(j.shape).astype(np.int64)

    def slice(self, a: int, b: int) -> np.ndarray:
        """Entries ``[a, b)`` as a new int64 array, verified."""
        if b <= a:
            return np.zeros(0, np.int64)
        k0, k1 = a // self.chunk, (b - 1) // self.chunk
        self.ensure(np.arange(k0, k1 + 1))
        parts = [self._view(k) for k in range(k0, k1 + 1)]
        whole = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return whole[a - k0 * self.chunk : b - k0 * self.chunk].astype(np.int64)

    def search(self, pos: np.ndarray) -> np.ndarray:
        """Shard-local document holding each shard-local token position (int64, in
        ``[0, num_tokens)``): the ``d`` with ``offsets[d] <= pos < offsets[d + 1]``, by a vectorized
        binary search that touches (and verifies) about log2(documents / chunk) chunks per position."""
        lo = np.zeros(pos.shape, np.int64)
        hi = np.full(pos.shape, self.n_entries - 1, np.int64)
        while True:
            open_ = hi - lo > 1
            if not open_.any():
                return lo
            mid = np.where(open_, (lo + hi) // 2, lo)
            go = self.take(mid) <= pos
            lo = np.where(open_ & go, mid, lo)
            hi = np.where(open_ & ~go, mid, hi)

    def check_ends(self) -> None:
        """The first entry is 0 and the last the shard's token count (verifies those chunks)."""
        first, last = self.take(np.array([0, self.n_entries - 1], np.int64)).tolist()
        if first != 0 or last != self.num_tokens:
            raise IndexChecksumError(
                self.path,
                0 if first else self._base.size - 1,
                f"runs from {first:,} to {last:,}, expected 0 to {self.num_tokens:,}",
            )

    def close(self) -> None:
        self._bytes = np.zeros(0, np.uint8)
        if not self._own:  # the tokens' map: closed with them
            return
        try:
            self._mm.close()
        except BufferError:  # a view is still alive; the map closes when it is collected
            pass
