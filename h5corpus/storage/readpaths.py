"""Per-process read paths of one shard's ``/tokens`` (docs/READING.md).

* :class:`MmapTokens`: a finished, unfiltered shard through a read-only memory map of the file, at
  the chunk byte offsets HDF5 reports (:func:`~h5corpus.storage.format.chunk_byte_offsets`). A range
  inside one run of file-contiguous chunks is one copy from the page cache, no HDF5 call.
* :class:`H5Tokens`: compressed shards and shards still being written, through one low-level
  ``H5Dread`` per range (SWMR, so ``.partial`` files work).

:class:`RunTable` lays every memory-mapped run of a split end to end in global token positions.
None of these objects is ever pickled: a :class:`~h5corpus.storage.reader.Corpus` opens them lazily
in the process that reads.
"""

from __future__ import annotations

import mmap
import os
import weakref
from typing import Any, Literal, NamedTuple

import h5py
import numpy as np

from . import format as fmt
from .format import PARTIAL_SUFFIX

ReadPath = Literal["auto", "mmap", "h5py"]
READ_PATHS = ("auto", "mmap", "h5py")

#: Chunks the HDF5 chunk cache holds per compressed ``/tokens`` dataset (per process).
FILTERED_CACHE_CHUNKS = 8


def h5open(path: str | os.PathLike[str], *, live: bool = False) -> h5py.File:
    """Open a shard read-only: in SWMR mode when it is still being written (``live``), else
    plainly, so that HDF5 checks the file's end against its superblock (a truncated shard fails
    here, at once, instead of reading as zeros or looping in SWMR's metadata retries). HDF5 refuses
    a second open with other SWMR flags in one process: a shard already open the other way in
    this process is then opened that way."""
    try:
        return h5py.File(path, "r", libver=fmt.LIBVER, swmr=live)
    except OSError as e:
        if "SWMR read access flag not the same" not in str(e) or str(path).endswith(PARTIAL_SUFFIX):
            raise
        return h5py.File(path, "r", libver=fmt.LIBVER, swmr=not live)


# -- per-process read paths for one shard's /tokens ----------------------------------------------


class RunTable(NamedTuple):
    """Where the tokens of a split whose shards are all memory-mapped lie: the runs of
    file-contiguous HDF5 chunks of every shard, in token order, and the global token range of each."""

    runs: list[np.ndarray]
    """Zero-copy token arrays over the runs."""
    starts: np.ndarray
    """(runs,) int64 global position of each run's first token (ascending)."""
    ends: np.ndarray
    """(runs,) int64 global position after each run's last token of its shard (a shard's last
    chunk is stored whole; the tokens past the shard's end are not the next shard's)."""

    def locate(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For global token positions ``pos`` (int64): the run holding each, its offset in that
        run (tokens), and the tokens from it to the run's end: ``[pos, pos + n)`` is one slice of
        one run if ``n <= room``."""
        run = self.starts.searchsorted(pos, side="right") - 1
        return run, pos - self.starts[run], self.ends[run] - pos


class MmapTokens:
    """Raw chunks of a finished, unfiltered shard read through a read-only memory map.

    The writer appends chunks in order, so most chunks sit right after their predecessor in the
    file. Runs of such chunks are exposed as one array (:attr:`runs`), and a range is one copy
    unless it crosses from one run into the next (where HDF5 put an index block between chunks)."""

    kind = "mmap"

    def __init__(self, path: str, chunk_tokens: int, byte_offsets: np.ndarray, dtype: np.dtype, n_tokens: int) -> None:
        self.chunk_tokens = C = chunk_tokens
        self.n_tokens = n_tokens
        with open(path, "rb") as fh:
            #: the mapped file's stat (the caller checks it is the file whose index it holds)
            self.stat = os.fstat(fh.fileno())
            size = self.stat.st_size
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        chunk_bytes = C * dtype.itemsize
        first = np.flatnonzero(np.diff(byte_offsets) != chunk_bytes) + 1 if byte_offsets.size else byte_offsets
        bounds = [0, *first.tolist(), int(byte_offsets.size)] if byte_offsets.size else [0]
        #: zero-copy arrays over runs of file-contiguous chunks, in token order
        self.runs = [
            np.frombuffer(self._mm, dtype=dtype, count=(b - a) * C, offset=int(byte_offsets[a]))
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        #: per chunk: its run's array, and the chunk's first token's position inside that run
        self.chunk_run: list[np.ndarray] = []
        self.chunk_pos: list[int] = []
        for run, a, b in zip(self.runs, bounds[:-1], bounds[1:]):
            self.chunk_run.extend([run] * (b - a))
            self.chunk_pos.extend(range(0, (b - a) * C, C))

    def read(self, lo: int, hi: int, out: np.ndarray) -> None:
        """``out[:] = tokens[lo:hi]`` (shard-local positions; ``out`` may be any integer dtype)."""
        C = self.chunk_tokens
        k, off = divmod(lo, C)
        run = self.chunk_run[k]
        p = self.chunk_pos[k] + off
        if p + (hi - lo) <= run.size:  # the common case: inside one run, one copy
            out[:] = run[p : p + hi - lo]
            return
        pos = lo
        while pos < hi:
            k, off = divmod(pos, C)
            run = self.chunk_run[k]
            p = self.chunk_pos[k] + off
            n = min(run.size - p, hi - pos)
            out[pos - lo : pos - lo + n] = run[p : p + n]
            pos += n

    def refresh(self) -> None:  # finished shards never change
        pass

    def close(self) -> None:
        self.runs, self.chunk_run = [], []
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the map closes when it is collected
                pass
            self._mm = None


class H5Tokens:
    """``/tokens`` through HDF5: one low-level H5Dread per range (SWMR, so ``.partial`` works).

    BEWARE: HDF5 (2.0) returns other chunks' bytes after ``H5Drefresh`` when the same dataset is
    open twice in one process, so a live shard's ``/tokens`` is opened once per process
    (:func:`_live_tokens` shares it between corpora) and the live index is read through
    :attr:`file` (see ``Corpus._refresh_live``)."""

    shared = False  # True for live readers shared between corpora: closed when the last user drops it

    kind = "h5py"

    def __init__(self, path: str, filtered: bool, chunk_tokens: int, dtype: np.dtype, live: bool = False) -> None:
        self.dtype = dtype
        self.file = h5open(path, live=live)
        self.path = path
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

    def read(self, lo: int, hi: int, out: np.ndarray) -> None:
        n = hi - lo
        if n == 0:
            return
        direct = out.dtype == self.dtype and out.flags.c_contiguous and out.flags.writeable
        dst = out if direct else np.empty(n, dtype=self.dtype)
        mspace = self._mspace.get(n)
        if mspace is None:
            if len(self._mspace) > 64:
                self._mspace.clear()
            mspace = self._mspace[n] = h5py.h5s.create_simple((n,))
        self._fspace.select_hyperslab((lo,), (n,))
        self.dsid.read(mspace, self._fspace, dst, self._mtype)
        if not direct:
            out[:] = dst

    def refresh(self) -> None:
        self.dsid.refresh()
        self._fspace = self.dsid.get_space()

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


def live_tokens(path: str, filtered: bool, chunk_tokens: int, dtype: np.dtype) -> H5Tokens:
    """This process's one HDF5 reader of a shard being written (see the BEWARE in H5Tokens)."""
    key = (os.getpid(), os.path.realpath(path))
    r = _LIVE_TOKENS.get(key)
    if r is None:
        r = H5Tokens(path, filtered, chunk_tokens, dtype, live=True)
        r.shared = True
        _LIVE_TOKENS[key] = r
    return r
