"""Format v2's verified reads: a flipped bit anywhere in a shard's token chunks raises on every read
path (``Corpus.tokens``, ``Corpus.document``, the window loader, the best-fit loader), naming the shard
and the chunk, for raw and compressed shards; validate names the chunk; version 1 corpora still open,
flagged unverified; ``h5corpus build`` writes the same bytes for any worker count and after a kill."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5corpus.loaders.bestfit import BestFitDataset
from h5corpus.loaders.window import SlidingWindowDataset
from h5corpus.storage.format import ChunkChecksumError, FormatError
from h5corpus.storage.manifest import Manifest, read_manifest, write_manifest
from h5corpus.storage.reader import UnverifiedCorpusWarning, open_corpus, open_live
from h5corpus.storage.validate import validate_corpus
from h5corpus.storage.writer import ShardWriter
from tests.helpers import BYTE_IDENTITY, byte_encode, doc_id, oracle_stream, subprocess_env, write_v1_corpus

C = 4096  # tokens per chunk of the test corpora


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, stdlib_corpus_texts) -> dict[str, Path]:
    """Two pristine one-shard corpora of the same documents (~100k byte ids, 25 chunks, the last
    partial): raw (the default) and gzip-compressed. Tests corrupt copies."""
    out = {}
    texts = stdlib_corpus_texts[:30]
    for kind in ("raw", "gzip"):
        root = tmp_path_factory.mktemp(f"verified-{kind}")
        m = Manifest(tokenizer=BYTE_IDENTITY, dtype="uint16", chunk_tokens=C, shards_dir="../shards")
        with ShardWriter(
            root / "shards" / "train" / "train-00000.h5",
            split="train",
            tokenizer=BYTE_IDENTITY,
            chunk_tokens=C,
            compression=None if kind == "raw" else "gzip",
        ) as w:
            for t, a in zip(texts, byte_encode(texts)):
                w.add_document(np.append(a, BYTE_IDENTITY.eos_id), doc_id(t))
        m.shards.append(w.info.relative_to(root / "manifests"))
        write_manifest(root / "manifests" / "shards.json", m)
        out[kind] = root / "manifests" / "shards.json"
    return out


def _copy(manifest: Path, dest: Path) -> Path:
    shutil.copytree(manifest.parent.parent, dest)
    return dest / "manifests" / "shards.json"


def _flip_bit(manifest: Path, chunk: str, seed: int) -> tuple[Path, int, int]:
    """Flip one bit of the stored bytes of chunk ``chunk`` (first / middle / last) of the shard's
    ``/tokens``, found with HDF5's own chunk query; returns (shard path, chunk index, global token
    position inside the chunk)."""
    m = read_manifest(manifest)
    path = m.shard_path(m.shards[0])
    with h5py.File(path, "r") as f:
        ds = f["tokens"]
        n_chunks = -(-ds.shape[0] // C)
        k = {"first": 0, "middle": n_chunks // 2, "last": n_chunks - 1}[chunk]
        info = ds.id.get_chunk_info_by_coord((k * C,))
        real = min(info.size, (ds.shape[0] - k * C) * 2)  # a raw chunk's real tokens, or the compressed bytes
        n_tokens = ds.shape[0]
    rng = np.random.default_rng(seed)
    at = info.byte_offset + int(rng.integers(0, real))
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([b ^ (1 << int(rng.integers(0, 8)))]))
    return path, k, min(k * C + 1, n_tokens - 1)


def _raises_naming(path: Path, k: int, fn) -> None:
    with pytest.raises(FormatError) as e:
        fn()
    msg = str(e.value)
    assert str(path) in msg and f"chunk {k:,} " in msg, msg


READS = {
    "tokens": lambda c, pos: c.tokens(0, c.num_tokens),
    "tokens_window": lambda c, pos: c.tokens(max(pos - 10, 0), min(pos + 10, c.num_tokens)),
    "document": lambda c, pos: c.document(int(np.searchsorted(c.doc_offsets, pos, side="right")) - 1),
    "window_loader": lambda c, pos: list(SlidingWindowDataset(c, 256, batch_size=4, seed=0)),
    "bestfit_loader": lambda c, pos: list(BestFitDataset(c, max_seq_len=256, batch_size=4, seed=0)),
}


@pytest.mark.parametrize("kind", ["raw", "gzip"])
@pytest.mark.parametrize("chunk", ["first", "middle", "last"])
@pytest.mark.parametrize("read", sorted(READS))
def test_a_flipped_bit_in_any_chunk_raises_on_every_read_path(corpora, tmp_path, kind, chunk, read):
    """One bit flipped on disk inside a chunk's stored bytes (raw tokens, the compressed final
    chunk, or a compressed shard's chunk): every read path that touches the chunk raises, naming
    the shard file and the chunk, in a fresh process state (a newly opened corpus)."""
    manifest = _copy(corpora[kind], tmp_path / "c")
    path, k, pos = _flip_bit(manifest, chunk, seed=zlib.crc32(f"{kind}/{chunk}/{read}".encode()) % 1000)
    c = open_corpus(manifest, "train")
    assert c.verified
    _raises_naming(path, k, lambda: READS[read](c, pos))


@pytest.mark.parametrize("document_mask", [False, True])
@pytest.mark.parametrize("chunk", ["first", "middle", "last"])
def test_the_window_loader_yields_every_batch_before_the_one_that_reads_a_corrupt_chunk(
    corpora, tmp_path, chunk, document_mask
):
    """On a fresh corpus the window loader serves the batches that do not touch a corrupt chunk,
    equal to the stream, and raises at the first batch that does (naming shard and chunk), every
    time that batch is read again."""
    manifest = _copy(corpora["raw"], tmp_path / "c")
    toks, _, _ = oracle_stream(manifest)
    path, k, _ = _flip_bit(manifest, chunk, seed=11)
    c = open_corpus(manifest, "train")
    L, B = 700, 3
    ds = SlidingWindowDataset(c, L, batch_size=B, seed=4, mode="random", document_mask=document_mask)
    starts = ds.plan()
    touches = (starts + L + 1 > k * C) & (starts < (k + 1) * C)  # window [a, a + L + 1) meets chunk k
    first_bad = int(np.argmax(touches)) // B
    assert touches.any() and first_bad > 0
    for _ in range(2):
        it = iter(ds)
        for i in range(first_bad):
            np.testing.assert_array_equal(
                next(it).tokens.numpy().view(np.uint16).reshape(-1, L + 1),
                np.stack([toks[a : a + L + 1] for a in starts[i * B : (i + 1) * B].tolist()]),
            )
        _raises_naming(path, k, lambda it=it: next(it))


def test_the_run_table_says_a_range_is_verified_only_once_each_of_its_chunks_is(corpora, tmp_path):
    """``RunTable.verified``: False while a chunk a range touches is unverified (also when another
    read verified its neighbours only), True once a read of any kind verified every one of them;
    a corrupt chunk never counts as verified, however often it is read."""
    manifest = _copy(corpora["raw"], tmp_path / "c")
    path, k, _ = _flip_bit(manifest, "middle", seed=5)
    c = open_corpus(manifest, "train")
    t = c.run_table()
    a = np.array([C + 5, 3 * C - 1], dtype=np.int64)  # ranges of C tokens over chunks 1-2 and 2-3
    assert not t.verified(a, C) and not t.verified(a[:1], C)
    c.tokens(C, 2 * C + 5)  # chunks 1 and 2, through Corpus.tokens (the readers)
    assert t.verified(a[:1], C) and not t.verified(a, C) and not t.verified(a[:1], 2 * C)
    c.tokens(3 * C, 3 * C + 1)
    assert t.verified(a, C)
    bad = np.array([k * C - 2], dtype=np.int64)
    for _ in range(2):
        assert not t.verified(bad, 4)
        _raises_naming(path, k, lambda: c.tokens(k * C - 2, k * C + 2))


def test_a_corrupt_chunk_raises_in_a_dataloader_worker(corpora, tmp_path):
    """The check runs where the tokens are read: in a DataLoader worker (spawned), the error names
    the shard and the chunk."""
    from torch.utils.data import DataLoader

    manifest = _copy(corpora["raw"], tmp_path / "c")
    path, k, _ = _flip_bit(manifest, "middle", seed=3)
    ds = SlidingWindowDataset(open_corpus(manifest, "train"), 256, batch_size=4, seed=0)
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(Exception) as e:
        list(loader)
    assert str(path) in str(e.value) and f"chunk {k:,} " in str(e.value)


def test_intact_chunks_read_equal_to_an_h5py_read_and_corrupt_ones_keep_raising(corpora, tmp_path):
    """Verification changes nothing on intact data (reads equal h5py's), and a corrupt chunk
    raises on every read of it, not only the first; other chunks stay readable."""
    manifest = _copy(corpora["raw"], tmp_path / "c")
    toks, _, _ = oracle_stream(manifest)
    path, k, _ = _flip_bit(manifest, "middle", seed=5)
    c = open_corpus(manifest, "train")
    np.testing.assert_array_equal(c.tokens(0, k * C), toks[: k * C])
    np.testing.assert_array_equal(c.tokens((k + 1) * C, c.num_tokens), toks[(k + 1) * C :])
    for _ in range(2):
        with pytest.raises(ChunkChecksumError) as e:
            c.tokens(k * C + 5, k * C + 6)
        assert e.value.chunk == k and e.value.path == str(path)
    c2 = open_corpus(manifest, "train", verify=False)  # the corruption is served when unverified
    assert not c2.verified and c2.integrity_note
    assert not np.array_equal(c2.tokens(k * C, (k + 1) * C), toks[k * C : (k + 1) * C])


def test_a_followed_shard_that_finishes_is_verified_on_the_memory_map_path(tmp_path, stdlib_corpus_texts):
    """open_live follows a shard while it is written; once the writer has finished, reads move to
    the memory map, whose chunks are checked against the checksums stored in the finished file
    (there is no manifest index to take them from): a flipped bit there raises, naming the chunk."""
    texts = stdlib_corpus_texts[:30]
    final = tmp_path / "train-00000.h5"
    w = ShardWriter(final, split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=C)
    for t, a in zip(texts[:10], byte_encode(texts[:10])):
        w.add_document(np.append(a, BYTE_IDENTITY.eos_id), doc_id(t))
    c = open_live(w.path)
    assert c.verified and not c.complete and c.read_paths() == ["h5py"]
    for t, a in zip(texts[10:], byte_encode(texts[10:])):
        w.add_document(np.append(a, BYTE_IDENTITY.eos_id), doc_id(t))
    w.close()
    c.refresh()
    assert c.complete
    with h5py.File(final, "r") as f:
        want = f["tokens"][:]
        k = -(-want.size // C) // 2
        at = f["tokens"].id.get_chunk_info_by_coord((k * C,)).byte_offset + 3
    with open(final, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([b ^ 0x10]))
    assert c.read_paths() == ["mmap"]
    np.testing.assert_array_equal(c.tokens(0, k * C), want[: k * C])
    with pytest.raises(ChunkChecksumError) as e:
        c.tokens(k * C + 1, k * C + 2)
    assert e.value.chunk == k and e.value.path == str(final)


@pytest.mark.parametrize("kind", ["raw", "gzip"])
def test_validate_names_the_corrupt_chunk(corpora, tmp_path, kind):
    """validate checks every chunk's checksum: a flipped bit is named as chunk_checksum with the
    chunk (raw shards: the token hash fails too; a compressed chunk that no longer decodes is
    unreadable)."""
    manifest = _copy(corpora[kind], tmp_path / "c")
    _, k, _ = _flip_bit(manifest, "middle", seed=7)
    r = validate_corpus(manifest, workers=1)
    codes = {f.code for f in r.findings}
    if "unreadable" in codes:
        assert kind == "gzip"
    else:
        assert {"chunk_checksum", "sha256"} <= codes, r.findings
        msg = next(f.message for f in r.findings if f.code == "chunk_checksum")
        assert f"first: chunk {k:,}," in msg


def test_a_tampered_checksum_is_caught_by_the_index_hash(corpora, tmp_path):
    """The checksums are covered by the manifest's sums_sha256 (and index_sha256): a rewritten
    checksum fails validate, and the reader refuses the shard when it first touches it, before
    trusting any of its checksums."""
    manifest = _copy(corpora["raw"], tmp_path / "c")
    m = read_manifest(manifest)
    with h5py.File(m.shard_path(m.shards[0]), "r+") as f:
        f["chunk_xxh3"][3] ^= np.uint64(1)
    codes = {f.code for f in validate_corpus(manifest).findings}
    assert {"index_sha256", "sums_sha256", "chunk_checksum"} <= codes
    c = open_corpus(manifest, "train")
    for read in (lambda: c.tokens(3 * C, 3 * C + 10), lambda: c.tokens(0, 1), lambda: c.doc_offsets_range(0, 1)):
        with pytest.raises(FormatError, match=f"{m.shards[0].path.rsplit('/', 1)[-1]}: .*sums_sha256"):
            read()


def test_version_1_corpora_open_unverified_and_read_the_same_tokens(tmp_path, stdlib_corpus_texts):
    """A corpus written to the version 1 contract (by an independent writer) still opens: with an
    UnverifiedCorpusWarning, ``verified`` False and a note saying why, in ``inspect`` too; its
    tokens and documents equal the same documents written as version 2, and validate passes."""
    texts = stdlib_corpus_texts[:40]
    v1 = write_v1_corpus(tmp_path / "v1", texts)
    with pytest.warns(UnverifiedCorpusWarning, match="version 1"):
        c1 = open_corpus(v1, "train")
    assert not c1.verified and "no chunk checksums" in c1.integrity_note
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a version 2 corpus opens without the warning
        m = Manifest(tokenizer=BYTE_IDENTITY, dtype="uint16", chunk_tokens=C, shards_dir="../shards")
        with ShardWriter(
            tmp_path / "v2" / "shards" / "train" / "t.h5", split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=C
        ) as w:
            for t, a in zip(texts, byte_encode(texts)):
                if a.size:
                    w.add_document(np.append(a, 256), doc_id(t))
        m.shards.append(w.info.relative_to(tmp_path / "v2" / "manifests"))
        write_manifest(tmp_path / "v2" / "manifests" / "shards.json", m)
        c2 = open_corpus(tmp_path / "v2" / "manifests" / "shards.json", "train")
    assert c2.verified and c2.integrity_note is None
    np.testing.assert_array_equal(c1.tokens(0, c1.num_tokens), c2.tokens(0, c2.num_tokens))
    np.testing.assert_array_equal(c1.doc_offsets, c2.doc_offsets)
    assert c1.document(7).tolist() == c2.document(7).tolist()
    assert len(list(SlidingWindowDataset(c1, 128, seed=0))) > 0
    assert validate_corpus(v1).ok
    p = subprocess.run(
        [sys.executable, "-m", "h5corpus", "inspect", str(v1), "--seq-len", "256"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "UNVERIFIED" in p.stdout and "no chunk checksums" in p.stdout


def test_an_unknown_format_version_is_refused(tmp_path, stdlib_corpus_texts):
    v1 = write_v1_corpus(tmp_path / "v", stdlib_corpus_texts[:5])
    raw = json.loads(v1.read_text())
    raw["version"] = 5
    v1.write_text(json.dumps(raw))
    with pytest.raises(FormatError, match="format version 5 is not supported"):
        open_corpus(v1, "train")


# -- the build: same bytes for any worker count and after kill -9 -----------------------------------------


def _build(cwd: Path, sources: list[Path], workers: int, crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = subprocess_env()
    if crash_at:
        env["H5CORPUS_TEST_CRASH_AT"] = crash_at
    args = ["build", *map(str, sources), "--tokenizer", "bytes", "--workers", str(workers), "--shard-tokens", "300000"]
    return subprocess.run(
        [sys.executable, "-m", "h5corpus", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _shard_bytes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for pattern in ("*.h5", "*.h5.docs")  # format version 4: each shard and its sidecar
        for p in sorted((root / "shards").rglob(pattern))
    }


def test_build_writes_identical_shards_for_any_worker_count_and_after_kill_9(tmp_path, stdlib_corpus_texts):
    """``h5corpus build`` with 1 and 2 workers, and a 2-worker build SIGKILLed (the crash-point
    hook) while finishing and then resumed, write byte-identical v4 shards and sidecars that
    validate and carry one checksum per chunk."""
    src = [tmp_path / f"in-{i}.jsonl" for i in range(4)]  # a task (or more) per file
    for i, p in enumerate(src):
        p.write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_corpus_texts[i::4]), encoding="utf-8")
    roots = {}
    for name in ("w1", "w2", "killed"):
        roots[name] = tmp_path / name
        roots[name].mkdir()
    for name in ("w1", "w2"):
        p = _build(roots[name], src, 1 if name == "w1" else 2)
        assert p.returncode == 0, p.stderr[-2000:]
    p = _build(roots["killed"], src, 2, crash_at="finish-renamed:2")
    assert p.returncode == -9, (p.returncode, p.stderr[-2000:])
    p = _build(roots["killed"], src, 2)
    assert p.returncode == 0, p.stderr[-2000:]
    ref = _shard_bytes(roots["w1"])
    assert len(ref) >= 3
    assert _shard_bytes(roots["w2"]) == ref and _shard_bytes(roots["killed"]) == ref
    manifest = roots["killed"] / "manifests" / "shards.json"
    assert validate_corpus(manifest).ok
    m = read_manifest(manifest)
    assert m.version == 4 and sum(k.endswith(".docs") for k in ref) == len(m.shards)
    for s in m.shards:
        with h5py.File(m.shard_path(s), "r") as f:
            assert f.attrs["version"] == 4 and f["chunk_xxh3"].shape == (-(-s.tokens // m.chunk_tokens),)
            assert f["offsets_xxh3"].shape == (-(-(s.documents + 1) // 1024),) and s.sums_sha256
    assert not list(tmp_path.rglob("*.partial")) and not os.path.exists(roots["killed"] / "shards" / ".build")
    assert list(itertools.islice(iter(SlidingWindowDataset(open_corpus(manifest, "train"), 64, seed=0)), 2))


def test_the_last_few_unverified_chunks_are_swept_but_a_corrupt_one_still_raises_when_read(corpora, tmp_path):
    """Once at most ``SWEEP_SHARE`` of a run table's chunks are unverified, a locate verifies them
    all (none is left to cost every later locate); a corrupt one stays unverified and the read
    that touches it raises naming it, as before."""
    from h5corpus.storage.readpaths import SWEEP_SHARE

    manifest = _copy(corpora["raw"], tmp_path / "c")
    path, k, pos = _flip_bit(manifest, "middle", seed=7)
    c = open_corpus(manifest, "train")
    t = c.run_table()
    chunks = t._chunk_start
    assert 2 <= SWEEP_SHARE * chunks.size < chunks.size - 2  # the sweep waits until two are left, not longer
    g = int(np.searchsorted(chunks, pos, side="right")) - 1  # the corrupt chunk's index in the table
    others = np.delete(chunks, [g, g + 1])  # every chunk's first token but the corrupt one's and the next's
    t.locate(others)
    assert t.pending == 1  # the next chunk was swept, the corrupt one was not
    _raises_naming(path, k, lambda: t.locate(np.array([pos], dtype=np.int64)))
    _raises_naming(path, k, lambda: c.tokens(pos, pos + 1))
    assert t.pending == 1
