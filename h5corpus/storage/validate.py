"""Prove a built corpus intact: recompute every hash and check every structural promise.

:func:`validate_corpus` is a library function that returns findings; the CLI maps them to exit
codes (0 intact, 1 corrupt, 2 usage error). Shards are checked in parallel threads (sha256 releases
the GIL), each shard read once, in chunk-aligned blocks of a memory map, through sha256, so memory
stays bounded and a worker costs about what ``hashlib.sha256`` alone does (docs/BENCHMARKS.md).
Compressed shards, whose decoding holds h5py's global lock, are checked in spawned processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import stat
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from . import format as fmt
from .format import PARTIAL_SUFFIX, FormatError, ShardExpectation, ShardRecord
from .manifest import Manifest, read_manifest, table_manifest

#: Tokens read per block while hashing (a multiple of every power-of-two chunk size up to it).
HASH_BLOCK_TOKENS = 1 << 22


@dataclass(frozen=True)
class Finding:
    """One broken promise. ``shard`` is the manifest path of the shard, or None for the manifest."""

    shard: str | None
    code: str
    """Short machine-readable kind: missing, unlisted, size, unreadable, format, attrs, tokens,
    offsets, index, checksums, sha256, index_sha256, chunk_checksum, eos, range, manifest."""
    message: str

    def __str__(self) -> str:
        return f"{self.shard or '<manifest>'}: {self.code}: {self.message}"


@dataclass
class ValidationReport:
    """Outcome of :func:`validate_corpus`."""

    manifest: str
    shards: int = 0
    tokens: int = 0
    bytes_hashed: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def failing_shards(self) -> list[str]:
        return sorted({f.shard for f in self.findings if f.shard})

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest,
            "ok": self.ok,
            "shards": self.shards,
            "tokens": self.tokens,
            "bytes_hashed": self.bytes_hashed,
            "failing_shards": self.failing_shards,
            "findings": [asdict(f) for f in self.findings],
        }


def _token_blocks(ds: h5py.Dataset, path: str, n_tokens: int, fresh: bool = False):
    """Yield (start, array) blocks covering ``ds[0:n_tokens]`` in order.

    Chunks stored raw are viewed straight from a read-only memory map of the file at the chunk
    byte offsets HDF5 reports (:func:`h5corpus.storage.format.chunk_byte_layout`), runs of chunks that are
    contiguous in the file cut into blocks of at most :data:`HASH_BLOCK_TOKENS`; a version 2
    shard's compressed final chunk, and anything else (compressed shards, or an odd layout a corrupt
    file may have) is read through h5py into one reused buffer, or a fresh one per block when
    ``fresh`` (a consumer on another thread may still hold the previous block). Every block starts
    on a chunk boundary.
    """
    if not n_tokens:
        return
    offsets, _ = fmt.chunk_byte_layout(ds, n_tokens, os.path.getsize(path)) if ds.chunks else (None, "")
    if offsets is not None:
        chunk, itemsize = ds.chunks[0], ds.dtype.itemsize
        per_block = max(HASH_BLOCK_TOKENS // chunk, 1)
        raw = offsets[:-1] if offsets[-1] < 0 else offsets
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            # a new run starts where a chunk does not follow the previous one in the file
            breaks = np.flatnonzero(np.diff(raw) != chunk * itemsize) + 1
            for lo, hi in zip(np.r_[0, breaks].tolist(), np.r_[breaks, raw.size].tolist()):
                for k in range(lo, hi, per_block):
                    a, b = k * chunk, min(min(hi, k + per_block) * chunk, n_tokens)
                    yield a, np.frombuffer(mm, dtype=ds.dtype, count=b - a, offset=int(raw[k]))
        finally:
            try:
                mm.close()
            except BufferError:  # views still alive; the map closes when they are collected
                pass
        if raw.size < offsets.size:  # the compressed final chunk
            a = raw.size * chunk
            tail = np.empty(n_tokens - a, dtype=ds.dtype)
            ds.read_direct(tail, source_sel=np.s_[a:n_tokens])
            yield a, tail
        return
    chunk = ds.chunks[0] if ds.chunks else n_tokens
    block = max(HASH_BLOCK_TOKENS // chunk, 1) * chunk
    buf = None
    for a in range(0, n_tokens, block):
        b = min(a + block, n_tokens)
        if buf is None or fresh:
            buf = np.empty(min(block, n_tokens), dtype=ds.dtype)
        view = buf[: b - a]
        ds.read_direct(view, source_sel=np.s_[a:b], dest_sel=np.s_[0 : b - a])
        yield a, view


@dataclass(frozen=True)
class TokenScan:
    """What one pass over a shard's ``/tokens`` found (see :func:`hash_shard_tokens`)."""

    sha256: str
    """Hex sha256 of the tokens as little-endian bytes."""
    bad_ends: int
    """Positions in ``ends`` that do not hold EOS."""
    first_bad_end: int
    """The first such token position, or -1."""
    eos_count: int | None
    """EOS ids anywhere in the tokens; None unless ``deep``."""
    max_id: int | None
    """Largest token id (-1 for no tokens)."""
    bad_chunks: tuple[int, ...] = ()
    """Chunks whose tokens do not match their stored checksum (version 2)."""


def _deep_scan(ds: h5py.Dataset, path: str, n_tokens: int, eos_id: int, h: Any, visit: Any) -> tuple[int, int]:
    """The ``deep`` pass of :func:`hash_shard_tokens`: one helper thread feeds ``h`` (sha256
    releases the GIL) while this thread counts EOS ids, takes the largest id and calls
    ``visit(start, block)``. Returns (EOS count, largest id or -1)."""
    eos_count, max_id = 0, -1
    with ThreadPoolExecutor(1) as hasher:
        pending = []
        for a, view in _token_blocks(ds, path, n_tokens, fresh=True):
            if len(pending) >= 4:
                pending.pop(0).result()
            pending.append(hasher.submit(fmt.tokens_sha256_update, h, view))
            eos_count += int(np.count_nonzero(view == eos_id))
            max_id = max(max_id, int(view.max()))
            visit(a, view)
        for p in pending:
            p.result()
    return eos_count, max_id


def hash_shard_tokens(
    ds: h5py.Dataset,
    path: str,
    n_tokens: int,
    eos_id: int,
    ends: np.ndarray,
    *,
    deep: bool = False,
    checksums: np.ndarray | None = None,
) -> TokenScan:
    """Stream ``ds[0:n_tokens]`` once through sha256, check EOS at ``ends`` and (``checksums``:
    version 2) each chunk's xxh3-64 against its stored checksum.

    ``ends`` are sorted token positions that must hold ``eos_id`` (last token of each whole
    document); they are gathered from each block right after it is hashed, while it is still in
    cache, so the default pass costs about what sha256 alone does (one read of the data, one
    thread: with N workers on N cores, any second scan would show up as lost throughput).

    The largest id is taken from each block too (a max: a few percent of the sha256's cost), so
    the default pass refuses ids at or above ``vocab_size``. ``deep`` adds a full scan per block
    (EOS count) on the calling thread while a helper thread hashes.
    """
    h = hashlib.sha256()
    bad_ends, first_bad = 0, -1
    eos_count = max_id = None
    bad_chunks: list[int] = []
    C = ds.chunks[0] if ds.chunks else max(n_tokens, 1)

    def check_chunks(a: int, view: np.ndarray) -> None:
        if checksums is not None:
            got = fmt.chunk_checksums(view, C)
            k0 = a // C
            want = checksums[k0 : k0 + got.size]
            if want.size != got.size or (got != want).any():
                miss = np.flatnonzero(got[: want.size] != want).tolist() + list(range(want.size, got.size))
                bad_chunks.extend(k0 + k for k in miss)

    def gather(a: int, view: np.ndarray) -> None:
        nonlocal bad_ends, first_bad
        lo, hi = np.searchsorted(ends, (a, a + view.size)).tolist()
        if hi > lo:
            miss = view[ends[lo:hi] - a] != eos_id
            if miss.any():
                miss = np.flatnonzero(miss)
                if not bad_ends:
                    first_bad = int(ends[lo + miss[0]])
                bad_ends += int(miss.size)

    if not deep:
        max_id = -1
        for a, view in _token_blocks(ds, path, n_tokens):
            fmt.tokens_sha256_update(h, view)
            gather(a, view)
            check_chunks(a, view)
            if view.size:
                max_id = max(max_id, int(view.max()))
        return TokenScan(h.hexdigest(), bad_ends, first_bad, None, max_id, tuple(bad_chunks))

    eos_count, max_id = _deep_scan(ds, path, n_tokens, eos_id, h, lambda a, v: (gather(a, v), check_chunks(a, v)))
    return TokenScan(h.hexdigest(), bad_ends, first_bad, eos_count, max_id, tuple(bad_chunks))


class _Scratch(threading.local):
    """Per-thread buffers the index datasets are read into, reused from shard to shard: fresh
    memory costs a page fault per 4 KiB, as much as hashing the index itself."""

    def __init__(self) -> None:
        self.bufs: dict[str, np.ndarray] = {}

    def array(self, key: str, size: int, dtype: Any) -> np.ndarray:
        """An uninitialised 1-D array of ``size`` items, valid until the next call with ``key``."""
        dt = np.dtype(dtype)
        buf = self.bufs.get(key)
        if buf is None or buf.nbytes < size * dt.itemsize:
            buf = self.bufs[key] = np.empty(size * dt.itemsize + (size * dt.itemsize >> 3), np.uint8)
        return buf[: size * dt.itemsize].view(dt)

    def read(self, ds: h5py.Dataset) -> np.ndarray:
        """``ds[()]`` as an array that stays valid until the next read of a dataset of that name."""
        dt, shape = ds.dtype, ds.shape
        if dt.hasobject or dt.kind not in "biuf" or shape is None or not shape:
            return np.asarray(ds[()])  # odd dtype or scalar: a corrupt file; no fast path needed
        out = self.array(ds.name, int(np.prod(shape, dtype=np.int64)), dt).reshape(shape)
        if out.size:
            ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
        return out


def check_shard(
    path: str,
    entry: ShardRecord,
    expect: ShardExpectation,
    *,
    deep: bool = False,
    scratch: _Scratch | None = None,
    sidecar: bool = True,
) -> tuple[list[Finding], int]:
    """Check one shard file against its manifest entry; return (findings, bytes hashed).

    ``deep`` adds the full-scan checks (every id below ``vocab_size``, no EOS inside a document);
    see :func:`hash_shard_tokens`. ``scratch`` (internal) reuses index buffers across calls.
    ``sidecar=False``: a version 4 shard's sidecar is not checked (nor, then, the end of each
    document, which its flags say); for a shard file proven alone, e.g. one just downloaded."""
    if not sidecar:
        entry = dataclasses.replace(entry, docs_sha256=None)
    found = _check_shard(path, entry, expect, deep, scratch or _Scratch(), defer_filtered=False)
    assert found is not None
    return found


def _check_shard(
    path: str, entry: ShardRecord, expect: ShardExpectation, deep: bool, scratch: _Scratch, defer_filtered: bool
) -> tuple[list[Finding], int] | None:
    """:func:`check_shard`; None when ``defer_filtered`` and ``/tokens`` is compressed (decoding
    holds h5py's global lock, so the caller checks such shards in processes instead). Any OS error
    on the path is one finding naming it."""
    name = entry.path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return [Finding(name, "missing", f"shard file not found at {path}")], 0
    except OSError as e:
        return [Finding(name, "unreadable", f"cannot stat {path} ({e.strerror or e})")], 0
    if not stat.S_ISREG(st.st_mode):
        return [Finding(name, "unreadable", f"{path} is not a regular file")], 0
    out: list[Finding] = []
    if st.st_size != entry.bytes:
        msg = f"file is {st.st_size:,} bytes, manifest says {entry.bytes:,} (truncated or replaced?)"
        out.append(Finding(name, "size", msg))
    elif entry.file_sha256 is not None and fmt.file_sha256(path) != entry.file_sha256:  # optional key
        out.append(Finding(name, "file_sha256", "the file's sha256 differs from the manifest's file_sha256"))
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        return [*out, Finding(name, "unreadable", f"cannot open as HDF5 ({e})")], 0
    with f:
        try:
            return _check_open_shard(f, path, entry, expect, deep, scratch, defer_filtered, out)
        except FormatError as e:
            return [*out, Finding(name, "format", str(e).split(": ", 1)[-1])], 0
        except (OSError, KeyError, ValueError, RuntimeError) as e:  # RuntimeError: corrupt HDF5 metadata
            return [*out, Finding(name, "unreadable", f"read failed ({e})")], 0


def _stored_problems(f: h5py.File, expect: ShardExpectation, entry: ShardRecord, n: int) -> list[fmt.Problem]:
    """What the file stores against what it claims, from shapes and chunk indexes alone, before
    any work proportional to the claim: every ``/tokens`` chunk allocated (a dataset resized
    without writing chunks reads as fill values), and (version 3) the index layout."""
    if expect.version >= 3:
        return fmt.v3_index_layout_problems(f, n, entry.documents, expect.chunk_tokens)
    t = f[fmt.TOKENS]
    have, want = t.id.get_num_chunks(), -(-n // expect.chunk_tokens)
    if have != want:
        return [fmt.Problem("tokens", f"/tokens has {have:,} chunks stored, {n:,} tokens need {want:,}", fatal=True)]
    return []


def _check_open_shard(
    f: h5py.File,
    path: str,
    entry: ShardRecord,
    expect: ShardExpectation,
    deep: bool,
    scratch: _Scratch,
    defer_filtered: bool,
    out: list[Finding],
) -> tuple[list[Finding], int] | None:
    """:func:`_check_shard` on the open file: attributes, datasets, index, then one pass over the
    tokens (hashes, chunk checksums, EOS at every end, the id range)."""
    name = entry.path
    attrs = fmt.check_attrs(f.attrs, name)
    out.extend(Finding(name, pr.code, pr.message) for pr in expect.attr_problems(attrs, entry.split))
    layout = fmt.dataset_problems(f, expect)
    out.extend(Finding(name, pr.code, pr.message) for pr in layout)
    if any(pr.fatal for pr in layout):
        return out, 0
    tokens = f[fmt.TOKENS]
    n = tokens.shape[0]
    if n != entry.tokens:
        out.append(Finding(name, "tokens", f"/tokens holds {n:,} tokens, manifest says {entry.tokens:,}"))
    stored = _stored_problems(f, expect, entry, n)
    out.extend(Finding(name, pr.code, pr.message) for pr in stored)
    if any(pr.fatal for pr in stored):
        return out, 0
    if defer_filtered and tokens.id.get_create_plist().get_nfilters():
        return None
    offsets, flags, sums, structure_ok = _check_index(f, path, entry, expect, n, scratch, out)
    ends = np.zeros(0, dtype=np.int64)
    docs = offsets.size - 1
    if flags is None:  # a version 4 sidecar that failed: which documents are truncated is unknown
        structure_ok = False
    if structure_ok and docs > 0:
        ends = np.subtract(offsets[1:], 1, out=scratch.array("ends", docs, np.int64))
        whole = (flags & fmt.FLAG_TRUNCATED) == 0
        if not whole.all():
            ends = ends[whole]
        ends = ends[int(np.searchsorted(ends, 0)) :]  # sorted: only a leading empty document is < 0
    if sums is not None and sums.size != -(-n // expect.chunk_tokens):
        sums = None  # already reported; nothing to compare chunk by chunk
    scan = hash_shard_tokens(tokens, path, n, expect.eos_id, ends, deep=deep, checksums=sums)
    out.extend(_scan_findings(scan, entry, expect, n, offsets if structure_ok else None, ends.size))
    return out, n * np.dtype(expect.dtype).itemsize


def _sidecar(path: str, entry: ShardRecord, docs: int, out: list[Finding]) -> tuple[np.ndarray, np.ndarray | None]:
    """A version 4 shard's ids and flags from its sidecar (``<path>.docs``), proven against the
    manifest (:func:`~h5corpus.storage.format.docs_problems`); a missing, unreadable or unproven
    sidecar is one ``docs`` finding, and then zero ids and flags None (unknown)."""
    side, unknown = fmt.docs_path(path), np.zeros((max(docs, 0), fmt.STORED_ID_BYTES_V3), np.uint8)
    if entry.docs_sha256 is None:  # not checked (``check_shard(sidecar=False)``; a manifest requires it)
        return unknown, None
    try:
        data = side.read_bytes()
    except FileNotFoundError:
        data, msg = None, f"its document sidecar {side.name} is missing"
    except OSError as e:
        data, msg = None, f"cannot read its document sidecar {side.name} ({e.strerror or e})"
    if data is not None:
        bad = fmt.docs_problems(data, entry)
        if not bad:
            ids, flags = fmt.decode_docs(data)
            return ids, flags
        msg = f"{side.name}: {bad[0].message}"
    out.append(Finding(entry.path, "docs", msg))
    return unknown, None


def _check_index(
    f: h5py.File,
    path: str,
    entry: ShardRecord,
    expect: ShardExpectation,
    n: int,
    scratch: _Scratch,
    out: list[Finding],
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, bool]:
    """The index datasets: structure, the chunk checksum tables (version 3: each offsets chunk's
    checksum recomputed, both tables against ``sums_sha256``), ``index_sha256`` and (version 4)
    the sidecar. Appends findings to ``out``; returns offsets, flags (None: unknown), token chunk
    checksums and whether the structure holds."""
    name, v = entry.path, expect.version
    offsets = scratch.read(f[fmt.DOC_OFFSETS])
    docs = offsets.size - 1
    if fmt.ids_in_shard(v):
        ids, flags = (scratch.read(f[k]) for k in (fmt.DOC_IDS, fmt.DOC_FLAGS))
    else:
        ids, flags = _sidecar(path, entry, docs, out)
    if docs != entry.documents:
        out.append(
            Finding(name, "offsets", f"/doc_offsets lists {docs:,} documents, manifest says {entry.documents:,}")
        )
    flags_or_zero = flags if flags is not None else np.zeros(max(docs, 0), np.uint8)
    problems = fmt.check_index(offsets, ids, flags_or_zero, num_tokens=n, id_bytes=fmt.stored_id_bytes(v))
    sums = scratch.read(f[fmt.CHUNK_CHECKSUMS]) if v >= 2 else None
    osums = scratch.read(f[fmt.OFFSETS_CHECKSUMS]) if v >= 3 else None
    if sums is not None:
        problems += fmt.checksum_problems(sums.size, n, expect.chunk_tokens)
    if osums is not None:
        problems += fmt.checksum_problems(osums.size, offsets.size, fmt.OFFSETS_CHUNK_V3, fmt.OFFSETS_CHECKSUMS)
        want = fmt.chunk_checksums(offsets, fmt.OFFSETS_CHUNK_V3)
        if want.size == osums.size and (want != osums).any():
            k = int(np.flatnonzero(want != osums)[0])
            out.append(Finding(name, "offsets_checksum", f"chunk {k:,} of /doc_offsets fails its checksum"))
        if sums is not None and fmt.sums_sha256(sums, osums) != entry.sums_sha256:
            out.append(
                Finding(name, "sums_sha256", "checksum tables (chunk_xxh3, offsets_xxh3) differ from the manifest")
            )
    out.extend(Finding(name, pr.code, pr.message) for pr in problems)
    if not fmt.ids_in_shard(v):
        index = fmt.index_sha256_v4(offsets, sums, osums)  # type: ignore[arg-type]
    else:
        index = fmt.index_sha256(offsets, ids, flags_or_zero, sums, osums)
    if index != entry.index_sha256:
        covered = ", ".join(fmt.datasets_of(v)[1:])
        out.append(Finding(name, "index_sha256", f"index hash ({covered}) differs from the manifest"))
    return offsets, flags, sums, not problems


def _scan_findings(
    scan: TokenScan, entry: ShardRecord, expect: ShardExpectation, n: int, offsets: np.ndarray | None, n_ends: int
) -> list[Finding]:
    """Findings of one pass over a shard's tokens (``offsets`` None: the index is broken, so
    document ends are not judged; ``n_ends``: the EOS ids the documents should hold)."""
    name, out = entry.path, []
    if scan.sha256 != entry.sha256:
        msg = f"token hash {scan.sha256[:16]}... differs from the manifest's {entry.sha256[:16]}..."
        out.append(Finding(name, "sha256", msg))
    if scan.bad_chunks:
        k, C = scan.bad_chunks[0], expect.chunk_tokens
        msg = (
            f"{len(scan.bad_chunks):,} chunks of /tokens fail their checksum (first: chunk {k:,}, "
            f"tokens [{k * C:,}, {min((k + 1) * C, n):,}))"
        )
        out.append(Finding(name, "chunk_checksum", msg))
    if scan.max_id is not None and scan.max_id >= expect.vocab_size:
        out.append(Finding(name, "range", f"token id {scan.max_id:,} >= vocab_size {expect.vocab_size:,}"))
    if offsets is None:
        return out
    if scan.bad_ends:
        doc = int(np.searchsorted(offsets, scan.first_bad_end, side="right")) - 1
        msg = (
            f"{scan.bad_ends:,} documents do not end with EOS {expect.eos_id} "
            f"(first: document {doc:,}, token {scan.first_bad_end:,})"
        )
        out.append(Finding(name, "eos", msg))
    elif scan.eos_count is not None and scan.eos_count != n_ends:
        out.append(Finding(name, "eos", f"{scan.eos_count - n_ends:,} EOS ids inside documents"))
    return out


def _check_shard_job(args: tuple[str, ShardRecord, ShardExpectation, bool]) -> tuple[list[Finding], int]:
    """Process-pool entry point (compressed shards)."""
    path, entry, expect, deep = args
    return check_shard(path, entry, expect, deep=deep)


def unlisted_shard_files(manifest: Manifest, pattern: str = "*.h5") -> list[Path]:
    """Files matching ``pattern`` (default ``*.h5``) that the manifest does not list, in the
    corpus's folders: each split's folder under the recorded ``shards_dir`` and the folder of every
    listed shard (not recursive: a build writes nothing deeper, and a folder above could hold
    anything). OSError when a folder cannot be listed."""
    listed = {manifest.shard_path(s) for s in manifest.shards}
    found = (p.absolute() for d in manifest.split_folders() if d.is_dir() for p in d.glob(pattern))
    return sorted(p for p in dict.fromkeys(found) if p not in listed and p.is_file())


def _split_total_findings(m: Manifest) -> list[Finding]:
    """Split totals the manifest records that differ from the sum of its shards'."""
    out = []
    for split, fig in m.splits.items():
        if isinstance(fig, dict) and "tokens" in fig:
            have = sum(s.tokens for s in m.shards_of(split))
            if int(fig["tokens"]) != have:
                msg = f"splits.{split}.tokens = {fig['tokens']:,} but its shards hold {have:,}"
                out.append(Finding(None, "manifest", msg))
    return out


def stray_findings(m: Manifest) -> list[Finding]:
    """Files in the corpus's folders that are not its shards: unlisted ``*.h5`` files, and
    ``.partial`` files (unfinished writes), beside a listed shard or matching none. An OS error
    (a path too long, a folder without permission) is one finding naming the path."""
    out: list[Finding] = []
    try:
        for p in unlisted_shard_files(m):
            out.append(
                Finding(os.path.relpath(p, m.root), "unlisted", "shard file present but not listed in the manifest")
            )
        sides = {fmt.docs_path(m.shard_path(s)) for s in m.shards if s.docs_sha256 is not None}
        for p in unlisted_shard_files(m, "*" + fmt.DOCS_SUFFIX):
            if p not in sides:
                msg = "a document sidecar whose shard the manifest does not list"
                out.append(Finding(os.path.relpath(p, m.root), "unlisted", msg))
        beside = {m.shard_path(s).with_name(m.shard_path(s).name + PARTIAL_SUFFIX): s.path for s in m.shards}
        beside.update(
            {p.with_name(p.name + PARTIAL_SUFFIX): s.path for s in m.shards for p in [fmt.docs_path(m.shard_path(s))]}
        )
        for p in unlisted_shard_files(m, "*" + PARTIAL_SUFFIX):
            if p in beside:
                out.append(Finding(beside[p], "partial", f"an unfinished write is lying beside it ({p.name})"))
            else:
                msg = "an unfinished write (.partial) matching no listed shard: a build died or is running"
                out.append(Finding(os.path.relpath(p, m.root), "partial", msg))
    except OSError as e:
        out.append(
            Finding(None, "unreadable", f"cannot list the corpus's folders: {e.filename or ''} ({e.strerror or e})")
        )
    return out


def _check_all(
    jobs: list[tuple[str, ShardRecord, ShardExpectation, bool]], n_workers: int, deep: bool, record: Any
) -> None:
    """Check every shard of ``jobs``; ``record(findings, nbytes)`` takes each result."""
    scratch = _Scratch()
    deferred: list[tuple[str, ShardRecord, ShardExpectation, bool]] = []
    if n_workers == 1:
        for j in jobs:
            record(*check_shard(*j[:3], deep=deep, scratch=scratch))
        return
    # Threads, not processes: sha256 and the memory map release the GIL, so N threads hash at N x
    # one core's speed with no fork, no copy-on-write faults and no worker start-up.
    with ThreadPoolExecutor(n_workers, thread_name_prefix="validate") as ex:
        futs = {ex.submit(_check_shard, *j, scratch, True): j for j in jobs}
        for fut in as_completed(futs):
            got = fut.result()
            if got is None:
                deferred.append(futs[fut])
            else:
                record(*got)
    _check_deferred(deferred, n_workers, deep, scratch, record)


def _check_deferred(
    deferred: list[tuple[str, ShardRecord, ShardExpectation, bool]],
    n_workers: int,
    deep: bool,
    scratch: _Scratch,
    record: Any,
) -> None:
    """Check compressed shards (decoding holds h5py's global lock): in spawned processes, never
    forked (this process has used HDF5 and may run other threads, e.g. a progress bar's); here,
    one at a time, when there is one or the pool breaks. ``record(findings, nbytes)`` takes each."""
    if len(deferred) == 1:
        record(*check_shard(*deferred[0][:3], deep=deep, scratch=scratch))
        return
    left = list(deferred)
    try:
        if deferred:
            with ProcessPoolExecutor(min(n_workers, len(deferred)), mp_context=get_context("spawn")) as ex:
                futs = {ex.submit(_check_shard_job, j): j for j in deferred}
                for fut in as_completed(futs):
                    record(*fut.result())
                    left.remove(futs[fut])
    except BrokenProcessPool:
        # a child could not start (e.g. a caller's unguarded __main__ under spawn) or died
        for j in left:
            record(*check_shard(*j[:3], deep=deep, scratch=scratch))


def validate_corpus(
    manifest_path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    progress: bool = False,
    deep: bool = False,
) -> ValidationReport:
    """Check every shard of a manifest: presence, size, format, structure, EOS at every document
    end, and both hashes; also report shard files the manifest does not list.

    ``workers`` threads (default: all cores) check one shard each at a time, each reading its
    shard once (memory-mapped) at about ``hashlib.sha256`` speed; sha256 and the reads release the
    GIL. Compressed shards, whose decoding holds h5py's lock, are checked in spawned processes. ``deep`` also scans every token for ids
    ``>= vocab_size`` and EOS inside documents (the sha256 already proves the tokens are the ones
    the writer wrote, and the writer refuses both, so this only guards against a writer bug; it
    costs about 20% more CPU).

    Raises FileNotFoundError when the manifest itself is absent (a usage error); a manifest
    that exists but is malformed is reported as a finding.
    """
    report = ValidationReport(manifest=str(manifest_path))
    try:
        m = read_manifest(manifest_path)
    except FormatError as e:
        report.findings.append(Finding(None, "manifest", str(e)))
        return report
    report.shards = len(m.shards)
    report.tokens = sum(s.tokens for s in m.shards)
    report.findings.extend([*_split_total_findings(m), *stray_findings(m), *table_findings(m)])
    expect = ShardExpectation.of(m.tokenizer, m.chunk_tokens, m.dtype, m.version)
    jobs = sorted(((str(m.shard_path(s)), s, expect, deep) for s in m.shards), key=lambda j: -j[1].bytes)
    total = sum(s.tokens for s in m.shards) * np.dtype(m.dtype).itemsize
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="validate", leave=False)
    results: list[list[Finding]] = []
    n_workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))

    def record(found: list[Finding], nbytes: int) -> None:
        results.append(found)
        report.bytes_hashed += nbytes
        if bar:
            bar.update(nbytes)

    try:
        _check_all(jobs, n_workers, deep, record)
    finally:
        if bar:
            bar.close()
    bos = (m.extra.get(fmt.SFT_KEY) or {}).get("bos_id")
    for found in results:
        if bos is not None and int(bos) == m.tokenizer.eos_id:  # BOS = EOS: judged by sft_findings
            found = [f for f in found if not (f.code == "eos" and "inside documents" in f.message)]
        report.findings.extend(found)
    report.findings.extend(sft_findings(m, deep=deep))
    report.findings.sort(key=lambda f: (f.shard or "", f.code))
    return report


def table_findings(m: Manifest) -> list[Finding]:
    """A current table file (the shard list readers open instead of parsing the manifest,
    docs/FORMAT.md) that lists other shards or facts than the manifest: readers would serve its
    list. A stale or damaged one is not a finding (readers parse the manifest then)."""
    assert m.path is not None
    try:
        mirror = table_manifest(m.path)
        same = mirror is None or (
            [s.to_json() for s in mirror.shards] == [s.to_json() for s in m.shards]
            and replace(mirror, shards=[]).to_json() == replace(m, shards=[]).to_json()
        )
    except FormatError as e:
        return [Finding(None, "table", f"{fmt.table_path(m.path)}: {e}; delete it (readers then parse the manifest)")]
    if same:
        return []
    return [
        Finding(
            None,
            "table",
            f"{fmt.table_path(m.path)}: lists other shards or facts than the manifest, and readers would take "
            "its list; delete it (readers then parse the manifest)",
        )
    ]


# -- fine-tuning shards: the loss mask and the BOS convention (docs/FORMAT.md, "Loss masks") ------
def sft_findings(m: Manifest, *, deep: bool = False) -> list[Finding]:
    """The fine-tuning facts of every shard: ``/loss_spans`` (present when the entry lists a
    ``loss_sha256``, of the listed row count and hash, sorted, disjoint, inside documents after
    their first token) and, when the manifest's ``sft.bos_id`` is set, every document starting
    with BOS (``deep``: and no BOS anywhere else but, for BOS = EOS, at document ends)."""
    sft = m.extra.get(fmt.SFT_KEY) or {}
    bos = sft.get("bos_id")
    out: list[Finding] = []
    for e in m.shards:
        if e.loss_sha256 is None and bos is None:
            continue
        if sft.get("loss_mask") and e.loss_sha256 is None:
            out.append(Finding(e.path, "loss_spans", "the corpus has a loss mask but this entry has no loss_sha256"))
            continue
        try:
            with h5py.File(str(m.shard_path(e)), "r") as f:
                out.extend(_sft_shard(f, e, None if bos is None else int(bos), m.tokenizer.eos_id, deep))
        except (OSError, KeyError, RuntimeError, ValueError) as err:
            out.append(Finding(e.path, "unreadable", f"cannot read the fine-tuning data ({err})"))
    return out


def _sft_shard(f: h5py.File, e: ShardRecord, bos: int | None, eos: int, deep: bool) -> list[Finding]:
    offsets = f[fmt.DOC_OFFSETS][()]
    out: list[Finding] = []
    if e.loss_sha256 is not None:
        ds = f.get(fmt.LOSS_SPANS)
        if not isinstance(ds, h5py.Dataset):
            return [Finding(e.path, "loss_spans", f"/{fmt.LOSS_SPANS} is missing")]
        spans = ds[()]
        if spans.shape[0] != e.loss_spans:
            out.append(
                Finding(
                    e.path,
                    "loss_spans",
                    f"/{fmt.LOSS_SPANS} holds {spans.shape[0]:,} ranges, manifest says {e.loss_spans:,}",
                )
            )
        if fmt.loss_spans_sha256(spans) != e.loss_sha256:
            out.append(Finding(e.path, "loss_sha256", f"/{fmt.LOSS_SPANS} differs from the manifest's loss_sha256"))
        out.extend(Finding(e.path, p.code, p.message) for p in fmt.loss_span_problems(spans, offsets))
    if bos is None or offsets.size < 2:
        return out
    tokens = f[fmt.TOKENS]
    first = tokens[offsets[:-1]] if not deep else None
    if deep:
        all_tokens = tokens[()]
        first = all_tokens[offsets[:-1]]
        at = np.flatnonzero(all_tokens == bos)
        allowed = offsets[:-1] if bos != eos else np.union1d(offsets[:-1], offsets[1:] - 1)
        inner = np.setdiff1d(at, allowed)
        if inner.size:
            out.append(
                Finding(
                    e.path, "bos", f"{inner.size:,} BOS ids {bos} inside documents (first: token {int(inner[0]):,})"
                )
            )
    bad = np.flatnonzero(first != bos)
    if bad.size:
        out.append(
            Finding(
                e.path, "bos", f"{bad.size:,} documents do not start with BOS {bos} (first: document {int(bad[0]):,})"
            )
        )
    return out
