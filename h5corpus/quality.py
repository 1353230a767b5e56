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
from dataclasses import dataclass, field, fields
from itertools import repeat
from typing import Any, Mapping, Sequence

import numpy as np

from .words import CJK, LOWER, NONASCII, UPPER, WordBatch, Words, mix64, ngram_hashes, split_words_batch, window_sums

CJK_NGRAM_SCALE = 2
"""In texts where single CJK characters are at least half of the words, the n-gram rules look at
n-grams of ``n * CJK_NGRAM_SCALE`` characters (a Chinese or Japanese word is ~2 characters): on a
Japanese novel, 5-character repeats cover 45% of the text, 10-character repeats 2%."""

RULES: tuple[str, ...] = (
    "min_words", "max_words", "mean_word_length", "uppercase_words", "alpha_words", "special_chars",
    "symbols", "line_punct", "dup_lines", "dup_line_chars", "top_ngram", "dup_ngram",
)
"""Every rule name, in evaluation order."""

#: Line endings that count as terminal punctuation (C4 uses . ! ? and closing quotes).
TERMINAL_PUNCT: tuple[str, ...] = (
    ".", "!", "?", '"', "'", "\u201d", "\u2019", "\u2026", ")", ":", ";",
    "\u3002", "\uff01", "\uff1f", "\u300d", "\u300f", "\uff09",
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
                        raise ValueError(f"QualityThresholds.{f.name}[{n}] = {frac}: need n >= 1 and a fraction in [0, 1]")
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
    def from_json(cls, d: Mapping[str, Any]) -> "QualityThresholds":
        d = dict(d)
        for k in ("max_top_ngram", "max_dup_ngram"):
            if k in d:
                d[k] = {int(n): float(v) for n, v in d[k].items()}
        return cls(**d)


def _quick_word_count_at_least(text: str, k: int) -> bool | None:
    """True/False when cheap to decide whether ``text`` has at least ``k`` whitespace-separated
    words, None when undecided (CJK text, whose characters are words, needs the full count)."""
    if k <= 0:
        return True
    if len(text) < 2 * k - 1 and text.isascii():
        return False  # k words need k characters and k - 1 separators
    probe = text[: 64 * k]
    if len(probe.split(None, k)) >= k:  # whitespace words never outnumber our words
        return True
    if len(probe) == len(text) and text.isascii():
        return False  # ASCII: no CJK characters, so whitespace words are our words
    return None


def quality_reason(text: str, t: QualityThresholds) -> str | None:
    """Name of the first rule ``text`` fails under thresholds ``t``, or None to keep it."""
    return _quality_group([text], t)[0][0]


_SUB_BATCH_CHARS = 1 << 19  # texts are evaluated in groups of ~512K characters (cache-sized arrays; 1.1x faster than 2M)


def quality_batch(texts: Sequence[str], t: QualityThresholds) -> tuple[list[str | None], list[np.ndarray | None]]:
    """First failing rule (or None) of every text, and each text's word hashes
    (:func:`h5corpus.words.split_words`; None for texts rejected before segmentation, for having
    too few words to be worth segmenting).

    Vectorized over groups of texts: one segmentation pass, per-text sums by prefix sums, the
    n-gram rules by hash-bucket counts and a sort of the few candidate n-grams (exact; see
    :func:`top_ngram_fraction` and :func:`dup_ngram_fraction` for the definitions). Results do
    not depend on how texts are grouped."""
    reasons: list[str | None] = []
    hashes: list[np.ndarray | None] = []
    group: list[str] = []
    size = 0
    for x in list(texts) + [None]:  # type: ignore[list-item]
        if x is None or (group and size + len(x) > _SUB_BATCH_CHARS):
            if group:
                r, wb = _quality_group(group, t)
                reasons.extend(r)
                hashes.extend(wb.hashes[a:b] if rr != "min_words" or b > a else None
                              for rr, a, b in zip(r, wb.offsets[:-1].tolist(), wb.offsets[1:].tolist()))
            group, size = [], 0
        if x is not None:
            group.append(x)
            size += len(x)
    return reasons, hashes


def _quality_group(texts: Sequence[str], t: QualityThresholds) -> tuple[list[str | None], WordBatch]:
    n = len(texts)
    reasons: list[str | None] = [None] * n
    seg: list[str] = list(texts)
    for i, x in enumerate(texts):
        if _quick_word_count_at_least(x, t.min_words) is False:
            reasons[i] = "min_words"
            seg[i] = ""
    wb = split_words_batch(seg)
    alive = np.fromiter((r is None for r in reasons), dtype=bool, count=n)
    if not alive.any():
        return reasons, wb
    off = wb.offsets
    nw = np.diff(off)
    bits, chars = wb.bits, wb.chars
    single_cjk = ((bits & CJK) != 0) & (chars == 1)

    def per_text(x: np.ndarray) -> np.ndarray:
        c = np.zeros(x.size + 1, dtype=np.int64)
        np.cumsum(x, out=c[1:])
        return c[off[1:]] - c[off[:-1]]

    total = per_text(chars)
    n_cjk = per_text(single_cjk)
    other = np.maximum(nw - n_cjk, 1)
    mean_len = (total - n_cjk) / other  # CJK single characters are 1 character each
    n_upper = per_text((bits & (UPPER | LOWER)) == UPPER)
    n_alpha = per_text((bits & (UPPER | LOWER | NONASCII)) != 0)
    has = nw > 0
    word_rules = [
        ("min_words", nw < t.min_words),
        ("max_words", nw > t.max_words if t.max_words is not None else np.zeros(n, dtype=bool)),
        ("mean_word_length", has & (2 * n_cjk < nw)
         & ((mean_len < t.min_mean_word_length) | (mean_len > t.max_mean_word_length))),
        ("uppercase_words", has & (n_upper > t.max_uppercase_words * nw)),
        ("alpha_words", has & (n_alpha < t.min_alpha_words * nw)),
    ]
    for name, fail in word_rules:
        for i in np.flatnonzero(alive & fail).tolist():
            reasons[i] = name
        alive &= ~fail
    alive &= has
    for i in np.flatnonzero(alive).tolist():
        r = _text_rules(texts[i], t, int(nw[i]))
        if r is not None:
            reasons[i] = r
            alive[i] = False
    # CJK-dominated texts count characters as words: their n-gram rules use n x CJK_NGRAM_SCALE.
    cjk = 2 * n_cjk >= nw
    groups = [(~cjk, 1), (cjk, CJK_NGRAM_SCALE)]
    for name, limits, fails in (("top_ngram", t.max_top_ngram, _top_ngram_fails),
                                ("dup_ngram", t.max_dup_ngram, _dup_ngram_fails)):
        for member, scale in groups:
            sel = alive & member
            if limits and sel.any():
                fail = fails(wb, sel, total, {n * scale: lim for n, lim in limits.items()})
                for i in np.flatnonzero(fail).tolist():
                    reasons[i] = name
                alive &= ~fail
    return reasons, wb


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
class _Windows:
    """The word n-grams of the selected texts of a batch that lie inside one text: first-word
    positions, texts, characters, and (on first use) salted hashes."""

    def __init__(self, wb: WordBatch, n: int, select: np.ndarray, cum: np.ndarray) -> None:
        # n-grams never cross texts: text t contributes windows offsets[t] .. offsets[t+1]-n
        self._hashes = wb.hashes
        self.n = n
        counts = np.diff(wb.offsets) - (n - 1)  # n-grams per text
        take = select & (counts > 0)
        starts = wb.offsets[:-1][take]
        lens = counts[take]
        # positions: starts[t] .. starts[t] + lens[t] - 1 for every selected text t
        self.text = np.repeat(np.flatnonzero(take), lens)
        self.pos = np.arange(self.text.size, dtype=np.int64)
        if self.pos.size:
            self.pos += np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
        self.chars = cum[self.pos + n] - cum[self.pos]
        self._g: np.ndarray | None = None

    @property
    def g(self) -> np.ndarray:
        """Hash of each n-gram, salted with its text so equal n-grams of different texts differ."""
        if self._g is None:
            h, pos = self._hashes, self.pos
            with np.errstate(over="ignore"):
                if pos.size and int(pos[-1]) - int(pos[0]) < 2 * pos.size:
                    # dense selection: the polynomial over contiguous slices, then one gather
                    lo, m = int(pos[0]), int(pos[-1]) - int(pos[0]) + 1
                    g = h[lo:lo + m].copy()
                    for j in range(1, self.n):  # same polynomial as ngram_hashes(mix=False)
                        g *= _P
                        g += h[lo + j:lo + j + m]
                    g = g[pos - lo]
                else:
                    g = h[pos]
                    for j in range(1, self.n):
                        g *= _P
                        g += h[pos + j]
            if self.text.size:  # per-text salts, gathered (same values as _SALT(self.text))
                g ^= _SALT(np.arange(int(self.text[-1]) + 1))[self.text]
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


def _bucket_counts(g: np.ndarray) -> np.ndarray:
    """For each value, how many values share its hash bucket (>= 8 x len buckets): at least the
    number of times the value itself occurs."""
    buckets = 1 << max(6, (8 * g.size - 1).bit_length())
    b = (g & np.uint64(buckets - 1)).astype(np.intp)
    return np.bincount(b, minlength=buckets)[b]


def _top_ngram_fails(wb: WordBatch, alive: np.ndarray, total: np.ndarray, limits: Mapping[int, float]) -> np.ndarray:
    """Texts (among ``alive``) whose :func:`top_ngram_fraction` exceeds the limit for some n.

    Exact, sorting as little as possible: a text's top count is at most the largest hash-bucket
    count among its n-grams (:func:`_bucket_counts`) and, for larger n, at most its top count for
    a smaller n; its top n-gram covers at most its longest window of n words. Only texts whose
    bound (count x longest window) exceeds the limit have their candidate n-grams sorted."""
    size = len(wb)
    cum = _char_prefix(wb)
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
        capped = np.minimum(top_ub, 1 << 40)
        if n > min(limits):  # cheap bound first: an n-gram has at most n x the longest word
            select &= capped * n * longest_word > limit * total
            if not select.any():
                continue
        w = _Windows(wb, n, select, cum)
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
        cand = np.flatnonzero(need[text] & (bc >= 2))
        top = np.zeros(size, dtype=np.int64)
        best = np.zeros(size, dtype=np.int64)
        if cand.size >= 2:
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
            best = _group_max(rchars[is_top], rtext[is_top], size)
        fail |= need & (top * best > limit * total)
        top_ub = np.where(need, top, top_ub)
    return fail


def _dup_ngram_fails(wb: WordBatch, alive: np.ndarray, total: np.ndarray, limits: Mapping[int, float]) -> np.ndarray:
    """Texts (among ``alive``) whose :func:`dup_ngram_fraction` exceeds the limit for some n.

    Exact. If the n-gram at i repeats the one at j < i, then for the smallest size m every
    m-gram at i .. i+n-m repeats too (the one at j .. j+n-m), so positions starting n - m + 1
    consecutive m-gram repeats bound the n-gram repeats from above; a text whose bound is within
    the limit for a larger n is not recomputed for it."""
    size = len(wb)
    nwords = wb.hashes.size
    cum = _char_prefix(wb)
    fail = np.zeros(size, dtype=bool)

    def covered_chars(starts: np.ndarray, n: int) -> np.ndarray:
        if starts.size == 0:
            return np.zeros(size, dtype=np.int64)
        diff = np.bincount(starts, minlength=nwords + 1)[: nwords + 1]
        diff -= np.bincount(starts + n, minlength=nwords + 1)[: nwords + 1]
        covered = np.cumsum(diff[:-1]) > 0
        c = np.zeros(nwords + 1, dtype=np.int64)
        np.cumsum(np.where(covered, wb.chars, 0), out=c[1:])
        return c[wb.offsets[1:]] - c[wb.offsets[:-1]]

    base_n: int | None = None
    base_flag: np.ndarray | None = None
    base_cov = np.zeros(size, dtype=np.int64)  # characters covered by the base repeats
    for n, limit in sorted(limits.items()):
        select = alive & ~fail
        if base_flag is not None:
            # n-gram repeats lie inside the base repeats' coverage: cheap bound first
            select &= base_cov > limit * total
            if not select.any():
                continue
            k = n - base_n + 1  # consecutive base repeats needed
            runs = np.zeros(0, dtype=np.int64)
            if base_flag.size >= k:
                runs = np.flatnonzero(window_sums(base_flag, k) == k)
            # (a run of base repeats never crosses texts: base n-grams lie inside one text)
            select &= covered_chars(runs, n) > limit * total
        if not select.any():
            if base_flag is None:
                base_n, base_flag = n, np.zeros(nwords, dtype=np.int64)
            continue
        w = _Windows(wb, n, select, cum)
        rep = np.zeros(0, dtype=np.int64)
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
        if base_flag is None:
            base_n, base_cov = n, cov
            base_flag = np.zeros(nwords, dtype=np.int64)
            base_flag[rep] = 1
    return fail
