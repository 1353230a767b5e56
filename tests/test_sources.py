"""Sources: spec resolution, task planning, and streaming readers on real text and bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from h5corpus.build.input.records import BadRecord
from h5corpus.build.input.sources import SourceError, parse_hf_spec, plan_tasks, resolve_sources, stdlib_files
from tests.helpers import task_records, write_fineweb_parquet

FINEWEB_REV = "9bb295ddab0e05d785b879661af7260fed5140fc"


def read_all(specs, *, task_bytes=1 << 30, text_field="text", **kw) -> list:
    """Every record of every task, in task order."""
    tasks = plan_tasks(resolve_sources(specs, **kw), task_bytes=task_bytes)
    out = []
    for t in tasks:
        for r in task_records(t, text_field):  # the build's run readers give the same records
            out.append(r if isinstance(r, BadRecord) else r[0])
    return out


def write_jsonl(path: Path, texts, **extra) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for i, t in enumerate(texts):
            fh.write(json.dumps({"id": f"d{i}", "text": t, **extra}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="module")
def texts(stdlib_corpus_texts) -> list[str]:
    """Real text with multi-byte characters so byte-range cuts land inside characters too."""
    return [t if i % 3 else t + "\n# ünïcödé — 日本語 👍\n" for i, t in enumerate(stdlib_corpus_texts[:80])]


@pytest.mark.parametrize("task_bytes", [997, 20_000, 333_333, 1 << 30])
def test_jsonl_byte_ranges_partition_lines_exactly(tmp_path, texts, task_bytes):
    """Every line belongs to exactly one range task (the one holding its first byte), in order."""
    p = write_jsonl(tmp_path / "a.jsonl", texts)
    tasks = plan_tasks(resolve_sources([str(p)]), task_bytes=task_bytes)
    if task_bytes < p.stat().st_size:
        assert len(tasks) > 1
    assert read_all([str(p)], task_bytes=task_bytes) == texts


@pytest.mark.parametrize("block", [1, 7, 4096])
def test_jsonl_block_reads_give_the_same_records_and_line_numbers(tmp_path, texts, monkeypatch, block):
    """The JSONL reader splits lines out of fixed-size blocks: any block size (lines spanning many
    blocks, blank and CRLF lines, a last line without a newline, byte ranges) gives exactly the
    records, order and line numbers of whole-file reading."""
    import h5corpus.build.input.records as src

    rows = [json.dumps({"text": t}, ensure_ascii=False) for t in texts[:30]]
    rows[7] = '{"text": broken'
    rows[12] = "   "
    rows[20] = rows[20] + "\r"
    p = tmp_path / "b.jsonl"
    p.write_text("\n".join(rows), encoding="utf-8")  # no newline after the last line
    want = read_all([str(p)], task_bytes=2_000)
    assert [r.where for r in want if isinstance(r, BadRecord)] == [f"{p}:8"]
    assert [r for r in want if not isinstance(r, BadRecord)] == [
        t for i, t in enumerate(texts[:30]) if i not in (7, 12)
    ]
    monkeypatch.setattr(src, "_JSONL_BLOCK", block)
    assert read_all([str(p)], task_bytes=2_000) == want


def test_every_format_streams_the_same_documents(tmp_path, texts):
    """jsonl, jsonl.gz, jsonl.zst, parquet (row-group tasks) and a folder of .txt agree."""
    write_jsonl(tmp_path / "a.jsonl", texts)
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write((tmp_path / "a.jsonl").read_text(encoding="utf-8"))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress((tmp_path / "a.jsonl").read_bytes()))
    pq_path = write_fineweb_parquet(tmp_path / "d.parquet", texts, row_group_size=7)
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, t in enumerate(texts):
        (txt / f"{i:04d}.txt").write_text(t, encoding="utf-8")
    (txt / "README.md").write_text("ignored: not a supported type")
    (txt / ".hidden.txt").write_text("ignored: dot-file")
    for spec in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "txt"):
        assert read_all([str(tmp_path / spec)], task_bytes=50_000) == texts, spec
    assert len(plan_tasks(resolve_sources([str(pq_path)]), task_bytes=50_000)) > 1


def test_input_order_is_spec_order_then_sorted_paths(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "b.jsonl", ["b1", "b2"])
    write_jsonl(tmp_path / "d" / "a.jsonl", ["a1"])
    write_jsonl(tmp_path / "z.jsonl", ["z1"])
    assert read_all([str(tmp_path / "z.jsonl"), str(tmp_path / "d")]) == ["z1", "a1", "b1", "b2"]
    assert read_all([str(tmp_path / "d" / "*.jsonl")]) == ["a1", "b1", "b2"]


def test_bad_specs_are_usage_errors_naming_the_spec(tmp_path):
    with pytest.raises(SourceError, match="no such file or folder"):
        resolve_sources([str(tmp_path / "missing.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unsupported file type"):
        resolve_sources([str(tmp_path / "x.csv")])
    with pytest.raises(SourceError, match="matches no files"):
        resolve_sources([str(tmp_path / "*.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no supported files"):
        resolve_sources([str(tmp_path / "empty")])


def test_bad_jsonl_records_name_file_and_line(tmp_path):
    """Invalid UTF-8, malformed JSON, non-objects, missing/non-string fields and lone surrogates are
    BadRecords naming file:line; NUL bytes and empty texts are documents; blank lines are not records."""
    lines = [
        b'{"text": "ok one"}',
        b'{"text": "bad \xff utf8"}',
        b'{"text": "unterminated',
        b"",
        b"   ",
        b"[1, 2]",
        b'{"body": "no text field"}',
        b'{"text": 42}',
        b'{"text": null}',
        b'{"text": "lone \\ud800 surrogate"}',
        b'{"text": "nul\\u0000inside"}',
        b'{"text": ""}',
        b'{"text": "raw\ttab and \x01 control"}',
    ]
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    recs = read_all([str(p)])
    got = [(r.where, r.code) if isinstance(r, BadRecord) else r for r in recs]
    name = str(p)
    assert got == [
        "ok one",
        (f"{name}:2", "invalid_utf8"),
        (f"{name}:3", "malformed_json"),
        (f"{name}:6", "not_object"),
        (f"{name}:7", "missing_field"),
        (f"{name}:8", "not_string"),
        (f"{name}:9", "not_string"),
        (f"{name}:10", "invalid_unicode"),
        "nul\x00inside",
        "",
        "raw\ttab and \x01 control",
    ]
    assert "null" in recs[6].reason and "'text'" in recs[4].reason


def test_line_numbers_are_absolute_in_later_byte_ranges(tmp_path, texts):
    rows = [json.dumps({"text": t}) for t in texts[:40]]
    rows[33] = '{"text": broken'
    p = tmp_path / "big.jsonl"
    p.write_text("\n".join(rows) + "\n")
    bad = [r for r in read_all([str(p)], task_bytes=10_000) if isinstance(r, BadRecord)]
    assert [b.where for b in bad] == [f"{p}:34"]


def test_corrupt_and_unreadable_files_report_where_reading_stopped(tmp_path, texts):
    raw = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    p = tmp_path / "cut.jsonl.gz"
    p.write_bytes(raw[: len(raw) // 2])
    recs = read_all([str(p)])
    assert recs[:-1] == texts[: len(recs) - 1] and len(recs) > 2
    assert isinstance(recs[-1], BadRecord) and recs[-1].fatal and recs[-1].where.startswith(f"{p}:")
    q = tmp_path / "fake.parquet"
    q.write_bytes(b"this is not parquet")
    [r] = read_all([str(q)])
    assert isinstance(r, BadRecord) and r.fatal and r.code == "unreadable" and r.where == str(q)


def test_parquet_nulls_and_missing_columns_are_bad_rows(tmp_path):
    p = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c"]}), p)
    recs = read_all([str(p)])
    assert recs[0] == "a" and recs[2] == "c"
    assert isinstance(recs[1], BadRecord) and recs[1].where == f"{p} row 1"
    recs = read_all([str(p)], text_field="content")
    assert [r.where for r in recs] == [f"{p} row {i}" for i in range(3)] and all(
        r.code == "missing_field" for r in recs
    )


@pytest.mark.parametrize("value_type", ["string", "large_string"])
@pytest.mark.parametrize("arrow_schema", [True, False], ids=["arrow-schema", "parquet-only"])
def test_dictionary_encoded_string_columns_read_as_their_strings(tmp_path, texts, value_type, arrow_schema):
    """A dictionary-encoded text column (as pandas categoricals and some writers produce) gives the
    same documents as the plain column, and a null is still a bad row named by its row."""
    values = [texts[i % 7] for i in range(40)] + [None] + texts[:5]
    col = pa.array(values, type=getattr(pa, value_type)()).dictionary_encode()
    d = tmp_path / "dict.parquet"
    pq.write_table(pa.table({"text": col}), d, row_group_size=9, store_schema=arrow_schema)
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"text": pa.array(values)}), plain, row_group_size=9)
    if arrow_schema:
        assert pa.types.is_dictionary(pq.ParquetFile(d).schema_arrow.field("text").type)
    recs = read_all([str(d)], task_bytes=300)
    assert recs[:40] + recs[41:] == [v for v in values if v is not None]
    assert isinstance(recs[40], BadRecord) and recs[40].where == f"{d} row 40" and recs[40].code == "not_string"
    assert [r for r in read_all([str(plain)], task_bytes=300) if isinstance(r, str)] == recs[:40] + recs[41:]


def test_a_million_character_document_streams_whole(tmp_path, stdlib_corpus_texts):
    big = "".join(stdlib_corpus_texts)[:1_200_000]
    assert len(big) == 1_200_000
    p = write_jsonl(tmp_path / "big.jsonl", ["short", big, "after"])
    assert read_all([str(p)], task_bytes=100_000) == ["short", big, "after"]


def test_hf_spec_requires_a_pinned_commit():
    assert parse_hf_spec(f"hf://datasets/HuggingFaceFW/fineweb@{FINEWEB_REV}/sample/10BT") == (
        "HuggingFaceFW/fineweb",
        FINEWEB_REV,
        "sample/10BT",
    )
    with pytest.raises(SourceError, match="pin the dataset to a commit"):
        parse_hf_spec("hf://datasets/HuggingFaceFW/fineweb@main/sample/10BT")
    with pytest.raises(SourceError, match="hf://datasets/ORG/NAME@REVISION/PATH"):
        parse_hf_spec("hf://HuggingFaceFW/fineweb/sample/10BT")


def test_hf_source_reads_fineweb_schema_from_the_local_cache(tmp_path, texts, monkeypatch):
    """FineWeb sample-10BT at the pinned revision, served from a local hub cache (offline)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = tmp_path / "hub" / "datasets--HuggingFaceFW--fineweb" / "snapshots" / FINEWEB_REV / "sample" / "10BT"
    write_fineweb_parquet(snap / "000_00000.parquet", texts[:50], row_group_size=8)
    write_fineweb_parquet(snap / "001_00000.parquet", texts[50:], row_group_size=8)
    spec = f"hf://datasets/HuggingFaceFW/fineweb@{FINEWEB_REV}/sample/10BT"
    [inp] = resolve_sources([spec], hf_cache_dir=tmp_path / "hub")
    assert inp.meta == {"repo": "HuggingFaceFW/fineweb", "revision": FINEWEB_REV, "path": "sample/10BT"}
    assert [f.name for f in inp.files] == ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]
    assert read_all([spec], task_bytes=20_000, hf_cache_dir=tmp_path / "hub") == texts
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE"):
        resolve_sources([f"hf://datasets/HuggingFaceFW/fineweb@{'0' * 40}/sample/10BT"], hf_cache_dir=tmp_path / "hub")


def test_stdlib_source_is_the_standard_library_without_tests():
    files = stdlib_files()
    names = [n for n, _ in files]
    assert names == sorted(names) and len(names) > 300
    assert "<stdlib>/json/decoder.py" in names
    assert not any("/test/" in n or "/tests/" in n or "site-packages" in n for n in names)
    [inp] = resolve_sources(["stdlib"])
    assert inp.kind == "stdlib" and len(inp.files) == len(files)


# Lines where the json module (strict=False) and orjson (RFC 8259) disagree or that are easy to get
# wrong: every one must give the record the json module gives.
_TRICKY_JSONL_LINES = [
    b'{"text": "plain"}',
    b'{"text": "first", "text": "last wins", "x": 1}',
    b'{"text": 1, "text": "string last"}',
    b'{"text": "string first", "text": 2}',
    b'{"text": "lone \\ud800 high"}',
    b'{"text": "lone \\udc00 low"}',
    b'{"text": "\\udc00\\ud800 reversed"}',
    b'{"text": "pair \\ud83d\\ude00 ok"}',
    b'{"text": "raw\ttab and \x01 and \x1f"}',
    b'{"text": "nul\\u0000escape"}',
    b'{"text": "del\x7f and c1 \xc2\x85"}',
    b'{"text": NaN}',
    b'{"text": Infinity}',
    b'{"text": -Infinity}',
    b'{"text": 1e999}',
    b'{"text": 123456789012345678901234567890}',
    b'{"text": 18446744073709551616}',
    b'{"text": -9223372036854775809}',
    b'{"text": "ok", "n": 123456789012345678901234567890}',
    b'{"text": "ok", "f": NaN}',
    b'\xef\xbb\xbf{"text": "bom"}',
    b'{"text": "bad \xff byte"}',
    b'{"text": "surrogate \xed\xa0\x80 bytes"}',
    b'{"text": "overlong \xc0\xaf"}',
    b'{"text": "beyond \xf4\x90\x80\x80"}',
    b'{"other": "\xff", "text": "ok"}',
    b'{"text": "x"} trailing',
    b'{"text": "x"}\x00',
    b'{"text": "x",}',
    b"{'text': 'single'}",
    b'{"text": "x" /* c */}',
    b'{"text": 01}',
    b'[{"text": "in a list"}]',
    b'"just a string"',
    b"null",
    b"42",
    b'{"text": null}',
    b'{"text": true}',
    b'{"text": ["a"]}',
    b'{"text": {"a": 1}}',
    b'{"body": "no text field"}',
    b'{"text": "escapes \\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9 \\u65e5"}',
    b'{"text": "<|endoftext|>"}',
    b'{"text": ""}',
    b' \t {"text": "padded"} \t ',
    b'{"text": "crlf"}\r',
    b'\x0c{"text": "form feed before"}',
    b'{"text": "' + "ünïcödé 日本語 👍🏽".encode() + b'"}',
    b'{"a": ' * 2000 + b"1" + b"}" * 2000,  # deeper than orjson's limit; the json module takes it
]


def _records_both_ways(monkeypatch, specs, *, task_bytes=1 << 30) -> tuple[list, list]:
    """Every record, (text, utf8) or BadRecord, read with orjson and with the json module alone."""
    import h5corpus.build.input.records as src

    def records() -> list:
        tasks = plan_tasks(resolve_sources(specs), task_bytes=task_bytes)
        return [r for t in tasks for r in task_records(t, "text")]

    assert src._fast_loads is not None, "orjson is a dependency (pyproject.toml)"
    fast = records()
    with monkeypatch.context() as m:
        m.setattr(src, "_fast_loads", None)
        slow = records()
    return fast, slow


def test_fast_json_parsing_gives_exactly_the_json_modules_records(tmp_path, monkeypatch, texts):
    """orjson is only a faster route: on tricky lines (lone surrogates, control characters, NaN,
    huge ints, duplicate keys, invalid UTF-8, BOM, deep nesting) and on real text, every document
    and every BadRecord (file:line, reason, code) equals what the json module gives."""
    p = tmp_path / "tricky.jsonl"
    p.write_bytes(b"\n".join(_TRICKY_JSONL_LINES) + b"\n")
    fast, slow = _records_both_ways(monkeypatch, [str(p)])
    assert len(fast) == len(_TRICKY_JSONL_LINES)
    assert fast == slow
    assert sum(isinstance(r, BadRecord) for r in fast) >= 20  # the bad lines are really bad
    assert ("last wins", b"last wins") in fast and ("string last", b"string last") in fast
    q = write_jsonl(tmp_path / "real.jsonl", texts)
    fast, slow = _records_both_ways(monkeypatch, [str(q)], task_bytes=50_000)
    assert fast == slow and fast == [(t, t.encode()) for t in texts]


def test_fast_json_parsing_matches_on_the_whole_dev_corpus(monkeypatch, dev_dir):
    """The same equality on the 10.6k real documents of the dev corpus (every script it holds)."""
    fast, slow = _records_both_ways(monkeypatch, [str(dev_dir)])
    assert len(fast) > 10_000 and fast == slow


# -- truncated and corrupt compressed streams, the UTF-8 BOM ---------------------------------------------
def _jsonl_lines(texts) -> list[bytes]:
    return [(json.dumps({"text": t}, ensure_ascii=False) + "\n").encode() for t in texts]


def _assert_cut(recs: list, texts: list[str], p: Path, complete: int) -> None:
    """The complete lines' records, in order, then one fatal truncation record naming the next line."""
    assert recs[:-1] == texts[:complete]
    bad = recs[-1]
    assert isinstance(bad, BadRecord) and bad.fatal and bad.code == "truncated", bad
    assert bad.where == f"{p}:{complete + 1}" and bad.reason.startswith("truncated: "), bad


def _zstd_blocks(lines: list[bytes], every: int, checksum: bool = True) -> tuple[bytes, list[int]]:
    """One zstd frame whose blocks end every ``every`` lines; returns it and the block boundaries."""
    co = zstandard.ZstdCompressor(level=3, write_checksum=checksum).compressobj()
    out, bounds = b"", []
    for i in range(0, len(lines), every):
        out += co.compress(b"".join(lines[i : i + every])) + co.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        bounds.append(len(out))
    return out + co.flush(), bounds


def _complete_lines(decoded: bytes) -> int:
    return decoded.count(b"\n")


@pytest.mark.parametrize("checksum", [True, False])
def test_a_zstd_stream_cut_anywhere_is_truncation_after_its_complete_lines(tmp_path, texts, checksum):
    """Cut at every block boundary (each one a line end), inside blocks, inside the last block and
    checksum, inside the frame header: the records are the complete lines in what can be decoded
    (zstd's decompressobj, another API, is the oracle), then one truncation record naming the next
    line. The whole file reads whole, with no bad record."""
    many = texts * 3
    data, bounds = _zstd_blocks(_jsonl_lines(many), 7, checksum)
    cuts = set(bounds) | {b + 11 for b in bounds[:-1]} | {len(data) - 1, len(data) - 3, 2, 5, 9}
    p = tmp_path / "c.jsonl.zst"
    for cut in sorted(c for c in cuts if 0 < c < len(data)):
        p.write_bytes(data[:cut])
        decoded = zstandard.ZstdDecompressor().decompressobj().decompress(data[:cut])
        _assert_cut(read_all([str(p)]), many, p, _complete_lines(decoded))
    p.write_bytes(data)
    assert read_all([str(p)]) == many


def test_a_gzip_stream_cut_anywhere_keeps_every_complete_line(tmp_path, texts):
    """Cuts all through the stream, in the header and in the 8-byte trailer: every complete line in
    what zlib can decode is a record (none of a 1 MiB read block is lost), then one truncation
    record naming the next line."""
    many = texts * 12  # well over 1 MiB of JSON
    body = b"".join(_jsonl_lines(many))
    assert len(body) > 2 << 20
    data = gzip.compress(body)
    cuts = {len(data) * k // 23 for k in range(1, 23)} | {len(data) - k for k in range(1, 9)} | {5, 11}
    p = tmp_path / "c.jsonl.gz"
    import zlib

    for cut in sorted(cuts):
        p.write_bytes(data[:cut])
        decoded = zlib.decompressobj(wbits=31).decompress(data[:cut])
        _assert_cut(read_all([str(p)]), many, p, _complete_lines(decoded))


def test_whole_multi_frame_and_multi_member_streams_read_whole(tmp_path, texts):
    """zstd: several frames, an empty frame, skippable frames (before, between, after); gzip: several
    members and zero padding; empty files: all records, no bad record."""
    import struct

    lines = _jsonl_lines(texts)
    half = len(lines) // 2
    c = zstandard.ZstdCompressor(level=3)
    skip = struct.pack("<II", 0x184D2A53, 5) + b"12345"
    zst = skip + c.compress(b"".join(lines[:half])) + c.compress(b"") + skip + c.compress(b"".join(lines[half:])) + skip
    (tmp_path / "m.jsonl.zst").write_bytes(zst)
    gz = gzip.compress(b"".join(lines[:half])) + gzip.compress(b"".join(lines[half:])) + b"\0" * 16
    (tmp_path / "m.jsonl.gz").write_bytes(gz)
    for name in ("m.jsonl.zst", "m.jsonl.gz"):
        assert read_all([str(tmp_path / name)]) == texts, name
    for name in ("e.jsonl.zst", "e.jsonl.gz"):
        (tmp_path / name).write_bytes(b"")
        assert read_all([str(tmp_path / name)]) == [], name


@pytest.mark.parametrize("damage", ["zst-garbage", "zst-flip", "gz-garbage", "gz-flip", "gz-crc"])
def test_corrupt_compressed_streams_are_unreadable_records_not_crashes(tmp_path, texts, damage):
    """Trailing garbage, flipped bytes or a wrong CRC end in one fatal ``unreadable`` record, never an
    exception out of the reader. After trailing garbage or a wrong CRC every record came first;
    flipped bytes may decode to garbage before the decompressor notices (gzip's CRC covers the
    whole member), which only the records up to the first bad one can be trusted for."""
    body = b"".join(_jsonl_lines(texts * 4))
    kind, how = damage.split("-")
    data = bytearray(zstandard.ZstdCompressor(level=3).compress(body) if kind == "zst" else gzip.compress(body))
    if how == "garbage":
        data += b"this is not part of any stream"
    elif how == "flip":
        for k in range(len(data) // 2, len(data) // 2 + 64):
            data[k] ^= 0x5A
    else:
        data[-6] ^= 0x01  # inside the CRC32 of the trailer
    p = tmp_path / f"x.jsonl.{'zst' if kind == 'zst' else 'gz'}"
    p.write_bytes(bytes(data))
    recs = read_all([str(p)])
    bad = recs[-1]
    assert isinstance(bad, BadRecord) and bad.fatal and bad.code == "unreadable", bad
    if how == "flip":
        good = next(i for i, r in enumerate(recs) if isinstance(r, BadRecord))
        assert recs[:good] == (texts * 4)[:good]
    else:
        assert recs[:-1] == texts * 4


@pytest.mark.parametrize("block", [1, 2, 3, 4096, 1 << 20])
def test_a_utf8_bom_at_the_start_of_a_jsonl_file_is_not_data(tmp_path, texts, monkeypatch, block):
    """A BOM at the very start of a .jsonl/.jsonl.gz/.jsonl.zst is skipped (any read block size,
    byte-range tasks too); a BOM at the start of a later line is data: that line is malformed JSON
    at its own line number."""
    import h5corpus.build.input.records as src

    monkeypatch.setattr(src, "_JSONL_BLOCK", block)
    bom = b"\xef\xbb\xbf"
    body = b"".join(_jsonl_lines(texts[:20]))
    (tmp_path / "a.jsonl").write_bytes(bom + body)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(bom + body))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(bom + body))
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst"):
        assert read_all([str(tmp_path / name)]) == texts[:20], name
    assert read_all([str(tmp_path / "a.jsonl")], task_bytes=3_000) == texts[:20]
    lines = _jsonl_lines(texts[:5])
    (tmp_path / "mid.jsonl").write_bytes(lines[0] + bom + lines[1] + b"".join(lines[2:]))
    recs = read_all([str(tmp_path / "mid.jsonl")])
    assert recs[0] == texts[0] and recs[2:] == texts[2:5]
    assert isinstance(recs[1], BadRecord) and recs[1].where == f"{tmp_path / 'mid.jsonl'}:2"
    assert recs[1].code == "malformed_json"
    for only in (bom, bom + b"\n", bom + b"  \n\n"):
        (tmp_path / "o.jsonl").write_bytes(only)
        assert read_all([str(tmp_path / "o.jsonl")]) == []
