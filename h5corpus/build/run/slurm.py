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
from ..config import BuildConflict, BuildError
from ..report import BuildReport, report_from_manifest
from ..stages.buckets import lsh_params
from ..stages.dispatch import stage_status
from ..tokenize.encoders import HFEncoder
from ..tokenize.proof import prove_fast_path
from .runner import _Run
from .scaled import plan_for_stages

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


class SlurmRun(_Run):
    """Plan, write the scripts, submit the chain (and follow it with ``wait``)."""

    def __init__(self, target: Any, tasks: list, resumed: bool, lock: Any, t_start: float, *, buckets: int) -> None:
        super().__init__(target, tasks, resumed, lock.fds, t_start)
        self.lock = lock
        self.buckets = int(buckets)
        self.opts = target.cfg.slurm
        lsh_params(self.decider.index)  # refuses an index the buckets cannot reproduce
        self.folder = target.state.root / "slurm"
        self.report.executor, self.report.decide_buckets = "slurm", self.buckets

    def _plan(self, encoder: Any) -> Any:
        return plan_for_stages(super()._plan(encoder), self.t, self.buckets)

    def _prove(self) -> None:
        """No driver watches the reads: prove the fast encoder before anything is submitted."""
        if self._loading is not None:
            self._proof_sample()  # while the fast encoder loads
        self._take_fast_encoder()
        if self.fast is None or self.encoder is not self.fast:
            return
        chosen, note = prove_fast_path(
            HFEncoder(self.t.tok), self.fast, self._proof_sample(), names=self.cfg.fast_encoders
        )
        if chosen is not self.fast:
            self.note = "; ".join(filter(None, (self.note, note)))
            self.encoder = chosen

    def run(self) -> BuildReport:
        self._prove()
        self.plan = self._plan(self.encoder)
        self.plan.write(self.t.state, self.t.tok.json_text)
        self.report.encoder, self.report.encoder_note = self.encoder.name, self.note
        todo = stage_status(self.t.state.root)
        scripts = self._write_scripts()
        self.report.submitted = True
        if self.opts.dry_run:
            self.report.jobs = {}
            self.report.slurm = {
                "scripts": {k: str(v) for k, v in scripts.items()},
                "commands": self._commands(todo, None),
            }
            return self.report
        self._cancel_forever_pending()
        jobs = self._submit(todo)
        self.report.jobs = jobs
        self.report.slurm = {"scripts": {k: str(v) for k, v in scripts.items()}, "logs": str(self.folder / "logs")}
        chain = [jobs[stage] for stage, _ in CHAIN if stage in jobs]
        flat = [j for ids in chain for j in ids]
        self.lock.update(kind="slurm", jobs=flat, chain=chain, state=str(self.t.state.root))
        self.lock.hand_over()
        if not self.opts.wait:
            return self.report
        return self._follow(jobs, todo)

    # -- scripts and submission ------------------------------------------------------------------
    def _script(self, stage: str, per_element: bool) -> str:
        o = self.opts
        py = o.python or sys.executable
        logs = self.folder / "logs"
        name = f"{stage}-%A_%a.out" if per_element else f"{stage}-%j.out"
        head = ["#!/bin/bash", f"#SBATCH --job-name=h5c-{stage}", f"#SBATCH --output={logs / name}"]
        head.append(f"#SBATCH --cpus-per-task={int(o.cpus_per_task)}")
        if o.partition:
            head.append(f"#SBATCH --partition={o.partition}")
        if o.time:
            head.append(f"#SBATCH --time={o.time}")
        head += [f"#SBATCH {a}" for a in o.sbatch_args]
        cmd = [py, "-m", "h5corpus", "build-stage", stage, "--state", str(self.t.state.root)]
        line = " ".join(shlex.quote(c) for c in cmd)
        if per_element:
            line += ' --task-index "$(( ${H5CORPUS_TASK_OFFSET:-0} + SLURM_ARRAY_TASK_ID ))"'
        return "\n".join([*head, "set -euo pipefail", f"exec {line}", ""])

    def _write_scripts(self) -> dict[str, Path]:
        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        out = {}
        for stage, per in CHAIN:
            p = self.folder / f"{stage}.sbatch"
            p.write_text(self._script(stage, per))
            out[stage] = p
        return out

    @staticmethod
    def _wanted(todo: dict[str, Any]) -> dict[str, list[int] | bool]:
        """What to submit per stage (:func:`~h5corpus.build.stages.dispatch.stage_status` already says "all"
        for every stage after one with missing work)."""
        return {stage: (list(todo[stage]) if per else bool(todo[stage])) for stage, per in CHAIN}

    def _commands(self, todo: dict[str, Any], job_ids: dict[str, list[str]] | None) -> list[str]:
        """The sbatch command lines (dependencies as ``$READ_JOBS`` etc. for a dry run)."""
        lines, prev = [], None
        for stage, per in CHAIN:
            w = self._wanted(todo)[stage]
            if not w:
                continue
            dep = f" --dependency=afterok:${prev.upper()}_JOBS" if prev else ""
            script = self.folder / f"{stage}.sbatch"
            if per:
                for off, idx in array_chunks(w, int(self.opts.max_array_size)):  # type: ignore[arg-type]
                    exp = f" --export=ALL,H5CORPUS_TASK_OFFSET={off}" if off else ""
                    lines.append(f"sbatch --parsable --array={array_spec(idx)}{dep}{exp} {shlex.quote(str(script))}")
            else:
                lines.append(f"sbatch --parsable{dep} {shlex.quote(str(script))}")
            prev = stage
        return lines

    def _submit(self, todo: dict[str, Any]) -> dict[str, list[str]]:
        """Submit the chain; on a failed ``sbatch``, cancel what was submitted and raise."""
        want = self._wanted(todo)
        jobs: dict[str, list[str]] = {}
        prev: list[str] = []
        try:
            for stage, per in CHAIN:
                w = want[stage]
                if not w:
                    continue
                script = str(self.folder / f"{stage}.sbatch")
                dep = [f"--dependency=afterok:{':'.join(prev)}"] if prev else []
                chunks = array_chunks(w, int(self.opts.max_array_size)) if per else [(0, [])]  # type: ignore[arg-type]
                jobs[stage] = []
                for off, idx in chunks:
                    argv = ["sbatch", "--parsable", *dep]
                    if per:
                        argv.append(f"--array={array_spec(idx)}")
                    if off:
                        argv.append(f"--export=ALL,H5CORPUS_TASK_OFFSET={off}")
                    out = _run_slurm([*argv, script], f"submitting the {stage} jobs")
                    jobs[stage].append(out.strip().split(";")[0])
                prev = jobs[stage]
        except BaseException:
            submitted = [j for ids in jobs.values() for j in ids]
            if submitted:
                subprocess.run(["scancel", *submitted], capture_output=True, timeout=120)
            raise
        return jobs

    def _cancel_forever_pending(self) -> None:
        never = self.lock.cancel_jobs
        if never:
            _run_slurm(["scancel", *never], "cancelling the jobs of the earlier run that would never start")

    # -- following ---------------------------------------------------------------------------------
    def _follow(self, jobs: dict[str, list[str]], todo: dict[str, Any]) -> BuildReport:
        bar = _bar(self.n) if self.cfg.progress else None
        ids = [j for v in jobs.values() for j in v]
        stage_of = {j: s for s, v in jobs.items() for j in v}
        try:
            while True:
                states = job_states(ids)
                self._check(states, stage_of, ids)
                if bar is not None:
                    done = (
                        sum(1 for _ in (self.t.state.root / "read").glob("*.json"))
                        if self.t.state.root.is_dir()
                        else self.n
                    )
                    fin = (
                        sum(1 for _ in (self.t.state.root / "finish").glob("*.json"))
                        if self.t.state.root.is_dir()
                        else self.n
                    )
                    bar.update(done + fin - bar.n)
                    bar.set_postfix_str(f"read={done}/{self.n} finished={fin}", refresh=False)
                commit_ids = jobs.get("commit", [])
                if all(states.get(j, ("", ""))[0] == "COMPLETED" for j in commit_ids):
                    break
                if not states and self.t.manifest_path.exists() and not self.t.state.root.exists():
                    break  # the jobs are gone from squeue (MinJobAge) after writing the manifest
                time.sleep(POLL_S)
        except KeyboardInterrupt:  # stop following; the jobs go on
            return self.report
        finally:
            if bar is not None:
                bar.close()
        m = read_manifest(self.t.manifest_path)
        rep = report_from_manifest(m, str(self.t.shards_dir), time.perf_counter() - self.t_start)
        rep.up_to_date = False
        rep.executor, rep.decide_buckets, rep.jobs = "slurm", self.buckets, jobs
        rep.encoder, rep.encoder_note, rep.tasks, rep.resumed = (
            self.encoder.name,
            self.note,
            self.n,
            self.report.resumed,
        )
        return rep

    def _check(self, states: dict[str, tuple[str, str]], stage_of: dict[str, str], ids: list[str]) -> None:
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
        what = bad[0] if bad else (never[0], "PENDING forever (DependencyNeverSatisfied)")
        job = what[0]
        stage = stage_of.get(job.split("_")[0], "?")
        log = self.folder / "logs" / (f"{stage}-{job}.out" if "_" in job else f"{stage}-{job}.out")
        raise BuildError(
            f"Slurm job {job} ({stage}) ended {what[1]}; its log: {log}. Completed work is kept: re-run the same "
            "command to resubmit what is missing"
        )


def _records(folder: Path, n: int) -> int:
    """Stage records (``00042.json``) in ``folder``; ``n`` once the state folder is gone (committed)."""
    if not folder.parent.is_dir():
        return n
    return sum(1 for p in folder.glob("*.json") if p.stem.isdigit())


def _bar(n: int):
    from tqdm import tqdm

    return tqdm(total=2 * n, unit="task", desc="slurm build", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


__all__ = ["SlurmRun", "array_chunks", "array_spec"]
