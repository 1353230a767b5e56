"""The perplexity filter: units, the n-gram language model (interpolated modified Kneser-Ney)
against a naive implementation of the same formulas, the model file, the filter stage, the CLI,
and wiki-vs-spam separation on the dev corpus.

Core tests use text that ships with Python (module docstrings, standard-library sources); the dev
corpus tests find it through ``H5CORPUS_SHARED`` and skip without it.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from h5corpus.filters import DocumentFilter, FilterConfig
from h5corpus.filters.lmunits import BOS, EOS, unit_hashes, units_batch
from h5corpus.filters.ngramtrain import kn_discounts, train_ngram_model
from h5corpus.filters.perplexity import ModelFileError, load_model, read_model_header, worst_fraction
from tests.helpers import (
    NaiveKneserNey,
    naive_kn_discounts,
    reference_lm_unit_hash,
    reference_lm_units,
    spam_texts,
    stdlib_texts,
    subprocess_env,
    write_jsonl,
)

#: Real English prose that ships with Python.
DOCS = [argparse.__doc__, json.__doc__, difflib.__doc__]

UNIT_CASES = [
    "Jarred Shaw (born September 28, 1990) is an\u2014American \u201cplayer\u201d.\n\nNew para\n \n x",
    "\n\nhello  world\n",
    "",
    " \n \n ",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001abc\u6f22\u5b57x",
    "a\u00a0b \u00ab c \u00bb 50\u00b0 \u00a73 \u00bd d\u2026e \u00e9t\u00e9",
    "don't stop 123abc ABC a.b,c\tx\r\ny\x00z\x7f",
    "abc\n \n",
    "\u00e9\u6f22t \u00ab\u00e9\u00bb x\x85y \U0001f600\U0001f600",
    "a" * 200 + " " + "b" * 63 + " " + "c" * 64 + " " + "d" * 65 + " " + "Ab" * 40 + " " + "aB" * 40,
]


# -- units --------------------------------------------------------------------------------------
_HASHES: dict[str, int] = {}  # the oracle's hashes by unit (units repeat: computed once each)


def _check_units(texts: list[str]) -> None:
    ub = units_batch(texts)
    assert ub.offsets[0] == 0 and ub.offsets[-1] == ub.hashes.size
    for i, t in enumerate(texts):
        units = reference_lm_units(t)
        for u in units:
            if u not in _HASHES:
                _HASHES[u] = reference_lm_unit_hash(u)
        want = [_HASHES[u] for u in units]
        got = ub.hashes[ub.offsets[i] : ub.offsets[i + 1]].tolist()
        assert got == want, (i, t[:80])


def test_units_match_the_regex_definition_and_plain_python_hashes():
    """Segmentation and hashes equal an independent regex + pure-Python-integer implementation,
    on edge cases, random strings of tricky characters, and standard-library sources, whatever the
    batching."""
    import random

    rng = random.Random(7)
    alphabet = ["a", "B", "9", " ", "\n", "\t", "\r", ",", "(", "\u00e9", "\u6f22", "\u2014", "\u00ab"]
    alphabet += ["\u00a0", "\u3000", "\x00", "\U0001f600", "xyzxyzxyz", "\u2028", "\x85", "\u00c2"]
    rand = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) for _ in range(2000)]
    texts = UNIT_CASES + rand + stdlib_texts(limit=40)
    _check_units(texts)
    for _ in range(3):
        _check_units(rng.sample(texts, 100))
    assert reference_lm_units(UNIT_CASES[0])[:10] == [
        "Jarred",
        "Shaw",
        "(",
        "born",
        "September",
        "28",
        ",",
        "1990",
        ")",
        "is",
    ]
    # folded: case of ASCII letters and every digit
    assert units_batch(["The 1990 USA"]).hashes.tolist() == units_batch(["the 2024 usa"]).hashes.tolist()
    assert unit_hashes(["Shaw", ","]).tolist() == units_batch(["Shaw,"]).hashes.tolist()
    with pytest.raises(ValueError, match="2 units"):
        unit_hashes(["ab,"])


def test_units_of_the_dev_corpus_match_the_definition(dev_texts):
    """Every dev document (UDHR in 129 languages, Japanese novels, Korean/Vietnamese Wikipedia, web)."""
    texts = dev_texts[::7]
    _check_units(texts)


# -- smoothing against the naive implementation ---------------------------------------------------
def _queries(naive: NaiveKneserNey, docs_units: list[list[str]], n_contexts: int, seed: int):
    """Every seen context of every length (from <s> on and inside texts) up to ``order - 1``,
    sampled, plus unseen ones; each with every vocabulary unit, </s> and an unseen unit."""
    import random

    order = naive.order
    ctxs = set()
    for d in docs_units:
        s = [BOS, *d]
        for k in range(0, order):
            for i in range(len(s) - k + 1):
                c = tuple(s[i : i + k])
                if BOS not in c[1:]:
                    ctxs.add(c)
    ctxs = sorted(ctxs)
    rng = random.Random(seed)
    picked = rng.sample(ctxs, min(n_contexts, len(ctxs)))
    picked += [(), ("zzunseen",), ("the", "zzunseen"), ("zzunseen", "the"), (BOS, "zzunseen")]
    units = [u for u in naive.vocab if u != EOS] + [EOS, "qqunseen"]
    return picked, units


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_probabilities_equal_the_naive_kneser_ney_and_sum_to_one(order):
    """For sampled contexts and every unit: the model's ln p equals the naive dict-and-recursion
    implementation (float32 tables: 1e-5), and each context's distribution over the vocabulary
    plus <unk> sums to 1."""
    docs_units = [reference_lm_units(d) for d in DOCS]
    model = train_ngram_model(DOCS, order=order)
    naive = NaiveKneserNey(docs_units, order)
    assert model.header["smoothing"]["discount_rule"] == ["modified"] * order
    for k in range(1, order + 1):  # the discounts themselves
        assert model.header["smoothing"]["discounts"][k - 1] == pytest.approx(naive.d[k], rel=1e-12)
    assert model.header["smoothing"]["vocabulary"] == len(naive.vocab) + 1
    contexts, units = _queries(naive, docs_units, 120, seed=order)
    queries = [(c, u) for c in contexts for u in units]
    got = model.log_prob_many(queries).astype(np.float64)
    want = np.log([naive.prob(c, u) for c, u in queries])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    sums = np.exp(got).reshape(len(contexts), len(units)).sum(axis=1)
    np.testing.assert_allclose(sums, 1.0, atol=1e-5)
    assert model.log_prob(["the"], "qqunseen") == pytest.approx(model.log_prob(["the"], "zzother"), abs=0)


@pytest.mark.parametrize(
    "docs, rules",
    [
        (["a b a b c", "a a"], ["ney", "ney", "fixed"]),
        (["x y z"], ["fixed", "fixed"]),
    ],
)
def test_discount_fallbacks_on_tiny_corpora_equal_the_naive_model(docs, rules):
    """Corpora too small for Chen & Goodman's discounts fall back (Ney's single discount, then
    0.5), recorded in the header; the probabilities still equal the naive model and sum to 1."""
    order = len(rules)
    model = train_ngram_model(docs, order=order)
    assert model.header["smoothing"]["discount_rule"] == rules
    docs_units = [reference_lm_units(d) for d in docs]
    naive = NaiveKneserNey(docs_units, order)
    contexts, units = _queries(naive, docs_units, 50, seed=0)
    queries = [(c, u) for c in contexts for u in units]
    got = model.log_prob_many(queries).astype(np.float64)
    np.testing.assert_allclose(got, np.log([naive.prob(c, u) for c, u in queries]), atol=2e-5)
    np.testing.assert_allclose(np.exp(got).reshape(len(contexts), -1).sum(axis=1), 1.0, atol=1e-5)


def test_discount_rule_itself():
    a = np.array([1] * 50 + [2] * 20 + [3] * 10 + [4] * 6 + [9] * 3)
    d, rule = kn_discounts(a)
    y = 50 / (50 + 40)
    assert rule == "modified"
    assert d == pytest.approx([1 - 2 * y * 20 / 50, 2 - 3 * y * 10 / 20, 3 - 4 * y * 6 / 10])
    assert d == pytest.approx(naive_kn_discounts(a.tolist()))
    assert kn_discounts(np.array([1, 1, 2]))[1] == "ney"
    assert kn_discounts(np.array([2, 2, 3])) == ([0.5, 0.5, 0.5], "fixed")


def test_document_scores_equal_the_naive_chain_rule():
    """A text's total ln p is the sum over its units and </s> of ln p(unit | the units before,
    from <s>), and its perplexity exp(-total / (units + 1)); texts never see each other's units."""
    model = train_ngram_model(DOCS, order=3)
    naive = NaiveKneserNey([reference_lm_units(d) for d in DOCS], 3)
    texts = [
        "The parser converts strings to objects.",
        "",
        "Sequence matching: compare pairs of sequences of any type, so long as the elements are hashable.",
        "zzz qqq ,,, \n newline",
        DOCS[1][:500],
    ]
    total, n = model.score(texts)
    for t, tot, k in zip(texts, total, n):
        units = [BOS, *reference_lm_units(t), EOS]
        want = sum(np.log(naive.prob(units[:i], units[i])) for i in range(1, len(units)))
        assert k == len(units) - 1
        assert tot == pytest.approx(want, abs=1e-4 * len(units))
    ppl = model.perplexities(texts)
    np.testing.assert_allclose(ppl, np.exp(-total / n))
    for i, t in enumerate(texts):  # alone or in a batch: the same score, to the bit
        assert model.perplexities([t])[0] == ppl[i]


# -- the model file -------------------------------------------------------------------------------
def test_save_load_round_trip_gives_identical_scores_and_the_header_records_the_training(tmp_path):
    texts = stdlib_texts(limit=30)
    model = train_ngram_model(texts, order=3, sources=[{"spec": "stdlib sample"}])
    path = model.save(tmp_path / "m.npz")
    back = load_model(path)
    probe = stdlib_texts(limit=60)[30:] + DOCS
    assert np.array_equal(back.perplexities(probe), model.perplexities(probe))
    h = read_model_header(path)
    assert h == back.header == json.loads(json.dumps(model.header))
    t = h["training"]
    assert t["documents"] == 30 and t["characters"] == sum(map(len, texts))
    assert t["units"] == sum(len(reference_lm_units(x)) for x in texts)
    digest = hashlib.sha256()
    for x in texts:
        b = x.encode()
        digest.update(len(b).to_bytes(8, "little") + b)
    assert t["texts_sha256"] == digest.hexdigest()
    assert t["sources"] == [{"spec": "stdlib sample"}]
    assert h["order"] == 3 and h["format"] == "h5corpus-ngram-lm" and h["format_version"] == 1
    assert h["smoothing"]["method"] == "interpolated modified Kneser-Ney" and len(h["ngrams"]) == 3
    with zipfile.ZipFile(path) as zf:  # plain arrays, nothing pickled
        assert sorted(zf.namelist()) == sorted(
            ["header.npy"]
            + [f"{p}{k}.npy" for k in (1, 2, 3) for p in ("keys", "logp")]
            + [f"{p}{k}.npy" for k in (1, 2) for p in ("bow", "ctx")]
        )
    np.load(path, allow_pickle=False)["keys1"]


def test_training_is_deterministic_bytes_included_whatever_the_batching(tmp_path):
    texts = stdlib_texts(limit=40)
    a = train_ngram_model(texts, order=3).save(tmp_path / "a.npz")
    b = train_ngram_model(iter(texts), order=3, batch_chars=5_000).save(tmp_path / "b.npz")
    assert a.read_bytes() == b.read_bytes()
    c = train_ngram_model(texts[:39], order=3).save(tmp_path / "c.npz")
    assert read_model_header(c)["sha256"] != read_model_header(a)["sha256"]


def test_corrupt_foreign_and_missing_model_files_are_refused_naming_the_file(tmp_path):
    good = train_ngram_model(DOCS, order=2).save(tmp_path / "good.npz")
    data = good.read_bytes()
    at = data.find(np.load(good)["logp2"].tobytes())
    assert at > 0
    flipped = tmp_path / "flipped.npz"
    flipped.write_bytes(data[: at + 10] + bytes([data[at + 10] ^ 0x40]) + data[at + 11 :])  # one bit of logp2
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, keys1=np.arange(3))
    text = tmp_path / "text.npz"
    text.write_text("not a model\n")
    bare = tmp_path / "bare.npy"
    np.save(bare, np.arange(3))
    for path, message in [
        (flipped, "Bad CRC-32"),  # the zip checksum sees it first (the sha256 below sees swaps)
        (truncated, "not an h5corpus n-gram model"),
        (foreign, "no header"),
        (text, "not an h5corpus n-gram model"),
        (bare, "bare .npy"),
        (tmp_path / "missing.npz", "not found"),
    ]:
        with pytest.raises(ModelFileError, match=message) as e:
            load_model(path)
        assert str(path) in str(e.value)
    # a header of another version, and one whose arrays were swapped for another model's
    other = train_ngram_model(DOCS[:2], order=2)
    model = load_model(good)
    model.header = {**model.header, "format_version": 99}
    model.save(tmp_path / "v99.npz")
    with pytest.raises(ModelFileError, match="format version 99"):
        read_model_header(tmp_path / "v99.npz")
    other.header = load_model(good).header
    other.save(tmp_path / "swapped.npz")
    with pytest.raises(ModelFileError, match="sha256"):
        load_model(tmp_path / "swapped.npz")


def test_directory_lookup_equals_searchsorted():
    from h5corpus.filters.perplexity import _Table

    rng = np.random.default_rng(3)
    for size in (1, 2, 3, 1000, 50_000):
        keys = np.unique(rng.integers(0, 2**63, size, dtype=np.uint64) * np.uint64(2))
        edges = np.array([0, 2**64 - 2], dtype=np.uint64)
        q = np.concatenate([keys, rng.integers(0, 2**63, 20_000, dtype=np.uint64) * np.uint64(2), edges])
        rng.shuffle(q)
        found, pos = _Table(keys).find(q)
        assert np.array_equal(pos, np.searchsorted(keys, q))
        assert np.array_equal(found, np.isin(q, keys))


def test_worst_fraction_drops_exactly_the_highest_scores_ties_by_position():
    s = np.array([5.0, 1.0, 9.0, 9.0, 2.0, 9.0, 3.0, 4.0, 8.0, 7.0])
    drop = worst_fraction(s, 0.2)
    assert drop.tolist() == [False, False, False, True, False, True, False, False, False, False]
    assert worst_fraction(s, 0.0).sum() == 0 and worst_fraction(s, 0.25).sum() == 3  # 2.5 -> 3
    assert worst_fraction([], 0.2).size == 0
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="fraction"):
            worst_fraction(s, bad)


# -- the filter stage -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stdlib_model(tmp_path_factory) -> Path:
    return train_ngram_model(stdlib_texts(limit=80), order=3).save(tmp_path_factory.mktemp("lm") / "stdlib.npz")


def test_filter_stage_scores_drops_counts_and_describes(stdlib_model, tmp_path):
    texts = stdlib_texts(limit=120)[80:] + spam_texts(["alpha", "beta"], n=8)
    model = load_model(stdlib_model)
    want = model.perplexities(texts)
    threshold = float(np.median(want))
    f = DocumentFilter(FilterConfig(perplexity_model=str(stdlib_model), max_perplexity=threshold))
    f.warm_up()
    assert f.stats() == {}
    res = f.process_batch(texts)
    for r, p in zip(res, want):
        assert r.info["perplexity"] == pytest.approx(p, rel=1e-9)
        assert (r.reason == "perplexity") == (p > threshold) and (r.text is None) == (p > threshold)
    st = f.stats()
    assert st["drop:perplexity"] == int((want > threshold).sum()) and st["kept"] == int((want <= threshold).sum())
    assert set(f.timings()) == {"perplexity"}
    d = f.describe()
    assert d["perplexity_model_sha256"] == model.sha256 and d["max_perplexity"] == threshold
    assert FilterConfig.from_json(d) == f.config
    # batching and pickling (a spawned worker loads the model itself) change nothing
    g = pickle.loads(pickle.dumps(f))
    one = [g.process_batch([t])[0] for t in texts]
    assert [r.info for r in one] == [r.info for r in res]
    # score only: no threshold, nothing dropped
    s = DocumentFilter(FilterConfig(perplexity_model=str(stdlib_model), perplexity_max_chars=300))
    out = s.process_batch(texts)
    assert all(r.text is not None for r in out)
    np.testing.assert_allclose([r.info["perplexity"] for r in out], model.perplexities([t[:300] for t in texts]))


def test_filter_stage_runs_after_quality_and_settings_without_it_are_unchanged(stdlib_model):
    f = DocumentFilter(FilterConfig(quality=True, perplexity_model=str(stdlib_model), max_perplexity=1e9))
    res = f.process_batch(["too short", DOCS[0]])
    assert res[0].reason == "quality:min_words" and "perplexity" not in res[0].info
    assert res[1].text is not None and res[1].info["perplexity"] > 1
    plain = FilterConfig(quality=True).to_json()
    assert not any(k.startswith("perplexity") or k == "max_perplexity" for k in plain)
    assert FilterConfig(perplexity_model=str(stdlib_model)).enabled


def test_filter_config_refuses_bad_perplexity_settings(stdlib_model, tmp_path):
    for kw, message in [
        ({"max_perplexity": 100.0}, "needs perplexity_model"),
        ({"perplexity_max_chars": 10}, "needs perplexity_model"),
        ({"perplexity_model": str(stdlib_model), "max_perplexity": 0.5}, "must be >= 1"),
        ({"perplexity_model": str(stdlib_model), "max_perplexity": float("nan")}, "must be >= 1"),
        ({"perplexity_model": str(stdlib_model), "perplexity_max_chars": 0}, "must be >= 1"),
        ({"perplexity_model": str(tmp_path / "none.npz")}, "not found"),
    ]:
        with pytest.raises(ValueError, match=message):
            DocumentFilter(FilterConfig(**kw))


def test_a_model_replaced_after_the_settings_were_made_is_refused(stdlib_model, tmp_path):
    path = tmp_path / "m.npz"
    path.write_bytes(stdlib_model.read_bytes())
    f = DocumentFilter(FilterConfig(perplexity_model=str(path)))
    train_ngram_model(DOCS, order=2).save(path)
    with pytest.raises(ModelFileError, match="the model changed"):
        f.process_batch(["some text"])


# -- CLI ------------------------------------------------------------------------------------------
def _cli(cwd: Path, *args: str, wait: bool = True):
    cmd = [sys.executable, "-m", "h5corpus", "quality-model", *args]
    if not wait:
        return subprocess.Popen(
            cmd, cwd=cwd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=300)


def test_cli_train_and_score_with_exit_codes(tmp_path):
    texts = stdlib_texts(limit=50)
    ref = write_jsonl(tmp_path / "ref.jsonl", texts[:40])
    probe = write_jsonl(tmp_path / "probe.jsonl", texts[40:] + [""])
    p = _cli(tmp_path, "train", str(ref), "-o", "out/m.npz", "--order", "2", "--max-documents", "30", "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["header"]["order"] == 2 and rep["header"]["training"]["documents"] == 30
    assert rep["header"]["training"]["sources"][0]["spec"] == str(ref)
    lib = train_ngram_model(texts[:30], order=2)
    assert rep["header"]["sha256"] == lib.sha256  # the same model as the library's, from the same texts
    p = _cli(tmp_path, "score", "out/m.npz", str(probe))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().split("\n")
    assert len(lines) == 12 and lines[0].startswith(f"{probe}#1\t") and "p80=" in lines[-1]
    got = [float(x.split("\t")[1]) for x in lines[:-1]]
    np.testing.assert_allclose(got, lib.perplexities(texts[40:] + [""]), rtol=1e-3)
    p = _cli(tmp_path, "score", "out/m.npz", str(probe), "--json", "--summary-only")
    assert p.returncode == 0 and json.loads(p.stdout)["documents"] == 11
    # usage errors and bad model files: 2; bad records: 1 (run side by side)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04 not really")
    cases = [
        (["train", "missing.jsonl", "-o", "x.npz"], 2, "no such file"),
        (["train", str(ref), "-o", "x.npz", "--order", "9"], 2, "--order"),
        (["train", "bad.jsonl", "-o", "x.npz"], 1, "bad.jsonl:2"),
        (["score", "none.npz", str(probe)], 2, "not found"),
        (["score", "corrupt.npz", str(probe)], 2, "corrupt.npz"),
        (["score", "out/m.npz", "bad.jsonl"], 1, "bad.jsonl:2"),
    ]
    procs = [_cli(tmp_path, *args, wait=False) for args, _, _ in cases]
    for (args, code, message), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == code, (args, out, err)
        assert message in err and "Traceback" not in err, (args, err)
    assert not (tmp_path / "x.npz").exists()


# -- the dev corpus: Wikipedia vs spam --------------------------------------------------------------
@pytest.fixture(scope="module")
def wiki_split(dev_dir):
    """(train, held aside) English Wikipedia articles of the dev corpus: every 10th held aside."""
    from tests.helpers import read_jsonl_texts

    wiki = read_jsonl_texts([dev_dir / "wiki-en-wikiextractor.jsonl"])
    return [t for i, t in enumerate(wiki) if i % 10], wiki[::10]


def test_wikipedia_model_ranks_held_aside_articles_far_better_than_spam(wiki_split):
    """Trained on 90% of the dev Wikipedia articles: held-aside articles score far lower than
    generated keyword lists, word salad of real Wikipedia words, boilerplate and machine noise."""
    train, held = wiki_split
    model = train_ngram_model(train, order=3)
    spam = spam_texts(" ".join(train).split(), n=80)
    pw, ps = model.perplexities(held), model.perplexities(spam)
    auc = float((ps[None, :] > pw[:, None]).mean())  # pairs ranked right
    assert auc >= 0.99, auc
    assert np.median(ps) >= 10 * np.median(pw), (np.median(ps), np.median(pw))
    for kind in range(4):  # every kind, even its best-looking document, above 90% of the articles
        assert ps[kind::4].min() > np.quantile(pw, 0.9), (kind, ps[kind::4].min(), np.quantile(pw, 0.9))
    # dropping the worst 20% of the mix drops 20% (one document either way), nearly all spam
    mixed = np.concatenate([pw, ps])
    drop = worst_fraction(mixed, 0.2)
    assert abs(int(drop.sum()) - 0.2 * mixed.size) <= 1
    assert drop[pw.size :].sum() >= 0.95 * drop.sum()
