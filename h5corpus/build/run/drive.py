"""The build's one event loop: :func:`drive` runs a :class:`~.prepare.Prepared` build's stages on an
:class:`~.executor.Executor` (the local process pool or Ray) with a decide form, and commits.

The loop is the same for every executor and both decide forms: submit reads (a window of them when
budgets may stop reading early), let the decide form advance (:class:`InMemoryDecide`: each task as
soon as it and every earlier one are read; :class:`BucketedDecide`: keys, buckets, one merge pass,
once every task is read), file each result through one handler (:meth:`Driver.on_result`), until
every task of the corpus is finished; then the commit writes the manifest. The fast encoder is
proven on the build's own input while the first reads run (:func:`~.prepare.prove`); on a
difference the executor restarts on ``tokenizers`` and what the fast one made is dropped.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

import numpy as np

from ..config import BuildError, OnError, WarmFilters
from ..oserrors import as_build_os_error, os_step
from ..report import BuildReport
from ..stages.buckets import run_bucket
from ..stages.buildplan import BuildPlan, StageContext
from ..stages.commit import add_up, commit
from ..stages.decide import DecideInput, task_scores, worst_masks
from ..stages.dispatch import Stage, StageCall, load_read_records, stage_lsh
from ..stages.explain import ExplainFile
from ..stages.merge import merge_buckets
from ..stages.statedir import FinishRecord, ReadRecord, TaskDecision
from .executor import Executor, StageResult
from .prepare import Prepared, new_report, progress_bar, prove


class DecideForm(Protocol):
    """How the decide stage runs inside the loop."""

    in_input_order: bool
    """Reads go in input order, a window at a time (budgets may stop reading early)."""

    def advance(self, d: Driver) -> None:
        """Decide what can be decided now: submit its finish calls, set ``d.cut`` once known."""

    def busy(self) -> bool:
        """Calls of this form still running (keys, buckets)."""


class Driver:
    """The state of one run of the stages: records, decisions and finishes so far, the work in
    flight. Its loop (:meth:`run`) is the only one; :meth:`on_result` the only result handler."""

    def __init__(self, prep: Prepared, executor: Executor, decide: DecideForm) -> None:
        self.prep, self.executor, self.decide = prep, executor, decide
        self.cfg, self.t, self.tasks = prep.cfg, prep.target, prep.tasks
        self.n = len(prep.tasks)
        self.workers = min(max(1, executor.workers), max(self.n, 1))
        self.decider = prep.decider
        self.read: dict[int, ReadRecord] = {}
        for t in prep.tasks:
            rec = self.t.state.load_read_record(t.index, t.key)
            if rec is not None:
                self.read[t.index] = rec
        self.earlier = set(self.read)
        """Tasks whose read record comes from an interrupted run (candidates re-hashed before use)."""
        self.decisions: dict[int, TaskDecision] = {}
        self.finishes: dict[int, FinishRecord] = {}
        self.pending: dict[Stage, set[int]] = {s: set() for s in (Stage.READ, Stage.KEYS, Stage.BUCKET, Stage.FINISH)}
        self.reread: set[int] = set()
        """Tasks whose candidates were gone at finish: read again, then finished."""
        self.cut: int | None = None
        """Last task that is part of the corpus (known once budgets are filled or all are decided)."""
        self.events = executor.driver_events()
        self.report = new_report(prep)
        self.explain = ExplainFile(self.cfg.explain_drops) if self.cfg.explain_drops is not None else None
        self.bar = progress_bar("tok", "build") if self.cfg.progress else None
        order = [t.index for t in self.tasks]
        if not decide.in_input_order:
            order.sort(key=lambda i: (-self.tasks[i].nbytes, i))  # longest first balances the workers
        self.order = order
        self.window = self.workers + 1 if decide.in_input_order else self.n
        self.to_read = [i for i in order if i not in self.read]

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> BuildReport:
        """Run every stage to the manifest; on any error stop the workers and discard the drop list."""
        try:
            self._start(self.prep.plan)
            self.submit_reads()
            replaced = prove(self.prep)
            if replaced is not None:
                self._restart(replaced)
            self._drop_unusable()
            self.submit_reads()
            self.report.encoder, self.report.encoder_note = self.encoder.name, self.prep.choice.note
            self.report.tasks_reused = len(self.read)
            self._loop()
            self.executor.shutdown(wait=not self.pending[Stage.READ])  # joined once the manifest is written
        except BaseException:
            self.executor.cancel()
            if self.explain is not None:
                self.explain.discard()
            raise
        finally:
            if self.bar is not None:
                self.bar.close()
        return self._commit()

    def _loop(self) -> None:
        while True:
            self.decide.advance(self)
            if self.cut is not None and not self.pending[Stage.FINISH] and not self.reread and not self.decide.busy():
                return
            self.submit_reads()
            res = self.executor.next_result(timeout=0.1)
            self._update_bar()
            if res is not None:
                self.on_result(res)

    def on_result(self, res: StageResult) -> None:
        """File one finished call (any stage, any executor)."""
        call = res.call
        if res.error is not None:
            context = f" ({call.stage.value} stage of task {call.index}: {self.tasks[call.index].label})"
            raise as_build_os_error(res.error, "write into", self.t.shards_dir, context) or res.error
        self.pending[call.stage].discard(call.index)
        if call.stage == Stage.READ:
            self._on_read(call.index, res.value)
        elif call.stage == Stage.FINISH:
            self._on_finish(call.index, res.value)

    def submit(self, call: StageCall) -> None:
        self.pending[call.stage].add(call.index)
        self.executor.submit(call)

    def submit_reads(self) -> None:
        while self.to_read and len(self.pending[Stage.READ]) < self.window and self.cut is None:
            self.submit(StageCall(Stage.READ, self.to_read.pop(0)))

    def submit_finish(self, i: int, decision: TaskDecision) -> None:
        self.decisions[i] = decision
        self.submit(StageCall(Stage.FINISH, i, decision))
        self.events.step("decided")

    # -- the encoder --------------------------------------------------------------------------------
    @property
    def encoder(self) -> Any:
        return self.prep.choice.encoder

    def _start(self, plan: BuildPlan) -> None:
        """Persist ``plan`` and start the executor's workers with its context."""
        with os_step("write the build plan", self.t.state.plan):
            plan.write(self.t.state, self.t.tok.json_text)
        self.ctx = StageContext(
            plan=plan, state=self.t.state, encoder=self.encoder, filters=self.cfg.filters, events=self.events
        )
        self.executor.start(self.ctx)

    def _restart(self, plan: BuildPlan) -> None:
        """The fast encoder differed: drop what it made and start again on ``plan``'s encoder."""
        self.executor.cancel()
        for i in [i for i, r in self.read.items() if not self._usable(r)]:
            del self.read[i]
        self.to_read = [i for i in self.order if i not in self.read]
        self.pending[Stage.READ].clear()
        self._start(plan)
        self.submit_reads()

    def _usable(self, rec: ReadRecord) -> bool:
        # A record from an interrupted run without --explain-drops lacks the locations: read again.
        return rec.encoder in ("tokenizers", self.encoder.name) and (rec.explain or self.cfg.explain_drops is None)

    def _drop_unusable(self) -> None:
        for i in [i for i, r in self.read.items() if not self._usable(r)]:
            del self.read[i]
            self.earlier.discard(i)
            if i not in self.pending[Stage.READ] and i not in self.to_read:
                self.to_read.append(i)

    # -- results --------------------------------------------------------------------------------------
    def _on_read(self, i: int, rec: ReadRecord) -> None:
        self.report.tokens_encoded += rec.tokens
        if self.cut is not None and i > self.cut:
            return  # read past the budgets: not part of the corpus
        self.read[i] = rec
        self.earlier.discard(i)
        if i in self.reread:
            self.reread.discard(i)
            decision = dataclasses.replace(self.decisions[i], candidates=rec.candidates, verify_candidates=False)
            self.submit(StageCall(Stage.FINISH, i, decision))

    def _on_finish(self, i: int, rec: FinishRecord | None) -> None:
        if rec is None:  # the candidates were gone or damaged: read the task again
            self.reread.add(i)
            self.submit(StageCall(Stage.READ, i))
            return
        self.finishes[i] = rec
        if rec.reused:
            self.report.shards_reused += len(rec.shards)
        else:
            self.report.shards_written += len(rec.shards)

    def _update_bar(self) -> None:
        counts = self.executor.progress()
        if self.bar is None or counts is None:
            return
        docs, tokens = counts
        self.bar.update(tokens - self.bar.n)
        self.bar.set_postfix_str(
            f"docs={docs:,} tasks read={len(self.read)}/{self.n} done={len(self.finishes)}", refresh=False
        )

    def decide_input(self, i: int) -> DecideInput:
        """Task ``i``'s read outputs as the decide stage takes them."""
        rec = self.read[i]
        if self.cfg.on_error == OnError.FAIL and rec.skipped_total:
            raise BuildError(
                f"{rec.skipped_records[0]} (recorded by an earlier run with --on-error skip; "
                "pass --on-error skip, or fix the input)"
            )
        return DecideInput(rec, *self.t.state.load_read_outputs(rec))

    def _commit(self) -> BuildReport:
        assert self.cut is not None
        reads = [self.read[i] for i in range(self.cut + 1)]
        totals = add_up(reads, timed={r.index for r in reads if r.index not in self.earlier})
        try:
            m = commit(
                self.ctx,
                manifest_path=self.t.manifest_path,
                splits=self.decider.finish(),
                reads=reads,
                finishes=self.finishes,
                totals=totals,
                sources=self.t.sources,
                explain=self.explain,
                decisions=self.decisions,
            )
        finally:
            self.executor.join()
        r = self.report
        r.tasks_read = len(reads)
        r.splits = m.splits
        r.skipped_total, r.skipped_records = totals.skipped_total, totals.skipped_records
        r.encoder_fallbacks = totals.encoder_fallbacks
        r.filter_counters, r.seconds = totals.filter_counters, totals.seconds
        if self.explain is not None:
            r.explain_drops, r.explained = str(self.cfg.explain_drops), self.explain.lines
        r.elapsed_s = time.perf_counter() - self.prep.t_start
        return r


class InMemoryDecide:
    """The driver decides each task as soon as it and every earlier one are read, so finishing
    overlaps reading and budgets stop reading early."""

    def __init__(self, can_stop_early: bool) -> None:
        self.in_input_order = can_stop_early
        self.next = 0
        """The next task to decide."""

    def busy(self) -> bool:
        return False

    def advance(self, d: Driver) -> None:
        rows = None
        if d.decider.drop_worst_fraction is not None and self.next < d.n:
            rows = self._worst_pass(d)
            if rows is None:
                return
        while d.cut is None and self.next < d.n and self.next in d.read:
            i = self.next
            exact, near, worst = rows[i] if rows is not None else (None, None, None)
            decision, lines = d.decider.feed(
                d.decide_input(i), verify_candidates=i in d.earlier, exact=exact, near=near, worst=worst
            )
            if d.explain is not None:
                with os_step("write the drop list", d.explain.path):
                    d.explain.write(lines)
            d.submit_finish(i, decision)
            self.next += 1
            if d.decider.can_stop_early and d.decider.filled:
                d.cut = i
        if d.cut is None and self.next == d.n:
            d.cut = d.n - 1

    @staticmethod
    def _worst_pass(d: Driver) -> dict[int, tuple[np.ndarray, ...]] | None:
        """The worst-fraction rule's first pass, once every task is read: each task's (exact, near,
        worst) rows. None while tasks are still being read."""
        if len(d.read) < d.n or d.pending[Stage.READ]:
            return None
        flags, scores = [], []
        for i in range(d.n):
            inp = d.decide_input(i)
            flags.append(d.decider.dedup(inp))
            scores.append(task_scores(inp))
        assert d.decider.drop_worst_fraction is not None
        worst = worst_masks(scores, [~e & ~n for e, n in flags], d.decider.drop_worst_fraction)
        return {i: (*flags[i], worst[i]) for i in range(d.n)}


class BucketedDecide:
    """Every task is read (with its sorted keys), then the decide buckets run as calls on the
    executor, the driver merges them (:func:`~h5corpus.build.stages.merge.merge_buckets`) and the
    finish calls follow. Same bytes as :class:`InMemoryDecide`, memory bounded per bucket."""

    in_input_order = False

    def __init__(self, buckets: int) -> None:
        self.buckets = int(buckets)
        self.phase = Stage.READ

    def busy(self) -> bool:
        return self.phase != Stage.FINISH

    def advance(self, d: Driver) -> None:
        if self.phase == Stage.READ and len(d.read) == d.n and not d.pending[Stage.READ]:
            self.phase = Stage.KEYS
            for i in sorted(d.earlier):  # records of an interrupted run may lack their keys
                d.submit(StageCall(Stage.KEYS, i))
        if self.phase == Stage.KEYS and not d.pending[Stage.KEYS]:
            self.phase = Stage.BUCKET
            for b in range(self.buckets):
                d.submit(StageCall(Stage.BUCKET, b))
        if self.phase == Stage.BUCKET and not d.pending[Stage.BUCKET]:
            self.phase = Stage.FINISH
            self._merge(d)

    def _merge(self, d: Driver) -> None:
        ctx = d.ctx
        reads = [d.read[i] for i in range(d.n)]
        lsh = stage_lsh(ctx)
        # The workers wrote the bucket records; reading them back here checks they are complete.
        on_disk = load_read_records(ctx)
        records = [run_bucket(ctx.state, on_disk, lsh, b, self.buckets) for b in range(self.buckets)]
        result = merge_buckets(
            ctx, reads, records, lsh, earlier=d.earlier, explain=d.explain.write if d.explain else None
        )
        d.decider, d.decisions, d.cut = result.decider, result.decisions, result.cut
        for i in range(result.cut + 1):
            d.submit_finish(i, d.decisions[i])


def drive(prep: Prepared, executor: Executor, decide: DecideForm) -> BuildReport:
    """Run ``prep``'s stages on ``executor`` with ``decide`` and commit (the module docstring)."""
    if isinstance(prep.cfg.filters, WarmFilters):
        prep.cfg.filters.warm_up()  # load models once, before forking: the workers share them
    return Driver(prep, executor, decide).run()
