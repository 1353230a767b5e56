"""Language identification: py3langid's model (ships inside the package, no download) with a
numpy-vectorized feature extractor.

py3langid scores a document with a naive-Bayes model over byte n-gram features found by an
Aho-Corasick automaton; its reference implementation walks that automaton one byte at a time in a
Python loop (~5 MB/s). The automaton's state after byte ``j`` is the longest suffix of the bytes
read so far that is a node of the pattern trie, and the trie is at most ``depth`` (6) bytes deep,
so the state after byte ``j`` depends only on bytes ``j-depth+1 .. j``. :func:`feature_ids`
therefore replays, for every position at once, the last ``depth`` bytes from the root state:
``depth - 1`` vectorized table lookups instead of one Python iteration per byte (the first two
bytes from the root through a 64K-entry table; states are stored as their transition row, 16 bits,
and the last step reads the emitted feature directly). The feature counts are identical to
py3langid's and so are the normalized probabilities (tests/test_filters.py compares both on the dev
corpus).

Only the first ``max_chars`` characters of a document are classified (a standard trade-off: the
cost is bounded per document and a few hundred characters identify a language reliably).

The model is loaded lazily, once per process, on first use; a :class:`LanguageDetector` pickles as
its settings only.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import numpy as np

_MODEL: _Model | None = None


@dataclass(frozen=True)
class _Model:
    # The automaton, by transition row (states with identical transitions share a row; 38K rows
    # for 105K states): the row of the state reached from row r by byte b, the feature emitted
    # on entering that state (-1 for none), and the row after two bytes from the root.
    next_row: np.ndarray  # uint16 (rows*256,): next_row[r * 256 + b]
    out_next: np.ndarray  # int32 (rows*256,): out_next[r * 256 + b]
    root2: np.ndarray  # int32 (65536,): row after bytes b0, b1 from the root: root2[b0 * 256 + b1]
    depth: int  # deepest trie node, in bytes
    ptc: np.ndarray  # float32 (features, classes): log P(feature | class) (stored as float16)
    pc: np.ndarray  # float32 (classes,): log prior
    classes: list[str]  # ISO 639 code per column (a code may appear twice: script aliases)
    alias_pairs: list[tuple[int, int]]  # (first column, duplicate column) per repeated code
    version: str


def _load_model() -> _Model:
    global _MODEL
    if _MODEL is not None:
        return _MODEL
    try:
        import py3langid.langid as pl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("language identification needs py3langid: pip install 'h5corpus[filters]'") from e
    ident = pl.LanguageIdentifier.from_model_file(pl.MODEL_FILE, norm_probs=True)
    nextmove = np.frombuffer(ident.tk_nextmove, dtype=np.dtype(ident.tk_nextmove.typecode)).astype(np.int32)
    rowbase = (np.asarray(ident.tk_row, dtype=np.int64) << 8).astype(np.int32)
    out = np.asarray(ident.tk_output, dtype=np.int32)
    # Breadth-first depth of every state from the root (= length of its trie string).
    depth = np.full(len(rowbase), -1, dtype=np.int64)
    depth[0] = 0
    frontier = np.zeros(1, dtype=np.int64)
    d = 0
    while frontier.size:
        d += 1
        nxt = np.unique(nextmove[(rowbase[frontier][:, None] + np.arange(256)[None, :]).ravel()])
        nxt = nxt[depth[nxt] < 0]
        depth[nxt] = d
        frontier = nxt
    if not (nextmove[rowbase + _SEP[0]] == 0).all() or out[0] >= 0:  # pragma: no cover
        raise RuntimeError("py3langid model: byte 0xFF does not reset the automaton; cannot batch")
    rows = rowbase >> 8  # transition row of each state
    if int(rows.max()) >= 1 << 16:  # pragma: no cover - a different model
        raise RuntimeError("py3langid model: more than 65536 transition rows; cannot batch")
    next_row = rows[nextmove].astype(np.uint16)
    out_next = out[nextmove]
    after1 = next_row[rowbase[0] + np.arange(256)].astype(np.int32)
    root2 = next_row[((after1[:, None] << 8) + np.arange(256)[None, :]).ravel()].astype(np.int32)
    classes = list(ident.nb_classes)
    first: dict[str, int] = {}
    pairs = []
    for i, c in enumerate(classes):
        if c in first:
            pairs.append((first[c], i))
        else:
            first[c] = i
    _MODEL = _Model(
        next_row=next_row,
        out_next=out_next,
        root2=root2,
        depth=int(depth.max()),
        # float16 on disk; numpy would promote each gathered block to float32 anyway (and BLAS
        # needs float32), so convert once: same numbers, ~10x faster scoring.
        ptc=np.asarray(ident.nb_ptc, dtype=np.float32),
        pc=np.asarray(ident.nb_pc, dtype=np.float32),
        classes=classes,
        alias_pairs=pairs,
        version=f"py3langid-{version('py3langid')}",
    )
    return _MODEL


def model_version() -> str:
    """``py3langid-<version>``: the model that decides; recorded in the manifest's filter config."""
    return _load_model().version


def encode_for_langid(text: str) -> bytes:
    """The bytes py3langid classifies: all-uppercase text lowercased, NFC, UTF-8."""
    if text.isupper():
        text = text.lower()
    return unicodedata.normalize("NFC", text).encode("utf-8", errors="surrogatepass")


#: Separator between texts classified together: no feature contains byte 0xFF (never valid
#: UTF-8), so from every state it leads back to the root (checked when the model loads).
_SEP = b"\xff"


def feature_ids(data: bytes, keep_positions: bool = False) -> np.ndarray:
    """Feature index emitted at each byte of ``data``: the same multiset py3langid's
    ``visit_counts`` DFA walk produces. Features only, in byte order; with ``keep_positions``
    one entry per byte, -1 where none."""
    m = _load_model()
    n = len(data)
    d = m.depth
    # Position j replays bytes j-d+1 .. j from the root. d-1 bytes of 0xFF in front (0xFF sends
    # every state to the root) make the first positions replay from the root too.
    b = np.frombuffer(_SEP * (d - 1) + data, dtype=np.uint8).astype(np.int32)
    r = np.take(m.root2, (b[:n] << 8) | b[1 : n + 1], mode="clip")
    for k in range(2, d - 1):
        r <<= 8
        r |= b[k : n + k]
        r = np.take(m.next_row, r, mode="clip").astype(np.int32)
    r <<= 8
    r |= b[d - 1 : n + d - 1]
    f = np.take(m.out_next, r, mode="clip")  # indices are in range by construction
    return f if keep_positions else f[f >= 0]


def language_scores(text: str, max_chars: int = 500) -> np.ndarray:
    """Normalized probability per model column (sums to 1; float32) for the first ``max_chars``
    characters of ``text``, exactly as py3langid's ``LanguageIdentifier(norm_probs=True)``."""
    m = _load_model()
    data = encode_for_langid(text[:max_chars] if max_chars > 0 else text)
    f = feature_ids(data)
    if f.size == 0:
        scores = np.zeros(len(m.classes), dtype=np.float32)
    else:
        idx, counts = np.unique(f, return_counts=True)
        scores = np.log1p(counts.astype(np.float32)) @ m.ptc[idx] + m.pc
    scores = scores.astype(np.float32, copy=False)
    scores *= 1.0 / math.sqrt(len(data) or 1)
    np.exp(scores - scores.max(), out=scores)
    scores /= scores.sum()
    for i, j in m.alias_pairs:
        scores[i] += scores[j]
        scores[j] = 0.0
    return scores


def detect_language(text: str, max_chars: int = 500) -> tuple[str, float]:
    """``(ISO 639-1 code, probability in [0, 1])`` of the most likely language of the first
    ``max_chars`` characters. Text without any model feature (e.g. empty) gives ``("und", 0.0)``."""
    m = _load_model()
    if not text.strip():
        return "und", 0.0
    scores = language_scores(text, max_chars)
    i = int(scores.argmax())
    return m.classes[i], float(scores[i])


def detect_languages(texts: Sequence[str], max_chars: int = 500) -> list[tuple[str, float]]:
    """:func:`detect_language` of many texts at once: one vectorized automaton pass over all of
    them (joined by a byte no feature contains, which sends the automaton back to its root), one
    sort of (text, feature) keys for the per-text feature counts, and one sparse x dense product
    (scipy CSR) for the naive-Bayes scores of every text. Each text's score row is a sum over its
    own features only, so results do not depend on the batch. Same results as py3langid up to
    float32 rounding of the sums (~1e-5)."""
    m = _load_model()
    out: list[tuple[str, float]] = [("und", 0.0)] * len(texts)
    keep = [i for i, t in enumerate(texts) if t.strip()]
    if not keep:
        return out
    data = [encode_for_langid(texts[i][:max_chars] if max_chars > 0 else texts[i]) for i in keep]
    nd = len(data)
    f = feature_ids(_SEP.join(data), keep_positions=True)
    bounds = np.zeros(nd + 1, dtype=np.int64)
    np.cumsum([len(d) + 1 for d in data], out=bounds[1:])
    pos = np.flatnonzero(f >= 0)
    n_feat = m.ptc.shape[0]
    # key = text * n_feat + feature, sorted: runs of equal keys are one feature's count in a text
    kdt = np.int32 if nd * n_feat < 2**31 else np.int64
    per_text = np.diff(np.searchsorted(pos, bounds))  # features are in text order
    key = np.repeat(np.arange(nd, dtype=kdt) * kdt(n_feat), per_text)
    key += f[pos]
    key.sort()
    indptr = np.zeros(nd + 1, dtype=np.int64)
    if key.size:
        new = np.empty(key.size, dtype=bool)
        new[0] = True
        np.not_equal(key[1:], key[:-1], out=new[1:])
        first = np.flatnonzero(new)
        counts = np.diff(first, append=key.size).astype(np.float32)
        ukey = key[first]
        udoc = ukey // kdt(n_feat)
        feat = (ukey - udoc * kdt(n_feat)).astype(np.int32)
        np.cumsum(np.bincount(udoc, minlength=nd), out=indptr[1:])
    else:
        counts = np.zeros(0, dtype=np.float32)
        feat = np.zeros(0, dtype=np.int32)
    try:
        from scipy.sparse import csr_matrix
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("language identification needs scipy: pip install 'h5corpus[filters]'") from e

    scores = np.asarray(csr_matrix((np.log1p(counts), feat, indptr), shape=(nd, n_feat)) @ m.ptc, dtype=np.float32)
    scores[np.diff(indptr) > 0] += m.pc  # a text without any feature keeps all-zero scores, as before
    lens = np.fromiter((len(d) for d in data), dtype=np.float32, count=nd)
    scores *= (1.0 / np.sqrt(np.maximum(lens, 1.0)))[:, None]
    scores -= scores.max(axis=1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=1, keepdims=True)
    for i, j in m.alias_pairs:
        scores[:, i] += scores[:, j]
        scores[:, j] = 0.0
    best = scores.argmax(axis=1)
    probs = scores[np.arange(nd), best]
    for i, c, p in zip(keep, best.tolist(), probs.tolist()):
        out[i] = (m.classes[c], float(p))
    return out


def known_languages() -> list[str]:
    """Codes the model can output (sorted)."""
    return sorted(set(_load_model().classes))


def check_languages(codes: Any) -> tuple[str, ...]:
    """Validate language codes against the model; raise ValueError naming the unknown ones."""
    known = set(_load_model().classes)
    codes = tuple(str(c).strip().lower() for c in codes)
    unknown = [c for c in codes if c not in known]
    if unknown:
        raise ValueError(
            f"unknown language code(s) {unknown}: py3langid knows {len(known)} ISO 639-1 codes, "
            f"e.g. en, de, fr, es, zh, ja, ko, ru"
        )
    return codes
