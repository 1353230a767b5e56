"""Every stage by name, run from the state folder alone: what each executor's worker and each
``h5corpus build-stage`` command runs (docs/SCALING.md, "The stage commands").

:func:`run_stage` is the dispatcher of one :class:`~h5corpus.build.stages.tasks.StageCall` in a process that
has a :class:`~h5corpus.build.stages.buildplan.StageContext`: ``read`` (and, when the plan has decide buckets, the
task's sorted keys), ``keys``, ``bucket``, ``finish``.

The ``stage_*`` functions are the stage commands of a build driven by a scheduler (Slurm's job
arrays, or any other): each loads the context from the state folder, does nothing when its valid
record is already there (so a rerun array element is harmless), and otherwise runs its stage:

========  ==========================================  ============================================
stage     runs                                        leaves in the state folder
========  ==========================================  ============================================
read      once per task (``--task-index`` 0..T-1)     ``read/<task>.*`` and the task's sorted keys
bucket    once per bucket (0..B-1), after all reads   ``decide/b<bucket>.*``
decide    once, after all buckets                     ``decide/<task>.*``, ``decide/summary.json``
finish    once per task, after decide                 ``finish/<task>.json``; the final shards
commit    once, after all finishes                    the manifest; then the state folder goes
========  ==========================================  ============================================
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...storage.manifest import Manifest
from ..config import BuildConflict, BuildError
from .buckets import BucketRecord, LshParams, load_bucket_record, lsh_params, run_bucket, write_task_keys
from .buildplan import StageContext
from .commit import add_up, commit
from .explain import ExplainFile
from .merge import load_decision, load_summary, merge_buckets, merge_inputs, summary_path
from .runmarker import remove_marker_of
from .state import LOCK_FILE, FinishRecord, ReadRecord, StateDir, TaskDecision, manifest_lock_path
from .tasks import StageCall, finish_task, read_task
from .tasks import run_stage as run_read_or_finish

STAGES = ("read", "bucket", "decide", "finish", "commit")
#: Test hook of the scheduler tests: ``STAGE:INDEX:SECONDS`` makes that stage command sleep first
#: (so a test can cancel a running array element).
DELAY_ENV = "H5CORPUS_TEST_STAGE_DELAY"


def stage_lsh(ctx: StageContext) -> LshParams | None:
    """The LSH parameters of the build's near-duplicate index, or None when near dedup is off."""
    make = getattr(ctx.filters, "near_duplicate_index", None)
    if not ctx.plan.want_signatures or not callable(make):
        return None
    return lsh_params(make())


def run_stage(ctx: StageContext, call: StageCall) -> Any:
    """Run ``call`` in this process (every executor's worker runs its calls through here)."""
    if call.stage == "read":
        rec = read_task(ctx, call.index)
        if ctx.plan.decide_buckets:
            docs, sigs, _ = ctx.state.load_read_outputs(rec)
            write_task_keys(ctx.state, rec, docs, sigs, stage_lsh(ctx))
        return rec
    if call.stage == "keys":
        rec = _read_record(ctx, call.index)
        docs, sigs, _ = ctx.state.load_read_outputs(rec)
        write_task_keys(ctx.state, rec, docs, sigs, stage_lsh(ctx))
        return None
    if call.stage == "bucket":
        return run_bucket(ctx.state, load_read_records(ctx), stage_lsh(ctx), call.index, ctx.plan.decide_buckets)
    return run_read_or_finish(ctx, call)


def _read_record(ctx: StageContext, index: int) -> ReadRecord:
    path = ctx.state.read_paths(index).record
    try:
        rec = ReadRecord.from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise BuildConflict(f"{path}: task {index} has no usable read record ({e}); run its read stage first") from None
    if rec.task != ctx.plan.tasks[index].key or rec.index != index:
        raise BuildConflict(f"{path}: the read record of task {index} is of other input; run its read stage again")
    return rec


def load_read_records(ctx: StageContext, upto: int | None = None) -> list[ReadRecord]:
    """The read records of tasks 0..``upto`` (default: all), as the read stage wrote them."""
    n = len(ctx.plan.tasks) if upto is None else upto + 1
    return [_read_record(ctx, i) for i in range(n)]


# -- the stage commands ---------------------------------------------------------------------------
def _context(state_dir: str | Path) -> StageContext:
    state = Path(state_dir)
    if not (state / "plan.json").is_file():
        raise BuildConflict(
            f"{state}: no build plan here, seen from host {socket.gethostname()} (is this the state folder, "
            "<shards>/.build, of a build, on a filesystem this node mounts at the same path?)"
        )
    return StageContext.load(state)


def _delay(stage: str, index: int | None) -> None:
    want = os.environ.get(DELAY_ENV, "")
    if want:
        name, i, seconds = want.split(":")
        if name == stage and (index is None or int(i) == index):
            time.sleep(float(seconds))


def _reusable_read(ctx: StageContext, index: int) -> ReadRecord | None:
    task = ctx.plan.tasks[index]
    rec = ctx.state.load_read_record(index, task.key)
    if rec is None or rec.encoder not in ("tokenizers", ctx.plan.encoder) or (ctx.plan.explain and not rec.explain):
        return None
    return rec


def stage_read(state_dir: str | Path, index: int) -> ReadRecord:
    """The read stage of task ``index`` (reused when its record and files verify)."""
    ctx = _context(state_dir)
    _check_index(ctx, "task", index, len(ctx.plan.tasks))
    _delay("read", index)
    rec = _reusable_read(ctx, index)
    if rec is not None:
        if ctx.plan.decide_buckets:
            run_stage(ctx, StageCall("keys", index))
        return rec
    return run_stage(ctx, StageCall("read", index))


def stage_bucket(state_dir: str | Path, bucket: int) -> BucketRecord:
    """Bucket ``bucket`` of the decide stage (needs every task's read record)."""
    ctx = _context(state_dir)
    _check_index(ctx, "bucket", bucket, ctx.plan.decide_buckets)
    _delay("bucket", bucket)
    return run_stage(ctx, StageCall("bucket", bucket))


def _bucket_records(ctx: StageContext, reads: Sequence[ReadRecord], lsh: LshParams | None) -> list[BucketRecord]:
    from .buckets import decide_inputs

    inputs = decide_inputs(reads, lsh, ctx.plan.decide_buckets)
    out = []
    for b in range(ctx.plan.decide_buckets):
        rec = load_bucket_record(ctx.state, b, inputs)
        if rec is None:
            raise BuildConflict(
                f"{ctx.state.root}: bucket {b} of the decide stage is missing or out of date; run it first"
            )
        out.append(rec)
    return out


def explain_spool(state: StateDir) -> Path:
    """Where a decide stage run without a driver keeps the ``--explain-drops`` lines until commit."""
    return state.root / "decide" / "explain.jsonl"


def stage_decide(state_dir: str | Path) -> dict[str, Any]:
    """The merge of the decide stage: every task's decision and ``decide/summary.json`` (reused when
    it was made from the same read records and buckets). Returns the summary."""
    ctx = _context(state_dir)
    _delay("decide", None)
    reads = load_read_records(ctx)
    lsh = stage_lsh(ctx)
    buckets = _bucket_records(ctx, reads, lsh)
    done = load_summary(ctx.state, merge_inputs(reads, lsh, buckets))
    if done is not None:
        return done
    spool = explain_spool(ctx.state)
    tmp = spool.with_name(f".{spool.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:

        def write(lines: list[dict[str, Any]]) -> None:
            for d in lines:
                fh.write(json.dumps(d, ensure_ascii=False) + "\n")

        # No driver watches these tasks: finish re-hashes every candidate shard before using it.
        merge_buckets(
            ctx, reads, buckets, lsh, earlier=set(range(len(reads))), explain=write if ctx.plan.explain else None
        )
    os.replace(tmp, spool)
    return json.loads(summary_path(ctx.state).read_text())


def _summary(ctx: StageContext) -> dict[str, Any]:
    try:
        return json.loads(summary_path(ctx.state).read_text())
    except (OSError, ValueError):
        raise BuildConflict(f"{ctx.state.root}: the decide stage has not run (no decide/summary.json)") from None


def stage_finish(state_dir: str | Path, index: int) -> FinishRecord | None:
    """The finish stage of task ``index``: its final shards (None for a task past the budgets)."""
    ctx = _context(state_dir)
    _check_index(ctx, "task", index, len(ctx.plan.tasks))
    _delay("finish", index)
    if index > int(_summary(ctx)["cut"]):
        return None
    decision = load_decision(ctx.state, index)
    if decision is None:
        raise BuildConflict(f"{ctx.state.root}: no decision for task {index}; run the decide stage first")
    rec = finish_task(ctx, index, decision)
    if rec is None:  # the candidates were gone or damaged: read the task again, then finish it
        before = _read_record(ctx, index)
        again = read_task(ctx, index)
        if again.docs_sha256 != before.docs_sha256:
            raise BuildError(
                f"task {index} ({ctx.plan.tasks[index].label}) reads differently now: did its input change?"
            )
        rec = finish_task(
            ctx, index, dataclasses.replace(decision, candidates=again.candidates, verify_candidates=False)
        )
        assert rec is not None
    return rec


def stage_commit(state_dir: str | Path) -> Manifest:
    """The commit stage: the manifest (then the state folder is removed)."""
    ctx = _context(state_dir)
    _delay("commit", None)
    plan = ctx.plan
    if plan.manifest is None or plan.sources is None:
        raise BuildConflict(f"{ctx.state.root}: this plan was made for a driver, not for stage commands")
    summary = _summary(ctx)
    cut = int(summary["cut"])
    reads = load_read_records(ctx, cut)
    finishes = {}
    for rec in reads:
        fin = ctx.state.load_finish_record(rec.index, rec.task)
        if fin is None or fin.decision_sha256 != summary["decisions"][str(rec.index)]:
            raise BuildConflict(f"{ctx.state.root}: task {rec.index} is not finished; run its finish stage first")
        finishes[rec.index] = fin
    explain = None
    if plan.explain_drops is not None:
        explain = ExplainFile(plan.explain_drops)
        with open(explain_spool(ctx.state), encoding="utf-8") as fh:
            explain.write(json.loads(line) for line in fh)
    totals = add_up(reads, timed={r.index for r in reads})
    m = commit(
        ctx,
        manifest_path=Path(plan.manifest),
        splits=summary["splits"],
        reads=reads,
        finishes=finishes,
        totals=totals,
        sources=plan.sources,
        explain=explain,
        decisions=_decisions(ctx, reads) if plan.perplexity_scores is not None else None,
    )
    state_root = str(ctx.state.root)
    for marker in (Path(plan.shards_dir) / LOCK_FILE, manifest_lock_path(Path(plan.manifest))):
        remove_marker_of(marker, lambda mk: mk.get("kind") == "slurm" and mk.get("state") == state_root)
    return m


def _decisions(ctx: StageContext, reads: Sequence[ReadRecord]) -> dict[int, TaskDecision]:
    out = {}
    for rec in reads:
        d = load_decision(ctx.state, rec.index)
        if d is None:
            raise BuildConflict(f"{ctx.state.root}: no decision for task {rec.index}; run the decide stage first")
        out[rec.index] = d
    return out


def stage_status(state_dir: str | Path) -> dict[str, Any]:
    """What each stage still has to do: ``{"read": [task, ...], "bucket": [...], "decide": bool,
    "finish": [...], "commit": bool}`` (lists of the indices without a valid record)."""
    ctx = _context(state_dir)
    n, nb = len(ctx.plan.tasks), ctx.plan.decide_buckets
    read_missing = [i for i in range(n) if _reusable_read(ctx, i) is None]
    out: dict[str, Any] = {"tasks": n, "buckets": nb, "read": read_missing}
    if read_missing:
        return {**out, "bucket": list(range(nb)), "decide": True, "finish": list(range(n)), "commit": True}
    reads = load_read_records(ctx)
    lsh = stage_lsh(ctx)
    from .buckets import decide_inputs

    inputs = decide_inputs(reads, lsh, nb)
    out["bucket"] = [b for b in range(nb) if load_bucket_record(ctx.state, b, inputs) is None]
    summary = None
    if not out["bucket"]:
        buckets = [load_bucket_record(ctx.state, b, inputs) for b in range(nb)]
        summary = load_summary(ctx.state, merge_inputs(reads, lsh, buckets))  # type: ignore[arg-type]
    out["decide"] = summary is None
    if summary is None:
        return {**out, "finish": list(range(n)), "commit": True}
    cut = int(summary["cut"])
    out["finish"] = [
        i
        for i in range(cut + 1)
        if (f := ctx.state.load_finish_record(i, reads[i].task)) is None
        or f.decision_sha256 != summary["decisions"][str(i)]
    ]
    out["commit"] = True
    return out


def _check_index(ctx: StageContext, what: str, index: int, count: int) -> None:
    if not 0 <= index < count:
        raise ValueError(f"{what} index {index} is out of range: this build has {count} {what}s (0..{count - 1})")


def main_stage(stage: str, state_dir: str | Path, index: int | None) -> Any:
    """Run one stage command (``h5corpus build-stage``); ValueError for a bad stage or index."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: one of {', '.join(STAGES)}")
    needs_index = stage in ("read", "bucket", "finish")
    if needs_index and index is None:
        raise ValueError(f"build-stage {stage} needs --task-index")
    if not needs_index and index is not None:
        raise ValueError(f"build-stage {stage} runs once: no --task-index")
    fn = {"read": stage_read, "bucket": stage_bucket, "finish": stage_finish}.get(stage)
    if fn is not None:
        return fn(state_dir, index)  # type: ignore[arg-type]
    return {"decide": stage_decide, "commit": stage_commit}[stage](state_dir)
