"""Format version 3: a corpus opens from its manifest alone, shards are checked when a process
first touches them, the index is consulted lazily and verified chunk by chunk, and the trust chain
manifest -> checksum tables -> chunks refuses any byte changed after the build, naming the shard,
on every read path. Also: version 2 corpora still read, and more shards than file descriptors.

Oracles: the token and length arrays the test generated itself, and hashes computed here with
hashlib/xxhash straight from docs/FORMAT.md."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
import xxhash

from h5corpus.storage.format import FormatError
from h5corpus.storage.manifest import Manifest, read_manifest, write_manifest
from h5corpus.storage.reader import open_corpus
from h5corpus.storage.validate import validate_corpus
from h5corpus.storage.writer import ShardWriter
from tests.helpers import BYTE_IDENTITY, rebind_sidecar, subprocess_env, write_v1_corpus

C = 512  # tokens per chunk: documents span chunks


def synthetic(root: Path, shards: int, docs: int, seed: int = 0) -> tuple[Path, np.ndarray, np.ndarray]:
    """``shards`` train shards of ``docs`` random byte documents each (1-40 ids + EOS), written by
    the real writer. Returns the manifest, the global token stream and the document offsets (the
    test's own arrays: the oracle)."""
    rng = np.random.default_rng(seed)
    m = Manifest(tokenizer=BYTE_IDENTITY, dtype="uint16", chunk_tokens=C, shards_dir="../shards")
    mpath = root / "manifests" / "shards.json"
    streams, lengths = [], []
    for s in range(shards):
        n = rng.integers(1, 41, docs)
        flat = rng.integers(0, 256, int(n.sum())).astype(np.uint16)
        ends = np.cumsum(n + 1) - 1
        toks = np.insert(flat, np.cumsum(n), 256)  # EOS after each document
        assert (toks[ends] == 256).all()
        ids = np.frombuffer(rng.bytes(32 * docs), np.uint8).reshape(docs, 32)
        with ShardWriter(root / "shards" / "train" / f"t-{s:05d}.h5", split="train", tokenizer=BYTE_IDENTITY,
                         chunk_tokens=C, fsync=False) as w:  # fmt: skip
            w.add_documents(toks, n + 1, ids)
        m.shards.append(w.info.relative_to(mpath.parent))
        streams.append(toks)
        lengths.append(n + 1)
    write_manifest(mpath, m)
    lens = np.concatenate(lengths)
    return mpath, np.concatenate(streams), np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


@pytest.fixture
def big_index(tmp_path) -> tuple[Path, np.ndarray, np.ndarray]:
    """3 shards of 2,600 documents: three /doc_offsets chunks per shard."""
    return synthetic(tmp_path, 3, 2600)


def test_open_reads_no_shard_and_the_index_is_consulted_lazily(big_index):
    """With every shard file gone, the corpus still opens and knows its sizes and fingerprint (the
    manifest's); the first read then names the missing shard. Intact, the lazy queries equal the
    oracle across offsets-chunk and shard boundaries, and touch only the chunks they need."""
    mpath, toks, offs = big_index
    m = read_manifest(mpath)
    moved = [(p, p.with_suffix(".away")) for p in (m.shard_path(s) for s in m.shards)]
    for a, b in moved:
        a.rename(b)
    c = open_corpus(mpath, "train")
    assert (c.num_documents, c.num_tokens, c.num_shards) == (offs.size - 1, toks.size, 3)
    assert c.shard_doc_starts.tolist() == [0, 2600, 5200, 7800] and len(c.fingerprint) == 64
    with pytest.raises(FormatError, match=r"t-00001\.h5: shard file not found"):
        c.doc_offsets_range(3000, 3001)
    for a, b in moved:
        b.rename(a)
    c = open_corpus(mpath, "train")
    np.testing.assert_array_equal(c.doc_offsets_range(2599, 2601), offs[2599:2602])  # across a shard
    assert set(c._indexes) == {0, 1} and c._indexes[0].ready.tolist() == [True, False, True]  # ends + the one asked
    for lo, hi in [(0, 0), (1023, 1025), (0, 7800), (5199, 5201), (7800, 7800), (100, 5300)]:
        np.testing.assert_array_equal(c.doc_offsets_range(lo, hi), offs[lo : hi + 1])
    pos = np.concatenate([offs[:-1], offs[1:] - 1, np.random.default_rng(1).integers(0, toks.size, 999)])
    np.testing.assert_array_equal(c.doc_index_at(pos), np.searchsorted(offs, pos, side="right") - 1)
    for i in (0, 1023, 1024, 2599, 2600, 7799):
        np.testing.assert_array_equal(c.document(i), toks[offs[i] : offs[i + 1]])
    np.testing.assert_array_equal(c.doc_lengths(), np.diff(offs))
    np.testing.assert_array_equal(c.doc_offsets, offs)
    assert validate_corpus(mpath, workers=1).ok


def _offsets_chunk_byte(shard: Path, chunk: int) -> int:
    """File offset of /doc_offsets chunk ``chunk`` (HDF5's own chunk index)."""
    with h5py.File(shard, "r") as f:
        return f["doc_offsets"].id.get_chunk_info(chunk).byte_offset


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x10]))


READS = {
    "doc_offsets_range": lambda c: c.doc_offsets_range(2600 + 1500, 2600 + 1501),
    "doc_index_at": lambda c: c.doc_index_at(np.array([int(c.shard_token_starts[2]) - 1])),
    "document": lambda c: c.document(2600 + 1500),
    "doc_lengths": lambda c: c.doc_lengths(),
    "doc_offsets": lambda c: c.doc_offsets,
}


@pytest.mark.parametrize("read", sorted(READS))
def test_a_flipped_offsets_byte_is_refused_naming_the_shard(big_index, read):
    """One bit flipped in a /doc_offsets chunk of shard 1 after the build: every index read path
    that reaches that chunk refuses it, naming the shard and the chunk; other chunks still serve."""
    mpath, toks, offs = big_index
    m = read_manifest(mpath)
    shard = m.shard_path(m.shards[1])
    _flip(shard, _offsets_chunk_byte(shard, 1) + 8 * (1500 - 1024) + 1)
    c = open_corpus(mpath, "train")
    with pytest.raises(FormatError, match=r"t-00001\.h5: chunk 1 of /doc_offsets fails its checksum"):
        READS[read](c)
    np.testing.assert_array_equal(c.doc_offsets_range(2600, 2610), offs[2600:2611])  # chunk 0 of that shard
    assert any(f.code == "offsets_checksum" for f in validate_corpus(mpath, workers=1).findings)


@pytest.mark.parametrize("read_path", ["auto", "h5py"])
@pytest.mark.parametrize("table", ["chunk_xxh3", "offsets_xxh3"])
def test_a_token_changed_with_its_checksum_is_refused_on_every_read_path(big_index, read_path, table):
    """A token rewritten together with its chunk's checksum (or an offsets checksum rewritten):
    the manifest's sums_sha256 no longer proves the tables, so the first touch of the shard
    refuses it on every read path, before any of its bytes is served."""
    mpath, toks, offs = big_index
    m = read_manifest(mpath)
    shard = m.shard_path(m.shards[2])
    with h5py.File(shard, "r+") as f:
        if table == "chunk_xxh3":
            t = f["tokens"][:C]
            t[7] = (int(t[7]) + 1) % 256
            f["tokens"][7] = t[7]
            f["chunk_xxh3"][0] = np.uint64(xxhash.xxh3_64_intdigest(t.astype("<u2").tobytes()))
        else:
            f["offsets_xxh3"][0] ^= np.uint64(1)
    raw = json.loads(mpath.read_text())
    raw["shards"][2]["bytes"] = shard.stat().st_size
    mpath.write_text(json.dumps(raw))
    g = int(open_corpus(mpath, "train").shard_token_starts[2])
    reads = [
        lambda c: c.tokens(g, g + 10),
        lambda c: c.gather(np.array([g]), 10),
        lambda c: c.gather_ranges(np.array([g]), np.array([10])),
        lambda c: c.document(5200),
        lambda c: c.doc_offsets_range(5200, 5201),
        lambda c: c.run_table(),
    ]
    for read in reads:
        c = open_corpus(mpath, "train", read_path=read_path)
        with pytest.raises(FormatError, match=r"t-00002\.h5: /chunk_xxh3 and /offsets_xxh3 differ .*sums_sha256"):
            read(c)
    codes = {f.code for f in validate_corpus(mpath, workers=1).findings}
    assert "sums_sha256" in codes


def test_an_id_at_or_above_vocab_is_refused_when_its_chunk_is_verified(big_index):
    """A shard whose every hash agrees with an id >= vocab_size (a buggy writer): the reader refuses
    the chunk holding it the first time it verifies it (a max per chunk); validate names it too."""
    mpath, toks, offs = big_index
    m = read_manifest(mpath)
    shard = m.shard_path(m.shards[0])
    with h5py.File(shard, "r+") as f:
        f["tokens"][C + 3] = 300
        t = f["tokens"][:].astype("<u2")
        sums = np.array([xxhash.xxh3_64_intdigest(t[a : a + C].tobytes()) for a in range(0, t.size, C)], "<u8")
        f["chunk_xxh3"][:] = sums
        osums = f["offsets_xxh3"][:].astype("<u8").tobytes()
        index = f["doc_offsets"][:].tobytes() + sums.tobytes() + osums  # version 4: ids are the sidecar's
    raw = json.loads(mpath.read_text())
    e = raw["shards"][0]
    e.update(sha256=hashlib.sha256(t.tobytes()).hexdigest(), index_sha256=hashlib.sha256(index).hexdigest())
    e.update(sums_sha256=hashlib.sha256(sums.tobytes() + osums).hexdigest(), bytes=shard.stat().st_size)
    rebind_sidecar(shard, e)
    mpath.write_text(json.dumps(raw))
    for read_path in ("auto", "h5py"):
        c = open_corpus(mpath, "train", read_path=read_path)
        np.testing.assert_array_equal(c.tokens(0, C), t[:C])  # chunk 0 is fine
        with pytest.raises(
            FormatError, match=r"t-00000\.h5: chunk 1 of /tokens .* holds token id 300 >= vocab_size 257"
        ):
            c.tokens(C, C + 1)
    rep = validate_corpus(mpath, workers=1)
    assert [(f.code, "300" in f.message) for f in rep.findings] == [("range", True)]


def test_version_2_corpus_still_reads_with_its_index_proven_at_open(tmp_path, stdlib_corpus_texts):
    """A version 2 corpus (written here from the v2 contract, not by this writer) opens, reading
    every index at open as before, proving it against index_sha256; a rewritten checksum is
    refused at open, naming the shard."""
    texts = stdlib_corpus_texts[:60]
    v2 = write_v1_corpus(tmp_path / "v2", texts, version=2)
    c = open_corpus(v2, "train")
    assert c.verified and c.version == 2 and c.num_shards >= 2
    v3, toks, offs = synthetic(tmp_path / "v3", 1, 10)  # control that the reader differs by version only
    assert open_corpus(v3, "train").version == 4
    want = np.concatenate(
        [h5py.File(p, "r")["tokens"][:] for p in sorted((tmp_path / "v2" / "shards" / "train").glob("*.h5"))]
    )
    np.testing.assert_array_equal(c.tokens(0, c.num_tokens), want)
    np.testing.assert_array_equal(c.doc_offsets_range(0, c.num_documents), c.doc_offsets)
    assert c.doc_ids.shape == (c.num_documents, 32) and validate_corpus(v2, workers=1).ok
    shard = read_manifest(v2).shard_path(read_manifest(v2).shards[1])
    with h5py.File(shard, "r+") as f:
        f["chunk_xxh3"][0] ^= np.uint64(1)
    with pytest.raises(FormatError, match=rf"{shard.name}: index .* differs from the manifest's index_sha256"):
        open_corpus(v2, "train")


def test_more_shards_than_file_descriptors(tmp_path):
    """1,100 shards read end to end (tokens, offsets, document lookups) in a process limited to 512
    open files: the reader keeps at most 128 shards open."""
    mpath, toks, offs = synthetic(tmp_path, 1100, 3, seed=4)
    script = textwrap.dedent(
        f"""
        import resource, numpy as np
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))
        from h5corpus.storage.reader import open_corpus
        c = open_corpus({str(mpath)!r}, "train")
        offs = c.doc_offsets_range(0, c.num_documents)
        toks = c.tokens(0, c.num_tokens)
        pos = np.arange(0, c.num_tokens, 7)
        d = c.doc_index_at(pos)
        rows = c.gather(np.arange(0, c.num_tokens - 8, 5), 8)
        print(c.num_shards, int(toks.astype(np.int64).sum()), int(offs.sum()), int(d.sum()), int(rows.sum()))
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    pos = np.arange(0, toks.size, 7)
    starts = np.arange(0, toks.size - 8, 5)
    rows = toks[starts[:, None] + np.arange(8)]
    d = np.searchsorted(offs, pos, side="right") - 1
    want = [1100, int(toks.astype(np.int64).sum()), int(offs.sum()), int(d.sum()), int(rows.astype(np.int64).sum())]
    assert p.stdout.split() == [str(x) for x in want]


def test_flipped_bytes_outside_the_tokens_are_never_served_wrong(tmp_path):
    """80 single-byte flips at random places of a shard outside its token chunks (HDF5 metadata,
    offsets, ids, flags, checksum tables, padding): every read either returns exactly the oracle's
    tokens and offsets (the byte is not one a read relies on) or raises a FormatError naming the
    shard; validate never raises and reports every flip that changes a byte it checks."""
    mpath, toks, offs = synthetic(tmp_path, 1, 3000, seed=3)
    shard = next((tmp_path / "shards" / "train").glob("*.h5"))
    data = shard.read_bytes()
    with h5py.File(shard, "r") as f:
        t = f["tokens"].id
        chunks = [t.get_chunk_info(i) for i in range(t.get_num_chunks())]
    in_tokens = np.zeros(len(data), bool)
    for ch in chunks:
        in_tokens[ch.byte_offset : ch.byte_offset + ch.size] = True
    places = np.random.default_rng(0).permutation(np.flatnonzero(~in_tokens))[:80].tolist()
    refused = 0
    for at in places:
        bad = bytearray(data)
        bad[at] ^= 0x40
        shard.write_bytes(bytes(bad))
        try:
            c = open_corpus(mpath, "train")
            np.testing.assert_array_equal(c.tokens(0, c.num_tokens), toks, err_msg=f"byte {at}")
            np.testing.assert_array_equal(c.doc_offsets_range(0, c.num_documents), offs, err_msg=f"byte {at}")
        except FormatError as e:
            assert shard.name in str(e), (at, str(e))
            refused += 1
        validate_corpus(mpath, workers=1)  # never raises
    shard.write_bytes(data)
    assert refused > 0 and validate_corpus(mpath, workers=1).ok
