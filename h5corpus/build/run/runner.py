"""``h5corpus build``: raw text -> tokenized shards + manifest, in parallel, deterministically,
resumably. See ``docs/BUILD.md``.

:func:`build_corpus` is the driver. It resolves the sources and the tokenizer, takes the lock,
checks what the output folders already hold, plans the *tasks* (:func:`~h5corpus.build.input.sources.plan_tasks`)
and persists the plan (:mod:`~h5corpus.build.stages.buildplan`), then runs the stages:

1. **read** (:func:`~h5corpus.build.stages.tasks.read_task`, parallel, one call per task) on an executor;
2. **decide** (:class:`~h5corpus.build.stages.decide.Decider`, here, in input order, as far as the read
   tasks allow): exact and near dedup across tasks, budgets; reading stops at the task where every
   budget is filled;
3. **finish** (:func:`~h5corpus.build.stages.tasks.finish_task`, parallel) as soon as a task is decided;
4. **commit** (:func:`~h5corpus.build.stages.commit.commit`): the manifest, last and atomically.

Every output byte is a function of the inputs and the settings, never of the worker count or
timing, so any worker count gives identical files, and a build killed at any moment (``kill -9``)
finishes on re-run with the same bytes: completed stages are reused after their hashes are
checked, everything else is redone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...storage.format import TokenizerIdentity
from ...storage.manifest import read_manifest
from ..config import (
    DEFAULT_SHARD_TOKENS,
    BuildConfig,
    BuildConflict,
    BuildError,
    SplitRule,
    filters_detect_language,
    filters_score_perplexity,
)
from ..input.records import newlines_before, sample_texts
from ..input.sources import Task, plan_tasks, resolve_sources
from ..oserrors import BuildOSError, as_build_os_error, check_output_kinds, check_writable, os_step
from ..report import BuildReport, check_build_sections, report_from_manifest
from ..stages.buildplan import BuildPlan, StageContext, filters_spec, read_plan_run
from ..stages.commit import add_up, commit
from ..stages.decide import DecideInput, Decider, task_scores, worst_masks
from ..stages.explain import ExplainFile
from ..stages.shards import our_shard_files
from ..stages.state import FinishRecord, ReadRecord, StateDir, TaskDecision
from ..stages.tasks import StageCall
from ..tokenize.encoders import Encoder, HFEncoder, fast_encoder
from ..tokenize.proof import prove_fast_path
from ..tokenize.tokenizer import Tokenizer, library_versions, load_tokenizer, source_sha256
from .executor import BuildLock, LocalExecutor

__all__ = ["DEFAULT_SHARD_TOKENS", "build_corpus"]

#: Text the build samples from its own input (the first documents of each task, in input order)
#: to prove a fast encoder equal to ``tokenizers``: at most this many characters in all ...
PROOF_SAMPLE_CHARS = 64 << 10
#: ... and at most this many from one task, so the sample spans the inputs.
PROOF_SAMPLE_TASK_CHARS = 8 << 10


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _tokenizer_conflict(path: Path, have: TokenizerIdentity, want: TokenizerIdentity) -> BuildConflict:
    return BuildConflict(
        f"{path} was built with tokenizer {have.name!r} (revision {have.revision}, sha256 {have.sha256[:12]}, "
        f"vocab {have.vocab_size:,}, eos {have.eos_id}); this build uses {want.name!r} (revision {want.revision}, "
        f"sha256 {want.sha256[:12]}, vocab {want.vocab_size:,}, eos {want.eos_id}). Token ids would not be "
        "comparable: choose another --manifest/--shards-dir, or pass --overwrite to replace it"
    )


def _diff_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:6]) or "inputs"


@dataclasses.dataclass(frozen=True)
class _Target:
    """What one build is and where it goes."""

    cfg: BuildConfig
    tok: Tokenizer
    shards_dir: Path
    manifest_path: Path
    state: StateDir
    settings: dict[str, Any]
    sources: dict[str, Any]
    """The inputs' description (the manifest's ``source``)."""
    run_id: dict[str, Any]
    fingerprint: str
    fast_loading: _Background | None = None
    """The fast encoder being loaded (:func:`~h5corpus.build.tokenize.encoders.fast_encoder` on a thread)."""


def build_corpus(config: BuildConfig) -> BuildReport:
    """Build (or resume, or confirm up to date) the corpus ``config`` describes.

    Raises ValueError (bad settings, an output path of the wrong kind),
    :class:`~h5corpus.build.tokenize.tokenizer.TokenizerError` / :class:`~h5corpus.build.input.sources.SourceError`
    (spec cannot be resolved), :class:`BuildConflict` (a live run marker, output built otherwise),
    :class:`BuildError` (bad input under ``on_error="fail"``) and
    :class:`~h5corpus.build.oserrors.BuildOSError` (the OS refused a write: disk full, read-only or
    unwritable output, I/O error). After the last two, completed work is kept, so fixing the cause
    and re-running resumes. On output that cannot be written, a build that is up to date still
    reports so (and writes nothing); anything else raises BuildOSError before any work.
    """
    t_start = time.perf_counter()
    cfg = config
    cfg.check()
    shards_dir = Path(cfg.shards_dir).absolute()
    manifest_path = Path(cfg.manifest).absolute()
    check_output_kinds(shards_dir, manifest_path, None if cfg.explain_drops is None else Path(cfg.explain_drops))
    tok = load_tokenizer(cfg.tokenizer, eos_token=cfg.eos_token, cache_dir=cfg.hf_cache_dir)
    # fastokens builds its tables without holding the GIL (about 0.5 s for GPT-2, docs/BUILD.md):
    # the fast encoder loads on a thread from here on, while this one resolves the sources, plans
    # the tasks and reads the proof's sample; it is taken (the thread joined) before a worker forks.
    loading = _Background(fast_encoder, tok, cfg.fast_encoders) if cfg.fast_path else None
    inputs = resolve_sources(list(cfg.sources), hf_cache_dir=cfg.hf_cache_dir, text_field=cfg.text_field)
    settings = cfg.settings()
    sources = {"inputs": [i.describe() for i in inputs]}
    run_id = {"settings": settings, "tokenizer": tok.identity.to_json(), "sources": [i.spec for i in inputs]}
    target = _Target(
        cfg=cfg,
        tok=tok,
        shards_dir=shards_dir,
        manifest_path=manifest_path,
        state=StateDir.of(shards_dir),
        settings=settings,
        sources=sources,
        run_id=run_id,
        fingerprint=hashlib.sha256(_canonical({"run": run_id, "sources": sources})).hexdigest(),
        fast_loading=loading,
    )
    try:
        with BuildLock(shards_dir, manifest_path) as lock:
            if not lock.writable:
                assert lock.refusal is not None
                return _read_only(target, lock.refusal, t_start)
            return _build(target, inputs, lock, t_start)
    except (OSError, RuntimeError) as e:  # a failed call no step above named: say what is known
        raise as_build_os_error(e, "build into", shards_dir) or e from None


def _build(target: _Target, inputs: list[Any], lock: BuildLock, t_start: float) -> BuildReport:
    """The build proper, under its locks, on writable output."""
    cfg, shards_dir = target.cfg, target.shards_dir
    if cfg.explain_drops is not None:
        check_writable("write the drop list", Path(cfg.explain_drops))
    if cfg.overwrite:
        with os_step("delete", target.manifest_path):
            target.manifest_path.unlink(missing_ok=True)
        target.state.remove()
        for p in our_shard_files(shards_dir):
            with os_step("delete", p):
                p.unlink(missing_ok=True)
    resumed = _resumable(target)
    if not resumed:
        done = _check_fresh_output(target, t_start)
        if done is not None:
            return done
        shutil.rmtree(target.state.root, ignore_errors=True)  # a state folder without its plan cannot be trusted
    with os_step("create the state folder", target.state.root):
        target.state.create()
    tasks = plan_tasks(inputs, task_bytes=int(cfg.task_bytes))
    from .scaled import make_run  # the executor and the decide stage's form (it imports _Run)

    return make_run(target, tasks, resumed, lock, t_start).run()


def _read_only(target: _Target, refused: BuildOSError, t_start: float) -> BuildReport:
    """On output that cannot be written: the report of an up-to-date build, written nowhere; else
    ``refused`` (or the conflict that a writable build would have met)."""
    if target.cfg.overwrite:
        raise refused
    if _resumable(target):
        raise BuildOSError(
            refused.op,
            refused.filename,
            refused.errno,
            refused.strerror,
            f"; {target.state.root} holds an interrupted build that can only be finished there",
        )
    done = _check_fresh_output(target, t_start)
    if done is None:
        raise refused
    return done


def _resumable(t: _Target) -> bool:
    """True when the state folder holds an interrupted build of this run; raises
    :class:`BuildConflict` when it holds one with other settings or another tokenizer."""
    if not (t.state.root.is_dir() and t.state.plan.exists()):
        return False
    old = read_plan_run(t.state) or {}
    if old != t.run_id:
        if old.get("tokenizer") and not TokenizerIdentity.from_json(old["tokenizer"]).same_ids(t.tok.identity):
            raise _tokenizer_conflict(t.state.root, TokenizerIdentity.from_json(old["tokenizer"]), t.tok.identity)
        srcs = t.run_id["sources"]
        raise BuildConflict(
            f"{t.state.root} holds an interrupted build with other settings ({_diff_keys(old.get('settings') or {}, t.settings)}"
            f"{'; sources ' + repr(old.get('sources')) if old.get('sources') != srcs else ''}); "
            "re-run that build to finish it, or pass --overwrite to start over"
        )
    return True


def _check_fresh_output(t: _Target, t_start: float) -> BuildReport | None:
    """Before a fresh build: the report of an up-to-date manifest (nothing to do), or None; raises
    :class:`BuildConflict` for an output built otherwise or stray shard files. Writes nothing."""
    cfg, manifest_path = t.cfg, t.manifest_path
    if manifest_path.exists():
        m = read_manifest(manifest_path)
        if not m.tokenizer.same_ids(t.tok.identity):
            raise _tokenizer_conflict(manifest_path, m.tokenizer, t.tok.identity)
        b = check_build_sections(m)
        if b.get("fingerprint") != t.fingerprint:
            raise BuildConflict(
                f"{manifest_path} exists and was built from other inputs or settings "
                f"({_diff_keys(b.get('settings') or {}, t.settings)}); pass --overwrite to replace it, "
                "or choose another --manifest/--shards-dir"
            )
        gone = [e.path for e in m.shards if not m.shard_path(e).is_file() or m.shard_path(e).stat().st_size != e.bytes]
        if gone:
            raise BuildConflict(
                f"{manifest_path} describes this build, but {len(gone)} of its shards are missing or "
                f"changed ({gone[0]}, ...); pass --overwrite to rebuild"
            )
        if cfg.explain_drops is not None:
            raise BuildConflict(
                f"{manifest_path} is already built and up to date; the drop list is written while the "
                "documents are read: pass --overwrite to rebuild with --explain-drops"
            )
        return report_from_manifest(m, str(t.shards_dir), time.perf_counter() - t_start)
    stray = our_shard_files(t.shards_dir)
    if stray:
        raise BuildConflict(
            f"{t.shards_dir} already holds {len(stray)} shard files ({stray[0].name}, ...) that no manifest or "
            "interrupted build here accounts for; pass --overwrite to delete them, or choose another --shards-dir"
        )
    return None


class _Run:
    """One run of the stages: the read records, decisions and finish records so far, the work
    in flight, and the event loop that moves tasks from one stage to the next."""

    def __init__(
        self, target: _Target, tasks: list[Task], resumed: bool, lock_fds: Sequence[int], t_start: float
    ) -> None:
        cfg = target.cfg
        self.t, self.cfg, self.tasks, self.t_start = target, cfg, tasks, t_start
        self.n = len(tasks)
        self.workers = min(max(1, int(cfg.workers or os.cpu_count() or 1)), max(self.n, 1))
        # Encoder: a fast one if the tokenizer allows it, proven on a sample below before any of its
        # output is used. Records made by another encoder than the final one are redone.
        self.encoder: Encoder = HFEncoder(target.tok)
        self.fast: Encoder | None = None
        self.note = ""
        self._loading = target.fast_loading  # taken in run(), once the proof's sample is read
        self.sample: list[str] | None = None
        self.read: dict[int, ReadRecord] = {}
        for t in tasks:
            rec = target.state.load_read_record(t.index, t.key)
            if rec is not None:
                self.read[t.index] = rec
        self.earlier = set(self.read)
        """Tasks whose read record comes from an interrupted run (candidates re-hashed before use)."""
        f = cfg.filters
        self.decider = Decider(
            budgets=cfg.max_tokens,
            validation_fraction=float(cfg.validation_fraction),
            near_index=f.near_duplicate_index() if callable(getattr(f, "near_duplicate_index", None)) else None,
            count_languages=filters_detect_language(f),
            explain=cfg.explain_drops is not None,
            drop_worst_fraction=cfg.drop_worst_fraction,
        )
        self.decisions: dict[int, TaskDecision] = {}
        self.finishes: dict[int, FinishRecord] = {}
        self.read_pending: set[int] = set()
        self.finish_pending: set[int] = set()
        self.reread: set[int] = set()
        """Tasks whose candidates were gone at finish: read again, then finished."""
        self.next_decide = 0
        self.cut: int | None = None
        """Last task that is part of the corpus (known once budgets are filled or all are decided)."""
        self.executor = LocalExecutor(self.workers, lock_fds=lock_fds, count_progress=cfg.progress)
        self.events = self.executor.driver_events()
        self.report = BuildReport(
            manifest=str(target.manifest_path),
            shards_dir=str(target.shards_dir),
            tokenizer=target.tok.identity.to_json(),
            splits={},
            tasks=self.n,
            resumed=resumed,
        )

    def _take_fast_encoder(self) -> None:
        """Wait for the fast encoder's load (once) and make it the build's encoder if it applies."""
        loading, self._loading = self._loading, None
        if loading is None:
            return
        self.fast, why = loading.result()
        if self.fast is None:
            self.note = f"fast path not applicable: {why}"
        else:
            self.encoder = self.fast
            self.note = f"not applicable: {why}" if why else ""

    def _proof_sample(self) -> list[str]:
        """The proof's sample of the build's input (read once), with the proof key's other parts."""
        if self.sample is None:
            self.sample = sample_texts(
                self.tasks,
                self.cfg.text_field,
                PROOF_SAMPLE_CHARS,
                PROOF_SAMPLE_TASK_CHARS,
                int(self.cfg.max_record_bytes),
            )
            library_versions(), source_sha256()  # computed once per process; the proof's cache key
        return self.sample

    def _plan(self, encoder: Encoder) -> BuildPlan:
        cfg, t = self.cfg, self.t
        explain = cfg.explain_drops is not None
        return BuildPlan(
            run=t.run_id,
            fingerprint=t.fingerprint,
            shards_dir=str(t.shards_dir),
            tokenizer=t.tok.identity,
            encoder=encoder.name,
            tasks=tuple(self.tasks),
            text_field=cfg.text_field,
            split=SplitRule(int(cfg.split_seed), float(cfg.validation_fraction)),
            on_error=cfg.on_error,
            max_record_bytes=int(cfg.max_record_bytes),
            chunk_tokens=int(cfg.chunk_tokens),
            shard_tokens=int(cfg.shard_tokens),
            max_document_tokens=None if cfg.max_document_tokens is None else int(cfg.max_document_tokens),
            filters=filters_spec(cfg.filters),
            want_signatures=self.decider.index is not None and callable(getattr(cfg.filters, "signature", None)),
            record_lang=self.decider.languages,
            explain=explain,
            newlines_before=newlines_before(self.tasks) if explain else {},
            record_perplexity=filters_score_perplexity(cfg.filters),
            drop_worst_fraction=cfg.drop_worst_fraction,
            perplexity_scores=None if cfg.perplexity_scores is None else str(Path(cfg.perplexity_scores).absolute()),
        )

    def _start(self, encoder: Encoder, plan: BuildPlan | None = None) -> None:
        """Persist the plan for ``encoder`` and start the executor's workers with its context."""
        self.encoder = encoder
        self.plan = plan or self._plan(encoder)
        with os_step("write the build plan", self.t.state.plan):
            self.plan.write(self.t.state, self.t.tok.json_text)
        self.ctx = StageContext(
            plan=self.plan, state=self.t.state, encoder=encoder, filters=self.cfg.filters, events=self.events
        )
        self.executor.start(self.ctx)

    def run(self) -> BuildReport:
        cfg = self.cfg
        warm_up = getattr(cfg.filters, "warm_up", None)
        if callable(warm_up):
            warm_up()  # load models once, before forking: the workers share them
        self.bar = _progress_bar() if cfg.progress else None
        self.explain = ExplainFile(cfg.explain_drops) if cfg.explain_drops is not None else None
        if self._loading is not None:
            self._proof_sample()  # while the fast encoder loads
        self._take_fast_encoder()
        self._start(self.encoder)
        try:
            in_order = self.decider.can_stop_early
            order = [t.index for t in self.tasks]
            if not in_order:
                order.sort(key=lambda i: (-self.tasks[i].nbytes, i))  # longest first balances the workers
            self.order = order
            self.window = self.workers + 1 if in_order else self.n
            self.to_read = [i for i in order if i not in self.read]
            self._submit_reads()
            self._prove_fast_path()
            self._drop_unusable()
            self._submit_reads()
            self.report.encoder, self.report.encoder_note = self.encoder.name, self.note
            self.report.tasks_reused = len(self.read)
            self._loop()
            self.executor.shutdown(wait=not self.read_pending)  # joined once the manifest is written
        except BaseException:
            self.executor.cancel()
            if self.bar is not None:
                self.bar.close()
            if self.explain is not None:
                self.explain.discard()
            raise
        if self.bar is not None:
            self.bar.close()
        return self._commit()

    def _submit_reads(self) -> None:
        while self.to_read and len(self.read_pending) < self.window and self.cut is None:
            i = self.to_read.pop(0)
            self.read_pending.add(i)
            self.executor.submit(StageCall("read", i))

    def _prove_fast_path(self) -> None:
        """Prove the fast encoder on the build's own input while the workers read; on a difference,
        drop what it made and restart the stages on ``tokenizers``."""
        fast = self.fast
        if fast is None or self.encoder is not fast:
            return
        chosen, note = prove_fast_path(HFEncoder(self.t.tok), fast, self._proof_sample(), names=self.cfg.fast_encoders)
        if chosen is fast:
            return
        self.note = "; ".join(filter(None, (self.note, note)))
        self.executor.cancel()
        for i in [i for i, r in self.read.items() if not self._usable(r, chosen)]:
            del self.read[i]
        self.to_read = [i for i in self.order if i not in self.read]
        self.read_pending.clear()
        self._start(chosen, dataclasses.replace(self.plan, encoder=chosen.name))
        self._submit_reads()

    def _usable(self, rec: ReadRecord, encoder: Encoder) -> bool:
        # A record from an interrupted run without --explain-drops lacks the locations: read again.
        return rec.encoder in ("tokenizers", encoder.name) and (rec.explain or self.cfg.explain_drops is None)

    def _drop_unusable(self) -> None:
        for i in [i for i, r in self.read.items() if not self._usable(r, self.encoder)]:
            del self.read[i]
            self.earlier.discard(i)
            if i not in self.read_pending and i not in self.to_read:
                self.to_read.append(i)

    def _loop(self) -> None:
        """Decide in input order as far as the read records allow, finish what is decided, until
        every task of the corpus is finished."""
        while True:
            self._decide_ready()
            if self.cut is None and self.next_decide == self.n:
                self.cut = self.n - 1
            if self.cut is not None and not self.finish_pending and not self.reread:
                return
            self._submit_reads()
            res = self.executor.next_result(timeout=0.1)
            self._update_bar()
            if res is None:
                continue
            if res.error is not None:
                raise self._stage_error(res.call, res.error)
            if res.call.stage == "read":
                self._on_read(res.call.index, res.value)
            else:
                self._on_finish(res.call.index, res.value)

    def _decide_input(self, i: int) -> DecideInput:
        rec = self.read[i]
        if self.cfg.on_error == "fail" and rec.skipped_total:
            raise BuildError(
                f"{rec.skipped_records[0]} (recorded by an earlier run with --on-error skip; "
                "pass --on-error skip, or fix the input)"
            )
        return DecideInput(rec, *self.t.state.load_read_outputs(rec))

    def _worst_pass(self) -> dict[int, tuple[np.ndarray, ...]] | None:
        """The worst-fraction rule's first pass, once every task is read: each task's (exact, near,
        worst) rows. None while tasks are still being read."""
        if len(self.read) < self.n or self.read_pending:
            return None
        flags, scores = [], []
        for i in range(self.n):
            inp = self._decide_input(i)
            flags.append(self.decider.dedup(inp))
            scores.append(task_scores(inp))
        assert self.decider.drop_worst_fraction is not None
        worst = worst_masks(scores, [~e & ~n for e, n in flags], self.decider.drop_worst_fraction)
        return {i: (*flags[i], worst[i]) for i in range(self.n)}

    def _stage_error(self, call: StageCall, error: BaseException) -> BaseException:
        """A stage's exception, as :class:`BuildOSError` naming the stage and task when the OS refused something."""
        context = f" ({call.stage} stage of task {call.index}: {self.tasks[call.index].label})"
        return as_build_os_error(error, "write into", self.t.shards_dir, context) or error

    def _decide_ready(self) -> None:
        rows: dict[int, tuple[np.ndarray, ...]] | None = None
        if self.decider.drop_worst_fraction is not None and self.next_decide < self.n:
            rows = self._worst_pass()
            if rows is None:
                return
        while self.cut is None and self.next_decide < self.n and self.next_decide in self.read:
            i = self.next_decide
            inp = self._decide_input(i)
            exact, near, worst = rows[i] if rows is not None else (None, None, None)
            decision, lines = self.decider.feed(
                inp, verify_candidates=i in self.earlier, exact=exact, near=near, worst=worst
            )
            self.decisions[i] = decision
            if self.explain is not None:
                with os_step("write the drop list", self.explain.path):
                    self.explain.write(lines)
            self.finish_pending.add(i)
            self.executor.submit(StageCall("finish", i, decision))
            self.events.step("decided")
            self.next_decide += 1
            if self.decider.can_stop_early and self.decider.filled:
                self.cut = i

    def _on_read(self, i: int, rec: ReadRecord) -> None:
        self.read_pending.discard(i)
        self.report.tokens_encoded += rec.tokens
        if self.cut is not None and i > self.cut:
            return  # read past the budgets: not part of the corpus
        self.read[i] = rec
        self.earlier.discard(i)
        if i in self.reread:
            self.reread.discard(i)
            self.finish_pending.add(i)
            decision = dataclasses.replace(self.decisions[i], candidates=rec.candidates, verify_candidates=False)
            self.executor.submit(StageCall("finish", i, decision))

    def _on_finish(self, i: int, rec: FinishRecord | None) -> None:
        self.finish_pending.discard(i)
        if rec is None:  # the candidates were gone or damaged: read the task again
            self.reread.add(i)
            self.executor.submit(StageCall("read", i))
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
        r.elapsed_s = time.perf_counter() - self.t_start
        return r


class _Background:
    """``fn(*args)`` on a thread of its own, started now; :meth:`result` joins it and returns (or
    raises) what it gave."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._out: tuple[bool, Any] = (False, None)

        def call() -> None:
            try:
                self._out = (True, fn(*args))
            except BaseException as e:  # noqa: BLE001 - re-raised by result(), in the caller's thread
                self._out = (False, e)

        self._thread = threading.Thread(target=call, name=f"h5corpus-{getattr(fn, '__name__', 'load')}", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        ok, value = self._out
        if not ok:
            raise value
        return value


def _progress_bar():
    from tqdm import tqdm

    return tqdm(
        total=None, unit="tok", unit_scale=True, desc="build", file=sys.stderr, dynamic_ncols=True, mininterval=0.25
    )
