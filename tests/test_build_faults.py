"""Faults around a build, tried as a hostile user would.

* The build deletes only files it made and recorded, never user files that merely look like shards.
* OS failures (disk full mid-build or at the manifest write, read-only output, paths of the wrong
  kind, unwritable ``inspect`` outputs) end in one line naming the operation and the path, with
  exit 1 ("could not complete; nothing lost") or 2 (a path of the wrong kind); re-running after
  the cause is fixed resumes and ends with the bytes of an uninterrupted build. A finished build
  re-run on read-only storage is up to date (exit 0) and writes nothing.
* Truncated compressed JSONL fails the build (``fail``) or is counted once (``skip``), naming the
  file and "truncated"; a UTF-8 BOM at the start of a JSONL file is not part of the first record.
* Two builds writing one manifest at once: the second is refused.

Disk-full and read-only cases use real file systems mounted in the test (small tmpfs, remounted
read-only): that needs root, which the test runs have here and in CI; elsewhere they skip, saying so.
"""

from __future__ import annotations

import errno
import fcntl
import gzip
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from h5corpus.build import BuildConfig, BuildConflict, BuildError, build_corpus
from h5corpus.build.oserrors import BuildOSError
from h5corpus.storage import format as fmt
from h5corpus.storage.manifest import read_manifest
from h5corpus.storage.validate import validate_corpus
from tests.helpers import WAITING_BUILD_SCRIPT, read_built, subprocess_env, tree, write_jsonl

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {seed}-{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300))) for i in range(n)]


@pytest.fixture(scope="module")
def fault_inputs(tmp_path_factory) -> list[Path]:
    """a.jsonl (one task) and b.jsonl (several tasks at ``task_bytes=300_000``), ~1.3 MB in all.
    b repeats some of a's documents in two of its tasks, whose finish stage then copies the kept
    documents instead of renaming the candidate shards."""
    d = tmp_path_factory.mktemp("fault-in")
    a, b = _texts(120, 1), _texts(1000, 2)
    return [write_jsonl(d / "a.jsonl", a), write_jsonl(d / "b.jsonl", b[:500] + a[:15] + b[500:] + a[15:30])]


def fault_settings(root: Path, sources, **kw) -> dict:
    """The BuildConfig fields of these tests, JSON-able (a killed build gets them in a subprocess)."""
    d = {
        "sources": [str(s) for s in sources],
        "tokenizer": "bytes",
        "workers": 2,
        "task_bytes": 300_000,
        "shard_tokens": 250_000,
        "chunk_tokens": 4096,
        "shards_dir": str(root / "shards"),
        "manifest": str(root / "manifests" / "shards.json"),
    }
    d.update(kw)
    return d


def fault_config(root: Path, sources, **kw) -> BuildConfig:
    return BuildConfig(**fault_settings(root, sources, **kw))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, fault_inputs) -> Path:
    """The inputs built once, uninterrupted, on an ordinary folder."""
    root = tmp_path_factory.mktemp("fault-ref")
    rep = build_corpus(fault_config(root, fault_inputs))
    assert rep.dropped().get("exact_dup") == 30, "the finish stage's copy path must be exercised"
    return root


def _cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "h5corpus", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or subprocess_env(),
        cwd=cwd,
    )


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    """The process failed with exactly one line on stderr, ``error: ...``, and no traceback."""
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


# -- real file systems ------------------------------------------------------------------------------
@pytest.fixture
def tmpfs():
    """``mount(path, size)`` mounts a tmpfs of ``size`` (e.g. ``"512k"``) at ``path``; unmounted
    after the test. Skips, saying why, where mounting is not possible."""
    mounted: list[Path] = []

    def mount(path: Path, size: str) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root and mount(8); run the suite as root (as CI does)")
        path.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], capture_output=True, text=True
        )
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True, capture_output=True)


def _fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` to the last byte; returns the filler file."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def _bytes_of(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# -- 1. what the build deletes ------------------------------------------------------------------------
#: User files in the split folders whose names look like shards but are not the build's.
DECOYS = [
    "train/train-00000-000.h5.sha256",
    "train/train-00000-draft.h5.bak",
    "train/train-00001-000.h5~",
    "train/train-0000-000.h5",
    "train/train-000001-000.h5",
    "train/train-a012345-000.h5",
    "train/train-b12345-000.h5",
    "train/train-00000-a0100.h5",
    "train/train-00000-000.H5",
    "train/notes.h5.partial",
    "train/train-00002-000.h5.partial.keep",
    "validation/validation-00000-000.h5.orig",
    "validation/train-00000-000.h5",
    "train/train-0000-000.h5.docs",  # format version 4 sidecar names of shards the build would not write
    "train/train-00000-000.docs",
    "train/train-00000-000.h5.docs.bak",
    "validation/train-00000-000.h5.docs",
]


#: A decoy that an older build took for a shard it had not made (and so refused to start).
WIDE = "train/train-000001-000.h5"


def _plant_decoys(shards: Path, names=DECOYS) -> dict[str, bytes]:
    out = {}
    for i, rel in enumerate(names):
        p = shards / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"user data {i}\n".encode())
        out[rel] = p.read_bytes()
    return out


def _decoys_intact(shards: Path, planted: dict[str, bytes]) -> None:
    for rel, data in planted.items():
        assert (shards / rel).is_file() and (shards / rel).read_bytes() == data, rel


def _without(t: dict[str, str], prefix: str, names) -> dict[str, str]:
    return {k: v for k, v in t.items() if k not in {f"{prefix}/{n}" for n in names}}


def test_a_build_never_deletes_user_files_that_look_like_shards(tmp_path, fault_inputs, reference):
    root = tmp_path / "d"
    planted = _plant_decoys(root / "shards")
    build_corpus(fault_config(root, fault_inputs))
    _decoys_intact(root / "shards", planted)
    assert _without(tree(root), "shards", DECOYS) == tree(reference)
    rep = build_corpus(fault_config(root, fault_inputs))  # up to date: still nothing touched
    assert rep.up_to_date
    _decoys_intact(root / "shards", planted)


_BUILD_SCRIPT = (
    "import json, sys\n"
    "from h5corpus.build import BuildConfig, build_corpus\n"
    "build_corpus(BuildConfig(**json.loads(sys.argv[1])))\n"
)


def _killed_at(point: str, settings: dict) -> None:
    """Run a build of ``settings`` in a subprocess that is SIGKILLed at the stage boundary ``point``."""
    from h5corpus.build.run.executor import CRASH_ENV

    p = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(settings)],
        env=dict(subprocess_env(), **{CRASH_ENV: point}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == -9, (point, p.returncode, p.stderr[-2000:])


#: Points are counted per worker process: with the inputs' 4 tasks on 2 workers, some worker
#: reaches each point twice whatever the scheduling (a third time only when it took 3 tasks).
@pytest.mark.parametrize("point", ["finish-renamed:2", "finish-record:2", "manifest-after"])
def test_a_resumed_build_never_deletes_user_files_that_look_like_shards(tmp_path, fault_inputs, reference, point):
    root = tmp_path / "k"
    planted = _plant_decoys(root / "shards", [d for d in DECOYS if d != WIDE])
    _killed_at(point, fault_settings(root, fault_inputs))
    planted.update(_plant_decoys(root / "shards", [WIDE]))
    assert build_corpus(fault_config(root, fault_inputs)).resumed
    _decoys_intact(root / "shards", planted)
    assert _without(tree(root), "shards", DECOYS) == tree(reference)


def test_overwrite_deletes_the_builds_file_names_only(tmp_path, fault_inputs, reference):
    """``--overwrite`` deletes files named exactly like the build's shards (and their .partial), and
    leaves every other file alone."""
    root = tmp_path / "o"
    build_corpus(fault_config(root, fault_inputs, split_seed=7))
    planted = _plant_decoys(root / "shards")
    stale = [
        root / "shards" / "train" / "train-00042-000.h5",
        root / "shards" / "train" / "train-00042-001.h5.partial",
        root / "shards" / "train" / "train-a123456-a1234.h5",  # a task and a shard past the 5 and 3 digits
    ]
    for p in stale:
        p.write_bytes(b"exact shard name")
    build_corpus(fault_config(root, fault_inputs, overwrite=True))
    _decoys_intact(root / "shards", planted)
    assert not any(p.exists() for p in stale)
    assert _without(tree(root), "shards", DECOYS) == tree(reference)


def test_a_fresh_build_refuses_a_partial_shard_it_did_not_make(tmp_path, fault_inputs):
    """Without a state folder nothing accounts for a ``.partial`` shard: refused, not deleted."""
    root = tmp_path / "p"
    p = root / "shards" / "train" / "train-00003-000.h5.partial"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"whose is this?")
    with pytest.raises(BuildConflict, match=r"train-00003-000\.h5\.partial.*--overwrite"):
        build_corpus(fault_config(root, fault_inputs))
    assert p.read_bytes() == b"whose is this?"


def test_shards_a_resumed_build_no_longer_lists_are_deleted_only_when_recorded(tmp_path):
    """Run 1 (budget filled in task 3) is killed after writing its final shards; the first input
    then grows, so on resume the budget fills in task 2: the shards of task 3, which run 1
    recorded, are deleted; an exact shard name of a task no record mentions is left alone."""
    src = tmp_path / "in"
    a = write_jsonl(src / "a.jsonl", _texts(60, 5))
    b = write_jsonl(src / "b.jsonl", _texts(2000, 6))
    root = tmp_path / "r"
    settings = fault_settings(root, [a, b], task_bytes=600_000, max_tokens={"train": 1_300_000, "validation": 1})
    _killed_at("manifest-before", settings)
    assert any(p.name.startswith("train-00003-") for p in (root / "shards" / "train").iterdir())
    planted = _plant_decoys(root / "shards")
    unrecorded = root / "shards" / "train" / "train-00099-000.h5"
    unrecorded.write_bytes(b"not made by this build")
    write_jsonl(a, _texts(60, 5) + [f"{i} " + "x " * 25_000 for i in range(8)])  # still one task
    assert a.stat().st_size < 600_000
    rep = build_corpus(BuildConfig(**settings))
    assert rep.resumed and rep.tasks_read == 3
    m = read_manifest(root / "manifests" / "shards.json")
    listed = {m.shard_path(e).name for e in m.shards if e.split == "train"}
    listed |= {name + ".docs" for name in listed}  # format version 4: each shard's sidecar
    on_disk = {p.name for p in (root / "shards" / "train").iterdir()}
    assert on_disk == listed | {Path(d).name for d in DECOYS if d.startswith("train/")} | {unrecorded.name}
    assert not any(n.startswith("train-00003-") for n in listed)
    _decoys_intact(root / "shards", planted)
    assert unrecorded.read_bytes() == b"not made by this build"


# -- 2. OS faults -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.4, 0.7, 0.95])
def test_disk_full_mid_build_fails_in_one_line_and_resumes_to_the_same_bytes(
    tmp_path, tmpfs, fault_inputs, reference, fraction
):
    """A tmpfs smaller than the build's output (4 KiB up to 95% of it): the build stops with one
    BuildOSError (ENOSPC) naming the operation and a path on that file system; once the file
    system has room, the same build resumes and ends byte for byte like the uninterrupted one."""
    size_kib = max(4, int(_bytes_of(reference) * fraction) // 1024)
    root = tmpfs(tmp_path / "fs", f"{size_kib}k")
    with pytest.raises(BuildOSError) as ei:
        build_corpus(fault_config(root, fault_inputs))
    e = ei.value
    assert e.errno == errno.ENOSPC, str(e)
    msg = str(e)
    assert msg.startswith("cannot ") and "\n" not in msg and str(root) in msg and "No space left on device" in msg
    remount(root, "size=64m")
    rep = build_corpus(fault_config(root, fault_inputs))
    assert not rep.up_to_date
    assert tree(root) == tree(reference)


def test_disk_full_through_the_cli_is_exit_1_and_one_line(tmp_path, tmpfs, fault_inputs):
    ref = tmp_path / "ref"
    ref.mkdir()
    args = ["build", *map(str, fault_inputs), "--tokenizer", "bytes", "--workers", "2"]
    assert _cli(*args, cwd=ref).returncode == 0
    root = tmpfs(tmp_path / "fs", "1m")
    p = _cli(*args, cwd=root)
    line = _one_error_line(p)
    assert p.returncode == 1 and "No space left on device [ENOSPC]" in line and str(root) in line, line
    assert "free space, then re-run the same command" in line
    remount(root, "size=64m")
    p = _cli(*args, cwd=root)
    assert p.returncode == 0 and "resumed and built" in p.stdout, p.stderr
    assert tree(root) == tree(ref)


def test_disk_full_at_the_manifest_write_names_the_manifest_and_resumes(tmp_path, tmpfs, fault_inputs, reference):
    """The manifest's folder is a full tmpfs: every shard is written, then the manifest write fails
    naming the manifest; no temporary file is left beside it; with room again the build resumes
    from its records and ends with the reference's bytes."""
    root = tmp_path / "m"
    manifests = tmpfs(root / "manifests", "64k")
    filler = _fill(manifests)
    os.truncate(filler, filler.stat().st_size - 4096)  # one page: room for the run marker, not the manifest
    with pytest.raises(BuildOSError) as ei:
        build_corpus(fault_config(root, fault_inputs))
    e = ei.value
    manifest = root / "manifests" / "shards.json"
    assert e.errno == errno.ENOSPC and str(e).startswith(f"cannot write the manifest {manifest}: "), str(e)
    assert sorted(p.name for p in manifests.iterdir()) == ["filler"]  # the run marker is removed too
    assert (root / "shards" / ".build" / "plan.json").is_file()  # the work is kept
    filler.unlink()
    rep = build_corpus(fault_config(root, fault_inputs))
    assert rep.resumed and rep.shards_written == 0 and rep.shards_reused > 0
    assert tree(root) == tree(reference)


def test_read_only_output_fails_before_any_work(tmp_path, tmpfs, fault_inputs):
    root = tmpfs(tmp_path / "ro", "4m")
    remount(root, "ro")
    with pytest.raises(BuildOSError) as ei:
        build_corpus(fault_config(root, fault_inputs))
    assert ei.value.errno == errno.EROFS and "Read-only file system" in str(ei.value)
    p = _cli("build", str(fault_inputs[0]), "--tokenizer", "bytes", cwd=root)
    line = _one_error_line(p)
    assert p.returncode == 1 and "[EROFS]" in line and str(root / "shards") in line, line
    assert not any(root.iterdir())


def test_a_drop_list_that_cannot_be_written_fails_before_any_work(tmp_path, tmpfs, fault_inputs):
    ro = tmpfs(tmp_path / "ro", "1m")
    remount(ro, "ro")
    root = tmp_path / "b"
    with pytest.raises(BuildOSError, match=rf"cannot write the drop list {ro / 'drops.jsonl'}: .*\[EROFS\]"):
        build_corpus(fault_config(root, fault_inputs, explain_drops=ro / "drops.jsonl"))
    assert not (root / "shards" / ".build").exists()


def _marker_of(pid: int, pid_start: str) -> str:
    """A run marker's JSON as a local driver with ``pid`` writes it (docs/BUILD.md, "Run markers")."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    fields = {"kind": "process", "host": os.uname().nodename, "boot_id": boot, "pid": pid, "pid_start": pid_start}
    return json.dumps({**fields, "started": "2026-01-01T00:00:00+00:00", "token": "t"})


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_finished_build_on_read_only_storage_is_up_to_date(tmp_path, tmpfs, fault_inputs, reference):
    """Re-run on read-only storage: up to date, exit 0, with or without the stale run markers of a
    build killed there (a corpus copied elsewhere has none). Other settings are the same conflict
    as on writable storage; --overwrite cannot write."""
    root = tmpfs(tmp_path / "ro", "16m")
    build_corpus(fault_config(root, fault_inputs))
    assert not (root / "shards" / ".build.lock").exists()  # removed when the build ended
    copy = tmpfs(tmp_path / "copy", "16m")
    shutil.copytree(root, copy, dirs_exist_ok=True)
    stale = _marker_of(_dead_pid(), "1")
    (root / "shards" / ".build.lock").write_text(stale)
    (root / "manifests" / ".shards.json.lock").write_text(stale)
    for fs in (root, copy):
        remount(fs, "ro")
        before = tree(fs)
        assert build_corpus(fault_config(fs, fault_inputs)).up_to_date
        with pytest.raises(BuildConflict, match="other inputs or settings"):
            build_corpus(fault_config(fs, fault_inputs, split_seed=3))
        with pytest.raises(BuildOSError, match=r"\[EROFS\]"):
            build_corpus(fault_config(fs, fault_inputs, overwrite=True))
        assert tree(fs) == before == tree(reference)
    assert (root / "shards" / ".build.lock").read_text() == stale  # nothing could remove them
    assert (root / "manifests" / ".shards.json.lock").read_text() == stale


def test_a_live_run_marker_on_read_only_storage_refuses_the_build(tmp_path, tmpfs, fault_inputs):
    """A marker whose run is alive (this test's own process) refuses a build that cannot write
    there too: a build with write permission may be changing the output."""
    root = tmpfs(tmp_path / "ro", "16m")
    build_corpus(fault_config(root, fault_inputs))
    me = Path("/proc/self/stat").read_text()
    marker = root / "manifests" / ".shards.json.lock"
    marker.write_text(_marker_of(os.getpid(), me[me.rindex(")") + 2 :].split()[19]))
    remount(root, "ro")
    with pytest.raises(
        BuildConflict, match=rf"writing the manifest {root / 'manifests' / 'shards.json'} .*pid {os.getpid()}"
    ):
        build_corpus(fault_config(root, fault_inputs))


def test_a_finished_build_on_read_only_storage_through_the_cli(tmp_path, tmpfs, fault_inputs):
    root = tmpfs(tmp_path / "ro", "16m")
    args = ["build", *map(str, fault_inputs), "--tokenizer", "bytes", "--validate"]
    assert _cli(*args, cwd=root).returncode == 0
    remount(root, "ro")
    p = _cli(*args, cwd=root)
    assert p.returncode == 0 and p.stdout.startswith("up to date ") and "OK" in p.stdout, p.stderr
    assert "Traceback" not in p.stderr


def test_an_interrupted_build_on_read_only_storage_says_it_must_be_finished_there(
    tmp_path, tmpfs, fault_inputs, reference
):
    root = tmpfs(tmp_path / "ro", "16m")
    _killed_at("finish-record:2", fault_settings(root, fault_inputs))
    remount(root, "ro")
    with pytest.raises(BuildOSError, match=r"\[EROFS\].*holds an interrupted build"):
        build_corpus(fault_config(root, fault_inputs))
    remount(root, "rw")
    assert build_corpus(fault_config(root, fault_inputs)).resumed
    assert tree(root) == tree(reference)


@pytest.mark.parametrize(
    "option,make,needle",
    [
        ("--manifest", "dir", "--manifest {p} is a folder, not a file"),
        ("--manifest", "below-file", "--manifest {p}: {f} is a file, not a folder"),
        ("--shards-dir", "file", "--shards-dir {p} is a file, not a folder"),
        ("--shards-dir", "below-file", "--shards-dir {p}: {f} is a file, not a folder"),
        ("--explain-drops", "dir", "--explain-drops {p} is a folder, not a file"),
    ],
)
def test_output_paths_of_the_wrong_kind_are_usage_errors_before_any_work(tmp_path, fault_inputs, option, make, needle):
    work = tmp_path / "w"
    work.mkdir()
    f = work / "plain-file"
    f.write_text("user data")
    p = {"dir": work / "a-folder", "file": f, "below-file": f / "x.json"}[make]
    if make == "dir":
        p.mkdir()
    before = sorted(x.name for x in work.rglob("*"))
    r = _cli("build", str(fault_inputs[0]), "--tokenizer", "bytes", option, str(p), cwd=work)
    line = _one_error_line(r)
    assert r.returncode == 2 and needle.format(p=p, f=f) in line, line
    assert sorted(x.name for x in work.rglob("*")) == before and f.read_text() == "user data"


def test_inspect_outputs_that_cannot_be_written(tmp_path, tmpfs, stdlib_manifest):
    """--output / --plot: a folder or a path below a file is exit 2; a read-only place is exit 1;
    both before any work, in one line naming the option and the path."""
    f = tmp_path / "plain-file"
    f.write_text("x")
    ro = tmpfs(tmp_path / "ro", "1m")
    remount(ro, "ro")
    for option, name in (("--output", "r.json"), ("--plot", "r.png")):
        for path, code, needle in (
            (tmp_path, 2, f"{option} {tmp_path} is a folder, not a file"),
            (f / name, 2, f"{option} {f / name}: {f} is not a folder"),
            (ro / name, 1, f"cannot write {option} {ro / name}: Read-only file system [EROFS]"),
            (ro / "sub" / name, 1, f"cannot write {option} {ro / 'sub' / name}: Read-only file system [EROFS]"),
        ):
            p = _cli("inspect", str(stdlib_manifest), option, str(path))
            line = _one_error_line(p)
            assert p.returncode == code and needle in line, (option, path, p.returncode, line)
            # checked before anything else: a missing manifest is not even looked at
            p = _cli("inspect", str(tmp_path / "no-such-manifest.json"), option, str(path))
            assert p.returncode == code and needle in _one_error_line(p)


def test_the_manifest_follows_the_umask_like_the_shards(tmp_path, fault_inputs):
    """Built under umask 022 the manifest is 0644 like the shards (others can open the corpus);
    under 027 both are 0640."""
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        root = tmp_path / f"u{umask:o}"
        old = os.umask(umask)
        try:
            build_corpus(fault_config(root, fault_inputs[:1], workers=1))
        finally:
            os.umask(old)
        m = read_manifest(root / "manifests" / "shards.json")
        assert (root / "manifests" / "shards.json").stat().st_mode & 0o777 == mode
        assert {m.shard_path(e).stat().st_mode & 0o777 for e in m.shards} == {mode}


# -- 3. truncated and BOM-prefixed input through the build ------------------------------------------------
def _zst_cut_at_a_line_boundary(path: Path, texts: list[str], keep: int) -> None:
    """``texts`` as one zstd frame, cut exactly after the block that ends with line ``keep``."""
    data = [(json.dumps({"text": t}) + "\n").encode() for t in texts]
    co = zstandard.ZstdCompressor(level=3, write_checksum=True).compressobj()
    head = co.compress(b"".join(data[:keep])) + co.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    path.write_bytes(head)


def test_a_zst_cut_at_a_block_boundary_fails_the_build_naming_truncation(tmp_path):
    texts = _texts(6000, 9)
    p = tmp_path / "cut.jsonl.zst"
    _zst_cut_at_a_line_boundary(p, texts, 3000)
    root = tmp_path / "b"
    with pytest.raises(BuildError, match=rf"{p}:3001: truncated: .*after line 3,000"):
        build_corpus(fault_config(root, [p], workers=1))
    rep = build_corpus(fault_config(root, [p], workers=1, on_error="skip", overwrite=True))
    m = json.loads((root / "manifests" / "shards.json").read_text())
    assert m["build"]["skip_reasons"] == {"truncated": 1}
    assert m["build"]["skipped_records"][0].startswith(f"{p}:3001: truncated")
    stored = {d[0] for s in read_built(root / "manifests" / "shards.json").values() for d in s}
    assert stored == {hashlib.sha256(t.encode()).digest()[:16] for t in texts[:3000]}
    assert rep.documents == 3000


def test_a_truncated_gzip_keeps_every_complete_record_under_skip(tmp_path):
    texts = _texts(12_000, 10)  # ~2.5 MB of JSON: more than one 1 MiB read block
    raw = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    p = tmp_path / "cut.jsonl.gz"
    p.write_bytes(raw[: len(raw) * 3 // 4])
    import zlib

    prefix = zlib.decompressobj(wbits=31).decompress(p.read_bytes())  # what can be decoded at all
    complete = prefix.count(b"\n")
    assert complete > 8000
    root = tmp_path / "b"
    with pytest.raises(BuildError, match=rf"{p}:{complete + 1}: truncated: the gzip stream ends inside this line"):
        build_corpus(fault_config(root, [p], workers=1))
    build_corpus(fault_config(root, [p], workers=1, on_error="skip", overwrite=True))
    stored = {d[0] for s in read_built(root / "manifests" / "shards.json").values() for d in s}
    assert stored == {hashlib.sha256(t.encode()).digest()[:16] for t in texts[:complete]}


def test_a_bom_at_the_start_of_a_jsonl_file_is_not_part_of_the_first_record(tmp_path):
    texts = _texts(50, 11)
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz", tmp_path / "c.jsonl.zst"]
    files[0].write_bytes(b"\xef\xbb\xbf" + body)
    files[1].write_bytes(gzip.compress(b"\xef\xbb\xbf" + body))
    files[2].write_bytes(zstandard.ZstdCompressor().compress(b"\xef\xbb\xbf" + body))
    for f in files:
        root = tmp_path / f.name.replace(".", "-")
        rep = build_corpus(fault_config(root, [f], workers=1))
        got = [d[0] for s in fmt.SPLITS for d in read_built(root / "manifests" / "shards.json")[s]]
        assert rep.documents == 50 and sorted(got) == sorted(hashlib.sha256(t.encode()).digest()[:16] for t in texts)


# -- 4. one manifest, two builds ----------------------------------------------------------------------
def test_a_second_build_into_another_shards_folder_but_the_same_manifest_is_refused(tmp_path, fault_inputs):
    root = tmp_path / "l"
    lock = root / "manifests" / ".shards.json.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as fh:
        fh.write("4242\n")
        fh.flush()
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        cfg = fault_config(root, fault_inputs[:1], workers=1)
        cfg.shards_dir = root / "other-shards"
        with pytest.raises(BuildConflict, match=r"another h5corpus build is writing the manifest .*pid 4242"):
            build_corpus(cfg)
        (root / "link").symlink_to(root / "manifests")
        cfg.manifest = root / "link" / "shards.json"  # another path to the same manifest
        with pytest.raises(BuildConflict, match=r"writing the manifest .*pid 4242"):
            build_corpus(cfg)
    assert not (root / "manifests" / "shards.json").exists()
    assert build_corpus(cfg).documents > 0


def test_two_concurrent_builds_on_one_manifest_never_both_succeed(tmp_path, fault_inputs):
    """A real race: build A (held inside its filters) writes shards-a + the manifest; build B, into
    shards-b with the same manifest, exits 2 naming the manifest; A then finishes, and the manifest
    is A's."""
    go = tmp_path / "go"
    manifest = tmp_path / "manifests" / "shards.json"
    cfg = {
        "sources": [str(fault_inputs[0])],
        "tokenizer": "bytes",
        "workers": 1,
        "shards_dir": str(tmp_path / "shards-a"),
        "manifest": str(manifest),
    }
    first = subprocess.Popen(
        [sys.executable, "-c", WAITING_BUILD_SCRIPT, json.dumps(cfg), str(go)],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(600):
            if (tmp_path / "shards-a" / ".build" / "plan.json").exists():
                break
            time.sleep(0.05)
        else:
            pytest.fail("first build never started")
        second = _cli(
            "build",
            str(fault_inputs[0]),
            "--tokenizer",
            "bytes",
            "--shards-dir",
            "shards-b",
            "--manifest",
            str(manifest),
            cwd=tmp_path,
        )
        line = _one_error_line(second)
        assert second.returncode == 2 and f"another h5corpus build is writing the manifest {manifest}" in line
        go.touch()
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    m = read_manifest(manifest)
    assert all(m.shard_path(e).is_relative_to(tmp_path / "shards-a") for e in m.shards)
    assert validate_corpus(manifest).ok
    assert not any((tmp_path / "shards-b").rglob("*.h5"))


# -- small things: build arguments ----------------------------------------------------------------------
#: The CLI started with arguments in which ``<NUL>`` stands for a NUL byte (an exec'd argument
#: cannot hold one, so the child puts it in).
_CLI_WITH_NUL = (
    "import sys\n"
    "from h5corpus.cli import main\n"
    "sys.argv = ['h5corpus'] + [a.replace('<NUL>', chr(0)) for a in sys.argv[1:]]\n"
    "main()\n"
)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--workers", "-3"], "--workers must be >= 1, got -3"),
        (["--shard-tokens", "0"], "--shard-tokens must be >= 1"),
        (["--max-document-tokens", "0"], "--max-document-tokens must be >= 1"),
        (["--tokenizer", "tok<NUL>.json"], "--tokenizer: 'tok\\x00.json' holds a NUL byte"),
        (["x<NUL>.jsonl"], "SOURCE 2: 'x\\x00.jsonl' holds a NUL byte"),
    ],
)
def test_bad_build_arguments_are_usage_errors_naming_the_option(tmp_path, fault_inputs, args, needle):
    p = _cli_with_nul("build", str(fault_inputs[0]), "--tokenizer", "bytes", *args, cwd=tmp_path)
    line = _one_error_line(p)
    assert p.returncode == 2 and needle in line, line
    assert not (tmp_path / "shards").exists()


@pytest.mark.parametrize("option", ["--manifest", "--shards-dir", "--explain-drops"])
def test_a_nul_byte_in_an_output_path_option_is_a_usage_error(tmp_path, fault_inputs, option):
    """Path options are parsed by click, which refuses the NUL byte itself (its usage message)."""
    p = _cli_with_nul("build", str(fault_inputs[0]), "--tokenizer", "bytes", option, "x<NUL>y", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and option in p.stderr and "null byte" in p.stderr
    assert not (tmp_path / "shards").exists()


def _cli_with_nul(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _CLI_WITH_NUL, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
        cwd=cwd,
    )


def test_a_nul_byte_in_an_output_path_is_refused_by_the_library(tmp_path, fault_inputs):
    for field in ("shards_dir", "manifest", "explain_drops"):
        with pytest.raises(ValueError, match="NUL byte"):
            build_corpus(fault_config(tmp_path, fault_inputs, **{field: str(tmp_path / "x\0y")}))


# -- the build's own sections of an existing manifest ---------------------------------------------
@pytest.mark.parametrize(
    "section,key,value,needle",
    [
        ("build", None, "x", "manifest field build: 'x' is not of type 'object'"),
        ("build", None, 5, "manifest field build: 5 is not of type 'object'"),
        ("build", "settings", [], "manifest field build.settings: [] is not of type 'object'"),
        ("build", "fingerprint", None, "manifest field build.fingerprint: None is not of type 'string'"),
        ("build", "tasks", "3", "manifest field build.tasks: '3' is not of type 'integer'"),
        ("build", "tasks_read", 2.0, "manifest field build.tasks_read: 2.0 is not of type 'integer'"),
        ("build", "skipped_records", 7, "manifest field build.skipped_records: 7 is not of type 'array'"),
        ("build", "skipped_records_total", -1, "manifest field build.skipped_records_total: -1 is less than"),
        ("filters", None, "x", "manifest field filters: 'x' is not of type 'object'"),
        ("filters", "counters", {"a": "b"}, "manifest field filters.counters.a: 'b' is not of type 'integer'"),
        ("splits", "train", {"tokens": 1, "near_duplicates": "2"}, "splits.train.near_duplicates: '2' is not"),
        ("splits", "train", {"dropped": {"quality": None}}, "splits.train.dropped.quality: None is not of type"),
    ],
)
def test_garbled_build_sections_of_the_existing_manifest_are_bad_data_naming_the_field(
    tmp_path, fault_inputs, section, key, value, needle
):
    """Re-running a build reads back the sections only the build writes (``build``, ``filters``,
    the build's figures in ``splits``): wrong types fail in one line naming the manifest and the
    field (exit 1), and leave every file as it was."""
    args = ["build", str(fault_inputs[0]), "--tokenizer", "bytes", "--shards-dir", "s", "--manifest", "m/shards.json"]
    assert _cli(*args, cwd=tmp_path).returncode == 0
    manifest = tmp_path / "m" / "shards.json"
    m = json.loads(manifest.read_text())
    if key is None:
        m[section] = value
    else:
        m.setdefault(section, {})[key] = value
    manifest.write_text(json.dumps(m))
    before = tree(tmp_path)
    p = _cli(*args, cwd=tmp_path)
    line = _one_error_line(p)
    assert p.returncode == 1 and str(manifest) in line and needle in line, line
    assert tree(tmp_path) == before
