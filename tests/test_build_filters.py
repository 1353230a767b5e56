"""`h5corpus build` with the filter stages: cleaning, language ID, quality, PII, near-dedup
wired into the real build, the manifest's per-rule counts, `--explain-drops`, the summary, the CLI
flags, determinism across worker counts and crash + resume.

Core tests build standard-library text plus documents written here (an HTML page, PII, paragraphs
in three languages) with the offline `bytes` tokenizer. Dev tests build dev-corpus files plus a
crafted extras file with GPT-2 and decode the stored tokens; they skip without ../shared.

The expected stored documents are computed independently of the build (`expected_ids`): the filter
library document by document, then exact dedup (first occurrence), then the near-duplicate index,
all in input order.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

for _mod in ("py3langid", "trafilatura", "ftfy", "rensa", "scipy"):
    pytest.importorskip(_mod)

from h5corpus.build import BuildConfig, build_corpus, document_split, filtered_total, format_report  # noqa: E402
from h5corpus.filters import DocumentFilter, FilterConfig  # noqa: E402
from h5corpus.storage import format as fmt  # noqa: E402
from tests.helpers import (  # noqa: E402
    read_built,
    read_stage_files,
    run_read_stage,
    subprocess_env,
    tree,
    without_timings,
    write_jsonl,
)

# ------------------------------------------------------------------------------------------------
# Documents written for these tests.

ARTICLE = [
    "The regional water authority announced on Monday that the reservoir above Millbrook has reached "
    "its lowest level in thirty years, and asked residents of the valley to cut their daily use by a "
    "fifth until the autumn rains arrive.",
    "Engineers said the dry winter and an unusually warm spring left the inflow from the mountain "
    "streams at less than half of its average. The authority will reduce the pressure in the network "
    "at night and has postponed the refilling of public swimming pools across the district.",
    "Farmers in the lower valley, who depend on the reservoir for irrigation, will receive their "
    "allocations on alternate weeks. Several growers told the council that they had already switched "
    "to drip irrigation and planted crops that need less water, but warned that another dry year "
    "would force some families to sell their land.",
    "The authority also plans to repair leaking pipes in the older neighbourhoods, where inspectors "
    "estimate that one litre in six is lost before it reaches a tap. Work on the first section of "
    "the network is expected to begin next month and to last until the end of the year.",
    "Residents can follow the level of the reservoir on a public board outside the town hall, which "
    "is updated every morning, and the authority will publish a weekly report on its progress.",
]

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <meta name="viewport" content="width=device-width, initial-scale=1">
  <title>Millbrook Reservoir at Lowest Level in Thirty Years | Valley Courier</title>
  <link rel="stylesheet" href="/assets/main.css">
  <script async src="https://www.googletagmanager.com/gtag/js?id=G-XXXX"></script>
  <script>window.dataLayer = window.dataLayer || []; function gtag(){dataLayer.push(arguments);} gtag('js', new Date());</script>
</head>
<body class="article-page">
  <header class="masthead">
    <a class="brand" href="/">Valley Courier</a>
    <nav aria-label="Main"><ul>
      <li><a href="/local">Local</a></li><li><a href="/business">Business</a></li>
      <li><a href="/sport">Sport</a></li><li><a href="/weather">Weather</a></li>
      <li><a class="cta" href="/subscribe">Subscribe for one dollar a week</a></li>
    </ul></nav>
  </header>
  <div id="consent" class="cookie-consent">This site uses cookies to personalise content. <button>Accept cookies</button></div>
  <main id="content">
    <article>
      <h1>Millbrook Reservoir at Lowest Level in Thirty Years</h1>
      <p class="byline">By Jonas Whitfield, environment correspondent</p>
%s
    </article>
    <section class="newsletter"><h2>Sign up for our morning newsletter</h2><form><input type="email"><button>Sign up</button></form></section>
  </main>
  <aside class="trending"><h3>Trending now</h3>
    <ol><li><a href="/x">Ten hikes for the long weekend</a></li><li><a href="/y">Derby ends in late drama</a></li></ol>
  </aside>
  <footer class="site-footer">
    <p>Copyright 2025 Valley Courier Media Group. All rights reserved.</p>
    <p><a href="/privacy">Privacy policy</a> | <a href="/terms">Terms and conditions</a> | <a href="/contact">Contact the newsroom</a></p>
  </footer>
</body>
</html>
""" % "\n".join(f"      <p>{p}</p>" for p in ARTICLE)

PAGE_JUNK = (
    "Subscribe for one dollar",
    "cookies",
    "Trending now",
    "All rights reserved",
    "Privacy policy",
    "dataLayer",
    "Sign up for our morning newsletter",
    "Derby ends",
)

PII_DOC = (
    "For questions about the spring registration, write to the club secretary at anna.kovacs@example.org "
    "or to the treasurer, m.okoye@mail.example.co.uk. You can also call the office on (555) 212-4477 "
    "during opening hours, or dial +44 20 7946 0958 from abroad. Members who host the online scoreboard "
    "should point it at the new server 203.0.113.42; the old address 198.51.100.7 will be switched off "
    "at the end of the month. Version 10.0.0.1 of the app and the meeting on 2023-10-12 are not affected."
)
PII_SECRETS = (
    "anna.kovacs@example.org",
    "m.okoye@mail.example.co.uk",
    "(555) 212-4477",
    "+44 20 7946 0958",
    "203.0.113.42",
    "198.51.100.7",
)

LANG_PARAS = {
    "en": "The committee met on Thursday to discuss the new bridge over the river. Most members agreed that "
    "the old bridge is no longer safe for heavy traffic and should be replaced within two years.",
    "de": "Der Ausschuss traf sich am Donnerstag, um die neue Brücke über den Fluss zu besprechen. Die meisten "
    "Mitglieder waren sich einig, dass die alte Brücke für den Schwerverkehr nicht mehr sicher ist.",
    "fr": "Le comité s'est réuni jeudi pour discuter du nouveau pont sur la rivière. La plupart des membres "
    "ont convenu que l'ancien pont n'est plus sûr pour les poids lourds et doit être remplacé.",
    "de_long": "Die Stadtverwaltung hat am Montag einen Plan für den Ausbau der Radwege vorgestellt. Bis zum "
    "Ende des kommenden Jahres sollen entlang der Hauptstraße getrennte Spuren entstehen, damit "
    "Schulkinder und Pendler sicherer unterwegs sind. Die Kosten werden auf rund zwei Millionen "
    "Euro geschätzt; einen Teil davon übernimmt das Land. Anwohner können ihre Vorschläge bis "
    "Ende des Monats im Rathaus einreichen oder an einer öffentlichen Versammlung teilnehmen.",
}

BOILERPLATE = [
    (
        "Home | News | Opinion | Sport | Subscribe\nAdvertisement\n",
        "\nShare this article: Facebook Twitter Email\n(c) 2025 Daily Herald. All rights reserved.",
    ),
    (
        "MENU  Sign in  Newsletters  Today's paper\n",
        "\nRelated stories\nMore from this section\nCookie settings | Privacy | Terms",
    ),
    (
        "Skip to content\nBreaking news alerts: sign up now\n",
        "\nComments are closed.\nPosted in Local News | Tagged water, council",
    ),
]


def with_boilerplate(text: str, k: int) -> str:
    head, tail = BOILERPLATE[k % len(BOILERPLATE)]
    return head + text + tail


def sha_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_texts(paths) -> list[str]:
    """Every document of the sources, in input order (files in the given order, lines in order)."""
    return [json.loads(line)["text"] for p in paths for line in open(p, encoding="utf-8") if line.strip()]


def expected_ids(texts: list[str], cfg: FilterConfig, seed: int = 20261003, fraction: float = 0.05) -> dict:
    """What the build must store and drop, computed the obvious way: per-document filter results,
    exact dedup (first occurrence), then the near-duplicate index, in input order."""
    f = DocumentFilter(cfg)
    index = f.near_duplicate_index()
    out: dict = {"stored": {s: [] for s in fmt.SPLITS}, "reasons": {}, "texts": {}}
    seen: set[str] = set()
    for raw, r in zip(texts, f.process_batch(texts, signatures=True)):
        if r.text is None:
            out["reasons"].setdefault(sha_hex(raw), r.reason)
            continue
        i = sha_hex(r.text)
        if i in seen:
            out["reasons"].setdefault(sha_hex(raw), "exact_dup")
            continue
        seen.add(i)
        if index is not None and index.add(r.signature):
            out["reasons"].setdefault(sha_hex(raw), "near_dup")
            continue
        split = document_split(bytes.fromhex(i), seed=seed, validation_fraction=fraction)
        out["stored"][split].append(i)
        out["texts"][i] = r.text
    return out


def stored_ids(manifest: Path) -> dict[str, list[str]]:
    return {s: [d[0].hex() for d in docs] for s, docs in read_built(manifest).items()}


def stored_tokens(manifest: Path) -> dict[str, np.ndarray]:
    return {d[0].hex(): d[1] for docs in read_built(manifest).values() for d in docs}


def explain_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def check_explain_locations(lines: list[dict], base: Path | None = None) -> None:
    """Every explain line names a source file and line whose text hashes to its id."""
    cache: dict[str, list[str]] = {}
    for d in lines:
        src = Path(d["source"]) if base is None else base / d["source"]
        if d["source"] not in cache:
            cache[d["source"]] = src.read_text(encoding="utf-8").split("\n")
        raw = json.loads(cache[d["source"]][d["line"] - 1])["text"]
        assert sha_hex(raw) == d["id"], d


def cfg_for(root: Path, sources, filters, **kw) -> BuildConfig:
    kw.setdefault("tokenizer", "bytes")
    kw.setdefault("workers", 2)
    kw.setdefault("task_bytes", 200_000)
    kw.setdefault("chunk_tokens", 1 << 14)
    kw.setdefault("shard_tokens", 1 << 20)
    kw.setdefault("explain_drops", root / "drops.jsonl")
    return BuildConfig(
        sources=[str(s) for s in sources],
        shards_dir=root / "shards",
        manifest=root / "manifests" / "shards.json",
        filters=filters,
        **kw,
    )


# ------------------------------------------------------------------------------------------------
# Core: stdlib text + crafted documents, bytes tokenizer, no ../shared needed.

CORE_CFG = FilterConfig(clean=True, scrub_pii=True, near_dedup=True)


@pytest.fixture(scope="module")
def core_inputs(tmp_path_factory, stdlib_corpus_texts) -> dict:
    """a.jsonl: 60 stdlib modules, the HTML page, the PII document; b.jsonl: two copies of two long
    modules with different boilerplate around them (~95% identical), an exact copy of a module and
    an exact copy of the HTML page (its cleaned text equals the first's)."""
    t = stdlib_corpus_texts
    d = tmp_path_factory.mktemp("core-filter-in")
    base = [x for x in t[:60] if 2000 < len(x.split()) < 6000][:2]
    assert len(base) == 2
    crafted = []
    for k, x in enumerate(base):
        for v in range(2):
            c = with_boilerplate(x, k + v)
            assert len(c.split()) <= 1.05 * len(x.split())
            crafted.append(c)
    a = write_jsonl(d / "a.jsonl", list(t[:60]) + [PAGE, PII_DOC])
    b = write_jsonl(d / "b.jsonl", [crafted[0], t[7], crafted[1], PAGE, crafted[2], crafted[3]])
    return {"sources": [a, b], "crafted": crafted, "base": base, "copy": t[7]}


@pytest.fixture(scope="module")
def core_build(tmp_path_factory, core_inputs):
    root = tmp_path_factory.mktemp("core-filter-2w")
    rep = build_corpus(cfg_for(root, core_inputs["sources"], DocumentFilter(CORE_CFG)))
    return root, rep


def test_core_near_and_exact_duplicates_stored_and_explained(core_build, core_inputs):
    """Crafted copies with other boilerplate are dropped as near_dup (the originals stay), an exact
    copy is dropped by the exact stage first (exact_dup, naming the stored copy), every distinct
    module is stored: the stored ids equal the independent expectation, per split and in order."""
    root, rep = core_build
    texts = read_texts(core_inputs["sources"])
    ex = expected_ids(texts, CORE_CFG)
    assert stored_ids(root / "manifests" / "shards.json") == ex["stored"]
    lines = explain_lines(root / "drops.jsonl")
    by_id = {d["id"]: d for d in lines}
    for c in core_inputs["crafted"]:
        assert by_id[sha_hex(c)]["reason"] == "near_dup"
    for x in core_inputs["base"]:
        assert sha_hex(x) not in by_id and sha_hex(x) in ex["texts"]
    copy = by_id[sha_hex(core_inputs["copy"])]
    stored_copy = DocumentFilter(CORE_CFG).process(core_inputs["copy"])[0]  # as stored (PII scrubbed)
    assert copy["reason"] == "exact_dup" and copy["duplicate_of"] == sha_hex(stored_copy)
    assert sha_hex(stored_copy) in ex["texts"]
    page_copy = [d for d in lines if d["id"] == sha_hex(PAGE)]
    assert len(page_copy) == 1 and page_copy[0]["source"].endswith("b.jsonl") and page_copy[0]["line"] == 4
    assert {d["id"]: d["reason"] for d in lines} == ex["reasons"]
    # input order: a.jsonl before b.jsonl, lines ascending
    assert [(d["source"], d["line"]) for d in lines] == sorted((d["source"], d["line"]) for d in lines)
    check_explain_locations(lines)
    m = json.loads((root / "manifests" / "shards.json").read_text())
    total = {}
    for s in fmt.SPLITS:
        for k, v in m["splits"][s]["dropped"].items():
            total[k] = total.get(k, 0) + v
        assert m["splits"][s]["dropped"].get("near_dup", 0) == m["splits"][s]["near_duplicates"]
        assert m["splits"][s]["dropped"].get("exact_dup", 0) == m["splits"][s]["duplicates"]
    assert total == {"near_dup": 4, "exact_dup": 2} == rep.dropped()
    assert rep.explained == len(lines) == 6


def test_core_html_and_pii_become_the_stored_tokens(core_build, core_inputs):
    """The HTML page is stored as its article text (bytes tokenizer: the stored ids are the UTF-8
    bytes), without navigation, banner, sidebar or footer; PII is replaced by placeholders; the
    summary and manifest count what the stages changed."""
    root, rep = core_build
    toks = stored_tokens(root / "manifests" / "shards.json")
    f = DocumentFilter(CORE_CFG)
    page_text, _ = f.process(PAGE)
    stored = bytes(toks[sha_hex(page_text)][:-1].astype(np.uint8)).decode("utf-8")
    assert stored == page_text
    assert all(p in stored for p in ARTICLE) and "Millbrook Reservoir at Lowest Level" in stored
    assert not any(j in stored for j in PAGE_JUNK) and "<p>" not in stored
    pii_text, _ = f.process(PII_DOC)
    stored = bytes(toks[sha_hex(pii_text)][:-1].astype(np.uint8)).decode("utf-8")
    assert not any(s in stored for s in PII_SECRETS)
    assert stored.count("<EMAIL>") == 2 and stored.count("<PHONE>") == 2 and stored.count("<IP>") == 2
    assert "10.0.0.1" in stored and "2023-10-12" in stored
    # the merged counters equal one filter's counters over the whole input
    f_all = DocumentFilter(CORE_CFG)
    f_all.process_batch(read_texts(core_inputs["sources"]))
    want = f_all.stats()
    m = json.loads((root / "manifests" / "shards.json").read_text())
    assert m["filters"]["counters"] == want == rep.filter_counters
    assert want["clean:html"] == 2 and want["pii:email"] >= 2 and want["pii:ip"] >= 2
    assert m["filters"]["settings"]["clean"] and m["filters"]["settings"]["near_dedup"]
    assert m["build"]["settings"]["filters"] == m["filters"]["settings"]
    summary = rep.filter_summary()
    assert summary["changed"] == {"html_extracted": 2, "pii_scrubbed": want["pii:docs"]}
    assert summary["pii"] == {k: want[f"pii:{k}"] for k in ("email", "ip", "phone") if want.get(f"pii:{k}")}
    text = format_report(rep)
    assert "html extracted 2" in text and f"email {want['pii:email']}" in text
    assert "explained 6 dropped documents" in text


def test_core_one_and_two_workers_identical(tmp_path, core_build, core_inputs):
    """Manifest, shards and the explain file are byte-identical for 1 and 2 workers."""
    root2, _ = core_build
    build_corpus(cfg_for(tmp_path, core_inputs["sources"], DocumentFilter(CORE_CFG), workers=1))
    assert tree(tmp_path) == tree(root2)


def test_core_language_and_quality_drops_are_counted_and_explained(tmp_path, stdlib_corpus_texts):
    """--lang de keeps the German paragraph and drops English/French (reason lang:<code>, the
    detected language and probability in the explain line); --quality-filter drops short texts
    (quality:min_words). Per-rule counts in splits.<split>.dropped; the manifest counts stored
    documents per detected language."""
    src = write_jsonl(
        tmp_path / "in.jsonl", [LANG_PARAS["en"], LANG_PARAS["de"], LANG_PARAS["fr"], LANG_PARAS["de_long"]]
    )
    cfg = FilterConfig(lang=("de",), quality=True)
    cfg.quality_thresholds.min_words = 40
    rep = build_corpus(cfg_for(tmp_path, [src], DocumentFilter(cfg), validation_fraction=0.0))
    lines = explain_lines(tmp_path / "drops.jsonl")
    assert [(d["line"], d["reason"]) for d in lines] == [(1, "lang:en"), (2, "quality:min_words"), (3, "lang:fr")]
    assert lines[0]["lang"] == "en" and lines[0]["lang_prob"] > 0.5 and lines[1]["lang"] == "de"
    m = json.loads((tmp_path / "manifests" / "shards.json").read_text())
    tr = m["splits"]["train"]
    assert tr["dropped"] == {"lang:en": 1, "lang:fr": 1, "quality:min_words": 1}
    assert filtered_total(tr) == 3 and tr["documents"] == 1 and tr["languages"] == {"de": 1}
    assert m["splits"]["validation"]["languages"] == {}
    assert rep.filter_summary()["languages"] == {"de": 1}
    assert "quality:min_words 1" in format_report(rep) and "languages stored: de 1" in format_report(rep)


def test_near_dedup_off_computes_no_signatures(tmp_path, stdlib_corpus_texts):
    """near_duplicate_index() is None when near-dedup is off, and the build then asks for no
    signature (a filter whose signature() raises builds fine)."""

    class NoSignatures(DocumentFilter):
        def signature(self, text):
            raise AssertionError("signature computed with near-dedup off")

    f = NoSignatures(FilterConfig(quality=True))
    assert f.near_duplicate_index() is None
    assert DocumentFilter(FilterConfig(near_dedup=True)).near_duplicate_index() is not None
    src = write_jsonl(tmp_path / "in.jsonl", stdlib_corpus_texts[:30])
    rep = build_corpus(cfg_for(tmp_path, [src], f, explain_drops=None))
    assert rep.documents > 0 and all(s["near_duplicates"] == 0 for s in rep.splits.values())


# -- CLI ------------------------------------------------------------------------------------------
def _cli(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "h5corpus", "build", *args],
        cwd=cwd,
        env=env or subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_filter_flags_end_to_end(tmp_path, core_inputs):
    """Every filter flag through `python -m h5corpus build`: the settings land in the manifest,
    --near-dedup-threshold implies --near-dedup, the JSON report carries per-rule drops and changes,
    --explain-drops writes the file; bad values exit 2."""
    srcs = [str(s) for s in core_inputs["sources"]]
    p = _cli(
        tmp_path,
        *srcs,
        "--tokenizer",
        "bytes",
        "--workers",
        "2",
        "--clean",
        "--fix-unicode",
        "--normalize-whitespace",
        "--quality-filter",
        "--lang",
        "en,de",
        "--lang-threshold",
        "0.3",
        "--scrub-pii",
        "--near-dedup-threshold",
        "0.7",
        "--explain-drops",
        "out/drops.jsonl",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    m = json.loads((tmp_path / "manifests" / "shards.json").read_text())
    st = m["filters"]["settings"]
    assert (st["clean"], st["fix_unicode"], st["normalize_whitespace"], st["quality"], st["scrub_pii"]) == (True,) * 5
    assert st["lang"] == ["en", "de"] and st["lang_threshold"] == 0.3
    assert st["near_dedup"] is True and st["near_dedup_threshold"] == 0.7
    assert out["filters"]["dropped"]["exact_dup"] >= 1 and any(
        k.startswith("quality:") for k in out["filters"]["dropped"]
    )
    assert out["filters"]["changed"]["html_extracted"] == 2 and out["filters"]["changed"]["whitespace_normalized"] > 0
    assert sum(out["filters"]["dropped"].values()) + out["documents"] == len(read_texts(srcs))
    assert out["explain_drops"] == "out/drops.jsonl"
    lines = explain_lines(tmp_path / "out" / "drops.jsonl")
    assert len(lines) == out["explained"] == sum(out["filters"]["dropped"].values())
    # re-running a finished build cannot write the drop list: refused, exit 2
    p = _cli(
        tmp_path,
        *srcs,
        "--tokenizer",
        "bytes",
        "--clean",
        "--fix-unicode",
        "--normalize-whitespace",
        "--quality-filter",
        "--lang",
        "en,de",
        "--lang-threshold",
        "0.3",
        "--scrub-pii",
        "--near-dedup-threshold",
        "0.7",
        "--explain-drops",
        "out/drops.jsonl",
    )
    assert p.returncode == 2 and "--overwrite" in p.stderr
    for bad in (
        ["--lang", "xx-klingon"],
        ["--lang-threshold", "0.5"],
        ["--near-dedup-threshold", "1.5"],
        ["--lang", "en", "--lang-threshold", "2"],
    ):
        p = _cli(tmp_path, srcs[0], "--tokenizer", "bytes", "--overwrite", *bad)
        assert p.returncode == 2, (bad, p.stderr)


def test_cli_without_filter_flags_is_the_filter_free_build(tmp_path, core_inputs):
    """With every filter flag off the CLI passes no filters: the output equals the library build
    with filters=None byte for byte, and the manifest has no top-level filters key."""
    srcs = [str(s) for s in core_inputs["sources"]]
    (tmp_path / "cli").mkdir()
    p = _cli(tmp_path / "cli", *srcs, "--tokenizer", "bytes")
    assert p.returncode == 0, p.stderr
    build_corpus(
        BuildConfig(
            sources=srcs,
            tokenizer="bytes",
            shards_dir=tmp_path / "api" / "shards",
            manifest=tmp_path / "api" / "manifests" / "shards.json",
        )
    )
    assert tree(tmp_path / "cli") == tree(tmp_path / "api")
    m = json.loads((tmp_path / "api" / "manifests" / "shards.json").read_text())
    assert "filters" not in m and m["build"]["settings"]["filters"] is None
    assert m["splits"]["train"]["dropped"] == {"exact_dup": m["splits"]["train"]["duplicates"]}


def test_cli_kill_at_every_stage_then_resume_gives_identical_output_and_drop_list(tmp_path, core_inputs):
    """SIGKILL the filtered build at stage boundaries (H5CORPUS_TEST_CRASH_AT), re-run the same
    command: shards, manifest and explain file equal an uninterrupted run, nothing left over."""
    from h5corpus.build.run.executor import CRASH_ENV

    srcs = [str(s) for s in core_inputs["sources"]]
    flags = [
        "--tokenizer",
        "bytes",
        "--workers",
        "2",
        "--clean",
        "--scrub-pii",
        "--near-dedup",
        "--explain-drops",
        "drops.jsonl",
    ]
    (tmp_path / "ref").mkdir()
    assert _cli(tmp_path / "ref", *srcs, *flags).returncode == 0
    ref = tree(tmp_path / "ref")
    root = tmp_path / "c"
    for point in ("read-record", "decided", "manifest-before", "manifest-after"):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        p = _cli(root, *srcs, *flags, env=dict(subprocess_env(), **{CRASH_ENV: point}))
        assert p.returncode == -9, (point, p.returncode, p.stderr[-2000:])
        p = _cli(root, *srcs, *flags)
        assert p.returncode == 0, (point, p.stderr)
        assert tree(root) == ref, point
        assert not list(root.rglob("*.tmp*")), point


def test_resume_of_a_run_without_explain_rereads_tasks_for_the_drop_list(tmp_path, core_inputs):
    """A build interrupted without --explain-drops and resumed with it re-reads the tasks whose
    records lack locations: the drop list equals a fresh run's."""
    from h5corpus.build.run.executor import CRASH_ENV

    srcs = [str(s) for s in core_inputs["sources"]]
    flags = ["--tokenizer", "bytes", "--workers", "2", "--clean", "--near-dedup"]
    (tmp_path / "ref").mkdir()
    assert _cli(tmp_path / "ref", *srcs, *flags, "--explain-drops", "drops.jsonl").returncode == 0
    (tmp_path / "c").mkdir()
    p = _cli(tmp_path / "c", *srcs, *flags, env=dict(subprocess_env(), **{CRASH_ENV: "decided"}))
    assert p.returncode == -9
    assert _cli(tmp_path / "c", *srcs, *flags, "--explain-drops", "drops.jsonl").returncode == 0
    assert tree(tmp_path / "c") == tree(tmp_path / "ref")


def test_filtered_stages_run_from_the_state_folder_alone(tmp_path, core_inputs):
    """The plan seam with the filters: a near-dedup + explain build killed after a read record;
    a fresh interpreter with only the state folder rebuilds the DocumentFilter from the plan and
    reruns that read task (same record, table, .npy signatures, meta, candidates). Killed again
    just before its manifest: the decide stage folded over every task at once, from the state
    folder, gives the run's decisions and exactly the drop list it published."""
    from h5corpus.build.run.executor import CRASH_ENV
    from h5corpus.build.stages.buildplan import StageContext
    from h5corpus.build.stages.decide import DecideInput, Decider, decide

    srcs = [str(s) for s in core_inputs["sources"]]
    flags = ["--tokenizer", "bytes", "--workers", "2", "--clean", "--near-dedup", "--explain-drops", "drops.jsonl"]
    root = tmp_path / "a"
    root.mkdir()
    assert _cli(root, *srcs, *flags, env=dict(subprocess_env(), **{CRASH_ENV: "read-record"})).returncode == -9
    state = root / "shards" / ".build"
    index = int(sorted((state / "read").glob("*.json"))[0].stem)
    before = read_stage_files(state, index)
    assert any(k.endswith(".sig.npy") for k in before) and any(k.endswith(".meta.json") for k in before)
    record = json.loads((state / "read" / f"{index:05d}.json").read_text())
    got = run_read_stage(state, index, cwd=tmp_path)
    assert without_timings(got) == without_timings(record)
    assert read_stage_files(state, index) == before

    root = tmp_path / "b"
    root.mkdir()
    assert _cli(root, *srcs, *flags, env=dict(subprocess_env(), **{CRASH_ENV: "manifest-before"})).returncode == -9
    ctx = StageContext.load(root / "shards" / ".build")
    assert ctx.filters.describe() == DocumentFilter(FilterConfig(clean=True, near_dedup=True)).describe()
    reads = [ctx.state.load_read_record(t.index, t.key) for t in ctx.plan.tasks]
    result = decide(
        Decider.for_plan(ctx.plan, ctx.filters), (DecideInput(r, *ctx.state.load_read_outputs(r)) for r in reads)
    )
    finished = [ctx.state.load_finish_record(t.index, t.key) for t in ctx.plan.tasks]
    assert [d.sha256 for d in result.decisions] == [f.decision_sha256 for f in finished]
    lines = [json.loads(x) for x in (root / "drops.jsonl").read_text().splitlines()]
    assert result.explain_lines == lines and any(x["reason"] == "near_dup" for x in lines)


# ------------------------------------------------------------------------------------------------
# Dev corpus: real files + a crafted extras file, GPT-2.

DEV_FILES = ("web-cc-dclm-annotated.jsonl", "multi-udhr.jsonl", "wiki-ko.jsonl")
DEV_CFG = FilterConfig(clean=True, scrub_pii=True, near_dedup=True)


@pytest.fixture(scope="session")
def dev_extras(tmp_path_factory, dev_dir) -> dict:
    """extras.jsonl (after the dev files): for 4 DCLM web articles two copies each with different
    boilerplate (~95% identical), an exact copy of a DCLM document, the HTML page, the PII text."""
    docs = read_texts([dev_dir / "web-cc-dclm-annotated.jsonl"])
    cands = [t for t in docs if 400 <= len(t.split()) <= 1500 and t.isascii()]
    articles = cands[:: len(cands) // 4][:4]
    crafted = []
    for k, a in enumerate(articles):
        for v in range(2):
            c = with_boilerplate(a, k + v)
            assert len(c.split()) <= 1.06 * len(a.split())  # ~95% identical
            crafted.append(c)
    d = tmp_path_factory.mktemp("dev-filter-extras")
    copy = cands[1]  # not one of the articles
    extras = write_jsonl(d / "extras.jsonl", crafted[:4] + [copy, PAGE] + crafted[4:] + [PII_DOC])
    return {
        "sources": [dev_dir / n for n in DEV_FILES] + [extras],
        "crafted": crafted,
        "articles": articles,
        "copy": copy,
    }


def _dev_cfg(root: Path, sources, gpt2_json, workers: int) -> BuildConfig:
    return cfg_for(
        root,
        sources,
        DocumentFilter(DEV_CFG),
        tokenizer=str(gpt2_json),
        workers=workers,
        task_bytes=1 << 20,
        chunk_tokens=1 << 16,
        shard_tokens=1 << 20,
    )


@pytest.fixture(scope="session")
def dev_filter_build(tmp_path_factory, dev_extras, gpt2_json):
    root = tmp_path_factory.mktemp("dev-filter-2w")
    return root, build_corpus(_dev_cfg(root, dev_extras["sources"], gpt2_json, workers=2))


@pytest.fixture(scope="session")
def gpt2_decode(gpt2_json):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(gpt2_json))
    return lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)


def test_dev_crafted_near_duplicates_removed_distinct_documents_survive(dev_filter_build, dev_extras):
    """On DCLM web text + UDHR + Korean Wikipedia: every crafted copy (other boilerplate, ~95%
    identical) is dropped as near_dup while its original stays; the stored documents equal the
    independent expectation (so every distinct document survives); the file's own near
    duplicates, if any, are found the same way."""
    root, rep = dev_filter_build
    texts = read_texts(dev_extras["sources"])
    ex = expected_ids(texts, DEV_CFG)
    assert stored_ids(root / "manifests" / "shards.json") == ex["stored"]
    by_id = {d["id"]: d for d in explain_lines(root / "drops.jsonl")}
    for c in dev_extras["crafted"]:
        assert by_id[sha_hex(c)]["reason"] == "near_dup"
        assert by_id[sha_hex(c)]["source"].endswith("extras.jsonl")
    for a in dev_extras["articles"]:
        assert sha_hex(a) not in by_id and sha_hex(a) in ex["texts"]
    n_near = sum(1 for r in ex["reasons"].values() if r == "near_dup")
    assert sum(s["near_duplicates"] for s in rep.splits.values()) == n_near >= len(dev_extras["crafted"])
    assert rep.documents == sum(len(v) for v in ex["stored"].values()) > 700


def test_dev_exact_duplicate_is_caught_by_the_exact_stage_first(dev_filter_build, dev_extras):
    """The exact copy of a DCLM document is dropped as exact_dup (never near_dup), pointing at the
    stored original; the explain lines name real source lines (the id hashes that line's text)."""
    root, _ = dev_filter_build
    lines = explain_lines(root / "drops.jsonl")
    copy = [d for d in lines if d["id"] == sha_hex(dev_extras["copy"])]
    assert len(copy) == 1 and copy[0]["reason"] == "exact_dup" and copy[0]["source"].endswith("extras.jsonl")
    assert copy[0]["duplicate_of"] == sha_hex(dev_extras["copy"])
    assert copy[0]["duplicate_of"] in stored_tokens(root / "manifests" / "shards.json")
    check_explain_locations(lines)


def test_dev_html_page_yields_its_main_text_in_the_shard(dev_filter_build, gpt2_decode):
    """Decoding the stored GPT-2 tokens of the HTML page gives its article text: every paragraph
    and the headline, none of the navigation, cookie banner, newsletter box, sidebar or footer."""
    root, _ = dev_filter_build
    toks = stored_tokens(root / "manifests" / "shards.json")
    text, reason = DocumentFilter(DEV_CFG).process(PAGE)
    ids = toks[sha_hex(text)]
    assert ids[-1] == 50256 and 50256 not in ids[:-1].tolist()
    stored = gpt2_decode(ids[:-1])
    assert stored == text
    assert all(p in stored for p in ARTICLE) and "Millbrook Reservoir at Lowest Level" in stored
    assert not any(j in stored for j in PAGE_JUNK) and "<" not in stored


def test_dev_pii_is_scrubbed_in_the_stored_tokens(dev_filter_build, gpt2_decode):
    root, rep = dev_filter_build
    toks = stored_tokens(root / "manifests" / "shards.json")
    text, _ = DocumentFilter(DEV_CFG).process(PII_DOC)
    stored = gpt2_decode(toks[sha_hex(text)][:-1])
    assert not any(s in stored for s in PII_SECRETS)
    assert (stored.count("<EMAIL>"), stored.count("<PHONE>"), stored.count("<IP>")) == (2, 2, 2)
    assert rep.filter_counters["pii:email"] >= 2 and rep.filter_summary()["changed"]["pii_scrubbed"] >= 1


def test_dev_one_and_two_workers_identical(tmp_path_factory, dev_filter_build, dev_extras, gpt2_json):
    """Manifest, shards and explain file: identical bytes for 1 and 2 workers."""
    root = tmp_path_factory.mktemp("dev-filter-1w")
    build_corpus(_dev_cfg(root, dev_extras["sources"], gpt2_json, workers=1))
    assert tree(root) == tree(dev_filter_build[0])


def test_dev_cli_lang_keeps_korean_wikipedia_and_drops_other_languages(tmp_path, dev_dir):
    """`--lang ko` through the CLI on Korean Wikipedia, the UDHR sample (no English translation in
    it) and TinyStories: all 119 Korean articles and the Korean UDHR translation are stored; the
    other 128 UDHR translations and the English stories are dropped, each explained with its
    detected language at its file:line; the manifest counts the stored languages."""
    srcs = [str(dev_dir / n) for n in ("wiki-ko.jsonl", "multi-udhr.jsonl", "story-tinystories.jsonl")]
    p = _cli(
        tmp_path,
        *srcs,
        "--tokenizer",
        "bytes",
        "--lang",
        "ko",
        "--explain-drops",
        "drops.jsonl",
        "--workers",
        "2",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    udhr = [json.loads(line) for line in open(dev_dir / "multi-udhr.jsonl", encoding="utf-8")]
    stories = read_texts([dev_dir / "story-tinystories.jsonl"])
    korean = read_texts([dev_dir / "wiki-ko.jsonl"]) + [d["text"] for d in udhr if d["id"] == "udhr2-kor"]
    ids = stored_ids(tmp_path / "manifests" / "shards.json")
    assert sorted(ids["train"] + ids["validation"]) == sorted(sha_hex(t) for t in korean)
    lines = explain_lines(tmp_path / "drops.jsonl")
    kor_line = next(i for i, d in enumerate(udhr, 1) if d["id"] == "udhr2-kor")
    assert [(Path(d["source"]).name, d["line"]) for d in lines] == (
        [("multi-udhr.jsonl", i) for i in range(1, len(udhr) + 1) if i != kor_line]
        + [("story-tinystories.jsonl", i) for i in range(1, len(stories) + 1)]
    )
    for d in lines:  # another language, or Korean below the probability threshold
        assert (d["reason"] == f"lang:{d['lang']}" and d["lang"] != "ko") or (
            d["reason"] == "lang:low_confidence" and d["lang"] == "ko" and d["lang_prob"] < 0.5
        ), d
    assert {d["lang"] for d in lines[-len(stories) :]} == {"en"}
    check_explain_locations(lines)
    m = json.loads((tmp_path / "manifests" / "shards.json").read_text())
    assert sum(m["splits"][s]["languages"].get("ko", 0) for s in fmt.SPLITS) == len(korean) == 120
    assert sum(filtered_total(m["splits"][s]) for s in fmt.SPLITS) == len(lines) == 133
    assert sum(v for k, v in out["filters"]["dropped"].items() if k.startswith("lang:")) == 133
    assert m["filters"]["settings"]["lang"] == ["ko"]


def test_build_does_not_hang_when_the_parent_used_the_minhash_thread_pool(tmp_path, stdlib_corpus_texts):
    """rensa computes multi-row MinHash matrices on a Rayon pool that does not survive fork: a
    process that used it and then forks build workers must still finish (workers compute one row
    per call). Run in a subprocess with a timeout, so a hang fails instead of blocking the suite."""
    paras = [p for t in stdlib_corpus_texts for p in t.split("\n\n") if len(p) > 200][:3000]
    src = write_jsonl(tmp_path / "in.jsonl", paras)  # short documents: batches of 256 (multi-row calls hung)
    script = (
        "import sys, numpy as np, rensa\n"
        "from h5corpus.build import BuildConfig, build_corpus\n"
        "from h5corpus.filters import DocumentFilter, FilterConfig\n"
        "flat = np.arange(2_000_000, dtype=np.uint64)\n"
        "rensa.RMinHash.digest_matrix_from_flat_token_hashes(flat, (np.arange(1001) * 2000).astype(np.uint64), 128, 1)\n"
        "r = build_corpus(BuildConfig(sources=[sys.argv[1]], tokenizer='bytes', workers=2, shards_dir=sys.argv[2] + '/s',\n"
        "                      manifest=sys.argv[2] + '/m.json', filters=DocumentFilter(FilterConfig(near_dedup=True))))\n"
        "print(r.documents)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script, str(src), str(tmp_path / "o")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr
    assert 0.9 * len(set(paras)) < int(p.stdout.split()[-1]) <= len(set(paras))


def test_explain_drops_without_filters_lists_empty_duplicate_and_over_budget_documents(tmp_path, stdlib_corpus_texts):
    """--explain-drops works without filter stages: empty texts (`empty`), exact copies
    (`exact_dup`) and documents past a --max-tokens budget (`over_budget`) are listed in input
    order, matching the manifest's counts; the manifest equals the build without the flag."""
    t = stdlib_corpus_texts[:40]
    src = write_jsonl(tmp_path / "in.jsonl", t[:20] + ["", t[3]] + t[20:] + [t[25]])
    kw = dict(validation_fraction=0.0, max_tokens={"train": 800_000}, workers=2, task_bytes=10 << 20)
    rep = build_corpus(cfg_for(tmp_path / "a", [src], None, **kw))
    build_corpus(cfg_for(tmp_path / "b", [src], None, explain_drops=None, **kw))
    assert (tmp_path / "a" / "manifests" / "shards.json").read_bytes() == (
        tmp_path / "b" / "manifests" / "shards.json"
    ).read_bytes()
    lines = explain_lines(tmp_path / "a" / "drops.jsonl")
    tr = rep.splits["train"]
    assert [d["line"] for d in lines] == sorted(d["line"] for d in lines)
    assert [d["reason"] for d in lines[:2]] == ["empty", "exact_dup"] and [d["line"] for d in lines[:2]] == [21, 22]
    assert sum(d["reason"] == "over_budget" for d in lines) == tr["over_budget"] > 0
    assert sum(d["reason"] == "exact_dup" for d in lines) == tr["duplicates"] == tr["dropped"]["exact_dup"]
    assert "lang" not in lines[0] and tr["skipped"] == 1
    check_explain_locations(lines)
