"""How a build runs: which executor, and whether the decide stage runs in memory or in buckets.

:func:`make_run` picks, for :func:`~h5corpus.build.run.runner.build_corpus`, the run that drives the
stages (docs/SCALING.md):

- in-memory decide (:class:`~h5corpus.build.run.runner._Run`, the local executor's default): the driver
  decides each task as soon as it and every earlier one are read, so finishing overlaps reading
  and budgets stop reading early;
- bucketed decide (:class:`BucketedRun`): every task is read (with its sorted keys), then the
  decide buckets run as tasks on the executor, the driver merges them
  (:func:`~h5corpus.build.stages.merge.merge_buckets`) and the finish tasks follow. Same bytes, memory
  bounded per bucket;
- Slurm (:class:`~h5corpus.build.run.slurm.SlurmRun`): no driver at all; the stages are job arrays.

Ray replaces the local process pool in either of the first two
(:class:`~h5corpus.build.run.ray_executor.RayExecutor`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from ..stages.buckets import lsh_params, run_bucket
from ..stages.buildplan import BuildPlan, filters_spec, rebuild_filters
from ..stages.decide import Decider
from ..stages.dispatch import load_read_records, stage_lsh
from ..stages.merge import merge_buckets
from ..stages.tasks import StageCall
from .runner import _Run

#: Input bytes per decide bucket when the count is picked automatically (~1 M documents of web
#: text: a bucket's sort then needs ~100 MB; docs/SCALING.md).
BUCKET_INPUT_BYTES = 1 << 30


def auto_buckets(tasks: Any) -> int:
    """One decide bucket per :data:`BUCKET_INPUT_BYTES` of input (at least one)."""
    return max(1, math.ceil(sum(int(t.nbytes) for t in tasks) / BUCKET_INPUT_BYTES))


def decide_buckets(cfg: Any, tasks: Any, can_stop_early: bool) -> int:
    """The decide buckets of this build: 0 for the in-memory decide (see :class:`BuildConfig
    <h5corpus.build.config.BuildConfig>`'s ``decide_buckets``)."""
    if cfg.decide_buckets is not None:
        return int(cfg.decide_buckets)
    if cfg.executor == "slurm":
        return auto_buckets(tasks)
    if cfg.executor == "local" or can_stop_early:
        return 0
    return auto_buckets(tasks)


def make_run(target: Any, tasks: list, resumed: bool, lock: Any, t_start: float) -> Any:
    """The run object of this build (its ``run()`` returns the :class:`~h5corpus.build.report.BuildReport`)."""
    cfg = target.cfg
    if cfg.executor != "local":
        rebuild_filters(filters_spec(cfg.filters))  # the workers rebuild them from the plan: fail here, not there
        _refuse_in_process_tasks(cfg.executor, tasks)
    stops = Decider(
        budgets=cfg.max_tokens,
        validation_fraction=float(cfg.validation_fraction),
        drop_worst_fraction=cfg.drop_worst_fraction,
    ).can_stop_early
    buckets = decide_buckets(cfg, tasks, stops)
    if cfg.executor == "slurm":
        from .slurm import SlurmRun

        return SlurmRun(target, tasks, resumed, lock, t_start, buckets=buckets)
    if buckets:
        run: _Run = BucketedRun(target, tasks, resumed, lock.fds, t_start, buckets=buckets)
    else:
        run = _Run(target, tasks, resumed, lock.fds, t_start)
    run.report.executor, run.report.decide_buckets = cfg.executor, buckets
    if cfg.executor == "ray":
        from .ray_executor import RayExecutor

        run.executor = RayExecutor(cfg.ray, target.state.root, count_progress=cfg.progress)
        run.workers = max(1, min(run.executor.workers, max(run.n, 1)))
        run.events = run.executor.driver_events()
    return run


def _refuse_in_process_tasks(executor: str, tasks: list) -> None:
    """An in-memory ``datasets`` object cannot travel in the plan: refuse it before submitting."""
    from ..input.hfrecords import in_process_only, task_label
    from ..input.sources import SourceError

    held = [t for t in tasks if in_process_only(t)]
    if held:
        raise SourceError(
            f"--executor {executor}: {task_label(held[0])} ({len(held)} task(s)) reads a datasets object held in this "
            "process's memory, which other processes cannot open; save it with save_to_disk() (or flatten_indices()) "
            "and build from the folder, or use --executor local"
        )


def plan_for_stages(plan: BuildPlan, target: Any, buckets: int) -> BuildPlan:
    """``plan`` with what stages run from the state folder alone need: the buckets, the manifest's
    path, the sources' description and the drop list's path."""
    cfg = target.cfg
    return dataclasses.replace(
        plan,
        decide_buckets=buckets,
        manifest=str(target.manifest_path),
        sources=dict(target.sources),
        explain_drops=None if cfg.explain_drops is None else str(Path(cfg.explain_drops).absolute()),
    )


class BucketedRun(_Run):
    """The stages with a bucketed decide: read everything, then the buckets, the merge, the finishes."""

    def __init__(self, *args: Any, buckets: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.buckets = int(buckets)
        self.lsh = lsh_params(self.decider.index)  # refuses an index the buckets cannot reproduce
        self.bucket_pending: set[int] = set()
        self.keys_pending: set[int] = set()

    def _plan(self, encoder: Any) -> BuildPlan:
        return plan_for_stages(super()._plan(encoder), self.t, self.buckets)

    def _decide_ready(self) -> None:
        """Nothing is decided before every task is read (see :meth:`_loop`)."""

    def _results(self) -> None:
        """Wait for one result (or 0.1 s) and file it."""
        self._submit_reads()
        res = self.executor.next_result(timeout=0.1)
        self._update_bar()
        if res is None:
            return
        if res.error is not None:
            raise self._stage_error(res.call, res.error)
        if res.call.stage == "read":
            self._on_read(res.call.index, res.value)
        elif res.call.stage == "bucket":
            self.bucket_pending.discard(res.call.index)
        elif res.call.stage == "keys":
            self.keys_pending.discard(res.call.index)
        elif res.call.stage == "finish":
            self._on_finish(res.call.index, res.value)

    def _loop(self) -> None:
        while len(self.read) < self.n or self.read_pending:
            self._results()
        self.keys_pending = set(self.earlier)  # records of an interrupted run may lack their keys
        for i in sorted(self.keys_pending):
            self.executor.submit(StageCall("keys", i))
        while self.keys_pending:
            self._results()
        self.bucket_pending = set(range(self.buckets))
        for b in range(self.buckets):
            self.executor.submit(StageCall("bucket", b))
        while self.bucket_pending:
            self._results()
        self._merge()
        while self.finish_pending or self.reread:
            self._results()

    def _merge(self) -> None:
        ctx = self.ctx
        reads = [self.read[i] for i in range(self.n)]
        lsh = stage_lsh(ctx)
        # The workers wrote the bucket records; reading them back here checks they are complete.
        on_disk = load_read_records(ctx)
        records = [run_bucket(ctx.state, on_disk, lsh, b, self.buckets) for b in range(self.buckets)]
        result = merge_buckets(
            ctx, reads, records, lsh, earlier=self.earlier, explain=self.explain.write if self.explain else None
        )
        self.decider, self.decisions, self.cut = result.decider, result.decisions, result.cut
        for i in range(self.cut + 1):
            self.finish_pending.add(i)
            self.executor.submit(StageCall("finish", i, self.decisions[i]))
            self.events.step("decided")
