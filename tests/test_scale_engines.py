"""Builds on real engines (tests/clusters.py: a two-node Ray cluster, a one-node Slurm cluster; no
mocks): the manifest and every shard equal a ``--executor local`` build with 1 and 2 workers, on
stdlib and on the dev corpus with GPT-2, plain, with ``--near-dedup`` and with ``--max-tokens`` (Slurm:
the dev corpus with ``--near-dedup``);
a Ray worker killed during a read task and a Slurm array element cancelled mid-run both end in the
same bytes (Ray retries the task; re-running the Slurm command resubmits only what is missing)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clusters import wait_until
from tests.helpers import subprocess_env, tree

STDLIB = ["stdlib", "--tokenizer", "bytes", "--task-bytes", "3000000", "--shard-tokens", "1000000"]
NEAR = ["--near-dedup"]
STDLIB_BUDGET = ["--max-tokens", "train=4M,validation=200k"]
DEV_BUDGET = ["--max-tokens", "train=4M,validation=100k"]


class References:
    """Local builds of each variant, made once (with 1 and with 2 workers, which must agree)."""

    def __init__(self, root: Path, variants: dict[str, list[str]]) -> None:
        self.root, self.variants, self.trees = root, variants, {}

    def args(self, name: str) -> list[str]:
        return self.variants[name]

    def tree(self, name: str) -> dict[str, str]:
        if name not in self.trees:
            got = []
            for workers in ("1", "2"):
                out = self.root / f"{name}-w{workers}"
                p = build(self.args(name) + ["--workers", workers], out, subprocess_env())
                assert p.returncode == 0, p.stderr
                got.append(tree(out))
            assert got[0] == got[1], name
            self.trees[name] = got[0]
        return self.trees[name]


def build(args: list[str], out: Path, env: dict[str, str], **kw) -> subprocess.CompletedProcess:
    where = ["--shards-dir", str(out / "shards"), "--manifest", str(out / "manifests" / "shards.json")]
    return subprocess.run(
        [sys.executable, "-m", "h5corpus", "build", *args, *where],
        env=env, capture_output=True, text=True, timeout=900, cwd=out.parent, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def refs(tmp_path_factory, shared) -> References:
    dev = shared / "corpora" / "dev"
    gpt2 = shared / "tokenizers" / "gpt2" / "tokenizer.json"
    variants = {"stdlib": STDLIB, "stdlib-near": STDLIB + NEAR, "stdlib-budget": STDLIB + STDLIB_BUDGET}
    if dev.is_dir() and gpt2.is_file():
        devargs = [str(dev), "--tokenizer", str(gpt2), "--task-bytes", "8000000", "--shard-tokens", "2000000"]
        variants.update({"dev": devargs, "dev-near": devargs + NEAR, "dev-budget": devargs + DEV_BUDGET})
    return References(tmp_path_factory.mktemp("local-refs"), variants)


def _needs(refs: References, name: str) -> None:
    if name not in refs.variants:
        pytest.skip(
            f"the dev corpus or the GPT-2 tokenizer is missing under {os.environ.get('H5CORPUS_SHARED', '../shared')} (set H5CORPUS_SHARED)"
        )


# -- Ray --------------------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.parametrize(
    "name, extra",
    [
        ("stdlib", []),  # bucketed decide, one bucket (picked automatically)
        ("stdlib-near", ["--decide-buckets", "3"]),
        ("stdlib-budget", []),  # budgets stop reading early: decided in memory by the driver
        ("dev", ["--decide-buckets", "2"]),
        ("dev-near", ["--decide-buckets", "2"]),
        ("dev-budget", ["--decide-buckets", "2"]),
    ],
)
def test_ray_build_equals_the_local_build(ray_cluster, refs, name, extra):
    _needs(refs, name)
    out = ray_cluster.shared_dir / f"build-{name}"
    p = build(
        refs.args(name) + ["--executor", "ray", "--ray-address", ray_cluster.address, *extra, "--json"],
        out,
        ray_cluster.env,
    )
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["executor"] == "ray" and report["decide_buckets"] == (
        int(extra[1]) if extra else (0 if "budget" in name else 1)
    )
    assert tree(out) == refs.tree(name)


@pytest.mark.ray
def test_ray_worker_killed_during_a_read_task_gives_the_same_bytes(ray_cluster, refs):
    _needs(refs, "dev")
    out = ray_cluster.shared_dir / "killed"
    out.mkdir()
    args = refs.args("dev") + ["--executor", "ray", "--ray-address", ray_cluster.address, "--decide-buckets", "2"]
    where = ["--shards-dir", str(out / "shards"), "--manifest", str(out / "manifests" / "shards.json")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "h5corpus", "build", *args, *where],
        env=ray_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out,
    )  # fmt: skip
    try:
        pid = wait_until(
            lambda: next(iter(ray_cluster.task_pids("read_stage")), None), 300, "a Ray worker in read_stage"
        )
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        os.kill(pid, signal.SIGKILL)
        assert cmdline.startswith(b"ray::read_stage")  # it was in a read task when it died
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert tree(out) == refs.tree("dev")


@pytest.mark.ray
def test_ray_task_that_cannot_see_the_state_folder_names_the_path_and_its_node(ray_cluster):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from h5corpus.build.run.ray_executor import read_stage
    from h5corpus.build.stages.tasks import StageCall

    missing = str(ray_cluster.shared_dir / "not-mounted-here" / ".build")
    with ray_cluster.connect() as ray:
        on_worker = NodeAffinitySchedulingStrategy(ray_cluster.worker_node_id, soft=False)
        ref = (
            ray.remote(read_stage)
            .options(scheduling_strategy=on_worker, max_retries=0)
            .remote(missing, "0" * 64, StageCall("read", 0))
        )
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(ref, timeout=120)
    message = str(e.value.cause)
    assert f"cannot read the build's state folder {missing}" in message
    assert "(127.0.0.3)" in message and "filesystem every node mounts at the same path" in message


# -- Slurm ------------------------------------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.parametrize(
    "name, buckets",
    # dev + budget runs on Ray only: the Slurm path of a budget is the stdlib case's (CI time)
    [("stdlib", "1"), ("stdlib-near", "3"), ("stdlib-budget", "2"), ("dev-near", "2")],
)
def test_slurm_build_equals_the_local_build(slurm_cluster, refs, tmp_path, name, buckets):
    _needs(refs, name)
    out = tmp_path / "out"
    p = build(
        refs.args(name) + ["--executor", "slurm", "--decide-buckets", buckets, "--wait", "--json"],
        out,
        slurm_cluster.env,
    )
    assert p.returncode == 0, p.stderr
    jobs = json.loads(p.stdout)["jobs"]
    assert sorted(jobs) == ["bucket", "commit", "decide", "finish", "read"]
    read_elements = slurm_cluster.jobs(jobs["read"][0])
    assert len(read_elements) == json.loads(p.stdout)["tasks"] >= 3
    assert {j.state for j in read_elements} == {"COMPLETED"}
    assert tree(out) == refs.tree(name)
    assert not (out / "shards" / ".build.lock").exists()  # the commit job ended the run
    assert not (out / "manifests" / ".shards.json.lock").exists()  # the manifest's marker too


@pytest.mark.slurm
def test_slurm_scancel_of_a_running_element_then_rerun_resubmits_only_what_is_missing(slurm_cluster, refs, tmp_path):
    _needs(refs, "dev")
    out = tmp_path / "out"
    args = refs.args("dev") + ["--executor", "slurm", "--decide-buckets", "2"]
    slow = dict(slurm_cluster.env, H5CORPUS_TEST_STAGE_DELAY="read:1:600")  # element 1 sleeps: cancel it then
    first = build(args, out, slow)
    assert first.returncode == 0, first.stderr
    read_job = re.search(
        r"submitted Slurm jobs: read (\d+), bucket (\d+), decide (\d+), finish (\d+), commit (\d+)", first.stdout
    )
    assert read_job, first.stdout
    read_id, *later = read_job.groups()
    wait_until(
        lambda: next((j for j in slurm_cluster.jobs(read_id) if j.array_task_id == 1 and j.state == "RUNNING"), None),
        120, "read element 1 running",
    )  # fmt: skip
    rerun_early = build(args, out, slurm_cluster.env)
    assert rerun_early.returncode == 2 and f"Slurm jobs {read_id}" in rerun_early.stderr  # the run is still alive
    slurm_cluster.scancel(f"{read_id}_1")
    states = slurm_cluster.wait(read_id, timeout_s=300)
    assert states[f"{read_id}_1"] == "CANCELLED" and list(states.values()).count("COMPLETED") == len(states) - 1
    wait_until(
        lambda: all(j.reason == "DependencyNeverSatisfied" for j in slurm_cluster.jobs(later[0])) or None,
        60, "the bucket array to wait forever on the cancelled element",
    )  # fmt: skip

    again = build(args + ["--wait", "--json"], out, slurm_cluster.env)
    assert again.returncode == 0, again.stderr
    jobs = json.loads(again.stdout)["jobs"]
    assert [j.array_task_id for j in slurm_cluster.jobs(jobs["read"][0])] == [1]  # only the missing task
    assert {s for job in later for s in slurm_cluster.states(job).values()} == {"CANCELLED"}  # old chain gone
    assert tree(out) == refs.tree("dev")


@pytest.mark.slurm
def test_slurm_wait_fails_naming_the_failed_element_and_its_log(slurm_cluster, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    good = "".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(400))
    (data / "a.jsonl").write_text(good)
    (data / "b.jsonl").write_text(good.replace("document 7 ", "other 7 ") + "{not json\n")
    out = tmp_path / "out"
    args = [str(data), "--tokenizer", "bytes", "--task-bytes", "40000", "--executor", "slurm", "--wait"]
    p = build(args, out, slurm_cluster.env)
    assert p.returncode == 1, p.stderr
    found = re.search(r"Slurm job (\d+)_(\d+) \(read\) ended FAILED; its log: (\S+)\.", p.stderr)
    assert found, p.stderr
    job, element, log = found.groups()
    assert "b.jsonl:401: malformed JSON" in Path(log).read_text()
    assert "re-run the same command to resubmit what is missing" in p.stderr
    left = [j for j in slurm_cluster.jobs(job) if j.state in ("PENDING", "RUNNING")]
    assert not left
    marker = json.loads((out / "shards" / ".build.lock").read_text())
    assert marker["kind"] == "slurm"
    manifest_marker = json.loads((out / "manifests" / ".shards.json.lock").read_text())
    assert manifest_marker["kind"] == "slurm" and manifest_marker["jobs"] == marker["jobs"]
    for other in marker["jobs"]:  # nothing of this run waits in the queue
        assert all(j.state not in ("PENDING",) for j in slurm_cluster.jobs(other))
