"""Hostile build inputs: records without an end (a ``/dev/zero`` link, a FIFO, a multi-GB line
written sparse, a compressed line that expands without bound, a huge ``.txt`` file or parquet
cell), ``hf://`` specs that are offline or climb out of the hub cache, a raw NUL in a JSON string,
and a file cut short while the build reads it. Every case: one clear error naming the file, record
or argument, the right exit code (2 for a bad argument, 1 for bad data under ``--on-error
fail``), or the record counted under ``--on-error skip``; no traceback, no hang, peak memory far
below the input's size."""

from __future__ import annotations

import gzip
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from h5corpus.build import BuildConfig
from tests.helpers import write_jsonl
from tests.hostile import Measured, MiB, run_measured

#: Peak RSS allowed for a build refusing a hostile input: an interpreter with the build loaded
#: takes ~150 MiB; the record limits below are 1-8 MiB, the inputs 64 MiB to 1 GiB and unbounded.
RSS_BOUND = 450 * MiB
REV = "0123456789abcdef0123456789abcdef01234567"


def _build(tmp_path: Path, *sources: str, options: tuple[str, ...] = (), env: dict | None = None) -> Measured:
    args = ["h5corpus", "build", *sources, "--tokenizer", "bytes", "--workers", "1", "--json", *options]
    return run_measured(args, cwd=tmp_path, env=env)


def _report(m: Measured) -> dict:
    assert m.returncode == 0 and not m.timed_out, m.stderr[-3000:]
    return json.loads(m.stdout)


# -- records without an end ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["zero.jsonl", "zero.jsonl.gz", "zero.txt", "zero.parquet"])
def test_a_link_to_dev_zero_is_refused_as_no_regular_file(tmp_path, name):
    (tmp_path / name).symlink_to("/dev/zero")
    m = _build(tmp_path, name)
    m.one_clear_error(2, name, "not a regular file")
    assert m.peak_rss < RSS_BOUND, m.peak_rss
    assert not (tmp_path / "shards").exists()


def test_a_fifo_is_refused_without_blocking_on_it(tmp_path):
    os.mkfifo(tmp_path / "pipe.jsonl")
    m = _build(tmp_path, str(tmp_path))  # through a folder listing too
    m.one_clear_error(2, "pipe.jsonl", "not a regular file")


def _sparse_middle_line(path: Path, hole: int) -> Path:
    """Three lines: a document, ``{"text": "`` + ``hole`` NUL bytes (a sparse hole: no disk
    used) + ``"}``, a document."""
    with open(path, "wb") as fh:
        fh.write(b'{"text": "first document"}\n{"text": "')
        fh.seek(hole, os.SEEK_CUR)
        fh.write(b'"}\n{"text": "third document"}\n')
    return path


def test_a_1_gib_sparse_line_fails_naming_file_line_and_offset_in_bounded_memory(tmp_path):
    _sparse_middle_line(tmp_path / "big.jsonl", 1 << 30)
    m = _build(tmp_path, "big.jsonl", options=("--max-record-bytes", "8M"))
    line = m.one_clear_error(1, "big.jsonl:2", "longer than 8,388,608 bytes", "byte offset 27")
    assert "--max-record-bytes" in line
    assert m.peak_rss < RSS_BOUND, m.peak_rss


def test_under_skip_the_long_line_is_counted_and_the_rest_of_the_file_is_read(tmp_path):
    _sparse_middle_line(tmp_path / "big.jsonl", 256 * MiB)
    m = _build(tmp_path, "big.jsonl", options=("--max-record-bytes", "1M", "--on-error", "skip"))
    rep = _report(m)
    assert rep["skipped_total"] == 1 and rep["skipped_records"][0].startswith("big.jsonl:2: record longer")
    assert sum(s["documents"] for s in rep["splits"].values()) == 2
    assert m.peak_rss < RSS_BOUND, m.peak_rss


def test_the_default_limit_is_far_above_real_documents_and_a_line_below_the_limit_is_kept(tmp_path):
    assert BuildConfig(sources=["stdlib"]).max_record_bytes >= 64 * MiB
    write_jsonl(tmp_path / "long.jsonl", ["x" * (3 * MiB), "short"])
    rep = _report(_build(tmp_path, "long.jsonl", options=("--max-record-bytes", "4M")))
    assert rep["skipped_total"] == 0
    assert sum(s["tokens"] for s in rep["splits"].values()) == 3 * MiB + 5 + 2  # bytes + one EOS each


def test_a_gzip_line_that_expands_to_512_mib_is_refused_in_bounded_memory(tmp_path):
    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(b'{"text": "ok"}\n{"text": "')
        block = b"a" * (16 * MiB)
        for _ in range(32):
            fh.write(block)
        fh.write(b'"}\n')
    assert path.stat().st_size < 8 * MiB
    m = _build(tmp_path, path.name, options=("--max-record-bytes", "2M"))
    m.one_clear_error(1, "bomb.jsonl.gz:2", "longer than 2,097,152 bytes")
    assert m.peak_rss < RSS_BOUND, m.peak_rss


def test_a_txt_file_over_the_limit_is_refused_before_it_is_read_and_counted_under_skip(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("a small document\n")
    with open(docs / "b.txt", "wb") as fh:  # 512 MiB, sparse
        fh.truncate(512 * MiB)
    (docs / "c.txt").write_text("another small document\n")
    m = _build(tmp_path, "docs", options=("--max-record-bytes", "1M"))
    m.one_clear_error(1, "b.txt", "536,870,912 bytes", "--max-record-bytes")
    assert m.peak_rss < RSS_BOUND
    rep = _report(_build(tmp_path, "docs", options=("--max-record-bytes", "1M", "--on-error", "skip")))
    assert rep["skipped_total"] == 1 and "b.txt" in rep["skipped_records"][0]
    assert sum(s["documents"] for s in rep["splits"].values()) == 2


def test_a_parquet_cell_over_the_limit_is_refused_naming_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="parquet sources need pyarrow")
    import pyarrow.parquet as pq

    texts = ["first", "y" * (3 * MiB), "third"]
    pq.write_table(pa.table({"text": texts}), tmp_path / "cells.parquet", row_group_size=2)
    m = _build(tmp_path, "cells.parquet", options=("--max-record-bytes", "1M"))
    m.one_clear_error(1, "cells.parquet row 1", "longer than 1,048,576 bytes")
    rep = _report(_build(tmp_path, "cells.parquet", options=("--max-record-bytes", "1M", "--on-error", "skip")))
    assert rep["skipped_total"] == 1 and rep["skipped_records"][0].startswith("cells.parquet row 1:")
    assert sum(s["documents"] for s in rep["splits"].values()) == 2


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "lots"])
def test_a_bad_record_limit_is_a_usage_error_naming_the_flag(tmp_path, value):
    write_jsonl(tmp_path / "d.jsonl", ["a"])
    m = _build(tmp_path, "d.jsonl", options=("--max-record-bytes", value))
    m.one_clear_error(2, "--max-record-bytes")


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "64M"])
def test_the_library_refuses_a_bad_record_limit_naming_the_field(value):
    with pytest.raises(ValueError, match="max_record_bytes"):
        BuildConfig(sources=["stdlib"], max_record_bytes=value).check()


# -- JSON strings ---------------------------------------------------------------------------------
def test_a_raw_nul_in_a_json_string_is_refused_and_an_escaped_one_is_kept(tmp_path):
    (tmp_path / "nul.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "a\x00b"}\n{"text": "c\\u0000d"}\n')
    m = _build(tmp_path, "nul.jsonl")
    m.one_clear_error(1, "nul.jsonl:2", "NUL")
    rep = _report(_build(tmp_path, "nul.jsonl", options=("--on-error", "skip")))
    assert rep["skipped_total"] == 1 and rep["skipped_records"][0].startswith("nul.jsonl:2:")
    assert sum(s["documents"] for s in rep["splits"].values()) == 2


# -- hf:// specs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        f"hf://datasets/x/y@{REV}/../../../../planted",
        f"hf://datasets/x/y@{REV}/data/../../../../../planted",
        f"hf://datasets/x/y@{REV}/./../../../../planted/docs.jsonl",
        f"hf://datasets/x/..@{REV}/planted",
        f"hf://datasets/../y@{REV}/planted",
        f"hf://datasets/x/y@{REV}/*/../../../../../planted/*.jsonl",
    ],
)
def test_a_dot_dot_in_an_hf_spec_is_refused_and_never_reaches_the_cache_path(tmp_path, spec):
    """A planted folder the ``..`` would reach from the cache's snapshot folder holds a real
    document: the spec is refused (exit 2, naming it) and nothing is read."""
    cache = tmp_path / "cache"
    snap = cache / "datasets--x--y" / "snapshots" / REV
    (snap / "data").mkdir(parents=True)
    write_jsonl(tmp_path / "planted" / "docs.jsonl", ["a planted document"])
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    m = _build(tmp_path, spec, env=env)
    m.one_clear_error(2, spec)
    assert "'..'" in m.stderr or "repository name" in m.stderr
    assert not (tmp_path / "shards").exists()


class _HungListener:
    """A local TCP port whose connects hang: a listener with a full backlog that never accepts."""

    def __enter__(self) -> int:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(0)
        self.fillers = []
        port = self.srv.getsockname()[1]
        for _ in range(4):  # fill the backlog; later SYNs are dropped, so connects hang
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            self.fillers.append(s)
        return port

    def __exit__(self, *exc: object) -> None:
        for s in self.fillers:
            s.close()
        self.srv.close()


def test_a_hub_that_never_answers_fails_fast_in_one_line_without_an_abort(tmp_path):
    """No network answer at all (the connect hangs): ``hf://`` sources and the gpt2 tokenizer
    each fail in one line with exit 2 within seconds; the process exits normally (no
    ``FATAL: exception not rethrown`` from a probe thread left behind, no exit 134)."""
    with _HungListener() as port:
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_CACHE": str(tmp_path / "cache")}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        env.pop("HF_HUB_OFFLINE", None)
        for args in (
            ["h5corpus", "build", f"hf://datasets/x/y@{REV}/data", "--tokenizer", "bytes"],
            ["h5corpus", "build", "stdlib", "--tokenizer", "gpt2"],
            ["h5corpus", "quality-model", "train", f"hf://datasets/x/y@{REV}/data", "-o", "m.npz"],
        ):
            t0 = time.monotonic()
            m = run_measured(args, cwd=tmp_path, env=env, timeout=120)
            m.one_clear_error(2, "could not be")
            assert time.monotonic() - t0 < 60, args


def test_the_hub_probe_leaves_no_thread_behind():
    from h5corpus.build.tokenize.tokenizer import hub_unreachable

    before = set(threading.enumerate())  # threads of earlier tests may end meanwhile: count new ones only
    with _HungListener() as port:
        os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
        try:
            why = hub_unreachable(timeout_s=0.5)
        finally:
            del os.environ["HF_ENDPOINT"]
    assert str(port) in why and ("timed out" in why or "no answer" in why), why
    assert not set(threading.enumerate()) - before


# -- the reader itself: ranges, line numbers, files that change ------------------------------------
def _records(path: Path, *, task_bytes: int, limit: int) -> list:
    from h5corpus.build.input.records import TaskReader
    from h5corpus.build.input.sources import plan_tasks, resolve_sources

    tasks = plan_tasks(resolve_sources([str(path)]), task_bytes=task_bytes)
    return [rec for t in tasks for rec in TaskReader(t, max_record_bytes=limit)]


@pytest.mark.parametrize("task_bytes", [1 << 30, 4096, 700])
def test_a_long_line_across_task_ranges_is_one_bad_record_and_every_other_line_is_read_once(tmp_path, task_bytes):
    """Lines of 0.1-3x the limit, cut into byte ranges at any place: each line is read by exactly
    one task, the too-long ones become one ``too_long`` record each, naming the right line and
    its byte offset (an oracle from the file's own bytes)."""
    from h5corpus.build.input.records import BadRecord

    limit = 1000
    texts = [("t%d " % i) * (40 if i % 4 else 900 if i % 8 else 90) for i in range(24)]
    path = write_jsonl(tmp_path / "mixed.jsonl", texts)
    raw = path.read_bytes().split(b"\n")[:-1]
    offsets = [sum(len(x) + 1 for x in raw[:i]) for i in range(len(raw))]
    want_bad = [f"{path}:{i + 1}" for i, line in enumerate(raw) if len(line) > limit]
    assert 2 <= len(want_bad) < len(raw)
    got = _records(path, task_bytes=task_bytes, limit=limit)
    docs = [r[0] for r in got if not isinstance(r, BadRecord)]
    bad = [r for r in got if isinstance(r, BadRecord)]
    assert docs == [t for t, line in zip(texts, raw) if len(line) <= limit]
    assert [b.where for b in bad] == want_bad and {b.code for b in bad} == {"too_long"}
    for b in bad:
        n = int(b.where.rsplit(":", 1)[1])
        assert f"at byte offset {offsets[n - 1]:,}" in b.reason and not b.fatal


def test_a_file_cut_short_after_planning_is_reported_as_changed_not_as_malformed_json(tmp_path):
    from h5corpus.build.input.records import BadRecord, TaskReader
    from h5corpus.build.input.sources import plan_tasks, resolve_sources

    path = write_jsonl(tmp_path / "cut.jsonl", [f"document {i} " * 30 for i in range(200)])
    tasks = plan_tasks(resolve_sources([str(path)]), task_bytes=16_000)
    assert len(tasks) > 2
    os.truncate(path, path.stat().st_size // 2 + 7)  # mid-line, as a writer still copying it
    got = [rec for t in tasks for rec in TaskReader(t)]
    bad = [r for r in got if isinstance(r, BadRecord)]
    assert bad and {b.code for b in bad} == {"changed"} and all(b.fatal for b in bad), bad
    assert "changed while the build read it" in bad[0].reason and bad[0].where.startswith(f"{path}:")


def test_a_changed_file_stops_the_build_even_under_skip(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("one document\n")
    from h5corpus.build.input.records import TaskReader
    from h5corpus.build.input.sources import plan_tasks, resolve_sources

    (task,) = plan_tasks(resolve_sources([str(docs)]), task_bytes=1 << 20)
    (docs / "a.txt").write_text("one document, and more written after planning\n")
    (rec,) = list(TaskReader(task))
    assert rec.code == "changed" and "13 bytes when planned, now 46" in rec.reason


@pytest.mark.parametrize(
    "spec, message",
    [
        (f"hf://datasets/x/y@{REV}/" + "a/" * 3000 + "d.jsonl", "File name too long"),
        (f"hf://datasets/{'a' * 200}/y@{REV}/d.jsonl", "is not a hub repository name"),
        (f"hf://datasets/x--z/y@{REV}/d.jsonl", "is not a hub repository name"),
        (f"hf://datasets/x/-y@{REV}/d.jsonl", "is not a hub repository name"),
        (f"hf://datasets/x/y@{REV}/a/./b.jsonl", "'.' or '..'"),
    ],
)
def test_odd_hf_specs_are_one_usage_error_naming_the_spec(tmp_path, spec, message):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    m = _build(tmp_path, spec, env=env)
    m.one_clear_error(2, spec[:60], message)
