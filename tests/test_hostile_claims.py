"""Hostile manifests and shards, second pass (issue 30's storage classes): containment judged against
the corpus folder, counts no real file could hold, chunks that were never written, OS errors on
paths, and stray unfinished writes. Each: one clear error naming the shard or field, the right exit
code, no traceback, bounded time and memory.

Every case is made here on a fresh corpus with h5py, json or plain file operations."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import pytest

from h5corpus.storage.format import FormatError
from h5corpus.storage.manifest import read_manifest
from h5corpus.storage.reader import open_corpus
from h5corpus.storage.validate import validate_corpus
from tests.helpers import subprocess_env


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "h5corpus", *args], capture_output=True, text=True, timeout=timeout, env=subprocess_env()
    )


def _clean(p: subprocess.CompletedProcess) -> str:
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out[-3000:]
    return out


def _edit(manifest: Path, fn) -> None:
    raw = json.loads(manifest.read_text())
    fn(raw)
    manifest.write_text(json.dumps(raw))


# -- containment ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards_dir", ["../../outside", "../shards/../../outside", "../..", "./../../outside/."])
def test_shards_dir_outside_the_corpus_is_refused_with_its_shards(stdlib_manifest, shards_dir):
    """The loophole: a relative shards_dir leaving the corpus folder (the manifest folder's parent),
    with every shard path inside it, pointing at a real copy of a shard. Refused by name by every
    entry point, judged on the normalised text, never by following the path."""
    corpus = stdlib_manifest.parent.parent
    name = f"outside-{corpus.name}"  # beside the corpus folder, one per test
    shards_dir = shards_dir.replace("outside", name)
    outside = corpus.parent / name / "train"
    outside.mkdir(parents=True)
    first = read_manifest(stdlib_manifest).shards[0]
    shutil.copyfile(stdlib_manifest.parent / first.path, outside / "x.h5")

    def point_outside(raw: dict) -> None:
        raw["shards_dir"] = shards_dir
        raw["shards"] = [dict(raw["shards"][0], path=f"../../{name}/train/x.h5")]
        raw.pop("splits", None)

    _edit(stdlib_manifest, point_outside)
    with pytest.raises(FormatError, match=r"shards_dir .* leaves the corpus folder"):
        read_manifest(stdlib_manifest)
    with pytest.raises(FormatError, match="shards_dir"):
        open_corpus(stdlib_manifest, "train")
    for cmd in ("validate", "inspect"):
        p = _cli(cmd, str(stdlib_manifest))
        assert p.returncode == 1 and "shards_dir" in _clean(p), (cmd, p.stdout, p.stderr)


def test_shards_dir_inside_the_corpus_is_accepted(stdlib_manifest):
    """The same rule accepts any spelling that stays inside: ``../shards/.`` and ``../x/../shards``."""
    for spelling in ("../shards/.", "../x/../shards"):
        _edit(stdlib_manifest, lambda raw, s=spelling: raw.update(shards_dir=s))
        assert read_manifest(stdlib_manifest).shards


# -- counts no file could hold, chunks never written ---------------------------------------------------


def test_a_tiny_shard_claiming_a_huge_count_is_refused_before_any_work(stdlib_manifest):
    """/tokens resized to 2**40 tokens without writing a chunk, the manifest agreeing: refused when
    the manifest is read (reader, validate, inspect), in seconds, with peak memory far below the
    claim (measured in a fresh process)."""
    m = read_manifest(stdlib_manifest)
    shard = m.shard_path(m.shards[0])
    with h5py.File(shard, "r+") as f:
        f["tokens"].resize((1 << 40,))
    _edit(stdlib_manifest, lambda raw: raw["shards"][0].update(tokens=1 << 40, bytes=shard.stat().st_size))
    with pytest.raises(FormatError, match=rf"shard '{m.shards[0].path}' claims 1,099,511,627,776 tokens, more than"):
        open_corpus(stdlib_manifest, "train")
    script = textwrap.dedent(
        f"""
        import re
        from h5corpus.storage.validate import validate_corpus
        r = validate_corpus({str(stdlib_manifest)!r}, workers=1)
        # VmHWM, not getrusage: ru_maxrss keeps the forking parent's peak across exec
        hwm = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
        print(len(r.findings), r.findings[0].code, hwm // 1024)
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    n, code, peak_mb = _clean(p).split()
    assert (n, code) == ("1", "manifest") and int(peak_mb) < 400, p.stdout
    for cmd in ("validate", "inspect"):
        p = _cli(cmd, str(stdlib_manifest), timeout=60)
        assert p.returncode == 1 and "claims 1,099,511,627,776 tokens" in _clean(p)


def test_unwritten_chunks_within_a_plausible_claim_are_refused_by_reader_and_validate(stdlib_manifest):
    """/tokens grown by 50 chunks that were never written (fill values), the manifest agreeing and
    within the size bound: the first touch of the shard refuses it, naming the chunk counts, and
    validate reports it without hashing fill bytes."""
    m = read_manifest(stdlib_manifest)
    e = m.shards[0]
    shard = m.shard_path(e)
    grown = e.tokens + 50 * m.chunk_tokens
    with h5py.File(shard, "r+") as f:
        f["tokens"].resize((grown,))
    _edit(stdlib_manifest, lambda raw: raw["shards"][0].update(tokens=grown, bytes=shard.stat().st_size))
    c = open_corpus(stdlib_manifest, "train")
    with pytest.raises(FormatError, match=rf"{shard.name}: .*/tokens has \d+ chunks stored, {grown:,} entries need"):
        c.tokens(grown - 5, grown)
    rep = validate_corpus(stdlib_manifest, workers=1)
    found = [f for f in rep.findings if f.shard == e.path]
    assert [f.code for f in found] == ["tokens"] and "chunks stored" in found[0].message, rep.findings
    assert rep.bytes_hashed == 2 * sum(s.tokens for s in m.shards[1:])  # not a byte of the claimed shard


# -- OS errors on paths, stray unfinished writes --------------------------------------------------------


def test_os_errors_on_any_path_are_one_line(stdlib_manifest, tmp_path):
    """A shard path longer than the file-name limit, and a manifest path longer than it: one line
    naming the path and the error, exit 1 or 2, no traceback (validate, inspect, the reader)."""
    long = "../shards/train/" + "x" * 300 + ".h5"
    _edit(stdlib_manifest, lambda raw: raw["shards"][0].update(path=long))
    rep = validate_corpus(stdlib_manifest, workers=1)
    bad = [f for f in rep.findings if f.shard == long]
    assert [f.code for f in bad] == ["unreadable"] and "File name too long" in bad[0].message
    with pytest.raises(FormatError, match="File name too long"):
        c = open_corpus(stdlib_manifest, "train")
        c.tokens(0, 1)
    p = _cli("validate", str(stdlib_manifest))
    assert p.returncode == 1 and "File name too long" in _clean(p)
    too_long = tmp_path / ("y" * 300) / "shards.json"
    for cmd in ("validate", "inspect"):
        p = _cli(cmd, str(too_long))
        assert p.returncode in (1, 2) and "File name too long" in _clean(p), (cmd, p.stdout, p.stderr)


def test_a_stray_partial_file_matching_no_shard_is_reported(stdlib_manifest):
    """An unfinished write in a split folder that matches no listed shard is reported by name (a
    build that died, or one still running), as is one beside a listed shard."""
    m = read_manifest(stdlib_manifest)
    folder = m.shard_path(m.shards[0]).parent
    (folder / "train-77777.h5.partial").write_bytes(b"half a shard")
    beside = m.shard_path(m.shards[1])
    beside.with_name(beside.name + ".partial").write_bytes(b"")
    rep = validate_corpus(stdlib_manifest, workers=1)
    got = sorted((f.shard, f.code) for f in rep.findings)
    assert got == sorted([("../shards/train/train-77777.h5.partial", "partial"), (m.shards[1].path, "partial")])
    p = _cli("validate", str(stdlib_manifest))
    assert p.returncode == 1 and "train-77777.h5.partial" in _clean(p)
