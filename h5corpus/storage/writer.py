"""Write one shard: documents in, a complete, hashed, renamed-into-place HDF5 file out.

Lifecycle (Megatron's builder verbs)::

    with ShardWriter(path, split="train", tokenizer=ident) as w:
        w.add_document(ids_with_eos, doc_id)
        ...
    info = w.info          # set only when the body finished without an exception

While writing, the file lives at ``<path>.partial`` in SWMR mode; a concurrent reader opened with
``swmr=True`` on that path sees a growing prefix of complete documents (tokens are flushed before the
offsets that point at them). ``close()`` writes the final partial chunk, publishes the rest of the
index, fsyncs, and only then renames the file to ``path``. A writer that dies leaves only a
``.partial`` file, which nothing treats as a shard.

Format version 3 (docs/FORMAT.md): every full chunk of ``/tokens`` is written raw (HDF5 direct
chunk write, the pipeline's deflate filter skipped: the reader maps these bytes), the final
partial chunk deflate-compressed (its zero padding then costs nothing on disk), one xxh3-64
checksum per chunk in ``/chunk_xxh3`` (published before the documents that the chunk completes),
the index datasets unfiltered (``/doc_offsets`` in raw chunks a reader maps), one xxh3-64 per
``/doc_offsets`` chunk in ``/offsets_xxh3`` (written at close, when the offsets are final), ids
stored as their first 16 bytes, string attributes fixed-length (no global heap).

Format version 4 (the default) keeps the shard as above without ``/doc_ids`` and ``/doc_flags``:
``close()`` writes them into the shard's sidecar (``<path>.docs``, :func:`~h5corpus.storage.format.encode_docs`),
renamed into place (and fsynced) before the shard itself, so a finished shard always has its
sidecar. ``version=3`` writes the version 3 layout (ids and flags in the shard).

``fsync=False`` skips the two fsyncs (file, then folder after the rename), about 3-4 ms each on
ext4. The bytes are the same, and a killed process still never leaves a half-written file under
``path`` (the rename is atomic and the page cache survives the process). What is lost is
durability against a power cut or OS crash: only use it for intermediate files that are checked
against their hashes before reuse, or call :func:`fsync_files` on the final files before
publishing anything that points at them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from . import format as fmt
from .format import PARTIAL_SUFFIX, ShardRecord, TokenizerIdentity


def _fsync_path(p: str | os.PathLike[str]) -> None:
    """fsync a file or a folder, by path."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    _fsync_path(path)


def fsync_files(paths: Iterable[str | os.PathLike[str]], *, dirs: bool = True) -> list[Path]:
    """Make files durable: fsync each file, then (``dirs``) each distinct parent folder once, which
    makes their names (renames) durable too. For files written with ``ShardWriter(..., fsync=False)``
    and possibly renamed since, before a manifest that lists them is written. Returns the distinct
    parent folders (with ``dirs=False``, the caller fsyncs them later, e.g. once per build)."""
    files = [Path(p) for p in paths]
    for p in files:
        _fsync_path(p)
    parents = list(dict.fromkeys(p.absolute().parent for p in files))
    if dirs:
        for d in parents:
            fsync_dir(d)
    return parents


def _create_file(path: Path) -> h5py.File:
    """A new HDF5 file within :data:`~h5corpus.storage.format.LIBVER`, its root group keeping up to
    16 attributes in its object header (HDF5's default moves more than 8 into a fractal heap and
    a B-tree: ~3 KiB per shard), no timestamps."""
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)  # no creation time in the root group: identical inputs, identical bytes
    fcpl.set_attr_phase_change(16, 14)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    low, high = (getattr(h5py.h5f, f"LIBVER_{v.upper()}") for v in fmt.LIBVER)
    fapl.set_libver_bounds(low, high)
    return h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


def _write_rows(ds: Any, lo: int, values: np.ndarray) -> None:
    """``ds[lo : lo + len(values)] = values`` for a chunked dataset's low-level id ``ds``, already
    extended to hold them: the HDF5 calls of h5py's ``__setitem__`` (a hyperslab of the file space,
    the memory type of ``values``) without its per-call Python work, which the writer pays on every
    publish."""
    a = np.ascontiguousarray(values)
    fspace = ds.get_space()
    fspace.select_hyperslab((lo,) + (0,) * (a.ndim - 1), a.shape)
    ds.write(h5py.h5s.create_simple(a.shape), fspace, a)


def _fixed_string(v: str) -> np.ndarray:
    """``v`` as a fixed-length UTF-8 string attribute value (a variable-length one costs a 4 KiB
    global heap collection per file)."""
    b = v.encode("utf-8")
    return np.array(b, dtype=h5py.string_dtype("utf-8", max(len(b), 1)))


def _create_datasets(
    f: h5py.File, dtype: np.dtype, chunk_tokens: int, compression: Any, compression_opts: Any, version: int
) -> tuple:
    """Create every dataset of a version 3 or 4 shard in ``f``; returns them in the order
    ``(tokens, doc_offsets, doc_ids, doc_flags, chunk_xxh3, offsets_xxh3)`` (version 4: ids and
    flags None: they go to the sidecar)."""
    # Raw shards: a deflate pipeline whose filter every full chunk skips (direct writes, filter
    # mask 1), so only the final chunk is compressed. Compressed shards: the caller's filter.
    filt: dict[str, Any] = dict(compression="gzip", compression_opts=fmt.DEFLATE_LEVEL)
    if compression is not None:
        filt = dict(compression=compression, compression_opts=compression_opts)
    tokens = f.create_dataset(
        fmt.TOKENS,
        shape=(0,),
        maxshape=(None,),
        dtype=dtype,
        chunks=(chunk_tokens,),
        track_times=False,
        **filt,
    )
    # The index datasets are unfiltered so that each publish rewrites their last chunk in place
    # (a compressed chunk that grows is moved, leaving a hole); small chunks bound the padding.
    offsets = f.create_dataset(
        fmt.DOC_OFFSETS,
        shape=(1,),
        maxshape=(None,),
        dtype=fmt.OFFSETS_DTYPE,
        chunks=(fmt.OFFSETS_CHUNK_V3,),
        track_times=False,
    )
    grown = dict(maxshape=(None,), track_times=False)
    sums, osums = (
        f.create_dataset(name, shape=(0,), dtype=fmt.CHECKSUM_DTYPE, chunks=(fmt.CHECKSUM_CHUNK,), **grown)
        for name in (fmt.CHUNK_CHECKSUMS, fmt.OFFSETS_CHECKSUMS)
    )
    if not fmt.ids_in_shard(version):
        return tokens, offsets, None, None, sums, osums
    ids = f.create_dataset(
        fmt.DOC_IDS,
        shape=(0, fmt.STORED_ID_BYTES_V3),
        maxshape=(None, fmt.STORED_ID_BYTES_V3),
        dtype=fmt.DOC_ID_DTYPE,
        chunks=(fmt.IDS_CHUNK_V3, fmt.STORED_ID_BYTES_V3),
        track_times=False,
    )
    flags = f.create_dataset(fmt.DOC_FLAGS, shape=(0,), dtype=fmt.FLAGS_DTYPE, chunks=(fmt.FLAGS_CHUNK,), **grown)
    return tokens, offsets, ids, flags, sums, osums


def _inner_eos(is_eos: np.ndarray, ends: np.ndarray, lengths: np.ndarray, bos_is_eos: bool) -> int:
    """Position of the first EOS inside a document of a batch (not its last id; with
    ``bos_is_eos``, not its first either), or -1."""
    inner = is_eos.copy()
    inner[ends - 1] = False
    if bos_is_eos:  # BOS = EOS: each document's first id is its BOS
        inner[ends - lengths] = False
    return int(np.argmax(inner)) if inner.any() else -1


def _create_loss_spans(f: h5py.File) -> list[np.ndarray]:
    """Create the optional ``/loss_spans`` dataset (fine-tuning shards) while the file is not yet
    in SWMR mode; the writer fills it at close. Returns the writer's list of pending ranges."""
    f.create_dataset(
        fmt.LOSS_SPANS,
        shape=(0, 2),
        maxshape=(None, 2),
        dtype=fmt.LOSS_SPANS_DTYPE,
        chunks=(fmt.LOSS_SPANS_CHUNK, 2),
        track_times=False,
    )
    return []


class ShardWriter:
    """Append documents to one shard of one split.

    Invariants kept at every flush: ``doc_offsets[-1] <= len(tokens)``; every published document
    ends with ``eos_id`` unless flagged truncated; no ``eos_id`` inside a document.

    Args:
        path: final shard path (``.h5``); the file is written at ``path + ".partial"``.
        split: ``"train"`` or ``"validation"``.
        tokenizer: identity recorded in the root attributes.
        chunk_tokens: tokens per HDF5 chunk and per write (the write buffer holds exactly one chunk).
        compression: optional h5py filter for ``/tokens`` (``"gzip"``, ``"lzf"``, or an hdf5plugin
            filter id); readers decompress transparently but lose the zero-copy read path.
        compression_opts: options for ``compression``.
        fsync: fsync the file before the rename and its folder after it (default). ``False``
            keeps the same bytes and atomic rename, without durability against power loss.
        loss_mask: also store ``/loss_spans`` (fine-tuning: :meth:`add_documents` takes each
            batch's trained-on ranges; docs/FORMAT.md, "Loss masks"), written at :meth:`close`.
        bos_id: the BOS id every document starts with (None: none); when it equals ``eos_id``, an
            EOS at a document's first position is its BOS, not an EOS inside it.
        version: the format version written (:data:`~h5corpus.storage.format.WRITABLE_VERSIONS`):
            4 (default) puts ids and flags in the sidecar, 3 in the shard.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        split: str,
        tokenizer: TokenizerIdentity,
        chunk_tokens: int = fmt.DEFAULT_CHUNK_TOKENS,
        compression: Any = None,
        compression_opts: Any = None,
        fsync: bool = True,
        loss_mask: bool = False,
        bos_id: int | None = None,
        version: int = fmt.FORMAT_VERSION,
    ) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        if version not in fmt.WRITABLE_VERSIONS:
            raise ValueError(f"version must be one of {fmt.WRITABLE_VERSIONS}, got {version!r}")
        self.version = int(version)
        self.final_path = Path(path).absolute()
        self.path = self.final_path.with_name(self.final_path.name + PARTIAL_SUFFIX)
        self.split = split
        self.tokenizer = tokenizer
        self.chunk_tokens = int(chunk_tokens)
        self.dtype = fmt.token_dtype(tokenizer.vocab_size)
        self.eos_id = int(tokenizer.eos_id)
        self.fsync = bool(fsync)
        self.info: ShardRecord | None = None

        attrs = fmt.shard_attrs(
            split=split, dtype=self.dtype, chunk_tokens=chunk_tokens, tokenizer=tokenizer, version=self.version
        )
        self.final_path.parent.mkdir(parents=True, exist_ok=True)
        self._f = f = _create_file(self.path)
        # Raw shards: a deflate pipeline whose filter every full chunk skips (direct writes, filter
        # mask 1), so only the final chunk is compressed. Compressed shards: the caller's filter.
        self._direct = compression is None
        dsets = _create_datasets(f, self.dtype, self.chunk_tokens, compression, compression_opts, self.version)
        self._tokens, self._offsets, self._ids, self._flags, self._sums_ds, self._offsets_sums_ds = dsets
        self._loss: list[np.ndarray] | None = _create_loss_spans(f) if loss_mask else None
        self.bos_id = None if bos_id is None else int(bos_id)
        for k, v in attrs.items():
            f.attrs[k] = _fixed_string(v) if isinstance(v, str) else v
        f.swmr_mode = True  # every object exists; from here on only datasets grow

        self._buf = np.empty(self.chunk_tokens, dtype=self.dtype)
        self._fill = 0  # tokens in _buf
        self._written = 0  # tokens on disk
        self._hash = hashlib.sha256()
        self._sums: list[int] = []  # checksum of every chunk written
        self._sums_published = 0
        # Index kept in memory (40 bytes per document) for the index hash; published lazily.
        self._ends: list[np.ndarray] = []
        self._id_blocks: list[np.ndarray] = []
        self._flag_blocks: list[np.ndarray] = []
        self._n_docs = 0
        self._n_tokens = 0
        self._published = 0  # documents visible to readers
        self._sealed = False  # the final partial chunk is written
        self._closed = False

    # -- context manager: publish only on success ---------------------------------------------
    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __getstate__(self) -> None:
        raise TypeError("ShardWriter holds an open HDF5 file and cannot be pickled; pass the path instead")

    @property
    def documents(self) -> int:
        """Documents added so far."""
        return self._n_docs

    @property
    def tokens(self) -> int:
        """Tokens added so far (buffered ones included)."""
        return self._n_tokens

    # -- appending ------------------------------------------------------------------------------
    def add_document(self, tokens: np.ndarray | list[int], doc_id: bytes, *, truncated: bool = False) -> None:
        """Append one document. ``tokens`` must end with ``eos_id`` (unless ``truncated``) and hold
        no other ``eos_id``; ``doc_id`` is the 32-byte sha256 of the document's UTF-8 text (or the
        16 bytes a version 3 shard stores of it)."""
        a = np.asarray(tokens)
        self.add_documents(
            a,
            np.array([a.size], dtype=np.int64),
            np.frombuffer(doc_id, dtype=np.uint8).reshape(1, -1),
            np.array([fmt.FLAG_TRUNCATED if truncated else 0], dtype=np.uint8),
        )

    def add_documents(
        self,
        flat: np.ndarray,
        lengths: np.ndarray,
        doc_ids: np.ndarray,
        flags: np.ndarray | None = None,
        loss_spans: np.ndarray | None = None,
    ) -> None:
        """Append a batch of documents given as one flat id array and per-document ``lengths`` (tokens).

        ``doc_ids`` is uint8 (n, 32) (sha256 of each text; the shard stores the first 16 bytes) or
        (n, 16) (ids read from a version 3 shard); ``flags`` uint8 (n,) of ``FLAG_*`` bits (default 0). The batch is
        checked as a whole (ids in range, EOS exactly at each untruncated end) before anything is
        buffered, so a bad document leaves the shard as it was. ``loss_spans`` (a writer made with
        ``loss_mask=True`` only, and then required): (k, 2) int64 trained-on ``[start, end)`` ranges
        in positions of ``flat`` (:func:`~h5corpus.storage.format.loss_span_problems`).
        """
        if self._closed:
            raise RuntimeError(f"{self.final_path}: writer is closed")
        if self._sealed:
            raise RuntimeError(f"{self.final_path}: the final partial chunk is written; no document can follow it")
        lengths = np.asarray(lengths, dtype=np.int64)
        n = lengths.size
        doc_ids = np.asarray(doc_ids, dtype=np.uint8).reshape(n, -1) if n else np.zeros((0, fmt.DOC_ID_BYTES), np.uint8)
        if doc_ids.shape[1] not in (fmt.DOC_ID_BYTES, fmt.STORED_ID_BYTES_V3):
            raise ValueError(f"{self.final_path}: document ids must be 32 or 16 bytes, got {doc_ids.shape[1]}")
        doc_ids = doc_ids[:, : fmt.STORED_ID_BYTES_V3]
        flags = np.zeros(n, dtype=np.uint8) if flags is None else np.asarray(flags, dtype=np.uint8)
        flat = np.asarray(flat)
        if n == 0:
            return
        if flat.ndim != 1 or flat.size != int(lengths.sum()):
            raise ValueError(f"{self.final_path}: flat tokens ({flat.size}) != sum of lengths ({int(lengths.sum())})")
        if (lengths <= 0).any():
            raise ValueError(f"{self.final_path}: empty document at batch index {int(np.argmax(lengths <= 0))}")
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.tokenizer.vocab_size):
            raise ValueError(
                f"{self.final_path}: token id out of range [0, {self.tokenizer.vocab_size}) "
                f"(min {int(flat.min())}, max {int(flat.max())})"
            )
        ends = np.cumsum(lengths)
        is_eos = flat == self.eos_id
        trunc = (flags & fmt.FLAG_TRUNCATED) != 0
        last_is_eos = is_eos[ends - 1]
        bad_end = np.flatnonzero(~trunc & ~last_is_eos)
        if bad_end.size:
            i = int(bad_end[0])
            raise ValueError(
                f"{self.final_path}: document {doc_ids[i].tobytes().hex()[:16]} does not end with EOS {self.eos_id}"
            )
        if int(is_eos.sum()) != int(last_is_eos.sum()):
            self._refuse_inner_eos(is_eos, ends, lengths, doc_ids)
        self._check_loss_spans(loss_spans, ends, lengths)
        self._ends.append(self._n_tokens + ends)
        self._id_blocks.append(doc_ids.copy())
        self._flag_blocks.append(flags.copy())
        self._n_docs += n
        self._n_tokens += int(ends[-1])
        self._append_tokens(flat.astype(self.dtype, copy=False))

    def _refuse_inner_eos(self, is_eos: np.ndarray, ends: np.ndarray, lengths: np.ndarray, doc_ids: np.ndarray) -> None:
        """Raise naming the first document with an EOS inside it (a BOS equal to EOS excepted)."""
        pos = _inner_eos(is_eos, ends, lengths, self.bos_id == self.eos_id)
        if pos >= 0:
            i = int(np.searchsorted(ends, pos, side="right"))
            raise ValueError(
                f"{self.final_path}: document {doc_ids[i].tobytes().hex()[:16]} has EOS {self.eos_id} inside it"
            )

    def _check_loss_spans(self, spans: np.ndarray | None, ends: np.ndarray, lengths: np.ndarray) -> None:
        """Check a batch's trained-on ranges (positions of the batch) and keep them in shard
        positions; a writer without ``loss_mask`` takes none, one with it needs them."""
        if self._loss is None:
            if spans is not None:
                raise ValueError(f"{self.final_path}: loss_spans given to a writer made without loss_mask=True")
            return
        if spans is None:
            raise ValueError(f"{self.final_path}: a writer made with loss_mask=True needs loss_spans for every batch")
        s = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        offsets = np.concatenate([np.zeros(1, np.int64), ends])
        bad = fmt.loss_span_problems(s, offsets)
        if bad:
            raise ValueError(f"{self.final_path}: {bad[0].message}")
        self._loss.append(s + self._n_tokens)  # ranges never cross a document: batches never touch

    def _append_tokens(self, a: np.ndarray) -> None:
        i = 0
        while i < a.size:
            take = min(self.chunk_tokens - self._fill, a.size - i)
            self._buf[self._fill : self._fill + take] = a[i : i + take]
            self._fill += take
            i += take
            if self._fill == self.chunk_tokens:
                self._flush_buffer()

    def _flush_buffer(self) -> None:
        """Write the buffered tokens (one chunk, or the final partial one) and their checksum, then
        publish the documents they complete: tokens first, checksums next, ids and flags next,
        offsets last."""
        if self._fill:
            start, real = self._written, self._buf[: self._fill]
            self._tokens.id.set_extent((start + self._fill,))
            if not self._direct:
                self._sealed = self._fill < self.chunk_tokens
                self._tokens[start : start + self._fill] = real
            elif self._fill == self.chunk_tokens:
                self._tokens.id.write_direct_chunk((start,), self._buf, filter_mask=1)
            else:  # the final partial chunk: zero padding, in a deflate stream a reader maps
                self._sealed = True
                self._buf[self._fill :] = 0
                tail = fmt.stored_tail_chunk(self._buf, self._fill * self.dtype.itemsize)
                self._tokens.id.write_direct_chunk((start,), tail, filter_mask=0)
            fmt.tokens_sha256_update(self._hash, real)
            self._sums.append(fmt.chunk_checksum(real))
            self._written += self._fill
            self._fill = 0
            self._tokens.id.flush()
        self._publish()

    def _all_ends(self) -> np.ndarray:
        if len(self._ends) > 1:
            self._ends = [np.concatenate(self._ends)]
            self._id_blocks = [np.concatenate(self._id_blocks)]
            self._flag_blocks = [np.concatenate(self._flag_blocks)]
        return self._ends[0] if self._ends else np.zeros(0, dtype=np.int64)

    def _publish(self) -> None:
        ends = self._all_ends()
        upto = int(np.searchsorted(ends, self._written, side="right"))
        if upto <= self._published:
            return
        lo = self._published
        sums, offsets = self._sums_ds.id, self._offsets.id
        if self._sums_published < len(self._sums):
            sums.set_extent((len(self._sums),))
            _write_rows(sums, self._sums_published, np.array(self._sums[self._sums_published :], fmt.CHECKSUM_DTYPE))
            sums.flush()
            self._sums_published = len(self._sums)
        if self._ids is not None:  # version 3: ids and flags before the offsets that expose them
            ids, flags = self._ids.id, self._flags.id
            ids.set_extent((upto, fmt.STORED_ID_BYTES_V3))
            _write_rows(ids, lo, self._id_blocks[0][lo:upto])
            flags.set_extent((upto,))
            _write_rows(flags, lo, self._flag_blocks[0][lo:upto])
            ids.flush()
            flags.flush()
        offsets.set_extent((upto + 1,))
        _write_rows(offsets, lo + 1, ends[lo:upto])
        offsets.flush()
        self._published = upto

    # -- finishing ------------------------------------------------------------------------------
    def close(self) -> ShardRecord:
        """Write the final partial chunk and the rest of the index, fsync (unless ``fsync=False``),
        rename into place."""
        if self._closed:
            assert self.info is not None
            return self.info
        self._flush_buffer()
        ends = self._all_ends()
        offsets = np.concatenate([np.zeros(1, dtype=np.int64), ends])
        ids = self._id_blocks[0] if self._id_blocks else np.zeros((0, fmt.STORED_ID_BYTES_V3), np.uint8)
        flags = self._flag_blocks[0] if self._flag_blocks else np.zeros(0, np.uint8)
        offsets_sums = fmt.chunk_checksums(offsets, fmt.OFFSETS_CHUNK_V3)
        osums = self._offsets_sums_ds.id
        osums.set_extent((offsets_sums.size,))
        _write_rows(osums, 0, offsets_sums)
        osums.flush()
        loss = self._write_loss_spans()
        self._f.close()
        self._closed = True
        if self.fsync:
            with open(self.path, "rb+") as fh:
                os.fsync(fh.fileno())
        nbytes = self.path.stat().st_size
        chunk_sums = np.array(self._sums, fmt.CHECKSUM_DTYPE)
        if self._ids is not None:
            index, docs = fmt.index_sha256(offsets, ids, flags, chunk_sums, offsets_sums), None
        else:  # version 4: the sidecar, in place before the shard (a finished shard has its sidecar)
            index = fmt.index_sha256_v4(offsets, chunk_sums, offsets_sums)
            docs = fmt.encode_docs(
                ids, flags, tokens=self._written, tokens_sha256=self._hash.hexdigest(), index_sha=index
            )
            self._write_docs(docs)
        os.replace(self.path, self.final_path)
        if self.fsync:
            fsync_dir(self.final_path.parent)
        self.info = ShardRecord(
            path=self.final_path.as_posix(),
            split=self.split,
            tokens=self._written,
            documents=self._n_docs,
            sha256=self._hash.hexdigest(),
            index_sha256=index,
            bytes=nbytes,
            sums_sha256=fmt.sums_sha256(chunk_sums, offsets_sums),
            loss_sha256=None if loss is None else fmt.loss_spans_sha256(loss),
            loss_spans=0 if loss is None else int(loss.shape[0]),
            docs_sha256=None if docs is None else hashlib.sha256(docs).hexdigest(),
            docs_bytes=0 if docs is None else len(docs),
        )
        return self.info

    @property
    def docs_path(self) -> Path:
        """Where a version 4 shard's sidecar goes (:func:`~h5corpus.storage.format.docs_path`)."""
        return fmt.docs_path(self.final_path)

    def _write_docs(self, data: bytes) -> None:
        """Write the sidecar at ``<docs path>.partial``, fsync it (unless ``fsync=False``) and rename
        it into place."""
        part = self.docs_path.with_name(self.docs_path.name + PARTIAL_SUFFIX)
        try:
            with open(part, "wb") as fh:
                fh.write(data)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(part, self.docs_path)
        except BaseException:
            part.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)
            raise

    def _write_loss_spans(self) -> np.ndarray | None:
        """Write ``/loss_spans`` (a ``loss_mask`` writer, at close); returns the ranges."""
        if self._loss is None:
            return None
        spans = np.concatenate(self._loss) if self._loss else np.zeros((0, 2), np.int64)
        ds = self._f[fmt.LOSS_SPANS]
        ds.resize((spans.shape[0], 2))
        if spans.size:
            ds[:] = spans
        ds.flush()
        return spans

    def abort(self) -> None:
        """Close and delete the partial file; nothing is published."""
        if not self._closed:
            self._closed = True
            try:
                self._f.close()
            finally:
                self.path.unlink(missing_ok=True)
                self.docs_path.with_name(self.docs_path.name + PARTIAL_SUFFIX).unlink(missing_ok=True)
