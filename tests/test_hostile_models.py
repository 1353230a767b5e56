"""Hostile n-gram model files (``--perplexity-model``, ``quality-model score``): what a file
declares (zip member sizes, ``.npy`` shapes, compression) is checked against the file's own size
before anything is allocated, and values no model holds are refused. Every case: one
:class:`ModelFileError` naming the file and the member or header field; in the CLI one line, exit
2, no traceback, peak memory far below what the file claims."""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from h5corpus.filters.lmunits import BOS_HASH
from h5corpus.filters.ngramtrain import train_ngram_model
from h5corpus.filters.perplexity import Level, ModelFileError, NgramModel, key_of, load_model, model_header
from tests.helpers import stdlib_texts, write_jsonl
from tests.hostile import MiB, python_measured, run_measured

#: Peak RSS allowed for a process refusing a hostile model (an interpreter with numpy and the
#: CLI needs ~100 MiB; the files below claim 1 GiB to 8 TiB).
RSS_BOUND = 400 * MiB


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return train_ngram_model(stdlib_texts(limit=20), order=3).save(tmp_path_factory.mktemp("m") / "good.npz")


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _write_zip(path: Path, members: dict[str, bytes], compress: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression=compress) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _npy_header(descr: str, shape: tuple[int, ...], fortran: bool = False) -> bytes:
    """A version-1.0 ``.npy`` header (magic, length, dict padded to 64 bytes) declaring anything."""
    d = repr({"descr": descr, "fortran_order": fortran, "shape": shape}).encode()
    pad = 64 - (10 + len(d) + 1) % 64
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(d) + pad + 1) + d + b" " * pad + b"\n"


def _with_levels(path: Path, good: Path, change, unk: float | None = None) -> Path:
    """A model whose arrays went through ``change(levels)``, saved with a header that matches
    them (sha256 included): only the value checks can refuse it."""
    m = load_model(good)
    levels = [
        Level(
            lv.keys.copy(),
            lv.log_prob.copy(),
            *(None if a is None else a.copy() for a in (lv.log_backoff, lv.is_context)),
        )
        for lv in m.levels
    ]
    change(levels)
    u = m.unk_log_prob if unk is None else unk
    NgramModel(levels, u, model_header(levels, u)).save(path)
    return path


def _set(name: str, k: int, index: int, value: float):
    def change(levels: list[Level]) -> None:
        getattr(levels[k - 1], name)[index] = value

    return change


def test_a_member_whose_npy_header_claims_2_to_the_40_elements_is_refused_in_bounded_memory(good, tmp_path):
    members = _members(good)
    members["logp2.npy"] = _npy_header("<f4", (1 << 40,)) + b"\0" * 512
    bad = _write_zip(tmp_path / "huge_shape.npz", members)
    assert bad.stat().st_size < 2 * good.stat().st_size
    with pytest.raises(ModelFileError, match=r"array logp2: shape \(1099511627776,\) needs") as e:
        load_model(bad)
    assert str(bad) in str(e.value)
    m = python_measured(f"from h5corpus.filters.perplexity import load_model\nload_model({str(bad)!r})")
    assert m.returncode == 1 and "ModelFileError" in m.stderr and m.peak_rss < RSS_BOUND


def test_a_compressed_member_that_expands_to_1_gib_is_refused_before_reading_it(good, tmp_path):
    members = _members(good)
    bad = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bad, "w") as zf:
        for name, data in members.items():
            if name != "keys3.npy":
                zf.writestr(name, data)
        info = zipfile.ZipInfo("keys3.npy")
        info.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(info, "w", force_zip64=True) as fh:
            fh.write(_npy_header("<u8", (1 << 27,)))
            zeros = bytes(16 * MiB)
            for _ in range(64):  # 1 GiB of zeros, ~1 MiB deflated
                fh.write(zeros)
    assert bad.stat().st_size < 8 * MiB
    with pytest.raises(ModelFileError, match="member 'keys3.npy' is compressed") as e:
        load_model(bad)
    assert str(bad) in str(e.value)
    m = run_measured(
        ["h5corpus", "quality-model", "score", str(bad), str(write_jsonl(tmp_path / "d.jsonl", ["a b c"]))]
    )
    m.one_clear_error(2, str(bad), "keys3.npy")
    assert m.peak_rss < RSS_BOUND, m.peak_rss


def test_a_zip_directory_claiming_more_bytes_than_the_file_holds_is_refused(good, tmp_path):
    data = bytearray(good.read_bytes())
    cd = data.rfind(b"PK\x01\x02" + data[data.find(b"PK\x01\x02") + 4 : data.find(b"PK\x01\x02") + 6])
    first = data.find(b"PK\x01\x02")  # the first central-directory entry: patch both sizes
    assert cd >= first >= 0
    struct.pack_into("<II", data, first + 20, 0xFFFF_FFF0, 0xFFFF_FFF0)
    bad = tmp_path / "lying_directory.npz"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as e:
        load_model(bad)
    assert str(bad) in str(e.value) and (
        "more than the file holds" in str(e.value) or "not an h5corpus" in str(e.value)
    )


@pytest.mark.parametrize(
    "member, payload, message",
    [
        ("keys1.npy", _npy_header(">u8", (4,)) + bytes(32), "array keys1: >u8"),
        ("logp1.npy", _npy_header("|O", (4,)) + bytes(32), "array logp1: object"),
        ("ctx1.npy", _npy_header("|b1", (2, 2)) + bytes(4), "array ctx1"),
        ("bow2.npy", _npy_header("<f4", (4,), fortran=True) + bytes(16), "fortran order True"),
        ("keys2.npy", _npy_header("<u8", (3,)) + bytes(40), r"shape \(3,\) needs 24 bytes; the member holds 40"),
        ("keys2.npy", b"\x93NUMPY\x01\x00\xff\xff" + b"{" * 200, "array keys2: unreadable"),
        ("header.npy", _npy_header("|u1", (1 << 30,)), "array header: shape"),
        ("evil.npy", b"x", "member 'evil.npy' is unexpected"),
        ("../keys1.npy", b"x", "member '../keys1.npy' is unexpected"),
    ],
)
def test_members_with_declarations_no_model_file_makes_are_refused_naming_the_member(
    good, tmp_path, member, payload, message
):
    members = _members(good)
    members[member] = payload
    bad = _write_zip(tmp_path / "bad.npz", members)
    with pytest.raises(ModelFileError, match=message) as e:
        load_model(bad)
    assert str(bad) in str(e.value)


def test_a_repeated_member_is_refused(good, tmp_path):
    bad = tmp_path / "twice.npz"
    with zipfile.ZipFile(bad, "w") as zf, pytest.warns(UserWarning, match="Duplicate name"):
        for name, data in _members(good).items():
            zf.writestr(name, data)
        zf.writestr("logp1.npy", _members(good)["logp1.npy"])
    with pytest.raises(ModelFileError, match="member 'logp1.npy' is unexpected or repeated"):
        load_model(bad)


BOS_KEY = int(key_of(np.array([BOS_HASH], dtype=np.uint64))[0])


@pytest.mark.parametrize(
    "change, message",
    [
        (_set("log_prob", 2, 5, np.nan), "array logp2 holds a NaN"),
        (_set("log_prob", 1, 3, np.inf), "array logp1 holds"),
        (_set("log_prob", 3, 0, -np.inf), "array logp3 holds"),
        (_set("log_prob", 1, 0, 0.5), "array logp1 holds a NaN, positive"),
        (_set("log_backoff", 1, 2, np.nan), "array bow1 holds a NaN"),
        (_set("log_backoff", 2, 2, -np.inf), "array bow2 holds"),
    ],
)
def test_non_finite_and_impossible_values_are_refused_naming_the_array(good, tmp_path, change, message):
    bad = _with_levels(tmp_path / "values.npz", good, change)
    with pytest.raises(ModelFileError, match=message) as e:
        load_model(bad)
    assert str(bad) in str(e.value)


def test_minus_infinity_at_the_start_symbol_is_the_one_accepted(good):
    m = load_model(good)
    lp = m.levels[0].log_prob
    assert np.isneginf(lp).sum() == 1 and int(m.levels[0].keys[np.isneginf(lp)][0]) == BOS_KEY


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("unk_log_prob", float("nan"), "'unk_log_prob' = nan"),
        ("unk_log_prob", float("inf"), "'unk_log_prob' = inf"),
        ("unk_log_prob", float("-inf"), "'unk_log_prob' = -inf"),
        ("unk_log_prob", 2.5, "'unk_log_prob' = 2.5"),
        ("order", True, "'order' = True"),
        ("order", 2**70, "'order' = 1180591620717411303424"),
        ("order", "3", "'order' = '3'"),
        ("ngrams", [1, 2, 3], "'ngrams' does not match"),
    ],
)
def test_bad_header_fields_are_refused_naming_the_field(good, tmp_path, field, value, message):
    m = load_model(good)
    m.header = {**m.header, field: value}
    bad = m.save(tmp_path / "header.npz")
    with pytest.raises(ModelFileError, match=message) as e:
        load_model(bad)
    assert str(bad) in str(e.value)


def test_a_deeply_nested_header_is_one_error_not_a_recursion_traceback(good, tmp_path):
    members = _members(good)
    text = b"[" * 200_000 + b"]" * 200_000
    members["header.npy"] = _npy_header("|u1", (len(text),)) + text
    bad = _write_zip(tmp_path / "nested.npz", members)
    with pytest.raises(ModelFileError, match="unreadable model header") as e:
        load_model(bad)
    assert str(bad) in str(e.value)


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "directory", "empty"])
def test_a_model_path_that_is_no_regular_file_is_refused_without_reading_it(tmp_path, kind):

    path = tmp_path / "model.npz"
    if kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"")
    with pytest.raises(ModelFileError, match="not a regular file|not an h5corpus") as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_the_cli_refuses_hostile_models_with_exit_2_in_build_and_score(good, tmp_path):
    members = _members(good)
    members["keys1.npy"] = _npy_header("<u8", (1 << 40,))
    shape_bomb = _write_zip(tmp_path / "shape_bomb.npz", members)
    nan = _with_levels(tmp_path / "nan.npz", good, _set("log_prob", 2, 1, np.nan))
    docs = write_jsonl(tmp_path / "docs.jsonl", stdlib_texts(limit=5))
    for model, field in [(shape_bomb, "keys1"), (nan, "logp2")]:
        score = run_measured(["h5corpus", "quality-model", "score", str(model), str(docs)], cwd=tmp_path)
        score.one_clear_error(2, str(model), field)
        assert score.peak_rss < RSS_BOUND
    build = run_measured(
        [
            "h5corpus",
            "build",
            str(docs),
            "--tokenizer",
            "bytes",
            "--shards-dir",
            "out",
            "--perplexity-model",
            str(shape_bomb),
        ],
        cwd=tmp_path,
    )
    build.one_clear_error(2, str(shape_bomb))
    assert build.peak_rss < RSS_BOUND
