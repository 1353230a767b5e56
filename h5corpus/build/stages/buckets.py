"""The bucketed decide stage: exact and near duplicates found in buckets that run as separate tasks.

The in-memory decide (:class:`~h5corpus.build.stages.decide.Decider`) keeps every id (32 bytes per
document) and the near-duplicate index (~1.9 KB per kept document) in one process. Here the same
answers come from ``B`` buckets, each a task that needs only its share of the build:

- **Keys** (written by the read stage, per task, next to its table): the task's ids sorted by id
  (``read/<task>.ids.npy``) and, with near dedup, one 64-bit hash per LSH band of each document's
  signature, sorted by hash (``read/<task>.bands.npy``), plus a header (``read/<task>.keys.json``)
  naming the table and signatures they were made from. Sorted keys make every bucket a contiguous
  slice of every task's file, found by binary search.
- **Exact dedup, bucket b**: the ids whose first 8 bytes (big-endian) fall in the b-th of ``B``
  equal ranges, from every task; an id seen more than once keeps its smallest (task, row), exactly
  the in-memory rule (first occurrence in input order wins). Output: the positions of the others.
- **Near dedup, bucket b**: the (band, key) groups whose band hash falls in the b-th range. A group
  is the set of documents whose signatures agree on all ``rows`` values of one band: the candidates
  the in-memory LSH index would compare. Within each group (members in input order, exact
  duplicates of an earlier member left out: they are never kept), each document lists its first
  :data:`NEAR_LIST` earlier members that are similar (agreement >= threshold, the index's own
  test; any member with ``verify`` off), and whether there were more. Output: those edges, and the
  full member list of every group where a list was cut short.

The merge (:mod:`~h5corpus.build.stages.merge`) then walks the documents in input order: a document is a
near duplicate when one of its listed earlier members was kept (and, for a cut list, when any
earlier kept member of that group is similar), which is the in-memory index's rule, since the index
compares a document with exactly the kept members of its groups. Groups of one document, the vast
majority, cost nothing past the sort. Positions are ``task << 32 | row`` (uint64), so sorting them
sorts input order.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import io
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import BuildConflict
from .state import DOC_DTYPE, ReadRecord, StateDir, write_state_file

KEYS_VERSION = 1
BUCKET_VERSION = 1
#: Similar earlier members listed per document and band group. A document whose listed members
#: were all dropped, while the group has more similar earlier ones, is checked against the full
#: group by the merge (rare: it needs this many near duplicates of one cluster dropped in a row).
NEAR_LIST = 4
#: Groups up to this size compare all pairs at once (m * m * num_perm booleans); larger ones scan.
PAIRWISE_MAX = 192

ID_KEY = np.dtype([("id", "V32"), ("row", "<u4")])
"""A task's ids, sorted by id (memcmp order = big-endian order of the 8-byte prefix)."""
BAND_KEY = np.dtype([("h", "<u8"), ("row", "<u4"), ("band", "<u2")])
"""A task's band hashes, sorted by (hash, band, row); documents with the empty signature are left out."""


# -- LSH parameters -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LshParams:
    """The near-duplicate index's parameters (``NearDedupIndex`` attributes)."""

    num_perm: int
    bands: int
    rows: int
    threshold: float
    verify: bool

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lsh_params(index: Any) -> LshParams | None:
    """The parameters of a near-duplicate index (None when near dedup is off); BuildConflict for an
    index whose rule the buckets cannot reproduce (anything but an LSH index with these fields)."""
    if index is None:
        return None
    try:
        p = LshParams(
            int(index.num_perm), int(index.bands), int(index.rows), float(index.threshold), bool(index.verify)
        )
    except AttributeError:
        raise BuildConflict(
            f"the near-duplicate index {type(index).__qualname__} has no num_perm/bands/rows/threshold/verify: "
            "the bucketed decide stage cannot reproduce it; run with the local executor and --decide-buckets 0"
        ) from None
    if p.bands < 1 or p.rows < 1 or p.bands * p.rows > p.num_perm or p.bands > 0xFFFF:
        raise BuildConflict(f"near-duplicate index with {p.bands} bands x {p.rows} rows of {p.num_perm}")
    return p


_EMPTY = np.uint32(0xFFFFFFFF)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (a bijection of uint64 with good avalanche), vectorized."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def band_hashes(sigs: np.ndarray, lsh: LshParams) -> np.ndarray:
    """(documents, bands) uint64: a hash of each band's ``rows`` values and the band's index. Only
    decides the bucket and the sort; groups are checked on the values themselves."""
    n = sigs.shape[0]
    x = np.ascontiguousarray(sigs[:, : lsh.bands * lsh.rows], dtype=np.uint32).reshape(n, lsh.bands, lsh.rows)
    with np.errstate(over="ignore"):
        h = _mix(np.arange(1, lsh.bands + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        h = np.broadcast_to(h, (n, lsh.bands)).copy()
        for r in range(lsh.rows):
            h = _mix(h ^ x[:, :, r].astype(np.uint64))
    return h


def nonempty_signatures(sigs: np.ndarray) -> np.ndarray:
    """Rows that are not the empty signature (a text without words: never a near duplicate)."""
    return ~(sigs == _EMPTY).all(axis=1) if sigs.size else np.zeros(sigs.shape[0], dtype=bool)


# -- per-task keys (written by the read stage) ------------------------------------------------------
@dataclass(frozen=True)
class KeyPaths:
    ids: Path
    bands: Path
    header: Path

    @classmethod
    def of(cls, state: StateDir, index: int) -> KeyPaths:
        stem = state.read_paths(index).candidates
        return cls(
            stem.with_name(stem.name + ".ids.npy"),
            stem.with_name(stem.name + ".bands.npy"),
            stem.with_name(stem.name + ".keys.json"),
        )


def load_npy(path: Path) -> np.ndarray:
    """An ``.npy`` file memory-mapped (read in slices), or read whole when it holds no element (a
    zero-length map is an error)."""
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError:
        return np.load(path, allow_pickle=False)


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def task_keys(docs: np.ndarray, sigs: np.ndarray | None, lsh: LshParams | None) -> tuple[np.ndarray, np.ndarray]:
    """A task's sorted id keys and band keys (empty without near dedup) from its table and signatures."""
    ids = np.empty(docs.size, dtype=ID_KEY)
    ids["id"] = docs["id"]
    ids["row"] = np.arange(docs.size, dtype=np.uint32)
    ids = ids[np.argsort(ids["id"], kind="stable")]
    bands = np.empty(0, dtype=BAND_KEY)
    if lsh is not None and sigs is not None and sigs.size:
        if sigs.shape[1] != lsh.num_perm:
            raise BuildConflict(f"signatures have {sigs.shape[1]} values, the index expects {lsh.num_perm}")
        rows = np.flatnonzero(nonempty_signatures(sigs))
        h = band_hashes(sigs[rows], lsh)
        bands = np.empty(h.size, dtype=BAND_KEY)
        bands["h"] = h.ravel()
        bands["row"] = np.repeat(rows.astype(np.uint32), lsh.bands)
        bands["band"] = np.tile(np.arange(lsh.bands, dtype=np.uint16), rows.size)
        bands = bands[np.lexsort((bands["row"], bands["band"], bands["h"]))]
    return ids, bands


def _keys_header(rec: ReadRecord, lsh: LshParams | None, ids: bytes, bands: bytes) -> dict[str, Any]:
    return {
        "version": KEYS_VERSION,
        "task": rec.task,
        "docs_sha256": rec.docs_sha256,
        "signatures_sha256": rec.signatures_sha256,
        "lsh": None if lsh is None else lsh.to_json(),
        "ids_bytes": len(ids),
        "bands_bytes": len(bands),
    }


def write_task_keys(
    state: StateDir, rec: ReadRecord, docs: np.ndarray, sigs: np.ndarray | None, lsh: LshParams | None
) -> None:
    """Write task ``rec.index``'s keys (durably, header last: a header means complete files)."""
    p = KeyPaths.of(state, rec.index)
    ids, bands = task_keys(docs, sigs, lsh)
    ib, bb = _npy_bytes(ids), _npy_bytes(bands)
    write_state_file(p.ids, ib, durable=True)
    write_state_file(p.bands, bb, durable=True)
    write_state_file(p.header, json.dumps(_keys_header(rec, lsh, ib, bb), sort_keys=True).encode(), durable=True)


def load_task_keys(state: StateDir, rec: ReadRecord, lsh: LshParams | None) -> tuple[np.ndarray, np.ndarray]:
    """Task ``rec.index``'s keys, memory-mapped; made from its table first when missing or made from
    other data (a read record of a run without buckets)."""
    p = KeyPaths.of(state, rec.index)
    for attempt in (0, 1):
        try:
            head = json.loads(p.header.read_text())
            want = _keys_header(rec, lsh, b"", b"")
            same = all(head.get(k) == want[k] for k in ("version", "task", "docs_sha256", "signatures_sha256", "lsh"))
            if same and p.ids.stat().st_size == head["ids_bytes"] and p.bands.stat().st_size == head["bands_bytes"]:
                return load_npy(p.ids), load_npy(p.bands)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if attempt == 0:
            docs, sigs, _ = state.load_read_outputs(rec)
            write_task_keys(state, rec, docs, sigs, lsh)
    raise BuildConflict(f"{p.header}: the keys of task {rec.index} cannot be written or read back")


# -- buckets --------------------------------------------------------------------------------------
def bucket_bounds(b: int, buckets: int) -> tuple[int, int]:
    """[lo, hi) of the 64-bit values in bucket ``b`` of ``buckets`` equal ranges (hi may be 2**64)."""
    return -((-b << 64) // buckets), -((-(b + 1) << 64) // buckets)


def _slice(n: int, key_at, lo: int, hi: int) -> tuple[int, int]:
    """[a, b) of the sorted keys (``key_at(i)`` -> int) that fall in [lo, hi), by binary search."""
    return bisect.bisect_left(range(n), lo, key=key_at), bisect.bisect_left(range(n), hi, key=key_at)


def _field_at(keys: np.ndarray, name: str):
    col = keys[name]
    return lambda i: int(col[i])


def _id_prefix_at(ids: np.ndarray):
    col = ids["id"]
    return lambda i: int.from_bytes(bytes(col[i])[:8], "big")


def positions(task: int | np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``task << 32 | row`` as uint64 (sorts in input order)."""
    return (np.asarray(task, dtype=np.uint64) << np.uint64(32)) | rows.astype(np.uint64)


def exact_bucket(
    state: StateDir, reads: Sequence[ReadRecord], lsh: LshParams | None, b: int, buckets: int
) -> np.ndarray:
    """Sorted positions of the documents whose id occurs at a smaller (task, row), among the ids of
    bucket ``b``."""
    lo, hi = bucket_bounds(b, buckets)
    ids, pos = [], []
    for rec in reads:
        keys, _ = load_task_keys(state, rec, lsh)
        i, j = _slice(keys.size, _id_prefix_at(keys), lo, hi)
        part = np.array(keys[i:j])
        ids.append(part["id"])
        pos.append(positions(rec.index, part["row"]))
    if not ids:
        return np.zeros(0, dtype=np.uint64)
    return exact_duplicates(np.concatenate(ids), np.concatenate(pos))


def exact_duplicates(ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Sorted positions of the ids (``pos``: their positions, ascending) seen at a smaller position."""
    order = np.argsort(ids, kind="stable")  # equal ids keep their order: the first is the smallest position
    s = ids[order]
    return np.sort(pos[order[1:][s[1:] == s[:-1]]])


# -- near dedup in a bucket -----------------------------------------------------------------------
@dataclass
class NearEdges:
    """A near bucket's result: for each document (``d``, a position) the first similar earlier members
    of its groups (``c``); the (document, group) pairs whose list was cut short, and those groups'
    members in input order."""

    d: np.ndarray
    c: np.ndarray
    trunc_d: np.ndarray
    trunc_g: np.ndarray
    groups: np.ndarray
    group_offsets: np.ndarray
    counts: dict[str, int]

    FILES = ("d", "c", "trunc_d", "trunc_g", "groups", "group_offsets")


class Members:
    """Signatures and ids of the documents that share a band key with another (sorted positions)."""

    def __init__(self, pos: np.ndarray, sigs: np.ndarray, ids: np.ndarray) -> None:
        self.pos, self.sigs, self.ids = pos, sigs, ids

    @classmethod
    def gather(cls, state: StateDir, reads: Mapping[int, ReadRecord], pos: np.ndarray, num_perm: int) -> Members:
        """Read these documents' rows from the tasks' signature files and tables (memory maps: only
        these rows are read)."""
        upos = np.unique(pos)
        sigs = np.empty((upos.size, num_perm), dtype=np.uint32)
        ids = np.empty(upos.size, dtype="V32")
        tasks = (upos >> np.uint64(32)).astype(np.int64)
        rows = (upos & np.uint64(0xFFFFFFFF)).astype(np.int64)
        for t in np.unique(tasks).tolist():
            sel = np.flatnonzero(tasks == t)
            paths = state.read_paths(t)
            sig_file = load_npy(paths.signatures)
            table = np.memmap(paths.docs, dtype=DOC_DTYPE, mode="r", shape=(reads[t].documents,))
            sigs[sel] = sig_file[rows[sel]]
            ids[sel] = table["id"][rows[sel]]
        return cls(upos, sigs, ids)

    def index(self, pos: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.pos, pos)


def _first_similar(sigs: np.ndarray, lsh: LshParams, near_list: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For members in input order (``sigs``, one row each): pairs (j, i), i < j, of each member's first
    ``near_list`` similar earlier members, and which members had more."""
    m, k = sigs.shape
    if not lsh.verify:
        j = np.arange(1, m)
        n = np.minimum(j, near_list)
        jj = np.repeat(j, n)
        ii = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        return jj, ii, np.flatnonzero(np.r_[False, j > near_list])
    if m <= PAIRWISE_MAX:
        eq = (sigs[:, None, :] == sigs[None, :, :]).sum(axis=2)
        sim = (eq.astype(np.float64) / k >= lsh.threshold) & np.tri(m, m, -1, dtype=bool)
        rank = np.cumsum(sim, axis=1)
        jj, ii = np.nonzero(sim & (rank <= near_list))
        return jj, ii, np.flatnonzero(rank[:, -1] > near_list)
    out_j, out_i, more = [], [], []
    for j in range(1, m):
        found: list[int] = []
        for a in range(0, j, 256):
            b = min(j, a + 256)
            eq = (sigs[a:b] == sigs[j]).sum(axis=1)
            found += (a + np.flatnonzero(eq.astype(np.float64) / k >= lsh.threshold)).tolist()
            if len(found) > near_list:
                break
        out_j += [j] * min(len(found), near_list)
        out_i += found[:near_list]
        if len(found) > near_list:
            more.append(j)
    return np.asarray(out_j, dtype=np.int64), np.asarray(out_i, dtype=np.int64), np.asarray(more, dtype=np.int64)


def _band_values(sigs: np.ndarray, band: int | np.ndarray, rows: int) -> np.ndarray:
    """Each row's values of its band (one void per row: comparable as a whole)."""
    cols = np.asarray(band, dtype=np.int64).reshape(-1, 1) * rows + np.arange(rows)
    vals = np.ascontiguousarray(np.take_along_axis(sigs, np.broadcast_to(cols, (sigs.shape[0], rows)), axis=1))
    return vals.view(f"V{4 * rows}").ravel()


def _gather_band_keys(
    state: StateDir, reads: Sequence[ReadRecord], lsh: LshParams, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Band hash, band and position of every key in [lo, hi), sorted by (hash, band, position)."""
    hs, bands, pos = [], [], []
    for rec in reads:
        _, keys = load_task_keys(state, rec, lsh)
        i, j = _slice(keys.size, _field_at(keys, "h"), lo, hi)
        part = np.array(keys[i:j])
        hs.append(part["h"])
        bands.append(part["band"])
        pos.append(positions(rec.index, part["row"]))
    if not hs:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint16), np.zeros(0, np.uint64)
    h, band, p = np.concatenate(hs), np.concatenate(bands), np.concatenate(pos)
    order = np.lexsort((p, band, h))
    return h[order], band[order], p[order]


def near_bucket(
    state: StateDir, reads: Sequence[ReadRecord], lsh: LshParams, b: int, buckets: int, near_list: int = NEAR_LIST
) -> NearEdges:
    """The near-duplicate edges of bucket ``b`` (see the module docstring)."""
    h, band, pos = _gather_band_keys(state, reads, lsh, *bucket_bounds(b, buckets))
    starts, lens = _runs(h, band)
    multi = lens >= 2
    members = Members.gather(
        state, {r.index: r for r in reads}, pos[_run_members(starts[multi], lens[multi])], lsh.num_perm
    )
    return near_edges(h, band, pos, members, lsh, near_list)


def _runs(h: np.ndarray, band: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of each run of equal (hash, band) in the sorted keys."""
    new = np.r_[True, (h[1:] != h[:-1]) | (band[1:] != band[:-1])] if h.size else np.zeros(0, bool)
    starts = np.flatnonzero(new)
    return starts, np.diff(np.r_[starts, h.size])


def _run_members(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Indices of every element of the runs (``starts``, ``lens``)."""
    return np.repeat(starts, lens) + (np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens))


def _true_groups(
    h: np.ndarray, band: np.ndarray, pos: np.ndarray, mem: Members, rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The groups of the sorted keys: documents whose signatures agree on all values of one band
    (runs of equal hash and band, split where a hash collision joined different values), without
    the exact duplicates of an earlier member (never kept). Returns the members' positions and
    :class:`Members` rows, input order within each group, and the groups' offsets; groups of one
    are left out."""
    starts, lens = _runs(h, band)
    multi = lens >= 2
    at = _run_members(starts[multi], lens[multi])
    mpos = pos[at]
    mi = mem.index(mpos)
    vals = _band_values(mem.sigs[mi], band[at], rows)
    key = np.empty(at.size, dtype=[("run", "<i8"), ("values", vals.dtype)])
    key["run"] = np.repeat(np.arange(int(multi.sum())), lens[multi])
    key["values"] = vals
    sub = np.unique(key, return_inverse=True)[1].ravel()
    order = np.lexsort((mpos, sub))
    sub, mpos, mi = sub[order], mpos[order], mi[order]
    ident = np.empty(sub.size, dtype=[("group", "<i8"), ("id", "V32")])
    ident["group"], ident["id"] = sub, mem.ids[mi]
    keep = np.sort(np.unique(ident, return_index=True)[1])  # first of each id in a group: the earliest
    sub, mpos, mi = sub[keep], mpos[keep], mi[keep]
    gstart = np.flatnonzero(np.r_[True, sub[1:] != sub[:-1]]) if sub.size else np.zeros(0, np.int64)
    glen = np.diff(np.r_[gstart, sub.size])
    ok = glen >= 2
    sel = _run_members(gstart[ok], glen[ok])
    return mpos[sel], mi[sel], np.r_[0, np.cumsum(glen[ok])].astype(np.int64)


def _first_similar_batch(
    sigs: np.ndarray, lsh: LshParams, near_list: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_first_similar` of G groups of m members at once (``sigs``: G x m x num_perm): (g, j, i)
    of the listed pairs, and (g, j) of the members with more similar earlier ones."""
    g, m, k = sigs.shape
    tri = np.tri(m, m, -1, dtype=bool)
    if lsh.verify:
        eq = (sigs[:, :, None, :] == sigs[:, None, :, :]).sum(axis=3)
        sim = (eq.astype(np.float64) / k >= lsh.threshold) & tri
    else:
        sim = np.broadcast_to(tri, (g, m, m))
    rank = np.cumsum(sim, axis=2)
    gg, jj, ii = np.nonzero(sim & (rank <= near_list))
    mg, mj = np.nonzero(rank[:, :, -1] > near_list)
    return gg, jj, ii, mg, mj


#: Booleans one batch of equal-size groups may compare at once (G x m x m x num_perm).
BATCH_CELLS = 1 << 24


def near_edges(
    h: np.ndarray, band: np.ndarray, pos: np.ndarray, mem: Members, lsh: LshParams, near_list: int = NEAR_LIST
) -> NearEdges:
    """The edges of the groups in the sorted keys (``h``, ``band``, ``pos``; :func:`near_bucket`):
    groups of one size are compared in batches, all pairs at once; only groups of more than
    :data:`PAIRWISE_MAX` members are scanned one by one."""
    gpos, gmi, goff = _true_groups(h, band, pos, mem, lsh.rows)
    sizes = np.diff(goff)
    counts = {"keys": int(h.size), "groups": int(sizes.size)}
    d: list[np.ndarray] = []
    c: list[np.ndarray] = []
    trunc_d: list[np.ndarray] = []
    trunc_g: list[np.ndarray] = []
    groups: list[np.ndarray] = []
    for m in np.unique(sizes).tolist():
        which = np.flatnonzero(sizes == m)
        if m > PAIRWISE_MAX:
            for w in which.tolist():
                members = gpos[goff[w] : goff[w + 1]]
                jj, ii, more = _first_similar(mem.sigs[gmi[goff[w] : goff[w + 1]]], lsh, near_list)
                d.append(members[jj])
                c.append(members[ii])
                if more.size:
                    trunc_d.append(members[more])
                    trunc_g.append(np.full(more.size, len(groups), dtype=np.uint32))
                    groups.append(members)
            continue
        step = max(1, BATCH_CELLS // (m * m * lsh.num_perm))
        for a in range(0, which.size, step):
            idx = goff[which[a : a + step]][:, None] + np.arange(m)  # G x m rows of gpos
            gg, jj, ii, mg, mj = _first_similar_batch(mem.sigs[gmi[idx]], lsh, near_list)
            d.append(gpos[idx[gg, jj]])
            c.append(gpos[idx[gg, ii]])
            if mg.size:
                cut, local = np.unique(mg, return_inverse=True)
                trunc_d.append(gpos[idx[mg, mj]])
                trunc_g.append((len(groups) + local.ravel()).astype(np.uint32))
                groups += [gpos[idx[x]] for x in cut.tolist()]
    return _near_edges(d, c, trunc_d, trunc_g, groups, counts)


def _near_edges(
    d: list, c: list, trunc_d: list, trunc_g: list, groups: list[np.ndarray], counts: dict[str, int]
) -> NearEdges:
    dd = np.concatenate(d).astype(np.uint64) if d else np.zeros(0, np.uint64)
    cc = np.concatenate(c).astype(np.uint64) if c else np.zeros(0, np.uint64)
    order = np.lexsort((cc, dd))
    td = np.concatenate(trunc_d).astype(np.uint64) if trunc_d else np.zeros(0, np.uint64)
    tgg = np.concatenate(trunc_g).astype(np.uint32) if trunc_g else np.zeros(0, np.uint32)
    o = np.lexsort((tgg, td))
    offsets = np.zeros(len(groups) + 1, dtype=np.uint64)
    offsets[1:] = np.cumsum([g.size for g in groups])
    counts = {**counts, "edges": int(dd.size), "cut_short": int(td.size)}
    return NearEdges(
        dd[order],
        cc[order],
        td[o],
        tgg[o],
        np.concatenate(groups).astype(np.uint64) if groups else np.zeros(0, np.uint64),
        offsets,
        counts,
    )


# -- the stage ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BucketRecord:
    """A bucket's result (``decide/b<bucket>.json``): its files' sha256 and what they hold."""

    bucket: int
    buckets: int
    inputs: str
    """:func:`decide_inputs` of the read records it was computed from."""
    files: dict[str, str]
    """Suffix (``exact``, ``d``, ``c``, ...) -> sha256 of ``decide/b<bucket>.<suffix>.npy``."""
    counts: dict[str, int]
    seconds: float
    """CPU seconds (report only)."""
    version: int = BUCKET_VERSION

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BucketRecord:
        if not isinstance(d, Mapping) or d.get("version") != BUCKET_VERSION:
            raise ValueError("bucket record of another version")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def decide_inputs(reads: Sequence[ReadRecord], lsh: LshParams | None, buckets: int) -> str:
    """sha256 naming what the buckets are computed from: every task's table and signatures, the LSH
    parameters and the bucket count. A bucket record of other inputs is redone."""
    what = {
        "buckets": buckets,
        "lsh": None if lsh is None else lsh.to_json(),
        "tasks": [[r.index, r.task, r.docs_sha256, r.signatures_sha256] for r in reads],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def decide_dir(state: StateDir) -> Path:
    return state.root / "decide"


def bucket_file(state: StateDir, b: int, suffix: str) -> Path:
    return decide_dir(state) / f"b{b:05d}.{suffix}.npy" if suffix else decide_dir(state) / f"b{b:05d}.json"


def load_bucket_record(state: StateDir, b: int, inputs: str) -> BucketRecord | None:
    """Bucket ``b``'s record when it was computed from ``inputs`` and its files are there; else None."""
    try:
        rec = BucketRecord.from_json(json.loads(bucket_file(state, b, "").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if rec.inputs != inputs or rec.bucket != b or not all(bucket_file(state, b, k).is_file() for k in rec.files):
        return None
    return rec


def run_bucket(
    state: StateDir, reads: Sequence[ReadRecord], lsh: LshParams | None, b: int, buckets: int
) -> BucketRecord:
    """Bucket ``b`` of ``buckets``: its exact and near results in the state folder, record last.
    A record of the same inputs is reused."""
    inputs = decide_inputs(reads, lsh, buckets)
    old = load_bucket_record(state, b, inputs)
    if old is not None:
        return old
    c0 = time.process_time()
    decide_dir(state).mkdir(parents=True, exist_ok=True)
    arrays = {"exact": exact_bucket(state, reads, lsh, b, buckets)}
    counts = {"exact_duplicates": int(arrays["exact"].size)}
    if lsh is not None:
        near = near_bucket(state, reads, lsh, b, buckets)
        arrays.update({k: getattr(near, k) for k in NearEdges.FILES})
        counts.update(near.counts)
    files = {}
    for k, a in arrays.items():
        blob = _npy_bytes(np.ascontiguousarray(a))
        write_state_file(bucket_file(state, b, k), blob, durable=True)
        files[k] = hashlib.sha256(blob).hexdigest()
    rec = BucketRecord(
        bucket=b, buckets=buckets, inputs=inputs, files=files, counts=counts, seconds=round(time.process_time() - c0, 4)
    )
    write_state_file(bucket_file(state, b, ""), json.dumps(rec.to_json(), sort_keys=True).encode())
    return rec


def load_bucket_arrays(state: StateDir, rec: BucketRecord) -> dict[str, np.ndarray]:
    """A bucket's arrays, memory-mapped (each is read in slices by the merge)."""
    out = {}
    for k in rec.files:
        out[k] = load_npy(bucket_file(state, rec.bucket, k))
    return out
