"""The vectorized fast paths of the filter stages decide exactly like their plain definitions.

Each fast path (byte-level line and character statistics, bound-pruned n-gram rules, batched
MinHash signatures, anchored e-mail/IP searches, table-driven language-ID features) is compared
with the plain per-document definition it replaces, on crafted edge cases and text that ships with
Python; the ``dev_texts`` tests repeat that on the whole dev corpus (skipped without it).
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("rensa")
pytest.importorskip("py3langid")

from h5corpus.filters import langid, pii, quality, words  # noqa: E402
from h5corpus.filters.neardedup import MinHasher  # noqa: E402
from h5corpus.filters.quality import QualityThresholds, quality_batch  # noqa: E402
from tests.helpers import reference_quality_reason  # noqa: E402

# Lines and characters that str.splitlines()/str.strip() treat specially, duplicates that differ
# only in case or inner spacing (equal word hashes, different bytes), terminal punctuation of
# every UTF-8 length, Unicode spaces and line separators (the respaced fallback).
EDGE_TEXTS = [
    "",
    "   \n \t\n",
    "one line without a break",
    "a.\r\nb!\r\nc?\rd\x0be\x0cf\x1cg\x1dh\x1ei\x1fj.\n\n\n  k;  \n",
    "dup line\n  dup line  \n\tdup line\ndup line \nother.",
    "Dup\ndup\nDUP\ndup\nDup",
    "a  b\na b\na\tb\na b\na  b",
    "end quote\u201d\nend apostrophe\u2019\nellipsis\u2026\nkuten\u3002\nbang\uff01\nq\uff1f\n\u300d\n\u300f\n\uff09",
    "two byte \u00e9\nfour byte \U0001f600\nfour byte \U0001f600\n\u00e9.\n\u00e9.",
    "nbsp\u00a0inside\nnbsp\u00a0inside\nline\u2028separator\u2029paragraph\x85next",
    "ideographic\u3000space\u3000\n\u3000\n",
    "... .... ...... .. # ## \u2026\u2026 #.#...",
    "\u00bfQu\u00e9? \u00a1S\u00ed! \u00abcomillas\u00bb \u2014 guion, \u00bd \u00b2 \u00a7 \u00b6 \u00a9 \u2122 \u2192",
    "\ud800 lone surrogate.\n\ud800 lone surrogate.",
    "\u5f3e\u8f29\u306f\u732b\u3067\u3042\u308b\u3002\u540d\u524d\u306f\u307e\u3060\u7121\u3044\u3002\n" * 4,
    ("The quick brown fox jumps over the lazy dog.\n" * 3 + "Another line here!\n") * 5,
    "x" * 300 + ",,," + " " * 300 + "y\n" + "#" * 40,
]


def _plain_counts(text: str) -> tuple[int, int]:
    """(special characters, symbols) exactly as _text_rules counts them."""
    special = text.encode("ascii", errors="ignore")
    n_special = len(special) - len(special.translate(None, quality._ASCII_SPECIAL_BYTES))
    if not text.isascii():
        n_special += len(quality._NONASCII_SPECIAL.findall(text))
    return n_special, text.count("#") + text.count("...") + text.count("\u2026")


# Reaches inside quality (_line_stats_batch, _line_stats): the batch kernel against the per-text definition.
def _check_line_stats(texts) -> int:
    sg = words.segment_batch(texts)
    got = quality._line_stats_batch(sg, np.frombuffer(sg.data, dtype=np.uint8), len(texts))
    checked = 0
    for i, t in enumerate(texts):
        assert bool(sg.respaced[i]) == (words._UNICODE_SPACE.search(t) is not None), repr(t[:80])
        if sg.respaced[i]:
            continue  # these take _line_stats itself
        assert tuple(int(x[i]) for x in got) == quality._line_stats(t), repr(t[:200])
        checked += 1
    return checked


def test_line_statistics_equal_splitlines_and_strip(stdlib_corpus_texts):
    """Lines, lines ending in terminal punctuation, repeated lines and their characters from the
    byte layout equal str.splitlines()/str.strip()/Counter on every text whose bytes were not
    respaced (those with Unicode spaces or line separators are flagged for the plain code)."""
    texts = EDGE_TEXTS + list(stdlib_corpus_texts[:150])
    assert _check_line_stats(texts) >= len(texts) - 5
    for t in EDGE_TEXTS:  # alone too (no neighbours in the batch)
        _check_line_stats([t])


def test_line_statistics_equal_definitions_on_dev_corpus(dev_texts):
    for i in range(0, len(dev_texts), 300):
        _check_line_stats(dev_texts[i : i + 300])


_reference = reference_quality_reason  # the rules one by one from their definitions


_LOOSE = dict(
    min_words=0,
    max_special_chars=1.0,
    max_symbols_per_word=1e9,
    min_line_punct=0.0,
    max_dup_lines=1.0,
    max_dup_line_chars=1.0,
    min_mean_word_length=0.0,
    max_mean_word_length=1e9,
    min_alpha_words=0.0,
    max_uppercase_words=1.0,
    max_top_ngram={},
    max_dup_ngram={},
)
THRESHOLD_SETS = {
    "defaults": QualityThresholds(),
    "special_chars": QualityThresholds(**{**_LOOSE, "max_special_chars": 0.04}),
    "symbols": QualityThresholds(**{**_LOOSE, "max_symbols_per_word": 0.003}),
    "lines": QualityThresholds(**{**_LOOSE, "min_line_punct": 0.6, "line_punct_min_lines": 2, "max_dup_lines": 0.02}),
    "dup_line_chars": QualityThresholds(**{**_LOOSE, "max_dup_line_chars": 0.01}),
    "top_ngram": QualityThresholds(**{**_LOOSE, "max_top_ngram": {1: 0.3, 2: 0.05, 3: 0.04, 5: 0.03}}),
    "dup_ngram": QualityThresholds(
        **{**_LOOSE, "max_dup_ngram": {1: 0.5, 2: 0.3, 5: 0.08, 6: 0.07, 9: 0.02, 12: 0.01}}
    ),
}


def _repetitive_texts() -> list[str]:
    rng = random.Random(7)
    vocab = [f"w{i}" for i in range(300)]
    out = []
    for _ in range(12):
        base = [rng.choice(vocab) for _ in range(rng.randint(20, 400))]
        phrase = " ".join(base[: rng.randint(2, 12)])
        out.append(" ".join(base) + (" " + phrase) * rng.randint(0, 30))
        out.append("\n".join(" ".join(base[j : j + 9]) + rng.choice([".", "", "!"]) for j in range(0, len(base), 9)))
    out.append("\u5f3e\u8f29\u306f\u732b\u3067\u3042\u308b\u3002" * 40)  # CJK: n-grams of 2n characters
    return out


@pytest.mark.parametrize("name", list(THRESHOLD_SETS))
def test_batched_rules_equal_definitions(name, stdlib_corpus_texts):
    """quality_batch (byte statistics, unigram-bound pruning of the n-gram rules, repeat
    candidates from bucket counts) decides like the rules applied one by one, under thresholds
    that make each family of rules decide, in any grouping."""
    t = THRESHOLD_SETS[name]
    texts = EDGE_TEXTS + _repetitive_texts() + list(stdlib_corpus_texts[:120])
    want = [_reference(x, t) for x in texts]
    got, hashes = quality_batch(texts, t)
    assert got == want
    assert 10 <= sum(r is not None for r in got) <= len(got) - 10  # the rules do decide
    pieces = [r for i in range(0, len(texts), 7) for r in quality_batch(texts[i : i + 7], t)[0]]
    assert pieces == want
    # every text's word hashes come back (rejected ones included)
    assert all(np.array_equal(h, words.split_words(x).hashes) for x, h in zip(texts, hashes))


def test_batched_rules_equal_definitions_on_dev_corpus(dev_texts):
    sample = dev_texts[1::5]
    for name in ("symbols", "lines", "dup_line_chars", "top_ngram", "dup_ngram"):
        t = THRESHOLD_SETS[name]
        assert quality_batch(sample, t)[0] == [_reference(x, t) for x in sample], name


def test_segmentation_layout(stdlib_corpus_texts, monkeypatch):
    """segment_batch's byte layout: each word's bytes hold no whitespace and decode to a word of
    its text (str.split() for ASCII text), with its character count and ASCII punctuation; a word
    longer than a piece is cut at the piece boundary, as split_words_batch always did."""
    texts = list(stdlib_corpus_texts[:40]) + ["x" * 3000 + " tail, end.", "caf\u00e9 na\u00efve \u5f3e\u8f29 ok"]
    for chunk in (words.SEGMENT_BYTES, 997):
        monkeypatch.setattr(words, "SEGMENT_BYTES", chunk)
        sg = words.segment_batch(texts)
        assert np.array_equal(sg.words.hashes, words.split_words_batch(texts).hashes)
        for i, t in enumerate(texts):
            a, b = int(sg.words.offsets[i]), int(sg.words.offsets[i + 1])
            toks = [
                sg.data[s:e].decode("utf-8") for s, e in zip(sg.word_start[a:b].tolist(), sg.word_end[a:b].tolist())
            ]
            assert all(tok and not any(c.isspace() for c in tok) for tok in toks)
            if t.isascii() and max(map(len, t.split()), default=0) < chunk:
                assert toks == t.split()
            assert sg.words.chars[a:b].tolist() == [len(tok) for tok in toks]
            assert sg.punct[a:b].tolist() == [sum(not c.isalnum() and c.isascii() for c in tok) for tok in toks]
    assert "".join(toks) == "caf\u00e9na\u00efve\u5f3e\u8f29ok"


_PATTERNS = {
    "email": (pii._EMAIL_RE, pii._EMAIL_AT, pii._EMAIL_RUN, 64),
    "ipv4": (pii._IPV4_RE, pii._IPV4_GATE, pii._IPV4_RUN, 3),
    "ipv6": (pii._IPV6_RE, pii._IPV6_GATE, pii._IPV6_RUN, 4),
}
_PIECES = [
    "1",
    "25",
    "255",
    "256",
    "300",
    "0",
    ".",
    ".",
    ":",
    "::",
    "a",
    "f",
    "F",
    "g",
    "@",
    "x.y",
    "-",
    "_",
    "%",
    " ",
    "\n",
    "v",
    "\u00e9",
    "\u0663",
    "\uff11",
    "192.168.1.1",
    "10.0.0",
    "2001:db8",
    "fe80::",
    "a@b.co",
    "first.last+tag@mail.example.org",
    "a" * 70,
    "@@",
]


@pytest.mark.parametrize("kind", list(_PATTERNS))
# Reaches inside pii (_anchored): the anchored search is compared with a full scan.
def test_anchored_pii_search_equals_a_full_scan(kind):
    """The e-mail and IP regexes searched only around their anchors find exactly the matches of
    finditer over the whole text (random texts of address fragments, Unicode digits included)."""
    regex, gate, run, back = _PATTERNS[kind]
    rng = random.Random(kind)
    for _ in range(20000):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 16)))
        assert [m.span() for m in pii._anchored(text, regex, gate, run, back)] == [
            m.span() for m in regex.finditer(text)
        ], repr(text)


def test_batched_signatures_equal_one_row_at_a_time(stdlib_corpus_texts):
    """Signatures from the batched shingles (rensa calls of 31 rows) equal one-text-at-a-time
    signatures, for empty texts, texts shorter than a shingle and any shingle size."""
    texts = ["", "one", "two words", "a b c d", "a b c d e"] + list(stdlib_corpus_texts[:70]) + ["", "x"]
    wb = words.split_words_batch(texts)
    hashes = [wb.hashes[wb.offsets[i] : wb.offsets[i + 1]] for i in range(len(texts))]
    for size in (1, 3, 5):
        m = MinHasher(shingle_size=size)
        want = np.array([m.signature(t) for t in texts])
        assert np.array_equal(m.signatures_of_word_hashes(hashes), want)
    assert MinHasher().signatures_of_word_hashes([]).shape == (0, 128)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to count threads")
def test_batched_signatures_never_start_rensa_thread_pool():
    """rensa runs calls of RENSA_DOC_PAR_BATCH_SIZE rows or more (never less than 32) on a thread
    pool that does not survive fork; the batched path stays below it even when the environment
    sets the smallest size (no thread is started)."""
    script = (
        "import os, numpy as np\n"
        "from h5corpus.filters.neardedup import MinHasher\n"
        "n0 = len(os.listdir('/proc/self/task'))\n"
        "rng = np.random.default_rng(0)\n"
        "hs = [rng.integers(0, 2**63, 300, dtype=np.uint64) for _ in range(500)]\n"
        "MinHasher().signatures_of_word_hashes(hs)\n"
        "print(n0, len(os.listdir('/proc/self/task')))\n"
    )
    env = dict(
        os.environ,
        RENSA_DOC_PAR_BATCH_SIZE="32",
        OPENBLAS_NUM_THREADS="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(p) for p in sys.path if p]),
    )
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    before, after = map(int, p.stdout.split())
    assert after == before


# Reaches inside py3langid's model (_rowbase): its own counts are the oracle for the fast automaton.
def test_langid_features_equal_py3langid_counts():
    """The table-driven automaton (two bytes from the root in one lookup, states as 16-bit rows)
    emits exactly py3langid's feature counts."""
    import py3langid.langid as pl

    ref = pl.LanguageIdentifier.from_model_file(pl.MODEL_FILE, norm_probs=True)
    texts = EDGE_TEXTS[2:] + [
        "Der schnelle braune Fuchs springt \u00fcber den faulen Hund.",
        "\u0391\u03b8\u03ae\u03bd\u03b1",
        "a",
        "ab",
        "abc",
        "\U0001f600" * 3,
    ]
    for t in texts:
        data = langid.encode_for_langid(t)
        want = pl.visit_counts(ref.tk_nextmove, ref._rowbase, ref.tk_output, data) or {}
        got = np.bincount(langid.feature_ids(data))
        assert {int(f): int(c) for f, c in enumerate(got) if c} == dict(want), repr(t[:60])


# The byte-level fast path (words.space_folded_utf8) is compared with the regex it replaces.
def test_unicode_space_detection_on_bytes_equals_the_regex():
    """space_folded_utf8 finds Unicode spaces by their UTF-8 bytes: the same texts as the str regex, for
    every code point."""
    every = "".join(chr(c) for c in range(0x80, 0x110000) if not 0xD800 <= c < 0xE000)
    spaces = {m.group(0) for m in words._UNICODE_SPACE.finditer(every)}
    for c in spaces:
        assert words.space_folded_utf8("x" + c)[1]
    for i in range(0, len(every), 2000):
        chunk = "".join(c for c in every[i : i + 2000] if c not in spaces)
        assert words.space_folded_utf8(chunk)[1] is False
    assert re.sub(r"\s", "", "".join(sorted(spaces))) == ""
