"""The Slurm executor: the stages as job arrays chained with ``afterok`` (``--executor slurm``).

The submitting command is the chain's first link: it lists the inputs, proves the fast encoder,
writes the plan into the state folder and then the batch scripts (``<state>/slurm/*.sbatch``), and
submits::

    read array (one element per task) -> bucket array (one per decide bucket) -> decide
        -> finish array (one per task) -> commit

each job ``--dependency=afterok:`` the previous one(s). Every element runs one stage command
(``python -m h5corpus build-stage STAGE --state DIR [--task-index I]``, :mod:`~h5corpus.build.stages.dispatch`),
which does nothing when its stage's record is already valid. The run marker of the shards folder
(:mod:`~h5corpus.build.stages.runmarker`) is handed to the jobs (``kind: "slurm"`` with their ids); the
commit job removes it.

Re-running the same command after a failed or cancelled element asks the state folder what is
missing (:func:`~h5corpus.build.stages.dispatch.stage_status`), cancels the old run's jobs that would pend
forever (``DependencyNeverSatisfied``) and submits only the missing elements and what follows them.
``wait`` follows the jobs with a progress bar until the manifest is written; a job that failed or
pends forever is a failure (:class:`~h5corpus.build.config.BuildError`, naming the job and its log).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...storage.manifest import read_manifest
from ..config import BuildConflict, BuildError, SlurmOptions
from ..report import BuildReport, report_from_manifest
from ..stages.dispatch import stage_status
from .executor import BuildLock
from .prepare import Prepared, new_report, progress_bar, prove

#: The stages in chain order; ``True``: one array element per task / bucket.
CHAIN = (("read", True), ("bucket", True), ("decide", False), ("finish", True), ("commit", False))
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
POLL_S = 1.0


def array_spec(indices: Sequence[int]) -> str:
    """``0-3,5,7-9``: Slurm's ``--array`` list of sorted indices."""
    out, run = [], []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def array_chunks(indices: Sequence[int], max_array_size: int) -> list[tuple[int, list[int]]]:
    """(offset, array indices) per job array: Slurm refuses indices >= ``MaxArraySize``, so task
    ``i`` runs as element ``i - offset`` of the array whose offset is a multiple of the size."""
    by: dict[int, list[int]] = {}
    for i in sorted(indices):
        off = i - i % max_array_size
        by.setdefault(off, []).append(i - off)
    return sorted(by.items())


def _run_slurm(argv: list[str], what: str) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise BuildConflict(
            f"{argv[0]} not found: --executor slurm runs on a machine with the Slurm commands"
        ) from None
    except subprocess.TimeoutExpired:
        raise BuildConflict(f"{' '.join(argv[:2])} did not answer in 120 s ({what})") from None
    if p.returncode != 0:
        raise BuildConflict(
            f"{what}: {' '.join(shlex.quote(a) for a in argv)} exited {p.returncode}: {p.stderr.strip()}"
        )
    return p.stdout


def job_states(jobs: Sequence[str]) -> dict[str, tuple[str, str]]:
    """{job id as squeue prints it ("12_3"): (state, reason)} of ``jobs`` and their array elements."""
    if not jobs:
        return {}
    out = _run_slurm(["squeue", "-h", "-r", "--states=all", "-j", ",".join(jobs), "-o", "%i|%T|%r"], "squeue")
    states = {}
    for line in out.splitlines():
        jid, state, reason = (line.strip().split("|") + ["", ""])[:3]
        states[jid] = (state, reason)
    return states


def submit_slurm(prep: Prepared, lock: BuildLock) -> BuildReport:
    """Plan, write the scripts, submit the chain (and follow it with ``wait``); a plain function on
    :func:`~.prepare.prepare`'s answer. No driver watches the reads, so the fast encoder is proven
    before anything is submitted."""
    prove(prep)
    t, opts = prep.target, prep.cfg.slurm
    folder = t.state.root / "slurm"
    prep.plan.write(t.state, t.tok.json_text)
    report = new_report(prep)
    report.encoder, report.encoder_note = prep.choice.encoder.name, prep.choice.note
    todo = stage_status(t.state.root)
    scripts = write_scripts(folder, opts, t.state.root)
    report.submitted = True
    if opts.dry_run:
        report.jobs = {}
        report.slurm = {
            "scripts": {k: str(v) for k, v in scripts.items()},
            "commands": sbatch_lines(folder, opts, todo),
        }
        return report
    never = lock.cancel_jobs
    if never:
        _run_slurm(["scancel", *never], "cancelling the jobs of the earlier run that would never start")
    jobs = submit_chain(folder, opts, todo)
    report.jobs = jobs
    report.slurm = {"scripts": {k: str(v) for k, v in scripts.items()}, "logs": str(folder / "logs")}
    chain = [jobs[stage] for stage, _ in CHAIN if stage in jobs]
    lock.update(kind="slurm", jobs=[j for ids in chain for j in ids], chain=chain, state=str(t.state.root))
    lock.hand_over()
    if not opts.wait:
        return report
    return follow(prep, report, folder, jobs)


# -- scripts and submission ------------------------------------------------------------------
def stage_script(folder: Path, opts: SlurmOptions, state_root: Path, stage: str, per_element: bool) -> str:
    """The batch script of one stage: its resources and the one ``build-stage`` command it runs."""
    py = opts.python or sys.executable
    logs = folder / "logs"
    name = f"{stage}-%A_%a.out" if per_element else f"{stage}-%j.out"
    head = ["#!/bin/bash", f"#SBATCH --job-name=h5c-{stage}", f"#SBATCH --output={logs / name}"]
    head.append(f"#SBATCH --cpus-per-task={int(opts.cpus_per_task)}")
    if opts.partition:
        head.append(f"#SBATCH --partition={opts.partition}")
    if opts.time:
        head.append(f"#SBATCH --time={opts.time}")
    head += [f"#SBATCH {a}" for a in opts.sbatch_args]
    cmd = [py, "-m", "h5corpus", "build-stage", stage, "--state", str(state_root)]
    line = " ".join(shlex.quote(c) for c in cmd)
    if per_element:
        line += ' --task-index "$(( ${H5CORPUS_TASK_OFFSET:-0} + SLURM_ARRAY_TASK_ID ))"'
    return "\n".join([*head, "set -euo pipefail", f"exec {line}", ""])


def write_scripts(folder: Path, opts: SlurmOptions, state_root: Path) -> dict[str, Path]:
    """``<state>/slurm/<stage>.sbatch`` for every stage of the chain."""
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    out = {}
    for stage, per in CHAIN:
        p = folder / f"{stage}.sbatch"
        p.write_text(stage_script(folder, opts, state_root, stage, per))
        out[stage] = p
    return out


def wanted(todo: dict[str, Any]) -> dict[str, list[int] | bool]:
    """What to submit per stage (:func:`~h5corpus.build.stages.dispatch.stage_status` already says "all"
    for every stage after one with missing work)."""
    return {stage: (list(todo[stage]) if per else bool(todo[stage])) for stage, per in CHAIN}


def _arrays(want: list[int] | bool, per: bool, opts: SlurmOptions) -> list[tuple[int, list[int]]]:
    """(offset, array indices) per sbatch call of one stage; one call without an array when not ``per``."""
    return array_chunks(want, int(opts.max_array_size)) if per else [(0, [])]  # type: ignore[arg-type]


def sbatch_lines(folder: Path, opts: SlurmOptions, todo: dict[str, Any]) -> list[str]:
    """The sbatch command lines of a dry run (dependencies as ``$READ_JOBS`` etc.)."""
    lines, prev = [], None
    for stage, per in CHAIN:
        w = wanted(todo)[stage]
        if not w:
            continue
        dep = f" --dependency=afterok:${prev.upper()}_JOBS" if prev else ""
        script = shlex.quote(str(folder / f"{stage}.sbatch"))
        for off, idx in _arrays(w, per, opts):
            exp = f" --export=ALL,H5CORPUS_TASK_OFFSET={off}" if off else ""
            arr = f" --array={array_spec(idx)}" if per else ""
            lines.append(f"sbatch --parsable{arr}{dep}{exp} {script}")
        prev = stage
    return lines


def submit_chain(folder: Path, opts: SlurmOptions, todo: dict[str, Any]) -> dict[str, list[str]]:
    """Submit the chain; on a failed ``sbatch``, cancel what was submitted and raise."""
    want = wanted(todo)
    jobs: dict[str, list[str]] = {}
    prev: list[str] = []
    try:
        for stage, per in CHAIN:
            if not want[stage]:
                continue
            dep = [f"--dependency=afterok:{':'.join(prev)}"] if prev else []
            jobs[stage] = []
            for off, idx in _arrays(want[stage], per, opts):
                argv = ["sbatch", "--parsable", *dep]
                if per:
                    argv.append(f"--array={array_spec(idx)}")
                if off:
                    argv.append(f"--export=ALL,H5CORPUS_TASK_OFFSET={off}")
                out = _run_slurm([*argv, str(folder / f"{stage}.sbatch")], f"submitting the {stage} jobs")
                jobs[stage].append(out.strip().split(";")[0])
            prev = jobs[stage]
    except BaseException:
        submitted = [j for ids in jobs.values() for j in ids]
        if submitted:
            subprocess.run(["scancel", *submitted], capture_output=True, timeout=120)
        raise
    return jobs


# -- following ---------------------------------------------------------------------------------
def follow(prep: Prepared, report: BuildReport, folder: Path, jobs: dict[str, list[str]]) -> BuildReport:
    """Follow the jobs until the manifest is written (Ctrl-C stops following; the jobs go on)."""
    t, n = prep.target, len(prep.tasks)
    bar = progress_bar("task", "slurm build", total=2 * n, every_s=0.5) if prep.cfg.progress else None
    ids = [j for v in jobs.values() for j in v]
    stage_of = {j: s for s, v in jobs.items() for j in v}
    try:
        while True:
            states = job_states(ids)
            check_jobs(states, stage_of, folder)
            if bar is not None:
                done, fin = _records(t.state.root / "read", n), _records(t.state.root / "finish", n)
                bar.update(done + fin - bar.n)
                bar.set_postfix_str(f"read={done}/{n} finished={fin}", refresh=False)
            if all(states.get(j, ("", ""))[0] == "COMPLETED" for j in jobs.get("commit", [])):
                break
            if not states and t.manifest_path.exists() and not t.state.root.exists():
                break  # the jobs are gone from squeue (MinJobAge) after writing the manifest
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # stop following; the jobs go on
        return report
    finally:
        if bar is not None:
            bar.close()
    rep = report_from_manifest(read_manifest(t.manifest_path), str(t.shards_dir), time.perf_counter() - prep.t_start)
    rep.up_to_date = False
    rep.executor, rep.decide_buckets, rep.jobs = "slurm", prep.buckets, jobs
    rep.encoder, rep.encoder_note, rep.tasks, rep.resumed = report.encoder, report.encoder_note, n, report.resumed
    return rep


def check_jobs(states: dict[str, tuple[str, str]], stage_of: dict[str, str], folder: Path) -> None:
    """Raise BuildError when a job failed or can never start (then cancel what would pend forever)."""
    bad = [(j, s) for j, (s, _) in states.items() if s in TERMINAL and s != "COMPLETED"]
    never = [j for j, (s, r) in states.items() if s == "PENDING" and r == "DependencyNeverSatisfied"]
    if not bad and not never:
        return
    # What still pends can never complete the chain now: cancel it (jobs pending on a failed
    # dependency would pend until cancelled). Elements still running go on; their work is kept.
    pending = [j for j, (s, _) in states.items() if s == "PENDING"]
    if pending:
        subprocess.run(["scancel", *pending], capture_output=True, timeout=120)
    job, why = bad[0] if bad else (never[0], "PENDING forever (DependencyNeverSatisfied)")
    stage = stage_of.get(job.split("_")[0], "?")
    log = folder / "logs" / f"{stage}-{job}.out"
    raise BuildError(
        f"Slurm job {job} ({stage}) ended {why}; its log: {log}. Completed work is kept: re-run the same "
        "command to resubmit what is missing"
    )


def _records(folder: Path, n: int) -> int:
    """Stage records (``00042.json``) in ``folder``; ``n`` once the state folder is gone (committed)."""
    if not folder.parent.is_dir():
        return n
    return sum(1 for p in folder.glob("*.json") if p.stem.isdigit())


__all__ = ["array_chunks", "array_spec", "submit_slurm"]
