"""Storage contract (format v2): round trip, hashes, every corruption kind, crash safety, SWMR."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import xxhash

from h5corpus.storage import format as fmt
from h5corpus.storage.format import FormatError, TokenizerIdentity
from h5corpus.storage.manifest import read_manifest
from h5corpus.storage.reader import open_corpus
from h5corpus.storage.validate import validate_corpus
from h5corpus.storage.writer import ShardWriter
from tests.helpers import BYTE_IDENTITY, byte_encode, doc_id, read_doc_meta, read_sidecar, stdlib_texts


def independent_hashes(path: Path) -> tuple[str, str, str]:
    """Recompute the three manifest hashes straight from the contract in docs/FORMAT.md (version 4:
    the index hash is the offsets' little-endian bytes, then the chunk checksums, each the xxh3-64
    of one chunk's real tokens, then the offsets checksums, each the xxh3-64 of 1,024 offsets'
    little-endian bytes, which must equal the ones recomputed here; sums_sha256 covers both
    checksum tables; ids and flags are the sidecar's, not the shard's)."""
    with h5py.File(path, "r") as f:
        toks = f["tokens"][:]
        assert "doc_ids" not in f and "doc_flags" not in f, path
        offs = f["doc_offsets"][:]
        sums, C = f["chunk_xxh3"][:], f["tokens"].chunks[0]
        osums = f["offsets_xxh3"][:]
    le = toks.astype(toks.dtype.newbyteorder("<"))
    want = [xxhash.xxh3_64_intdigest(le[k : k + C].tobytes()) for k in range(0, le.size, C)]
    assert sums.dtype == np.dtype("<u8") and sums.tolist() == want, path
    ole = offs.astype("<i8")
    want = [xxhash.xxh3_64_intdigest(ole[k : k + 1024].tobytes()) for k in range(0, ole.size, 1024)]
    assert osums.dtype == np.dtype("<u8") and osums.tolist() == want, path
    h = hashlib.sha256(le.tobytes()).hexdigest()
    ih = hashlib.sha256(ole.tobytes() + sums.tobytes() + osums.tobytes()).hexdigest()
    return h, ih, hashlib.sha256(sums.tobytes() + osums.tobytes()).hexdigest()


# -- round trip ------------------------------------------------------------------------------------


def test_round_trip_gpt2_dev_corpus_documents_and_boundaries_exact(dev_manifest, dev_texts, gpt2_encode):
    """Documents written and read back are identical, boundaries exact, ids = sha256(text)."""
    m = read_manifest(dev_manifest)
    assert m.dtype == "uint16" and m.tokenizer.eos_id == 50256
    by_id = {doc_id(t)[:16]: t for t in dev_texts}  # version 3 stores the first 128 bits of each sha256
    seen = 0
    for split in ("train", "validation"):
        c = open_corpus(dev_manifest, split)
        assert c.num_documents == m.splits[split]["documents"]
        sample = np.linspace(0, c.num_documents - 1, 300).astype(int)
        texts = [by_id[c.doc_ids[i].tobytes()] for i in sample]
        for i, ids in zip(sample, gpt2_encode(texts)):
            got = c.document(int(i))
            assert got[-1] == 50256 and np.count_nonzero(got == 50256) == 1
            np.testing.assert_array_equal(got[:-1], ids)
            seen += 1
    assert seen == 600


def test_hashes_reproducible_from_contract(dev_manifest):
    """sha256 and index_sha256 in the manifest equal an independent computation from the contract."""
    m = read_manifest(dev_manifest)
    assert len(m.shards) >= 4
    for s in m.shards:
        h, ih, sh = independent_hashes(m.shard_path(s))
        assert (h, ih, sh) == (s.sha256, s.index_sha256, s.sums_sha256), s.path
        assert m.shard_path(s).stat().st_size == s.bytes
        ids, flags, head = read_sidecar(m.shard_path(s))  # the sidecar, bound to its shard
        assert (head["sha256"], head["size"]) == (s.docs_sha256, s.docs_bytes), s.path
        assert (head["magic"], head["version"], head["id_bytes"]) == (b"H5CDOCS1", 4, 16)
        assert (head["documents"], head["tokens"]) == (s.documents, s.tokens)
        assert (head["tokens_sha256"], head["index_sha256"]) == (h, ih)


def test_layout_matches_contract(stdlib_manifest):
    """Datasets, dtypes, chunking, maxshape and root attributes as docs/FORMAT.md states."""
    m = read_manifest(stdlib_manifest)
    raw = json.loads(stdlib_manifest.read_text())
    assert set(raw) >= {"format", "version", "tokenizer", "dtype", "chunk_tokens", "shards", "splits"}
    assert set(raw["tokenizer"]) == {"name", "revision", "sha256", "vocab_size", "eos_id"}
    assert set(raw["shards"][0]) == {
        "path",
        "split",
        "tokens",
        "documents",
        "sha256",
        "index_sha256",
        "bytes",
        "sums_sha256",
        "docs_sha256",
        "docs_bytes",
    }
    for s in m.shards:
        assert s.path.startswith(f"../shards/{s.split}/")
        with h5py.File(m.shard_path(s), "r") as f:
            t = f["tokens"]
            assert t.dtype == np.uint16 and t.chunks == (4096,) and t.maxshape == (None,)
            o = f["doc_offsets"][:]
            assert o.dtype == np.int64 and o[0] == 0 and o[-1] == t.shape[0] and (np.diff(o) > 0).all()
            assert "doc_ids" not in f and "doc_flags" not in f  # version 4: in the sidecar
            ids, flags, _ = read_sidecar(m.shard_path(s))
            assert ids.shape == (o.size - 1, 16) and flags.shape == (o.size - 1,)
            assert f["doc_offsets"].chunks == (1024,) and f["doc_offsets"].compression is None
            a = fmt.check_attrs(f.attrs, "x")
            assert a["split"] == s.split and a["eos_id"] == 256 and a["chunk_tokens"] == 4096
            assert a["version"] == 4 and raw["version"] == 4
            sums = f["chunk_xxh3"]
            assert sums.dtype == np.dtype("<u8") and sums.shape == (-(-t.shape[0] // 4096),)


def test_dtype_follows_vocab_size():
    assert fmt.token_dtype(50257) == np.uint16
    assert fmt.token_dtype(65536) == np.uint16
    assert fmt.token_dtype(65537) == np.uint32


def test_uint32_vocab_round_trip(tmp_path):
    ident = fmt.TokenizerIdentity(name="big", revision="local", sha256="1" * 64, vocab_size=200_000, eos_id=199_999)
    docs = [np.array([70_000, 5, 199_999]), np.array([199_998, 199_999])]
    with ShardWriter(tmp_path / "s.h5", split="train", tokenizer=ident, chunk_tokens=2) as w:
        for i, d in enumerate(docs):
            w.add_document(d, bytes([i]) * 32)
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert f["tokens"].dtype == np.uint32
        np.testing.assert_array_equal(f["tokens"][:], np.concatenate(docs))


def test_moving_shards_and_manifests_together_keeps_manifest_valid(stdlib_manifest, tmp_path):
    root = stdlib_manifest.parent.parent
    dest = tmp_path / "moved"
    dest.mkdir()
    shutil.move(str(root / "shards"), dest / "shards")
    shutil.move(str(root / "manifests"), dest / "manifests")
    assert validate_corpus(dest / "manifests" / "shards.json").ok


# -- writer contract --------------------------------------------------------------------------------


def test_writer_refuses_eos_inside_document_and_missing_eos(tmp_path):
    w = ShardWriter(tmp_path / "s.h5", split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=8)
    with pytest.raises(ValueError, match="inside"):
        w.add_document([1, 256, 2, 256], b"a" * 32)
    with pytest.raises(ValueError, match="does not end with EOS"):
        w.add_document([1, 2], b"b" * 32)
    with pytest.raises(ValueError, match="out of range"):
        w.add_document([1, 300, 256], b"c" * 32)
    w.add_document([1, 2], b"d" * 32, truncated=True)  # a cut is not an end: no EOS, flagged
    info = w.close()
    assert info.documents == 1 and info.tokens == 2
    assert read_doc_meta(Path(info.path))[1][0] == fmt.FLAG_TRUNCATED


def test_writer_appends_exactly_one_chunk_at_a_time(tmp_path):
    """The file grows by whole chunks; only the final chunk is partial."""
    sizes = []
    w = ShardWriter(tmp_path / "s.h5", split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=100)
    for k in range(30):
        w.add_document(np.r_[np.full(37, 7), 256], bytes([k]) * 32)
        sizes.append(w._tokens.shape[0])
    info = w.close()
    assert all(s % 100 == 0 for s in sizes)
    assert info.tokens == 30 * 38


def test_failed_body_publishes_nothing(tmp_path):
    path = tmp_path / "s.h5"
    with pytest.raises(RuntimeError):
        with ShardWriter(path, split="train", tokenizer=BYTE_IDENTITY) as w:
            w.add_document([1, 256], b"a" * 32)
            raise RuntimeError("boom")
    assert not path.exists() and not list(tmp_path.iterdir())


def test_reader_refuses_other_format_versions(stdlib_manifest):
    m = read_manifest(stdlib_manifest)
    p = m.shard_path(m.shards[0])
    with h5py.File(p, "r+") as f:
        f.attrs["version"] = 5
    raw = json.loads(stdlib_manifest.read_text())
    raw["shards"][0]["bytes"] = p.stat().st_size  # as a newer h5corpus would list it
    stdlib_manifest.write_text(json.dumps(raw))
    c = open_corpus(stdlib_manifest, m.shards[0].split)  # version 4: the shard is checked when first read
    with pytest.raises(FormatError, match="version 5 is not supported"):
        c.tokens(0, 1)
    raw["version"] = 99
    stdlib_manifest.write_text(json.dumps(raw))
    with pytest.raises(FormatError, match="format version 99"):
        read_manifest(stdlib_manifest)


def test_manifest_version_written_and_checked(stdlib_manifest):
    """The manifest carries a version of its own; a manifest without it (written before it existed)
    reads as version 1, any other version is refused by name."""
    raw = json.loads(stdlib_manifest.read_text())
    assert raw["manifest_version"] == 1
    del raw["manifest_version"]
    stdlib_manifest.write_text(json.dumps(raw))
    assert read_manifest(stdlib_manifest).shards
    raw["manifest_version"] = 2
    stdlib_manifest.write_text(json.dumps(raw))
    with pytest.raises(FormatError, match="manifest_version 2 is not supported"):
        read_manifest(stdlib_manifest)


def _naive_index_ok(offsets, ids, flags, num_tokens) -> bool:
    """The index rule of docs/FORMAT.md, one element at a time."""
    if offsets.dtype != np.dtype("<i8") or ids.dtype != np.uint8 or flags.dtype != np.uint8:
        return False
    o = offsets.tolist()
    if not o or o[0] != 0 or o[-1] != num_tokens:
        return False
    if any(b < a for a, b in zip(o, o[1:])):
        return False
    return ids.shape == (len(o) - 1, 32) and flags.shape == (len(o) - 1,)


def test_check_index_agrees_with_the_documented_rule():
    """``check_index`` reports a problem exactly when the naive rule says the index is broken,
    over random intact and mutated indexes (decreasing, past the end, short id rows, wrong dtypes)."""
    from h5corpus.storage.format import check_index

    rng = np.random.default_rng(5)
    for trial in range(400):
        docs = int(rng.integers(0, 6))
        offs = np.concatenate([[0], np.cumsum(rng.integers(1, 9, docs))]).astype("<i8")
        n = int(offs[-1])
        ids = np.zeros((docs, 32), np.uint8)
        flags = np.zeros(docs, np.uint8)
        kind = trial % 8
        if kind == 1 and docs:
            offs[int(rng.integers(1, docs + 1))] -= 20  # decreases (or starts below 0)
        elif kind == 2:
            n -= 1  # offsets end past the tokens
        elif kind == 3 and docs:
            ids = ids[:-1]
        elif kind == 4:
            flags = np.zeros(docs + 1, np.uint8)
        elif kind == 5:
            offs = offs.astype(">i8")
        elif kind == 6:
            offs = offs.astype("<i4")
        elif kind == 7:
            offs = offs + 1
        problems = check_index(offs, ids, flags, num_tokens=n)
        assert (not problems) == _naive_index_ok(offs, ids, flags, n), (kind, offs, problems)
    ok = np.array([0, 3, 5], "<i8")
    assert check_index(ok, np.zeros((2, 32), np.uint8), np.zeros(2, np.uint8), num_tokens=5, num_documents=3)


def test_attributes_give_back_the_tokenizer_identity(tmp_path):
    """``identity_from_attrs`` inverts ``shard_attrs`` through a real HDF5 file."""
    from h5corpus.storage import format as fmt

    ident = TokenizerIdentity(name="t", revision="r1", sha256="ab" * 32, vocab_size=70_000, eos_id=69_999)
    attrs = fmt.shard_attrs(
        split="validation", dtype=fmt.token_dtype(ident.vocab_size), chunk_tokens=64, tokenizer=ident
    )
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.attrs.update(attrs)
    with h5py.File(tmp_path / "a.h5", "r") as f:
        got = fmt.check_attrs(f.attrs, "a.h5")
    assert fmt.identity_from_attrs(got) == ident and got["dtype"] == "uint32"


def test_shards_use_the_pinned_hdf5_file_format(tmp_path):
    """Shards are written within the pinned format bounds (HDF5 1.10 to 1.14 objects), whatever
    HDF5 is installed: the superblock is version 3, the one SWMR files of those releases carry."""
    w = ShardWriter(tmp_path / "a.h5", split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=64)
    w.add_document(np.array([1, 2, 256]), b"a" * 32)
    w.close()
    head = (tmp_path / "a.h5").read_bytes()[:9]
    assert head[:8] == b"\x89HDF\r\n\x1a\n" and head[8] == 3


# -- validate: every corruption kind names the shard ------------------------------------------------


def _shard_file(manifest: Path, k: int = 0) -> tuple[str, Path]:
    m = read_manifest(manifest)
    s = m.shards[k]
    return s.path, m.shard_path(s)


def _flip_token(manifest):
    name, p = _shard_file(manifest)
    with h5py.File(p, "r+") as f:
        f["tokens"][1000] = (int(f["tokens"][1000]) + 1) % 256
    return [name]


def _change_offset(manifest):
    name, p = _shard_file(manifest)
    with h5py.File(p, "r+") as f:
        f["doc_offsets"][3] += 1
    return [name]


def _truncate_file(manifest):
    name, p = _shard_file(manifest)
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size // 2)
    return [name]


def _delete_shard(manifest):
    name, p = _shard_file(manifest)
    p.unlink()
    return [name]


def _extra_shard(manifest):
    name, p = _shard_file(manifest)
    shutil.copy(p, p.with_name("train-99999.h5"))
    return ["../shards/train/train-99999.h5"]


def _swap_shards(manifest):
    a, pa = _shard_file(manifest, 0)
    b, pb = _shard_file(manifest, 1)
    tmp = pa.with_suffix(".swap")
    os.replace(pa, tmp)
    os.replace(pb, pa)
    os.replace(tmp, pb)
    return [a, b]


def _edit_manifest_field(manifest):
    raw = json.loads(manifest.read_text())
    raw["shards"][1]["documents"] += 1
    manifest.write_text(json.dumps(raw))
    return [raw["shards"][1]["path"]]


def _edit_manifest_hash(manifest):
    raw = json.loads(manifest.read_text())
    raw["shards"][2]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(raw))
    return [raw["shards"][2]["path"]]


CORRUPTIONS = [
    pytest.param(_flip_token, "sha256", id="flipped-token"),
    pytest.param(_change_offset, "index_sha256", id="changed-offset"),
    pytest.param(_truncate_file, "size", id="truncated-file"),
    pytest.param(_delete_shard, "missing", id="deleted-shard"),
    pytest.param(_extra_shard, "unlisted", id="extra-shard-file"),
    pytest.param(_swap_shards, "tokens", id="two-shards-swapped"),  # counts differ: refused before hashing
    pytest.param(_edit_manifest_field, "offsets", id="manifest-field-edited"),
    pytest.param(_edit_manifest_hash, "sha256", id="manifest-hash-edited"),
]


def test_intact_corpus_validates(stdlib_manifest):
    r = validate_corpus(stdlib_manifest, workers=2)
    assert r.ok, r.findings
    assert r.shards >= 3 and r.bytes_hashed == 2 * r.tokens


@pytest.mark.parametrize("corrupt, code", CORRUPTIONS)
def test_each_corruption_is_detected_and_names_the_shard(stdlib_manifest, corrupt, code):
    names = corrupt(stdlib_manifest)
    r = validate_corpus(stdlib_manifest, workers=2)
    assert not r.ok
    assert set(names) <= set(r.failing_shards), r.findings
    assert code in {f.code for f in r.findings}, r.findings


def test_cli_exit_codes_and_json(stdlib_manifest, tmp_path):
    def run(*a):
        return subprocess.run([sys.executable, "-m", "h5corpus", *a], capture_output=True, text=True)

    ok = run("validate", str(stdlib_manifest), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    missing = run("validate", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "not found" in missing.stderr
    names = _flip_token(stdlib_manifest)
    bad = run("validate", str(stdlib_manifest))
    assert bad.returncode == 1
    assert f"FAIL {names[0]}: sha256" in bad.stderr


# -- crash safety and SWMR ---------------------------------------------------------------------------

_KILL_WRITER = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[3])
from tests.helpers import BYTE_IDENTITY, byte_encode, stdlib_texts
from h5corpus.storage.writer import ShardWriter
from h5corpus.storage.manifest import Manifest, write_manifest
from pathlib import Path
out = Path(sys.argv[1]); n = int(sys.argv[2])
w = ShardWriter(out / "shards" / "train-00000.h5", split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=1024)
for i, ids in enumerate(byte_encode(stdlib_texts(400)) * 50):
    w.add_document(np.append(ids, 256), i.to_bytes(32, "little"))
    if i == n:
        print("ready", flush=True)
"""


def test_killed_writer_leaves_nothing_that_looks_complete(tmp_path):
    """kill -9 mid-shard: no .h5 appears, only the .partial; the manifest is never half-written."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_WRITER, str(tmp_path), "300", str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    files = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert files == ["train-00000.h5.partial"]
    assert not list((tmp_path / "shards").glob("*.h5"))


def test_manifest_write_is_atomic(stdlib_manifest, monkeypatch):
    """A crash while writing the manifest leaves the previous one intact and no stray temp file."""
    from h5corpus.storage import manifest as mm

    before = stdlib_manifest.read_bytes()
    m = read_manifest(stdlib_manifest)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(mm.os, "replace", boom)
    m.splits["train"]["documents"] = -1
    with pytest.raises(OSError):
        mm.write_manifest(stdlib_manifest, m)
    assert stdlib_manifest.read_bytes() == before
    assert [p.name for p in stdlib_manifest.parent.iterdir()] == ["shards.json"]


def _swmr_reader(path: str, final_docs: int, q) -> None:
    """Poll a shard under construction; record every document seen (tokens) as a hash."""
    seen: dict[int, str] = {}
    polls = 0
    deadline = time.time() + 60
    f = None
    while time.time() < deadline:
        try:
            if f is None:
                f = h5py.File(path, "r", libver="latest", swmr=True)
            offs_ds, toks = f["doc_offsets"], f["tokens"]
            offs_ds.refresh()
            toks.refresh()
            offs = offs_ds[:]
            n_tok = toks.shape[0]
            if offs[-1] > n_tok:
                q.put(("torn", int(offs[-1]), int(n_tok)))
                return
            new = [i for i in range(len(offs) - 1) if i not in seen]
            if new:
                lo, hi = int(offs[new[0]]), int(offs[new[-1] + 1])
                data = toks[lo:hi]
                for i in new:
                    seen[i] = hashlib.sha256(data[offs[i] - lo : offs[i + 1] - lo].tobytes()).hexdigest()
            polls += 1
            if len(seen) >= final_docs:
                break
        except (OSError, KeyError):
            time.sleep(0.01)
            continue
    q.put(("ok", polls, seen))


def test_swmr_reader_sees_only_complete_documents_equal_to_final(tmp_path):
    texts = stdlib_texts(200)
    ids = byte_encode(texts)
    final = tmp_path / "s.h5"
    w = ShardWriter(final, split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=2048)
    w.add_document(np.append(ids[0], 256), doc_id(texts[0]))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    reader = ctx.Process(target=_swmr_reader, args=(str(w.path), len(texts), q))
    reader.start()
    time.sleep(1.0)
    for t, a in zip(texts[1:], ids[1:]):
        w.add_document(np.append(a, 256), doc_id(t))
        time.sleep(0.003)
    w._flush_buffer()  # publish the tail while the reader still polls the partial file
    time.sleep(0.5)
    info = w.close()
    kind, polls, seen = q.get(timeout=60)
    reader.join(10)
    assert kind == "ok", (kind, polls, seen)
    assert polls > 5 and len(seen) == len(texts)
    with h5py.File(info.path, "r") as f:
        offs, toks = f["doc_offsets"][:], f["tokens"][:]
    for i, h in seen.items():
        assert h == hashlib.sha256(toks[offs[i] : offs[i + 1]].tobytes()).hexdigest(), i


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_compressed_shards_validate_and_corruption_still_detected(tmp_path, compression):
    """Compressed shards take the h5py read path in validate; hashes are of the decoded tokens."""
    from h5corpus.storage.manifest import Manifest, write_manifest

    texts = stdlib_texts(60)
    m = Manifest(tokenizer=BYTE_IDENTITY, dtype="uint16", chunk_tokens=4096)
    with ShardWriter(
        tmp_path / "shards" / "train-0.h5",
        split="train",
        tokenizer=BYTE_IDENTITY,
        chunk_tokens=4096,
        compression=compression,
    ) as w:
        for t, ids in zip(texts, byte_encode(texts)):
            w.add_document(np.append(ids, 256), doc_id(t))
    m.shards.append(w.info.relative_to(tmp_path / "manifests"))
    write_manifest(tmp_path / "manifests" / "shards.json", m)
    h, _, _ = independent_hashes(w.info.path)
    assert h == w.info.sha256
    assert validate_corpus(tmp_path / "manifests" / "shards.json").ok
    with h5py.File(w.info.path, "r+") as f:
        f["tokens"][5000] = (int(f["tokens"][5000]) + 1) % 256
    r = validate_corpus(tmp_path / "manifests" / "shards.json")
    assert "sha256" in {f.code for f in r.findings}
