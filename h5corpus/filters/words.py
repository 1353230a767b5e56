"""Word segmentation and stable word hashes on UTF-8 bytes, shared by the quality filter and
near-duplicate detection (numpy-vectorized; no per-word Python loop).

A *word* is a maximal run of non-whitespace characters, except that every character in
U+3000-U+9FFF (CJK symbols and punctuation, kana, Bopomofo, CJK ideographs) and U+F000-U+FFFF
(CJK compatibility ideographs, full-width forms) is a word of its own: Chinese and Japanese are
written without spaces, so counting whitespace runs would make a Japanese page look like a handful
of 1,000-character "words". Korean (Hangul, written with
spaces) and every other script split on whitespace. Whitespace is ASCII whitespace plus the Unicode
space separators (NBSP, U+2000-U+200A, U+3000, ...); offsets are in bytes of the UTF-8 encoding.

:func:`segment_batch` also gives the byte layout of the words in the batch's joined UTF-8
(:class:`Segmented`), from which the quality stage counts characters and lines.

Word hashes are 64-bit, case-insensitive for ASCII letters (A-Z fold to a-z; other scripts are
hashed as written), computed from the bytes with fixed constants: identical in every process, on
every platform and Python version (never Python's salted ``hash``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_UNICODE_SPACE = re.compile("[\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")

#: Per-byte class bits (:data:`CLS`): ASCII uppercase, lowercase, digit, punctuation/symbol/control,
#: first byte of a non-ASCII character, first byte of a character that is a word by itself
#: (U+3000-U+9FFF and U+F000-U+FFFF: lead bytes E3-E9 and EF), whitespace, UTF-8 continuation byte.
UPPER, LOWER, DIGIT, PUNCT, NONASCII, CJK, SPACE, CONT = 1, 2, 4, 8, 16, 32, 64, 128

CLS = np.zeros(256, dtype=np.uint8)
CLS[ord("A") : ord("Z") + 1] = UPPER
CLS[ord("a") : ord("z") + 1] = LOWER
CLS[ord("0") : ord("9") + 1] = DIGIT
for _c in range(128):
    if chr(_c).isspace():
        CLS[_c] = SPACE  # str.isspace() of the ASCII range: \t \n \v \f \r \x1c-\x1f and space
    elif not chr(_c).isalnum():
        CLS[_c] = PUNCT  # punctuation, symbols and the other C0 controls
CLS[0x80:0xC0] = CONT
CLS[0xC0:0x100] = NONASCII
CLS[0xE3:0xEA] = NONASCII | CJK
CLS[0xEF] = NONASCII | CJK
#: Byte + 1 with ASCII letters folded to lowercase; 0 for whitespace (contributes nothing).
_FOLD1 = np.arange(1, 257, dtype=np.uint64)
_FOLD1[ord("A") : ord("Z") + 1] += np.uint64(32)
_FOLD1[CLS == SPACE] = 0

HASH_PRIME = 0x100000001B3  # FNV-1 64-bit prime (odd, so invertible mod 2**64)
_MASK64 = (1 << 64) - 1
_POW = np.ones(1, dtype=np.uint64)  # _POW[i] = P**i mod 2**64, grown on demand
_IPOW = np.ones(1, dtype=np.uint64)  # _IPOW[i] = P**-i mod 2**64
SEGMENT_BYTES = (
    1 << 17
)  # bytes segmented per vectorized pass (pieces cut at whitespace); ~1 MiB arrays stay in cache (1.4x faster than 1 MiB pieces)


def hash_powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    global _POW, _IPOW
    if _POW.size < n:
        size = max(n, 2 * _POW.size, 1 << 16)
        pinv = pow(HASH_PRIME, -1, 1 << 64)
        with np.errstate(over="ignore"):
            pw = np.full(size, HASH_PRIME, dtype=np.uint64)
            pw[0] = 1
            ipw = np.full(size, pinv, dtype=np.uint64)
            ipw[0] = 1
            _POW = np.multiply.accumulate(pw)
            _IPOW = np.multiply.accumulate(ipw)
    return _POW, _IPOW


M1 = np.uint64(0xFF51AFD7ED558CCD)
M2 = np.uint64(0xC4CEB9FE1A85EC53)
S33 = np.uint64(33)


def mix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer (a bijection on uint64), in place; returns ``h``."""
    with np.errstate(over="ignore"):
        h ^= h >> S33
        h *= M1
        h ^= h >> S33
        h *= M2
        h ^= h >> S33
    return h


@dataclass(frozen=True)
class Words:
    """The words of one text. All arrays have one entry per word, in text order."""

    chars: np.ndarray
    """int64 length of each word, in characters (code points)."""
    bits: np.ndarray
    """uint8 OR of the :data:`CLS` bits of the word's bytes (UPPER, LOWER, ..., CJK)."""
    hashes: np.ndarray
    """uint64 stable hash of each word (ASCII case folded)."""

    def __len__(self) -> int:
        return int(self.chars.size)


@dataclass(frozen=True)
class WordBatch:
    """The words of several texts: one concatenated :class:`Words`-like set of arrays plus the
    word offsets of each text (``offsets[i]:offsets[i+1]`` are text ``i``'s words)."""

    chars: np.ndarray
    bits: np.ndarray
    hashes: np.ndarray
    offsets: np.ndarray
    """int64 (texts + 1,): first word of each text; last entry = total words."""

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    def doc(self, i: int) -> Words:
        """Text ``i``'s words (views into the batch arrays)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Words(self.chars[a:b], self.bits[a:b], self.hashes[a:b])

    def counts(self) -> np.ndarray:
        """int64 words per text."""
        return np.diff(self.offsets)


@dataclass(frozen=True)
class Segmented:
    """A :class:`WordBatch` with the byte layout it was segmented from (for byte-level text
    statistics; :func:`segment_batch`). Byte offsets are into :attr:`data`."""

    words: WordBatch
    data: bytes
    """The texts' UTF-8 joined by ``b"\\n"``, Unicode spaces (NBSP, U+2000-U+200A, U+3000, ...,
    also U+0085, U+2028, U+2029) replaced by one ASCII space each (see :attr:`respaced`)."""
    text_start: np.ndarray
    """int64 (texts + 1,): byte offset of each text; the last entry is ``len(data) + 1``."""
    word_start: np.ndarray
    """int64 (words,): byte offset of each word."""
    word_end: np.ndarray
    """int64 (words,): byte offset just past each word (words hold no whitespace)."""
    punct: np.ndarray
    """int64 (words,): bytes of each word in the ASCII PUNCT class (punctuation, symbols, controls)."""
    respaced: np.ndarray
    """bool (texts,): the text had Unicode spaces, so its bytes here are not its UTF-8."""


# The UTF-8 of the Unicode spaces, searched in the bytes (faster than a regex over the str):
# U+0085 and U+00A0 (C2 85, C2 A0), U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000.
_SPACE_C2 = re.compile(b"\xc2[\x85\xa0]")
_SPACE_E2 = re.compile(b"\xe2(?:\x80[\x80-\x8a\xa8\xa9\xaf]|\x81\x9f)")


def _has_unicode_space(data: bytes) -> bool:
    return (
        (b"\xc2" in data and _SPACE_C2.search(data) is not None)
        or b"\xe1\x9a\x80" in data
        or b"\xe3\x80\x80" in data
        or _SPACE_E2.search(data) is not None
    )


def space_folded_utf8(text: str) -> tuple[bytes, bool]:
    """UTF-8 of ``text`` with its Unicode spaces replaced by " " (and whether there were any)."""
    data = text.encode("utf-8", errors="surrogatepass")
    if len(data) != len(text) and _has_unicode_space(data):
        return _UNICODE_SPACE.sub(" ", text).encode("utf-8", errors="surrogatepass"), True
    return data, False


def split_words(text: str) -> Words:
    """Segment ``text`` into words (see the module docstring) and hash them."""
    return split_words_batch([text]).doc(0)


def split_words_batch(texts: Sequence[str]) -> WordBatch:
    """:func:`split_words` of many texts at once (one vectorized pass; same results)."""
    return segment_batch(texts).words


def segment_batch(texts: Sequence[str]) -> Segmented:
    """:func:`split_words_batch` plus the byte layout of the words (:class:`Segmented`)."""
    enc, respaced = zip(*map(space_folded_utf8, texts)) if len(texts) else ((), ())
    data = b"\n".join(enc)  # a whitespace byte between texts: no word spans two texts
    text_start = np.zeros(len(enc) + 1, dtype=np.int64)
    np.cumsum([len(e) + 1 for e in enc], out=text_start[1:])
    n = len(data)
    cuts = [0]
    while n - cuts[-1] > SEGMENT_BYTES:  # pieces of at most SEGMENT_BYTES bytes, cut right after whitespace
        cuts.append(_cut(data, cuts[-1], cuts[-1] + SEGMENT_BYTES))
    cuts.append(n)
    cls = np.frombuffer(data.translate(_CLS_TABLE), dtype=np.uint8)
    values = np.frombuffer(data.translate(_VALUE_TABLE), dtype=np.uint8)
    starts = _word_starts(cls, cuts)
    w, ends, punct = _words_at(cls, values, cuts, starts)
    offsets = np.empty(len(enc) + 1, dtype=np.int64)
    offsets[:-1] = np.searchsorted(starts, text_start[:-1])
    offsets[-1] = starts.size
    return Segmented(
        WordBatch(w.chars, w.bits, w.hashes, offsets),
        data,
        text_start,
        starts,
        ends,
        punct,
        np.array(respaced, dtype=bool),
    )


def _cut(data: bytes, lo: int, hi: int) -> int:
    """Where to end a piece [lo, hi) so that no word spans two pieces: after the last whitespace,
    else before the last character that is a word by itself (CJK), else (a "word" of a MiB) at a
    character boundary."""
    ws = max(data.rfind(c, lo, hi) for c in (b" ", b"\n", b"\t", b"\r"))
    if ws > lo:
        return ws + 1
    cjk = max(data.rfind(bytes([c]), lo + 1, hi) for c in (*range(0xE3, 0xEA), 0xEF))
    if cjk > lo:
        return cjk
    cut = hi
    while cut < len(data) and (data[cut] & 0xC0) == 0x80:
        cut += 1
    return cut


def _empty() -> Words:
    return Words(np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros(0, np.uint64))


_CLS_TABLE = CLS.tobytes()  # bytes.translate() tables: a C lookup, ~3x faster than numpy's gather
#: Folded byte + 1 (whitespace 0): the value a byte adds to its word's hash (0xFF never occurs in UTF-8).
_VALUE_TABLE = bytes(int(v) if i < 255 else 0 for i, v in enumerate(_FOLD1))
_BIG_ENDIAN = sys.byteorder == "big"
_GATHER8 = np.uint64(0x0102040810204080)  # x * this >> 56 packs the low bit of each byte of x (bytes 0/1)


def _word_starts(cls: np.ndarray, cuts: Sequence[int]) -> np.ndarray:
    """Byte offsets where words start (classes ``cls``, pieces cut at ``cuts``)."""
    n = cls.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    ws = cls == SPACE
    cjk = (cls & CJK) != 0
    # A word starts at a non-space byte after a space, at a CJK character, or right after one
    # (or at a piece boundary).
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    brk[1:] = ws[:-1]
    brk |= cjk
    if n > 3:
        brk[3:] |= cjk[:-3]
    brk[list(cuts[1:-1])] = True
    brk &= ~ws
    return np.flatnonzero(brk)


def _piece_sums(
    cls: np.ndarray, values: np.ndarray, cuts: Sequence[int], starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per word (starting at ``starts``): its unmixed hash, its per-class byte counts (8 bits per
    class in one uint64) and its span (bytes to the next word's start, or the piece end)."""
    W = starts.size
    h = np.empty(W, dtype=np.uint64)
    d = np.empty(W, dtype=np.uint64)
    rel = np.empty(W, dtype=np.int64)  # offset of each word in its piece
    span = np.empty(W, dtype=np.int64)  # bytes from the word's start to the next word's (or the piece end)
    first = np.searchsorted(starts, cuts).tolist()
    with np.errstate(over="ignore"):
        for k in range(len(cuts) - 1):
            a, b = first[k], first[k + 1]
            if b == a:
                continue
            lo, n = cuts[k], cuts[k + 1] - cuts[k]
            r = starts[a:b] - lo
            # Each word owns the bytes from its start to the next word's start (its trailing
            # whitespace included): prefix sums at before = r - 1 and last = next start - 1.
            before = r - 1
            last = np.empty_like(r)
            last[:-1] = before[1:]
            last[-1] = n - 1
            pw = hash_powers(n)[0]
            # acc[i] = sum_{j <= i} v[j] P^j, v[j] = folded byte + 1 (0 for whitespace)
            acc = np.multiply(values[lo : lo + n], pw[:n], dtype=np.uint64)
            np.cumsum(acc, out=acc)
            # per-class byte counts, 8 bits each (one cumulative sum for all classes): each
            # byte's class bits spread to one byte per bit (byte k = bit k), summed as uint64
            cnt = np.unpackbits(cls[lo : lo + n], bitorder="little").view(np.uint64)
            np.cumsum(cnt, out=cnt)
            np.subtract(acc[last], acc[before], out=h[a:b])
            np.subtract(cnt[last], cnt[before], out=d[a:b])
            if r[0] == 0:  # before = -1: nothing before the piece
                h[a] = acc[last[0]]
                d[a] = cnt[last[0]]
            rel[a:b] = r
            np.subtract(last + 1, r, out=span[a:b])
        h *= hash_powers(int(rel.max()) + 1)[1][rel]
    return h, d, span


def _words_at(
    cls: np.ndarray, values: np.ndarray, cuts: Sequence[int], starts: np.ndarray
) -> tuple[Words, np.ndarray, np.ndarray]:
    """The words starting at ``starts`` (byte offsets into the class and hash-value arrays, cut
    into pieces at ``cuts``): Words, end offsets, PUNCT byte counts. Per piece (cache-sized
    arrays): prefix sums of the hash terms and of the class counts, read at each word's bounds;
    then the per-word arithmetic once for all pieces."""
    W = starts.size
    if W == 0:
        return _empty(), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    h, d, span = _piece_sums(cls, values, cuts, starts)
    hashes = mix64(h)
    fields = d.view(np.uint8).reshape(-1, 8)  # field k = bytes with class bit k (exact below 256)
    trailing = fields[:, 6].astype(np.int64)  # whitespace after the word
    punct = fields[:, 3].astype(np.int64)
    chars = span - trailing - fields[:, 7]  # code points: neither whitespace nor continuation
    # bits = OR of the class bits = which fields are nonzero: one 0/1 byte per field, gathered
    # into one byte by a multiply (byte k of the integer -> bit k)
    t = (fields != 0).view(np.uint64).reshape(-1)
    if _BIG_ENDIAN:
        t = t.byteswap()
    t = t * _GATHER8
    t >>= np.uint64(56)
    bits = t.astype(np.uint8)
    long = np.flatnonzero(span >= 256)  # fields may have wrapped: count these words directly
    if long.size:
        idx = np.empty(2 * long.size, dtype=np.int64)
        idx[0::2] = starts[long]
        idx[1::2] = starts[long] + span[long]
        if idx[-1] == cls.size:
            idx = idx[:-1]
        bits[long] = np.bitwise_or.reduceat(cls, idx)[0::2]
        is_char = ((cls & (SPACE | CONT)) == 0).view(np.uint8)
        chars[long] = np.add.reduceat(is_char, idx, dtype=np.int64)[0::2]
        trailing[long] = np.add.reduceat((cls == SPACE).view(np.uint8), idx, dtype=np.int64)[0::2]
        punct[long] = np.add.reduceat((cls == PUNCT).view(np.uint8), idx, dtype=np.int64)[0::2]
    bits &= np.uint8(~SPACE & 0xFF)  # the trailing whitespace
    return Words(chars, bits, hashes), starts + (span - trailing), punct


def ngram_hashes(hashes: np.ndarray, n: int, mix: bool = True) -> np.ndarray:
    """Order-sensitive 64-bit hash of every run of ``n`` consecutive word hashes (length
    ``len(hashes) - n + 1``; empty when there are fewer than ``n`` words). With ``mix=False`` the
    values are not passed through the final bit mixer: equal and unequal n-grams stay apart
    exactly as well (the mixer is a bijection), which is all counting needs."""
    m = hashes.size - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        g = hashes[:m].copy()
        for j in range(1, n):
            g *= np.uint64(HASH_PRIME)
            g += hashes[j : j + m]
    return mix64(g) if mix else g


def ngram_hashes_batch(hashes: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ngram_hashes` (mixed) of every text of a batch at once: ``hashes`` are the texts'
    word hashes concatenated, text ``i`` owning ``hashes[offsets[i]:offsets[i+1]]``. Returns the
    n-gram hashes of all texts concatenated and their int64 offsets (text ``i``'s are
    ``flat[out_offsets[i]:out_offsets[i+1]]``, ``max(words - n + 1, 0)`` of them). One
    polynomial pass over the whole batch; n-grams that would cross two texts are dropped."""
    offsets = np.asarray(offsets, dtype=np.int64)
    counts = np.maximum(np.diff(offsets) - (n - 1), 0)
    out_offsets = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out_offsets[1:])
    m = hashes.size - n + 1
    if m <= 0 or out_offsets[-1] == 0:
        return np.zeros(0, dtype=np.uint64), out_offsets
    with np.errstate(over="ignore"):
        g = hashes[:m].copy()
        for j in range(1, n):
            g *= np.uint64(HASH_PRIME)
            g += hashes[j : j + m]
    if n > 1:  # drop the windows that start in the last n - 1 words of a text
        keep = np.ones(m, dtype=bool)
        bad = (offsets[1:, None] + np.arange(-(n - 1), 0)[None, :]).ravel()
        keep[bad[(bad >= 0) & (bad < m)]] = False
        g = g[keep]
    return mix64(g), out_offsets


def window_sums(values: np.ndarray, n: int) -> np.ndarray:
    """Sum of every run of ``n`` consecutive values (length ``len(values) - n + 1``)."""
    c = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
    return c[n:] - c[:-n]
