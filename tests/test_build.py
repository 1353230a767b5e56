"""`h5corpus build`: content, dedup, split, budgets, truncation, determinism across worker counts,
kill -9 + resume, locking, refusal, bad input, filters seam, CLI.

Core tests build standard-library text with the offline `bytes` tokenizer; the dev-corpus tests
build ../shared/corpora/dev with GPT-2 (a few session-scoped builds) and compare every stored
document with the `tokenizers` reference ids.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pytest

from h5corpus.build import (
    BuildConfig,
    BuildConflict,
    BuildError,
    build_corpus,
    document_split,
    filtered_total,
    format_report,
    parse_max_tokens,
)
from h5corpus.build.input.records import BadRecord, TaskReader
from h5corpus.build.input.sources import plan_tasks, resolve_sources
from h5corpus.storage import format as fmt
from h5corpus.storage.manifest import read_manifest
from h5corpus.storage.validate import validate_corpus
from tests.helpers import (
    WAITING_BUILD_SCRIPT,
    read_built,
    read_stage_files,
    run_read_stage,
    subprocess_env,
    tree,
    without_timings,
    write_fineweb_parquet,
    write_jsonl,
)

REPO = Path(__file__).resolve().parent.parent
SEED = 20261003
EOT = "<|endoftext|>"


# -- helpers --------------------------------------------------------------------------------------
def sha(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def config(root: Path, sources, **kw) -> BuildConfig:
    kw.setdefault("tokenizer", "bytes")
    kw.setdefault("workers", 1)
    kw.setdefault("task_bytes", 60_000)
    kw.setdefault("chunk_tokens", 4096)
    kw.setdefault("shard_tokens", 150_000)
    return BuildConfig(
        sources=[str(s) for s in sources], shards_dir=root / "shards", manifest=root / "manifests" / "shards.json", **kw
    )


def records(sources, task_bytes: int, text_field: str = "text") -> list[list]:
    """The input as the build sees it: per task, its records (text or BadRecord), in order."""
    tasks = plan_tasks(resolve_sources([str(s) for s in sources]), task_bytes=task_bytes)
    return [[r if isinstance(r, BadRecord) else r[0] for r in TaskReader(t, text_field)] for t in tasks]


@dataclass
class Expected:
    docs: dict[str, list[str]] = field(default_factory=lambda: {s: [] for s in fmt.SPLITS})
    stats: dict[str, dict[str, int]] = field(
        default_factory=lambda: {
            s: {k: 0 for k in ("duplicates", "near_duplicates", "dropped", "over_budget", "skipped")}
            for s in fmt.SPLITS
        }
    )


def model(tasks_records, *, encode, seed=SEED, fraction=0.05, filters=None, budgets=None, mdt=None) -> Expected:
    """What the build must produce, computed the obvious way: filters, exact dedup (first
    occurrence), near-dedup, hash split, budgets in input order (last document whole)."""
    ex = Expected()
    seen: set[bytes] = set()
    index = filters.near_duplicate_index() if filters else None
    used = {s: 0 for s in fmt.SPLITS}
    budgets = budgets or {}
    for recs in tasks_records:
        for r in recs:
            if isinstance(r, BadRecord):
                ex.stats[
                    document_split(hashlib.sha256(r.where.encode()).digest(), seed=seed, validation_fraction=fraction)
                ]["skipped"] += 1
                continue
            text = r
            if filters:
                new, _ = filters.process(text)
                if new is None:
                    ex.stats[document_split(sha(text), seed=seed, validation_fraction=fraction)]["dropped"] += 1
                    continue
                text = new
            s = document_split(sha(text), seed=seed, validation_fraction=fraction)
            if not text:
                ex.stats[s]["skipped"] += 1
                continue
            if sha(text) in seen:
                ex.stats[s]["duplicates"] += 1
                continue
            seen.add(sha(text))
            if index is not None and index.add(filters.signature(text)):
                ex.stats[s]["near_duplicates"] += 1
                continue
            n = len(encode(text)) + 1
            n = min(n, mdt) if mdt else n
            if s in budgets and used[s] >= budgets[s]:
                ex.stats[s]["over_budget"] += 1
                continue
            used[s] += n
            ex.docs[s].append(text)
    return ex


def check_content(manifest: Path, ex: Expected, encode, eos: int, mdt: int | None = None) -> None:
    """Stored documents = the model's, in order; tokens = encode(text) + [EOS] (or cut at mdt)."""
    got = read_built(manifest)
    for split in fmt.SPLITS:
        texts = ex.docs[split]
        assert [d[0] for d in got[split]] == [sha(t) for t in texts], split
        for (_doc_id, toks, flags), text in zip(got[split], texts):
            ref = np.append(np.asarray(encode(text), dtype=np.int64), eos)
            if mdt and ref.size > mdt:
                assert flags == fmt.FLAG_TRUNCATED and np.array_equal(toks, ref[:mdt]), split
            else:
                assert flags == 0 and np.array_equal(toks, ref), split
            assert eos not in toks[:-1].tolist()


def byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


# -- the core corpus (stdlib text, bytes tokenizer) -----------------------------------------------
@pytest.fixture(scope="module")
def core_sources(tmp_path_factory, stdlib_corpus_texts) -> list[Path]:
    """Three sources in input order: a.jsonl, b.jsonl, a folder of .txt. Duplicates within and across
    files, an empty document, NUL bytes, literal <|endoftext|>, a 1.2M-character document."""
    t = stdlib_corpus_texts
    d = tmp_path_factory.mktemp("core-in")
    big = "".join(t)[:1_200_000]
    a = list(t[:70]) + [f"literal {EOT} inside a document {EOT}", "nul\x00bytes\x00kept", "", t[5], big]
    b = list(t[70:140]) + [t[3], t[10], t[75], "", t[3]]
    write_jsonl(d / "a.jsonl", a)
    write_jsonl(d / "b.jsonl", b)
    (d / "c").mkdir()
    for i, x in enumerate(t[140:200] + [t[141]]):
        (d / "c" / f"{i:03d}.txt").write_text(x, encoding="utf-8")
    return [d / "a.jsonl", d / "b.jsonl", d / "c"]


@pytest.fixture(scope="module")
def core_build(tmp_path_factory, core_sources):
    """The core corpus built with 2 workers and small tasks/shards/chunks."""
    root = tmp_path_factory.mktemp("core-2w")
    rep = build_corpus(config(root, core_sources, workers=2))
    return root, rep


def test_stored_documents_equal_encoding_plus_eos_in_input_order(core_build, core_sources):
    """Every stored document is tokenizer.encode(text) + [EOS], id = sha256(text), in input order
    per split; exact duplicates kept once (first occurrence); empty documents skipped and counted;
    NUL bytes, literal <|endoftext|> and a 1.2M-character document stored as text."""
    root, rep = core_build
    ex = model(records(core_sources, 60_000), encode=byte_encode)
    check_content(root / "manifests" / "shards.json", ex, byte_encode, eos=256)
    for split in fmt.SPLITS:
        st = rep.splits[split]
        assert st["documents"] == len(ex.docs[split])
        assert st["tokens"] == sum(len(t.encode()) + 1 for t in ex.docs[split])
        assert st["pairs"] == st["tokens"] - st["documents"]
        assert st["characters"] == sum(len(t) for t in ex.docs[split])
        for k in ("duplicates", "skipped"):
            assert st[k] == ex.stats[split][k], (split, k)
    texts = [t for recs in records(core_sources, 60_000) for t in recs if t]
    assert sum(rep.splits[s]["duplicates"] for s in fmt.SPLITS) == len(texts) - len(set(texts)) == 6
    assert sum(rep.splits[s]["skipped"] for s in fmt.SPLITS) == 2
    all_texts = ex.docs["train"] + ex.docs["validation"]
    assert any(len(x) == 1_200_000 for x in all_texts) and any("\x00" in x for x in all_texts)
    assert any(EOT in x for x in all_texts)


def test_split_is_the_documented_hash_and_disjoint(core_build):
    """Split = hash(doc id, seed) < fraction; no document id in both splits."""
    root, _ = core_build
    got = read_built(root / "manifests" / "shards.json")
    ids = {s: [d[0] for d in got[s]] for s in fmt.SPLITS}
    assert not set(ids["train"]) & set(ids["validation"])
    assert len(ids["validation"]) > 0
    for s in fmt.SPLITS:
        assert all(document_split(i, seed=SEED, validation_fraction=0.05) == s for i in ids[s])


def documented_split(doc_id: bytes, seed: int, fraction: float) -> str:
    """docs/BUILD.md's split rule, written from the text: validation when the first 8 bytes
    (big-endian) of sha256(b"h5corpus-split:<seed>:" + id), as a fraction of 2**64, are below the
    validation fraction."""
    head = hashlib.sha256(f"h5corpus-split:{seed}:".encode("ascii") + doc_id).digest()[:8]
    return "validation" if int.from_bytes(head, "big") / 2**64 < fraction else "train"


def test_split_rule_matches_the_documented_formula():
    """document_split and the batch rule the read stage uses agree with the formula of
    docs/BUILD.md, computed here with hashlib alone, for many ids, seeds and fractions."""
    from h5corpus.build.config import SplitRule

    rng = random.Random(5)
    ids = [hashlib.sha256(str(i).encode()).digest() for i in range(400)] + [rng.randbytes(32) for _ in range(100)]
    for seed in (0, 1, SEED, 2**40 + 7):
        for fraction in (0.0, 1e-9, 0.05, 0.3, 0.5, 0.999, 1.0):
            want = [documented_split(i, seed, fraction) for i in ids]
            assert [document_split(i, seed=seed, validation_fraction=fraction) for i in ids] == want
            got = SplitRule(seed, fraction).indices(ids)
            assert [fmt.SPLITS[k] for k in got.tolist()] == want, (seed, fraction)
    share = sum(documented_split(i, SEED, 0.3) == "validation" for i in ids) / len(ids)
    assert 0.25 < share < 0.35


def test_build_validates_and_manifest_records_splits_source_build(core_build, core_sources):
    root, rep = core_build
    mpath = root / "manifests" / "shards.json"
    assert validate_corpus(mpath).ok
    m = json.loads(mpath.read_text())
    for s in fmt.SPLITS:
        for k in ("documents", "tokens", "duplicates", "skipped", "truncated", "pairs", "characters", "dropped"):
            assert k in m["splits"][s]
    assert m["tokenizer"]["name"] == "bytes" and m["dtype"] == "uint16"
    assert [i["spec"] for i in m["source"]["inputs"]] == [str(s) for s in core_sources]
    assert m["build"]["settings"]["split_seed"] == SEED and m["build"]["tasks_read"] == m["build"]["tasks"] > 3
    # Each task writes its own shards, named by task and sequence; shards are size-capped.
    names = [Path(s["path"]).name for s in m["shards"]]
    task_ids = {int(n.split("-")[1]) for n in names}
    assert len(task_ids) > 3 and task_ids <= set(range(m["build"]["tasks"]))
    assert all(s["tokens"] <= 150_000 or s["documents"] == 1 for s in m["shards"])
    assert not (root / "shards" / ".build").exists()
    assert "train" in format_report(rep) and rep.tokens_per_s > 0


def test_worker_count_and_encoder_do_not_change_a_byte(tmp_path, core_build, core_sources):
    """1 worker vs 2 workers, and the raw-bytes fast path vs the tokenizers path: identical
    manifest and shard bytes."""
    root2, rep2 = core_build
    rep1 = build_corpus(config(tmp_path / "w1", core_sources, workers=1))
    rep_hf = build_corpus(config(tmp_path / "hf", core_sources, workers=2, fast_path=False))
    assert (rep2.encoder, rep1.encoder, rep_hf.encoder) == ("bytes", "bytes", "tokenizers")
    ref = tree(root2)
    assert tree(tmp_path / "w1") == ref
    assert tree(tmp_path / "hf") == ref


def test_every_listed_shard_is_fsynced_before_the_manifest(tmp_path, core_sources, monkeypatch):
    """Every shard the manifest lists is durable before the manifest is written: its data fsynced
    (by the worker that wrote it, in the background) and its folder fsynced after the rename into
    place, so a power cut never leaves a manifest pointing at unwritten bytes or names."""
    import h5corpus.build.stages.commit as B

    log = tmp_path / "fsynced.log"  # appended to by every process (workers fsync their shards)
    at_manifest: list[set[str]] = []
    real_fsync, real_write = os.fsync, B.write_manifest

    def fsync(fd: int) -> None:
        real_fsync(fd)
        st = os.fstat(fd)  # by inode: a candidate is fsynced under its state-folder name, then renamed
        with open(log, "a") as fh:
            fh.write(f"{st.st_dev}:{st.st_ino}\n")

    def write_manifest(path, m):
        at_manifest.append(set(log.read_text().splitlines()))
        return real_write(path, m)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(B, "write_manifest", write_manifest)
    root = tmp_path / "b"
    build_corpus(config(root, core_sources, workers=2))
    m = read_manifest(root / "manifests" / "shards.json")
    assert len(m.shards) > 2 and len(at_manifest) == 1

    def key(p: Path) -> str:
        st = p.stat()
        return f"{st.st_dev}:{st.st_ino}"

    for e in m.shards:
        p = m.shard_path(e)
        assert key(p) in at_manifest[0] and key(p.parent) in at_manifest[0], e.path


def test_rerun_is_up_to_date_and_other_settings_are_refused(tmp_path, core_sources):
    root = tmp_path / "r"
    build_corpus(config(root, core_sources))
    before = tree(root)
    rep = build_corpus(config(root, core_sources, workers=2))
    assert rep.up_to_date and tree(root) == before
    with pytest.raises(BuildConflict, match="other inputs or settings.*split_seed.*--overwrite"):
        build_corpus(config(root, core_sources, split_seed=7))
    rep = build_corpus(config(root, core_sources, split_seed=7, overwrite=True))
    assert not rep.up_to_date and validate_corpus(root / "manifests" / "shards.json").ok
    assert tree(root) != before


def test_different_tokenizer_into_existing_manifest_is_refused(tmp_path, core_sources, gpt2_json):
    root = tmp_path / "t"
    build_corpus(config(root, core_sources[:1]))
    with pytest.raises(
        BuildConflict, match=r"built with tokenizer 'bytes'.*this build uses .*tokenizer\.json.*would not be comparable"
    ):
        build_corpus(config(root, core_sources[:1], tokenizer=str(gpt2_json)))


def test_second_concurrent_build_fails_clearly(tmp_path, core_sources):
    """While a build holds the lock, another build into the same output fails naming the lock."""
    root = tmp_path / "l"
    (root / "shards").mkdir(parents=True)
    with open(root / "shards" / ".build.lock", "w") as fh:
        fh.write("4242\n")
        fh.flush()
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BuildConflict, match="another h5corpus build is writing into .*pid 4242"):
            build_corpus(config(root, core_sources[:1]))
    assert build_corpus(config(root, core_sources[:1])).documents > 0


def test_running_build_holds_the_lock_against_a_second_cli_build(tmp_path, core_sources):
    """A real concurrent build: the first (held inside its filters until a go-file appears) holds
    the run marker (its pid in it); a second CLI build into the same output exits 2 with a clear
    message naming that pid; the first then finishes and removes the marker."""
    env = subprocess_env()
    go = tmp_path / "go"
    cfg = {
        "sources": [str(core_sources[0])],
        "tokenizer": "bytes",
        "workers": 1,
        "shards_dir": str(tmp_path / "shards"),
        "manifest": str(tmp_path / "manifests" / "shards.json"),
    }
    first = subprocess.Popen(
        [sys.executable, "-c", WAITING_BUILD_SCRIPT, json.dumps(cfg), str(go)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    args = [sys.executable, "-m", "h5corpus", "build", str(core_sources[0]), "--tokenizer", "bytes"]
    try:
        marker = tmp_path / "shards" / ".build.lock"
        for _ in range(300):
            try:
                if json.loads(marker.read_text())["pid"] == first.pid:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        else:
            pytest.fail("first build never wrote its run marker")
        second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert "another h5corpus build is writing into" in second.stderr
        assert f"pid {first.pid}," in second.stderr
        go.touch()
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
        assert json.loads(out)["documents"] > 0
        assert not marker.exists()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_max_tokens_keeps_whole_documents_in_input_order_until_filled(tmp_path, core_sources):
    """Budgets: documents in input order until each budget is filled, the last one kept whole;
    reading stops at the task that fills the last budget; later documents are not stored."""
    budgets = {"train": 400_000, "validation": 30_000}
    rep = build_corpus(config(tmp_path / "b", core_sources, max_tokens=budgets, workers=2, task_bytes=40_000))
    assert rep.tasks_read < rep.tasks
    full = model(records(core_sources, 40_000), encode=byte_encode)
    got = read_built(tmp_path / "b" / "manifests" / "shards.json")
    for split, budget in budgets.items():
        lens = [len(t.encode()) + 1 for t in full.docs[split]]
        k = len(got[split])
        assert [d[0] for d in got[split]] == [sha(t) for t in full.docs[split][:k]]
        assert sum(lens[: k - 1]) < budget <= sum(lens[:k])  # filled, and only by the last document
        assert rep.splits[split]["tokens"] == sum(lens[:k])
    assert validate_corpus(tmp_path / "b" / "manifests" / "shards.json").ok


def test_max_document_tokens_truncates_at_write_time_flagged_without_eos(tmp_path, core_sources):
    """Documents longer than N tokens are stored as their first N tokens, flagged truncated, with
    no EOS (a cut is not an end); shorter ones keep their EOS; the count is recorded."""
    mdt = 3000
    rep = build_corpus(config(tmp_path / "m", core_sources, max_document_tokens=mdt, workers=2))
    mpath = tmp_path / "m" / "manifests" / "shards.json"
    ex = model(records(core_sources, 60_000), encode=byte_encode, mdt=mdt)
    check_content(mpath, ex, byte_encode, eos=256, mdt=mdt)
    n_long = sum(len(t.encode()) + 1 > mdt for s in fmt.SPLITS for t in ex.docs[s])
    assert n_long > 10 and sum(rep.splits[s]["truncated"] for s in fmt.SPLITS) == n_long
    assert validate_corpus(mpath).ok


BAD_LINES = [b'{"text": "fine"}', b'{"text": "bad \xff"}', b'{"text": ', b'{"other": 1}', b'{"text": 7}']


def test_bad_input_fails_naming_file_and_line_and_keeps_completed_work(tmp_path, core_sources):
    """on_error=fail: the first bad record stops the build with file:line; tasks already done are
    kept, so fixing the input and re-running resumes and finishes."""
    bad = tmp_path / "in" / "z.jsonl"
    bad.parent.mkdir()
    bad.write_bytes(b"\n".join(BAD_LINES) + b"\n")
    root = tmp_path / "f"
    with pytest.raises(BuildError, match=rf"{bad}:2: invalid UTF-8"):
        build_corpus(config(root, [*core_sources, bad]))
    assert any((root / "shards" / ".build" / "read").glob("*.json"))
    bad.write_text('{"text": "fine"}\n{"text": "fixed"}\n')
    rep = build_corpus(config(root, [*core_sources, bad]))
    assert rep.resumed and rep.tasks_reused > 0 and rep.skipped_total == 0
    assert validate_corpus(root / "manifests" / "shards.json").ok


def test_bad_input_skipped_counted_and_listed(tmp_path, core_sources):
    bad = tmp_path / "in" / "z.jsonl"
    bad.parent.mkdir()
    bad.write_bytes(b"\n".join(BAD_LINES) + b"\n")
    rep = build_corpus(config(tmp_path / "s", [core_sources[0], bad], on_error="skip"))
    assert rep.skipped_total == 4
    assert [r.split(": ", 1)[0] for r in rep.skipped_records] == [f"{bad}:{i}" for i in (2, 3, 4, 5)]
    ex = model(records([core_sources[0], bad], 60_000), encode=byte_encode)
    for s in fmt.SPLITS:
        assert rep.splits[s]["skipped"] == ex.stats[s]["skipped"]
    assert sum(rep.splits[s]["skipped"] for s in fmt.SPLITS) == 4 + 1  # + the empty document
    m = json.loads((tmp_path / "s" / "manifests" / "shards.json").read_text())
    assert m["build"]["skip_reasons"] == {
        "empty": 1,
        "invalid_utf8": 1,
        "malformed_json": 1,
        "missing_field": 1,
        "not_string": 1,
    }
    assert m["build"]["skipped_records"] == rep.skipped_records
    check_content(tmp_path / "s" / "manifests" / "shards.json", ex, byte_encode, eos=256)


class TrimDropSign:
    """A stand-in for the filters package: strips trailing whitespace, drops texts that import os,
    signs each text by the sha256 of its first line (a uint8 array); the index calls a repeated
    first line a near duplicate."""

    def __init__(self) -> None:
        self.c = {"seen": 0, "dropped_imports_os": 0, "trimmed": 0}

    def process(self, text):
        self.c["seen"] += 1
        if "import os" in text:
            self.c["dropped_imports_os"] += 1
            return None, "imports_os"
        new = text.rstrip()
        self.c["trimmed"] += new != text
        return new, None

    def counters(self):
        return dict(self.c)

    def signature(self, text):
        return np.frombuffer(hashlib.sha256(text.split("\n", 1)[0].encode()).digest(), dtype=np.uint8)

    def near_duplicate_index(self):
        class Index:
            def __init__(self):
                self.seen = set()

            def add(self, sig):
                key = bytes(np.asarray(sig, dtype=np.uint8))
                dup = key in self.seen
                self.seen.add(key)
                return dup

        return Index()

    def describe(self):
        return {"name": "trim-drop-sign", "version": 1}


class TrimDropSignBatch(TrimDropSign):
    """The same rules through the optional batch method (signatures computed by the filter)."""

    def process_batch(self, texts, *, signatures=False):
        from types import SimpleNamespace

        out = []
        for t in texts:
            new, reason = self.process(t)
            out.append(
                SimpleNamespace(
                    text=new, reason=reason, signature=self.signature(new) if signatures and new is not None else None
                )
            )
        return out


def test_filters_plug_into_the_build_deterministically(tmp_path, core_sources):
    """The filter seam: processed text is what is stored (ids hash it), drops and near duplicates
    are counted per split with reasons, counters merge across tasks; 1 and 2 workers, and the
    per-document and batch methods, give identical bytes."""
    r1 = build_corpus(config(tmp_path / "f1", core_sources, filters=TrimDropSign(), workers=1))
    r2 = build_corpus(config(tmp_path / "f2", core_sources, filters=TrimDropSign(), workers=2))
    r3 = build_corpus(config(tmp_path / "f3", core_sources, filters=TrimDropSignBatch(), workers=2))
    assert tree(tmp_path / "f1") == tree(tmp_path / "f2") == tree(tmp_path / "f3")
    assert r3.filter_counters == r2.filter_counters
    ex = model(records(core_sources, 60_000), encode=byte_encode, filters=TrimDropSign())
    check_content(tmp_path / "f2" / "manifests" / "shards.json", ex, byte_encode, eos=256)
    for s in fmt.SPLITS:
        for k in ("near_duplicates", "duplicates"):
            assert r2.splits[s][k] == ex.stats[s][k], (s, k)
        assert filtered_total(r2.splits[s]) == ex.stats[s]["dropped"], s
    assert sum(filtered_total(r2.splits[s]) for s in fmt.SPLITS) > 0
    assert sum(r2.splits[s]["near_duplicates"] for s in fmt.SPLITS) > 0
    assert r1.filter_counters == r2.filter_counters
    assert r2.filter_counters["seen"] == sum(len(x) for x in records(core_sources, 60_000))
    m = json.loads((tmp_path / "f2" / "manifests" / "shards.json").read_text())
    assert m["filters"]["settings"] == {"name": "trim-drop-sign", "version": 1}
    train = m["splits"]["train"]
    assert train["dropped"] == {
        "imports_os": filtered_total(train),
        "exact_dup": train["duplicates"],
        "near_dup": train["near_duplicates"],
    }


def test_hf_source_fineweb_schema_from_local_cache(tmp_path, stdlib_corpus_texts, monkeypatch):
    """An hf://datasets/...@REV/PATH source (FineWeb's schema, local cache) builds, and the manifest
    records the dataset and its pinned revision."""
    pytest.importorskip("pyarrow")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rev = "9bb295ddab0e05d785b879661af7260fed5140fc"
    snap = tmp_path / "hub" / "datasets--HuggingFaceFW--fineweb" / "snapshots" / rev / "sample" / "10BT"
    snap.mkdir(parents=True)
    texts = stdlib_corpus_texts[:90]
    n = len(texts)
    write_fineweb_parquet(snap / "000_00000.parquet", texts, row_group_size=10)
    spec = f"hf://datasets/HuggingFaceFW/fineweb@{rev}/sample/10BT"
    rep = build_corpus(config(tmp_path / "o", [spec], hf_cache_dir=tmp_path / "hub", workers=2, task_bytes=100_000))
    assert rep.tasks > 1 and rep.documents == n
    m = json.loads((tmp_path / "o" / "manifests" / "shards.json").read_text())
    [inp] = m["source"]["inputs"]
    assert (inp["repo"], inp["revision"], inp["path"], inp["files"]) == ("HuggingFaceFW/fineweb", rev, "sample/10BT", 1)
    ex = model([[t for t in texts]], encode=byte_encode)
    check_content(tmp_path / "o" / "manifests" / "shards.json", ex, byte_encode, eos=256)


def test_fast_path_that_differs_on_the_input_falls_back_to_tokenizers(tmp_path):
    """A tokenizer whose tiktoken mirror looks eligible but merges "abc" differently: the proof at
    build start catches it on the build's own text, and the corpus equals the tokenizers ids.
    (fastokens gives the right ids here: the build is limited to tiktoken to reach the fallback.)"""
    from h5corpus.build.tokenize.tokenizer import load_tokenizer
    from tests.helpers import bpe_tokenizer_json

    tj = tmp_path / "tokenizer.json"
    tj.write_text(json.dumps(bpe_tokenizer_json([("a", "b"), ("b", "c"), ("a", "bc")])))
    src = write_jsonl(tmp_path / "in.jsonl", ["we sing the abc song", "abcabc and cab", "nothing here"])
    rep = build_corpus(
        config(tmp_path / "o", [src], tokenizer=str(tj), validation_fraction=0.0, fast_encoders=("tiktoken",))
    )
    assert rep.encoder == "tokenizers" and "differs at token" in rep.encoder_note
    assert (
        build_corpus(config(tmp_path / "f", [src], tokenizer=str(tj), validation_fraction=0.0)).encoder == "fastokens"
    )
    assert tree(tmp_path / "f") == tree(tmp_path / "o")
    tok = load_tokenizer(str(tj))
    ex = model(records([src], 60_000), encode=lambda t: tok.encode(t).tolist(), fraction=0.0)
    check_content(tmp_path / "o" / "manifests" / "shards.json", ex, lambda t: tok.encode(t).tolist(), eos=tok.eos_id)


# -- kill -9 and resume ---------------------------------------------------------------------------
_BUILD_SCRIPT = (
    "import json, sys\n"
    "from h5corpus.build import BuildConfig, build_corpus\n"
    "r = build_corpus(BuildConfig(**json.loads(sys.argv[1])))\n"
    "print(json.dumps(r.to_json()))\n"
)


def _run_killed(args: list[str], delay: float) -> bool:
    """Start a build and SIGKILL it after ``delay`` seconds (no cleanup runs). True if it was killed."""
    proc = subprocess.Popen(args, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.wait(timeout=delay)
        killed = False
    except subprocess.TimeoutExpired:
        proc.kill()
        killed = True
    proc.communicate()
    return killed


def kill_and_resume(
    cfg: dict, seed: int, points: int = 3, reference: dict | None = None, duration: float | None = None
) -> int:
    """For each of ``points`` kill moments (stratified over a full build's duration, seeded): start
    from nothing, kill -9 the build there, then re-run the same build to completion; the last
    point also kills the resuming run once. Every time the result must equal the uninterrupted
    build (``reference`` tree, else one run here first) byte for byte, with no state, partial or
    temporary file left. Returns how many runs were killed."""
    rng = random.Random(seed)
    root = Path(cfg["shards_dir"]).parent
    args = [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(dict(cfg, overwrite=False))]
    if reference is None or duration is None:
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(dict(cfg, overwrite=True))],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr
        duration = time.perf_counter() - t0
        reference = tree(root) if reference is None else reference
    kills = 0
    for j in range(points):
        shutil.rmtree(cfg["shards_dir"], ignore_errors=True)
        shutil.rmtree(Path(cfg["manifest"]).parent, ignore_errors=True)
        kills += _run_killed(args, duration * (0.15 + 0.65 * (j + rng.random()) / points))
        if j == points - 1:
            kills += _run_killed(args, duration * rng.uniform(0.15, 0.6))
        p = subprocess.run(args, env=subprocess_env(), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        assert tree(root) == reference, f"kill point {j}"
        assert not (Path(cfg["shards_dir"]) / ".build").exists()
        assert not list(root.rglob("*.partial")) and not list(root.rglob("*.tmp*"))
    return kills


def _cfg_json(root: Path, sources, **kw) -> dict:
    c = config(root, sources, **kw)
    d = {k: v for k, v in asdict(c).items() if k not in ("filters",)}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def test_kill_9_at_random_points_then_resume_gives_identical_bytes(tmp_path, core_build, core_sources):
    """kill -9 at random moments (tokenizers path, so the build lasts long enough to be hit in each
    stage), then resume: the manifest and shards equal an uninterrupted build byte for byte."""
    cfg = _cfg_json(tmp_path / "k", core_sources[:2], workers=2, fast_path=False)
    assert kill_and_resume(cfg, seed=11, points=1) >= 1


#: Every stage boundary where a kill leaves a distinct state: candidates written but no record; a
#: task recorded; a task decided; a task's shards half renamed into place / half copied; a task
#: finished; the manifest about to be written; the manifest written but the state not yet removed.
CRASH_POINTS = [
    "read-candidates",
    "read-record:3",
    "decided:2",
    "finish-renamed:2",
    "finish-copied",
    "finish-record:3",
    "manifest-before",
    "manifest-after",
]


def test_kill_9_at_every_stage_then_resume_gives_identical_bytes(tmp_path, core_sources):
    """Fault injection (H5CORPUS_TEST_CRASH_AT): SIGKILL the whole build exactly at each stage
    boundary, then re-run: the result equals an uninterrupted build byte for byte, and no state,
    partial or temporary file is left."""
    from h5corpus.build.run.executor import CRASH_ENV

    srcs = core_sources[:2]  # b.jsonl repeats documents of a.jsonl, so some tasks take the copy path
    build_corpus(config(tmp_path / "ref", srcs, workers=2))
    ref = tree(tmp_path / "ref")
    root = tmp_path / "c"
    cfg = _cfg_json(root, srcs, workers=2)
    for point in CRASH_POINTS:
        shutil.rmtree(root, ignore_errors=True)
        p = subprocess.run(
            [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(cfg)],
            env=dict(subprocess_env(), **{CRASH_ENV: point}),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == -9, (point, p.returncode, p.stderr[-2000:])
        rep = build_corpus(config(root, srcs, workers=2))
        assert tree(root) == ref, point
        assert rep.resumed, point
        assert not (root / "shards" / ".build").exists(), point
        assert not list(root.rglob("*.partial")) and not list(root.rglob("*.tmp*")), point


def _kill_at(point: str, cfg: dict, cwd: Path | None = None) -> Path:
    """Run the build of ``cfg`` in a subprocess killed at ``point``; returns its state folder."""
    from h5corpus.build.run.executor import CRASH_ENV

    p = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(cfg)],
        cwd=cwd,
        env=dict(subprocess_env(), **{CRASH_ENV: point}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == -9, (point, p.returncode, p.stderr[-2000:])
    return Path(cfg["shards_dir"]) / ".build"


def test_read_stage_runs_in_a_fresh_process_from_the_state_folder_alone(tmp_path, core_sources):
    """The plan seam: a build (relative SOURCE paths) is killed right after its first read record;
    another interpreter, started elsewhere with nothing but the state folder, runs the read stage
    of that task again and gets the same record and byte-identical table and candidate shards."""
    root = tmp_path / "b"
    srcs = [p.name for p in core_sources[:2]]  # relative to the build's working folder
    cfg = _cfg_json(root, srcs, workers=1)
    state = _kill_at("read-record", cfg, cwd=core_sources[0].parent)
    [rec_path] = (state / "read").glob("*.json")
    index = int(rec_path.stem)
    before = read_stage_files(state, index)
    assert any(k.endswith(".h5") for k in before) and any(k.endswith(".docs") for k in before)
    record = json.loads(rec_path.read_text())
    (tmp_path / "elsewhere").mkdir()
    got = run_read_stage(state, index, cwd=tmp_path / "elsewhere")
    assert without_timings(got) == without_timings(record) and got["documents"] > 0
    assert read_stage_files(state, index) == before


def test_stage_records_round_trip_and_decide_at_once_equals_the_run(tmp_path, core_sources):
    """A budgeted build killed just before its manifest: every record in the state folder (plan,
    read, finish) parses into its dataclass and back to the same JSON; folding every read task
    through the decide stage at once gives the decisions the incremental run finished with, and
    stops at the same task."""
    from h5corpus.build.stages.buildplan import BuildPlan
    from h5corpus.build.stages.decide import DecideInput, Decider, decide
    from h5corpus.build.stages.state import FinishRecord, ReadRecord, StateDir, TaskDecision

    cfg = _cfg_json(
        tmp_path / "b", core_sources, workers=2, task_bytes=40_000, max_tokens={"train": 400_000, "validation": 30_000}
    )
    state = StateDir(_kill_at("manifest-before", cfg))
    plan_json = json.loads(state.plan.read_text())
    plan = BuildPlan.from_json(plan_json)
    assert plan.to_json() == plan_json and len(plan.tasks) > 3
    reads = {}
    for p in sorted((state.root / "read").glob("*.json")):
        d = json.loads(p.read_text())
        rec = ReadRecord.from_json(d)
        assert rec.to_json() == d and ReadRecord.from_json(rec.to_json()) == rec
        reads[rec.index] = rec
    finishes = {}
    for p in sorted((state.root / "finish").glob("*.json")):
        d = json.loads(p.read_text())
        rec = FinishRecord.from_json(d)
        assert rec.to_json() == d
        finishes[rec.index] = rec
    assert sorted(finishes) == list(range(len(finishes))) and len(finishes) < len(plan.tasks)
    inputs = (DecideInput(reads[i], *state.load_read_outputs(reads[i])) for i in sorted(reads))
    result = decide(Decider.for_plan(plan, None), inputs)
    assert [d.sha256 for d in result.decisions] == [finishes[i].decision_sha256 for i in sorted(finishes)]
    d0 = result.decisions[0]
    again = TaskDecision.from_json(json.loads(json.dumps(d0.to_json())), d0.keep.copy())
    assert again.to_json() == d0.to_json() and np.array_equal(again.keep, d0.keep)
    with pytest.raises(ValueError, match="does not match its sha256"):
        TaskDecision.from_json(d0.to_json(), 1 - d0.keep)
    with pytest.raises(ValueError, match="version"):
        ReadRecord.from_json(dict(reads[0].to_json(), version=2))


# -- CLI ------------------------------------------------------------------------------------------
def test_cli_main_job_builds_stdlib_offline_validates_and_summarizes(tmp_path):
    """The README's main job on a fresh machine: `h5corpus build --validate` (stdlib, bytes
    tokenizer, no network) -> shards + manifest + summary + validation OK, exit 0."""
    p = subprocess.run(
        [sys.executable, "-m", "h5corpus", "build", "--validate", "--workers", "2"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    assert "train" in p.stdout and "validation" in p.stdout and "tokens/s" in p.stdout
    assert ": OK:" in p.stdout
    m = json.loads((tmp_path / "manifests" / "shards.json").read_text())
    assert m["tokenizer"]["name"] == "bytes" and m["source"]["inputs"][0]["kind"] == "stdlib"
    assert m["splits"]["train"]["documents"] > 300


def test_cli_json_usage_and_bad_data_exit_codes(tmp_path, core_sources):
    env = subprocess_env()

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "h5corpus", "build", *a],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    p = run(
        str(core_sources[0]), "--tokenizer", "bytes", "--json", "--validate", "--max-tokens", "train=50k,validation=5k"
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["validation"]["ok"] and out["splits"]["train"]["tokens"] >= 50_000
    assert run("missing.jsonl", "--tokenizer", "bytes").returncode == 2
    assert run(str(core_sources[0]), "--tokenizer", "bytes", "--max-tokens", "dev=5").returncode == 2
    assert run(str(core_sources[0]), "--tokenizer", "bytes", "--on-error", "maybe", "--overwrite").returncode == 2
    p = run(str(core_sources[0]), "--tokenizer", "bytes", "--split-seed", "3")
    assert p.returncode == 2 and "--overwrite" in p.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "a"}\n{"text": \n')
    p = run(str(bad), "--tokenizer", "bytes", "--overwrite")
    assert p.returncode == 1 and f"{bad}:2: malformed JSON" in p.stderr
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "h5corpus",
            "build",
            str(core_sources[0]),
            "--shards-dir",
            "o/s",
            "--manifest",
            "o/m.json",
        ],
        cwd=tmp_path,
        env=dict(env, HF_HUB_CACHE=str(tmp_path / "empty-cache")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 2 and "not in the Hugging Face cache" in p.stderr


def test_parse_max_tokens():
    assert parse_max_tokens("train=8M,validation=100k") == {"train": 8_000_000, "validation": 100_000}
    assert parse_max_tokens("train=1_000") == {"train": 1000}
    for bad in ("train", "dev=5", "train=x", ""):
        with pytest.raises(ValueError):
            parse_max_tokens(bad)


# -- the dev corpus with GPT-2 --------------------------------------------------------------------
@pytest.fixture(scope="session")
def dev_inputs(tmp_path_factory, dev_dir, dev_texts) -> tuple[list[Path], list[str]]:
    """The dev corpus plus an extras file: literal <|endoftext|> text, and exact copies of dev
    documents (2 of one, 1 of another) and one within the file. Returns (sources, all texts in order)."""
    d = tmp_path_factory.mktemp("dev-extras")
    extras = [
        f"The literal text {EOT} is not an end of document. {EOT}",
        dev_texts[5],
        "An extra document.",
        dev_texts[2000],
        dev_texts[5],
        "An extra document.",
        f"{EOT}",
    ]
    write_jsonl(d / "extras.jsonl", extras)
    return [dev_dir, d / "extras.jsonl"], list(dev_texts) + extras


def _dev_cfg(root: Path, sources, gpt2_json, **kw) -> BuildConfig:
    kw.setdefault("workers", 2)
    return config(
        root, sources, tokenizer=str(gpt2_json), task_bytes=4 << 20, chunk_tokens=1 << 16, shard_tokens=1_500_000, **kw
    )


@pytest.fixture(scope="session")
def dev_build(tmp_path_factory, dev_inputs, gpt2_json):
    root = tmp_path_factory.mktemp("dev-2w")
    return root, build_corpus(_dev_cfg(root, dev_inputs[0], gpt2_json))


@pytest.fixture(scope="session")
def dev_encode(gpt2_json, dev_texts, dev_gpt2_ids):
    """text -> reference ids (HF tokenizers, special-token text as text), from the session cache."""
    from h5corpus.build.tokenize.tokenizer import load_tokenizer

    cache = {t: ids for t, ids in zip(dev_texts, dev_gpt2_ids)}
    tok = load_tokenizer(str(gpt2_json))
    return lambda t: cache[t] if t in cache else tok.encode(t)


def test_dev_corpus_every_document_equals_gpt2_encode_plus_eos(dev_build, dev_inputs, dev_encode):
    """Whole dev corpus + extras, 2 workers, GPT-2 via the proven fastokens fast path: every stored
    document = tokenizers ids + [50256]; EOS nowhere else (also where the text says <|endoftext|>);
    duplicates dropped exactly once; no id in both splits; the corpus validates."""
    root, rep = dev_build
    sources, texts = dev_inputs
    assert rep.encoder == "fastokens" and rep.encoder_fallbacks == 0
    ex = model([texts], encode=dev_encode)
    check_content(root / "manifests" / "shards.json", ex, dev_encode, eos=50256)
    n_dups = len(texts) - len(set(texts))
    assert sum(rep.splits[s]["duplicates"] for s in fmt.SPLITS) == n_dups >= 4
    assert rep.documents == len(set(texts))
    got = read_built(root / "manifests" / "shards.json")
    assert not {d[0] for d in got["train"]} & {d[0] for d in got["validation"]}
    eot_docs = [d for s in fmt.SPLITS for d in got[s] if d[0] in (sha(texts[-7]), sha(EOT))]
    assert len(eot_docs) == 2 and all(int((d[1] == 50256).sum()) == 1 for d in eot_docs)
    assert validate_corpus(root / "manifests" / "shards.json", workers=2).ok
    assert rep.tokens > 9_900_000


def test_dev_corpus_one_worker_gives_identical_bytes(tmp_path_factory, dev_build, dev_inputs, gpt2_json):
    root = tmp_path_factory.mktemp("dev-1w")
    build_corpus(_dev_cfg(root, dev_inputs[0], gpt2_json, workers=1))
    assert tree(root) == tree(dev_build[0])


def test_dev_corpus_budgets_and_truncation(tmp_path, dev_inputs, gpt2_json, dev_encode):
    """--max-tokens with --max-document-tokens on the dev corpus: budgets count stored tokens, whole
    (possibly truncated) documents in input order, last kept whole; truncated documents are the
    first N reference ids without EOS; reading stops early."""
    budgets, mdt = {"train": 1_000_000, "validation": 50_000}, 700
    rep = build_corpus(_dev_cfg(tmp_path, dev_inputs[0], gpt2_json, max_tokens=budgets, max_document_tokens=mdt))
    assert rep.tasks_read < rep.tasks
    tasks_records = records(dev_inputs[0], 4 << 20)
    ex = model(tasks_records, encode=dev_encode, budgets=budgets, mdt=mdt)
    check_content(tmp_path / "manifests" / "shards.json", ex, dev_encode, eos=50256, mdt=mdt)
    for split, budget in budgets.items():
        lens = [min(len(dev_encode(t)) + 1, mdt) for t in ex.docs[split]]
        assert sum(lens[:-1]) < budget <= sum(lens) == rep.splits[split]["tokens"]
        assert rep.splits[split]["truncated"] == sum(len(dev_encode(t)) + 1 > mdt for t in ex.docs[split]) > 0
    assert validate_corpus(tmp_path / "manifests" / "shards.json").ok


def test_dev_corpus_kill_9_then_resume_gives_identical_bytes(tmp_path, dev_build, dev_inputs, gpt2_json):
    cfg = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in asdict(_dev_cfg(tmp_path / "k", dev_inputs[0], gpt2_json)).items()
        if k != "filters"
    }
    root, rep = dev_build
    # Reference: the in-process 2-worker build; a subprocess adds ~0.7 s of interpreter start-up.
    assert kill_and_resume(cfg, seed=3, points=2, reference=tree(root), duration=rep.elapsed_s + 0.7) >= 1
