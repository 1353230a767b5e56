"""Read one split of a built corpus as one global token stream and a list of documents.

``open_corpus`` of a format version 3 corpus reads the manifest only: sizes and shard starts come
from its counts, and each process opens (and checks) a shard the first time it touches it (through
the manifest's layout file when it proves the shard, else through HDF5), holding at most
:data:`MAX_OPEN_FDS` descriptors; document offsets are consulted lazily through a verified
memory map (:meth:`Corpus.doc_offsets_range`, :meth:`Corpus.doc_index_at`). Versions 1 and 2 read
every shard's index at open, as before. A :class:`Corpus` pickles as its manifest, split and what it
has checked, never as open handles, so DataLoader workers (fork or spawn) reopen files themselves.

Read path (measured in ``bench/bench_reader.py``, numbers in docs/READING.md). Token windows are
small (a few KiB) and land at random places, which is the worst case for HDF5's chunked reads:
``ds[a:b]`` with a chunk cache reads and caches the whole chunk for every window, and with the cache
off every read still pays HDF5's selection and dataspace machinery. So:

* **Finished, unfiltered shards** (the default: ``/tokens`` is stored raw) are read through a
  read-only memory map of the file at the byte offset of each chunk, as HDF5 itself reports it
  (``H5Dchunk_iter`` / ``H5Dget_chunk_info``). A window inside one chunk is then one ``memcpy`` from
  the page cache, no HDF5 call at all. The chunk map is checked before use (every chunk present,
  unfiltered, full size, inside the file); a shard failing a check uses the next path.
* **Compressed shards** (gzip, lzf, hdf5plugin filters) and **shards still being written**
  (``.partial`` files followed under SWMR) are read through HDF5 with one low-level ``H5Dread`` per
  range: the chunk cache is off for raw data (a cache only adds a chunk-sized copy per window) and
  holds :data:`FILTERED_CACHE_CHUNKS` chunks for compressed data (so neighbouring windows decompress a
  chunk once).

Live reading: :func:`open_live` follows one shard while a :class:`~h5corpus.writer.ShardWriter`
writes it; :meth:`Corpus.refresh` exposes the documents published since the last call. The writer
flushes tokens before the offsets that point at them, and the reader reads offsets before tokens, so a
reader only ever sees complete documents. :meth:`Corpus.refresh` on a manifest corpus picks up shards
appended to the manifest.
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
import os
import stat
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import format as fmt
from .format import PARTIAL_SUFFIX, FormatError, ShardRecord, TokenizerIdentity
from .manifest import Manifest, map_readonly, read_manifest, release_freed_memory
from .readpaths import (
    FORKS,
    READ_PATHS,
    H5Tokens,
    MappedOffsets,
    MmapTokens,
    ReadPath,
    RunTable,
    h5open,
    live_tokens,
    read_checksums,
)
from .remote import RemoteOptions, is_remote, redact
from .shardtable import RootedPaths, ShardTable

if TYPE_CHECKING:
    import h5py

    from .cache import Lease, RemoteShards

#: Shards one corpus keeps open per process (each holds two descriptors, its memory maps): 10,000
#: shards then read under the default ``ulimit -n`` of 1,024.
MAX_OPEN_SHARDS = 128
#: File descriptors one corpus's open shards may hold per process: 128 shards read through HDF5
#: (two each), or up to 256 opened through the layout file (one memory map each, shared by tokens
#: and offsets).
MAX_OPEN_FDS = 2 * MAX_OPEN_SHARDS
#: Seconds between two hand-backs of freed memory when shards are closed (``malloc_trim`` walks the
#: process's free heap: ~0.4 ms in a DataLoader worker, more in a training process with a large heap).
TRIM_EVERY_S = 10.0


class UnverifiedCorpusWarning(UserWarning):
    """The corpus opened is of format version 1: its shards carry no chunk checksums, so the tokens
    it serves are not verified (``h5corpus validate`` still proves them; a rebuild adds checksums)."""


class Corpus:
    """One split of a corpus: global token positions ``[0, num_tokens)`` across its shards in
    manifest order, and documents ``[0, num_documents)``.

    All ranges are half-open and 0-based, in tokens. Documents never cross shards; document ``i``
    is ``tokens(doc_offsets[i], doc_offsets[i + 1])``.

    Build it with :func:`open_corpus` (a manifest) or :func:`open_live` (one shard, possibly still
    being written).
    """

    # -- construction ----------------------------------------------------------------------------
    def __init__(
        self,
        manifest: Manifest,
        split: str,
        *,
        tokenizer: TokenizerIdentity | None = None,
        read_path: ReadPath = "auto",
        verify: bool = True,
    ) -> None:
        if split not in fmt.SPLITS:
            raise ValueError(f"split must be one of {fmt.SPLITS}, got {split!r}")
        if read_path not in READ_PATHS:
            raise ValueError(f"read_path must be one of {READ_PATHS}, got {read_path!r}")
        if tokenizer is not None and not tokenizer.same_ids(manifest.tokenizer):
            raise FormatError(
                f"{manifest.path}: corpus was built with tokenizer {manifest.tokenizer.name!r} "
                f"(sha256 {manifest.tokenizer.sha256[:12]}), not {tokenizer.name!r} (sha256 {tokenizer.sha256[:12]})"
            )
        self.manifest: Manifest | None = manifest
        #: format version of the shards (every shard of a manifest is of the manifest's version)
        self.version = manifest.version
        self._verify = bool(verify)
        self.split = split
        self.read_path = read_path
        self.tokenizer = manifest.tokenizer
        self.dtype = np.dtype(manifest.dtype)
        self.eos_id = manifest.tokenizer.eos_id
        self.chunk_tokens = manifest.chunk_tokens
        #: the split's manifest entries, in global order (a :class:`ShardTable` for version 3)
        self.entries: Sequence[ShardRecord] = []
        #: absolute shard paths, in global order
        self.paths: Sequence[str] = []
        #: per shard: False while it may still grow (a live ``.partial`` file)
        self._complete = bytearray()
        self.shard_token_starts = np.zeros(1, dtype=np.int64)
        self.shard_doc_starts = np.zeros(1, dtype=np.int64)
        #: a version 3+ split's table, until its shard starts are first asked for
        self._starts_of: ShardTable | None = None
        #: (documents + 1,) int64 global token offset of each document (versions 1-2 and live
        #: shards: read at open; version 3: None until :attr:`doc_offsets` is asked for)
        self._doc_offsets: np.ndarray | None = np.zeros(1, dtype=np.int64)
        id_bytes = fmt.stored_id_bytes(self.version)
        self._doc_ids: np.ndarray | None = np.zeros((0, id_bytes), np.uint8)
        self._doc_flags: np.ndarray | None = np.zeros(0, np.uint8)
        self._readers: dict[int, MmapTokens | H5Tokens] = {}
        #: version 3, per open shard: its verified, memory-mapped ``/doc_offsets`` (this process)
        self._indexes: dict[int, MappedOffsets] = {}
        #: per finished shard: the identity of the file whose index this corpus holds
        self._file_ids = FileIds()
        #: per finished shard: its ``/chunk_xxh3`` when this corpus verifies (read with the index)
        self._chunk_sums: dict[int, np.ndarray] = {}
        self._pid, self._forks = os.getpid(), FORKS[0]
        #: a remote corpus's shard fetcher (None: local files), and this process's leases on them
        self._remote: RemoteShards | None = None
        self._leases: dict[int, Lease] = {}
        self._append_entries(manifest.shards_of(split))
        if self.version < 2:
            warnings.warn(f"{manifest.path}: {self.integrity_note}", UnverifiedCorpusWarning, stacklevel=3)

    @property
    def shard_token_starts(self) -> np.ndarray:
        """(shards + 1,) int64: the global token offset where each shard starts; last = num_tokens."""
        if self.__dict__.get("_starts_of") is not None:
            self._fill_starts()
        return self._token_starts

    @shard_token_starts.setter
    def shard_token_starts(self, starts: np.ndarray) -> None:
        self._token_starts = starts

    @property
    def shard_doc_starts(self) -> np.ndarray:
        """(shards + 1,) int64: the global document index where each shard starts; last = num_documents."""
        if self.__dict__.get("_starts_of") is not None:
            self._fill_starts()
        return self._doc_starts

    @shard_doc_starts.setter
    def shard_doc_starts(self, starts: np.ndarray) -> None:
        self._doc_starts = starts

    def _fill_starts(self) -> None:
        table, self._starts_of = self._starts_of, None
        zero = np.zeros(1, np.int64)
        self._token_starts = np.concatenate([zero, np.cumsum(table.column("tokens"))])
        self._doc_starts = np.concatenate([zero, np.cumsum(table.column("documents"))])

    @classmethod
    def _live_corpus(cls, path: Path, tokenizer: TokenizerIdentity | None, read_path: ReadPath) -> Corpus:
        self = cls.__new__(cls)
        if read_path not in READ_PATHS:
            raise ValueError(f"read_path must be one of {READ_PATHS}, got {read_path!r}")
        final = path.with_name(path.name[: -len(PARTIAL_SUFFIX)]) if path.name.endswith(PARTIAL_SUFFIX) else path
        where = str(final)
        with _open_live_file(final) as f:
            a = fmt.check_attrs(f.attrs, where)
            ds = f[fmt.TOKENS]
            chunk_tokens = ds.chunks[0] if ds.chunks else int(a["chunk_tokens"])
        ident = fmt.identity_from_attrs(a)
        if tokenizer is not None and not tokenizer.same_ids(ident):
            raise FormatError(
                f"{where}: shard was written with tokenizer {ident.name!r} (sha256 {ident.sha256[:12]}), "
                f"not {tokenizer.name!r} (sha256 {tokenizer.sha256[:12]})"
            )
        self.manifest = None
        self.version = int(a["version"])
        self._verify = True
        self.split = a["split"]
        self.read_path = read_path
        self.tokenizer = ident
        self.dtype = np.dtype(a["dtype"])
        self.eos_id = int(a["eos_id"])
        self.chunk_tokens = int(chunk_tokens)
        self.entries = []
        self.paths = [str(final)]
        self._complete = bytearray(1)
        self.shard_token_starts = np.zeros(2, dtype=np.int64)
        self.shard_doc_starts = np.zeros(2, dtype=np.int64)
        self._doc_offsets = np.zeros(1, dtype=np.int64)
        self._doc_ids = np.zeros((0, fmt.stored_id_bytes(self.version)), np.uint8)
        self._doc_flags = np.zeros(0, np.uint8)
        self._readers = {}
        self._indexes = {}
        self._file_ids = FileIds()
        self._chunk_sums = {}
        self._pid, self._forks = os.getpid(), FORKS[0]
        self._remote, self._leases = None, {}
        self.refresh()
        return self

    def _append_entries(self, entries: list) -> None:
        """Add manifest shards after the current ones: version 3 from the manifest's counts alone
        (each shard is checked when this process first touches it); versions 1-2 read and check
        every index now."""
        assert self.manifest is not None
        if self.version >= 3:  # columns, not records: ~170 bytes per shard in every process
            table = ShardTable.of(entries)
            first = not self.entries
            self.entries = table if first else ShardTable.of(self.entries) + table
            self.paths = RootedPaths(str(self.manifest.root), self.entries)
            self._complete.extend(b"\x01" * len(table))
            self._doc_offsets = None
            self._doc_ids = self._doc_flags = None
            if first:  # the starts when first asked for: an open reads no per-shard column
                self._starts_of = table
                return
            self.shard_token_starts = np.concatenate(
                [self.shard_token_starts, self.shard_token_starts[-1] + np.cumsum(table.column("tokens"))]
            )
            self.shard_doc_starts = np.concatenate(
                [self.shard_doc_starts, self.shard_doc_starts[-1] + np.cumsum(table.column("documents"))]
            )
            return
        assert self._doc_offsets is not None
        offs, ids, flags = [self._doc_offsets], [], []
        starts, dstarts = [self.shard_token_starts], [self.shard_doc_starts]
        t0, d0 = int(self.shard_token_starts[-1]), int(self.shard_doc_starts[-1])
        for e in entries:
            path = str(self.manifest.shard_path(e))
            o, i, fl, ident, sums = self._read_index(path, e)
            self._file_ids.set(len(self.paths), ident)
            if sums is not None:
                self._chunk_sums[len(self.paths)] = sums
            offs.append(o[1:] + t0)
            ids.append(i)
            flags.append(fl)
            t0 += e.tokens
            d0 += e.documents
            starts.append(np.array([t0], np.int64))
            dstarts.append(np.array([d0], np.int64))
            self.entries.append(e)
            self.paths.append(path)
            self._complete.append(True)
        self._doc_offsets = np.concatenate(offs)
        self.shard_token_starts = np.concatenate(starts)
        self.shard_doc_starts = np.concatenate(dstarts)
        if self._doc_ids is not None and ids:
            self._doc_ids = np.concatenate([self._doc_ids] + ids)
            self._doc_flags = np.concatenate([self._doc_flags] + flags)

    def _read_index(
        self, path: str, entry: ShardRecord
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, FileId, np.ndarray | None]:
        """Check one finished shard against its manifest entry and the format contract, without
        reading a token: size, attributes, datasets (dtypes, byte order, shapes, chunks), the index
        (monotonic, within bounds, one id and flag per document). Returns its index, file id and,
        when this corpus verifies, its chunk checksums (read here, where the file is open already:
        a reader opening the shard later would pay HDF5's dataset open again)."""
        before = _file_id(path)
        if before[2] != entry.bytes:
            raise FormatError(
                f"{path}: file is {before[2]:,} bytes, manifest says {entry.bytes:,} (truncated or replaced?); "
                "run h5corpus validate"
            )
        try:
            f = h5open(path)
        except OSError as e:
            raise FormatError(f"{path}: cannot open shard ({e}); run h5corpus validate") from None
        assert self.manifest is not None
        expect = fmt.ShardExpectation.of(self.tokenizer, self.chunk_tokens, self.manifest.dtype, self.version)
        with f:
            problems = expect.attr_problems(fmt.check_attrs(f.attrs, path), self.split)
            problems += fmt.dataset_problems(f, expect)
            if any(pr.fatal for pr in problems):
                raise FormatError(f"{path}: {problems[-1].message}; run h5corpus validate")
            try:
                o, ids, flags = (f[k][()] for k in (fmt.DOC_OFFSETS, fmt.DOC_IDS, fmt.DOC_FLAGS))
            except (OSError, RuntimeError) as e:
                raise FormatError(f"{path}: cannot read the index ({e}); run h5corpus validate") from None
            stored = f[fmt.TOKENS].shape[0]
            sums = None
            if self.version >= 2:
                sums_ds = f[fmt.CHUNK_CHECKSUMS]
                problems += fmt.checksum_problems(sums_ds.shape[0], stored, self.chunk_tokens)
                if self.verified and not problems:
                    sums = _read_checksums(sums_ds, path)
        if stored != entry.tokens:
            problems.append(fmt.Problem("tokens", f"/tokens holds {stored:,} tokens, manifest says {entry.tokens:,}"))
        problems += fmt.check_index(
            o, ids, flags, num_tokens=stored, num_documents=entry.documents, id_bytes=fmt.stored_id_bytes(self.version)
        )
        if not problems and sums is not None and fmt.index_sha256(o, ids, flags, sums) != entry.index_sha256:
            problems.append(
                fmt.Problem(
                    "index_sha256", "index (offsets, ids, flags, checksums) differs from the manifest's index_sha256"
                )
            )
        if problems:
            raise FormatError(f"{path}: {problems[0].message}; run h5corpus validate")
        if _file_id(path) != before:
            raise FormatError(f"{path}: the shard changed while it was being opened (a build writing there?)")
        return o, ids, flags, before, sums

    def _check_unchanged(self, shard: int, st: os.stat_result | None = None) -> None:
        """Refuse to read a finished shard that is no longer the file whose index this corpus
        holds (rebuilt or replaced since the corpus was opened, e.g. by ``build --overwrite``)."""
        if not self._complete[shard] or not self._file_ids.has(shard):
            return
        now = _file_id(self.paths[shard]) if st is None else _stat_id(st)
        if not self._file_ids.same(shard, now):
            raise FormatError(
                f"{self.paths[shard]}: the shard changed since this corpus was opened (rebuilt or replaced?); "
                "reopen the corpus"
            )

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens in the split, EOS ids included (for a live shard: of its complete documents)."""
        return int(self.shard_token_starts[-1])

    @property
    def num_documents(self) -> int:
        """Documents in the split (from the manifest's counts)."""
        return int(self.shard_doc_starts[-1])

    @property
    def doc_offsets(self) -> np.ndarray:
        """(documents + 1,) int64 global token offset of each document; last = num_tokens.
        O(documents): a version 3 corpus reads (and verifies) every shard's offsets the first time
        it is asked for in a process (8 bytes per document); prefer :meth:`doc_offsets_range` and
        :meth:`doc_index_at`, which touch only what they need."""
        if self._doc_offsets is None:
            parts = [np.zeros(1, np.int64)]
            for s in range(self.num_shards):
                d = int(self.shard_doc_starts[s + 1] - self.shard_doc_starts[s])
                parts.append(self._index(s).slice(1, d + 1) + self.shard_token_starts[s])
            self._doc_offsets = np.concatenate(parts)
        return self._doc_offsets

    @property
    def num_shards(self) -> int:
        return len(self.paths)

    def doc_lengths(self) -> np.ndarray:
        """(documents,) int64 tokens per document, EOS included. O(documents): reads every shard's
        offsets (verified); for computing a plan once, not per batch."""
        return np.diff(self.doc_offsets)

    def doc_offsets_range(self, lo: int, hi: int) -> np.ndarray:
        """(hi - lo + 1,) int64 global token offsets of the boundaries of documents ``lo..hi``
        inclusive (``0 <= lo <= hi <= num_documents``): document ``i`` is tokens
        ``[out[i - lo], out[i - lo + 1])``. Verified; reads only the index chunks holding them."""
        if not (isinstance(lo, (int, np.integer)) and isinstance(hi, (int, np.integer))):
            raise TypeError(f"doc_offsets_range: lo and hi must be integers, got {lo!r}, {hi!r}")
        if not 0 <= lo <= hi <= self.num_documents:
            raise IndexError(f"doc_offsets_range: [{lo:,}, {hi:,}] outside [0, {self.num_documents:,}]")
        return self._offsets_between(int(lo), int(hi))

    def doc_index_at(self, positions: np.ndarray) -> np.ndarray:
        """int64 index of the document holding each global token position (``positions``: any
        shape of integers in ``[0, num_tokens)``; the result has its shape). Reads only the index
        chunks that hold the answers."""
        pos = np.asarray(positions)
        if pos.size and pos.dtype.kind not in "iu":
            raise TypeError(f"doc_index_at: positions must be integers, got dtype {pos.dtype}")
        pos = pos.astype(np.int64, copy=False)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.num_tokens):
            raise IndexError(f"doc_index_at: positions outside [0, {self.num_tokens:,})")
        return self._doc_index_at(pos)

    def _offsets_between(self, lo: int, hi: int) -> np.ndarray:
        """Checked ``doc_offsets_range``: boundaries ``lo..hi`` as a new array; version 3 reads
        them shard by shard from the shards' verified maps."""
        if self._doc_offsets is not None:
            return self._doc_offsets[lo : hi + 1].copy()
        if self.num_shards == 0:
            return np.zeros(1, np.int64)
        self._check_pid()
        dst = self.shard_doc_starts
        parts, j = [], lo
        while j <= hi:
            s = int(np.searchsorted(dst[:-1], j, side="right")) - 1  # dst[s] <= j <= dst[s + 1]
            end = min(hi, int(dst[s + 1]))
            parts.append(self._index(s).slice(j - int(dst[s]), end - int(dst[s]) + 1) + self.shard_token_starts[s])
            j = end + 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _doc_index_at(self, pos: np.ndarray) -> np.ndarray:
        """Checked ``doc_index_at`` over int64 positions; version 3 searches each shard's verified
        map (a binary search touching ~log2(documents / 1,024) offsets chunks per position)."""
        if self._doc_offsets is not None:
            return np.searchsorted(self._doc_offsets, pos, side="right").astype(np.int64) - 1
        self._check_pid()
        flat = pos.reshape(-1)
        shard = np.searchsorted(self.shard_token_starts, flat, side="right") - 1
        out = np.empty(flat.size, np.int64)
        for s in sorted(set(shard.tolist())):
            sel = shard == s
            local = self._index(s).search(flat[sel] - self.shard_token_starts[s])
            out[sel] = local + self.shard_doc_starts[s]
        return out.reshape(pos.shape)

    @property
    def doc_ids(self) -> np.ndarray:
        """(documents, 16) uint8 (version 3: the first 128 bits of the sha256 of each document's source
        text; 32 bytes, the whole sha256, before) read on first use: O(documents), proven against the
        manifest's index_sha256."""
        if self._doc_ids is None:
            self._load_doc_meta()
        assert self._doc_ids is not None
        return self._doc_ids

    @property
    def doc_flags(self) -> np.ndarray:
        """(documents,) uint8 ``FLAG_*`` bits (read on first use)."""
        if self._doc_flags is None:
            self._load_doc_meta()
        assert self._doc_flags is not None
        return self._doc_flags

    def _load_doc_meta(self) -> None:
        """Read every shard's ids and flags (O(documents)) through :meth:`shard_doc_meta`."""
        ids, flags = [np.zeros((0, fmt.stored_id_bytes(self.version)), np.uint8)], [np.zeros(0, np.uint8)]
        for s in range(self.num_shards):
            i, f = self.shard_doc_meta(s)
            ids.append(i)
            flags.append(f)
        self._doc_ids, self._doc_flags = np.concatenate(ids), np.concatenate(flags)

    def shard_doc_meta(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """One shard's document ids ``(n, id bytes)`` and flags ``(n,)``, ``n`` its manifest count;
        a finished version 3 shard's are proven against the manifest's ``index_sha256`` first (its
        offsets and checksum tables re-read); a version 4 shard's are read from its sidecar
        (fetched on this first need for a remote corpus), proven against ``docs_sha256`` and its
        binding to the shard first. Raises :class:`FormatError` naming the shard."""
        self._check_pid()
        n = int(self.shard_doc_starts[shard + 1] - self.shard_doc_starts[shard])
        if not fmt.ids_in_shard(self.version):
            return self._sidecar_meta(shard)
        if self._remote is not None:
            self._reader(shard)  # fetched into the cache and leased
        self._check_unchanged(shard)
        path = self._open_path(shard)
        try:
            with h5open(path, live=not self._complete[shard]) as f:
                rows = (f[fmt.DOC_IDS].shape[0], f[fmt.DOC_FLAGS].shape[0])
                if self._complete[shard] and rows != (n, n):
                    raise FormatError(
                        f"{path}: /doc_ids and /doc_flags hold {rows[0]:,} and {rows[1]:,} rows, manifest says "
                        f"{n:,} documents; run h5corpus validate"
                    )
                ids, flags = f[fmt.DOC_IDS][:n], f[fmt.DOC_FLAGS][:n]
                if self.version >= 3 and self._complete[shard] and self.verified:
                    sums = (f[k][()] for k in (fmt.CHUNK_CHECKSUMS, fmt.OFFSETS_CHECKSUMS))
                    got = fmt.index_sha256(f[fmt.DOC_OFFSETS][()], ids, flags, *sums)
                    if got != self.entries[shard].index_sha256:
                        raise FormatError(
                            f"{path}: the index (/doc_offsets, /doc_ids, /doc_flags, checksums) differs from "
                            "the manifest's index_sha256; run h5corpus validate"
                        )
        except (OSError, KeyError, RuntimeError) as e:  # RuntimeError: HDF5 metadata that fails its checksum
            raise FormatError(f"{path}: cannot read document ids and flags ({e}); run h5corpus validate") from None
        return ids, flags

    def _sidecar_meta(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """A version 4 shard's ids and flags from its sidecar, proven first (the shard itself is
        not opened); a live shard's sidecar exists once its writer has finished."""
        where = self.paths[shard]
        if self.manifest is None or not self._complete[shard]:
            path = fmt.docs_path(where)
            if not path.exists():
                raise FormatError(f"{where}: document ids and flags are written when the shard is finished")
            with h5open(where) as f:  # a finished live shard: its record from the file itself
                offs, sums = f[fmt.DOC_OFFSETS][()], (f[k][()] for k in (fmt.CHUNK_CHECKSUMS, fmt.OFFSETS_CHECKSUMS))
                index = fmt.index_sha256_v4(offs, *sums)
            data = path.read_bytes()
            n = int(self.shard_doc_starts[shard + 1] - self.shard_doc_starts[shard])
            hdr = np.frombuffer(data[:32], "<u8", 2, 16).tolist() if len(data) >= 32 else [-1, -1]
            if len(data) < fmt.DOCS_HEADER_BYTES or data[64:96].hex() != index or hdr[0] != n:
                raise FormatError(f"{path}: not the document sidecar of {where}; run h5corpus validate")
            return fmt.decode_docs(data)
        entry = self.entries[shard]
        local = fmt.docs_path(where)
        if self._remote is not None:
            self._remote.acquire_docs(entry, str(local))
        return fmt.read_docs(local, entry, where)

    @property
    def fingerprint(self) -> str:
        """Hex sha256 naming this token stream: split + every shard's manifest sha256 (for a live
        shard: its path and current token count). Loader checkpoints store it."""
        key = (self.num_shards, self.num_tokens)
        hit = self.__dict__.get("_fingerprint")
        if hit is not None and hit[0] == key:
            return hit[1]
        h = hashlib.sha256(self.split.encode())
        rows = self.entries.hex_blocks("sha256") if isinstance(self.entries, ShardTable) else None
        if rows is not None and not self.entries.has("loss_sha256"):
            for block in rows:  # = one update per shard's hex sha256
                h.update(block)
        elif self.manifest is not None:
            for e in self.entries:
                h.update(e.sha256.encode())
                if e.loss_sha256 is not None:  # a fine-tuning mask is part of what a checkpoint trained on
                    h.update(e.loss_sha256.encode())
        else:
            h.update(f"{self.paths[0]}:{self.num_tokens}".encode())
        self.__dict__["_fingerprint"] = (key, h.hexdigest())
        return h.hexdigest()

    @property
    def verified(self) -> bool:
        """True when every chunk this corpus serves is checked against its stored checksum the first
        time this process touches it (format version >= 2, ``verify=True``); False for version 1
        corpora and ``verify=False``."""
        return self.version >= 2 and self._verify

    @property
    def integrity_note(self) -> str | None:
        """None for a verified corpus; else what an unverified one means, in one sentence."""
        if self.verified:
            return None
        if self.version >= 2:
            return "opened with verify=False: chunk checksums are not checked"
        return (
            f"format version {self.version} shards carry no chunk checksums: tokens are served unverified "
            "(run h5corpus validate to prove them, or rebuild the corpus for verified reads)"
        )

    @property
    def complete(self) -> bool:
        """False while a live shard may still grow."""
        return all(self._complete)

    def __len__(self) -> int:
        return self.num_documents

    # -- handles (lazy, per process, never pickled) ----------------------------------------------
    def _open_path(self, shard: int) -> str:
        p = self.paths[shard]
        if not self._complete[shard] and os.path.exists(p + PARTIAL_SUFFIX):
            return p + PARTIAL_SUFFIX
        return p

    def _check_pid(self) -> None:
        if self._forks != FORKS[0]:  # forked: never touch the parent's handles
            self._readers, self._indexes, self._leases = {}, {}, {}
            self.__dict__.pop("_vbits", None)  # and verify for itself
            self._pid, self._forks = os.getpid(), FORKS[0]

    def _reader(self, shard: int) -> MmapTokens | H5Tokens:
        """This process's read path for ``shard`` (callers run :meth:`_check_pid` first). At most
        :data:`MAX_OPEN_FDS` descriptors are held per corpus and process (a shard opened through the
        layout file holds one, through HDF5 two): past :data:`MAX_OPEN_SHARDS` shards, opening one
        more when the descriptors are used up first closes the older half."""
        r = self._readers.get(shard)
        if r is None:
            cap = self._open_cap()
            if len(self._readers) >= cap and (cap < MAX_OPEN_SHARDS or self._open_fds() + 2 > MAX_OPEN_FDS):
                self._close_oldest(max(1, len(self._readers) // 2))
            self._fetch(shard)
            fds = self._open_fds()
            if self.version >= 3 and self.manifest is not None:
                r, idx = self._open_v3(shard)
                self._indexes[shard] = idx
                fds += idx.fds
            else:
                r = self._open_reader(shard)
            self._recall_verified(shard, r)
            self._readers[shard] = r
            self.__dict__["_fdn"] = (self._readers, len(self._readers), fds + r.fds)
        return r

    def _fetch(self, shard: int) -> None:
        """The seam to object storage: a remote shard is fetched into the node's cache (once per
        node, verified against the manifest's sha256) and leased while this process has it open,
        so that no process evicts it; its cached path is :attr:`paths` ``[shard]``."""
        if self._remote is None or shard in self._leases:
            return
        self._leases[shard] = self._remote.acquire(self.entries[shard], self.paths[shard])
        self._file_ids.forget(shard)  # a new download is a new file of the same proven bytes
        bits = self.__dict__.get("_vbits")
        if bits is not None:  # whose chunks are verified afresh
            bits[1][bits[0][shard] : bits[0][shard + 1]] = 0

    def _open_cap(self) -> int:
        """Shards this process keeps open: :data:`MAX_OPEN_SHARDS`, fewer for a remote split
        larger than its cache (leased shards cannot be evicted)."""
        if self._remote is None:
            return MAX_OPEN_SHARDS
        sizes = (
            self.entries.column("bytes") if isinstance(self.entries, ShardTable) else [e.bytes for e in self.entries]
        )
        return self._remote.open_cap(MAX_OPEN_SHARDS, int(max(sizes, default=1)))

    def prefetch(self, shards: Any) -> None:
        """Start fetching these shards (indices) of a remote corpus into the cache in the background,
        so a later read does not wait for them; nothing for a local corpus."""
        if self._remote is not None:
            want = np.asarray(shards, dtype=np.int64).reshape(-1).tolist()
            idx = [s for s in want if 0 <= s < self.num_shards and s not in self._leases]  # held: cached
            self._remote.prefetch([(self.entries[s], self.paths[s]) for s in idx])

    @property
    def remote(self) -> bool:
        """True when this corpus's shards come from object storage through a node cache."""
        return self._remote is not None

    def cached_shards(self) -> np.ndarray:
        """(shards,) bool: which shards' bytes are on this node (every one for a local corpus; for
        a remote one, those in the node cache). Loaders read a cold remote corpus shard by shard
        instead of opening every shard at once (:meth:`run_table`) while some are missing."""
        if self._remote is None:
            return np.ones(self.num_shards, dtype=bool)
        self._check_pid()
        return np.array([s in self._leases or os.path.exists(p) for s, p in enumerate(self.paths)], dtype=bool)

    def _open_fds(self) -> int:
        """File descriptors this corpus's open shards hold in this process (a memory map holds one);
        counted once per change of the open set, else kept up to date by :meth:`_reader`."""
        hit = self.__dict__.get("_fdn")
        if hit is not None and hit[0] is self._readers and hit[1] == len(self._readers):
            return hit[2]
        idx = self._indexes
        n = sum(r.fds + (idx[s].fds if s in idx else 0) for s, r in self._readers.items())
        self.__dict__["_fdn"] = (self._readers, len(self._readers), n)
        return n

    def _index(self, shard: int) -> MappedOffsets:
        """This process's verified map of a version 3 shard's ``/doc_offsets`` (opens the shard)."""
        idx = self._indexes.get(shard)
        if idx is None:
            self._check_pid()
            self._reader(shard)
            idx = self._indexes[shard]
        return idx

    def _close_oldest(self, n: int) -> None:
        """Close the ``n`` shards opened first (dicts keep insertion order); their chunks are
        verified again if they are opened again."""
        for s in list(self._readers)[:n]:
            r = self._readers.pop(s)
            self._remember_verified(s, r)
            r.close()
            idx = self._indexes.pop(s, None)
            if idx is not None:
                idx.close()
            lease = self._leases.pop(s, None)
            if lease is not None:
                lease.release()
        now = time.monotonic()  # hand the closed shards' memory back to the OS, at most every TRIM_EVERY_S
        if now - self.__dict__.get("_trimmed_at", -TRIM_EVERY_S) >= TRIM_EVERY_S:
            self.__dict__["_trimmed_at"] = now
            release_freed_memory()

    def _verified_bits(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(shards + 1,) first chunk of each shard and (chunks,) uint8 per chunk of the split: 1 once
        this process verified it; kept when a shard is closed (version 3 corpora of a manifest)."""
        if self.version < 3 or self.manifest is None or not self.verified:
            return None
        hit = self.__dict__.get("_vbits")
        if hit is None or hit[0].size != self.num_shards + 1:
            chunks = -(-np.diff(self.shard_token_starts) // self.chunk_tokens)
            base = np.concatenate([[0], np.cumsum(chunks)])
            old = hit[1] if hit is not None else np.zeros(0, np.uint8)
            bits = np.zeros(int(base[-1]), np.uint8)
            bits[: old.size] = old[: bits.size]  # shards are only ever appended
            hit = self.__dict__["_vbits"] = (base, bits)
        return hit

    def _remember_verified(self, shard: int, r: MmapTokens | H5Tokens) -> None:
        """Keep which chunks of ``shard`` this process verified, for when it opens the shard again."""
        vb = self._verified_bits() if isinstance(r, MmapTokens) else None
        if vb is not None and len(r.ready) == vb[0][shard + 1] - vb[0][shard]:
            vb[1][vb[0][shard] : vb[0][shard + 1]] = np.frombuffer(r.ready, np.uint8)

    def _recall_verified(self, shard: int, r: MmapTokens | H5Tokens) -> None:
        """Mark the chunks of ``shard`` verified in this process before it was closed as ready:
        the file is the one verified (:meth:`_check_unchanged` refuses another), so its bytes are
        as proven as those of a shard kept open (whose pages the kernel may also re-read)."""
        vb = self._verified_bits() if isinstance(r, MmapTokens) else None
        if vb is not None and len(r.ready) == vb[0][shard + 1] - vb[0][shard]:
            r.adopt(vb[1][vb[0][shard] : vb[0][shard + 1]])

    def _open_v3(self, shard: int) -> tuple[MmapTokens | H5Tokens, MappedOffsets]:
        """Open a finished version 3 shard the first time this process touches it, checking it at
        a cost independent of its documents' count (8 bytes per token chunk and per 1,024
        documents): the file's identity and size, its attributes and datasets against the manifest,
        every chunk stored, and both checksum tables against the manifest's ``sums_sha256``.
        Returns its token reader and its offsets map."""
        path, e = self.paths[shard], self.entries[shard]
        now = _file_id(path)
        if now[2] != e.bytes:
            raise FormatError(
                f"{path}: file is {now[2]:,} bytes, manifest says {e.bytes:,} (truncated or replaced?); "
                "run h5corpus validate"
            )
        if not self._file_ids.has(shard):
            self._file_ids.set(shard, now, self.num_shards)
        self._check_unchanged(shard, None)
        lay = self._mapped_layout(shard, now, e)
        if lay is not None:  # proven by the layout file: no HDF5 open
            return self._open_mapped(shard, lay, e)
        sums, osums, tok_layout, off_layout, filtered, tail = self._checked_v3(path, e)
        verify, vocab = self.verified, self.tokenizer.vocab_size
        if tok_layout is not None:
            r: MmapTokens | H5Tokens = MmapTokens(
                path, self.chunk_tokens, tok_layout, self.dtype, e.tokens, sums if verify else None, vocab, tail
            )
        else:
            r = H5Tokens(path, filtered, self.chunk_tokens, self.dtype, verify=verify, checksums=sums, vocab_size=vocab)
        idx = MappedOffsets(path, off_layout, e.documents + 1, osums if verify else None, e.tokens)
        try:
            self._check_unchanged(shard, idx.stat)  # the file mapped is the one checked
        except FormatError:
            r.close()
            idx.close()
            raise
        return r, idx

    def _open_mapped(self, shard: int, lay: fmt.ShardLayout, e: ShardRecord) -> tuple[MmapTokens, MappedOffsets]:
        """:meth:`_open_v3` of a shard whose layout file entry holds (:meth:`_mapped_layout`): one
        memory map of the file, shared by its tokens and its offsets, no HDF5 call (``e``: its entry)."""
        path = self.paths[shard]
        verify = self.verified
        runs = fmt.stored_block_runs(lay.tail[0], e.tokens % self.chunk_tokens * self.dtype.itemsize, lay.tail_runs)
        r = MmapTokens(
            path,
            self.chunk_tokens,
            lay.tokens,
            self.dtype,
            e.tokens,
            lay.chunk_sums if verify else None,
            self.tokenizer.vocab_size,
            lay.tail if lay.tail[1] and not runs else None,
            tail_runs=runs,
        )
        try:
            idx = MappedOffsets(
                path, lay.offsets, e.documents + 1, lay.offsets_sums if verify else None, e.tokens, mapped=r.mapped
            )
            self._check_unchanged(shard, r.stat)  # the file mapped is the one checked
        except FormatError:
            r.close()
            raise
        return r, idx

    def _checked_v3(
        self, path: str, e: ShardRecord
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, bool, tuple[int, int] | None]:
        """Open a version 3 shard through HDF5 and run :meth:`_check_v3`; also returns the stored
        extent of its final ``/tokens`` chunk when that chunk is filtered."""
        try:
            with h5open(path) as f:
                sums, osums, tok_layout, off_layout, filtered = self._check_v3(f, path, e)
                tail = fmt.final_chunk_extent(f[fmt.TOKENS], tok_layout)
        except (OSError, KeyError, ValueError, RuntimeError) as err:  # RuntimeError: corrupt HDF5 metadata
            if isinstance(err, FormatError):
                raise
            raise FormatError(f"{path}: cannot open shard ({err}); run h5corpus validate") from None
        return sums, osums, tok_layout, off_layout, filtered, tail

    def _mapped_layout(self, shard: int, now: FileId, e: ShardRecord) -> fmt.ShardLayout | None:
        """The layout file's entry for ``shard`` when it may replace the HDF5 checks (docs/FORMAT.md
        "The layout file"): the file is the one that was checked (size and mtime), its checksum
        tables hash to the manifest's ``sums_sha256``, its counts and addresses fit the manifest's
        entry and the file. Else None (the shard is then checked through HDF5)."""
        if self.read_path == "h5py" or self.manifest is None or self.manifest.path is None:
            return None
        data = self.__dict__.get("_layout_map")
        if data is None:
            data = self.__dict__["_layout_map"] = map_readonly(fmt.layout_path(self.manifest.path))
        if not data:
            return None
        where = self._manifest_rows()
        lay = fmt.decode_layout(data, int(where[shard]), len(self.manifest.shards))
        C = self.chunk_tokens
        if lay is None or (lay.size, lay.mtime_ns) != (now[2], now[3]):
            return None
        n_tok, n_off = -(-e.tokens // C), -(-(e.documents + 1) // fmt.OFFSETS_CHUNK_V3)
        if (lay.tokens.size, lay.chunk_sums.size, lay.offsets.size, lay.offsets_sums.size) != (
            n_tok,
            n_tok,
            n_off,
            n_off,
        ):
            return None
        raw = lay.tokens[lay.tokens >= 0]
        if (
            raw.size
            and int(raw.max()) + C * self.dtype.itemsize > lay.size
            or int(lay.offsets.max()) + 8 * fmt.OFFSETS_CHUNK_V3 > lay.size
        ):
            return None
        if n_tok and int(lay.tokens[-1]) == -1 and sum(lay.tail) > lay.size:
            return None
        if fmt.sums_sha256(lay.chunk_sums, lay.offsets_sums) != e.sums_sha256:
            return None
        return lay

    def _manifest_rows(self) -> Sequence[int]:
        """Each shard's position among the manifest's shards (the layout file's rows)."""
        hit = self.__dict__.get("_mrows")
        if hit is None or len(hit) != len(self.entries):
            assert self.manifest is not None
            shards = self.manifest.shards
            if isinstance(shards, ShardTable):
                hit = np.flatnonzero(shards.split_mask(self.split))
            else:
                hit = [i for i, e in enumerate(shards) if e.split == self.split]
            self.__dict__["_mrows"] = hit
        return hit

    def shard_layout(self, shard: int) -> fmt.ShardLayout:
        """A finished version 3 shard's :class:`~h5corpus.storage.format.ShardLayout`, found by the
        full checks of a first touch through HDF5 (for :func:`write_layout_file`). Raises
        :class:`FormatError` naming the shard when a check fails."""
        if self.version < 3 or self.manifest is None:
            raise FormatError(f"{self.paths[shard]}: layouts are for finished format version 3 shards")
        path, e = self.paths[shard], self.entries[shard]
        before = _file_id(path)
        sums, osums, tok, off, _, tail = self._checked_v3(path, e)
        if tok is None or _file_id(path) != before or before[2] != e.bytes:
            raise FormatError(f"{path}: the shard cannot be memory-mapped, or changed while it was checked")
        runs = 0
        if tail is not None:  # how many stored blocks hold the final chunk's tokens (0: decode it)
            real = e.tokens % self.chunk_tokens * self.dtype.itemsize
            with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                found = fmt.stored_tail_runs(mm, tail[0], tail[1], real, self.dtype.itemsize)
            if found and found == fmt.stored_block_runs(tail[0], real, len(found)):
                runs = len(found)
        return fmt.ShardLayout(before[2], before[3], tok, tail or (0, 0), off, sums, osums, runs)

    def _check_v3(
        self, f: h5py.File, path: str, e: ShardRecord
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, bool]:
        """:meth:`_open_v3`'s checks of the open file; returns both checksum tables (proven
        against the manifest), the byte layouts of ``/tokens`` (None: read through HDF5) and of
        ``/doc_offsets``, and whether ``/tokens`` is filtered."""
        assert self.manifest is not None
        expect = fmt.ShardExpectation.of(self.tokenizer, self.chunk_tokens, self.manifest.dtype, self.version)
        problems = expect.attr_problems(fmt.check_attrs(f.attrs, path), self.split)
        ds = {k: f.get(k) for k in fmt.datasets_of(self.version)}  # each object looked up once (h5py lookups cost)
        problems += fmt.dataset_problems(ds, expect)
        t = ds[fmt.TOKENS] if not any(p.fatal for p in problems) else None
        if t is not None and t.shape[0] != e.tokens:
            problems.append(fmt.Problem("tokens", f"/tokens holds {t.shape[0]:,} tokens, manifest says {e.tokens:,}"))
        if t is not None and not problems:
            problems += fmt.v3_index_layout_problems(ds, e.tokens, e.documents, self.chunk_tokens)
        if problems or t is None:
            raise FormatError(f"{path}: {problems[0].message}; run h5corpus validate")
        sums, osums = read_checksums(ds[fmt.CHUNK_CHECKSUMS]), read_checksums(ds[fmt.OFFSETS_CHECKSUMS])
        if fmt.sums_sha256(sums, osums) != e.sums_sha256:
            raise FormatError(
                f"{path}: /{fmt.CHUNK_CHECKSUMS} and /{fmt.OFFSETS_CHECKSUMS} differ from the manifest's sums_sha256 "
                "(corrupt or replaced); run h5corpus validate"
            )
        size = os.path.getsize(path)
        off_layout, why = fmt.chunk_byte_layout(ds[fmt.DOC_OFFSETS], e.documents + 1, size)
        if off_layout is None:
            raise FormatError(f"{path}: /doc_offsets cannot be mapped: {why}; run h5corpus validate")
        tok_layout = None
        if self.read_path != "h5py":
            tok_layout, why = fmt.chunk_byte_layout(t, e.tokens, size)
            if tok_layout is None and self.read_path == "mmap":
                raise FormatError(f"{path}: read_path='mmap' impossible: {why}")
        return sums, osums, tok_layout, off_layout, t.id.get_create_plist().get_nfilters() != 0

    def _open_reader(self, shard: int) -> MmapTokens | H5Tokens:
        path = self._open_path(shard)
        live = not self._complete[shard]
        n = int(self.shard_token_starts[shard + 1] - self.shard_token_starts[shard])
        verify = self.verified
        self._check_unchanged(shard)
        try:
            with h5open(path, live=live) as f:
                ds = f[fmt.TOKENS]
                chunk_tokens = ds.chunks[0] if ds.chunks else 0
                filtered = ds.id.get_create_plist().get_nfilters() != 0
                offsets, why = None, "shard is still being written"
                if self.read_path != "h5py" and not live:
                    offsets, why = fmt.chunk_byte_layout(ds, n, os.path.getsize(path))
                tail = fmt.final_chunk_extent(ds, offsets)
                sums = None
                if verify and offsets is not None:  # read with the index, or (a live shard since finished) now
                    sums = self._chunk_sums.get(shard)
                    sums = read_checksums(f[fmt.CHUNK_CHECKSUMS]) if sums is None else sums
        except (OSError, KeyError, RuntimeError) as e:
            raise FormatError(f"{path}: cannot open shard ({e})") from None
        if offsets is not None:
            if sums is not None and sums.size != offsets.size:
                raise FormatError(
                    f"{path}: {sums.size:,} chunk checksums for {offsets.size:,} chunks; run h5corpus validate"
                )
            r = MmapTokens(path, chunk_tokens, offsets, self.dtype, n, sums, self.tokenizer.vocab_size, tail)
            self._check_unchanged(shard, r.stat)  # the file mapped is the one checked
            return r
        if self.read_path == "mmap" and not live:
            raise FormatError(f"{path}: read_path='mmap' impossible: {why}")
        vocab = self.tokenizer.vocab_size
        if live:
            return live_tokens(path, filtered, max(chunk_tokens, 1), self.dtype, verify, vocab)
        sums = self._chunk_sums.get(shard)  # proven at open (v2)
        return H5Tokens(
            path,
            filtered,
            max(chunk_tokens, 1),
            self.dtype,
            live=False,
            verify=verify,
            checksums=sums,
            vocab_size=vocab,
        )

    def read_paths(self) -> list[str]:
        """Read path (``"mmap"`` or ``"h5py"``) of every shard in this process (opens them)."""
        self._check_pid()
        return [self._reader(s).kind for s in range(self.num_shards)]

    def close(self) -> None:
        """Close every open shard handle and memory map in this process."""
        self._close_oldest(len(self._readers))
        for idx in self._indexes.values():
            idx.close()
        for lease in self._leases.values():
            lease.release()
        self._readers, self._indexes, self._leases = {}, {}, {}

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_readers"] = {}
        d["_indexes"] = {}
        d["_leases"] = {}
        if self.version >= 3 and self.manifest is not None:
            d["_doc_offsets"] = None  # re-readable lazily, verified, in the process that asks
        d.pop("_sts_list", None)
        d.pop("_offs_view", None)
        d.pop("_rtab", None)
        d.pop("_layout_map", None)  # mapped again, per process
        d.pop("_fdn", None)
        d.pop("_vbits", None)  # verified per process
        d.pop("_loss_cache", None)  # re-read (and proven) in the process that asks
        d.pop("_loss_shards", None)
        if self.manifest is not None:  # re-readable from the immutable shards
            d["_doc_ids"] = None
            d["_doc_flags"] = None
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._pid, self._forks = os.getpid(), FORKS[0]

    def __del__(self) -> None:
        try:
            if self._pid == os.getpid():
                self.close()
        except Exception:
            pass

    # -- live reading -----------------------------------------------------------------------------
    def refresh(self) -> int:
        """Pick up what was published since the last call; return the number of new documents.

        For :func:`open_live`: re-reads the shard's index under SWMR and exposes every document
        the writer has published (offsets are read before anything they point at, and the writer
        flushes tokens before offsets, so no torn document is ever exposed). Once the writer has
        renamed the file into place, :attr:`complete` turns True.
        For :func:`open_corpus`: re-reads the manifest and appends shards added to this split
        (the shards already open must still be listed first, unchanged).
        """
        self._check_pid()
        if self.manifest is None:
            return self._refresh_live()
        assert self.manifest.path is not None
        m = read_manifest(self.manifest.path, compact=True)
        entries = m.shards_of(self.split)
        old = [(e.path, e.sha256) for e in self.entries]
        if [(e.path, e.sha256) for e in entries[: len(old)]] != old:
            raise FormatError(
                f"{self.manifest.path}: shards of split {self.split!r} changed under an open corpus "
                "(only appending shards can be followed); reopen it"
            )
        before = self.num_documents
        self.manifest = m
        self._append_entries(entries[len(old) :])
        return self.num_documents - before

    def _refresh_live(self) -> int:
        if self._complete[0]:
            return 0
        final = self.paths[0]
        r = self._readers.get(0)
        if not isinstance(r, H5Tokens):
            r = self._readers[0] = self._open_reader(0)
        assert isinstance(r, H5Tokens)
        f = r.file
        offs_ds = f[fmt.DOC_OFFSETS]
        offs_ds.refresh()  # offsets first: everything they point at was flushed before them
        n_docs = offs_ds.shape[0] - 1
        in_shard = fmt.ids_in_shard(self.version)  # version 4: ids and flags come with the sidecar
        ids_ds, flags_ds = (f[k] for k in (fmt.DOC_IDS, fmt.DOC_FLAGS)) if in_shard else (None, None)
        if ids_ds is not None and flags_ds is not None:
            ids_ds.refresh()
            flags_ds.refresh()
            n_docs = min(n_docs, ids_ds.shape[0], flags_ds.shape[0])
        r.refresh()
        n_tok = r.dsid.shape[0]
        known = self.num_documents
        if n_docs > known:
            new = offs_ds[known + 1 : n_docs + 1]
            keep = int(np.searchsorted(new, n_tok, side="right"))  # defensive: never past the tokens
            if keep:
                if (np.diff(new[:keep]) < 0).any() or new[0] < self.doc_offsets[-1]:
                    raise FormatError(f"{final}: document offsets decrease; not an h5corpus shard being written")
                n_docs = known + keep
                self._doc_offsets = np.concatenate([self.doc_offsets, new[:keep]])
                if ids_ds is not None and flags_ds is not None:
                    assert self._doc_ids is not None and self._doc_flags is not None
                    self._doc_ids = np.concatenate([self._doc_ids, ids_ds[known:n_docs]])
                    self._doc_flags = np.concatenate([self._doc_flags, flags_ds[known:n_docs]])
                else:
                    self._doc_ids = self._doc_flags = None  # read from the sidecar when asked
                self.shard_token_starts = np.array([0, self.doc_offsets[-1]], np.int64)
                self.shard_doc_starts = np.array([0, n_docs], np.int64)
        del offs_ds, ids_ds, flags_ds
        if not os.path.exists(final + PARTIAL_SUFFIX) and os.path.exists(final):
            # The writer closed and renamed the file. It publishes everything before the rename, so
            # once our index matches the finished file's, nothing more can come: let later reads
            # use the memory-map path.
            with h5open(final) as g:
                finished = g[fmt.DOC_OFFSETS].shape[0] - 1 == self.num_documents
            if finished:
                self._complete[0] = True
                r.close()
                self._readers.pop(0, None)
        return self.num_documents - known

    # -- reads ------------------------------------------------------------------------------------
    def _bounds(self) -> memoryview:
        """:attr:`shard_token_starts` as a memoryview of its int64s (indexing gives ints as fast as a
        list's, with no copy; cached per array: appending shards replaces it)."""
        sts = self.shard_token_starts
        hit = self.__dict__.get("_sts_list")
        if hit is None or hit[0] is not sts:
            hit = self.__dict__["_sts_list"] = (sts, memoryview(np.ascontiguousarray(sts, np.int64)))
        return hit[1]

    def _offsets_view(self) -> memoryview:
        """:attr:`doc_offsets` as a memoryview (indexing it gives Python ints, ~10x faster than
        numpy scalars; cached per array)."""
        offs = self.doc_offsets
        hit = self.__dict__.get("_offs_view")
        if hit is None or hit[0] is not offs:
            hit = self.__dict__["_offs_view"] = (offs, memoryview(np.ascontiguousarray(offs, dtype=np.int64)))
        return hit[1]

    def tokens(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split's global stream, crossing shard boundaries.

        ``out`` (1-D, ``stop - start`` long, any integer dtype) receives them when given. Every chunk
        read is verified first (format version 2): :class:`~h5corpus.storage.format.ChunkChecksumError`
        names the shard and chunk that fail."""
        hit = self.__dict__.get("_sts_list")
        bounds = hit[1] if hit is not None and hit[0] is self.shard_token_starts else self._bounds()
        if not 0 <= start <= stop <= bounds[-1]:
            raise IndexError(f"token range [{start:,}, {stop:,}) outside [0, {self.num_tokens:,})")
        if out is not None and out.shape != (stop - start,):
            raise ValueError(f"out has shape {out.shape}, expected ({stop - start},)")
        if self._forks != FORKS[0]:
            self._check_pid()
        if stop == start:
            return np.empty(0, dtype=self.dtype) if out is None else out
        s = bisect.bisect_right(bounds, start) - 1
        if stop <= bounds[s + 1]:  # inside one shard: the common case
            r = self._readers.get(s) or self._reader(s)
            a = start - bounds[s]
            if out is None and r.kind == "mmap":  # one slice copy when the range is one run's
                k, o = divmod(a, r.chunk_tokens)  # type: ignore[union-attr]
                if r.pending:  # type: ignore[union-attr]
                    k1 = (a + stop - start - 1) // r.chunk_tokens  # type: ignore[union-attr]
                    if k1 - k > 1 or not (r.ready[k] and r.ready[k1]):  # type: ignore[union-attr]
                        r.ensure(k, k1)  # type: ignore[union-attr]
                run = r.chunk_run[k]  # type: ignore[union-attr]
                p = r.chunk_pos[k] + o  # type: ignore[union-attr]
                if p + stop - start <= run.size:
                    return run[p : p + stop - start].copy()
            if out is None:
                out = np.empty(stop - start, dtype=self.dtype)
            r.read(a, a + stop - start, out)
            return out
        if out is None:
            out = np.empty(stop - start, dtype=self.dtype)
        pos = start
        while pos < stop:
            end = min(stop, bounds[s + 1])
            if end > pos:
                self._reader(s).read(pos - bounds[s], end - bounds[s], out[pos - start : end - start])
            pos = end
            s += 1
        return out

    def gather(self, starts: np.ndarray, length: int, out: np.ndarray | None = None) -> np.ndarray:
        """``out[j] = tokens(starts[j], starts[j] + length)`` for every j: many equal-length windows
        in one call (the sliding-window loader's hot path). ``out`` is (n, length), any integer dtype.
        Verified like :meth:`tokens`."""
        starts = np.asarray(starts, dtype=np.int64)
        if out is None:
            out = np.empty((starts.size, length), dtype=self.dtype)
        if starts.size == 0:
            return out
        if self._forks != FORKS[0]:
            self._check_pid()
        bounds = self._bounds()
        shard = (self.shard_token_starts.searchsorted(starts, side="right") - 1).tolist()
        readers = self._readers
        flat = out.reshape(-1) if out.flags.c_contiguous else None
        parts: list[np.ndarray] = []  # one view per window, copied into ``out`` by one concatenate
        done = 0  # rows of ``out`` already copied
        for s, g in zip(shard, starts.tolist()):
            a = g - bounds[s]
            if g < 0 or g + length > bounds[s + 1]:  # crosses into the next shard (or out of range)
                done = _flush_rows(out, parts, done)
                parts.append(self.tokens(g, g + length))
                continue
            r = readers.get(s)
            if r is None:  # opening a shard may close others: copy the views taken so far first
                done = _flush_rows(out, parts, done)
                r = self._reader(s)
            if r.kind == "mmap":  # the one-run case: a view, no call
                k, o = divmod(a, r.chunk_tokens)  # type: ignore[union-attr]
                if r.pending:  # type: ignore[union-attr]
                    k1 = (a + length - 1) // r.chunk_tokens  # type: ignore[union-attr]
                    if k1 - k > 1 or not (r.ready[k] and r.ready[k1]):  # type: ignore[union-attr]
                        r.ensure(k, k1)  # type: ignore[union-attr]
                run = r.chunk_run[k]  # type: ignore[union-attr]
                p = r.chunk_pos[k] + o  # type: ignore[union-attr]
                if p + length <= run.size:
                    parts.append(run[p : p + length])
                    continue
            row = np.empty(length, dtype=self.dtype)
            r.read(a, a + length, row)
            parts.append(row)
        if flat is not None and length and parts:
            np.concatenate(parts, out=flat[done * length :], casting="unsafe")
        else:
            _flush_rows(out, parts, done)
        return out

    def gather_ranges(self, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Ranges of different lengths end to end: ``out`` = the concatenation of
        ``tokens(starts[j], starts[j] + lengths[j])`` over j, 1-D of ``sum(lengths)`` tokens, any
        integer dtype (the best-fit loader's hot path: one range per packed segment).

        When every shard is memory-mapped, the chunk run and position of every range come from one
        lookup in the run table (:class:`RunTable`) and the copy is one ``np.concatenate`` of views
        into ``out`` (a range that crosses a shard or a gap between runs is read like :meth:`tokens`
        first). With a shard
        read through HDF5, every range is read like :meth:`tokens`."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if starts.shape != lengths.shape:
            raise ValueError(f"{starts.size} starts but {lengths.size} lengths")
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if ends.size else 0
        if out is None:
            out = np.empty(total, dtype=self.dtype)
        elif out.shape != (total,):
            raise ValueError(f"out has shape {out.shape}, expected ({total},)")
        if starts.size == 0:
            return out
        if (lengths < 0).any():
            raise ValueError("range lengths must be >= 0")
        bad = (starts < 0) | (starts + lengths > self.num_tokens)
        if bad.any():
            j = int(np.argmax(bad))
            raise IndexError(
                f"token range [{int(starts[j]):,}, {int(starts[j] + lengths[j]):,}) outside [0, {self.num_tokens:,})"
            )
        if total == 0:
            return out
        self._check_pid()
        tab = self._range_table()
        if tab is not None:  # views into the maps (a range that crosses a gap is read apart), one copy
            runs = tab.runs
            run_of, pos, room = tab.locate(starts)
            ok = lengths <= room
            if not ok.all():
                run_of = np.where(ok, run_of, -1)
            if run_of.min() >= 0:
                parts = [runs[i][a:b] for i, a, b in zip(run_of.tolist(), pos.tolist(), (pos + lengths).tolist())]
            else:
                parts = [
                    runs[i][a : a + n] if i >= 0 else self.tokens(g, g + n)
                    for i, a, n, g in zip(run_of.tolist(), pos.tolist(), lengths.tolist(), starts.tolist())
                ]
            np.concatenate(parts, out=out, casting="unsafe")
            return out
        for g, n, o in zip(starts.tolist(), lengths.tolist(), (ends - lengths).tolist()):
            self.tokens(g, g + n, out[o : o + n])
        return out

    def run_table(self) -> RunTable | None:
        """The :class:`RunTable` of every shard's memory-mapped chunk runs in this process (for
        :meth:`gather_ranges` and loaders that copy straight from the maps), or None if some shard
        is read through HDF5. Safe after a fork (the parent's maps are never used); built once
        per process and corpus size (it opens every shard)."""
        self._check_pid()
        return self._range_table()

    def _range_table(self) -> RunTable | None:
        hit = self.__dict__.get("_rtab")
        key = (self.num_shards, self.num_tokens)
        if hit is not None and hit[0] is self._readers and hit[1] == key and hit[2] == len(self._readers):
            return hit[3]
        tab = None
        if self.num_shards > self._open_cap():  # the table needs every shard open at once
            self.__dict__["_rtab"] = (self._readers, key, len(self._readers), None)
            return None
        if self._remote is not None:  # a cold cache: every shard at once, not one by one
            self._remote.fetch_all(
                [(e, p) for s, (e, p) in enumerate(zip(self.entries, self.paths)) if s not in self._leases]
            )
        readers = [self._reader(s) for s in range(self.num_shards)]
        if readers and all(r.kind == "mmap" for r in readers):
            tab = RunTable(readers, self.shard_token_starts)  # type: ignore[arg-type]
        self.__dict__["_rtab"] = (self._readers, key, len(self._readers), tab)
        return tab

    def cached_run_table(self) -> RunTable | None:
        """:meth:`run_table` over the shards on this node now, fetching none: a remote shard not
        in the cache yet is an empty run (:class:`RunTable`), read through :meth:`tokens` (which
        fetches it). What the loaders read a cold remote corpus through, rebuilt as shards
        arrive. None as for :meth:`run_table`; a local corpus's is :meth:`run_table`."""
        self._check_pid()
        if self._remote is None or self.cached_shards().all():
            return self._range_table()
        if self.num_shards > self._open_cap():
            return None
        have = self.cached_shards().tolist()
        readers = [self._reader(s) if have[s] else None for s in range(self.num_shards)]
        if not all(r is None or r.kind == "mmap" for r in readers):
            return None
        return RunTable(readers, self.shard_token_starts)  # type: ignore[arg-type]

    # -- fine-tuning: loss mask and BOS (docs/FORMAT.md, "Loss masks") -------------------------------
    @property
    def sft(self) -> dict[str, Any]:
        """The manifest's fine-tuning facts (``loss_mask``, ``bos_id``, ``loss_on``); {} for a
        pretraining corpus or a live shard."""
        if self.manifest is None:
            return {}
        return dict(self.manifest.extra.get(fmt.SFT_KEY) or {})

    @property
    def bos_id(self) -> int | None:
        """The BOS id every document of this corpus starts with (``build --loss-on ... --bos``), or None."""
        v = self.sft.get("bos_id")
        return None if v is None else int(v)

    @property
    def has_loss_mask(self) -> bool:
        """True when the split's shards store a loss mask (``/loss_spans``)."""
        hit = self.__dict__.get("_has_loss")
        if hit is None or hit[0] != self.num_shards:
            e = self.entries
            hit = (
                self.num_shards,
                e.has("loss_sha256") if isinstance(e, ShardTable) else any(r.loss_sha256 for r in e),
            )
            self.__dict__["_has_loss"] = hit
        return hit[1]

    def loss_spans_for(self, first: np.ndarray, last: np.ndarray) -> np.ndarray | None:
        """(K, 2) int64 global ``[start, end)`` trained-on ranges (sorted, disjoint) that hold
        every trained-on position of each interval ``[first[i], last[i])``: the ranges of every
        shard those intervals touch. None when the split has no loss mask. What the loaders call
        per batch: a shard's ranges are read, and proven against the manifest's ``loss_sha256``,
        when a batch first touches it, and kept for at most :data:`MAX_OPEN_SHARDS` shards per
        process (never the whole split's array)."""
        if not self.has_loss_mask:
            return None
        first = np.asarray(first, dtype=np.int64)
        if not first.size:
            return np.zeros((0, 2), np.int64)
        sts = self.shard_token_starts
        top = self.num_shards - 1
        lo = np.clip(np.searchsorted(sts, first, side="right") - 1, 0, top)
        hi = np.clip(np.searchsorted(sts, np.maximum(np.asarray(last, np.int64) - 1, first), side="right") - 1, lo, top)
        n = hi - lo + 1
        touched = np.unique(np.repeat(lo, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
        cache = self.__dict__.setdefault("_loss_shards", {})  # shard -> its ranges, in global positions
        parts = []
        for s in touched.tolist():
            spans = cache.pop(s, None)  # re-inserted: the dict's order is the order of last use
            if spans is None:
                spans = self._shard_loss_spans(s) + int(sts[s])
                if len(cache) >= MAX_OPEN_SHARDS:
                    for old in list(cache)[: MAX_OPEN_SHARDS // 2]:
                        del cache[old]
            cache[s] = spans
            parts.append(spans)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def loss_spans(self) -> np.ndarray | None:
        """(K, 2) int64 global ``[start, end)`` token ranges of this split whose positions are
        trained-on targets (sorted, disjoint), or None when the split has no loss mask (every
        target trained on). The whole split's ranges (``inspect``'s checks; the loaders ask
        :meth:`loss_spans_for` instead), read from every shard's ``/loss_spans`` (16 bytes per
        range), each proven against the manifest's ``loss_sha256`` first; a shard without a
        mask in a masked split is refused."""
        hit = self.__dict__.get("_loss_cache")
        if hit is not None and hit[0] == self.num_shards:
            return hit[1]
        out: np.ndarray | None = None
        if self.has_loss_mask:
            parts = [self._shard_loss_spans(s) + int(self.shard_token_starts[s]) for s in range(self.num_shards)]
            out = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
        self.__dict__["_loss_cache"] = (self.num_shards, out)
        return out

    def _shard_loss_spans(self, shard: int) -> np.ndarray:
        """One shard's ``/loss_spans`` (shard positions), proven against its manifest entry."""
        e, path = self.entries[shard], self.paths[shard]
        if e.loss_sha256 is None:
            raise FormatError(f"{path}: the split has a loss mask but this shard's manifest entry has no loss_sha256")
        self._check_unchanged(shard)
        import h5py  # only fine-tuning corpora read their ranges through HDF5

        try:
            with h5open(path) as f:
                ds = f.get(fmt.LOSS_SPANS)
                if not isinstance(ds, h5py.Dataset) or ds.ndim != 2 or ds.shape != (e.loss_spans, 2):
                    got = "missing" if not isinstance(ds, h5py.Dataset) else f"of shape {ds.shape}"
                    raise FormatError(
                        f"{path}: /{fmt.LOSS_SPANS} is {got}, manifest says {e.loss_spans:,} ranges; run h5corpus validate"
                    )
                spans = np.asarray(ds[()], dtype=np.int64).reshape(-1, 2)
        except (OSError, KeyError, RuntimeError) as err:
            raise FormatError(f"{path}: cannot read /{fmt.LOSS_SPANS} ({err}); run h5corpus validate") from None
        if self._verify and fmt.loss_spans_sha256(spans) != e.loss_sha256:
            raise FormatError(
                f"{path}: /{fmt.LOSS_SPANS} differs from the manifest's loss_sha256 (corrupt mask); run h5corpus validate"
            )
        return spans

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (EOS included unless it was truncated at build time); verified
        like :meth:`tokens`."""
        if self._doc_offsets is None:  # version 3: the two boundaries, from the verified map
            if not 0 <= i < self.num_documents:
                raise IndexError(f"document {i:,} outside [0, {self.num_documents:,})")
            a, b = self._offsets_between(int(i), int(i) + 1).tolist()
            return self.tokens(a, b)
        hit = self.__dict__.get("_offs_view")
        offs = hit[1] if hit is not None and hit[0] is self._doc_offsets else self._offsets_view()
        if not 0 <= i < len(offs) - 1:
            raise IndexError(f"document {i:,} outside [0, {self.num_documents:,})")
        return self.tokens(offs[i], offs[i + 1])

    def doc_id(self, i: int) -> str:
        """Hex id of document ``i`` (see :attr:`doc_ids`: 32 hex digits in version 3)."""
        return self.doc_ids[i].tobytes().hex()

    def __repr__(self) -> str:
        live = "" if self.complete else ", live"
        return (
            f"Corpus(split={self.split!r}, shards={self.num_shards}, documents={self.num_documents:,}, "
            f"tokens={self.num_tokens:,}{live})"
        )


FileId = tuple[int, int, int, int]
"""(device, inode, size in bytes, mtime in ns) of a shard file."""


class FileIds:
    """Per shard, the identity of the file a corpus checked (a 16-byte digest of its device,
    inode, size and mtime in ns), or none yet: 17 bytes per shard in two arrays, sized to the
    shard count when first set (grown when live shards are added), not a tuple of four ints per
    shard touched (~300 bytes each: 3 MB once an epoch has touched 10,000 shards)."""

    def __init__(self) -> None:
        self._rows = np.zeros((0, 16), np.uint8)
        self._set = np.zeros(0, bool)

    def has(self, shard: int) -> bool:
        return shard < self._set.size and bool(self._set[shard])

    def set(self, shard: int, fid: FileId, shards: int = 0) -> None:
        """Record ``fid`` for ``shard`` of a corpus of ``shards`` shards (the arrays' size)."""
        if shard >= self._set.size:
            n = max(shard + 1, shards or 2 * self._set.size)
            self._rows = np.concatenate([self._rows, np.zeros((n - self._set.size, 16), np.uint8)])
            self._set = np.concatenate([self._set, np.zeros(n - self._set.size, bool)])
        self._rows[shard] = np.frombuffer(_id_digest(fid), np.uint8)
        self._set[shard] = True

    def same(self, shard: int, fid: FileId) -> bool:
        """Whether ``fid`` is the identity recorded for ``shard`` (False when none is)."""
        return self.has(shard) and self._rows[shard].tobytes() == _id_digest(fid)

    def forget(self, shard: int) -> None:
        if shard < self._set.size:
            self._set[shard] = False


def _id_digest(fid: FileId) -> bytes:
    """16 bytes naming a file identity: equal identities give equal digests, others differ
    (BLAKE2b-128 of the four words)."""
    words = b"".join((v & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little") for v in fid)
    return hashlib.blake2b(words, digest_size=16).digest()


def _flush_rows(out: np.ndarray, parts: list[np.ndarray], done: int) -> int:
    """Copy ``parts`` into rows ``done, done + 1, ...`` of ``out`` and empty it (views into maps
    are then released before their shard may be closed); returns the rows copied so far."""
    for row, part in zip(out[done:], parts):
        row[:] = part
    done += len(parts)
    parts.clear()
    return done


def write_layout_file(manifest: str | os.PathLike[str]) -> Path:
    """Check every finished version 3 shard of the manifest at ``manifest`` through HDF5 (as a
    first touch does) and write the layout file beside it (``<manifest>.layout``, atomically), so
    that readers' first touches of these files skip HDF5. Shards that fail a check get no row
    (they are checked, and refused, through HDF5). Returns the layout file's path."""
    m = read_manifest(Path(manifest), compact=True)
    rows: list[fmt.ShardLayout | None] = [None] * len(m.shards)
    if m.version >= 3:
        for split in fmt.SPLITS:
            c = Corpus(m, split)
            where = c._manifest_rows()
            for s in range(c.num_shards):
                try:
                    rows[int(where[s])] = c.shard_layout(s)
                except FormatError:
                    continue
    out = fmt.layout_path(manifest)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_bytes(fmt.encode_layouts(rows))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _read_checksums(ds: h5py.Dataset, path: str) -> np.ndarray:
    try:
        return read_checksums(ds)
    except (OSError, KeyError, RuntimeError) as e:
        raise FormatError(f"{path}: cannot read /{fmt.CHUNK_CHECKSUMS} ({e}); run h5corpus validate") from None


def _stat_id(st: os.stat_result) -> FileId:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _file_id(path: str) -> FileId:
    """The identity of a finished shard's file; FormatError when it is missing or not a file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FormatError(f"{path}: shard file not found; run h5corpus validate") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot stat the shard ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{path}: the shard path is not a regular file")
    return _stat_id(st)


def _open_live_file(final: Path) -> h5py.File:
    """Open a shard being written (``<final>.partial``) or, once renamed, the finished file (SWMR)."""
    import h5py

    for p in (final.with_name(final.name + PARTIAL_SUFFIX), final):
        try:
            return h5py.File(p, "r", libver=fmt.LIBVER, swmr=True)
        except FileNotFoundError:
            continue
        except OSError as e:
            if p.exists():
                raise FormatError(f"{p}: cannot open shard under SWMR ({e})") from None
    raise FileNotFoundError(f"{final}: neither the shard nor its {PARTIAL_SUFFIX} file exists")


def open_corpus(
    manifest: str | os.PathLike[str] | Manifest,
    split: str = "train",
    *,
    tokenizer: TokenizerIdentity | None = None,
    read_path: ReadPath = "auto",
    verify: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
    remote: RemoteOptions | None = None,
) -> Corpus:
    """Open ``split`` of the corpus described by ``manifest`` (a path, a URL, or a parsed Manifest).

    Checks format and version of the manifest and every shard, that each shard's index matches the
    manifest, and, if ``tokenizer`` is given, that the corpus was built with the same ids.
    ``read_path``: ``"auto"`` (memory map for raw shards, HDF5 otherwise), or force ``"mmap"`` (raises
    for shards that cannot use it) or ``"h5py"``. ``verify`` (default True): check every chunk
    against its checksum the first time this process reads it (format version 2; ``False`` is for
    measuring what verification costs, or a corpus validated just before). A version 1 corpus has
    no checksums: it opens with an :class:`UnverifiedCorpusWarning` and ``Corpus.verified`` False.

    A URL (``s3://``, ``gs://``, ``az://``, ``hf://``, ``https://``) opens a corpus on object
    storage (format version 3) through the node's shard cache at ``cache_dir`` (default
    :func:`~h5corpus.storage.cache.default_cache_dir`), kept under ``cache_limit`` bytes (None: no
    limit); ``remote`` sets time-outs, retries and backend options (docs/READING.md).
    """
    if not isinstance(manifest, Manifest) and is_remote(manifest):
        opts = remote if remote is not None else RemoteOptions()
        from .cache import open_remote_manifest  # here: a local corpus never needs the cache

        m, shards = open_remote_manifest(str(manifest), split, cache_dir, cache_limit, opts)
        if m.version < 3:
            raise FormatError(
                f"{redact(str(manifest))}: format version {m.version} corpora open from local files only (rebuild: v3)"
            )
        c = Corpus(m, split, tokenizer=tokenizer, read_path=read_path, verify=verify)
        c._remote = shards
        return c
    m = manifest if isinstance(manifest, Manifest) else read_manifest(Path(manifest), compact=True)
    return Corpus(m, split, tokenizer=tokenizer, read_path=read_path, verify=verify)


def open_live(
    shard: str | os.PathLike[str], *, tokenizer: TokenizerIdentity | None = None, read_path: ReadPath = "auto"
) -> Corpus:
    """Follow one shard while a ShardWriter writes it (give the final ``.h5`` path or the
    ``.partial`` one). The corpus holds the documents published so far; call
    :meth:`Corpus.refresh` to expose newer ones, and read :attr:`Corpus.complete` to learn when the
    writer has finished. Works on a finished shard too."""
    return Corpus._live_corpus(Path(shard).absolute(), tokenizer, read_path)
