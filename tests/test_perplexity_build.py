"""The perplexity filter in the build: ``--perplexity-model``, ``--max-perplexity``,
``--drop-worst-fraction``, the scores the read stage records, ``--perplexity-scores``, the
manifest's score distribution, ``--explain-drops`` and ``inspect``.

The core test builds standard-library text (plus spam written here and repeated documents) with the
offline ``bytes`` tokenizer; the expected drops are computed independently of the build: the model
scores every text, exact dedup is "first occurrence in input order", the rule drops the
``floor(0.2 n + 1/2)`` highest scores, later documents first among equal ones. The dev test builds
dev-corpus files with GPT-2 and near dedup; it skips without ../shared.
"""

from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from h5corpus.build import BuildConfig, build_corpus
from h5corpus.filters import DocumentFilter, FilterConfig
from h5corpus.filters.ngramtrain import train_ngram_model
from h5corpus.filters.perplexity import load_model
from h5corpus.storage import format as fmt
from tests.helpers import read_built, spam_texts, stdlib_texts, subprocess_env, write_jsonl

FRACTION = 0.2


def _build(src: list[Path], out: Path, model: Path, **kw) -> dict:
    """Build ``src`` into ``out`` with the worst-fraction rule; returns what the test compares."""
    tok = kw.pop("tokenizer", "bytes")
    filters = DocumentFilter(FilterConfig(perplexity_model=str(model), near_dedup=kw.pop("near_dedup", False)))
    cfg = BuildConfig(
        sources=[str(p) for p in src],
        tokenizer=tok,
        shards_dir=out / "shards",
        manifest=out / "manifest.json",
        filters=filters,
        drop_worst_fraction=FRACTION,
        perplexity_scores=out / "scores.tsv",
        explain_drops=out / "drops.jsonl",
        **kw,
    )
    build_corpus(cfg)
    m = json.loads((out / "manifest.json").read_text())
    shards = {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((out / "shards").rglob("*.h5"))
    }
    return {
        "shards": shards,
        "splits": m["splits"],
        "settings": m["build"]["settings"],
        "scores": (out / "scores.tsv").read_bytes(),
        "drops": (out / "drops.jsonl").read_bytes(),
    }


def _tsv(path_bytes: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(path_bytes.decode().splitlines(), delimiter="\t"))


def _drops(blob: bytes) -> list[dict]:
    return [json.loads(line) for line in blob.decode().splitlines()]


@pytest.fixture(scope="module")
def stdlib_case(tmp_path_factory):
    """A model trained on 80 stdlib files; a source of the other stdlib files, 20 spam documents
    and repeats of every 12th earlier document (exact duplicates in later tasks), in 3 files."""
    root = tmp_path_factory.mktemp("ppl-build")
    texts = stdlib_texts(limit=200)
    model = train_ngram_model(texts[:80], order=3).save(root / "lm.npz")
    docs = texts[80:200]
    assert len(docs) >= 60
    spam = spam_texts(" ".join(texts[:80]).split(), n=20)
    rest = spam[:10] + docs[::12] + spam[10:]  # docs[::12]: 10 repeats
    files = [
        write_jsonl(root / "in" / "a.jsonl", docs[:40]),
        write_jsonl(root / "in" / "b.jsonl", docs[40:]),
        write_jsonl(root / "in" / "c.jsonl", rest),
    ]
    return root, model, files, docs + rest, spam


def test_worst_fraction_drops_the_highest_scores_of_what_reaches_it_identically_for_any_worker_or_bucket_count(
    stdlib_case,
):
    root, model, files, all_texts, spam = stdlib_case
    small = {"task_bytes": 200_000, "validation_fraction": 0.1}
    one = _build(files, root / "w1", model, workers=1, **small)
    two = _build(files, root / "w2", model, workers=2, **small)
    buckets = _build(files, root / "b2", model, workers=2, decide_buckets=2, **small)
    assert one == two == buckets  # shards, manifest figures, scores file and drop list: bytes
    assert one["settings"]["drop_worst_fraction"] == FRACTION

    # the oracle: score every text with the model; first occurrences reach the rule
    scores = load_model(model).perplexities(all_texts)
    first: dict[bytes, int] = {}
    for i, t in enumerate(all_texts):
        first.setdefault(hashlib.sha256(t.encode()).digest(), i)
    reach = sorted(first.values())
    repeats = len(all_texts) - len(reach)
    assert repeats >= 5
    k = int(np.floor(FRACTION * len(reach) + 0.5))
    ranked = sorted(reach, key=lambda i: (scores[i], i))  # the last k: highest scores, later first
    want_dropped = {hashlib.sha256(all_texts[i].encode()).hexdigest() for i in ranked[len(ranked) - k :]}

    drops = _drops(one["drops"])
    worst = [d for d in drops if d["reason"] == "perplexity_worst"]
    assert {d["id"] for d in worst} == want_dropped
    assert abs(len(worst) - FRACTION * len(reach)) <= 1
    assert sum(d["reason"] == "exact_dup" for d in drops) == repeats
    assert sum(int(s["dropped"].get("perplexity_worst", 0)) for s in one["splits"].values()) == k
    spam_ids = {hashlib.sha256(t.encode()).hexdigest() for t in spam}
    assert len(spam_ids & want_dropped) >= 0.75 * len(spam_ids)  # most spam is among the worst (a code model)

    # the stored documents: the reaching ones minus the dropped, in input order per split
    built = read_built(root / "w1" / "manifest.json")
    stored = [i.hex() for s in fmt.SPLITS for i, _, _ in built[s]]
    want_stored = [hashlib.sha256(all_texts[i].encode()).hexdigest() for i in reach]
    want_stored = [i for i in want_stored if i not in want_dropped]
    assert sorted(stored) == sorted(want_stored) and len(stored) == len(set(stored))

    # the scores file: one row per document past the read stage (cross-task repeats included),
    # in input order, with the model's scores
    rows = _tsv(one["scores"])
    assert [r["id"] for r in rows] == [hashlib.sha256(t.encode()).hexdigest() for t in all_texts]
    reached = set(reach)
    for j, (r, want) in enumerate(zip(rows, scores)):
        assert float(r["perplexity"]) == pytest.approx(want, rel=1e-9)
        assert (r["stored"] == "1") == (j in reached and r["id"] not in want_dropped)
    by_id = {hashlib.sha256(t.encode()).hexdigest(): s for t, s in zip(all_texts, scores)}
    for d in worst:
        assert d["perplexity"] == pytest.approx(by_id[d["id"]], abs=1e-4)

    # the manifest: the distribution of what reached the rule, per split
    n_reached = sum(s["perplexity"]["documents"] for s in one["splits"].values())
    assert n_reached == len(reach)
    train = one["splits"]["train"]["perplexity"]
    assert sum(train["histogram"]["counts"].values()) == train["documents"]
    assert train["quantiles"]["p0"] <= train["quantiles"]["p50"] <= train["quantiles"]["p100"]


def test_max_perplexity_drops_in_the_read_stage_and_both_rules_combine(stdlib_case, tmp_path):
    root, model, files, all_texts, spam = stdlib_case
    scores = load_model(model).perplexities(all_texts)
    limit = float(np.quantile(scores, 0.9))
    cfg = BuildConfig(
        sources=[str(p) for p in files],
        tokenizer="bytes",
        shards_dir=tmp_path / "shards",
        manifest=tmp_path / "m.json",
        filters=DocumentFilter(FilterConfig(perplexity_model=str(model), max_perplexity=limit)),
        drop_worst_fraction=0.1,
        workers=1,
        task_bytes=200_000,
    )
    build_corpus(cfg)
    m = json.loads((tmp_path / "m.json").read_text())
    above = {hashlib.sha256(t.encode()).digest() for t, s in zip(all_texts, scores) if s > limit}
    dropped = {k: sum(int(s["dropped"].get(k, 0)) for s in m["splits"].values()) for k in ("perplexity",)}
    assert dropped["perplexity"] == sum(1 for s in scores if s > limit)  # every copy, in the read stage
    reach = len(set(hashlib.sha256(t.encode()).digest() for t in all_texts) - above)
    worst = sum(int(s["dropped"].get("perplexity_worst", 0)) for s in m["splits"].values())
    assert worst == int(np.floor(0.1 * reach + 0.5))


def _cli(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "h5corpus", *args],
        cwd=cwd,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cli_flags_usage_errors_and_inspect(stdlib_case, tmp_path):
    root, model, files, _, _ = stdlib_case
    src = [str(p) for p in files]
    bad = [
        (["--perplexity-model", str(model), "--drop-worst-fraction", "1"], "drop_worst_fraction must be in [0, 1)"),
        (["--perplexity-model", str(model), "--drop-worst-fraction", "-0.1"], "must be in [0, 1)"),
        (["--drop-worst-fraction", "0.2"], "needs a perplexity model"),
        (["--max-perplexity", "100"], "--max-perplexity needs --perplexity-model"),
        (["--perplexity-scores", "s.tsv"], "needs a perplexity model"),
        (["--perplexity-model", str(tmp_path / "missing.npz")], "missing.npz"),
        (["--perplexity-model", str(model), "--max-perplexity", "0.5"], "must be >= 1"),
        (["--perplexity-max-chars", "100"], "--perplexity-max-chars needs --perplexity-model"),
        (["--perplexity-model", str(model), "--perplexity-max-chars", "0"], "perplexity_max_chars = 0: must be >= 1"),
    ]
    procs = [
        _cli(tmp_path, "build", *src, "-t", "bytes", "--shards-dir", f"bad{i}", *a) for i, (a, _) in enumerate(bad)
    ]
    good = _cli(
        tmp_path,
        "build",
        *src,
        "-t",
        "bytes",
        "--task-bytes",
        "200000",
        "--perplexity-model",
        str(model),
        "--drop-worst-fraction",
        "0.2",
        "--perplexity-scores",
        "scores.tsv",
        "--json",
    )
    for (args, message), proc in zip(bad, procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (args, out, err)
        assert message in err and "Traceback" not in err, (args, err)
    out, err = good.communicate(timeout=600)
    assert good.returncode == 0, err
    report = json.loads(out)
    k = sum(int(s["dropped"].get("perplexity_worst", 0)) for s in report["splits"].values())
    assert k > 0 and (tmp_path / "scores.tsv").is_file()
    made = [p for i in range(len(bad)) for p in (tmp_path / f"bad{i}").rglob("*.h5")]
    assert not made, made
    insp = subprocess.run(
        [sys.executable, "-m", "h5corpus", "inspect", "manifests/shards.json", "--plot", "p.png"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert insp.returncode == 0, insp.stderr
    m = json.loads((tmp_path / "manifests" / "shards.json").read_text())
    q = m["splits"]["train"]["perplexity"]["quantiles"]
    assert f"p50 {q['p50']:,.1f}" in insp.stdout and "scored documents" in insp.stdout
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_cli_perplexity_max_chars_scores_only_the_start_of_each_document(stdlib_case, tmp_path):
    """A document that starts like the reference and ends in spam: scored on its first N characters
    (the model on ``text[:N]``, computed here) it gets the prefix's perplexity, far below the whole
    document's."""
    root, model, files, texts, spam = stdlib_case
    n = 400
    mixed = [t[:n] + " " + s for t, s in zip(texts[:5], spam[:5])]
    src = write_jsonl(tmp_path / "mixed.jsonl", mixed)
    proc = _cli(
        tmp_path, "build", str(src), "-t", "bytes", "--perplexity-model", str(model),
        "--perplexity-max-chars", str(n), "--perplexity-scores", "scores.tsv", "--json",
    )  # fmt: skip
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    settings = json.loads((tmp_path / "manifests" / "shards.json").read_text())["build"]["settings"]
    assert settings["filters"]["perplexity_max_chars"] == n
    lm = load_model(model)
    want = {hashlib.sha256(t.encode()).hexdigest(): p for t, p in zip(mixed, lm.perplexities([t[:n] for t in mixed]))}
    whole = lm.perplexities(mixed)
    rows = _tsv((tmp_path / "scores.tsv").read_bytes())
    assert len(rows) == len(mixed)
    for row in rows:
        assert float(row["perplexity"]) == pytest.approx(want[row["id"]], rel=1e-6)
    assert np.all(np.array(sorted(want.values())) < np.array(sorted(whole)))


def test_dev_corpus_near_dedup_then_worst_fraction_identical_for_1_and_2_workers_and_2_buckets(
    dev_dir, gpt2_json, tmp_path
):
    """Wikipedia-trained model; English Wikipedia, two web samples and generated spam, with near
    dedup: 20% (one either way) of what survives the filters and both dedup stages is dropped,
    nearly all the spam among it, the same bytes for 1 and 2 workers and 2 decide buckets."""
    from tests.helpers import read_jsonl_texts

    wiki = read_jsonl_texts([dev_dir / "wiki-en-wikiextractor.jsonl"])
    model = train_ngram_model(wiki[1::2], order=3).save(tmp_path / "wiki.npz")
    spam = spam_texts(" ".join(wiki[1::2]).split(), n=40)
    src = [
        write_jsonl(tmp_path / "in" / "wiki-held.jsonl", wiki[::2]),
        dev_dir / "web-cc-dolma-c4-samples.jsonl",
        dev_dir / "web-cc-dclm-annotated.jsonl",
        write_jsonl(tmp_path / "in" / "spam.jsonl", spam),
    ]
    kw = {"tokenizer": str(gpt2_json), "near_dedup": True, "task_bytes": 600_000}
    one = _build(src, tmp_path / "w1", model, workers=1, **kw)
    two = _build(src, tmp_path / "w2", model, workers=2, **kw)
    buckets = _build(src, tmp_path / "b2", model, workers=2, decide_buckets=2, **kw)
    assert one == two == buckets
    drops = _drops(one["drops"])
    worst = {d["id"] for d in drops if d["reason"] == "perplexity_worst"}
    near = sum(d["reason"] == "near_dup" for d in drops)
    rows = _tsv(one["scores"])
    stored = sum(r["stored"] == "1" for r in rows)
    reached = sum(s["perplexity"]["documents"] for s in one["splits"].values())
    assert reached == stored + len(worst)  # no budgets: what reaches the rule is stored or dropped by it
    assert reached <= len(rows) - near
    assert abs(len(worst) - FRACTION * reached) <= 1
    deduped = {d["id"] for d in drops if d["reason"] in ("near_dup", "exact_dup")}
    spam_ids = {hashlib.sha256(t.encode()).hexdigest() for t in spam} - deduped  # boilerplate repeats itself
    # web text scores high under a Wikipedia model too: a few spam documents are not in the worst 20%
    assert len(spam_ids) >= 20 and len(spam_ids & worst) >= 0.9 * len(spam_ids)
    score = {r["id"]: float(r["perplexity"]) for r in rows}
    kept_max = max(score[r["id"]] for r in rows if r["stored"] == "1")
    assert min(score[i] for i in worst) >= kept_max  # the dropped ones score worst of all that reached it


def test_stage_commands_decide_the_worst_fraction_as_the_local_build_does(stdlib_case, tmp_path):
    """The Slurm executor's plan (a dry run: nothing is submitted), then every stage command run
    here as a scheduler would: the same shards, scores file and drop list as the local build."""
    from h5corpus.build.config import SlurmOptions
    from h5corpus.build.stages.dispatch import main_stage

    root, model, files, _, _ = stdlib_case
    small = {"task_bytes": 200_000, "validation_fraction": 0.1}
    want = _build(files, tmp_path / "local", model, workers=1, **small)
    got_dir = tmp_path / "stages"
    cfg = BuildConfig(
        sources=[str(p) for p in files],
        tokenizer="bytes",
        shards_dir=got_dir / "shards",
        manifest=got_dir / "manifest.json",
        filters=DocumentFilter(FilterConfig(perplexity_model=str(model))),
        drop_worst_fraction=FRACTION,
        perplexity_scores=got_dir / "scores.tsv",
        explain_drops=got_dir / "drops.jsonl",
        executor="slurm",
        decide_buckets=2,
        slurm=SlurmOptions(dry_run=True),
        **small,
    )
    build_corpus(cfg)
    state = got_dir / "shards" / ".build"
    assert not (got_dir / "manifest.json").exists()
    plan = json.loads((state / "plan.json").read_text())
    tasks = len(plan["tasks"])
    assert tasks >= 3 and plan["drop_worst_fraction"] == FRACTION and plan["record_perplexity"]
    for i in reversed(range(tasks)):
        main_stage("read", state, i)
    for b in (1, 0):
        main_stage("bucket", state, b)
    main_stage("decide", state, None)
    for i in range(tasks):
        main_stage("finish", state, i)
    main_stage("commit", state, None)
    assert not state.exists()
    m = json.loads((got_dir / "manifest.json").read_text())
    shards = {
        p.relative_to(got_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((got_dir / "shards").rglob("*.h5"))
    }
    assert shards == want["shards"] and m["splits"] == want["splits"]
    assert (got_dir / "scores.tsv").read_bytes() == want["scores"]
    assert (got_dir / "drops.jsonl").read_bytes() == want["drops"]
