"""The table file: a manifest's shard list memory-mapped at open instead of parsing ``shards.json``.

Oracle: ``shards.json`` itself, read with ``json`` (its entries, as the file says them); and the
checks a parse makes (a shard listed twice through a symbolic link is refused)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from h5corpus.storage import format as fmt
from h5corpus.storage import manifest as mf
from h5corpus.storage.format import FormatError
from h5corpus.storage.reader import open_corpus
from tests.helpers import flip_bit
from tests.test_storage_v3 import synthetic


@pytest.fixture
def tabled(tmp_path) -> Path:
    """3 train shards of 40 documents, their manifest and its table file."""
    mpath = synthetic(tmp_path, 3, 40, seed=3)[0]
    mf.write_table_file(mpath)
    return mpath


def _entries(mpath: Path) -> list[dict]:
    return json.loads(mpath.read_text())["shards"]


def _from_table(m: mf.Manifest) -> bool:
    """Whether ``m``'s shards came from the table file (its columns then wait for first use)."""
    return m.shards._bulk._columns is None


def _as_json(m: mf.Manifest) -> list[dict]:
    return [s.to_json() for s in m.shards]


def test_a_current_table_file_opens_the_manifest_the_json_holds(tabled):
    m = mf.read_manifest(tabled, compact=True)
    assert _from_table(m)
    assert len(m.shards) == 3 and m.shards.split_mask("train").all()
    assert _as_json(m) == _entries(tabled)  # columns checked and read on first use
    top = json.loads(tabled.read_text())
    assert m.to_json() == top
    c = open_corpus(tabled, "train")
    assert c.num_documents == 120
    assert c.num_tokens == sum(e["tokens"] for e in top["shards"])


def test_an_edit_in_place_right_after_the_table_is_seen(tabled):
    """Same inode, same size, written straight after the table file: the mtime moved on (the
    writer waits for the filesystem clock to pass the manifest's), so the edit is what opens."""
    text = tabled.read_text()
    old = _entries(tabled)[1]["sha256"]
    new = ("0" if old[0] != "0" else "1") + old[1:]
    with open(tabled, "r+") as fh:
        fh.write(text.replace(old, new))
    m = mf.read_manifest(tabled, compact=True)
    assert not _from_table(m)
    assert m.shards[1].sha256 == new


def test_a_rewritten_manifest_or_a_changed_shard_folder_is_parsed(tabled):
    data = tabled.read_bytes()
    tmp = tabled.with_name("x.json")
    tmp.write_bytes(data)
    os.replace(tmp, tabled)  # the same bytes, another file: the table keys on the file
    assert not _from_table(mf.read_manifest(tabled, compact=True))
    mf.write_table_file(tabled)
    assert _from_table(mf.read_manifest(tabled, compact=True))
    shard0, shard1 = (tabled.parent / e["path"] for e in _entries(tabled)[:2])
    shard1.unlink()
    shard1.symlink_to(shard0.name)  # the second listed path is now the first file
    with pytest.raises(FormatError, match="already lists"):
        mf.read_manifest(tabled, compact=True)


def _column_at(tpath: Path, name: str) -> int:
    """Byte offset in the table file of column ``name``'s first byte."""
    data = tpath.read_bytes()
    size = int(np.frombuffer(data, "<u8", 1, 8)[0])
    head = json.loads(data[24 : 24 + size])
    at = next(c[3] for c in head["columns"] if c[0] == name)
    return 24 + size + at


@pytest.mark.parametrize("where", ["header", "splits", "hex:sha256", "int:tokens", "paths"])
def test_a_damaged_table_file_is_never_used(tabled, where):
    """A damaged header or splits column: the manifest is parsed at open. A damaged column read
    on first use: its digest fails then, and the same shards are taken from ``shards.json``."""
    tpath = fmt.table_path(tabled)
    flip_bit(tpath, 40 if where == "header" else _column_at(tpath, where))
    m = mf.read_manifest(tabled, compact=True)
    assert _from_table(m) == (where not in ("header", "splits"))
    assert _as_json(m) == _entries(tabled)
    c = open_corpus(tabled, "train")
    assert c.tokens(0, c.num_tokens).size == c.num_tokens


def test_the_table_file_round_trips_any_shard_table(tmp_path):
    """Splits mixed, a hash some shards lack: columns out, the same records back."""
    mpath = synthetic(tmp_path, 2, 10, seed=1)[0]
    d = json.loads(mpath.read_text())
    d["shards"][1]["split"] = "validation"
    d["shards"][0]["loss_sha256"] = "ab" * 32
    table = mf.parse_manifest_columns(json.dumps(d).encode(), "x")[1]
    head, cols, unchecked = fmt.decode_table(fmt.encode_table({"k": 1}, table.columns()), defer=("hex:",))
    assert head == {"k": 1} and set(unchecked) == {k for k in cols if k.startswith("hex:")}
    back = type(table).from_columns(cols, "t")
    assert [s.to_json() for s in back] == [s.to_json() for s in table]
    assert [s.sha256 for s in back] == [e["sha256"] for e in d["shards"]]
    assert [s.loss_sha256 for s in back] == ["ab" * 32, None]
    assert back.split_mask("validation").tolist() == [False, True]


def test_validate_names_a_current_table_file_that_disagrees_with_the_manifest(tabled):
    """An edit that gives the manifest back its inode, size and mtime (deliberate: no write does)
    leaves the table file current; validate then names it, and passes once it is deleted."""
    from h5corpus.storage.validate import validate_corpus

    assert validate_corpus(tabled).ok
    st = tabled.stat()
    text = tabled.read_text()
    e = _entries(tabled)[2]
    edited = text.replace(f'"{e["path"]}"', f'"{e["path"][:-3]}.x5"')  # same length
    with open(tabled, "r+") as fh:
        fh.write(edited)
    os.utime(tabled, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert mf.table_manifest(tabled) is not None  # current, by its key
    found = [f for f in validate_corpus(tabled).findings if f.code == "table"]
    assert len(found) == 1 and fmt.table_path(tabled).name in found[0].message
    fmt.table_path(tabled).unlink()
    assert not [f for f in validate_corpus(tabled).findings if f.code == "table"]


def test_a_corpus_opened_from_the_table_file_pickles_for_spawned_workers(tabled):
    """What a spawned DataLoader worker receives: the same shards and tokens, with columns of its
    own (not views of the parent's map)."""
    import pickle

    c = open_corpus(tabled, "train")
    blob = pickle.dumps(c)
    c2 = pickle.loads(blob)
    assert _as_json(c2.manifest) == _entries(tabled)
    assert (c2.tokens(0, c2.num_tokens) == c.tokens(0, c.num_tokens)).all()
    assert isinstance(c2.entries._paths, bytes)


def test_a_manifest_dated_in_the_future_gets_no_table_file(tmp_path):
    """The writer cannot wait for the clock to pass that mtime: it refuses by name (after 2.5 s),
    leaves no table file, and readers parse the manifest."""
    mpath = synthetic(tmp_path, 2, 10, seed=2)[0]
    future = mpath.stat().st_mtime_ns + 3600 * 10**9
    os.utime(mpath, ns=(future, future))
    with pytest.raises(FormatError, match="in the future"):
        mf.write_table_file(mpath)
    assert not fmt.table_path(mpath).exists() and not list(mpath.parent.glob(".*.tmp"))
    m = mf.read_manifest(mpath, compact=True)
    assert not _from_table(m) and _as_json(m) == _entries(mpath)
