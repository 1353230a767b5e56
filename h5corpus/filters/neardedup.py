"""Near-duplicate detection: MinHash signatures over word shingles + banded LSH.

Two halves, matching how a parallel build uses them:

- :class:`MinHasher` (parallel phase, any process): ``signature(text)`` -> ``uint32[num_perm]``.
  Shingles are runs of ``shingle_size`` consecutive words (:mod:`h5corpus.words`: whitespace
  words, CJK characters one word each, ASCII case folded), hashed to 64 bits with fixed constants;
  the MinHash is rensa's ``RMinHash`` (Rust) seeded with ``seed``. A text with fewer words than
  ``shingle_size`` has one shingle (all its words); a text without words has the *empty*
  signature (every value ``0xFFFFFFFF``). Signatures depend only on the text and the parameters:
  identical across processes, runs and worker counts.
- :class:`NearDedupIndex` (sequential phase, one process, documents in global input order):
  ``add(signature)`` returns True when the document is a near duplicate of a document added
  (and kept) earlier, else indexes it and returns False. So the first document of each cluster in
  input order survives, and the outcome does not depend on how signatures were computed.

A candidate (a document sharing at least one LSH band with the new one) counts as a duplicate
when the two signatures agree in at least ``threshold`` of their ``num_perm`` positions (the
MinHash estimate of their Jaccard similarity; standard error ~ sqrt(J(1-J)/num_perm), 0.035 at
J = 0.8 with 128 permutations), unless ``verify=False``, where any band collision counts. Bands
and rows default to datasketch's choice for the threshold (:func:`optimal_bands`: 9 x 13 for 0.8
and 128 permutations).

Memory of the index: about ``num_perm * 4`` bytes (the signature, for verification) plus
``bands * (4 * rows + ~90)`` bytes (band keys in Python dicts) per kept document, ~1.9 KB with the
defaults (~1.9 GB per million kept documents).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import lru_cache
from importlib.metadata import version
from itertools import chain

import numpy as np

from .words import ngram_hashes, ngram_hashes_batch, split_words

EMPTY_VALUE = np.uint32(0xFFFFFFFF)

_U32 = next(c for c in "IL" if array(c).itemsize == 4)  # array typecode of uint32

RENSA_ROWS = 31
"""Rows per rensa call: below the smallest ``RENSA_DOC_PAR_BATCH_SIZE`` (32) from which rensa uses
its thread pool (see :meth:`MinHasher.signatures_of_flat_shingles`)."""


def _rensa():
    try:
        import rensa
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("near-dedup needs rensa (MinHash in Rust): pip install 'h5corpus[filters]'") from e
    return rensa


def backend_version() -> str:
    """``rensa-<version> RMinHash``: the MinHash implementation (recorded in the manifest)."""
    _rensa()
    return f"rensa-{version('rensa')} RMinHash"


def shingle_hashes(text: str, shingle_size: int) -> np.ndarray:
    """uint64 hash of every run of ``shingle_size`` consecutive words of ``text`` (one hash of
    all words when there are fewer; empty for a text without words)."""
    return shingles_from_word_hashes(split_words(text).hashes, shingle_size)


def shingles_from_word_hashes(hashes: np.ndarray, shingle_size: int) -> np.ndarray:
    if hashes.size == 0:
        return np.zeros(0, dtype=np.uint64)
    k = min(shingle_size, int(hashes.size))
    return ngram_hashes(hashes, k, mix=True)


class MinHasher:
    """MinHash signatures of texts (see the module docstring). Cheap to construct; pickles as its
    parameters."""

    def __init__(self, *, num_perm: int = 128, shingle_size: int = 5, seed: int = 1) -> None:
        if num_perm < 1:
            raise ValueError(f"num_perm = {num_perm}: must be >= 1")
        if shingle_size < 1:
            raise ValueError(f"shingle_size = {shingle_size}: must be >= 1")
        self.num_perm = int(num_perm)
        self.shingle_size = int(shingle_size)
        self.seed = int(seed)

    def signature(self, text: str) -> np.ndarray:
        """uint32[num_perm] MinHash signature of ``text``'s word shingles."""
        return self.signature_of_shingles(shingle_hashes(text, self.shingle_size))

    def signature_of_word_hashes(self, word_hashes: np.ndarray) -> np.ndarray:
        """Same as :meth:`signature` from already computed word hashes (:func:`split_words`)."""
        return self.signature_of_shingles(shingles_from_word_hashes(word_hashes, self.shingle_size))

    def signatures_of_word_hashes(self, word_hashes: Sequence[np.ndarray]) -> np.ndarray:
        """uint32[len(word_hashes), num_perm]: :meth:`signature_of_word_hashes` of many texts
        (same values): the shingles of all texts in one vectorized pass
        (:func:`h5corpus.words.ngram_hashes_batch`), then rensa calls of :data:`RENSA_ROWS` rows."""
        k = len(word_hashes)
        lens = np.fromiter((h.size for h in word_hashes), dtype=np.int64, count=k)
        offsets = np.zeros(k + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        flat = np.concatenate(word_hashes) if k else np.zeros(0, dtype=np.uint64)
        shingles, sh_off = ngram_hashes_batch(flat, offsets, self.shingle_size)
        short = np.flatnonzero((lens > 0) & (lens < self.shingle_size))
        if short.size:  # fewer words than a shingle: one shingle of all the words
            pieces = []
            prev = 0
            for i in short.tolist():
                pieces.append(shingles[sh_off[prev] : sh_off[i]])
                pieces.append(shingles_from_word_hashes(word_hashes[i], self.shingle_size))
                prev = i + 1
            pieces.append(shingles[sh_off[prev] :])
            counts = np.diff(sh_off)
            counts[short] = 1
            sh_off = np.zeros(k + 1, dtype=np.int64)
            np.cumsum(counts, out=sh_off[1:])
            shingles = np.concatenate(pieces)
        return self.signatures_of_flat_shingles(shingles, sh_off)

    def signatures_of_flat_shingles(self, shingles: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """uint32[len(offsets) - 1, num_perm]: the signature of each text's shingles
        ``shingles[offsets[i]:offsets[i+1]]`` (the empty signature for none).

        rensa runs calls of at least ``RENSA_DOC_PAR_BATCH_SIZE`` rows (default 256, never less
        than 32) on a Rayon thread pool, and that pool does not survive ``fork``: a forked build
        worker whose parent process had used it hangs forever in its first large call. Calls of
        :data:`RENSA_ROWS` (31) rows never use the pool (whatever the environment says), give
        identical rows, and cost one call per 31 texts instead of one per text."""
        k = offsets.size - 1
        out = np.full((k, self.num_perm), EMPTY_VALUE, dtype=np.uint32)
        flat = np.ascontiguousarray(shingles, dtype=np.uint64)
        offsets = np.asarray(offsets, dtype=np.int64)
        digest = _rensa().RMinHash.digest_matrix_from_flat_token_hashes
        for a in range(0, k, RENSA_ROWS):
            b = min(a + RENSA_ROWS, k)
            lo, hi = int(offsets[a]), int(offsets[b])
            if hi == lo:
                continue
            m = digest(flat[lo:hi], (offsets[a : b + 1] - lo).astype(np.uint64), self.num_perm, self.seed)
            rows = array(_U32, chain.from_iterable(m.to_rows()))  # 2x faster than np.asarray(list of lists)
            out[a:b] = np.frombuffer(rows, dtype=np.uint32).reshape(b - a, self.num_perm)
        empty = offsets[1:] == offsets[:-1]
        if empty.any():
            out[empty] = EMPTY_VALUE
        return out

    def signature_of_shingles(self, shingles: np.ndarray) -> np.ndarray:
        if shingles.size == 0:
            return np.full(self.num_perm, EMPTY_VALUE, dtype=np.uint32)
        offsets = np.array([0, shingles.size], dtype=np.uint64)
        m = _rensa().RMinHash.digest_matrix_from_flat_token_hashes(
            np.ascontiguousarray(shingles, dtype=np.uint64), offsets, self.num_perm, self.seed
        )
        return np.asarray(m.to_rows()[0], dtype=np.uint32)


def is_empty_signature(sig: np.ndarray) -> bool:
    """True for the signature of a text without words (never a near duplicate of anything)."""
    return bool((sig == EMPTY_VALUE).all())


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of positions where two signatures agree: the MinHash estimate of the Jaccard
    similarity of the two shingle sets."""
    if a.shape != b.shape:
        raise ValueError(f"signatures of different lengths: {a.shape[0]} vs {b.shape[0]}")
    return float(np.count_nonzero(a == b)) / a.size


@lru_cache(maxsize=64)
def optimal_bands(threshold: float, num_perm: int, fp_weight: float = 0.5, fn_weight: float = 0.5) -> tuple[int, int]:
    """``(bands, rows)`` with ``bands * rows <= num_perm`` minimizing the weighted sum of the
    false-positive area (``P(candidate | J)`` integrated over ``[0, threshold]``) and the
    false-negative area (``1 - P`` over ``[threshold, 1]``), where ``P(candidate | J) =
    1 - (1 - J**rows)**bands``: the rule of datasketch's ``MinHashLSH`` (same results; numeric
    integration here instead of scipy's ``quad``)."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold = {threshold}: must be in (0, 1)")
    x_fp = np.linspace(0.0, threshold, 2001)
    x_fn = np.linspace(threshold, 1.0, 2001)
    best = (float("inf"), (1, 1))
    for b in range(1, num_perm + 1):
        r = np.arange(1, num_perm // b + 1, dtype=np.float64)[:, None]
        fp = np.trapezoid(1.0 - (1.0 - x_fp[None, :] ** r) ** b, x_fp, axis=1)
        fn = np.trapezoid((1.0 - x_fn[None, :] ** r) ** b, x_fn, axis=1)
        err = fp * fp_weight + fn * fn_weight
        i = int(np.argmin(err))
        if err[i] < best[0]:
            best = (float(err[i]), (b, i + 1))
    return best[1]


class NearDedupIndex:
    """Banded LSH index over MinHash signatures, fed in global input order (see module docstring).

    Not thread-safe and not meant to be pickled: the build runs it in one process."""

    def __init__(self, *, num_perm: int, bands: int, rows: int, threshold: float, verify: bool = True) -> None:
        if bands * rows > num_perm or bands < 1 or rows < 1:
            raise ValueError(f"bands x rows = {bands} x {rows} must be >= 1 x 1 and fit in num_perm = {num_perm}")
        self.num_perm = num_perm
        self.bands = bands
        self.rows = rows
        self.threshold = threshold
        self.verify = verify
        self._tables: list[dict[bytes, list[int]]] = [dict() for _ in range(bands)]
        self._band_slices = [slice(4 * rows * i, 4 * rows * (i + 1)) for i in range(bands)]
        self._empty = np.full(num_perm, EMPTY_VALUE, dtype=np.uint32).tobytes()
        self._sigs: list[np.ndarray] = []
        self.added = 0
        """Signatures offered to :meth:`add`."""
        self.duplicates = 0
        """How many of them were near duplicates."""

    def __len__(self) -> int:
        """Documents indexed (kept)."""
        return len(self._sigs)

    def _keys(self, sig: np.ndarray) -> list[bytes]:
        """One key per band: the raw bytes of its ``rows`` values (exact, so only true band
        matches become candidates)."""
        buf = sig.tobytes()
        return [buf[s] for s in self._band_slices]

    def add(self, signature: np.ndarray) -> bool:
        """True if ``signature`` is a near duplicate of an earlier kept document (then it is not
        indexed); else index it and return False. Empty signatures are never duplicates and are
        not indexed."""
        sig = signature
        if not (type(sig) is np.ndarray and sig.dtype == np.uint32 and sig.flags.c_contiguous):
            sig = np.ascontiguousarray(sig, dtype=np.uint32)
        if sig.shape != (self.num_perm,):
            raise ValueError(f"signature has shape {sig.shape}, expected ({self.num_perm},)")
        self.added += 1
        buf = sig.tobytes()
        if buf == self._empty:
            return False
        keys = [buf[s] for s in self._band_slices]
        cands: set[int] | None = None
        for table, k in zip(self._tables, keys):
            hit = table.get(k)
            if hit is not None:
                if cands is None:
                    cands = set(hit)
                else:
                    cands.update(hit)
        if cands:
            if not self.verify:
                self.duplicates += 1
                return True
            for c in sorted(cands):
                if estimated_jaccard(sig, self._sigs[c]) >= self.threshold:
                    self.duplicates += 1
                    return True
        idx = len(self._sigs)
        self._sigs.append(sig)
        for table, k in zip(self._tables, keys):
            hit = table.get(k)
            if hit is None:
                table[k] = [idx]
            else:
                hit.append(idx)
        return False
