"""Perplexity of documents under an n-gram language model (interpolated modified Kneser-Ney),
trained on reference text (e.g. Wikipedia) by :func:`h5corpus.filters.ngramtrain.train_ngram_model`.

A high perplexity means the document does not look like the reference: keyword lists, boilerplate,
machine-generated noise (RefinedWeb and CCNet filter web text this way, with KenLM models).

The model counts *units* (:mod:`h5corpus.filters.lmunits`: words with punctuation split off, ASCII
case and digits folded, line breaks as one unit). Every text is scored as ``<s> u1 ... un </s>``:
each unit and the end of text are predicted from up to ``order - 1`` units before them;
``<s>`` is context only. The perplexity of a text is ``exp(-(sum of ln p) / (n + 1))``.

Representation (what :meth:`NgramModel.save` writes and the scorer reads): for every order ``k``,
the n-grams seen in training as sorted 64-bit keys (:func:`ngram_keys`) with, for each, ``ln p``
of its last unit given the ``k - 1`` before (the full interpolated probability) and, for orders
below the highest, ``ln`` of its backoff weight as a context and whether it is one. The
probability of a unit is then that of the longest n-gram ending with it that the model holds,
times the backoff weights of the longer contexts (ARPA's backoff form of an interpolated model,
as KenLM stores it); a unit never seen in training gets the ``<unk>`` unigram probability.

Scoring is vectorized over a batch of texts: one lookup per unit and order (only where the
shorter n-gram was found and its context can be extended), no per-unit Python. Lookups are a
``searchsorted`` over the sorted keys, accelerated by a directory on their top bits (keys are
uniform hashes, so one or two steps from the directory entry find the place).

Model files (``.npz``: a zip of uncompressed ``.npy`` arrays, nothing pickled) hold a JSON header
(format, version, unit definition, order, smoothing parameters, what the model was trained on, the
sha256 of its arrays) and the arrays. Nothing a file declares is allocated before it is checked
against the file's size (:class:`_ModelArchive`), so loading any file takes memory proportional
to its size; a file that is not a model, of another version, with values no model holds (NaN, infinite
weights), or whose arrays do not match their sha256 raises :class:`ModelFileError` naming the file
and the array or header field.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .lmunits import BOS, BOS_HASH, EOS, EOS_HASH, UNITS_VERSION, UnitBatch, unit_hashes, units_batch
from .words import HASH_PRIME

FORMAT = "h5corpus-ngram-lm"
FORMAT_VERSION = 1
"""Version of the model file layout and of the meaning of its arrays."""
SMOOTHING = "interpolated modified Kneser-Ney"
MAX_ORDER = 6
"""Highest supported order (memory grows with it; 2-4 are the useful ones for filtering)."""

_P64 = np.uint64(HASH_PRIME)
_EVEN = np.uint64(~1 & 0xFFFFFFFFFFFFFFFF)
_SENTINEL = np.uint64(0xFFFFFFFFFFFFFFFF)  # odd: never a key (keys are even)


class ModelFileError(ValueError):
    """A model file that cannot be used: missing, not a model, another version, corrupt."""


# -- n-gram keys -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Texts laid out for n-gram counting/scoring: ``<s> units </s>`` per text, concatenated."""

    hashes: np.ndarray
    """uint64 unit hashes with :data:`BOS_HASH` / :data:`EOS_HASH` around each text's units."""
    pos: np.ndarray
    """int64 position of each entry in its text's sequence (0 = its ``<s>``)."""
    bounds: np.ndarray
    """int64 (texts + 1,): first entry of each text's sequence; the last entry is the total."""


def layout(units: UnitBatch) -> Layout:
    """The ``<s> u1 ... un </s>`` sequence of every text of ``units``."""
    lens = units.counts() + 2
    bounds = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(lens, out=bounds[1:])
    total = int(bounds[-1])
    seq = np.empty(total, dtype=np.uint64)
    seq[bounds[:-1]] = BOS_HASH
    seq[bounds[1:] - 1] = EOS_HASH
    text_of_unit = np.repeat(np.arange(lens.size), units.counts())
    seq[np.arange(units.hashes.size) + 2 * text_of_unit + 1] = units.hashes
    pos = np.arange(total, dtype=np.int64) - np.repeat(bounds[:-1], lens)
    return Layout(seq, pos, bounds)


def next_raw(raw: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """The unmixed hashes of the (k+1)-grams ending at each position from those of the k-grams
    (``raw``): ``raw[i - 1] * P + seq[i]`` (entry 0 is meaningless)."""
    out = np.empty_like(raw)
    out[:1] = 0
    with np.errstate(over="ignore"):
        np.multiply(raw[:-1], _P64, out=out[1:])
        out[1:] += seq[1:]
    return out


def key_of(raw: np.ndarray) -> np.ndarray:
    """Keys from the unmixed hashes: even (odd values are free for the lookup's sentinel). The
    polynomial of uniform 64-bit unit hashes is uniform already (the lookup directory needs
    uniform top bits); each order has its own table, so orders need no salt."""
    return raw & _EVEN


def ngram_keys(units: Sequence[str]) -> np.ndarray:
    """uint64 key of the n-gram ``units`` (strings: see :func:`h5corpus.filters.lmunits.unit_hashes`),
    as the model files store it."""
    h = unit_hashes(list(units))
    raw = h.copy()
    for _ in range(1, len(units)):
        raw = next_raw(raw, h)
    return key_of(raw[-1:])


# -- lookup tables -----------------------------------------------------------------------------
class _Table:
    """The n-grams of one order: sorted keys plus a directory on their top bits."""

    def __init__(self, keys: np.ndarray) -> None:
        self.size = int(keys.size)
        bits = max(1, int(np.ceil(np.log2(max(self.size, 2)))) + 1)  # 2-4 directory slots per key
        self.shift = np.uint64(64 - bits)
        self.keys = np.append(keys, _SENTINEL)
        self.start = np.zeros((1 << bits) + 1, dtype=np.int64)
        np.cumsum(np.bincount((keys >> self.shift).astype(np.intp), minlength=1 << bits), out=self.start[1:])

    def find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, index) of each query key: where the key is in the table, its row; elsewhere
        the row of the next larger key (``index = searchsorted(keys, q)`` everywhere)."""
        bucket = (q >> self.shift).view(np.int64)  # < 2**63: the same values, no conversion to intp
        pos = self.start[bucket]
        k = self.keys[pos]
        less = np.flatnonzero(k < q)
        while less.size:  # at most a few steps: keys are uniform hashes
            p = pos[less] + 1
            pos[less] = p
            kk = self.keys[p]
            k[less] = kk
            less = less[kk < q[less]]
        return k == q, pos


@dataclass
class Level:
    """The arrays of one order ``k`` of a model (what the file stores)."""

    keys: np.ndarray
    """uint64, sorted, even: the n-grams of order k (:func:`ngram_keys`)."""
    log_prob: np.ndarray
    """float32 ln p(last unit | the k - 1 before) (``-inf`` for ``<s>``, never predicted)."""
    log_backoff: np.ndarray | None
    """float32 ln of the backoff weight of the n-gram as a context (0 when it is none); None for
    the highest order."""
    is_context: np.ndarray | None
    """bool: the n-gram is the context of some n-gram of order k + 1; None for the highest order."""


class NgramModel:
    """An n-gram language model in backoff form (module docstring); :meth:`perplexities` scores
    texts. Build with :func:`h5corpus.filters.ngramtrain.train_ngram_model` or :func:`load_model`."""

    def __init__(self, levels: Sequence[Level], unk_log_prob: float, header: dict[str, Any]) -> None:
        self.levels = list(levels)
        self.order = len(self.levels)
        self.unk_log_prob = float(unk_log_prob)
        self.header = header
        """The JSON header (see :func:`model_header`); ``header["sha256"]`` identifies the model."""
        self._tables = [_Table(lv.keys) for lv in self.levels]
        # the unigram values with one more row, for units not in the model (<unk>, no context)
        one, rows = self.levels[0], self.levels[0].keys.size
        self._unigram_log_prob = np.append(one.log_prob, np.float32(self.unk_log_prob))
        self._unigram_backoff = np.zeros(rows + 1, dtype=np.float32)
        self._unigram_context = np.zeros(rows + 1, dtype=bool)
        if one.log_backoff is not None:
            self._unigram_backoff[:rows] = one.log_backoff
            self._unigram_context[:rows] = one.is_context

    @property
    def sha256(self) -> str:
        """Identity of everything that decides scores (arrays, order, units, ``<unk>``)."""
        return str(self.header["sha256"])

    # -- scoring -------------------------------------------------------------------------------
    def log_probs(self, seq: np.ndarray) -> np.ndarray:
        """float32 ln p of every entry of laid-out texts (:func:`layout`) given the entries before
        it in its text (the value at a ``<s>`` is meaningless: context only). One table lookup
        per entry and order, only where the n-gram can be in the model: where the shorter one
        ending there was found and the one ending just before is a context. (Nothing extends
        ``</s>`` and ``<s>`` only follows it, so no n-gram reaches across two texts.)"""
        n = seq.size
        found, idx = self._tables[0].find(seq & _EVEN)
        idx = np.where(found, idx, self.levels[0].keys.size)  # the <unk> row where not found
        lp, bow, ctx = self._unigram_log_prob[idx], self._unigram_backoff[idx], self._unigram_context[idx]
        if self.order == 1 or n == 0:
            return lp
        lp[1:] += bow[:-1]  # back off through the context before; overwritten where a longer n-gram is found
        hit = np.flatnonzero(found[1:]) + 1  # positions where the longest n-gram found so far ends
        raw = seq.copy()  # at those positions, the unmixed key of that n-gram
        for k in range(2, self.order + 1):
            cand = hit[ctx[hit - 1]]
            r = raw[cand - 1] * _P64 + seq[cand]
            f, i = self._tables[k - 1].find(r & _EVEN)
            hit, i = cand[f], i[f]
            lv = self.levels[k - 1]
            lp[hit] = lv.log_prob[i]
            if k < self.order:
                nxt = hit[hit < n - 1]
                lp[nxt + 1] += lv.log_backoff[i[: nxt.size]]
                ctx = np.zeros(n, dtype=bool)
                ctx[hit] = lv.is_context[i]
                raw[hit] = r[f]
        return lp

    def score_units(self, units: UnitBatch) -> tuple[np.ndarray, np.ndarray]:
        """(float64 total ln p, int64 predicted units = units + 1 for ``</s>``) of every text."""
        lay = layout(units)
        lp = self.log_probs(lay.hashes)
        lp[lay.bounds[:-1]] = 0.0  # the <s> entries are not predicted
        totals = np.add.reduceat(lp, lay.bounds[:-1], dtype=np.float64) if lp.size else np.zeros(0)
        return totals, units.counts() + 1

    def score(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(float64 total ln p, int64 predicted units) of every text (:meth:`score_units`)."""
        return self.score_units(units_batch(texts))

    def perplexities(self, texts: Sequence[str]) -> np.ndarray:
        """float64 perplexity of every text: ``exp(-total ln p / predicted units)``, >= 1."""
        total, n = self.score(texts)
        return np.exp(-total / n)

    def log_prob(self, context: Sequence[str], unit: str) -> float:
        """ln p(``unit`` | ``context``) for units as strings (``<s>`` first means the start of a
        text; ``</s>`` is the end of text; an unseen unit is ``<unk>``). Uses the last
        ``order - 1`` units of the context. For tests and inspection, not for bulk scoring."""
        return float(self.log_prob_many([(context, unit)])[0])

    def log_prob_many(self, queries: Sequence[tuple[Sequence[str], str]]) -> np.ndarray:
        """float32 :meth:`log_prob` of many ``(context, unit)`` queries at once."""
        hashes: dict[str, int] = {}
        seq: list[int] = []
        last: list[int] = []
        for context, unit in queries:
            units = [*context, unit]
            if BOS in units[1:] or EOS in units[:-1]:
                raise ValueError("<s> may only come first and </s> only last")
            for u in units:
                if u not in hashes:
                    hashes[u] = int(unit_hashes([u])[0])
                seq.append(hashes[u])
            last.append(len(seq) - 1)
            seq.append(int(EOS_HASH))  # nothing extends </s>: the next query starts afresh
        return self.log_probs(np.array(seq, dtype=np.uint64))[np.array(last, dtype=np.int64)]

    # -- file --------------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays as the file stores them (:func:`level_arrays`)."""
        return level_arrays(self.levels)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the model to ``path`` (an ``.npz``; a temporary name, then renamed). The bytes
        depend only on the model and its header (fixed zip timestamps)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        items = {"header": np.frombuffer(json.dumps(self.header, sort_keys=True).encode(), dtype=np.uint8)}
        items.update(self.arrays())
        try:
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name, arr in items.items():
                    info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                    with zf.open(info, "w", force_zip64=True) as fh:
                        np.lib.format.write_array(fh, np.ascontiguousarray(arr), allow_pickle=False)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return path


def worst_fraction(perplexities: Sequence[float] | np.ndarray, fraction: float) -> np.ndarray:
    """bool mask of the ``floor(fraction * n + 1/2)`` documents with the highest perplexity (the
    seed's "drop the worst 20%": ``fraction=0.2``). Among equal scores the later document goes
    first, so the choice depends only on the scores in input order."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction = {fraction}: must be in [0, 1)")
    scores = np.asarray(perplexities, dtype=np.float64)
    if np.isnan(scores).any():
        raise ValueError("perplexities hold NaN")
    n = scores.size
    k = int(np.floor(fraction * n + 0.5))
    drop = np.zeros(n, dtype=bool)
    if k:
        order = np.lexsort((np.arange(n), scores))  # by score, then by position
        drop[order[n - k :]] = True
    return drop


# -- header, identity, loading -------------------------------------------------------------------
def level_arrays(levels: Sequence[Level]) -> dict[str, np.ndarray]:
    """The arrays of a model by file name: ``keys<k>``, ``logp<k>`` for every order k and
    ``bow<k>``, ``ctx<k>`` below the highest."""
    out: dict[str, np.ndarray] = {}
    for k, lv in enumerate(levels, start=1):
        out[f"keys{k}"] = lv.keys
        out[f"logp{k}"] = lv.log_prob
        if lv.log_backoff is not None:
            out[f"bow{k}"] = lv.log_backoff
            out[f"ctx{k}"] = lv.is_context
    return out


def arrays_sha256(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over every array (sorted by name): name, dtype, shape, then its bytes."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(a.data)
    return h.hexdigest()


def model_sha256(order: int, unk_log_prob: float, arrays_digest: str) -> str:
    """The model's identity: sha256 of what decides its scores."""
    ident = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "units_version": UNITS_VERSION,
        "order": order,
        "unk_log_prob": unk_log_prob,
        "arrays_sha256": arrays_digest,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def model_header(levels: Sequence[Level], unk_log_prob: float, **info: Any) -> dict[str, Any]:
    """The header of a model file: format, units, order, ``unk_log_prob``, n-grams per order, the
    arrays' and the model's sha256, plus ``info`` (smoothing parameters, training facts)."""
    digest = arrays_sha256(level_arrays(levels))
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "units": {"module": "h5corpus.filters.lmunits", "version": UNITS_VERSION},
        "order": len(levels),
        "unk_log_prob": float(unk_log_prob),
        "log_base": "e",
        "ngrams": [int(lv.keys.size) for lv in levels],
        **info,
        "arrays_sha256": digest,
        "sha256": model_sha256(len(levels), float(unk_log_prob), digest),
    }


def read_model_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a model file, checked for format and version (arrays not read)."""
    with _open_model_file(path) as archive:
        return _header(archive)


def load_model(path: str | os.PathLike[str]) -> NgramModel:
    """Read a model file, checking its members (names, sizes, dtypes, shapes) before reading
    them, then the values (sorted keys, no NaN or infinite values except ``<s>``'s) and their
    sha256. Memory is proportional to the file's size (its arrays plus a lookup directory of 2-4
    slots per key). Raises :class:`ModelFileError` naming the file and the array."""
    with _open_model_file(path) as archive:
        header = _header(archive)
        order = header["order"]
        expected = {f"{p}{k}" for k in range(1, order + 1) for p in ("keys", "logp")}
        expected |= {f"{p}{k}" for k in range(1, order) for p in ("bow", "ctx")}
        if set(archive.arrays) != expected:
            raise ModelFileError(f"{path}: arrays {sorted(archive.arrays)} do not match an order-{order} model")
        arrays = {name: archive.read(name, _DTYPES[name.rstrip("0123456789")]) for name in sorted(expected)}
    if arrays_sha256(arrays) != header.get("arrays_sha256"):
        raise ModelFileError(f"{path}: the arrays do not match their sha256 (corrupt or modified file)")
    levels = [_level(path, arrays, k) for k in range(1, order + 1)]
    if header.get("ngrams") != [int(lv.keys.size) for lv in levels]:
        raise ModelFileError(f"{path}: header field 'ngrams' does not match the arrays' lengths")
    if model_sha256(order, float(header["unk_log_prob"]), header["arrays_sha256"]) != header.get("sha256"):
        raise ModelFileError(f"{path}: header sha256 does not match its content")
    return NgramModel(levels, header["unk_log_prob"], header)


#: dtype of every array of a model file by name prefix (little-endian, as :meth:`NgramModel.save`
#: writes them); any other dtype, byte order or layout is refused.
_DTYPES = {
    "header": np.dtype(np.uint8),
    "keys": np.dtype("<u8"),
    "logp": np.dtype("<f4"),
    "bow": np.dtype("<f4"),
    "ctx": np.dtype(np.bool_),
}
_MEMBER = re.compile(r"(header|(keys|logp|bow|ctx)[1-9])\.npy")
MAX_HEADER_BYTES = 1 << 24
"""Largest model header accepted, in bytes of JSON (real headers are a few KB)."""
_NPY_MAGIC = b"\x93NUMPY"


def _level(path: str | os.PathLike[str], arrays: dict[str, np.ndarray], k: int) -> Level:
    """Order ``k`` of a model from its checked arrays; refuses unsorted keys and values no model
    holds: a NaN or positive ``ln p``, ``-inf`` except at ``<s>`` (order 1), a non-finite backoff."""
    keys, logp = arrays[f"keys{k}"], arrays[f"logp{k}"]
    bow, ctx = arrays.get(f"bow{k}"), arrays.get(f"ctx{k}")
    same = keys.shape == logp.shape and (bow is None or bow.shape == ctx.shape == keys.shape)  # type: ignore[union-attr]
    if not same or keys.size == 0 or (keys.size > 1 and not bool(np.all(keys[1:] > keys[:-1]))):
        raise ModelFileError(f"{path}: order-{k} arrays malformed (lengths differ, empty, or keys not sorted)")
    minus_inf = logp == -np.inf
    if k == 1:
        minus_inf &= keys != key_of(np.array([BOS_HASH], dtype=np.uint64))[0]
    if bool(np.any(minus_inf | ~(logp <= 0.0))):  # NaN fails every comparison
        raise ModelFileError(f"{path}: array logp{k} holds a NaN, positive or infinite log-probability")
    if bow is not None and not bool(np.all(np.isfinite(bow))):
        raise ModelFileError(f"{path}: array bow{k} holds a NaN or infinite log backoff weight")
    return Level(keys, logp, bow, ctx)


class _ModelArchive:
    """The members of a model file (a zip of ``.npy`` arrays, stored uncompressed), checked from
    the zip directory before any is read: expected names, no compression, each member and all
    together within the file's size. A member is read only after its ``.npy`` header's dtype,
    layout and shape agree with the member's size, so what is read is at most the file's size."""

    def __init__(self, path: str | os.PathLike[str], zf: zipfile.ZipFile, file_bytes: int) -> None:
        self.path, self.zf = path, zf
        self.members: dict[str, zipfile.ZipInfo] = {}
        for info in zf.infolist():
            m = _MEMBER.fullmatch(info.filename)
            what = f"{path}: member {info.filename!r}"
            if m is None or m.group(1) in self.members:
                raise ModelFileError(f"{what} is unexpected or repeated (not an h5corpus n-gram model)")
            if info.compress_type != zipfile.ZIP_STORED:
                raise ModelFileError(f"{what} is compressed; model files hold their arrays uncompressed")
            if info.file_size != info.compress_size or info.header_offset + info.compress_size > file_bytes:
                raise ModelFileError(f"{what} declares {info.file_size:,} bytes, more than the file holds")
            self.members[m.group(1)] = info
        if sum(i.file_size for i in self.members.values()) > file_bytes:
            raise ModelFileError(f"{path}: members declare more bytes than the file holds ({file_bytes:,})")
        self.arrays = sorted(set(self.members) - {"header"})

    def __enter__(self) -> _ModelArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.zf.close()

    def read(self, name: str, dtype: np.dtype, max_bytes: int | None = None) -> np.ndarray:
        """The 1-D array ``name``, after checking its ``.npy`` header: ``dtype`` exactly, C order,
        and ``length * itemsize`` equal to the member's remaining bytes (at most ``max_bytes``)."""
        where = f"{self.path}: array {name}"
        try:
            with self.zf.open(self.members[name]) as fh:
                version = np.lib.format.read_magic(fh)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, fortran, got = read_header(fh)
                data_bytes = self.members[name].file_size - fh.tell()
                if got != dtype or fortran or len(shape) != 1:
                    raise ModelFileError(f"{where}: {got} {shape} (fortran order {fortran}); expected 1-D {dtype}")
                if shape[0] * dtype.itemsize != data_bytes or (max_bytes is not None and data_bytes > max_bytes):
                    raise ModelFileError(
                        f"{where}: shape {shape} needs {shape[0] * dtype.itemsize:,} bytes; the member holds {data_bytes:,}"
                    )
                out = np.empty(shape[0], dtype=dtype)
                got_bytes = fh.readinto(memoryview(out).cast("B")) if out.size else 0
                if got_bytes != data_bytes or fh.read(1):  # the read past the end checks the CRC
                    raise ModelFileError(f"{where}: truncated member")
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            if isinstance(e, ModelFileError):
                raise
            raise ModelFileError(f"{where}: unreadable ({type(e).__name__}: {e})") from None
        return out


def _open_model_file(path: str | os.PathLike[str]) -> _ModelArchive:
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{path}: model file not found")
    if not p.is_file():  # a device, a FIFO, a folder: nothing to read a size from
        raise ModelFileError(f"{path}: not a regular file (a model file is a .npz)")
    try:
        with open(p, "rb") as fh:
            if fh.read(len(_NPY_MAGIC)) == _NPY_MAGIC:
                raise ModelFileError(f"{path}: not an h5corpus n-gram model (a bare .npy array)")
        zf = zipfile.ZipFile(p)
        return _ModelArchive(path, zf, p.stat().st_size)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(f"{path}: not an h5corpus n-gram model ({type(e).__name__}: {e})") from None


def _header(archive: _ModelArchive) -> dict[str, Any]:
    path = archive.path
    if "header" not in archive.members:
        raise ModelFileError(f"{path}: not an h5corpus n-gram model (no header)")
    raw = archive.read("header", _DTYPES["header"], max_bytes=MAX_HEADER_BYTES)
    try:
        header = json.loads(raw.tobytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ModelFileError(f"{path}: unreadable model header ({type(e).__name__})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ModelFileError(f"{path}: not an h5corpus n-gram model (header format is not {FORMAT!r})")
    if header.get("format_version") != FORMAT_VERSION:
        raise ModelFileError(
            f"{path}: model format version {header.get('format_version')!r}; this h5corpus reads {FORMAT_VERSION}"
        )
    units = header.get("units")
    if not isinstance(units, dict) or units.get("version") != UNITS_VERSION:
        raise ModelFileError(f"{path}: model units {units!r}; this h5corpus segments units version {UNITS_VERSION}")
    order, unk = header.get("order"), header.get("unk_log_prob")
    if type(order) is not int or not 1 <= order <= MAX_ORDER:
        raise ModelFileError(f"{path}: header field 'order' = {order!r}: must be an integer 1..{MAX_ORDER}")
    if type(unk) is not float or not -np.inf < unk <= 0.0:
        raise ModelFileError(f"{path}: header field 'unk_log_prob' = {unk!r}: must be a finite float <= 0")
    return header
