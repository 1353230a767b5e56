"""`h5corpus inspect`: figures agree with independent computations; every seed check can fail."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from h5corpus import inspection
from h5corpus.inspection import format_report, inspect_corpus
from h5corpus.loaders import bestfit as packing
from h5corpus.loaders import chunking
from h5corpus.storage import format as fmt
from h5corpus.storage.manifest import Manifest, read_manifest, write_manifest
from h5corpus.storage.writer import ShardWriter
from tests.helpers import (
    BYTE_IDENTITY,
    byte_encode,
    doc_id,
    rebind_sidecar,
    reseal_chunk_checksums,
    stdlib_texts,
    write_corpus,
)


def naive_best_fit(lengths: list[int], capacity: int, buffer: int) -> list[int]:
    """The seed's algorithm written plainly: top the buffer up, take the longest chunk that fits
    (oldest first among equals), repeat until none fits. Returns each pack's load."""
    stream, buf, loads = list(lengths), [], []
    pos = 0
    while pos < len(stream) or buf:
        room, load = capacity, 0
        while True:
            while len(buf) < buffer and pos < len(stream):
                buf.append(stream[pos])
                pos += 1
            fits = [(n, -k) for k, n in enumerate(buf) if n <= room]
            if not fits:
                break
            n, negk = max(fits)
            buf.pop(-negk)
            room -= n
            load += n
        if load == 0:
            break
        loads.append(load)
    return loads


def independent_chunks(n_tokens: int, seq_len: int) -> list[int]:
    pairs = n_tokens - 1
    return [seq_len] * (pairs // seq_len) + ([pairs % seq_len] if pairs % seq_len else [])


def test_figures_agree_with_independent_computation_on_dev_corpus(dev_manifest):
    """Counts, pairs, chunk lengths and best-fit fill equal a from-scratch computation."""
    rep = inspect_corpus(dev_manifest, seq_len=4096, batch_size=35, packing_buffer=64)
    m = read_manifest(dev_manifest)
    for split in ("train", "validation"):
        lengths = []
        for s in m.shards_of(split):
            with h5py.File(m.shard_path(s), "r") as f:
                lengths.append(np.diff(f["doc_offsets"][:]))
        L = np.concatenate(lengths)
        got = rep.splits[split]
        assert got["documents"] == L.size
        assert got["raw_tokens"] == int(L.sum())
        assert got["prediction_pairs"] == int(L.sum()) - L.size
        assert got["length_tokens"]["max"] == int(L.max()) and got["length_tokens"]["min"] == int(L.min())
        assert got["documents_longer_than_seq_len"] == int(np.count_nonzero(L - 1 > 4096))
        for ex in got["long_document_examples"]:
            assert ex["chunk_lengths"] == independent_chunks(ex["tokens"], 4096)
        assert got["chunks"] == sum(len(independent_chunks(int(n), 4096)) for n in L)
        # fill: the documented chunk order (chunks in corpus order, then permuted), packed by the naive algorithm
        chunks = [c for n in L for c in independent_chunks(int(n), 4096)]
        stream = [chunks[i] for i in np.random.default_rng([0, 0]).permutation(len(chunks)).tolist()]
        loads = naive_best_fit(stream, 4096, 64)
        assert got["packing"]["packs"] == len(loads)
        assert got["packing"]["real_tokens"] == sum(loads) == got["prediction_pairs"]
        assert got["packing"]["fill"] == pytest.approx(sum(loads) / (len(loads) * 4096), abs=1e-6)
        assert got["packing"]["microbatches"] == -(-len(loads) // 35)
    assert rep.ok, format_report(rep)
    assert rep.splits["train"]["packing"]["fill"] > 0.99


def test_seed_examples_chunk_lengths():
    """8,991 tokens with EOS -> 4096, 4096, 798 (seed 002); 9,000 text tokens + EOS -> 4096, 4096, 808."""
    _, _, l1 = chunking.document_chunks(np.array([8991]), 4096)
    _, _, l2 = chunking.document_chunks(np.array([9001]), 4096)
    assert l1.tolist() == [4096, 4096, 798] and l2.tolist() == [4096, 4096, 808]


# -- each check can be made to fail -----------------------------------------------------------------


@pytest.fixture
def small_manifest(tmp_path) -> Path:
    return write_corpus(
        tmp_path,
        stdlib_texts(80),
        byte_encode,
        BYTE_IDENTITY,
        chunk_tokens=4096,
        shard_tokens=300_000,
        validation_every=8,
    )


def _failed(rep) -> set[str]:
    return {c.name.split("] ")[-1] for c in rep.checks if not c.passed}


def test_intact_small_corpus_passes_every_check(small_manifest):
    rep = inspect_corpus(small_manifest, seq_len=1024, batch_size=4)
    assert rep.ok and len(rep.checks) == 9, format_report(rep)


def test_document_in_both_splits_fails_the_leakage_check(tmp_path):
    texts = stdlib_texts(12)
    m = Manifest(tokenizer=BYTE_IDENTITY, dtype="uint16", chunk_tokens=4096)
    for split, part in (("train", texts[:8]), ("validation", texts[7:])):  # texts[7] in both
        with ShardWriter(
            tmp_path / "shards" / f"{split}.h5", split=split, tokenizer=BYTE_IDENTITY, chunk_tokens=4096
        ) as w:
            for t, ids in zip(part, byte_encode(part)):
                w.add_document(np.append(ids, 256), doc_id(t))
        m.shards.append(w.info.relative_to(tmp_path / "manifests"))
    write_manifest(tmp_path / "manifests" / "shards.json", m)
    rep = inspect_corpus(tmp_path / "manifests" / "shards.json", seq_len=512, batch_size=2)
    assert _failed(rep) == {"no source document id in both splits"}
    assert "1 ids shared" in str(rep.checks[0])


def test_chunking_that_drops_a_pair_fails(small_manifest, monkeypatch):
    real = chunking.document_chunks

    def lossy(lengths, max_seq_len):
        doc, start, length = real(lengths, max_seq_len)
        last = np.r_[doc[1:] != doc[:-1], True]
        length = length.copy()
        length[last & (length > 1)] -= 1  # forget each document's final pair (the one predicting EOS)
        return doc, start, length

    monkeypatch.setattr(chunking, "document_chunks", lossy)
    rep = inspect_corpus(small_manifest, seq_len=1024, batch_size=4)
    assert "chunking neither drops nor duplicates a pair and keeps the real EOS" in _failed(rep)


def test_padded_batches_fail_the_input_length_check(small_manifest, monkeypatch):
    real = packing._SegmentReads.batch
    capacity = 2 * 100_000  # batch_size x seq_len below: what a padding loader materializes

    def padded(self, mb):
        b = real(self, mb)
        b.input_ids = torch.cat([b.input_ids, torch.zeros(capacity - b.num_tokens, dtype=torch.int64)])
        return b

    monkeypatch.setattr(packing._SegmentReads, "batch", padded)
    rep = inspect_corpus(small_manifest, seq_len=100_000, batch_size=2)  # whole documents leave room in packs
    assert "model input length = real input count; positions restart per segment" in _failed(rep)


def test_sampler_that_forgets_its_state_fails_the_restore_check(small_manifest, monkeypatch):
    monkeypatch.setattr(packing.BestFitDataset, "load_state_dict", lambda self, state: None)
    rep = inspect_corpus(small_manifest, seq_len=1024, batch_size=4)
    assert _failed(rep) == {"restoring the sampler state continues with the same next batch"}


def reseal(manifest: Path, shard) -> None:
    """Chunk checksums rewritten to match edited tokens, and (format v3) the manifest's record of
    them: what a writer that produced those tokens consistently would have left."""
    m = read_manifest(manifest)
    path = m.shard_path(shard)
    reseal_chunk_checksums(path)
    if shard.sums_sha256 is None:
        return
    with h5py.File(path, "r") as f:
        sums = (f[fmt.CHUNK_CHECKSUMS][:], f[fmt.OFFSETS_CHECKSUMS][:])
        proof = fmt.sums_sha256(*sums)
        index = fmt.index_sha256_v4(f[fmt.DOC_OFFSETS][:], *sums)
    edit = {"sums_sha256": proof, "index_sha256": index}
    raw = {"sha256": shard.sha256, "index_sha256": index}
    rebind_sidecar(path, raw)  # the sidecar names the shard's index hash: the writer would have written it so
    edit["docs_sha256"] = raw["docs_sha256"]
    m.shards = [dataclasses.replace(e, **edit) if e.path == shard.path else e for e in m.shards]
    write_manifest(manifest, m)


def test_misplaced_eos_fails_the_eos_check(small_manifest):
    m = read_manifest(small_manifest)
    s = m.shards_of("train")[0]
    with h5py.File(m.shard_path(s), "r+") as f:
        offs = f["doc_offsets"][:]
        f["tokens"][offs[1] - 1] = ord("x")  # document 0 loses its EOS
        f["tokens"][offs[2] + 5] = 256  # document 2 gains one inside
    reseal(small_manifest, s)  # as if written so: the content check, not the checksum, fails
    rep = inspect_corpus(small_manifest, seq_len=1024, batch_size=4)
    failed = [c for c in rep.checks if not c.passed]
    assert "every document ends with EOS and no EOS elsewhere" in _failed(rep)
    eos = next(c for c in failed if "EOS elsewhere" in c.name)
    assert "1 of" in eos.figure and "1 EOS inside" in eos.figure


def test_cli_table_json_plot_and_exit_codes(small_manifest, tmp_path, monkeypatch):
    def run(*a):
        return subprocess.run([sys.executable, "-m", "h5corpus", "inspect", *a], capture_output=True, text=True)

    png, out = tmp_path / "stats.png", tmp_path / "stats.json"
    r = run(str(small_manifest), "--seq-len", "1024", "--batch-size", "4", "--plot", str(png), "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert "prediction pairs" in r.stdout and "ALL CHECKS PASSED" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    data = json.loads(out.read_text())
    assert data["ok"] is True and set(data["splits"]) == {"train", "validation"}
    j = run(str(small_manifest), "--json", "--split", "validation")
    assert json.loads(j.stdout)["splits"].keys() == {"validation"}
    assert run(str(tmp_path / "missing.json")).returncode == 2
    m = read_manifest(small_manifest)
    with h5py.File(m.shard_path(m.shards_of("train")[0]), "r+") as f:
        f["tokens"][int(f["doc_offsets"][1]) - 1] = ord("x")
    corrupt = run(str(small_manifest))  # the edited chunk no longer matches its checksum
    assert corrupt.returncode == 1 and "fails its checksum" in corrupt.stderr, corrupt.stderr
    assert "Traceback" not in corrupt.stderr and str(m.shard_path(m.shards_of("train")[0])) in corrupt.stderr
    reseal(small_manifest, m.shards_of("train")[0])
    bad = run(str(small_manifest))
    assert bad.returncode == 1 and "CHECK(S) FAILED" in bad.stdout


# -- streaming: figures shard by shard equal whole-corpus oracles ---------------------------------------


def _all_lengths(manifest: Path, split: str) -> np.ndarray:
    """Every document's length read straight from the shard files (independent of the reader)."""
    m = read_manifest(manifest)
    out = []
    for s in m.shards_of(split):
        with h5py.File(m.shard_path(s), "r") as f:
            out.append(np.diff(f["doc_offsets"][:]))
    return np.concatenate(out)


@pytest.mark.parametrize("dense", [1 << 20, 7])
def test_length_quantiles_equal_numpy_percentile_nearest(dense, monkeypatch):
    """Exact quantiles from counts (dense bins and, past ``DENSE_LENGTHS``, a dict) equal
    np.percentile(method="nearest") over the lengths, ties and odd/even counts included."""
    monkeypatch.setattr(inspection, "DENSE_LENGTHS", dense)
    rng = np.random.default_rng(5)
    for n in (1, 2, 3, 10, 101, 1000, 4097):
        lengths = np.concatenate([rng.integers(1, 12, n // 2 + 1), rng.integers(1, 5000, n - n // 2 - 1)])
        counts = inspection._LengthCounts()
        for part in np.array_split(lengths, 3):  # added shard by shard
            counts.add(part)
        q = np.percentile(lengths, [50, 90, 99], method="nearest")
        want = {"min": lengths.min(), "median": q[0], "p90": q[1], "p99": q[2], "max": lengths.max()}
        assert counts.quantiles() == {k: int(v) for k, v in want.items()}, n


@pytest.fixture
def many_shards(tmp_path) -> Path:
    """~400 documents of varied lengths in many small shards of both splits."""
    texts = stdlib_texts(400)
    return write_corpus(
        tmp_path, texts, byte_encode, BYTE_IDENTITY, chunk_tokens=4096, shard_tokens=60_000, validation_every=5
    )


def test_streamed_figures_equal_whole_corpus_oracles(many_shards, monkeypatch):
    """Shard by shard, with the pack-fill sample forced below the document count: every exact
    figure equals a computation over all documents at once; the sample is stated and its fill
    close to the whole split's."""
    m = read_manifest(many_shards)
    assert len(m.shards_of("train")) > 3
    full = inspect_corpus(many_shards, seq_len=512, batch_size=4)
    monkeypatch.setattr(inspection, "SAMPLE_DOCUMENTS", 150)
    rep = inspect_corpus(many_shards, seq_len=512, batch_size=4)
    assert rep.ok, format_report(rep)
    for split in ("train", "validation"):
        L = _all_lengths(many_shards, split)
        got = rep.splits[split]
        flat = np.concatenate([h5py.File(m.shard_path(s), "r")["tokens"][:] for s in m.shards_of(split)]).astype(
            np.int64
        )
        hist = np.bincount(flat, minlength=257)
        q = np.percentile(L, [50, 90, 99], method="nearest")
        assert got["length_tokens"] == {
            "min": int(L.min()),
            "median": int(q[0]),
            "p90": int(q[1]),
            "p99": int(q[2]),
            "max": int(L.max()),
        }
        assert got["prediction_pairs"] == int((L - 1).sum())
        assert got["chunks"] == sum(len(independent_chunks(int(n), 512)) for n in L)
        assert got["documents_longer_than_seq_len"] == int(np.count_nonzero(L - 1 > 512))
        longest = sorted(range(L.size), key=lambda i: (-L[i], i))[:5]
        assert [e["document"] for e in got["long_document_examples"]] == [i for i in longest if L[i] - 1 > 512]
        assert got["vocabulary_used"] == int(np.count_nonzero(hist))
        assert [t["count"] for t in got["top_tokens"]] == sorted(hist[hist > 0].tolist(), reverse=True)[:20]
        assert got["eos"] == {"bad_ends": 0, "eos_inside": 0, "whole_documents": L.size}
        n = got["packing"]["sampled_documents"]
        assert full.splits[split]["packing"]["sampled_documents"] == L.size
        if L.size > 150:
            assert 50 < n < 300 and n != L.size
            assert got["packing"]["fill"] == pytest.approx(full.splits[split]["packing"]["fill"], abs=0.05)
        else:
            assert got["packing"] == full.splits[split]["packing"]
