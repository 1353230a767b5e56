"""Format version 4: document ids and flags live in a sidecar beside each shard (``<shard>.docs``),
proven by the manifest's ``docs_sha256`` and bound to its shard by its header; readers never open
it to serve tokens; ``validate``, ``Corpus.doc_ids`` and the build's copy stage use it. Version 3
corpora (ids in the shard) still read and validate.

Oracles: sha256 of each source text computed here with hashlib, the sidecar read with ``struct``
straight from docs/FORMAT.md (``tests.helpers.read_sidecar``), the generating arrays."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5corpus.build import BuildConfig, build_corpus
from h5corpus.storage.format import FormatError
from h5corpus.storage.manifest import Manifest, read_manifest, write_manifest
from h5corpus.storage.reader import open_corpus, open_live
from h5corpus.storage.validate import validate_corpus
from h5corpus.storage.writer import ShardWriter
from tests.helpers import BYTE_IDENTITY, read_sidecar, subprocess_env, write_jsonl


def _synthetic(root: Path, version: int, shards: int = 2, docs: int = 40) -> tuple[Path, list[bytes], np.ndarray]:
    """``shards`` train shards of random byte documents (one in five flagged truncated, without EOS)
    written with ``ShardWriter(version=...)``. Returns the manifest, every 32-byte id and flag."""
    rng = np.random.default_rng(version)
    m = Manifest(tokenizer=BYTE_IDENTITY, dtype="uint16", chunk_tokens=64, shards_dir="../shards", version=version)
    mpath = root / "manifests" / "shards.json"
    ids, flags = [], []
    for s in range(shards):
        path = root / "shards" / "train" / f"train-{s:05d}.h5"
        with ShardWriter(path, split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=64, version=version) as w:
            for i in range(docs):
                body = rng.integers(0, 256, int(rng.integers(1, 30))).tolist()
                trunc = i % 5 == 4
                ids.append(hashlib.sha256(f"{s}/{i}".encode()).digest())
                flags.append(int(trunc))
                w.add_document(body if trunc else body + [256], ids[-1], truncated=trunc)
        m.shards.append(w.info.relative_to(mpath.parent))
    write_manifest(mpath, m)
    return mpath, ids, np.array(flags, np.uint8)


def _cli_validate(manifest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "h5corpus", "validate", str(manifest)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )


def test_v4_shards_hold_no_ids_and_the_sidecar_holds_them(tmp_path):
    """The shard has no /doc_ids or /doc_flags; the sidecar (read independently) holds the first 16
    bytes of every id and the flags, its header names the shard's token sha256 and index hash, and
    the manifest records its sha256 and size. Reader and validate agree."""
    mpath, ids, flags = _synthetic(tmp_path, 4)
    m = read_manifest(mpath)
    assert m.version == 4
    got_ids, got_flags = [], []
    for e in m.shards:
        with h5py.File(m.shard_path(e), "r") as f:
            assert set(f) == {"tokens", "doc_offsets", "chunk_xxh3", "offsets_xxh3"}
            assert f.attrs["version"] == 4
        i, fl, head = read_sidecar(m.shard_path(e))
        assert (head["sha256"], head["size"]) == (e.docs_sha256, e.docs_bytes)
        assert (head["tokens_sha256"], head["index_sha256"], head["documents"]) == (e.sha256, e.index_sha256, 40)
        got_ids.append(i)
        got_flags.append(fl)
    want = np.frombuffer(b"".join(x[:16] for x in ids), np.uint8).reshape(-1, 16)
    np.testing.assert_array_equal(np.concatenate(got_ids), want)
    np.testing.assert_array_equal(np.concatenate(got_flags), flags)
    c = open_corpus(mpath, "train")
    np.testing.assert_array_equal(c.doc_ids, want)
    np.testing.assert_array_equal(c.doc_flags, flags)
    assert validate_corpus(mpath, workers=1).ok
    raw = json.loads(mpath.read_text())["shards"][0]
    assert {"docs_sha256", "docs_bytes"} <= set(raw)


def test_version_3_corpus_still_reads_and_validates(tmp_path):
    """A version 3 corpus (ids and flags in the shard, no sidecar) opens, serves ids and flags and
    validates; a changed id is refused by its index hash."""
    mpath, ids, flags = _synthetic(tmp_path, 3)
    m = read_manifest(mpath)
    assert m.version == 3 and not list((tmp_path / "shards").rglob("*.docs"))
    c = open_corpus(mpath, "train")
    want = np.frombuffer(b"".join(x[:16] for x in ids), np.uint8).reshape(-1, 16)
    np.testing.assert_array_equal(c.doc_ids, want)
    np.testing.assert_array_equal(c.doc_flags, flags)
    assert validate_corpus(mpath, workers=1).ok
    with h5py.File(m.shard_path(m.shards[1]), "r+") as f:
        f["doc_ids"][3, 0] ^= 1
    with pytest.raises(FormatError, match=r"train-00001\.h5: the index .* differs from the manifest's index_sha256"):
        _ = open_corpus(mpath, "train").doc_ids
    assert {f.code for f in validate_corpus(mpath, workers=1).findings} == {"index_sha256"}


def test_flipped_byte_in_a_sidecar_is_refused_naming_the_shard(tmp_path):
    """One byte of an id changed in shard 1's sidecar: tokens still read (readers never open it),
    ``Corpus.doc_ids`` refuses naming the shard, ``validate`` reports it (exit 1, one line)."""
    mpath, _, _ = _synthetic(tmp_path, 4)
    m = read_manifest(mpath)
    side = Path(str(m.shard_path(m.shards[1])) + ".docs")
    data = bytearray(side.read_bytes())
    data[96 + 16 * 7 + 3] ^= 0x40
    side.write_bytes(bytes(data))
    c = open_corpus(mpath, "train")
    assert c.tokens(0, c.num_tokens).size == c.num_tokens and c.document(c.num_documents - 1).size > 0
    with pytest.raises(FormatError, match=r"train-00001\.h5: the sidecar's sha256 differs .*docs_sha256"):
        _ = c.doc_ids
    np.testing.assert_array_equal(c.shard_doc_meta(0)[0], read_sidecar(m.shard_path(m.shards[0]))[0])
    rep = validate_corpus(mpath, workers=1)
    assert [(f.shard, f.code) for f in rep.findings] == [(m.shards[1].path, "docs")]
    r = _cli_validate(mpath)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    fails = [ln for ln in r.stdout.splitlines() + r.stderr.splitlines() if "FAIL" in ln]
    assert len(fails) == 1 and "train-00001.h5" in fails[0] and "docs" in fails[0], r.stdout + r.stderr
    r = subprocess.run(  # inspect reads every shard's flags (truncated documents): refused by name
        [sys.executable, "-m", "h5corpus", "inspect", str(mpath), "--seq-len", "64"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout and "train-00001.h5" in r.stderr, r.stderr


def test_missing_sidecar_is_one_clear_error(tmp_path):
    """A deleted sidecar: tokens still read; ids refused naming the shard and the missing file;
    validate says which shard lacks it, exit 1."""
    mpath, _, _ = _synthetic(tmp_path, 4)
    m = read_manifest(mpath)
    Path(str(m.shard_path(m.shards[0])) + ".docs").unlink()
    c = open_corpus(mpath, "train")
    assert c.tokens(0, 10).size == 10
    with pytest.raises(FormatError, match=r"train-00000\.h5: its document sidecar train-00000\.h5\.docs is missing"):
        _ = c.doc_flags
    rep = validate_corpus(mpath, workers=1)
    assert [(f.shard, f.code) for f in rep.findings] == [(m.shards[0].path, "docs")]
    assert "train-00000.h5.docs is missing" in rep.findings[0].message
    r = _cli_validate(mpath)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "train-00000.h5.docs is missing" in r.stdout + r.stderr


def test_sidecar_swapped_from_another_shard_is_refused(tmp_path):
    """Shard 0's sidecar copied over shard 1's (same size: 40 documents each): refused as another
    shard's by its header, by the reader and by validate; an unlisted sidecar is reported too."""
    mpath, _, _ = _synthetic(tmp_path, 4)
    m = read_manifest(mpath)
    s0, s1 = (Path(str(m.shard_path(e)) + ".docs") for e in m.shards)
    assert s0.stat().st_size == s1.stat().st_size
    s1.write_bytes(s0.read_bytes())
    with pytest.raises(FormatError, match=r"train-00001\.h5: the sidecar belongs to another shard"):
        _ = open_corpus(mpath, "train").doc_ids
    (s0.parent / "stray.h5.docs").write_bytes(s0.read_bytes())
    rep = validate_corpus(mpath, workers=1)
    assert {(f.shard, f.code) for f in rep.findings} == {
        (m.shards[1].path, "docs"),
        ("../shards/train/stray.h5.docs", "unlisted"),
    }, rep.findings


def test_live_v4_shard_serves_ids_once_finished(tmp_path):
    """``open_live`` on a version 4 shard being written: documents appear as published; ids and
    flags are refused (one line) until the writer finishes, then read from the sidecar."""
    path = tmp_path / "live.h5"
    w = ShardWriter(path, split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=16)
    for i in range(20):
        w.add_document([i, i + 1, 256], bytes([i]) * 32)
    c = open_live(path)
    assert c.num_documents > 0
    with pytest.raises(FormatError, match="written when the shard is finished"):
        _ = c.doc_ids
    w.close()
    c.refresh()
    assert c.num_documents == 20
    np.testing.assert_array_equal(c.doc_ids, np.array([[i] * 16 for i in range(20)], np.uint8))


def test_build_writes_sidecars_equal_to_sha256_of_each_text(tmp_path):
    """A build with cross-task duplicates (so the finish stage copies the kept documents of some
    candidates, reading their ids from the candidates' sidecars) writes version 4: every stored id
    is sha256(text)[:16] of the document at that position, each shard has its sidecar, validate
    passes, and nothing else lies in the shards folder."""
    originals = [f"document number {i} " * (1 + i % 9) for i in range(120)]
    dups = originals[:60:7]
    texts = originals[:60]
    for i in range(60, 120):  # a copy of document i - 60 after document i: later tasks mix kept and dropped
        texts += [originals[i]] + ([originals[i - 60]] if originals[i - 60] in dups else [])
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    cfg = BuildConfig(
        sources=[str(src)],
        shards_dir=tmp_path / "shards",
        manifest=tmp_path / "manifests" / "shards.json",
        tokenizer="bytes",
        workers=1,
        task_bytes=2_000,
        chunk_tokens=256,
        shard_tokens=3_000,
    )
    rep = build_corpus(cfg)
    assert sum(rep.splits[s]["duplicates"] for s in rep.splits) == len(dups)
    m = read_manifest(cfg.manifest)
    assert m.version == 4
    by_id = {hashlib.sha256(t.encode()).digest()[:16]: t for t in texts}
    seen = 0
    for e in m.shards:
        ids, flags, head = read_sidecar(m.shard_path(e))
        assert (head["sha256"], head["tokens_sha256"]) == (e.docs_sha256, e.sha256)
        with h5py.File(m.shard_path(e), "r") as f:
            toks, offs = f["tokens"][:], f["doc_offsets"][:]
        for k in range(ids.shape[0]):
            text = by_id[ids[k].tobytes()]
            assert bytes(toks[offs[k] : offs[k + 1] - 1].astype(np.uint8)) == text.encode() and flags[k] == 0
            seen += 1
    assert seen == len(set(texts))
    files = {p.name for p in (tmp_path / "shards").rglob("*") if p.is_file() and not p.name.startswith(".")}
    assert files == {Path(e.path).name for e in m.shards} | {Path(e.path).name + ".docs" for e in m.shards}
    assert validate_corpus(cfg.manifest, workers=1).ok
