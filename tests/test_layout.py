"""The layout file (a first touch without HDF5) and the final chunk stored in mapped deflate blocks.

Oracles: the test's own token arrays, HDF5's own reads (``read_path="h5py"``, which never uses
the layout file), zlib's decoder."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from h5corpus.build.config import BuildConfig
from h5corpus.build.run.runner import build_corpus
from h5corpus.storage import format as fmt
from h5corpus.storage import manifest as mf
from h5corpus.storage.reader import _file_id, open_corpus, write_layout_file
from h5corpus.storage.readpaths import IndexChecksumError
from tests.helpers import flip_bit, subprocess_env, write_jsonl
from tests.test_storage_v3 import synthetic


@pytest.fixture
def laid_out(tmp_path) -> tuple[Path, np.ndarray, np.ndarray]:
    """4 shards of 2,600 documents (several token and offsets chunks each) with a layout file."""
    mpath, toks, offs = synthetic(tmp_path, 4, 2600, seed=7)
    write_layout_file(mpath)
    return mpath, toks, offs


def _used(c) -> list[bool]:
    """Whether each shard's first touch in this process may use the layout file."""
    return [c._mapped_layout(s, _file_id(c.paths[s]), c.entries[s]) is not None for s in range(c.num_shards)]


def test_reads_through_the_layout_file_equal_the_oracle_and_hdf5(laid_out):
    mpath, toks, offs = laid_out
    c = open_corpus(mpath, "train")
    assert _used(c) == [True] * 4
    c.tokens(0, c.num_tokens)
    assert not any(c._readers[s]._decoded for s in range(4))  # final chunks mapped, not decoded
    ref = open_corpus(mpath, "train", read_path="h5py")
    assert (c.tokens(0, c.num_tokens) == toks).all()
    assert (c.doc_offsets_range(0, c.num_documents) == offs).all()
    rng = np.random.default_rng(1)
    starts = rng.integers(0, toks.size - 50, 400)
    lens = rng.integers(1, 50, 400)
    assert (c.gather_ranges(starts, lens) == ref.gather_ranges(starts, lens)).all()
    pos = rng.integers(0, toks.size, 300)
    assert (c.doc_index_at(pos) == np.searchsorted(offs, pos, side="right") - 1).all()


def test_a_stale_damaged_or_foreign_layout_is_never_used(laid_out, tmp_path):
    mpath, toks, _ = laid_out
    shard = Path(open_corpus(mpath, "train").paths[1])
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000))  # rewritten since
    c = open_corpus(mpath, "train")
    assert _used(c) == [True, False, True, True]
    assert (c.tokens(0, c.num_tokens) == toks).all()
    lay = fmt.layout_path(mpath)
    data = bytearray(lay.read_bytes())
    data[-3] ^= 0x10  # the last shard's payload: its digest fails
    lay.write_bytes(bytes(data))
    assert _used(open_corpus(mpath, "train"))[3] is False
    lay.write_bytes(bytes(data[:100]))  # truncated: no row is usable
    c = open_corpus(mpath, "train")
    assert _used(c) == [False] * 4
    assert (c.tokens(0, c.num_tokens) == toks).all()
    other, _, _ = synthetic(tmp_path / "other", 4, 2600, seed=8)  # another corpus's layout file
    lay.write_bytes(write_layout_file(other).read_bytes())
    assert _used(open_corpus(mpath, "train")) == [False] * 4


def test_the_checksums_still_guard_a_first_touch_through_the_layout(laid_out):
    """A byte flipped in a token chunk or an offsets chunk, the file's mtime kept (so the layout
    entry is used), is refused naming the shard, as through HDF5."""
    mpath, _, _ = laid_out
    c = open_corpus(mpath, "train")
    lay = fmt.decode_layout(fmt.layout_path(mpath).read_bytes(), 2, 4)
    path = Path(c.paths[2])
    flip_bit(path, int(lay.tokens[0]) + 10)
    flip_bit(path, int(lay.offsets[1]) + 100)
    c = open_corpus(mpath, "train")
    assert _used(c)[2]
    with pytest.raises(fmt.ChunkChecksumError, match=rf"{path.name}: chunk 0 of /tokens"):
        c.tokens(int(c.shard_token_starts[2]), int(c.shard_token_starts[2]) + 5)
    with pytest.raises(IndexChecksumError, match=rf"{path.name}: chunk 1 of /doc_offsets"):
        c.doc_offsets_range(int(c.shard_doc_starts[2]) + 1500, int(c.shard_doc_starts[2]) + 1501)


def test_a_shard_closed_and_opened_again_keeps_what_this_process_verified(laid_out):
    """Past the open-shard bound a shard is closed; opened again (the same file) its chunks
    verified before are ready, the others are still checked: a byte flipped in one of them, the
    file's mtime kept, is refused naming the shard. A shard whose bad last offset was never read
    opens (its ends are checked before its first offset is served, not at open)."""
    mpath, toks, _ = laid_out
    lay = fmt.decode_layout(fmt.layout_path(mpath).read_bytes(), 1, 4)
    c = open_corpus(mpath, "train")
    t0 = int(c.shard_token_starts[1])
    assert (c.tokens(t0, t0 + 10) == toks[t0 : t0 + 10]).all()
    n_chunks = len(c._readers[1].ready)
    assert n_chunks > 2 and list(c._readers[1].ready) == [1] + [0] * (n_chunks - 1)
    c._close_oldest(len(c._readers))
    assert not c._readers
    path = Path(c.paths[1])
    flip_bit(path, int(lay.tokens[1]) + 6)  # chunk 1, never read
    assert list(c._reader(1).ready) == [1] + [0] * (n_chunks - 1)  # opened: chunk 0 needs no hash again
    assert (c.tokens(t0 + 3, t0 + 8) == toks[t0 + 3 : t0 + 8]).all()
    C = c.chunk_tokens
    with pytest.raises(fmt.ChunkChecksumError, match=rf"{path.name}: chunk 1 of /tokens"):
        c.tokens(t0 + C, t0 + C + 4)
    fresh = open_corpus(mpath, "train")  # another corpus object verifies for itself
    with pytest.raises(fmt.ChunkChecksumError, match=rf"{path.name}: chunk 1 of /tokens"):
        fresh.tokens(t0 + C, t0 + C + 4)
    last = Path(c.paths[3])
    lay3 = fmt.decode_layout(fmt.layout_path(mpath).read_bytes(), 3, 4)
    n_off = c.num_documents - int(c.shard_doc_starts[3]) + 1
    flip_bit(last, int(lay3.offsets[-1]) + 8 * ((n_off - 1) % fmt.OFFSETS_CHUNK_V3))  # its last offset
    t3 = int(c.shard_token_starts[3])
    assert (c.tokens(t3, t3 + 7) == toks[t3 : t3 + 7]).all()
    with pytest.raises(IndexChecksumError, match=rf"{last.name}: chunk"):
        c.doc_offsets_range(int(c.shard_doc_starts[3]), int(c.shard_doc_starts[3]) + 1)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("fill", [1, 32766, 32767, 200_001, 262_143])
def test_the_final_chunk_in_stored_blocks_decodes_as_hdf5_would_and_maps_its_tokens(dtype, fill):
    chunk = np.zeros(262_144, dtype)
    chunk[:fill] = np.random.default_rng(fill).integers(1, 50_000, fill)
    real = fill * chunk.itemsize
    stream = fmt.stored_tail_chunk(chunk, real)
    assert zlib.decompress(stream) == chunk.tobytes()  # what HDF5's deflate filter returns
    runs = fmt.stored_tail_runs(stream, 0, len(stream), real, chunk.itemsize)
    assert b"".join(stream[o : o + n] for o, n in runs) == chunk[:fill].tobytes()
    assert len(stream) - real < 1200  # 5 bytes per block, the padding compressed
    assert fmt.stored_tail_runs(zlib.compress(chunk.tobytes(), 6), 0, 10**6, real, chunk.itemsize) is None


def test_reading_through_the_layout_file_imports_neither_h5py_nor_jsonschema(laid_out):
    """What a training process pays in memory: a corpus opened and read through its layout file
    loads no HDF5 library and no JSON Schema machinery (docs/SCALING.md, "Memory")."""
    mpath, toks, _ = laid_out
    script = textwrap.dedent(
        f"""
        import sys
        from h5corpus.storage.reader import open_corpus
        c = open_corpus({str(mpath)!r}, "train")
        print(int(c.tokens(0, c.num_tokens).astype("int64").sum()), int(c.doc_offsets_range(0, 5)[-1]))
        print("h5py" in sys.modules, "jsonschema" in sys.modules)
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    total, _ = p.stdout.split("\n")[0].split()
    assert int(total) == int(toks.astype(np.int64).sum())
    assert p.stdout.split("\n")[1] == "False False"


def _mutations(d: dict, rng: np.random.Generator, n: int) -> list[dict]:
    """``n`` copies of manifest ``d`` each with one value replaced or one key removed, somewhere."""
    values = [
        None,
        True,
        0,
        -1,
        7,
        2**41,
        1.5,
        12.0,
        "",
        "x",
        "a" * 64,
        "0" * 64,
        "uint16",
        "train",
        [],
        {},
        [1],
        {"a": 1},
    ]
    out = []
    for _ in range(n):
        m = copy.deepcopy(d)
        node: Any = m
        for _depth in range(3):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            key = keys[int(rng.integers(len(keys)))]
            child = node[key]
            if not isinstance(child, (dict, list)) or not child or rng.random() < 0.4:
                break
            node = child
        if isinstance(node, dict) and rng.random() < 0.2:
            del node[key]
        else:
            node[key] = values[int(rng.integers(len(values)))]
        out.append(m)
    return out


def test_the_fast_manifest_check_agrees_with_jsonschema(laid_out):
    """Oracle: jsonschema on the same schema. Over 600 one-field mutations of a real manifest (and
    the manifest itself), the fast check accepts exactly what jsonschema accepts."""
    mpath, _, _ = laid_out
    d = json.loads(mpath.read_text())
    d["splits"] = {"train": {"documents": 3, "tokens": 9}}
    top = mf._without_shard_items(fmt.MANIFEST_SCHEMA)
    validator = mf._schema_validator(top)
    cases = [d, *_mutations(d, np.random.default_rng(3), 600)]
    verdicts = [(mf._conforms(m, top), validator.is_valid(m)) for m in cases]
    assert all(a == b for a, b in verdicts)
    assert sum(not b for _, b in verdicts) > 200  # the mutations do break the schema, often


def test_the_build_writes_a_layout_file_that_every_shard_opens_through(tmp_path, stdlib_corpus_texts):
    """A build's commit writes ``<manifest>.layout``; every shard of both splits then opens through
    it and reads what HDF5 reads. It also writes the table file, current, that both splits open
    from (the oracle: ``shards.json`` read with ``json``)."""
    src = write_jsonl(tmp_path / "in" / "a.jsonl", stdlib_corpus_texts[:150])
    mpath = tmp_path / "manifests" / "shards.json"
    cfg = BuildConfig(
        sources=[str(src)], shards_dir=tmp_path / "shards", manifest=mpath, tokenizer="bytes", workers=1,
        task_bytes=60_000, chunk_tokens=4096, shard_tokens=150_000,
    )  # fmt: skip
    build_corpus(cfg)
    assert fmt.layout_path(mpath).is_file()
    tabled = mf.table_manifest(mpath)
    entries = json.loads(mpath.read_text())["shards"]
    assert tabled is not None and [s.to_json() for s in tabled.shards] == entries
    assert {e["split"] for e in entries} == {"train", "validation"}
    for split in fmt.SPLITS:
        assert open_corpus(mpath, split).entries._bulk._columns is None  # from the table file, unread yet
        c, ref = open_corpus(mpath, split), open_corpus(mpath, split, read_path="h5py")
        if c.num_shards:
            assert _used(c) == [True] * c.num_shards
            assert (c.tokens(0, c.num_tokens) == ref.tokens(0, ref.num_tokens)).all()
            assert (c.doc_offsets_range(0, c.num_documents) == ref.doc_offsets_range(0, ref.num_documents)).all()


def test_shards_opened_through_the_layout_file_hold_one_descriptor_each(tmp_path):
    """400 shards read end to end through the layout file in a process limited to 300 open files:
    at most 256 are open at once (one memory map each), and what is read equals the oracle."""
    mpath, toks, offs = synthetic(tmp_path, 400, 3, seed=5)
    write_layout_file(mpath)
    script = textwrap.dedent(
        f"""
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
        from h5corpus.storage.reader import open_corpus
        c = open_corpus({str(mpath)!r}, "train")
        toks = c.tokens(0, c.num_tokens)
        offs = c.doc_offsets_range(0, c.num_documents)
        print(int(toks.astype("int64").sum()), int(offs.sum()), len(c._readers), c._open_fds())
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    total, osum, open_now, fds = map(int, p.stdout.split())
    assert (total, osum) == (int(toks.astype(np.int64).sum()), int(offs.sum()))
    assert 128 < open_now <= 256 and fds == open_now  # more than the HDF5 path's 128, one descriptor each


def test_validate_write_layout_writes_a_file_the_readers_use_and_only_after_every_check(laid_out):
    mpath, toks, _ = laid_out
    lay = fmt.layout_path(mpath)
    lay.unlink()
    run = [sys.executable, "-m", "h5corpus", "validate", str(mpath), "--write-layout"]
    r = subprocess.run(run, capture_output=True, text=True, env=subprocess_env())
    assert r.returncode == 0, r.stderr
    assert f"wrote {lay}" in r.stdout and lay.is_file()
    c = open_corpus(mpath, "train")
    assert _used(c) == [True] * 4
    assert np.array_equal(c.tokens(0, c.num_tokens), toks)
    lay.unlink()  # a corrupt shard: validate exits 1 and writes no layout file
    shard = Path(c.paths[1])
    flip_bit(shard, shard.stat().st_size // 2)
    r = subprocess.run(run, capture_output=True, text=True, env=subprocess_env())
    assert r.returncode == 1 and shard.name in r.stdout + r.stderr
    assert not lay.exists()
    r = subprocess.run(
        [*run[:4], "s3://bucket/m.json", "--write-layout"], capture_output=True, text=True, env=subprocess_env()
    )
    assert r.returncode == 2 and "--write-layout needs a local manifest" in r.stderr
