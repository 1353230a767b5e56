"""Scaling a build out, without the engines: shard names that sort at any size, the run marker, the
bucketed decide stage against the in-memory one (bytes of real builds, and the near-dedup rule
against the filters' own LSH index on crafted signatures), and the public stage commands driving a
whole build the way another scheduler would. The engine tests are in test_scale_engines.py."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from h5corpus.build import BuildConfig, BuildConflict, build_corpus
from h5corpus.build.stages.buckets import (
    LshParams,
    Members,
    NearEdges,
    bucket_bounds,
    exact_duplicates,
    near_edges,
    positions,
    task_keys,
)
from h5corpus.build.stages.merge import KeptSet, NearResolver
from h5corpus.build.stages.runmarker import RunMarker
from h5corpus.build.stages.shards import parse_shard_file_name, shard_file_name
from h5corpus.build.stages.state import DOC_DTYPE, StateDir
from h5corpus.filters import DocumentFilter, FilterConfig
from h5corpus.filters.neardedup import NearDedupIndex
from tests.helpers import subprocess_env, tree

# -- shard names -----------------------------------------------------------------------------------


def test_shard_names_below_the_cap_are_the_old_ones_and_all_names_sort_in_input_order():
    rng = random.Random(5)
    for _ in range(2000):
        task, n = rng.randrange(100_000), rng.randrange(1000)
        split = rng.choice(["train", "validation"])
        assert shard_file_name(split, task, n) == f"{split}-{task:05d}-{n:03d}.h5"
    pairs = {(rng.randrange(10 ** rng.randint(1, 9)), rng.randrange(10 ** rng.randint(1, 6))) for _ in range(3000)}
    pairs |= {(99_999, 999), (99_999, 1000), (100_000, 0), (999_999, 0), (1_000_000, 0), (0, 999), (0, 1000)}
    names = [shard_file_name("train", t, n) for t, n in pairs]
    assert sorted(names) == [shard_file_name("train", t, n) for t, n in sorted(pairs)]
    for (t, n), name in zip(pairs, names):
        assert parse_shard_file_name(name) == ("train", t, n)
    assert shard_file_name("train", 123_456, 1234) == "train-a123456-a1234.h5"
    for odd in ("train-100000-000.h5", "train-0001-000.h5", "train-a12345-000.h5", "train-a0123456-000.h5"):
        assert parse_shard_file_name(odd) is None, odd


# -- the run marker --------------------------------------------------------------------------------

_HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from h5corpus.build.stages.runmarker import RunMarker\n"
    "m = RunMarker(Path(sys.argv[1]), 'the test output').acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def _holder(path: Path) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path)], env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "held"
    return p


def test_run_marker_refuses_a_live_run_and_replaces_a_dead_one(tmp_path):
    marker = tmp_path / ".build.lock"
    holder = _holder(marker)
    try:
        content = json.loads(marker.read_text())
        assert (content["pid"], content["host"], content["kind"]) == (holder.pid, socket.gethostname(), "process")
        with pytest.raises(
            BuildConflict, match=rf"another h5corpus build is writing the test output .*pid {holder.pid},"
        ):
            RunMarker(marker, "the test output").acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    mine = RunMarker(marker, "the test output").acquire()  # the holder died without removing it
    assert mine.replaced is not None and mine.replaced["pid"] == holder.pid
    assert json.loads(marker.read_text())["pid"] == os.getpid()
    mine.release()
    assert not marker.exists()


def test_run_marker_of_another_host_is_live_while_its_heartbeat_is_fresh(tmp_path):
    marker = tmp_path / ".build.lock"
    other = {"kind": "process", "host": "node-17", "boot_id": "x", "pid": 4242, "started": "2026-01-01T00:00:00+00:00"}
    marker.write_text(json.dumps(other))
    with pytest.raises(BuildConflict, match=r"host node-17, pid 4242, started 2026-01-01"):
        RunMarker(marker, "x").acquire()
    old = time.time() - 3600
    os.utime(marker, (old, old))  # no heartbeat for an hour: that run is gone
    with RunMarker(marker, "x") as m:
        assert m.replaced == other


def test_run_marker_is_taken_by_exactly_one_of_many_racing_processes(tmp_path):
    marker = tmp_path / ".build.lock"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from h5corpus.build.stages.runmarker import RunMarker\n"
        "from h5corpus.build import BuildConflict\n"
        "while time.time() < float(sys.argv[2]): pass\n"
        "try:\n"
        "    RunMarker(Path(sys.argv[1]), 'x').acquire(); print('won', flush=True); time.sleep(30)\n"
        "except BuildConflict:\n"
        "    print('lost', flush=True)\n"
    )
    start = time.time() + 2.0
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(marker), str(start)], env=subprocess_env(), stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]  # fmt: skip
    try:
        answers = [p.stdout.readline().strip() for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert sorted(answers) == ["lost"] * 5 + ["won"]


# -- the near-dedup rule in buckets, against the filters' LSH index --------------------------------


def _signatures(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Clusters of signatures at various distances, empty ones, and exact duplicates (same id)."""
    base = rng.integers(0, 2**32 - 1, size=(rng.integers(1, 6), k), dtype=np.uint64).astype(np.uint32)
    sigs = base[rng.integers(len(base), size=n)].copy()
    for i in range(n):
        flip = rng.random(k) < rng.choice([0.0, 0.05, 0.15, 0.3, 0.6])
        sigs[i, flip] = rng.integers(0, 2**32 - 1, size=int(flip.sum()), dtype=np.uint64).astype(np.uint32)
        if rng.random() < 0.05:
            sigs[i] = 0xFFFFFFFF
    ids = np.frombuffer(rng.bytes(32 * n), dtype="V32").copy()
    for i in range(1, n):
        if rng.random() < 0.1:
            j = int(rng.integers(i))
            sigs[i], ids[i] = sigs[j], ids[j]
    return sigs, ids


def _oracle(sigs: np.ndarray, ids: np.ndarray, lsh: LshParams) -> tuple[np.ndarray, np.ndarray]:
    """Exact and near duplicates as the in-memory decide finds them: a set of ids, and the filters'
    NearDedupIndex fed the exact survivors in order."""
    index = NearDedupIndex(
        num_perm=lsh.num_perm, bands=lsh.bands, rows=lsh.rows, threshold=lsh.threshold, verify=lsh.verify
    )
    seen: set[bytes] = set()
    exact, near = np.zeros(len(ids), bool), np.zeros(len(ids), bool)
    for i in range(len(ids)):
        if bytes(ids[i]) in seen:
            exact[i] = True
        else:
            seen.add(bytes(ids[i]))
            near[i] = index.add(sigs[i])
    return exact, near


def _bucketed(sigs, ids, lsh, tasks, buckets, near_list, root: Path):
    """The same through the bucketed stage's functions: per-task keys, buckets, the merge's resolver
    (signatures of other tasks read from real .npy files in a state folder)."""
    state = StateDir(root)
    (root / "read").mkdir(parents=True)
    cut = np.linspace(0, len(ids), tasks + 1).astype(int)
    id_keys, id_pos, hs, bands, pos = [], [], [], [], []
    for t in range(tasks):
        a, b = cut[t], cut[t + 1]
        docs = np.zeros(b - a, DOC_DTYPE)
        docs["id"] = ids[a:b]
        np.save(state.read_paths(t).signatures, sigs[a:b])
        ik, bk = task_keys(docs, sigs[a:b], lsh)
        id_keys.append(ik["id"])
        id_pos.append(positions(t, ik["row"]))
        hs.append(bk["h"])
        bands.append(bk["band"])
        pos.append(positions(t, bk["row"]))
    exact_pos = set(exact_duplicates(np.concatenate(id_keys), np.concatenate(id_pos)).tolist())
    h, band, p = np.concatenate(hs), np.concatenate(bands), np.concatenate(pos)
    every = np.concatenate([positions(t, np.arange(cut[t + 1] - cut[t])) for t in range(tasks)])
    members = Members(every, sigs, ids)
    outs = []
    for b in range(buckets):
        lo, hi = bucket_bounds(b, buckets)
        sel = (h >= lo) & (h < hi) if hi < 2**64 else h >= lo
        o = np.lexsort((p[sel], band[sel], h[sel]))
        e = near_edges(h[sel][o], band[sel][o], p[sel][o], members, lsh, near_list)
        outs.append({k: getattr(e, k) for k in NearEdges.FILES})
    resolver = NearResolver(state, outs, lsh, KeptSet(np.diff(cut).tolist()))
    exact, near = np.zeros(len(ids), bool), np.zeros(len(ids), bool)
    for t in range(tasks):
        rows = np.arange(cut[t + 1] - cut[t])
        e = np.isin(positions(t, rows), np.fromiter(exact_pos, np.uint64, len(exact_pos)))
        exact[cut[t] : cut[t + 1]] = e
        near[cut[t] : cut[t + 1]] = resolver.task(t, e, sigs[cut[t] : cut[t + 1]]) & ~e
    return exact, near, resolver.fallbacks


def test_bucketed_near_dedup_equals_the_lsh_index_in_input_order(tmp_path):
    """Random clusters, chains and exact duplicates; every bucket count, task split and list length
    (a list of 1 forces the merge's whole-group check often) gives the index's exact answer."""
    rng = np.random.default_rng(7)
    fallbacks = 0
    for trial in range(24):
        k = int(rng.choice([8, 16]))
        lsh = LshParams(
            k,
            int(rng.choice([2, 4])),
            int(rng.choice([1, 2])),
            float(rng.choice([0.3, 0.5, 0.8])),
            bool(rng.random() < 0.8),
        )
        sigs, ids = _signatures(rng, int(rng.integers(20, 300)), k)
        want_exact, want_near = _oracle(sigs, ids, lsh)
        assert want_near.any() or trial % 5, "the data must hold near duplicates"
        for tasks, buckets, near_list in ((1, 1, 4), (3, 4, 1), (3, 1, 2), (5, 7, 1)):
            exact, near, fb = _bucketed(
                sigs, ids, lsh, tasks, buckets, near_list, tmp_path / f"{trial}-{tasks}-{buckets}-{near_list}"
            )
            fallbacks += fb
            assert (exact == want_exact).all(), (trial, lsh)
            assert (near == want_near).all(), (
                trial,
                lsh,
                tasks,
                buckets,
                near_list,
                np.flatnonzero(near != want_near)[:5],
            )
    assert fallbacks > 100  # the whole-group check ran, and agreed


# -- bucketed builds == in-memory builds -----------------------------------------------------------


def _build(root: Path, **kw) -> dict[str, str]:
    kw.setdefault("sources", ["stdlib"])
    kw.setdefault("tokenizer", "bytes")
    kw.setdefault("task_bytes", 2_000_000)
    kw.setdefault("shard_tokens", 1 << 20)
    build_corpus(BuildConfig(shards_dir=root / "shards", manifest=root / "manifests" / "shards.json", **kw))
    return tree(root)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"filters": "near"},
        {"max_tokens": {"train": 3_000_000, "validation": 100_000}},
        {"max_tokens": {"train": 3_000_000}, "filters": "near"},
    ],
    ids=["plain", "near-dedup", "budgets", "train-budget+near"],
)
def test_bucketed_decide_gives_the_in_memory_bytes_on_stdlib(tmp_path, variant):
    def kw():
        d = dict(variant)
        if d.get("filters") == "near":
            d["filters"] = DocumentFilter(FilterConfig(near_dedup=True))
        return d

    want = _build(tmp_path / "mem1", workers=1, **kw())
    assert _build(tmp_path / "mem2", workers=2, **kw()) == want
    for buckets in (1, 3):
        assert _build(tmp_path / f"b{buckets}", workers=2, decide_buckets=buckets, **kw()) == want, buckets


def test_bucketed_decide_gives_the_in_memory_bytes_and_drop_list_on_the_dev_corpus(tmp_path, dev_dir, gpt2_json):
    def kw(name):
        return {
            "sources": [str(dev_dir)],
            "tokenizer": str(gpt2_json),
            "task_bytes": 6_000_000,
            "shard_tokens": 1_000_000,
            "workers": 2,
            "filters": DocumentFilter(FilterConfig(near_dedup=True, quality=True)),
            "explain_drops": tmp_path / f"{name}.jsonl",
        }

    want = _build(tmp_path / "mem", **kw("mem"))
    got = _build(tmp_path / "b4", decide_buckets=4, **kw("b4"))
    assert got == want
    assert (tmp_path / "b4.jsonl").read_bytes() == (tmp_path / "mem.jsonl").read_bytes()
    assert b'"near_dup"' in (tmp_path / "mem.jsonl").read_bytes()


def test_interrupted_in_memory_build_resumes_bucketed_with_the_same_bytes(tmp_path):
    """Read records of a killed in-memory run have no sorted keys: the bucketed resume makes them."""
    cfg = {"sources": ["stdlib"], "tokenizer": "bytes", "task_bytes": 2_000_000, "shard_tokens": 1 << 20, "workers": 2}
    want = _build(tmp_path / "ref", **cfg)
    root = tmp_path / "k"
    script = (
        "import json, sys\nfrom h5corpus.build import BuildConfig, build_corpus\n"
        "build_corpus(BuildConfig(**json.loads(sys.argv[1])))\n"
    )
    args = dict(cfg, shards_dir=str(root / "shards"), manifest=str(root / "manifests" / "shards.json"))
    env = dict(subprocess_env(), H5CORPUS_TEST_CRASH_AT="decided:4")
    p = subprocess.run([sys.executable, "-c", script, json.dumps(args)], env=env, capture_output=True, timeout=600)
    assert p.returncode == -signal.SIGKILL
    assert len(list((root / "shards" / ".build" / "read").glob("*.json"))) >= 4
    assert not list((root / "shards" / ".build" / "read").glob("*.keys.json"))
    assert _build(root, **cfg, decide_buckets=2) == want


# -- the stage commands, driven by hand ------------------------------------------------------------


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "h5corpus", *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_stage_commands_build_what_the_local_executor_builds(tmp_path):
    """Plan with the Slurm executor's dry run (no Slurm needed: it submits nothing), then run every
    stage command as any scheduler would, in an order of its own; the result equals a local build."""
    common = ["stdlib", "--tokenizer", "bytes", "--task-bytes", "3000000", "--near-dedup", "--shard-tokens", "1000000"]
    local = _cli("build", *common, "--shards-dir", "l/shards", "--manifest", "l/manifests/shards.json", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    out = ["--shards-dir", "s/shards", "--manifest", "s/manifests/shards.json"]
    dry = _cli("build", *common, *out, "--executor", "slurm", "--decide-buckets", "3", "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    state = tmp_path / "s" / "shards" / ".build"
    assert "build-stage read --state" in dry.stdout and f"{state}/slurm/read.sbatch" in dry.stdout
    assert not (tmp_path / "s" / "shards" / ".build.lock").exists()  # a dry run leaves no run marker
    assert not (tmp_path / "s" / "manifests" / ".shards.json.lock").exists()
    status = json.loads(_cli("build-stage", "status", "--state", str(state), cwd=tmp_path).stdout)
    tasks = status["tasks"]
    assert tasks >= 3 and status["read"] == list(range(tasks)) and status["buckets"] == 3

    early = _cli("build-stage", "decide", "--state", str(state), cwd=tmp_path)
    assert early.returncode == 2 and "no usable read record" in early.stderr
    bad = _cli("build-stage", "read", "--state", str(state), "--task-index", str(tasks), cwd=tmp_path)
    assert bad.returncode == 2 and f"this build has {tasks} tasks" in bad.stderr

    for i in reversed(range(tasks)):
        assert _cli("build-stage", "read", "--state", str(state), "--task-index", str(i), cwd=tmp_path).returncode == 0
    again = _cli("build-stage", "read", "--state", str(state), "--task-index", "0", "--json", cwd=tmp_path)
    assert json.loads(again.stdout)["index"] == 0  # a rerun element reuses the record
    for b in (2, 0, 1):
        assert (
            _cli("build-stage", "bucket", "--state", str(state), "--task-index", str(b), cwd=tmp_path).returncode == 0
        )
    assert _cli("build-stage", "decide", "--state", str(state), cwd=tmp_path).returncode == 0
    assert json.loads(_cli("build-stage", "status", "--state", str(state), cwd=tmp_path).stdout)["finish"] == list(
        range(tasks)
    )
    for i in range(tasks):
        assert (
            _cli("build-stage", "finish", "--state", str(state), "--task-index", str(i), cwd=tmp_path).returncode == 0
        )
    done = _cli("build-stage", "commit", "--state", str(state), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not state.exists()
    assert tree(tmp_path / "s") == tree(tmp_path / "l")


def test_executor_flags_are_checked(tmp_path):
    for args, msg in (
        (["--executor", "spark"], "--executor must be one of local, ray, slurm"),
        (["--ray-address", "auto"], "--ray-address need --executor ray"),
        (["--executor", "ray", "--wait"], "--wait need --executor slurm"),
        (["--executor", "slurm", "--decide-buckets", "0"], "decide_buckets must be >= 1"),
        (["--executor", "slurm", "--max-array-size", "0"], "--max-array-size must be >= 1"),
    ):
        p = _cli("build", "stdlib", "--tokenizer", "bytes", *args, cwd=tmp_path)
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)
    assert not (tmp_path / "shards").exists()
