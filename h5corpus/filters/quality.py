"""Heuristic quality filter: the seed lesson's three rules plus Gopher/C4-style rules.

:func:`quality_reason` returns the name of the first rule a document fails (``None`` = keep). Rules
run cheapest first and stop at the first failure, so each rejected document is counted under
exactly one rule. Rule names (counters are ``quality:<name>``), in evaluation order:

- ``min_words``: fewer words than ``min_words`` (default 50).
- ``max_words``: more words than ``max_words`` (default None = off).
- ``mean_word_length``: mean word length outside [min, max] characters (default [3, 10]).
- ``uppercase_words``: fraction of all-uppercase words above the limit (0.3).
- ``alpha_words``: fraction of words containing a letter below the limit (0.8).
- ``special_chars``: fraction of characters that are not letters, marks, digits or whitespace
  (punctuation, symbols, controls) above the limit (0.1).
- ``symbols``: ("#" + "..." + "…") per word above the limit (0.1).
- ``line_punct``: fraction of non-blank lines ending in terminal punctuation below the limit
  (0.12; documents of 5+ lines).
- ``dup_lines``: fraction of non-blank lines repeating an earlier line above the limit (0.3).
- ``dup_line_chars``: fraction of line characters in repeated lines above the limit (0.2).
- ``top_ngram``: characters covered by the most frequent word n-gram, as a fraction of word
  characters, above the limit for n (2: 0.20, 3: 0.18, 4: 0.16).
- ``dup_ngram``: characters of words inside repeats of an earlier n-gram, as a fraction of word
  characters, above the limit for n (5: 0.15, 6: 0.14, ... 10: 0.10).

Words are segmented by :mod:`h5corpus.words`: whitespace runs, with every CJK character (kana,
Han) a word of its own, so Chinese and Japanese text has sensible word counts and n-grams. Rules
are adapted so they are not biased against other scripts: ``mean_word_length`` ignores
single-character CJK words (and is skipped when they are at least half of the words);
``uppercase_words`` and the letter test of ``alpha_words`` look at ASCII letters (any non-ASCII
character counts as a letter; scripts without case are never "uppercase"). In mostly-CJK text the
n-gram rules use n-grams of twice as many characters (:data:`CJK_NGRAM_SCALE`).
``special_chars`` is Unicode-aware: marks (the vowel signs of Devanagari, Thai, ...) count as
letters; CJK punctuation (、。「」) and markup such as Aozora ruby brackets (《》) count as special
characters. Scripts written without spaces outside the CJK blocks (Thai, Lao, Khmer, Myanmar,
Ethiopic with its ፡ separator, Yi) look like very long words and fail ``mean_word_length``: widen
it or leave ``quality`` off for them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import repeat
from typing import Any

import numpy as np

from .words import (
    CJK,
    LOWER,
    NONASCII,
    UPPER,
    Segmented,
    WordBatch,
    Words,
    hash_powers,
    mix64,
    ngram_hashes,
    segment_batch,
    window_sums,
)

CJK_NGRAM_SCALE = 2
"""In texts where single CJK characters are at least half of the words, the n-gram rules look at
n-grams of ``n * CJK_NGRAM_SCALE`` characters (a Chinese or Japanese word is ~2 characters): on a
Japanese novel, 5-character repeats cover 45% of the text, 10-character repeats 2%."""

RULES: tuple[str, ...] = (
    "min_words",
    "max_words",
    "mean_word_length",
    "uppercase_words",
    "alpha_words",
    "special_chars",
    "symbols",
    "line_punct",
    "dup_lines",
    "dup_line_chars",
    "top_ngram",
    "dup_ngram",
)
"""Every rule name, in evaluation order."""

#: Line endings that count as terminal punctuation (C4 uses . ! ? and closing quotes).
TERMINAL_PUNCT: tuple[str, ...] = (
    ".",
    "!",
    "?",
    '"',
    "'",
    "\u201d",
    "\u2019",
    "\u2026",
    ")",
    ":",
    ";",
    "\u3002",
    "\uff01",
    "\uff1f",
    "\u300d",
    "\u300f",
    "\uff09",
)

try:  # the `regex` module (a tiktoken dependency) knows Unicode categories
    import regex as _regex

    _NONASCII_SPECIAL = _regex.compile(r"[^\x00-\x7f\p{L}\p{M}\p{N}\s]")
except ImportError:  # pragma: no cover - regex ships with tiktoken, a core dependency
    _NONASCII_SPECIAL = re.compile(r"[^\x00-\x7f\w\s]")


def _gopher_top() -> dict[int, float]:
    return {2: 0.20, 3: 0.18, 4: 0.16}


def _gopher_dup() -> dict[int, float]:
    return {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}


@dataclass(kw_only=True)
class QualityThresholds:
    """Limits of the quality rules (see the module docstring). Ratios are fractions in [0, 1]."""

    min_words: int = 50
    """Fewest words a document may have (seed lesson: 50)."""
    max_words: int | None = None
    """Most words a document may have; None = no limit (Gopher uses 100,000, which rejects books)."""
    min_mean_word_length: float = 3.0
    """Smallest mean word length, in characters (Gopher: 3)."""
    max_mean_word_length: float = 10.0
    """Largest mean word length, in characters (Gopher: 10)."""
    max_uppercase_words: float = 0.3
    """Largest fraction of words written in capitals only (seed lesson: 0.3)."""
    min_alpha_words: float = 0.8
    """Smallest fraction of words containing a letter (Gopher: 0.8)."""
    max_special_chars: float = 0.1
    """Largest fraction of characters that are punctuation, symbols or controls (seed: 0.1)."""
    max_symbols_per_word: float = 0.1
    """Largest count of "#", "..." and "…" per word (Gopher: 0.1)."""
    min_line_punct: float = 0.12
    """Smallest fraction of non-blank lines ending in terminal punctuation (FineWeb's C4-style
    rule: 0.12); applied to documents of at least :attr:`line_punct_min_lines` lines."""
    line_punct_min_lines: int = 5
    """Fewest non-blank lines for ``line_punct`` to apply (a title, a byline and one long
    paragraph say nothing about line endings)."""
    max_dup_lines: float = 0.3
    """Largest fraction of non-blank lines that repeat an earlier line (Gopher: 0.3)."""
    max_dup_line_chars: float = 0.2
    """Largest fraction of line characters inside repeated lines (Gopher: 0.2)."""
    max_top_ngram: dict[int, float] = field(default_factory=_gopher_top)
    """n -> largest fraction of word characters covered by the most frequent word n-gram."""
    max_dup_ngram: dict[int, float] = field(default_factory=_gopher_dup)
    """n -> largest fraction of word characters inside n-grams repeating an earlier one."""

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("max_top_ngram", "max_dup_ngram"):
                for n, frac in v.items():
                    if int(n) < 1 or not 0.0 <= float(frac) <= 1.0:
                        raise ValueError(
                            f"QualityThresholds.{f.name}[{n}] = {frac}: need n >= 1 and a fraction in [0, 1]"
                        )
            elif f.name in ("min_words", "max_words", "line_punct_min_lines"):
                if v is not None and int(v) < 0:
                    raise ValueError(f"QualityThresholds.{f.name} = {v}: must be >= 0")
            elif "mean_word_length" in f.name:
                if float(v) < 0:
                    raise ValueError(f"QualityThresholds.{f.name} = {v}: must be >= 0")
            elif f.name != "max_symbols_per_word" and not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"QualityThresholds.{f.name} = {v}: must be a fraction in [0, 1]")

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["max_top_ngram"] = {str(k): float(v) for k, v in sorted(self.max_top_ngram.items())}
        d["max_dup_ngram"] = {str(k): float(v) for k, v in sorted(self.max_dup_ngram.items())}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> QualityThresholds:
        d = dict(d)
        for k in ("max_top_ngram", "max_dup_ngram"):
            if k in d:
                d[k] = {int(n): float(v) for n, v in d[k].items()}
        return cls(**d)


def quality_reason(text: str, t: QualityThresholds) -> str | None:
    """Name of the first rule ``text`` fails under thresholds ``t``, or None to keep it."""
    return _quality_group([text], t)[0][0]


_SUB_BATCH_CHARS = (
    1 << 19
)  # texts are evaluated in groups of ~512K characters (cache-sized arrays; 1.1x faster than 2M)


def quality_batch(texts: Sequence[str], t: QualityThresholds) -> tuple[list[str | None], list[np.ndarray]]:
    """First failing rule (or None) of every text, and each text's word hashes
    (:func:`h5corpus.words.split_words`).

    Vectorized over groups of texts: one segmentation pass, per-text sums by prefix sums, the
    n-gram rules by hash-bucket counts and a sort of the few candidate n-grams (exact; see
    :func:`top_ngram_fraction` and :func:`dup_ngram_fraction` for the definitions). Results do
    not depend on how texts are grouped."""
    reasons: list[str | None] = []
    hashes: list[np.ndarray] = []
    group: list[str] = []
    size = 0
    for x in list(texts) + [None]:  # type: ignore[list-item]
        if x is None or (group and size + len(x) > _SUB_BATCH_CHARS):
            if group:
                r, wb = _quality_group(group, t)
                reasons.extend(r)
                hashes.extend(wb.hashes[a:b] for a, b in zip(wb.offsets[:-1].tolist(), wb.offsets[1:].tolist()))
            group, size = [], 0
        if x is not None:
            group.append(x)
            size += len(x)
    return reasons, hashes


def _quality_group(texts: Sequence[str], t: QualityThresholds) -> tuple[list[str | None], WordBatch]:
    n = len(texts)
    reasons: list[str | None] = [None] * n
    sg = segment_batch(texts)
    wb = sg.words
    alive = np.ones(n, dtype=bool)
    off = wb.offsets
    nw = np.diff(off)
    bits, chars = wb.bits, wb.chars
    single_cjk = ((bits & CJK) != 0) & (chars == 1)
    has = nw > 0
    starts = off[:-1][has]

    def per_text(x: np.ndarray) -> np.ndarray:
        out = np.zeros(n, dtype=np.int64)
        if starts.size:  # (a segment runs to the next text with words: the ones between have none)
            out[has] = np.add.reduceat(x, starts, dtype=np.int64)
        return out

    total = per_text(chars)
    n_cjk = per_text(single_cjk)
    other = np.maximum(nw - n_cjk, 1)
    mean_len = (total - n_cjk) / other  # CJK single characters are 1 character each
    n_upper = per_text((bits & (UPPER | LOWER)) == UPPER)
    n_alpha = per_text((bits & (UPPER | LOWER | NONASCII)) != 0)
    word_rules = [
        ("min_words", nw < t.min_words),
        ("max_words", nw > t.max_words if t.max_words is not None else np.zeros(n, dtype=bool)),
        (
            "mean_word_length",
            has & (2 * n_cjk < nw) & ((mean_len < t.min_mean_word_length) | (mean_len > t.max_mean_word_length)),
        ),
        ("uppercase_words", has & (n_upper > t.max_uppercase_words * nw)),
        ("alpha_words", has & (n_alpha < t.min_alpha_words * nw)),
    ]
    for name, fail in word_rules:
        for i in np.flatnonzero(alive & fail).tolist():
            reasons[i] = name
        alive &= ~fail
    alive &= has
    if alive.any():
        for name, fail in _text_rule_fails(sg, texts, alive, nw, t):
            for i in np.flatnonzero(alive & fail).tolist():
                reasons[i] = name
            alive &= ~fail
    _ngram_rules(wb, t, alive, reasons, total, cjk=2 * n_cjk >= nw)
    return reasons, wb


def _ngram_rules(
    wb: WordBatch,
    t: QualityThresholds,
    alive: np.ndarray,
    reasons: list[str | None],
    total: np.ndarray,
    cjk: np.ndarray,
) -> None:
    """The n-gram rules on the texts still ``alive`` (updated in place, with ``reasons``).
    CJK-dominated texts (``cjk``) count characters as words: their rules use n x CJK_NGRAM_SCALE."""
    groups = [(~cjk, 1), (cjk, CJK_NGRAM_SCALE)]
    grp = _Group(wb)
    for name, limits, fails in (
        ("top_ngram", t.max_top_ngram, _top_ngram_fails),
        ("dup_ngram", t.max_dup_ngram, _dup_ngram_fails),
    ):
        for member, scale in groups:
            sel = alive & member
            if limits and sel.any():
                fail = fails(grp, sel, total, {n * scale: lim for n, lim in limits.items()})
                for i in np.flatnonzero(fail).tolist():
                    reasons[i] = name
                alive &= ~fail


def _text_rules(text: str, t: QualityThresholds, nw: int) -> str | None:
    """The character- and line-level rules (C-speed string methods)."""
    special = text.encode("ascii", errors="ignore")
    n_special = len(special) - len(special.translate(None, _ASCII_SPECIAL_BYTES))
    if not text.isascii():
        n_special += len(_NONASCII_SPECIAL.findall(text))
    if n_special > t.max_special_chars * len(text):
        return "special_chars"
    n_symbols = text.count("#") + text.count("...") + text.count("\u2026")
    if n_symbols > t.max_symbols_per_word * nw:
        return "symbols"
    lines = [ln for ln in map(str.strip, text.splitlines()) if ln]
    if len(lines) >= t.line_punct_min_lines:
        n_punct = sum(map(str.endswith, lines, repeat(TERMINAL_PUNCT)))
        if n_punct < t.min_line_punct * len(lines):
            return "line_punct"
    if len(lines) >= 2:
        counts = Counter(lines)
        n_dup = len(lines) - len(counts)  # occurrences after the first
        if n_dup > t.max_dup_lines * len(lines):
            return "dup_lines"
        line_chars = sum(map(len, lines))
        dup_chars = line_chars - sum(map(len, counts))
        if dup_chars > t.max_dup_line_chars * line_chars:
            return "dup_line_chars"
    return None


_ASCII_SPECIAL_BYTES = bytes(c for c in range(128) if not (chr(c).isalnum() or chr(c).isspace()))

# -- the character and line rules over a whole group (same decisions as _text_rules) ----------
#: ASCII line boundaries of str.splitlines() (the others, U+0085/U+2028/U+2029, are Unicode
#: spaces for the segmentation: texts holding them take _text_rules' own line code).
_LINE_BREAK = np.zeros(256, dtype=np.uint8)
_LINE_BREAK[list(b"\n\r\x0b\x0c\x1c\x1d\x1e")] = 1
_LINE_BREAK_TABLE = _LINE_BREAK.tobytes()
_RARE_LINE_BREAKS = tuple(bytes([c]) for c in b"\r\x0b\x0c\x1c\x1d\x1e")
_TERMINAL_ASCII = np.zeros(256, dtype=bool)
#: UTF-8 length -> sorted big-endian integer codes of the non-ASCII terminal punctuation.
_TERMINAL_CODES: dict[int, np.ndarray] = {}
for _p in TERMINAL_PUNCT:
    _b = _p.encode("utf-8")
    if len(_b) == 1:
        _TERMINAL_ASCII[_b[0]] = True
    else:
        _TERMINAL_CODES[len(_b)] = np.union1d(
            _TERMINAL_CODES.get(len(_b), np.zeros(0, np.int64)), [int.from_bytes(_b, "big")]
        )


def _symbol_counts(sg: Segmented, arr: np.ndarray, texts: Sequence[str], sel: np.ndarray) -> np.ndarray:
    """Per text: "#" + non-overlapping "..." + "…" (the ``symbols`` rule's count; "…" only for ``sel``)."""
    n = len(texts)

    def per_text_positions(pos: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        owner = np.searchsorted(sg.text_start, pos, side="right") - 1
        return np.bincount(owner, weights=weights, minlength=n)[:n]

    symbols = per_text_positions(np.flatnonzero(arr == ord("#")))
    dots = np.flatnonzero(arr == ord("."))
    if dots.size >= 3:
        new = np.empty(dots.size, dtype=bool)
        new[0] = True
        np.not_equal(dots[1:], dots[:-1] + 1, out=new[1:])
        first = np.flatnonzero(new)
        runs = np.diff(first, append=dots.size) // 3
        symbols = symbols + per_text_positions(dots[first], runs.astype(np.float64)).astype(np.int64)
    for i in np.flatnonzero(sel).tolist():
        if not texts[i].isascii():
            symbols[i] += texts[i].count("\u2026")
    return symbols


def _text_rule_fails(
    sg: Segmented, texts: Sequence[str], sel: np.ndarray, nw: np.ndarray, t: QualityThresholds
) -> list[tuple[str, np.ndarray]]:
    """``[(rule, fails)]`` for the character and line rules (``special_chars`` .. ``dup_line_chars``,
    in order) of the selected texts of a group: exactly :func:`_text_rules`' counts, from the
    segmentation's byte layout. Characters: ASCII punctuation bytes of the words; non-ASCII
    special characters by the regex only where an upper bound (every non-ASCII character
    special) exceeds the limit. Lines: str.splitlines() boundaries in the bytes, a line's stripped
    text spans its first to its last word, duplicates are candidates by a hash of their words and
    byte length, confirmed by comparing the bytes. Texts with Unicode line breaks or spaces (whose
    bytes were respaced) take the plain line code."""
    n = len(texts)
    wb = sg.words
    off = wb.offsets
    data = sg.data
    arr = np.frombuffer(data, dtype=np.uint8)
    nbytes = np.diff(sg.text_start) - 1
    length = np.fromiter(map(len, texts), dtype=np.int64, count=n)
    fails: list[tuple[str, np.ndarray]] = []

    has = np.diff(off) > 0
    word_starts = off[:-1][has]

    def per_text_words(x: np.ndarray) -> np.ndarray:
        out = np.zeros(n, dtype=np.int64)
        if word_starts.size:
            out[has] = np.add.reduceat(x, word_starts)
        return out

    # special_chars: ASCII punctuation (inside words) + non-ASCII non-letter/mark/digit/space
    special = per_text_words(sg.punct)
    limit = t.max_special_chars * length
    bound = special + (nbytes - length)  # each non-ASCII character has at least two bytes
    for i in np.flatnonzero(sel & (bound > limit)).tolist():
        if not texts[i].isascii():
            special[i] += len(_NONASCII_SPECIAL.findall(texts[i]))
    fail = special > limit
    fails.append(("special_chars", fail))
    sel = sel & ~fail
    symbols = _symbol_counts(sg, arr, texts, sel)
    fail = sel & (symbols > t.max_symbols_per_word * nw)
    fails.append(("symbols", fail))
    sel = sel & ~fail
    # lines
    n_lines, n_punct, n_dup, line_chars, dup_chars = _line_stats_batch(sg, arr, n)
    for i in np.flatnonzero(sel & sg.respaced).tolist():
        n_lines[i], n_punct[i], n_dup[i], line_chars[i], dup_chars[i] = _line_stats(texts[i])
    fail = sel & (n_lines >= t.line_punct_min_lines) & (n_punct < t.min_line_punct * n_lines)
    fails.append(("line_punct", fail))
    sel = sel & ~fail
    many = n_lines >= 2
    fail = sel & many & (n_dup > t.max_dup_lines * n_lines)
    fails.append(("dup_lines", fail))
    sel = sel & ~fail
    fails.append(("dup_line_chars", sel & many & (dup_chars > t.max_dup_line_chars * line_chars)))
    return fails


def _line_stats_batch(sg: Segmented, arr: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Per text of a group (bytes as they are in ``sg.data``): non-blank lines, lines ending in
    terminal punctuation, lines repeating an earlier line, characters of the stripped lines,
    characters of the repeating lines (see :func:`_line_stats`)."""
    z = [np.zeros(n, dtype=np.int64) for _ in range(5)]
    if int(sg.words.offsets[-1]) == 0:
        return tuple(z)
    lines = _Lines(sg, arr)
    owner, a, b = lines.owner, lines.a, lines.b
    n_lines = np.bincount(owner, minlength=n)[:n]
    term = _ends_in_terminal_punct(arr, a, b)
    n_punct = np.bincount(owner, weights=term, minlength=n)[:n].astype(np.int64)
    line_chars = np.bincount(owner, weights=lines.chars, minlength=n)[:n].astype(np.int64)
    n_dup, dup_chars = z[0], z[1]
    two = n_lines[owner] >= 2
    if two.sum() >= 2:
        _count_duplicate_lines(sg, arr, lines, np.flatnonzero(two), n_dup, dup_chars)
    return n_lines, n_punct, n_dup, line_chars, dup_chars


class _Lines:
    """The non-blank lines of a group's texts, from the word layout: each line's first and last
    word, its text, its stripped byte range ``[a, b)`` and its characters."""

    def __init__(self, sg: Segmented, arr: np.ndarray) -> None:
        wb = sg.words
        W = int(wb.offsets[-1])
        ws, we = sg.word_start, sg.word_end
        if any(c in sg.data for c in _RARE_LINE_BREAKS):
            breaks = np.flatnonzero(np.frombuffer(sg.data.translate(_LINE_BREAK_TABLE), dtype=np.uint8))
        else:
            breaks = np.flatnonzero(arr == 10)
        # a line starts at the first word after a line break (lines hold no line break; texts are
        # joined by "\n"); blank lines hold no word, so every line here is non-blank
        starts_line = np.zeros(W, dtype=bool)
        starts_line[0] = True
        k = np.searchsorted(ws, breaks)
        starts_line[k[k < W]] = True
        self.first = first = np.flatnonzero(starts_line)
        self.last = last = np.empty_like(first)
        last[:-1] = first[1:] - 1
        last[-1] = W - 1
        self.owner = np.searchsorted(wb.offsets, first, side="right") - 1
        self.a, self.b = ws[first], we[last]
        chars = self.b - self.a  # bytes of the stripped line; minus the continuation bytes of its words:
        extra = (we - ws) - wb.chars
        if extra.any():
            c = np.zeros(W + 1, dtype=np.int64)
            np.cumsum(extra, out=c[1:])
            chars -= c[last + 1] - c[first]
        self.chars = chars


def _ends_in_terminal_punct(arr: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per line ``[a, b)``: True when its last character is terminal punctuation."""
    e = b - 1
    term = _TERMINAL_ASCII[arr[e]]
    wide = np.flatnonzero(arr[e] >= 0x80)
    for size, codes in _TERMINAL_CODES.items():
        w = wide[e[wide] - (size - 1) >= a[wide]]
        code = np.zeros(w.size, dtype=np.int64)
        for j in range(size - 1, -1, -1):
            code = (code << 8) | arr[e[w] - j]
        term[w[codes[np.minimum(np.searchsorted(codes, code), codes.size - 1)] == code]] = True
    return term


def _line_keys(sg: Segmented, lines: _Lines) -> np.ndarray:
    """Per line: a hash of its words, byte length and text (equal lines have equal keys)."""
    wb = sg.words
    W = int(wb.offsets[-1])
    pw, ipw = hash_powers(W + 1)
    with np.errstate(over="ignore"):
        s = np.zeros(W + 1, dtype=np.uint64)
        np.multiply(wb.hashes, pw[:W], out=s[1:])
        np.cumsum(s, out=s)
        key = (s[lines.last + 1] - s[lines.first]) * ipw[lines.first]
        key ^= mix64((lines.b - lines.a).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
        key ^= _SALT(lines.owner)
    return key


def _count_duplicate_lines(
    sg: Segmented, arr: np.ndarray, lines: _Lines, cand: np.ndarray, n_dup: np.ndarray, dup_chars: np.ndarray
) -> None:
    """Add, per text, the lines (among ``cand``) that repeat an earlier line and their characters.
    Lines of one text with the same key are candidates; the bytes decide."""
    owner, a, b, chars = lines.owner, lines.a, lines.b, lines.chars
    n = n_dup.size
    key = _line_keys(sg, lines)
    cand = cand[_maybe_repeated(key[cand])]  # only keys that may occur twice (bucket counts)
    kc = key[cand]
    order = np.argsort(kc, kind="stable")  # equal keys: in line order
    sk = kc[order]
    eq = sk[1:] == sk[:-1]
    if not eq.any():
        return
    # every line of a run of equal keys vs the run's first line, byte by byte
    later = np.zeros(cand.size, dtype=bool)
    later[1:] = eq
    run = np.cumsum(~later) - 1  # run number of each sorted line
    first_of_run = np.flatnonzero(~later)
    li = cand[order[later]]  # the later lines of the runs
    ri = cand[order[first_of_run[run[later]]]]  # their run's first line
    ln = b[li] - a[li]  # = b[ri] - a[ri] (the key holds the length)
    same = np.ones(li.size, dtype=bool)
    nb = int(ln.sum())
    if nb:
        rel = np.arange(nb, dtype=np.int64) - np.repeat(np.cumsum(ln) - ln, ln)
        differ = arr[np.repeat(a[li], ln) + rel] != arr[np.repeat(a[ri], ln) + rel]
        if differ.any():
            same = np.bincount(np.repeat(np.arange(li.size), ln)[differ], minlength=li.size) == 0
    # runs whose lines all equal their first line: every later line repeats it
    run_ok = np.ones(first_of_run.size, dtype=bool)
    run_ok[run[later][~same]] = False
    ok = same & run_ok[run[later]]
    n_dup += np.bincount(owner[li[ok]], minlength=n)[:n]
    dup_chars += np.bincount(owner[li[ok]], weights=chars[li[ok]], minlength=n)[:n].astype(np.int64)
    # other runs (a hash collision, or lines equal up to case/spacing): plain sets
    if not run_ok.all():
        rest = np.sort(np.concatenate([li[~ok], cand[order[first_of_run[~run_ok]]]]))
        seen: set[tuple[int, bytes]] = set()
        for o, x, y, ch in zip(owner[rest].tolist(), a[rest].tolist(), b[rest].tolist(), chars[rest].tolist()):
            line = (o, sg.data[x:y])
            if line in seen:
                n_dup[o] += 1
                dup_chars[o] += ch
            else:
                seen.add(line)


def _line_stats(text: str) -> tuple[int, int, int, int, int]:
    """Plain definitions: non-blank stripped lines (str.splitlines, str.strip), those ending in
    terminal punctuation, those repeating an earlier line, their characters, the characters of
    the repeating ones."""
    lines = [ln for ln in map(str.strip, text.splitlines()) if ln]
    n_punct = sum(map(str.endswith, lines, repeat(TERMINAL_PUNCT)))
    counts = Counter(lines)
    line_chars = sum(map(len, lines))
    return len(lines), n_punct, len(lines) - len(counts), line_chars, line_chars - sum(map(len, counts))


def _sorted_runs(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted values, start of each run of equal values, run lengths)."""
    s = np.sort(g)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    run_starts = np.flatnonzero(new)
    return s, run_starts, np.diff(np.append(run_starts, s.size))


def _maybe_repeated(g: np.ndarray) -> np.ndarray:
    """Sorted positions whose value *may* occur more than once: every position of a repeated
    value, plus positions sharing a hash bucket with another value (~1 in 9 of the others). A
    bincount over >= 8 x len buckets instead of a sort; the exact answer sorts only these."""
    buckets = 1 << max(6, (8 * g.size - 1).bit_length())
    b = (g & np.uint64(buckets - 1)).astype(np.intp)
    return np.flatnonzero(np.bincount(b, minlength=buckets)[b] >= 2)


def _coverage(positions: np.ndarray, n: int, nwords: int) -> np.ndarray:
    """Boolean mask of words inside [i, i + n) for any i in ``positions``."""
    diff = np.bincount(positions, minlength=nwords + 1)[: nwords + 1]
    diff -= np.bincount(np.minimum(positions + n, nwords), minlength=nwords + 1)[: nwords + 1]
    return np.cumsum(diff[:-1]) > 0


# -- reference definitions (plain sorts; the tests check the fast deciders against them) -------
def top_ngram_fraction(words: Words, n: int) -> float:
    """Characters covered by the most frequent word n-gram (its count x its characters; among
    equally frequent n-grams the longest) as a fraction of all word characters; 0 when no n-gram
    occurs twice. Gopher's ``top_n_grams`` rule, measured over word characters."""
    total = int(words.chars.sum())
    g = ngram_hashes(words.hashes, n, mix=False)
    if g.size < 2 or total == 0:
        return 0.0
    s, run_starts, counts = _sorted_runs(g)
    top = int(counts.max())
    if top < 2:
        return 0.0
    best = s[run_starts[counts == top]]
    longest = int(window_sums(words.chars, n)[np.isin(g, best)].max())
    return top * longest / total


def dup_ngram_fraction(words: Words, n: int) -> float:
    """Characters of the words inside occurrences of an n-gram that already occurred earlier in
    the document (each word counted once), as a fraction of all word characters. Gopher's
    ``dup_n_grams`` rule, measured over word characters."""
    total = int(words.chars.sum())
    g = ngram_hashes(words.hashes, n, mix=False)
    if g.size < 2 or total == 0:
        return 0.0
    order = np.argsort(g, kind="stable")
    s = g[order]
    later = np.zeros(s.size, dtype=bool)
    np.equal(s[1:], s[:-1], out=later[1:])
    rep = order[later]
    if rep.size == 0:
        return 0.0
    return int(words.chars[_coverage(rep, n, len(words))].sum()) / total


# -- batched deciders ---------------------------------------------------------------------------
class _Group:
    """Per-group arrays shared by the n-gram deciders, computed on first use: the text of each
    word, word hashes salted with their text (so n-grams of different texts differ while equal
    n-grams of one text stay equal), words left in the text from each word, character prefix
    sums, and bucket counts of the salted words (an upper bound on each word's count in its text)."""

    def __init__(self, wb: WordBatch) -> None:
        self.wb = wb
        self.size = len(wb)
        self.nwords = int(wb.offsets[-1])
        self._cache: dict[str, np.ndarray] = {}
        self._min_counts: dict[int, np.ndarray] = {}

    def _get(self, key: str, make) -> np.ndarray:
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = make()
        return v

    @property
    def text(self) -> np.ndarray:
        return self._get("text", lambda: np.repeat(np.arange(self.size, dtype=np.int64), np.diff(self.wb.offsets)))

    @property
    def salted(self) -> np.ndarray:
        def make() -> np.ndarray:
            h = np.repeat(_SALT(np.arange(self.size)), np.diff(self.wb.offsets))
            h ^= self.wb.hashes
            return h

        return self._get("salted", make)

    @property
    def left(self) -> np.ndarray:
        """Words from each word to the end of its text (itself included)."""

        def make() -> np.ndarray:
            r = np.repeat(self.wb.offsets[1:], np.diff(self.wb.offsets))
            r -= np.arange(self.nwords)
            return r

        return self._get("left", make)

    @property
    def cum(self) -> np.ndarray:
        return self._get("cum", lambda: _char_prefix(self.wb))

    def min_counts(self, n: int) -> np.ndarray:
        """For each window of n words (all W - n + 1 starts), the smallest bucket count of its
        words: an upper bound on how often the n-gram occurs in its text (when inside it)."""
        mc = self._min_counts.get(n)
        if mc is not None:
            return mc
        if not self._min_counts:
            self._min_counts[1] = _bucket_counts(self.salted, 4)  # (a smaller table: faster, barely looser)
        k = max(j for j in self._min_counts if j <= n)
        mc = self._min_counts[k]
        base = self._min_counts[1]
        for j in range(k + 1, n + 1):  # min over n words = min(min over n-1 words, the n-th)
            mc = np.minimum(mc[:-1], base[j - 1 :])
        self._min_counts[n] = mc
        return mc

    def unigram_bound(self, n: int) -> np.ndarray:
        """Per text, an upper bound on (count x characters) of its most frequent n-gram: over its
        windows of n words, the largest (smallest bucket count of the n words) x (characters)."""
        out = np.zeros(self.size, dtype=np.int64)
        m = self.nwords - n + 1
        if m <= 0:
            return out
        mc = self.min_counts(n)
        cum = self.cum
        v = cum[n:] - cum[:m]
        v *= mc
        # per text: max over the windows starting in it (windows running into the next text
        # only raise the bound)
        starts = self.wb.offsets[:-1]
        idx = np.flatnonzero(starts < m)
        if idx.size:
            out[idx] = np.maximum.reduceat(v, starts[idx])
        return out


class _Windows:
    """The word n-grams of the selected texts of a group that lie inside one text: first-word
    positions, texts, and (on first use) characters and hashes (salted per text)."""

    def __init__(self, grp: _Group, n: int, select: np.ndarray, repeatable: bool = False) -> None:
        """``repeatable``: only the n-grams that may occur twice in their text (every word's
        bucket count >= 2)."""
        wb = grp.wb
        self._grp = grp
        self.n = n
        counts = np.diff(wb.offsets) - (n - 1)  # n-grams per text
        take = select & (counts > 0)
        lens = counts[take]
        total = int(lens.sum())
        m = grp.nwords - n + 1
        if total and 2 * total >= m:  # dense selection: a mask over all windows
            mask = grp.left[:m] >= n
            mask &= take[grp.text[:m]]
            if repeatable:
                mask &= grp.min_counts(n) >= 2
            self.pos = np.flatnonzero(mask)
            self.text = grp.text[self.pos]
        else:  # positions: starts[t] .. starts[t] + lens[t] - 1 for every selected text t
            starts = wb.offsets[:-1][take]
            self.text = np.repeat(np.flatnonzero(take), lens)
            self.pos = np.arange(total, dtype=np.int64)
            if total:
                self.pos += np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
                if repeatable:
                    keep = grp.min_counts(n)[self.pos] >= 2
                    self.pos, self.text = self.pos[keep], self.text[keep]
        self._g: np.ndarray | None = None
        self._chars: np.ndarray | None = None

    @property
    def chars(self) -> np.ndarray:
        """Characters of each n-gram."""
        if self._chars is None:
            cum = self._grp.cum
            self._chars = cum[self.pos + self.n] - cum[self.pos]
        return self._chars

    @property
    def g(self) -> np.ndarray:
        """Hash of each n-gram (the ngram_hashes polynomial over the salted word hashes)."""
        if self._g is None:
            h, pos = self._grp.salted, self.pos
            with np.errstate(over="ignore"):
                if pos.size and int(pos[-1]) - int(pos[0]) < 2 * pos.size:
                    # dense selection: the polynomial over contiguous slices, then one gather
                    lo, m = int(pos[0]), int(pos[-1]) - int(pos[0]) + 1
                    g = h[lo : lo + m].copy()
                    for j in range(1, self.n):
                        g *= _P
                        g += h[lo + j : lo + j + m]
                    g = g[pos - lo] if m != pos.size else g
                else:
                    g = h[pos]
                    for j in range(1, self.n):
                        g *= _P
                        g += h[pos + j]
            self._g = g
        return self._g


_P = np.uint64(0x100000001B3)


def _SALT(text: np.ndarray) -> np.ndarray:
    return mix64(text.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))


def _char_prefix(wb: WordBatch) -> np.ndarray:
    cum = np.zeros(wb.chars.size + 1, dtype=np.int64)
    np.cumsum(wb.chars, out=cum[1:])
    return cum


def _group_max(values: np.ndarray, groups: np.ndarray, size: int) -> np.ndarray:
    """Max of ``values`` per group id (ids sorted ascending), 0 for absent groups."""
    out = np.zeros(size, dtype=np.int64)
    if values.size:
        new = np.empty(groups.size, dtype=bool)
        new[0] = True
        np.not_equal(groups[1:], groups[:-1], out=new[1:])
        first = np.flatnonzero(new)
        out[groups[first]] = np.maximum.reduceat(values, first)
    return out


def _bucket_counts(g: np.ndarray, spread: int = 8) -> np.ndarray:
    """For each value, how many values share its hash bucket (>= ``spread`` x len buckets): at
    least the number of times the value itself occurs."""
    buckets = 1 << max(6, (spread * g.size - 1).bit_length())
    b = (g & np.uint64(buckets - 1)).astype(np.intp)
    return np.bincount(b, minlength=buckets)[b]


def _top_ngrams(
    cand: np.ndarray, g: np.ndarray, text: np.ndarray, chars: np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per text, the count of its most repeated n-gram among the windows ``cand`` (hashes ``g``,
    texts ``text``, characters ``chars``) and the most characters such a top n-gram covers."""
    top = np.zeros(size, dtype=np.int64)
    best = np.zeros(size, dtype=np.int64)
    if cand.size < 2:
        return top, best
    vals = g[cand]
    order = np.argsort(vals)
    sv = vals[order]
    new = np.empty(sv.size, dtype=bool)
    new[0] = True
    np.not_equal(sv[1:], sv[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    counts = np.diff(starts, append=sv.size)
    rep = counts >= 2
    first = cand[order[starts[rep]]]  # one occurrence of each repeated n-gram
    counts = counts[rep]
    rtext = text[first]
    by_text = np.argsort(rtext, kind="stable")
    rtext, counts, rchars = rtext[by_text], counts[by_text], chars[first][by_text]
    top = _group_max(counts, rtext, size)
    is_top = counts == top[rtext]
    return top, _group_max(rchars[is_top], rtext[is_top], size)


def _top_ngram_fails(grp: _Group, alive: np.ndarray, total: np.ndarray, limits: Mapping[int, float]) -> np.ndarray:
    """Texts (among ``alive``) whose :func:`top_ngram_fraction` exceeds the limit for some n.

    Exact, sorting as little as possible: a text's top count is at most the largest hash-bucket
    count among its n-grams (:func:`_bucket_counts`) and, for larger n, at most its top count for
    a smaller n; its top n-gram covers at most its longest window of n words. Only texts whose
    bound (count x longest window) exceeds the limit have their candidate n-grams sorted. Before
    all that, the rarest word of an n-gram bounds its count (:meth:`_Group.unigram_bound`): on
    the dev corpus this alone clears 99% of the words for n = 2 .. 4."""
    wb = grp.wb
    size = len(wb)
    fail = np.zeros(size, dtype=bool)
    top_ub = np.full(size, np.iinfo(np.int64).max, dtype=np.int64)  # bound on the top count
    has = np.diff(wb.offsets) > 0
    longest_word = np.zeros(size, dtype=np.int64)
    if has.any():
        longest_word[has] = np.maximum.reduceat(wb.chars, wb.offsets[:-1][has])
    for n, limit in sorted(limits.items()):
        select = alive & ~fail & (top_ub >= 2)  # no repeated (n-1)-gram: no repeated n-gram
        if not select.any():
            continue
        select &= grp.unigram_bound(n) > limit * total
        if not select.any():
            continue
        capped = np.minimum(top_ub, 1 << 40)
        if n > min(limits):  # cheap bound first: an n-gram has at most n x the longest word
            select &= capped * n * longest_word > limit * total
            if not select.any():
                continue
        w = _Windows(grp, n, select)
        longest = _group_max(w.chars, w.text, size)
        select &= capped * longest > limit * total
        if not select.any():
            continue
        keep = select[w.text]
        text, chars, g = w.text[keep], w.chars[keep], w.g[keep]
        bc = _bucket_counts(g)
        ub = _group_max(bc, text, size)
        top_ub = np.where(select, np.minimum(top_ub, ub), top_ub)
        need = select & (ub * longest > limit * total)
        if not need.any():
            continue
        top, best = _top_ngrams(np.flatnonzero(need[text] & (bc >= 2)), g, text, chars, size)
        fail |= need & (top * best > limit * total)
        top_ub = np.where(need, top, top_ub)
    return fail


def _dup_ngram_fails(grp: _Group, alive: np.ndarray, total: np.ndarray, limits: Mapping[int, float]) -> np.ndarray:
    """Texts (among ``alive``) whose :func:`dup_ngram_fraction` exceeds the limit for some n.

    Exact. Only n-grams whose words all occur twice (bucket counts) can repeat, so only those are
    hashed and counted. If the n-gram at i repeats the one at j < i, then for the smallest size m
    every m-gram at i .. i+n-m repeats too (the one at j .. j+n-m), so positions starting
    n - m + 1 consecutive m-gram repeats bound the n-gram repeats from above; a text whose bound
    is within the limit for a larger n is not recomputed for it. Coverage is measured on the
    sorted repeat positions (intervals of n words), never on arrays over all words."""
    size = len(grp.wb)
    cum = grp.cum
    fail = np.zeros(size, dtype=bool)

    def covered_chars(starts: np.ndarray, n: int) -> np.ndarray:
        """Per text: characters of the words inside [s, s + n) for s in ``starts`` (sorted,
        distinct, each interval inside one text)."""
        if starts.size == 0:
            return np.zeros(size, dtype=np.int64)
        lo = starts.copy()
        np.maximum(starts[1:], starts[:-1] + n, out=lo[1:])  # the part not covered by the previous one
        new = cum[starts + n] - cum[lo]
        return np.bincount(grp.text[starts], weights=new, minlength=size)[:size].astype(np.int64)

    base_n = 0
    base_rep: np.ndarray | None = None  # sorted positions of the base repeats
    base_cov = np.zeros(size, dtype=np.int64)  # characters covered by the base repeats
    for n, limit in sorted(limits.items()):
        select = alive & ~fail
        if base_rep is not None:
            # n-gram repeats lie inside the base repeats' coverage: cheap bound first
            select &= base_cov > limit * total
            if not select.any():
                continue
            k = n - base_n + 1  # consecutive base repeats needed
            runs = base_rep[:0]
            if base_rep.size >= k:
                runs = base_rep[: base_rep.size - k + 1]
                runs = runs[base_rep[k - 1 :] - runs == k - 1]
                runs = runs[grp.left[runs] >= n]  # (runs that would leave the text only count less)
            select &= covered_chars(runs, n) > limit * total
        if not select.any():
            if base_rep is None:
                base_n, base_rep = n, np.zeros(0, dtype=np.int64)
            continue
        w = _Windows(grp, n, select, repeatable=True)
        rep = w.pos[:0]
        cand = _maybe_repeated(w.g) if w.g.size >= 2 else w.pos[:0]
        if cand.size >= 2:
            vals = w.g[cand]
            order = np.argsort(vals, kind="stable")  # the first occurrence comes first
            sv = vals[order]
            later = np.zeros(cand.size, dtype=bool)
            np.equal(sv[1:], sv[:-1], out=later[1:])
            rep = np.sort(w.pos[cand[order[later]]])
        cov = covered_chars(rep, n)
        fail |= select & (cov > limit * total)
        if base_rep is None:
            base_n, base_rep, base_cov = n, rep, cov
    return fail
