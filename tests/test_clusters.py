"""The test clusters of tests/clusters.py are real engines: Slurm runs job arrays, honours afterok
and scancel of one element; Ray places tasks on both nodes, retries a task whose worker was killed
and reads the shared folder on the second node. Oracles are files the jobs write and the engines'
own views (squeue, the GCS, /proc), never the fixtures' bookkeeping."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from testkit.clusters import RAY_HEAD_IP, RAY_WORKER_IP, live_processes, wait_until


def _job_script(body: str) -> str:
    return "#!/bin/bash\nset -eu\n" + body


# --- Slurm -----------------------------------------------------------------------------------------


@pytest.mark.slurm
def test_slurm_array_runs_every_element_with_its_index(slurm_cluster, tmp_path):
    script = _job_script(f'echo "$SLURM_ARRAY_TASK_ID $SLURM_ARRAY_JOB_ID" > {tmp_path}/task-$SLURM_ARRAY_TASK_ID\n')
    job = slurm_cluster.sbatch("--array=0-3", f"--output={tmp_path}/%A_%a.log", script=script)

    assert slurm_cluster.wait(job) == {f"{job}_{i}": "COMPLETED" for i in range(4)}
    assert sorted(p.name for p in tmp_path.glob("task-*")) == [f"task-{i}" for i in range(4)]
    for i in range(4):
        assert (tmp_path / f"task-{i}").read_text() == f"{i} {job}\n"


@pytest.mark.slurm
def test_slurm_afterok_waits_for_its_dependency_and_never_runs_after_a_failure(slurm_cluster, tmp_path):
    gate = tmp_path / "gate"  # the first array finishes only once the test opens the gate
    wait_for_gate = f"for _ in $(seq 1200); do [ -e {gate} ] && break; sleep 0.1; done\n"
    first_script = _job_script(wait_for_gate + f"touch {tmp_path}/first-$SLURM_ARRAY_TASK_ID\n")
    first = slurm_cluster.sbatch("--array=0-1", "--output=/dev/null", script=first_script)
    second = slurm_cluster.sbatch(
        f"--dependency=afterok:{first}", "--output=/dev/null",
        script=_job_script(f"ls {tmp_path} | grep -c '^first-' > {tmp_path}/seen\n"),
    )  # fmt: skip
    assert [(j.state, j.reason) for j in slurm_cluster.jobs(second)] == [("PENDING", "Dependency")]
    gate.touch()
    assert slurm_cluster.wait(second) == {second: "COMPLETED"}
    assert slurm_cluster.states(first) == {f"{first}_0": "COMPLETED", f"{first}_1": "COMPLETED"}
    assert (tmp_path / "seen").read_text() == "2\n"  # both elements had finished when it started

    failing = slurm_cluster.sbatch("--output=/dev/null", script=_job_script("exit 3\n"))
    blocked = slurm_cluster.sbatch(
        f"--dependency=afterok:{failing}", "--output=/dev/null", script=_job_script(f"touch {tmp_path}/ran\n")
    )
    assert slurm_cluster.wait(failing) == {failing: "FAILED"}
    job = wait_until(
        lambda: next((j for j in slurm_cluster.jobs(blocked) if j.reason == "DependencyNeverSatisfied"), None),
        30.0, "the dependent of a failed job to be marked DependencyNeverSatisfied",
    )  # fmt: skip
    assert job.state == "PENDING"  # Slurm keeps it queued; it is the submitter's to cancel
    slurm_cluster.scancel(blocked)
    assert slurm_cluster.wait(blocked) == {blocked: "CANCELLED"}
    assert not (tmp_path / "ran").exists()


@pytest.mark.slurm
def test_slurm_scancel_of_one_element_then_resubmitting_that_index(slurm_cluster, tmp_path):
    work = tmp_path / "work"  # the jobs' working folder: what still runs there after scancel is a leak
    work.mkdir()
    script = _job_script(
        f'if [ "$SLURM_ARRAY_TASK_ID" = 2 ] && [ -z "${{RESUBMIT:-}}" ]; then touch {tmp_path}/started-2; sleep 300; fi\n'
        f"echo $SLURM_ARRAY_TASK_ID > {tmp_path}/task-$SLURM_ARRAY_TASK_ID\n"
    )
    job = slurm_cluster.sbatch("--array=0-3", "--output=/dev/null", script=script, cwd=work)
    wait_until(lambda: (tmp_path / "started-2").exists() or None, 60.0, "array element 2 to start")
    slurm_cluster.scancel(f"{job}_2")

    states = slurm_cluster.wait(job)
    assert states == {
        f"{job}_0": "COMPLETED",
        f"{job}_1": "COMPLETED",
        f"{job}_2": "CANCELLED",
        f"{job}_3": "COMPLETED",
    }
    assert sorted(p.name for p in tmp_path.glob("task-*")) == ["task-0", "task-1", "task-3"]
    assert live_processes(set(), work) == []  # the cancelled element's `sleep` was killed

    again = slurm_cluster.sbatch("--array=2", "--export=ALL,RESUBMIT=1", "--output=/dev/null", script=script, cwd=work)
    assert slurm_cluster.wait(again) == {f"{again}_2": "COMPLETED"}
    assert (tmp_path / "task-2").read_text() == "2\n"


# --- Ray (task functions live at module level: workers import them from this module) --------------


def rendezvous(folder: str, parties: int, timeout_s: float) -> str:
    """Check in, then wait until ``parties`` tasks have: they must all run at once. Returns the node id."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    Path(folder, f"{node}-{os.getpid()}").touch()
    wait_until(lambda: len(os.listdir(folder)) >= parties or None, timeout_s, f"{parties} tasks in {folder}")
    return node


def slow_first_attempt(folder: str) -> tuple[int, int]:
    """Record the attempt; the first one sleeps (to be killed). Returns (attempt number, pid)."""
    Path(folder, f"attempt-{os.getpid()}").touch()
    attempt = len(list(Path(folder).glob("attempt-*")))
    if attempt == 1:
        time.sleep(300)
    return attempt, os.getpid()


def read_on_node(path: str) -> tuple[str, str, str]:
    """(the file's text, this node's id, this node's IP)."""
    import ray

    return Path(path).read_text(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


@pytest.mark.ray
def test_ray_runs_tasks_on_both_nodes(ray_cluster):
    folder = ray_cluster.shared_dir / "rendezvous"
    folder.mkdir()
    with ray_cluster.connect() as ray:
        task = ray.remote(num_cpus=1)(rendezvous)  # one CPU per node: two at once need both nodes
        nodes = ray.get([task.remote(str(folder), 2, 60.0) for _ in range(2)], timeout=120)

    assert sorted(nodes) == sorted([ray_cluster.head_node_id, ray_cluster.worker_node_id])
    alive = {n["NodeID"]: n["NodeManagerAddress"] for n in ray_cluster.nodes() if n["Alive"]}
    assert alive == {ray_cluster.head_node_id: RAY_HEAD_IP, ray_cluster.worker_node_id: RAY_WORKER_IP}


@pytest.mark.ray
def test_ray_task_completes_through_max_retries_after_its_worker_is_killed(ray_cluster):
    folder = ray_cluster.shared_dir / "attempts"
    folder.mkdir()
    with ray_cluster.connect() as ray:
        ref = ray.remote(num_cpus=1, max_retries=2)(slow_first_attempt).remote(str(folder))
        first = wait_until(lambda: next(iter(folder.glob("attempt-*")), None), 60.0, "the first attempt to start")
        first_pid = int(first.name.split("-")[1])
        assert ray_cluster.wait_for_task_pid("slow_first_attempt") == first_pid
        os.kill(first_pid, signal.SIGKILL)
        attempt, pid = ray.get(ref, timeout=120)

    assert attempt == 2 and pid != first_pid
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"attempt-{first_pid}", f"attempt-{pid}"])


@pytest.mark.ray
def test_ray_task_on_the_second_node_reads_the_shared_folder(ray_cluster):
    note = ray_cluster.shared_dir / "note.txt"
    note.write_text(f"written by the driver, pid {os.getpid()}\n")
    with ray_cluster.connect() as ray:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        on_worker = NodeAffinitySchedulingStrategy(ray_cluster.worker_node_id, soft=False)
        task = ray.remote(num_cpus=1)(read_on_node).options(scheduling_strategy=on_worker)
        text, node, ip = ray.get(task.remote(str(note)), timeout=120)

    assert (text, node, ip) == (note.read_text(), ray_cluster.worker_node_id, RAY_WORKER_IP)
