"""The units an n-gram language model (:mod:`h5corpus.filters.perplexity`) counts and scores:
text -> stable 64-bit unit hashes, vectorized over a batch of texts (no per-unit Python).

A *unit* (definition ``UNITS_VERSION``; a model file records it and is refused by code with
another) is, after the UTF-8 encoding (Unicode spaces -> ASCII space, as in
:mod:`h5corpus.filters.words`):

- a maximal run of *word characters*: ASCII letters and digits and the non-ASCII characters,
  except that these are units by themselves: each character in U+3000-U+9FFF and U+F000-U+FFFF
  (kana, CJK ideographs, full-width forms; as :mod:`h5corpus.filters.words` splits them), the
  Latin-1 symbols U+00A1-U+00BF (``«`` ``°`` ``§`` ...) and U+2000-U+2BFF (dashes, quotes, bullets,
  ``…``, arrows, math, box drawing);
- one ASCII punctuation, symbol or control character (``,`` ``(`` ``$`` ...): split off the words
  they are glued to, so ``Shaw,`` ``(Shaw`` and ``Shaw.`` are all ``Shaw`` plus a punctuation unit;
- a line break: a run of ``\\n`` (with only spaces, tabs or ``\\r`` between them) is one unit,
  :data:`NEWLINE`; line breaks at the start or end of a text are not units.

Spaces, tabs, ``\\r``, ``\\v``, ``\\f`` and the Unicode spaces separate units and are not units.
Units are hashed folded: ASCII letters to lowercase and every ASCII digit to ``0`` (so ``1990`` and
``2015`` are one unit type, as CCNet normalizes digits for its KenLM models); other characters as
written. A unit's hash is a fixed function of its folded bytes (its first 64 bytes as 8-byte
words in a polynomial, its length, MurmurHash3's finalizer: :func:`_unit_hashes`): the same in
every process and on every platform, never Python's salted ``hash``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .words import HASH_PRIME, mix64, space_folded_utf8

UNITS_VERSION = 1
"""Version of the unit definition above (segmentation, folding, hashing)."""

# Byte classes of the segmentation.
_WORD, _PUNCT, _NL, _SPACE, _OWN, _CONT = 1, 2, 3, 4, 5, 6
_CLASS = np.zeros(256, dtype=np.uint8)
for _b in range(128):
    _c = chr(_b)
    if _c == "\n":
        _CLASS[_b] = _NL
    elif _c.isspace():
        _CLASS[_b] = _SPACE
    elif _c.isalnum():
        _CLASS[_b] = _WORD
    else:
        _CLASS[_b] = _PUNCT
_CLASS[0x80:0xC0] = _CONT
_CLASS[0xC0:0x100] = _WORD
_CLASS[0xE3:0xEA] = _OWN  # lead bytes of U+3000-U+9FFF
_CLASS[0xEF] = _OWN  # U+F000-U+FFFF
_CLASS_TABLE = _CLASS.tobytes()
#: Folded byte + 1 (never 0 for a unit byte): A-Z -> a-z, 0-9 -> 0.
_VALUE = np.arange(1, 257, dtype=np.uint64)
_VALUE[ord("A") : ord("Z") + 1] += np.uint64(32)
_VALUE[ord("0") : ord("9") + 1] = ord("0") + 1
_VALUE[_CLASS == _SPACE] = 0  # separators inside a unit's byte range (trailing) add nothing
_VALUE_TABLE = bytes(int(v) & 0xFF for v in _VALUE)  # (0xFF never occurs in UTF-8)

_MAX_HASHED = 64  # bytes of a unit that its hash reads
_P64 = np.uint64(HASH_PRIME)
_LENGTH_MIX = np.uint64(0x9E3779B97F4A7C15)
_MASKS = np.array([(1 << (8 * i)) - 1 for i in range(8)] + [(1 << 64) - 1], dtype=np.uint64)

#: Hashes of the special units (constants; a real unit hashing to one is a 2**-64 event).
#: ``<s>`` only stands before a text's first unit (context only); ``</s>`` is predicted after its last.
BOS_HASH = np.uint64(0x9E3779B97F4A7C15)
EOS_HASH = np.uint64(0xC2B2AE3D27D4EB4F)
NEWLINE_HASH = np.uint64(0x165667B19E3779F9)
BOS, EOS, NEWLINE = "<s>", "</s>", "\n"
"""The special units as strings (for :func:`unit_hashes` and model queries)."""


@dataclass(frozen=True)
class UnitBatch:
    """The units of several texts: hashes concatenated, text ``i`` owning
    ``hashes[offsets[i]:offsets[i + 1]]``."""

    hashes: np.ndarray
    """uint64 unit hashes, in text order."""
    offsets: np.ndarray
    """int64 (texts + 1,): first unit of each text; the last entry is the total."""

    def counts(self) -> np.ndarray:
        """int64 units per text."""
        return np.diff(self.offsets)


def units_batch(texts: Sequence[str]) -> UnitBatch:
    """The unit hashes of every text (module docstring), in one vectorized pass."""
    enc = [space_folded_utf8(t)[0] for t in texts]
    data = b"\n".join(enc)  # a line break between texts: the end of the text before (dropped)
    text_start = np.zeros(len(texts) + 1, dtype=np.int64)  # byte offset of each text in ``data``
    np.cumsum([len(e) + 1 for e in enc], out=text_start[1:])
    starts, ends, is_nl = _segment(data)
    hashes = _unit_hashes(data.translate(_VALUE_TABLE), starts, ends)
    hashes[is_nl] = NEWLINE_HASH
    offsets = np.searchsorted(starts, text_start)
    # A run of line breaks with spaces between is one unit: drop those after another ...
    kept = ~is_nl.copy()
    kept[1:] |= ~is_nl[:-1]
    hashes, is_nl, offsets = hashes[kept], is_nl[kept], _kept_offsets(kept, offsets)
    # ... and line breaks are not units at the start or end of a text
    edge = np.zeros(is_nl.size, dtype=bool)
    nonempty = offsets[1:] > offsets[:-1]
    edge[offsets[:-1][nonempty]] = True
    edge[offsets[1:][nonempty] - 1] = True
    kept = ~(is_nl & edge)
    return UnitBatch(hashes[kept], _kept_offsets(kept, offsets))


def _segment(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, is a line break) of every unit of ``data``, in bytes (end excludes the
    spaces after the unit)."""
    cls = np.frombuffer(data.translate(_CLASS_TABLE), dtype=np.uint8)
    ascii_only = data.isascii()
    if not ascii_only:
        cls = _mark_own_symbols(np.frombuffer(data, dtype=np.uint8), cls)
    n = cls.size
    prev = np.empty(n, dtype=np.uint8)
    prev[:1] = _NL
    prev[1:] = cls[:-1]
    start = (cls == _PUNCT) | (cls == _OWN)
    start |= (cls == _NL) & (prev != _NL)
    start |= (cls == _WORD) & (prev != _WORD) & (prev != _CONT)
    if not ascii_only:  # a word byte right after a character that is a unit by itself
        raw = np.frombuffer(data, dtype=np.uint8)
        lead = np.flatnonzero(cls == _OWN)
        after = lead + np.where(raw[lead] < 0xE0, 2, 3)
        after = after[after < n]
        start[after] |= cls[after] == _WORD
    bound = start | ((cls == _SPACE) & (prev != _SPACE))  # unit starts and the first space after a unit
    bounds = np.append(np.flatnonzero(bound), n)
    at = np.flatnonzero(start[bounds[:-1]])
    starts = bounds[at]
    return starts, bounds[at + 1], cls[starts] == _NL


def _kept_offsets(kept: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Offsets of each text's units after dropping the units where ``kept`` is False."""
    before = np.zeros(kept.size + 1, dtype=np.int64)
    np.cumsum(kept, out=before[1:])
    return before[offsets]


def _mark_own_symbols(raw: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """``cls`` with the lead bytes of U+00A1-U+00BF (C2 A1-BF: Latin-1 symbols) and U+2000-U+2BFF
    (E2 80-AF: dashes, quotes, bullets, arrows, math, box drawing, ...) marked as units by themselves."""
    cls = cls.copy()
    sym = np.flatnonzero((raw[:-1] == 0xC2) | (raw[:-1] == 0xE2))
    second = raw[sym + 1]
    cls[sym[np.where(raw[sym] == 0xC2, second >= 0xA1, second <= 0xAF)]] = _OWN
    return cls


def _unit_hashes(values: bytes, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The hash of every unit [s, e) of the folded byte values: its first 64 bytes read as
    little-endian 8-byte words ``w_0 .. w_{m-1}`` (the last one zero-padded), combined as
    ``(...(w_0 * P + w_1) * P + ...) + w_{m-1}``, xor ``length * LENGTH_MIX``, through MurmurHash3's
    finalizer. (Units longer than 64 bytes are junk to a language model: only their prefix and
    length tell them apart.)"""
    buf = np.frombuffer(values + bytes(8), dtype=np.uint8)
    words = np.ndarray((len(values) + 1,), dtype="<u8", buffer=buf, strides=(1,))  # 8 bytes from each offset
    length = ends - starts
    h = words[starts]
    h &= _MASKS[np.minimum(length, 8)]
    live = np.flatnonzero(length > 8)  # longer units: the next words, while they last
    at, left = starts[live], length[live]
    with np.errstate(over="ignore"):
        for j in range(8, _MAX_HASHED, 8):
            more = left > j
            if not more.all():
                live, at, left = live[more], at[more], left[more]
            if live.size == 0:
                break
            w = words[at + j]
            w &= _MASKS[np.minimum(left - j, 8)]
            h[live] = h[live] * _P64 + w
        h ^= length.astype(np.uint64) * _LENGTH_MIX
    return mix64(h)


def unit_hashes(units: Sequence[str]) -> np.ndarray:
    """uint64 hash of each unit given as a string (``"Shaw"``, ``","``, :data:`NEWLINE`,
    :data:`BOS`, :data:`EOS`): what :func:`units_batch` gives for that unit inside a text. A string
    that is not one unit (``"a b"``, ``"ab,"``) raises ValueError."""
    out = np.empty(len(units), dtype=np.uint64)
    for i, u in enumerate(units):
        if u == BOS:
            out[i] = BOS_HASH
        elif u == EOS:
            out[i] = EOS_HASH
        elif u == NEWLINE:
            out[i] = NEWLINE_HASH
        else:
            ub = units_batch([u])
            if ub.hashes.size != 1:
                raise ValueError(f"{u!r} is {ub.hashes.size} units, not one")
            out[i] = ub.hashes[0]
    return out
