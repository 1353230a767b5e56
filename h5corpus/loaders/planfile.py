"""The best-fit loader's epoch plan, materialized once and shared: every microbatch's segments as
flat arrays (:class:`PlanArrays`), held in memory or in a **plan file** that every process memory-maps.

A plan depends on the corpus (its fingerprint), the settings (:class:`~h5corpus.loaders.epochplan.PlanSettings`,
plus the mixture's) and the epoch, never on the cluster shape. :func:`ensure_plan_file` returns
the plan file of those three in a folder: one process writes it (under an exclusive lock, to a
temporary name, then an atomic rename), every other process waits for the lock and maps it; a
file left by an earlier run is reused. What a reader of the file does per microbatch is O(1)
slices (:meth:`SharedPlan.microbatch`), and its memory is page cache, not anonymous memory.

**File layout** (little-endian): a 64-byte preamble (``MAGIC``, u64 header length, the header's
sha256, 16 zero bytes), the header (UTF-8 JSON: version, fingerprint, settings, epoch, the
checksum table's sha256, and per array its shape, byte offset, size and first checksum), then the
checksum table (u64 xxh3-64 of every :data:`BLOCK` bytes of every array) and the arrays, each at
a 64-byte aligned offset (array dtypes are fixed here, :data:`DTYPES`). The header and the
checksum table are checked when the file is opened (a stale file: other fingerprint, settings or
epoch; a damaged one: bad magic, size or hash; either is refused with :class:`PlanFileError` and
rewritten by :func:`ensure_plan_file`); an array block is checked against its checksum the first
time a process reads it, so nothing unverified is served and nothing is hashed that is not read.
A microbatch is checked as one unit instead (array ``mb_sums``, :func:`microbatch_sum`: the
xxh3-64 of its rows of the six arrays :meth:`SharedPlan.microbatch` returns), so a rank that reads
every 512th microbatch hashes what it reads and no more, like one that reads them all in order.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

from .chunking import ChunkTable
from .epochplan import EpochPlan

MAGIC = b"H5CPLAN\x01"
#: Version of the file's layout and of the arrays' meaning; a file of another version is stale
#: (2: the per-microbatch checksums ``mb_sums``).
PLANFILE_VERSION = 2
#: Bytes per checksummed block of an array (what ``len()``, ``seek()``, a state's token check and
#: prefetching read; a microbatch's rows are checked against its own checksum instead).
BLOCK = 1 << 14
_PREAMBLE = struct.Struct("<8sQ32s16x")
_ALIGN = 64
#: Array name -> numpy dtype (fixed here, never read from a file).
DTYPES = {
    "mb_packs": np.dtype("<i8"),
    "pack_starts": np.dtype("<i8"),
    "seg_start": np.dtype("<i8"),
    "seg_len": np.dtype("<i4"),
    "seg_doc": np.dtype("<i8"),
    "seg_within": np.dtype("<i8"),
    "source_tokens": np.dtype("<i8"),
    "mb_sums": np.dtype("<u8"),
}
#: The segment arrays a microbatch's checksum covers, in its order (after ``mb_packs`` and
#: ``pack_starts``).
SEGMENT_ARRAYS = ("seg_start", "seg_len", "seg_doc", "seg_within")


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


class SharedPlan:
    """An epoch's :class:`PlanArrays`, in memory or memory-mapped from a plan file (blocks
    verified on first read). Reads are O(1) slices per microbatch."""

    def __init__(self, arrays: Mapping[str, np.ndarray], sums: Mapping[str, np.ndarray] | None = None, path: str = ""):
        self._arrays = dict(arrays)
        self._sums = sums
        self._ok: dict[str, bytearray] = {}  # per array: which blocks this process verified (1 byte each)
        self.path = path
        self.num_microbatches = int(self._arrays["mb_packs"].shape[0]) - 1
        #: per microbatch: 1 once this process verified it (pages untouched until then: calloc)
        self._mb_ok = np.zeros(self.num_microbatches if sums is not None else 0, np.uint8)

    @classmethod
    def of(cls, arrays: PlanArrays) -> SharedPlan:
        """An in-memory plan (nothing to verify)."""
        return cls(arrays._asdict())

    def _get(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of array ``name``, each block they touch verified once."""
        a = self._arrays[name]
        if self._sums is not None and hi > lo:
            row = a.itemsize * (a.shape[1] if a.ndim == 2 else 1)
            b0, b1 = lo * row // BLOCK, ((hi * row) - 1) // BLOCK + 1
            ok = self._ok.get(name)
            if ok is None:
                ok = self._ok[name] = bytearray(self._sums[name].size)
            while (b := ok.find(0, b0, b1)) >= 0:  # one C scan when every block is verified (the usual case)
                self._verify(name, b, a)
                ok[b] = 1
        return a[lo:hi]

    def _verify(self, name: str, block: int, a: np.ndarray) -> None:
        raw = a.reshape(-1).view(np.uint8)
        if xxhash.xxh3_64_intdigest(raw[block * BLOCK : (block + 1) * BLOCK]) != int(self._sums[name][block]):  # type: ignore[index]
            raise PlanFileError(
                f"plan file {self.path}: array {name!r} block {block} fails its checksum (damaged after it "
                "was written): delete the file, or rerun `h5corpus plan`"
            )

    def tokens_at(self, position: int) -> tuple[int, tuple[int, ...]]:
        """Input tokens (total, per source) in microbatches ``[0, position)``; past M the epoch
        wraps around (the remainder rule): ``position = q * M + r`` counts q epochs plus r."""
        M = self.num_microbatches
        q, r = divmod(int(position), M) if M and position > M else (0, int(position))
        src = self._get("source_tokens", r, r + 1)[0].astype(np.int64)
        if q:
            src = src + q * self._get("source_tokens", M, M + 1)[0]
        return int(src.sum()), tuple(int(x) for x in src)

    def seg_starts(self, g0: int, g1: int) -> np.ndarray:
        """The first global token of every segment of microbatches ``[g0, g1)`` (``0 <= g0 <= g1
        <= M``), in plan order (the slice of ``seg_start`` they span): what a loader prefetches ahead."""
        p0 = int(self._get("mb_packs", g0, g0 + 1)[0])
        p1 = int(self._get("mb_packs", g1, g1 + 1)[0])
        a = int(self._get("pack_starts", p0, p0 + 1)[0])
        b = int(self._get("pack_starts", p1, p1 + 1)[0])
        return self._get("seg_start", a, b)

    def microbatch(self, g: int) -> PlanArrays:
        """Microbatch ``g``: its segments and packs (``pack_starts`` relative, ending with S); from
        a file, verified against its checksum (``mb_sums``) the first time this process reads it."""
        trusted = self._sums is None or self._mb_ok[g]  # in memory, or verified before
        rows = microbatch_rows(self._arrays, g) if trusted else self._verified_rows(g)
        mp, ps, start, length, doc, within = rows
        return PlanArrays(
            np.array([0, int(mp[1]) - int(mp[0])], np.int64),
            ps - ps[0],
            start,
            length,
            doc,
            within,
            np.zeros((0, 1), np.int64),
        )

    def _verified_rows(self, g: int) -> list[np.ndarray]:
        """:func:`microbatch_rows` of ``g``, checked against ``mb_sums[g]`` (its block verified)."""
        want = int(self._get("mb_sums", g, g + 1)[0])
        try:
            rows = microbatch_rows(self._arrays, g)
        except ValueError as e:
            raise PlanFileError(f"plan file {self.path}: microbatch {g} is damaged ({e})") from None
        got = microbatch_sum(rows)
        if got != want:
            raise PlanFileError(
                f"plan file {self.path}: microbatch {g} fails its checksum (xxh3 {got:016x}, stored "
                f"{want:016x}: damaged after it was written): delete the file, or rerun `h5corpus plan`"
            )
        self._mb_ok[g] = 1
        return rows


# ------------------------------------------------------------------------------------------------
# The file
# ------------------------------------------------------------------------------------------------
def plan_file_name(fingerprint: str, settings: Mapping[str, Any], epoch: int) -> str:
    """The file name of a plan: a digest of its fingerprint and settings, then the epoch."""
    key = hashlib.sha256(json.dumps([fingerprint, dict(settings)], sort_keys=True).encode()).hexdigest()[:24]
    return f"bestfit-{key}-e{int(epoch)}.h5cplan"


def microbatch_rows(arrays: Mapping[str, np.ndarray], g: int) -> list[np.ndarray]:
    """Microbatch ``g``'s rows, unverified: ``mb_packs[g : g + 2]``, its packs' ``pack_starts``
    (``p0 .. p1`` inclusive) and its segments' rows of :data:`SEGMENT_ARRAYS`, in that order.
    ValueError when the bounds they hold do not fit the arrays (a damaged file)."""
    mp = arrays["mb_packs"][g : g + 2]
    p0, p1 = int(mp[0]), int(mp[1])
    ps_all = arrays["pack_starts"]
    if not 0 <= p0 <= p1 < ps_all.shape[0]:
        raise ValueError(f"packs [{p0}, {p1}) outside the plan's {ps_all.shape[0] - 1}")
    ps = ps_all[p0 : p1 + 1]
    a, b = int(ps[0]), int(ps[-1])
    if not 0 <= a <= b <= arrays["seg_start"].shape[0]:
        raise ValueError(f"segments [{a}, {b}) outside the plan's {arrays['seg_start'].shape[0]}")
    return [mp, ps, *(arrays[n][a:b] for n in SEGMENT_ARRAYS)]


def microbatch_sum(rows: list[np.ndarray]) -> int:
    """xxh3-64 of ``rows`` (:func:`microbatch_rows`) end to end: a microbatch's checksum."""
    h = xxhash.xxh3_64()
    for r in rows:
        h.update(r)
    return h.intdigest()


def _block_sums(raw: np.ndarray) -> list[int]:
    return [xxhash.xxh3_64_intdigest(raw[i : i + BLOCK]) for i in range(0, raw.size, BLOCK)]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def write_plan_file(path: str | os.PathLike, arrays: PlanArrays, identity: Mapping[str, Any]) -> None:
    """Write ``arrays`` to ``path`` atomically (a temporary name in the same folder, fsync, rename).
    ``identity``: fingerprint, settings and epoch, stored in the header and compared on open."""
    path = Path(path)
    data = {n: np.ascontiguousarray(a, dtype=DTYPES[n]) for n, a in arrays._asdict().items()}
    data["mb_sums"] = np.array(
        [microbatch_sum(microbatch_rows(data, g)) for g in range(data["mb_packs"].size - 1)], dtype=DTYPES["mb_sums"]
    )
    sums: list[int] = []
    layout, offset = {}, 0
    for name, a in data.items():
        raw = a.reshape(-1).view(np.uint8)
        layout[name] = {"shape": list(a.shape), "offset": offset, "nbytes": int(raw.size), "first_sum": len(sums)}
        sums.extend(_block_sums(raw))
        offset += _aligned(raw.size)
    table = np.asarray(sums, dtype="<u8").tobytes()
    meta = {
        "version": PLANFILE_VERSION,
        **identity,
        "arrays": layout,
        "sums": [len(sums), hashlib.sha256(table).hexdigest()],
    }
    header = json.dumps(meta, sort_keys=True).encode()
    body0 = _aligned(_PREAMBLE.size + len(header)) + _aligned(len(table))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(_PREAMBLE.pack(MAGIC, len(header), hashlib.sha256(header).digest()))
        f.write(header)
        f.seek(_aligned(_PREAMBLE.size + len(header)))
        f.write(table)
        for name, a in data.items():
            f.seek(body0 + layout[name]["offset"])
            f.write(a.tobytes())
        f.truncate(body0 + offset)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_plan_file(path: str | os.PathLike, identity: Mapping[str, Any]) -> SharedPlan:
    """Memory-map the plan file at ``path``; :class:`PlanFileError` if it is damaged (magic,
    header or checksum table hash, sizes) or stale (its fingerprint, settings or epoch differ
    from ``identity``). Costs the header and the checksum table (8 bytes per 16 KiB of plan)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _PREAMBLE.size:
            raise PlanFileError(f"plan file {path}: {size} bytes, shorter than its preamble (damaged)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    magic, hlen, digest = _PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC or _PREAMBLE.size + hlen > size:
        raise PlanFileError(f"plan file {path}: not a plan file of this version, or truncated (damaged)")
    header = bytes(buf[_PREAMBLE.size : _PREAMBLE.size + hlen])
    if hashlib.sha256(header).digest() != digest:
        raise PlanFileError(f"plan file {path}: header fails its sha256 (damaged)")
    h = json.loads(header)
    for key in ("version", *identity):
        want = PLANFILE_VERSION if key == "version" else identity[key]
        if h.get(key) != json.loads(json.dumps(want)):
            raise PlanFileError(f"plan file {path}: stale, its {key} is {h.get(key)!r}, this plan's is {want!r}")
    n_sums, sums_sha = h["sums"]
    t0 = _aligned(_PREAMBLE.size + hlen)
    if t0 + 8 * n_sums > size or hashlib.sha256(buf[t0 : t0 + 8 * n_sums]).hexdigest() != sums_sha:
        raise PlanFileError(f"plan file {path}: checksum table fails its sha256 (damaged)")
    sums = np.frombuffer(buf, dtype="<u8", count=n_sums, offset=t0)
    return _map_arrays(buf, h["arrays"], sums, t0 + _aligned(8 * n_sums), str(path))


def _map_arrays(buf: mmap.mmap, layout: Mapping[str, Any], sums: np.ndarray, body0: int, path: str) -> SharedPlan:
    arrays, block_sums = {}, {}
    size = len(buf)
    for name, dt in DTYPES.items():
        e = layout.get(name)
        if e is None:
            raise PlanFileError(f"plan file {path}: array {name!r} missing (damaged)")
        shape, n = tuple(int(x) for x in e["shape"]), int(np.prod(e["shape"])) * dt.itemsize
        start, first, nb = body0 + int(e["offset"]), int(e["first_sum"]), -(-n // BLOCK)
        if n != int(e["nbytes"]) or start + n > size or first + nb > sums.size:
            raise PlanFileError(f"plan file {path}: array {name!r} does not fit the file (damaged)")
        arrays[name] = np.frombuffer(buf, dtype=dt, count=n // dt.itemsize, offset=start).reshape(shape)
        block_sums[name] = sums[first : first + nb]
    return SharedPlan(arrays, block_sums, path)


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
