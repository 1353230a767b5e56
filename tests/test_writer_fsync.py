"""ShardWriter(fsync=False): the same shard bytes, no fsync, still renamed into place atomically."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from h5corpus.storage.validate import validate_corpus
from h5corpus.storage.writer import PARTIAL_SUFFIX, ShardWriter, fsync_files
from tests.helpers import BYTE_IDENTITY, byte_encode, doc_id


def _write(path, texts, monkeypatch, **kw) -> tuple[object, int]:
    """Write ``texts`` into one shard; returns (ShardRecord, number of os.fsync calls)."""
    calls = []
    real = os.fsync
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
        with ShardWriter(path, split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=4096, **kw) as w:
            for t, a in zip(texts, byte_encode(texts)):
                w.add_document(np.append(a, BYTE_IDENTITY.eos_id), doc_id(t))
                assert path.with_name(path.name + PARTIAL_SUFFIX).exists() and not path.exists()
    return w.info, len(calls)


def test_fsync_false_writes_the_same_bytes_without_fsync(tmp_path, monkeypatch, stdlib_corpus_texts):
    """Only durability changes: file bytes and ShardRecord hashes are identical, the file appears
    under its name only at close, and no fsync is issued (the default issues three: the shard,
    its sidecar (format version 4), the folder once after both renames)."""
    texts = stdlib_corpus_texts[:40]
    a, n_default = _write(tmp_path / "a" / "train-00000.h5", texts, monkeypatch)
    b, n_off = _write(tmp_path / "b" / "train-00000.h5", texts, monkeypatch, fsync=False)
    assert n_default == 3 and n_off == 0
    assert (Path(a.path).read_bytes() == Path(b.path).read_bytes()) and a.tokens > 100_000
    assert Path(a.path + ".docs").read_bytes() == Path(b.path + ".docs").read_bytes()
    assert (a.docs_sha256, a.docs_bytes) == (b.docs_sha256, b.docs_bytes)
    assert (a.sha256, a.index_sha256, a.bytes, a.documents) == (b.sha256, b.index_sha256, b.bytes, b.documents)
    assert not list(tmp_path.rglob("*" + PARTIAL_SUFFIX))


def test_fsync_files_makes_unsynced_shards_durable(tmp_path, monkeypatch, stdlib_corpus_texts):
    """fsync_files: one fsync per file, then one per distinct folder unless dirs=False (for files
    written with fsync=False, e.g. before a manifest lists them); the shards stay valid."""
    from h5corpus.storage.manifest import Manifest, write_manifest

    infos = [
        _write(
            tmp_path / "s" / split / f"{split}-{i:05d}.h5",
            stdlib_corpus_texts[i * 5 : (i + 1) * 5],
            monkeypatch,
            fsync=False,
        )[0]
        for i, split in enumerate(["train", "train", "validation"])
    ]
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    folders = fsync_files(i.path for i in infos)
    assert len(calls) == 3 + 2 and sorted(folders) == sorted({Path(i.path).parent for i in infos})
    calls.clear()
    assert len(fsync_files((i.path for i in infos), dirs=False)) == 2 and len(calls) == 3
    monkeypatch.undo()
    m = Manifest(
        tokenizer=BYTE_IDENTITY,
        dtype="uint16",
        chunk_tokens=4096,
        shards=[i.relative_to(tmp_path) for i in infos],
    )
    write_manifest(tmp_path / "shards.json", m)
    assert validate_corpus(tmp_path / "shards.json").ok
