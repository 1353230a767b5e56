"""Prove a built corpus intact: recompute every hash and check every structural promise.

:func:`validate_corpus` is a library function that returns findings; the CLI maps them to exit
codes (0 intact, 1 corrupt, 2 usage error). Shards are checked in parallel processes, each shard
streamed once in chunk-aligned blocks through sha256, so memory stays bounded.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
import multiprocessing as mp
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from . import format as fmt
from .format import FormatError
from .manifest import Manifest, ShardEntry, read_manifest
from .writer import PARTIAL_SUFFIX

#: Tokens read per block while hashing (a multiple of every power-of-two chunk size up to it).
HASH_BLOCK_TOKENS = 1 << 22


@dataclass(frozen=True)
class Finding:
    """One broken promise. ``shard`` is the manifest path of the shard, or None for the manifest."""

    shard: str | None
    code: str
    """Short machine-readable kind: missing, unlisted, size, unreadable, format, attrs, tokens,
    offsets, index, sha256, index_sha256, eos, range, manifest."""
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


@dataclass(frozen=True)
class _Expect:
    dtype: str
    chunk_tokens: int
    eos_id: int
    vocab_size: int
    tokenizer_sha256: str


def _token_blocks(ds: h5py.Dataset, path: str, n_tokens: int):
    """Yield (start, array) blocks covering ``ds[0:n_tokens]`` in order.

    Uncompressed shards are viewed straight from a read-only memory map of the file at the chunk
    byte offsets HDF5 reports (:func:`h5corpus.reader.chunk_byte_offsets`), runs of chunks that are
    contiguous in the file merged into one block; anything else (compressed, or an odd layout a
    corrupt file may have) is read through h5py.
    """
    from .reader import chunk_byte_offsets

    if not n_tokens:
        return
    offsets, _ = chunk_byte_offsets(ds, n_tokens, os.path.getsize(path)) if ds.chunks else (None, "")
    if offsets is not None:
        import mmap

        chunk, itemsize = ds.chunks[0], ds.dtype.itemsize
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            # a new run starts where a chunk does not follow the previous one in the file
            breaks = np.flatnonzero(np.diff(offsets) != chunk * itemsize) + 1
            for lo, hi in zip(np.r_[0, breaks].tolist(), np.r_[breaks, offsets.size].tolist()):
                for k in range(lo, hi, max(HASH_BLOCK_TOKENS // chunk, 1)):
                    k_end = min(hi, k + max(HASH_BLOCK_TOKENS // chunk, 1))
                    a, b = k * chunk, min(k_end * chunk, n_tokens)
                    yield a, np.frombuffer(mm, dtype=ds.dtype, count=b - a, offset=int(offsets[k]))
        finally:
            try:
                mm.close()
            except BufferError:  # views still alive; the map closes when they are collected
                pass
        return
    chunk = ds.chunks[0] if ds.chunks else n_tokens
    block = max(HASH_BLOCK_TOKENS // chunk, 1) * chunk
    for a in range(0, n_tokens, block):
        b = min(a + block, n_tokens)
        view = np.empty(b - a, dtype=ds.dtype)  # fresh per block: the hasher thread may still hold the last
        ds.read_direct(view, source_sel=np.s_[a:b], dest_sel=np.s_[0 : b - a])
        yield a, view


def hash_shard_tokens(ds: h5py.Dataset, path: str, n_tokens: int, eos_id: int, ends: np.ndarray) -> tuple[str, int, int, int]:
    """Stream ``ds[0:n_tokens]`` once.

    ``ends`` are sorted token positions that must hold ``eos_id`` (last token of each whole
    document). Returns (hex sha256, EOS count, max id, positions in ``ends`` lacking EOS).
    """
    h = hashlib.sha256()
    eos_count = 0
    max_id = -1
    bad_ends = 0
    # sha256 releases the GIL: one helper thread digests blocks in order while this thread runs the
    # numpy checks on them, so a shard validates at about hashlib's speed.
    with ThreadPoolExecutor(1) as hasher:
        pending = []
        for a, view in _token_blocks(ds, path, n_tokens):
            if len(pending) >= 4:
                pending.pop(0).result()
            pending.append(hasher.submit(fmt.tokens_sha256_update, h, view))
            b = a + view.size
            eos_count += int(np.count_nonzero(view == eos_id))
            max_id = max(max_id, int(view.max()))
            lo, hi = np.searchsorted(ends, [a, b])
            if hi > lo:
                bad_ends += int(np.count_nonzero(view[ends[lo:hi] - a] != eos_id))
        for p in pending:
            p.result()
    return h.hexdigest(), eos_count, max_id, bad_ends


def check_shard(path: str, entry: ShardEntry, expect: _Expect) -> tuple[list[Finding], int]:
    """Check one shard file against its manifest entry; return (findings, bytes hashed)."""
    name = entry.path
    out: list[Finding] = []

    def bad(code: str, msg: str) -> tuple[list[Finding], int]:
        out.append(Finding(name, code, msg))
        return out, 0

    p = Path(path)
    if not p.exists():
        return bad("missing", f"shard file not found at {p}")
    size = p.stat().st_size
    if size != entry.bytes:
        out.append(Finding(name, "size", f"file is {size:,} bytes, manifest says {entry.bytes:,} (truncated or replaced?)"))
    try:
        f = h5py.File(p, "r")
    except OSError as e:
        return bad("unreadable", f"cannot open as HDF5 ({e})")
    with f:
        try:
            attrs = fmt.check_attrs(f.attrs, name)
        except FormatError as e:
            return bad("format", str(e).split(": ", 1)[-1])
        for key, want in (
            ("split", entry.split), ("dtype", expect.dtype), ("chunk_tokens", expect.chunk_tokens),
            ("eos_id", expect.eos_id), ("vocab_size", expect.vocab_size), ("tokenizer_sha256", expect.tokenizer_sha256),
        ):
            if attrs[key] != want:
                out.append(Finding(name, "attrs", f"attribute {key} = {attrs[key]!r}, manifest says {want!r}"))
        for ds_name in (fmt.TOKENS, fmt.DOC_OFFSETS, fmt.DOC_IDS, fmt.DOC_FLAGS):
            if ds_name not in f:
                return bad("format", f"dataset /{ds_name} is missing")
        try:
            tokens = f[fmt.TOKENS]
            if tokens.dtype != np.dtype(expect.dtype) or tokens.ndim != 1:
                return bad("tokens", f"/tokens is {tokens.dtype} with shape {tokens.shape}, expected 1-D {expect.dtype}")
            n = tokens.shape[0]
            if n != entry.tokens:
                out.append(Finding(name, "tokens", f"/tokens holds {n:,} tokens, manifest says {entry.tokens:,}"))
            if tokens.chunks != (expect.chunk_tokens,):
                out.append(Finding(name, "tokens", f"/tokens chunks {tokens.chunks}, expected ({expect.chunk_tokens},)"))
            offsets = f[fmt.DOC_OFFSETS][:]
            ids = f[fmt.DOC_IDS][:]
            flags = f[fmt.DOC_FLAGS][:]
            docs = offsets.size - 1
            if offsets.dtype != np.dtype("int64"):
                out.append(Finding(name, "offsets", f"/doc_offsets is {offsets.dtype}, expected int64"))
            if docs != entry.documents:
                out.append(Finding(name, "offsets", f"/doc_offsets lists {docs:,} documents, manifest says {entry.documents:,}"))
            if ids.shape != (max(docs, 0), fmt.DOC_ID_BYTES) or flags.shape != (max(docs, 0),):
                out.append(Finding(name, "index", f"/doc_ids {ids.shape} or /doc_flags {flags.shape} do not match {docs:,} documents"))
            offsets_ok = True
            if offsets.size == 0 or offsets[0] != 0:
                out.append(Finding(name, "offsets", "/doc_offsets does not start at 0"))
                offsets_ok = False
            else:
                d = np.diff(offsets)
                if (d < 0).any():
                    i = int(np.argmax(d < 0))
                    out.append(Finding(name, "offsets", f"/doc_offsets decreases at document {i:,} ({offsets[i]:,} -> {offsets[i + 1]:,})"))
                    offsets_ok = False
                if offsets[-1] != n:
                    out.append(Finding(name, "offsets", f"/doc_offsets ends at {int(offsets[-1]):,}, but /tokens holds {n:,}"))
                    offsets_ok = False
            if fmt.index_sha256(offsets, ids, flags) != entry.index_sha256:
                out.append(Finding(name, "index_sha256", "index hash (doc_offsets, doc_ids, doc_flags) differs from the manifest"))
            structure_ok = offsets_ok and ids.shape[0] == docs and flags.shape == (docs,)
            ends = np.zeros(0, dtype=np.int64)
            if structure_ok and docs > 0:
                ends = offsets[1:][(flags & fmt.FLAG_TRUNCATED) == 0] - 1
                ends = ends[ends >= 0]
            digest, eos_count, max_id, bad_ends = hash_shard_tokens(tokens, path, n, expect.eos_id, ends)
        except (OSError, KeyError, ValueError) as e:
            return bad("unreadable", f"read failed ({e})")
        if digest != entry.sha256:
            out.append(Finding(name, "sha256", f"token hash {digest[:16]}... differs from the manifest's {entry.sha256[:16]}..."))
        if max_id >= expect.vocab_size:
            out.append(Finding(name, "range", f"token id {max_id} >= vocab_size {expect.vocab_size}"))
        if structure_ok:
            if bad_ends:
                out.append(Finding(name, "eos", f"{bad_ends:,} documents do not end with EOS {expect.eos_id}"))
            elif eos_count != ends.size:
                out.append(Finding(name, "eos", f"{eos_count - ends.size:,} EOS ids inside documents"))
    return out, n * np.dtype(expect.dtype).itemsize


def _check_shard_job(args: tuple[str, ShardEntry, _Expect]) -> tuple[list[Finding], int]:
    return check_shard(*args)


def unlisted_shard_files(manifest: Manifest) -> list[Path]:
    """``*.h5`` files under the shards' common directory that the manifest does not list."""
    listed = {manifest.shard_path(s) for s in manifest.shards}
    if not listed:
        return []
    root = Path(os.path.commonpath([str(p.parent) for p in listed]))
    if not root.is_dir():
        return []
    return sorted(p.absolute() for p in root.rglob("*.h5") if p.absolute() not in listed)


def validate_corpus(
    manifest_path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    progress: bool = False,
) -> ValidationReport:
    """Check every shard of a manifest: presence, size, format, structure, EOS placement, and
    both hashes; also report shard files the manifest does not list.

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
    seen: set[str] = set()
    for s in m.shards:
        if s.path in seen:
            report.findings.append(Finding(s.path, "manifest", "listed twice"))
        seen.add(s.path)
        if s.split not in fmt.SPLITS:
            report.findings.append(Finding(s.path, "manifest", f"unknown split {s.split!r}"))
    for split, fig in m.splits.items():
        if isinstance(fig, dict) and "tokens" in fig:
            have = sum(s.tokens for s in m.shards_of(split))
            if int(fig["tokens"]) != have:
                report.findings.append(Finding(None, "manifest", f"splits.{split}.tokens = {fig['tokens']:,} but its shards hold {have:,}"))
    for p in unlisted_shard_files(m):
        report.findings.append(Finding(os.path.relpath(p, m.root), "unlisted", "shard file present but not listed in the manifest"))
    for s in m.shards:
        pp = m.shard_path(s)
        partial = pp.with_name(pp.name + PARTIAL_SUFFIX)
        if partial.exists():
            report.findings.append(Finding(s.path, "partial", f"an unfinished write is lying beside it ({partial.name})"))
    expect = _Expect(
        dtype=m.dtype, chunk_tokens=m.chunk_tokens, eos_id=m.tokenizer.eos_id,
        vocab_size=m.tokenizer.vocab_size, tokenizer_sha256=m.tokenizer.sha256,
    )
    jobs = sorted(((str(m.shard_path(s)), s, expect) for s in m.shards), key=lambda j: -j[1].bytes)
    total = sum(s.tokens for s in m.shards) * np.dtype(m.dtype).itemsize
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="validate", leave=False)
    results: list[list[Finding]] = []
    n_workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))
    try:
        if n_workers == 1:
            for j in jobs:
                found, nbytes = _check_shard_job(j)
                results.append(found)
                report.bytes_hashed += nbytes
                if bar:
                    bar.update(nbytes)
        else:
            # fork where available: workers open only their own files, and start in milliseconds
            ctx = get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ProcessPoolExecutor(n_workers, mp_context=ctx) as ex:
                futs = [ex.submit(_check_shard_job, j) for j in jobs]
                for fut in as_completed(futs):
                    found, nbytes = fut.result()
                    results.append(found)
                    report.bytes_hashed += nbytes
                    if bar:
                        bar.update(nbytes)
    finally:
        if bar:
            bar.close()
    for found in results:
        report.findings.extend(found)
    report.findings.sort(key=lambda f: (f.shard or "", f.code))
    return report
