"""The decide stage: which documents the corpus stores, as a fold over the read tasks in input order.

For each task, in input order: exact dedup across tasks (the first occurrence wins), then the
near-duplicate index (fed the signatures of the exact-dedup survivors), then ``--max-tokens``
budgets (whole documents in input order until a split's budget is filled; the last one is kept
whole). The result per task is a :class:`~h5corpus.build.stages.state.TaskDecision`.

With ``--drop-worst-fraction F`` (:class:`WorstRule`) a rule sits between dedup and the budgets:
of the documents that survive the read stage's filters and both dedup stages, the
``floor(F * n + 1/2)`` with the highest perplexity are dropped (reason ``perplexity_worst``), ties
broken by input position (the later document goes first). It needs every document's score before
deciding any, so the decide then runs in two passes over all tasks (:func:`worst_masks`): dedup
flags and scores first, then the decisions; reading never stops early.

:class:`Decider` is the fold itself, usable incrementally (the local driver feeds each task as soon
as it and all earlier ones are read, so finishing overlaps reading) or over every task at once
(:func:`decide`); both give the same decisions. Its state is the ids kept so far (32 bytes each),
the near-duplicate index and the budgets used. With the worst-fraction rule the driver waits for
every read, then runs :meth:`Decider.dedup` over all tasks and :meth:`Decider.feed` with the
flags it found (what :func:`decide` does).

That in-memory fold is the fast path of one machine. The bucketed decide stage
(:mod:`~h5corpus.build.stages.buckets`) finds the same exact and near duplicates in buckets that run as
separate tasks (by id prefix and by LSH band key), and its merge feeds them to :meth:`Decider.feed`
(``exact=``, ``near=``), which then only applies the budgets and counts: the same decisions, with
memory bounded per bucket instead of per build.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...filters.perplexity import worst_fraction
from ...storage import format as fmt
from ..report import empty_split
from .buildplan import BuildPlan
from .explain import explain_line
from .state import ReadRecord, TaskDecision


class SeenIds:
    """Set of 32-byte document ids as sorted numpy runs (32 bytes per id; merged like an LSM tree)."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def contains(self, keys: np.ndarray) -> np.ndarray:
        hit = np.zeros(keys.size, dtype=bool)
        for run in self.runs:
            i = np.searchsorted(run, keys)
            i[i == run.size] = 0
            hit |= run[i] == keys
        return hit

    def add(self, keys: np.ndarray) -> None:
        """Add ``keys`` (distinct, none already present)."""
        if keys.size == 0:
            return
        self.runs.append(np.sort(keys))
        while len(self.runs) > 1 and self.runs[-2].size <= 2 * self.runs[-1].size:
            b = self.runs.pop()
            a = self.runs.pop()
            self.runs.append(np.sort(np.concatenate([a, b])))


@dataclass(frozen=True)
class DecideInput:
    """One read task as the decide stage sees it (:meth:`~h5corpus.build.stages.state.StateDir.load_read_outputs`)."""

    record: ReadRecord
    docs: np.ndarray
    """The task's table (``DOC_DTYPE`` rows)."""
    signatures: np.ndarray | None
    """(documents, k) near-dedup signatures, when computed."""
    meta: Mapping[str, Any] | None
    """``lang`` per row and ``explain`` data, when recorded."""


#: Quantiles of the recorded perplexities in the manifest (``splits.<split>.perplexity``).
SCORE_QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.8, 0.9, 0.95, 0.99, 1.0)
#: Histogram bins of the recorded perplexities: 20 per decade from 1 (bin ``i`` holds
#: ``10**(i/20) <= score < 10**((i+1)/20)``), the same for every build so histograms compare.
SCORE_BINS_PER_DECADE = 20


def row_scores(meta: Mapping[str, Any] | None, rows: int, where: str) -> np.ndarray | None:
    """The perplexity of each table row as the read stage recorded it (float64), or None when it
    recorded none. ValueError naming the task when the list does not fit the table."""
    got = (meta or {}).get("perplexity")
    if got is None:
        return None
    scores = np.asarray(got, dtype=np.float64)
    if scores.shape != (rows,) or np.isnan(scores).any():
        raise ValueError(f"{where}: the read stage recorded {scores.size} perplexities for {rows} documents")
    return scores


def worst_masks(scores: list[np.ndarray], reach: list[np.ndarray], fraction: float) -> list[np.ndarray]:
    """Per task, which rows the worst-fraction rule drops: of the rows that ``reach`` it (every
    task's, in input order), the ``floor(fraction * n + 1/2)`` with the highest score; among equal
    scores the later document in input order (task, then row) goes first."""
    flat = np.concatenate([s[r] for s, r in zip(scores, reach)]) if scores else np.zeros(0)
    drop = worst_fraction(flat, fraction)
    out, at = [], 0
    for r in reach:
        m = np.zeros(r.size, dtype=bool)
        n = int(r.sum())
        m[r] = drop[at : at + n]
        at += n
        out.append(m)
    return out


def score_summary(scores: np.ndarray) -> dict[str, Any]:
    """The distribution of ``scores`` (perplexities, >= 1): count, quantiles, and the histogram's
    non-empty bins (:data:`SCORE_BINS_PER_DECADE`) as ``{bin index: documents}``."""
    out: dict[str, Any] = {"documents": int(scores.size)}
    if scores.size:
        q = np.quantile(scores, SCORE_QUANTILES)
        out["quantiles"] = {f"p{round(p * 100):g}": round(float(v), 4) for p, v in zip(SCORE_QUANTILES, q)}
        idx = np.floor(np.log10(np.maximum(scores, 1.0)) * SCORE_BINS_PER_DECADE).astype(np.int64)
        bins, counts = np.unique(idx, return_counts=True)
        out["histogram"] = {
            "bins_per_decade": SCORE_BINS_PER_DECADE,
            "counts": {str(b): int(c) for b, c in zip(bins.tolist(), counts.tolist())},
        }
    return out


class Decider:
    """Global decisions in input order: exact dedup, near dedup, the worst-fraction rule, budgets.
    Deterministic."""

    def __init__(
        self,
        *,
        budgets: Mapping[str, int] | None,
        validation_fraction: float,
        near_index: Any = None,
        count_languages: bool = False,
        explain: bool = False,
        drop_worst_fraction: float | None = None,
    ) -> None:
        self.seen = SeenIds()
        self.index = near_index
        """The filters' near-duplicate index, or None (near-dedup off)."""
        b = budgets or {}
        self.budget = [b.get(s) for s in fmt.SPLITS]
        self.used = [0, 0]
        frac = float(validation_fraction)
        # A split that can receive no document needs nothing; reading stops only when every
        # split that can receive documents has a budget and it is filled.
        self.needs = [frac < 1.0, frac > 0.0]
        self.splits = {s: empty_split() for s in fmt.SPLITS}
        self.languages = count_languages
        """Count stored documents per detected language (``splits.<split>.languages``)."""
        if self.languages:
            for st in self.splits.values():
                st["languages"] = {}
        self.explain = explain
        self.drop_worst_fraction = drop_worst_fraction
        """``--drop-worst-fraction``: the caller passes each task's ``worst`` mask to :meth:`feed`."""
        self.scores: list[list[np.ndarray]] = [[], []]
        """Per split, the perplexities of the documents that reached the worst-fraction rule."""

    @classmethod
    def for_plan(cls, plan: BuildPlan, filters: Any) -> Decider:
        """The decider of the build ``plan`` describes (``filters``: its filters object, or None)."""
        make_index = getattr(filters, "near_duplicate_index", None) if filters is not None else None
        return cls(
            budgets=plan.run["settings"]["max_tokens"],
            validation_fraction=plan.split.validation_fraction,
            near_index=make_index() if callable(make_index) else None,
            count_languages=plan.record_lang,
            explain=plan.explain,
            drop_worst_fraction=plan.drop_worst_fraction,
        )

    @property
    def can_stop_early(self) -> bool:
        """Every split that can receive documents has a budget (so reading may stop before the end),
        and no rule needs every document's score."""
        if self.drop_worst_fraction is not None:
            return False
        return all((not need) or b is not None for b, need in zip(self.budget, self.needs))

    @property
    def filled(self) -> bool:
        return all((not need) or (b is not None and u >= b) for b, u, need in zip(self.budget, self.used, self.needs))

    def dedup(self, inp: DecideInput) -> tuple[np.ndarray, np.ndarray]:
        """The task's exact and near duplicates (one bool per table row) against every earlier
        task, updating the id set and the index; counts nothing. :meth:`feed` without ``exact``
        and ``near`` calls it; a two-pass decide calls it first for every task."""
        ids = inp.docs["id"]
        dup = self.seen.contains(ids) if ids.size else np.zeros(0, bool)
        self.seen.add(ids[~dup])
        return dup, self._near(dup, inp.signatures)

    def feed(
        self,
        inp: DecideInput,
        *,
        verify_candidates: bool = False,
        exact: np.ndarray | None = None,
        near: np.ndarray | None = None,
        worst: np.ndarray | None = None,
    ) -> tuple[TaskDecision, list[dict[str, Any]]]:
        """Decide one task's documents; also returns its ``--explain-drops`` lines in input order
        (when asked for). ``verify_candidates`` is passed on to the finish stage.

        ``exact`` and ``near`` (one bool per table row), when given, are the task's exact and near
        duplicates as :meth:`dedup` or the bucketed decide stage found them
        (:mod:`~h5corpus.build.stages.buckets`); the decider's own id set and index are then left alone,
        and only the rules after dedup and the counts run. ``worst``: the rows the worst-fraction
        rule drops (:func:`worst_masks`)."""
        rec, docs = inp.record, inp.docs
        self._add_read_counts(rec)
        ids = docs["id"]
        if exact is not None:
            dup = np.asarray(exact, dtype=bool)
        else:
            dup = self.seen.contains(ids) if ids.size else np.zeros(0, bool)
            self.seen.add(ids[~dup])
        near = np.asarray(near, dtype=bool) & ~dup if near is not None else self._near(dup, inp.signatures)
        keep = ~dup & ~near
        scores = row_scores(inp.meta, docs.size, f"task {rec.index}")
        if scores is not None:
            for s in (0, 1):
                self.scores[s].append(scores[keep & (docs["split"] == s)])
        bad = np.zeros(dup.size, bool) if worst is None else np.asarray(worst, dtype=bool) & keep
        keep &= ~bad
        over = self._budgets(keep, docs)
        decision = np.where(keep, docs["split"].astype(np.uint8) + 1, 0).astype(np.uint8)
        self._add_kept(docs, keep, dup, near, over, inp.meta, bad)
        lines = self._explain_lines(ids, dup, near, over, inp.meta, bad, scores) if self.explain else []
        return (
            TaskDecision(
                index=rec.index,
                task=rec.task,
                keep=decision,
                candidates=rec.candidates,
                verify_candidates=verify_candidates,
            ),
            lines,
        )

    def _add_read_counts(self, rec: ReadRecord) -> None:
        for split in fmt.SPLITS:
            c = rec.counts[split]
            st = self.splits[split]
            st["duplicates"] += c.duplicates
            st["skipped"] += c.skipped
            for r, n in c.filtered.items():
                st["dropped"][r] = st["dropped"].get(r, 0) + int(n)

    def _near(self, dup: np.ndarray, sigs: np.ndarray | None) -> np.ndarray:
        near = np.zeros(dup.size, dtype=bool)
        if self.index is not None and sigs is not None:
            for i in np.flatnonzero(~dup).tolist():
                if self.index.add(sigs[i]):
                    near[i] = True
        return near

    def _budgets(self, keep: np.ndarray, docs: np.ndarray) -> np.ndarray:
        """Mark (and unkeep) the documents over a split's budget; counts the kept ones' tokens."""
        stored, split = docs["tokens"], docs["split"]
        over = np.zeros(keep.size, dtype=bool)
        for s in (0, 1):
            b = self.budget[s]
            idx = np.flatnonzero(keep & (split == s))
            if b is None or not idx.size:
                continue
            lens = stored[idx]
            before = np.cumsum(lens) - lens
            ok = self.used[s] + before < b
            over[idx[~ok]] = True
            keep[idx[~ok]] = False
            self.used[s] += int(lens[ok].sum())
        return over

    def _add_kept(
        self,
        docs: np.ndarray,
        keep: np.ndarray,
        dup: np.ndarray,
        near: np.ndarray,
        over: np.ndarray,
        meta: Mapping[str, Any] | None,
        worst: np.ndarray,
    ) -> None:
        stored, split = docs["tokens"], docs["split"]
        trunc = (docs["flags"] & fmt.FLAG_TRUNCATED) != 0
        langs = (meta or {}).get("lang") if self.languages else None
        for s, name in enumerate(fmt.SPLITS):
            st = self.splits[name]
            m = split == s
            k = keep & m
            st["duplicates"] += int((dup & m).sum())
            st["near_duplicates"] += int((near & m).sum())
            st["over_budget"] += int((over & m).sum())
            if (n_worst := int((worst & m).sum())) > 0:
                st["dropped"]["perplexity_worst"] = st["dropped"].get("perplexity_worst", 0) + n_worst
            st["documents"] += int(k.sum())
            st["tokens"] += int(stored[k].sum())
            st["characters"] += int(docs["chars"][k].sum())
            st["truncated"] += int((trunc & k).sum())
            if langs is not None:
                hist = st["languages"]
                for i in np.flatnonzero(k).tolist():
                    code = langs[i] or "none"
                    hist[code] = hist.get(code, 0) + 1

    def _explain_lines(
        self,
        ids: np.ndarray,
        dup: np.ndarray,
        near: np.ndarray,
        over: np.ndarray,
        meta: Mapping[str, Any] | None,
        worst: np.ndarray,
        scores: np.ndarray | None,
    ) -> list[dict[str, Any]]:
        """The task's drop lines, the read stage's and this stage's, merged in record order."""
        ex = (meta or {}).get("explain") or {}
        rows = ex.get("rows") or []
        mine: list[tuple[int, dict[str, Any]]] = []
        for i in np.flatnonzero(dup | near | worst | over).tolist():
            o, read_id, src, lk, lv, lang, prob = rows[i]
            reason = (
                "exact_dup" if dup[i] else "near_dup" if near[i] else "perplexity_worst" if worst[i] else "over_budget"
            )
            info: dict[str, Any] | None = {"lang": lang, "lang_prob": prob} if lang is not None else None
            if scores is not None:
                info = {**(info or {}), "perplexity": float(scores[i])}
            dup_of = bytes(ids[i]).hex() if dup[i] else None
            mine.append((o, explain_line(read_id, (src, lk, lv), reason, info, dup_of=dup_of)))
        merged = sorted([tuple(x) for x in ex.get("drops") or []] + mine, key=lambda x: x[0])
        return [d for _, d in merged]

    def finish(self) -> dict[str, dict[str, Any]]:
        """Fold the dedup stages into ``dropped``, sort the per-split mappings; the manifest's ``splits``
        (without ``pairs`` and ``shards``, which the commit adds)."""
        for st in self.splits.values():
            d = st["dropped"]
            if st["duplicates"]:
                d["exact_dup"] = int(st["duplicates"])
            if st["near_duplicates"]:
                d["near_dup"] = int(st["near_duplicates"])
            st["dropped"] = dict(sorted(d.items()))
            if "languages" in st:
                st["languages"] = dict(sorted(st["languages"].items()))
        for s, name in enumerate(fmt.SPLITS):
            if self.scores[s]:
                self.splits[name]["perplexity"] = score_summary(np.concatenate(self.scores[s]))
                self.scores[s] = []
        return self.splits


@dataclass
class DecideResult:
    """:func:`decide` over a whole build."""

    decisions: list[TaskDecision] = field(default_factory=list)
    """One per task up to and including the one that filled the budgets."""
    explain_lines: list[dict[str, Any]] = field(default_factory=list)
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)


def decide(decider: Decider, inputs: Iterable[DecideInput]) -> DecideResult:
    """Fold every task (in input order) through ``decider``; stops after the task that fills the
    budgets, as the incremental driver does. With a worst-fraction rule: two passes (dedup and
    scores of every task, then the decisions; ``inputs`` is then read into a list)."""
    out = DecideResult()
    if decider.drop_worst_fraction is None:
        for inp in inputs:
            decision, lines = decider.feed(inp)
            out.decisions.append(decision)
            out.explain_lines += lines
            if decider.can_stop_early and decider.filled:
                break
        out.splits = decider.finish()
        return out
    tasks = list(inputs)
    flags = [decider.dedup(inp) for inp in tasks]
    worst = worst_masks_of(decider.drop_worst_fraction, tasks, flags)
    for inp, (dup, near), bad in zip(tasks, flags, worst):
        decision, lines = decider.feed(inp, exact=dup, near=near, worst=bad)
        out.decisions.append(decision)
        out.explain_lines += lines
    out.splits = decider.finish()
    return out


def task_scores(inp: DecideInput) -> np.ndarray:
    """The perplexity of each of the task's table rows; ValueError when the read stage recorded none."""
    sc = row_scores(inp.meta, inp.docs.size, f"task {inp.record.index}")
    if sc is None:
        raise ValueError(f"task {inp.record.index}: no perplexities recorded (--drop-worst-fraction needs a model)")
    return sc


def worst_masks_of(
    fraction: float, inputs: Sequence[DecideInput], flags: Sequence[tuple[np.ndarray, np.ndarray]]
) -> list[np.ndarray]:
    """:func:`worst_masks` of tasks ``inputs`` whose dedup flags are ``flags`` (exact, near)."""
    return worst_masks([task_scores(inp) for inp in inputs], [~d & ~n for d, n in flags], fraction)
