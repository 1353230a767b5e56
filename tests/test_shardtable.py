"""The manifest's shard list as columns (:class:`ShardTable`): the same records as parsing every
entry into a :class:`ShardRecord`, views and concatenation, bad counts named, and what a reading
process holds (a table, not records)."""

from __future__ import annotations

import hashlib
import json
import pickle

import numpy as np
import pytest

from h5corpus.storage.format import FormatError, ShardRecord
from h5corpus.storage.manifest import read_manifest
from h5corpus.storage.reader import open_corpus
from h5corpus.storage.shardtable import RootedPaths, ShardTable


def _entries(n: int, seed: int = 0) -> list[dict]:
    """Manifest entries with every optional key present on some shards only."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h = [hashlib.sha256(f"{k}{i}".encode()).hexdigest() for k in "sxulf"]
        e = {
            "path": f"../shards/{'train' if i % 3 else 'validation'}/part-{i:05d}-é.h5",
            "split": "train" if i % 3 else "validation",
            "tokens": int(rng.integers(1, 1 << 40)),
            "documents": int(rng.integers(1, 1000)),
            "sha256": h[0],
            "index_sha256": h[1],
            "bytes": int(rng.integers(1, 1 << 41)),
        }
        if i % 2:
            e["sums_sha256"] = h[2]
        if i % 5 == 1:
            e["loss_sha256"], e["loss_spans"] = h[3], int(rng.integers(0, 100))
        if i % 7 == 3:
            e["file_sha256"] = h[4]
        out.append(e)
    return out


def test_table_gives_the_records_parsing_each_entry_gives():
    entries = _entries(50)
    oracle = [ShardRecord.from_json(e, "m") for e in entries]
    t = ShardTable.from_json(entries, "m")
    assert len(t) == 50 and list(t) == oracle and t == oracle
    assert t[-1] == oracle[-1] and t[7] == oracle[7]
    with pytest.raises(IndexError):
        t[50]
    for k in ("tokens", "documents", "bytes", "loss_spans"):
        np.testing.assert_array_equal(t.column(k), [getattr(r, k) for r in oracle])
    np.testing.assert_array_equal(t.split_mask("train"), [r.split == "train" for r in oracle])
    assert b"".join(t.hex_blocks("sha256")) == b"".join(r.sha256.encode() for r in oracle)
    assert t.hex_blocks("sums_sha256") is None and t.has("sums_sha256") and not t.take([0, 2]).has("sums_sha256")
    assert pickle.loads(pickle.dumps(t)) == oracle


def test_views_and_concatenation_keep_every_field():
    entries = _entries(40, seed=1)
    oracle = [ShardRecord.from_json(e, "m") for e in entries]
    t = ShardTable.from_json(entries, "m")
    idx = [39, 0, 5, 5, 17]
    v = t.take(idx)
    assert list(v) == [oracle[i] for i in idx]
    assert list(v[1:4]) == [oracle[i] for i in idx[1:4]] and list(v.take([-1])) == [oracle[17]]
    np.testing.assert_array_equal(v.column("tokens"), [oracle[i].tokens for i in idx])
    both = t[:3] + v  # a materialized table then a view, optional keys present on some only
    assert list(both) == oracle[:3] + [oracle[i] for i in idx]
    plain = ShardTable.from_json([{k: e[k] for k in list(e)[:7]} for e in entries[:4]], "m")
    assert (
        list(plain + t[4:6])
        == [ShardRecord.from_json({k: e[k] for k in list(e)[:7]}, "m") for e in entries[:4]] + oracle[4:6]
    )
    paths = RootedPaths("/data/corpus/manifests", t)
    assert paths[1] == "/data/corpus/shards/train/part-00001-é.h5" and len(paths[:4]) == 4


def test_hashes_in_blocks_and_as_bytes_equal_each_records_hex():
    """hex_blocks (what the fingerprint hashes, a few rows at a time) and digests, on a whole table
    and on a shuffled view, against each record's hex string."""
    entries = _entries(23)
    oracle = [ShardRecord.from_json(e, "m") for e in entries]
    t = ShardTable.from_json(entries, "m")
    order = np.random.default_rng(1).permutation(23)[:17]
    for table, recs in ((t, oracle), (t.take(order), [oracle[i] for i in order])):
        for rows in (1, 4, 256):
            blocks = list(table.hex_blocks("index_sha256", rows=rows))
            assert len(blocks) == -(-len(recs) // rows)
            assert b"".join(blocks) == b"".join(r.index_sha256.encode() for r in recs)
        assert table.digests("sha256").tobytes() == b"".join(bytes.fromhex(r.sha256) for r in recs)
    assert t.hex_blocks("sums_sha256") is None and t.digests("sums_sha256") is None  # some shards lack it


def test_a_local_corpus_and_a_mixture_of_it_are_not_remote(stdlib_manifest):
    """Loaders skip what only feeds remote prefetch (the block order) for local files."""
    from h5corpus.loaders.mixture import Mixture, MixtureSource

    c = open_corpus(stdlib_manifest, "train")
    assert c.remote is False
    assert Mixture([MixtureSource("a", c, 1.0)]).remote is False


def test_a_count_past_int64_is_named():
    entries = _entries(3)
    entries[2]["tokens"] = 1 << 70
    with pytest.raises(FormatError, match=r"m: shard '../shards/train/part-00002-é.h5': tokens .* out of range"):
        ShardTable.from_json(entries, "m")


def test_reading_processes_hold_a_table_with_the_manifests_records(stdlib_manifest):
    """open_corpus keeps the split's shards as a table (the same records read_manifest lists) and
    read_manifest keeps giving a list users may edit."""
    m = read_manifest(stdlib_manifest)
    assert isinstance(m.shards, list)
    c = open_corpus(stdlib_manifest, "train")
    assert isinstance(c.entries, ShardTable)
    assert list(c.entries) == [s for s in m.shards if s.split == "train"]
    assert list(c.paths) == [str(m.shard_path(s)) for s in m.shards if s.split == "train"]
    raw = json.loads(stdlib_manifest.read_text())
    assert [e["path"] for e in raw["shards"] if e["split"] == "train"] == [s.path for s in c.entries]
    want = hashlib.sha256(b"train")  # the fingerprint: split, then every shard's sha256 in hex
    for s in m.shards_of("train"):
        want.update(s.sha256.encode())
    assert c.fingerprint == want.hexdigest()
    c2 = pickle.loads(pickle.dumps(c))
    assert c2.tokens(0, 50).tobytes() == c.tokens(0, 50).tobytes() and c2.fingerprint == c.fingerprint
