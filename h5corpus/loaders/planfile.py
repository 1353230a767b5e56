"""The best-fit loader's epoch plan, materialized once and shared: every microbatch's segments
(:class:`PlanArrays`), held in memory (:class:`InMemoryPlan`) or in a **plan file** that every
process reads (:class:`PlanFile`); both are a :class:`SharedPlan`.

A plan depends on the corpus (its fingerprint), the settings (:class:`~h5corpus.loaders.epochplan.PlanSettings`,
plus the mixture's) and the epoch, never on the cluster shape. :func:`ensure_plan_file` returns
the plan file of those three in a folder: one process writes it (under an exclusive lock, to a
temporary name, then an atomic rename), every other process waits for the lock and opens it; a
file left by an earlier run is reused. What a reader of the file does per microbatch is two
``pread`` calls of its own bytes (:meth:`PlanFile.microbatch`), whatever the microbatch's index,
so rank 0 of 512, which reads every 512th microbatch, pays what rank 0 of 1 pays; the file's
pages are page cache, shared by every process, not anonymous memory.

**File layout** (little-endian; version 3): a 64-byte preamble (``MAGIC``, u64 header length,
the header's sha256, 16 zero bytes), the header (UTF-8 JSON: version, fingerprint, settings,
epoch, the checksum table's sha256, per flat array its shape, byte offset, size and first
checksum, and the records' offset, size and largest record), then the checksum table (u64
xxh3-64 of every :data:`BLOCK` bytes of every flat array), the flat arrays (:data:`DTYPES`:
``mb_offsets``, (M + 1,) byte offset of each microbatch's record in the records, and
``source_tokens``), each at a 64-byte aligned offset, and the records: one per microbatch, 8-byte
aligned, laid out by :func:`build_records` (a 24-byte head: its checksum, its microbatch index,
its packs P and segments S; then ``pack_starts`` relative, ``seg_start``, ``seg_doc``,
``seg_within`` as int64 and ``seg_len`` as int32). The header and the checksum table are checked
when the file is opened (a stale file: other version, fingerprint, settings or epoch; a damaged
one: bad magic, size or hash; either is refused with :class:`PlanFileError` and rewritten by
:func:`ensure_plan_file`). A record's checksum is the xxh3-64, seeded by :func:`record_seed`, of
the rest of it, checked on every read together with its index and size, which proves the
offsets that located it; a block of ``source_tokens`` is checked whenever it is read. So nothing
unverified is served and nothing is hashed that is not read.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import xxhash

from .chunking import ChunkTable
from .epochplan import EpochPlan

MAGIC = b"H5CPLAN\x01"
#: Version of the file's layout and of the arrays' meaning; a file of another version is stale
#: (2: per-microbatch checksums; 3: one self-checked record per microbatch, read with ``pread``).
PLANFILE_VERSION = 3
#: Bytes per checksummed block of a flat array (what ``len()``, ``seek()`` and a state's token
#: check read of ``source_tokens``; a microbatch's record carries its own checksum).
BLOCK = 1 << 14
_PREAMBLE = struct.Struct("<8sQ32s16x")
_ALIGN = 64
#: Flat array name -> numpy dtype (fixed here, never read from a file).
DTYPES = {"mb_offsets": np.dtype("<u8"), "source_tokens": np.dtype("<i8")}
#: A record's head: xxh3-64 of the rest of the record, microbatch index, packs P, segments S.
RECORD_HEAD = struct.Struct("<QQII")
#: Segments whose records the writer builds at once (at least one microbatch; ~30 MB).
RECORD_SEGMENTS = 1 << 20


class PlanFileError(ValueError):
    """A plan file that must not be used: stale (another corpus, settings or epoch) or damaged."""


class PlanArrays(NamedTuple):
    """One epoch's microbatches, flat: microbatch ``g`` holds packs ``mb_packs[g]:mb_packs[g+1]``,
    pack ``p`` holds segments ``pack_starts[p]:pack_starts[p+1]``; a segment is ``seg_len`` inputs
    (plus one lookahead token) from global token ``seg_start``, i.e. input offset ``seg_within`` of
    document ``seg_doc``. ``source_tokens[g]``: input tokens per source of microbatches ``[0, g)``."""

    mb_packs: np.ndarray
    """(M + 1,) int64."""
    pack_starts: np.ndarray
    """(P + 1,) int64."""
    seg_start: np.ndarray
    """(S,) int64 global token position of each segment's first input."""
    seg_len: np.ndarray
    """(S,) int32 inputs per segment, in ``[1, max_seq_len]``."""
    seg_doc: np.ndarray
    """(S,) int64 document index (in the corpus or mixture)."""
    seg_within: np.ndarray
    """(S,) int64 offset of the segment's first input inside its document, in tokens."""
    source_tokens: np.ndarray
    """(M + 1, K) int64 cumulative input tokens per source (K = 1 for one corpus)."""


def materialize(plan: EpochPlan, doc_offsets: np.ndarray, token_bases: np.ndarray | None = None) -> PlanArrays:
    """Plan ``plan``'s whole epoch into :class:`PlanArrays`. ``doc_offsets``: (N + 1,) global token
    offset of each document (of the plan's chunk table); ``token_bases``: a mixture's (K + 1,)
    first global token of each source (None: one source). O(chunks) time and memory."""
    table: ChunkTable = plan.table
    parts: dict[str, list[np.ndarray]] = {"mb": [], "ps": [], "chunks": [], "len": []}
    packs = segs = 0
    while (g := plan.next_group(64)) is not None:
        parts["mb"].append(np.asarray(g.mb_packs[1:], dtype=np.int64) + packs)
        parts["ps"].append(g.pack_starts + segs)
        parts["chunks"].append(np.asarray(g.chunks, dtype=np.int64))
        parts["len"].append(g.lengths)
        packs += g.pack_starts.size
        segs += g.chunks.size
    chunks = _cat(parts["chunks"], np.int64)
    seg_len = _cat(parts["len"], np.int64)
    doc = table.doc[chunks].astype(np.int64)
    within = table.starts(chunks)
    start = np.asarray(doc_offsets, dtype=np.int64)[doc] + within
    mb_packs = np.concatenate([[0], _cat(parts["mb"], np.int64)]).astype(np.int64)
    pack_starts = np.concatenate([_cat(parts["ps"], np.int64), [segs]]).astype(np.int64)
    seg_mb = np.repeat(np.arange(mb_packs.size - 1), np.diff(pack_starts[mb_packs]))
    bases = np.zeros(2, np.int64) if token_bases is None else np.asarray(token_bases, dtype=np.int64)
    K = bases.size - 1
    src = np.searchsorted(bases, start, side="right") - 1 if K > 1 else np.zeros(segs, np.int64)
    M = mb_packs.size - 1
    per = np.bincount(seg_mb * K + src, weights=seg_len, minlength=M * K).astype(np.int64).reshape(M, K)
    source_tokens = np.zeros((M + 1, K), np.int64)
    np.cumsum(per, axis=0, out=source_tokens[1:])
    return PlanArrays(mb_packs, pack_starts, start, seg_len.astype(np.int32), doc, within, source_tokens)


def _cat(xs: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(xs).astype(dtype, copy=False) if xs else np.zeros(0, dtype)


class SharedPlan(Protocol):
    """What a loader reads of an epoch's plan: :class:`InMemoryPlan` or :class:`PlanFile`."""

    num_microbatches: int

    def microbatch(self, g: int) -> PlanArrays:
        """Microbatch ``g`` (``0 <= g < num_microbatches``): its segments and packs, with
        ``mb_packs`` ``[0, P]`` and ``pack_starts`` relative (from 0, ending with S)."""
        ...

    def seg_starts(self, g0: int, g1: int) -> np.ndarray:
        """The first global token of every segment of microbatches ``[g0, g1)``, in plan order."""
        ...

    def tokens_at(self, position: int) -> tuple[int, tuple[int, ...]]:
        """Input tokens (total, per source) in microbatches ``[0, position)`` (past M: wrapped)."""
        ...


def _tokens_at(row: Any, M: int, position: int) -> tuple[int, tuple[int, ...]]:
    """:meth:`SharedPlan.tokens_at` from ``row(i)``, the (K,) row ``i`` of ``source_tokens``:
    past M the epoch wraps around (the remainder rule), ``position = q * M + r`` counts q epochs plus r."""
    q, r = divmod(int(position), M) if M and position > M else (0, int(position))
    src = np.asarray(row(r), dtype=np.int64)
    if q:
        src = src + q * np.asarray(row(M), dtype=np.int64)
    return int(src.sum()), tuple(int(x) for x in src)


class InMemoryPlan:
    """An epoch's :class:`PlanArrays` held by this process (no plan file: small corpora, tests).
    Reads are O(1) slices per microbatch."""

    def __init__(self, arrays: PlanArrays):
        self.arrays = arrays
        self.num_microbatches = int(arrays.mb_packs.shape[0]) - 1

    def microbatch(self, g: int) -> PlanArrays:
        a = self.arrays
        p0, p1 = int(a.mb_packs[g]), int(a.mb_packs[g + 1])
        ps = a.pack_starts[p0 : p1 + 1]
        s0, s1 = int(ps[0]), int(ps[-1])
        return PlanArrays(
            np.array([0, p1 - p0], np.int64),
            ps - s0,
            a.seg_start[s0:s1],
            a.seg_len[s0:s1],
            a.seg_doc[s0:s1],
            a.seg_within[s0:s1],
            np.zeros((0, 1), np.int64),
        )

    def seg_starts(self, g0: int, g1: int) -> np.ndarray:
        a = self.arrays
        s0, s1 = (int(a.pack_starts[int(a.mb_packs[g])]) for g in (g0, g1))
        return a.seg_start[s0:s1]

    def tokens_at(self, position: int) -> tuple[int, tuple[int, ...]]:
        return _tokens_at(self.arrays.source_tokens.__getitem__, self.num_microbatches, position)


class PlanFile:
    """An epoch's plan in a plan file (:func:`open_plan_file`), read with ``pread`` (no memory
    map): a microbatch is its offsets (16 bytes) and its record, verified against the record's
    checksum on every read; a row of ``source_tokens`` comes with its 16 KiB block, verified."""

    def __init__(self, fd: int, layout: _Layout, seed: int, path: str):
        self._fd, self._layout, self._seed, self.path = fd, layout, seed, path
        self.num_microbatches = layout.num_microbatches
        weakref.finalize(self, os.close, fd)

    def microbatch(self, g: int) -> PlanArrays:
        lay = self._layout
        if not 0 <= g < lay.num_microbatches:
            raise IndexError(f"microbatch {g} outside the plan's {lay.num_microbatches}")
        lo, hi = struct.unpack("<QQ", os.pread(self._fd, 16, lay.offsets_at + 8 * g))
        if not (lo % 8 == 0 and lo + RECORD_HEAD.size <= hi <= lay.records_nbytes and hi - lo <= lay.max_record):
            raise PlanFileError(f"plan file {self.path}: microbatch {g} is damaged (record bounds {lo}..{hi})")
        rec = os.pread(self._fd, hi - lo, lay.records_at + lo)
        try:
            return parse_record(rec, g, self._seed)
        except ValueError as e:
            raise PlanFileError(
                f"plan file {self.path}: microbatch {g} {e} (damaged after it was written): delete the "
                "file, or rerun `h5corpus plan`"
            ) from None

    def seg_starts(self, g0: int, g1: int) -> np.ndarray:
        parts = [self.microbatch(g).seg_start for g in range(g0, g1)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def tokens_at(self, position: int) -> tuple[int, tuple[int, ...]]:
        return _tokens_at(self._source_row, self.num_microbatches, position)

    def _source_row(self, i: int) -> np.ndarray:
        """Row ``i`` of ``source_tokens``, read with the 16 KiB blocks it lies in, each verified."""
        lay = self._layout
        row = 8 * lay.source_shape[1]
        b0, b1 = i * row // BLOCK, ((i + 1) * row - 1) // BLOCK + 1
        raw = os.pread(self._fd, min(b1 * BLOCK, lay.source_shape[0] * row) - b0 * BLOCK, lay.source_at + b0 * BLOCK)
        for b in range(b0, b1):
            if xxhash.xxh3_64_intdigest(raw[(b - b0) * BLOCK : (b - b0 + 1) * BLOCK]) != int(lay.source_sums[b]):
                raise PlanFileError(
                    f"plan file {self.path}: array 'source_tokens' block {b} fails its checksum (damaged "
                    "after it was written): delete the file, or rerun `h5corpus plan`"
                )
        return np.frombuffer(raw, DTYPES["source_tokens"], lay.source_shape[1], i * row - b0 * BLOCK)


# ------------------------------------------------------------------------------------------------
# Microbatch records
# ------------------------------------------------------------------------------------------------
def record_bytes(P: Any, S: Any) -> Any:
    """Bytes of the record of a microbatch of ``P`` packs and ``S`` segments (ints or arrays):
    the head, ``8 (P + 1) + 28 S``, padded to a multiple of 8."""
    return (RECORD_HEAD.size + 8 * (P + 1) + 28 * S + 7) // 8 * 8


def record_sizes(arrays: PlanArrays) -> np.ndarray:
    """(M,) int64 :func:`record_bytes` of each microbatch of ``arrays``."""
    return record_bytes(np.diff(arrays.mb_packs), np.diff(arrays.pack_starts[arrays.mb_packs]))


def build_records(arrays: PlanArrays, g0: int, g1: int, seed: int) -> np.ndarray:
    """The records of microbatches ``[g0, g1)`` end to end (uint8, 8-byte aligned each): per
    record its head (checksum, g, P, S), then ``pack_starts`` (relative, P + 1 int64), ``seg_start``,
    ``seg_doc``, ``seg_within`` (S int64 each) and ``seg_len`` (S int32). Vectorized; the checksum,
    xxh3-64 with ``seed`` of the record after its first 8 bytes, one call per record."""
    mp = np.asarray(arrays.mb_packs[g0 : g1 + 1], dtype=np.int64)
    n, P = g1 - g0, np.diff(mp)
    first = np.asarray(arrays.pack_starts[mp], dtype=np.int64)  # each microbatch's first segment (and the end)
    S = np.diff(first)
    off = np.zeros(n + 1, np.int64)
    np.cumsum(record_bytes(P, S), out=off[1:])
    buf = np.zeros(int(off[-1]), np.uint8)
    w, word = buf.view("<i8"), off[:-1] // 8
    w[word + 1] = np.arange(g0, g1)
    buf.view("<u8")[word + 2] = P.astype(np.uint64) | (S.astype(np.uint64) << np.uint64(32))
    k_mb = np.repeat(np.arange(n), P + 1)  # pack_starts: P + 1 rows per microbatch
    k = np.arange(k_mb.size) - np.repeat(np.cumsum(P + 1) - (P + 1), P + 1)
    w[word[k_mb] + 3 + k] = np.asarray(arrays.pack_starts[mp[k_mb] + k]) - first[k_mb]
    seg = np.arange(first[0], first[-1])  # segments: S rows of each array per microbatch
    s_mb = np.repeat(np.arange(n), S)
    r = seg - first[s_mb]
    base, Sm = word[s_mb] + 3 + P[s_mb] + 1, S[s_mb]
    w[base + r] = arrays.seg_start[seg]
    w[base + Sm + r] = arrays.seg_doc[seg]
    w[base + 2 * Sm + r] = arrays.seg_within[seg]
    buf.view("<i4")[2 * (base + 3 * Sm) + r] = arrays.seg_len[seg]
    sums = buf.view("<u8")
    for i in range(n):
        sums[word[i]] = xxhash.xxh3_64_intdigest(buf[off[i] + 8 : off[i + 1]], seed)
    return buf


def _record_chunks(arrays: PlanArrays) -> Iterator[tuple[int, int]]:
    """Consecutive ranges ``[g0, g1)`` of microbatches covering the epoch, each of at most
    :data:`RECORD_SEGMENTS` segments unless a single microbatch holds more."""
    first = np.asarray(arrays.pack_starts[arrays.mb_packs], dtype=np.int64)
    M, g0 = first.size - 1, 0
    while g0 < M:
        g1 = int(np.searchsorted(first, first[g0] + RECORD_SEGMENTS, side="right")) - 1
        g1 = min(M, max(g0 + 1, g1))
        yield g0, g1
        g0 = g1


def parse_record(rec: bytes, g: int, seed: int) -> PlanArrays:
    """Microbatch ``g``'s :class:`PlanArrays` from its record (:func:`build_records`), views of
    ``rec``; ValueError (its reason) when the checksum, the index or the size do not hold."""
    if len(rec) < RECORD_HEAD.size:
        raise ValueError("is truncated")
    want, at, P, S = RECORD_HEAD.unpack_from(rec)
    if xxhash.xxh3_64_intdigest(memoryview(rec)[8:], seed) != want:
        raise ValueError("fails its checksum")
    if at != g or len(rec) != record_bytes(P, S):
        raise ValueError(f"is another record (microbatch {at}, {len(rec)} bytes for {P} packs, {S} segments)")
    o = RECORD_HEAD.size
    pack_starts = np.frombuffer(rec, "<i8", P + 1, o)
    o += 8 * (P + 1)
    start, doc, within = (np.frombuffer(rec, "<i8", S, o + 8 * S * k) for k in range(3))
    seg_len = np.frombuffer(rec, "<i4", S, o + 24 * S)
    return PlanArrays(np.array([0, P], np.int64), pack_starts, start, seg_len, doc, within, np.zeros((0, 1), np.int64))


def record_seed(identity: Mapping[str, Any]) -> int:
    """The records' checksum seed: 64 bits of the sha256 of the plan's fingerprint, settings and
    epoch, so that a record copied from another plan file fails its checksum."""
    key = json.dumps([identity["fingerprint"], dict(identity["settings"]), int(identity["epoch"])], sort_keys=True)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


# ------------------------------------------------------------------------------------------------
# The file
# ------------------------------------------------------------------------------------------------
def plan_file_name(fingerprint: str, settings: Mapping[str, Any], epoch: int) -> str:
    """The file name of a plan: a digest of its fingerprint and settings, then the epoch."""
    key = hashlib.sha256(json.dumps([fingerprint, dict(settings)], sort_keys=True).encode()).hexdigest()[:24]
    return f"bestfit-{key}-e{int(epoch)}.h5cplan"


class _Layout(NamedTuple):
    """Where a plan file's parts lie (absolute byte offsets), from its checked header."""

    num_microbatches: int
    offsets_at: int
    source_at: int
    source_shape: tuple[int, int]
    source_sums: np.ndarray
    records_at: int
    records_nbytes: int
    max_record: int


def _block_sums(raw: np.ndarray) -> list[int]:
    return [xxhash.xxh3_64_intdigest(raw[i : i + BLOCK]) for i in range(0, raw.size, BLOCK)]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _header(arrays: PlanArrays, identity: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray], bytes]:
    """(header, flat arrays by name, checksum table) of the plan file of ``arrays``."""
    sizes = record_sizes(arrays)
    offsets = np.zeros(sizes.size + 1, DTYPES["mb_offsets"])
    np.cumsum(sizes, out=offsets[1:])
    flat = {"mb_offsets": offsets, "source_tokens": np.ascontiguousarray(arrays.source_tokens, DTYPES["source_tokens"])}
    sums: list[int] = []
    layout, offset = {}, 0
    for name, a in flat.items():
        raw = a.reshape(-1).view(np.uint8)
        layout[name] = {"shape": list(a.shape), "offset": offset, "nbytes": int(raw.size), "first_sum": len(sums)}
        sums.extend(_block_sums(raw))
        offset += _aligned(raw.size)
    table = np.asarray(sums, dtype="<u8").tobytes()
    meta = {
        "version": PLANFILE_VERSION,
        **identity,
        "arrays": layout,
        "records": {"offset": offset, "nbytes": int(offsets[-1]), "max_record": int(sizes.max(initial=0))},
        "sums": [len(sums), hashlib.sha256(table).hexdigest()],
    }
    return meta, flat, table


def write_plan_file(path: str | os.PathLike, arrays: PlanArrays, identity: Mapping[str, Any]) -> None:
    """Write ``arrays`` to ``path`` atomically (a temporary name in the same folder, fsync, rename).
    ``identity``: fingerprint, settings and epoch, stored in the header and compared on open.
    The records are built about :data:`RECORD_SEGMENTS` segments at a time."""
    path = Path(path)
    meta, flat, table = _header(arrays, identity)
    header = json.dumps(meta, sort_keys=True).encode()
    body0 = _aligned(_PREAMBLE.size + len(header)) + _aligned(len(table))
    seed, rec = record_seed(identity), meta["records"]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(_PREAMBLE.pack(MAGIC, len(header), hashlib.sha256(header).digest()))
        f.write(header)
        f.seek(_aligned(_PREAMBLE.size + len(header)))
        f.write(table)
        for name, a in flat.items():
            f.seek(body0 + meta["arrays"][name]["offset"])
            f.write(a.tobytes())
        f.seek(body0 + rec["offset"])
        for g0, g1 in _record_chunks(arrays):
            f.write(memoryview(build_records(arrays, g0, g1, seed)))
        f.truncate(body0 + rec["offset"] + rec["nbytes"])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_plan_file(path: str | os.PathLike, identity: Mapping[str, Any]) -> PlanFile:
    """Open the plan file at ``path``; :class:`PlanFileError` if it is damaged (magic, header or
    checksum table hash, sizes) or stale (its version, fingerprint, settings or epoch differ from
    ``identity``). Costs the header and the checksum table (8 bytes per 16 KiB of flat arrays)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # held by the PlanFile, closed with it
    try:
        layout = _read_layout(fd, identity, str(path))
    except BaseException:
        os.close(fd)
        raise
    return PlanFile(fd, layout, record_seed(identity), str(path))


def _read_layout(fd: int, identity: Mapping[str, Any], path: str) -> _Layout:
    """The checked :class:`_Layout` of the plan file open at ``fd`` (see :func:`open_plan_file`)."""
    size = os.fstat(fd).st_size
    pre = os.pread(fd, _PREAMBLE.size, 0)
    if len(pre) < _PREAMBLE.size:
        raise PlanFileError(f"plan file {path}: {size} bytes, shorter than its preamble (damaged)")
    magic, hlen, digest = _PREAMBLE.unpack(pre)
    if magic != MAGIC or _PREAMBLE.size + hlen > size:
        raise PlanFileError(f"plan file {path}: not a plan file, or truncated (damaged)")
    header = os.pread(fd, hlen, _PREAMBLE.size)
    if hashlib.sha256(header).digest() != digest:
        raise PlanFileError(f"plan file {path}: header fails its sha256 (damaged)")
    h = json.loads(header)
    for key in ("version", *identity):
        want = PLANFILE_VERSION if key == "version" else identity[key]
        if h.get(key) != json.loads(json.dumps(want)):
            raise PlanFileError(f"plan file {path}: stale, its {key} is {h.get(key)!r}, this plan's is {want!r}")
    n_sums, sums_sha = h["sums"]
    t0 = _aligned(_PREAMBLE.size + hlen)
    table = os.pread(fd, 8 * n_sums, t0)
    if len(table) != 8 * n_sums or hashlib.sha256(table).hexdigest() != sums_sha:
        raise PlanFileError(f"plan file {path}: checksum table fails its sha256 (damaged)")
    return _layout_of(h, np.frombuffer(table, "<u8"), t0 + _aligned(8 * n_sums), size, path)


def _layout_of(h: Mapping[str, Any], sums: np.ndarray, body0: int, size: int, path: str) -> _Layout:
    """The parts' places from header ``h`` (its sha256 checked), each checked to fit the file."""
    at: dict[str, tuple[int, tuple[int, ...], np.ndarray]] = {}
    for name, dt in DTYPES.items():
        e = h["arrays"].get(name)
        if e is None:
            raise PlanFileError(f"plan file {path}: array {name!r} missing (damaged)")
        shape, n = tuple(int(x) for x in e["shape"]), int(np.prod(e["shape"])) * dt.itemsize
        start, first, nb = body0 + int(e["offset"]), int(e["first_sum"]), -(-n // BLOCK)
        if n != int(e["nbytes"]) or start + n > size or first + nb > sums.size:
            raise PlanFileError(f"plan file {path}: array {name!r} does not fit the file (damaged)")
        at[name] = (start, shape, sums[first : first + nb])
    rec = h["records"]
    M = at["mb_offsets"][1][0] - 1
    if body0 + int(rec["offset"]) + int(rec["nbytes"]) > size or at["source_tokens"][1][0] != M + 1:
        raise PlanFileError(f"plan file {path}: its records do not fit the file (damaged)")
    source_shape = at["source_tokens"][1]
    return _Layout(
        M,
        at["mb_offsets"][0],
        at["source_tokens"][0],
        (int(source_shape[0]), int(source_shape[1])),
        at["source_tokens"][2],
        body0 + int(rec["offset"]),
        int(rec["nbytes"]),
        int(rec["max_record"]),
    )


def ensure_plan_file(
    folder: str | os.PathLike, identity: Mapping[str, Any], build: Any, *, rebuild: bool = False
) -> tuple[SharedPlan, Path]:
    """The plan of ``identity`` (fingerprint, settings, epoch) from its file in ``folder``,
    written first if missing, stale or damaged (``rebuild``: always) by calling ``build()`` (->
    :class:`PlanArrays`) in exactly one process: the others wait on the folder's lock file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / plan_file_name(identity["fingerprint"], identity["settings"], identity["epoch"])
    if not rebuild:
        try:
            return open_plan_file(path, identity), path
        except FileNotFoundError:
            pass
        except PlanFileError as e:
            warnings.warn(f"{e}; writing it again", stacklevel=2)
    with open(path.with_name(path.name + ".lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if not rebuild and path.exists():
                try:
                    return open_plan_file(path, identity), path  # written while this process waited
                except PlanFileError:
                    pass
            write_plan_file(path, build(), identity)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return open_plan_file(path, identity), path
