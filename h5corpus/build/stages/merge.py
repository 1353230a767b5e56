"""The merge of the bucketed decide stage: one cheap sequential pass over the tasks in input order.

For each task it gathers, from every bucket (:mod:`~h5corpus.build.stages.buckets`), the positions of its
exact duplicates and its documents' near-duplicate edges, resolves the near duplicates in input order
(:class:`NearResolver`), and hands both to :meth:`Decider.feed <h5corpus.build.stages.decide.Decider.feed>`,
which applies the budgets and counts exactly as the in-memory path does. The state it keeps is one
byte per document read so far (kept or not) and one task's table at a time; the buckets' arrays are
memory-mapped and read in slices.

The result is written to the state folder -- one decision per task (``decide/<task>.json`` and its
``keep`` array) and ``decide/summary.json`` (the split figures and the last task of the corpus) -- so
the finish stage can run anywhere (:func:`load_decision`).

With ``--drop-worst-fraction`` the merge makes two passes: the dedup flags of every task first
(one byte each per document, kept), then the worst-fraction rule over every task's scores
(:func:`~h5corpus.build.stages.decide.worst_masks`) and the decisions, in input order as before.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import BuildError
from .buckets import BucketRecord, LshParams, decide_dir, decide_inputs, load_bucket_arrays, load_npy
from .buildplan import StageContext
from .decide import DecideInput, Decider, task_scores, worst_masks
from .state import ReadRecord, StateDir, TaskDecision, write_state_file

SUMMARY_VERSION = 1
_ROW = np.uint64(0xFFFFFFFF)


class KeptSet:
    """Whether each document of the tasks merged so far was kept: one byte per document."""

    def __init__(self, documents: Sequence[int]) -> None:
        self.offsets = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum(np.asarray(documents, dtype=np.int64), out=self.offsets[1:])
        self.kept = np.zeros(int(self.offsets[-1]), dtype=bool)

    def get(self, pos: np.ndarray) -> np.ndarray:
        task = (pos >> np.uint64(32)).astype(np.int64)
        return self.kept[self.offsets[task] + (pos & _ROW).astype(np.int64)]

    def set_task(self, task: int, kept: np.ndarray) -> None:
        self.kept[self.offsets[task] : self.offsets[task + 1]] = kept


class NearResolver:
    """The near duplicates of each task, in input order, from the buckets' edges: a document is one
    when an earlier member of one of its groups that is similar to it was kept (the in-memory
    index's rule; see :mod:`~h5corpus.build.stages.buckets`)."""

    def __init__(self, state: StateDir, arrays: Sequence[Mapping[str, np.ndarray]], lsh: LshParams, kept: KeptSet):
        self.state, self.arrays, self.lsh, self.kept = state, arrays, lsh, kept
        self.fallbacks = 0
        """Documents checked against a whole group (their listed members were all dropped)."""

    def _slices(self, task: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
        lo, hi = np.uint64(task) << np.uint64(32), np.uint64(task + 1) << np.uint64(32)
        ds, cs, cut = [], [], []
        for b, arr in enumerate(self.arrays):
            i, j = np.searchsorted(arr["d"], [lo, hi])
            ds.append(np.asarray(arr["d"][i:j]))
            cs.append(np.asarray(arr["c"][i:j]))
            i, j = np.searchsorted(arr["trunc_d"], [lo, hi])
            cut += [(int(d & _ROW), b, int(g)) for d, g in zip(arr["trunc_d"][i:j], arr["trunc_g"][i:j])]
        return np.concatenate(ds), np.concatenate(cs), cut

    def task(self, task: int, exact: np.ndarray, sigs: np.ndarray | None) -> np.ndarray:
        """Near-duplicate flags of task ``task``'s rows (``exact``: its exact duplicates)."""
        near = np.zeros(exact.size, dtype=bool)
        d, c, cut = self._slices(task)
        kept_now = ~exact
        if d.size == 0 and not cut:
            self.kept.set_task(task, kept_now)
            return near
        rows = (d & _ROW).astype(np.int64)
        earlier = (c >> np.uint64(32)) < np.uint64(task)
        c_kept = np.zeros(c.size, dtype=bool)
        c_kept[earlier] = self.kept.get(c[earlier])
        c_rows = (c & _ROW).astype(np.int64)
        cut_rows = {r for r, _, _ in cut}
        # Rows whose edges all lead to earlier tasks (and no cut-short list) are decided at once.
        waits = np.zeros(exact.size, dtype=bool)
        waits[rows[~earlier]] = True
        waits[list(cut_rows)] = True
        hit = np.zeros(exact.size, dtype=bool)
        np.logical_or.at(hit, rows, c_kept)
        near[~waits] = hit[~waits]
        kept_now = ~exact & ~near
        by_row: dict[int, list[tuple[int, int]]] = {}
        for r, b, g in cut:
            by_row.setdefault(r, []).append((b, g))
        order = np.argsort(rows, kind="stable")
        rows_s, same_rows_s = rows[order], np.where(earlier[order], -1, c_rows[order])
        for r in np.flatnonzero(waits).tolist():  # in row order: same-task members are decided first
            a, b = np.searchsorted(rows_s, [r, r + 1])
            same = same_rows_s[a:b]
            dup = bool(hit[r]) or bool(kept_now[same[same >= 0]].any())
            if not dup and r in by_row:
                dup = any(self._group_check(task, r, sigs, b, g, kept_now) for b, g in by_row[r])
            near[r] = dup and not exact[r]
            kept_now[r] = not exact[r] and not dup
        self.kept.set_task(task, kept_now)
        return near

    def _group_check(self, task: int, row: int, sigs: np.ndarray | None, b: int, g: int, kept_now: np.ndarray) -> bool:
        """Is an earlier kept member of group ``g`` of bucket ``b`` similar to document ``row``?"""
        self.fallbacks += 1
        arr = self.arrays[b]
        lo, hi = int(arr["group_offsets"][g]), int(arr["group_offsets"][g + 1])
        members = np.asarray(arr["groups"][lo:hi])
        me = (np.uint64(task) << np.uint64(32)) | np.uint64(row)
        pred = members[members < me]
        same = (pred >> np.uint64(32)) == np.uint64(task)
        k = np.zeros(pred.size, dtype=bool)
        k[~same] = self.kept.get(pred[~same])
        k[same] = kept_now[(pred[same] & _ROW).astype(np.int64)]
        cand = pred[k]
        if cand.size == 0 or not self.lsh.verify:
            return bool(cand.size)
        assert sigs is not None
        mine = sigs[row]
        for p in cand.tolist():
            t, r = p >> 32, p & 0xFFFFFFFF
            other = sigs[r] if t == task else load_npy(self.state.read_paths(t).signatures)[r]
            if float(np.count_nonzero(other == mine)) / mine.size >= self.lsh.threshold:
                return True
        return False


# -- the stage ------------------------------------------------------------------------------------
@dataclass
class MergeResult:
    decider: Decider
    """Its ``splits`` are the manifest's per-split figures once :meth:`Decider.finish` ran."""
    decisions: dict[int, TaskDecision]
    cut: int
    """Last task of the corpus."""
    fallbacks: int = 0


def _decision_paths(state: StateDir, index: int) -> tuple[Path, Path]:
    stem = decide_dir(state) / f"{index:05d}"
    return stem.with_suffix(".json"), stem.with_suffix(".keep.npy")


def write_decision(state: StateDir, decision: TaskDecision) -> None:
    meta, keep = _decision_paths(state, decision.index)
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(decision.keep, dtype=np.uint8), allow_pickle=False)
    write_state_file(keep, buf.getvalue())
    write_state_file(meta, json.dumps(decision.to_json(), sort_keys=True).encode())


def load_decision(state: StateDir, index: int) -> TaskDecision | None:
    """Task ``index``'s persisted decision (its keep array checked against its sha256), or None."""
    meta, keep = _decision_paths(state, index)
    try:
        return TaskDecision.from_json(json.loads(meta.read_text()), np.load(keep, allow_pickle=False))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def summary_path(state: StateDir) -> Path:
    return decide_dir(state) / "summary.json"


def load_summary(state: StateDir, inputs: str) -> dict[str, Any] | None:
    """The merge's summary when it was computed from ``inputs`` (:func:`merge_inputs`), else None."""
    try:
        s = json.loads(summary_path(state).read_text())
    except (OSError, ValueError):
        return None
    return s if isinstance(s, dict) and s.get("version") == SUMMARY_VERSION and s.get("inputs") == inputs else None


def merge_inputs(reads: Sequence[ReadRecord], lsh: LshParams | None, buckets: Sequence[BucketRecord]) -> str:
    """sha256 over the read records' data and the buckets' files: what the merge's result depends on."""
    what: dict[str, Any] = {"reads": decide_inputs(reads, lsh, len(buckets)), "buckets": [b.files for b in buckets]}
    if any(r.meta_sha256 for r in reads):  # the scores of the worst-fraction rule live there
        what["meta"] = [r.meta_sha256 for r in reads]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _write_summary(
    state: StateDir, inputs: str, cut: int, splits: dict[str, Any], decisions: Mapping[int, TaskDecision]
) -> None:
    summary = {
        "version": SUMMARY_VERSION,
        "inputs": inputs,
        "cut": cut,
        "splits": splits,
        "decisions": {str(i): d.sha256 for i, d in decisions.items()},
    }
    write_state_file(summary_path(state), json.dumps(summary, sort_keys=True).encode(), durable=True)


def merge_buckets(
    ctx: StageContext,
    reads: Sequence[ReadRecord],
    buckets: Sequence[BucketRecord],
    lsh: LshParams | None,
    *,
    earlier: set[int] | frozenset[int] = frozenset(),
    explain: Callable[[list[dict[str, Any]]], None] | None = None,
) -> MergeResult:
    """Decide every task from the buckets' results (input order; stops after the task that fills
    the budgets), write the decisions and the summary; ``earlier``: tasks whose candidates come
    from an interrupted run (the finish stage re-hashes them)."""
    plan, state = ctx.plan, ctx.state
    decider = Decider(
        budgets=plan.run["settings"]["max_tokens"],
        validation_fraction=plan.split.validation_fraction,
        count_languages=plan.record_lang,
        explain=plan.explain,
        drop_worst_fraction=plan.drop_worst_fraction,
    )
    arrays = [load_bucket_arrays(state, b) for b in buckets]
    kept = KeptSet([r.documents for r in reads])
    resolver = NearResolver(state, arrays, lsh, kept) if lsh is not None else None
    decisions: dict[int, TaskDecision] = {}
    cut = len(reads) - 1

    def dedup(rec: ReadRecord) -> tuple[DecideInput, np.ndarray, np.ndarray]:
        if plan.on_error == "fail" and rec.skipped_total:
            raise BuildError(
                f"{rec.skipped_records[0]} (recorded by an earlier run with --on-error skip; "
                "pass --on-error skip, or fix the input)"
            )
        inp = DecideInput(rec, *state.load_read_outputs(rec))
        exact = np.zeros(inp.docs.size, dtype=bool)
        lo, hi = np.uint64(rec.index) << np.uint64(32), np.uint64(rec.index + 1) << np.uint64(32)
        for arr in arrays:
            i, j = np.searchsorted(arr["exact"], [lo, hi])
            exact[(np.asarray(arr["exact"][i:j]) & _ROW).astype(np.int64)] = True
        if resolver is not None:
            near = resolver.task(rec.index, exact, inp.signatures)
        else:
            near = np.zeros(inp.docs.size, dtype=bool)
        return inp, exact, near

    worst: list[np.ndarray] | None = None
    flags: list[tuple[np.ndarray, np.ndarray]] = []
    if plan.drop_worst_fraction is not None:  # first pass: every task's dedup flags and scores
        scores = []
        for rec in reads:
            inp, e, n = dedup(rec)
            flags.append((e, n))
            scores.append(task_scores(inp))
        worst = worst_masks(scores, [~e & ~n for e, n in flags], plan.drop_worst_fraction)
    for k, rec in enumerate(reads):
        if worst is not None:
            inp = DecideInput(rec, *state.load_read_outputs(rec))
            exact, near = flags[k]
        else:
            inp, exact, near = dedup(rec)
        decision, lines = decider.feed(
            inp,
            verify_candidates=rec.index in earlier,
            exact=exact,
            near=near,
            worst=None if worst is None else worst[k],
        )
        write_decision(state, decision)
        decisions[rec.index] = decision
        if explain is not None:
            explain(lines)
        if decider.can_stop_early and decider.filled:
            cut = rec.index
            break
    _write_summary(state, merge_inputs(reads, lsh, buckets), cut, decider.finish(), decisions)
    return MergeResult(decider, decisions, cut, resolver.fallbacks if resolver is not None else 0)
