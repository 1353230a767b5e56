"""The decide stage: which documents the corpus stores, as a fold over the read tasks in input order.

For each task, in input order: exact dedup across tasks (the first occurrence wins), then the
near-duplicate index (fed the signatures of the exact-dedup survivors), then ``--max-tokens``
budgets (whole documents in input order until a split's budget is filled; the last one is kept
whole). The result per task is a :class:`~h5corpus.build.state.TaskDecision`.

:class:`Decider` is the fold itself, usable incrementally (the local driver feeds each task as soon
as it and all earlier ones are read, so finishing overlaps reading) or over every task at once
(:func:`decide`); both give the same decisions. Its state is the ids kept so far (32 bytes each),
the near-duplicate index and the budgets used. A rule that needs every document's score before
deciding any (e.g. "drop the worst fraction") would run :func:`decide` after all reads, in two
passes.

That in-memory fold is the fast path of one machine. The bucketed decide stage
(:mod:`~h5corpus.build.buckets`) finds the same exact and near duplicates in buckets that run as
separate tasks (by id prefix and by LSH band key), and its merge feeds them to :meth:`Decider.feed`
(``exact=``, ``near=``), which then only applies the budgets and counts: the same decisions, with
memory bounded per bucket instead of per build.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..storage import format as fmt
from .explain import explain_line
from .plan import BuildPlan
from .report import empty_split
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
    """One read task as the decide stage sees it (:meth:`~h5corpus.build.state.StateDir.load_read_outputs`)."""

    record: ReadRecord
    docs: np.ndarray
    """The task's table (``DOC_DTYPE`` rows)."""
    signatures: np.ndarray | None
    """(documents, k) near-dedup signatures, when computed."""
    meta: Mapping[str, Any] | None
    """``lang`` per row and ``explain`` data, when recorded."""


class Decider:
    """Global decisions in input order: exact dedup, near dedup, budgets. Deterministic."""

    def __init__(
        self,
        *,
        budgets: Mapping[str, int] | None,
        validation_fraction: float,
        near_index: Any = None,
        count_languages: bool = False,
        explain: bool = False,
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
        )

    @property
    def can_stop_early(self) -> bool:
        """Every split that can receive documents has a budget (so reading may stop before the end)."""
        return all((not need) or b is not None for b, need in zip(self.budget, self.needs))

    @property
    def filled(self) -> bool:
        return all((not need) or (b is not None and u >= b) for b, u, need in zip(self.budget, self.used, self.needs))

    def feed(
        self,
        inp: DecideInput,
        *,
        verify_candidates: bool = False,
        exact: np.ndarray | None = None,
        near: np.ndarray | None = None,
    ) -> tuple[TaskDecision, list[dict[str, Any]]]:
        """Decide one task's documents; also returns its ``--explain-drops`` lines in input order
        (when asked for). ``verify_candidates`` is passed on to the finish stage.

        ``exact`` and ``near`` (one bool per table row), when given, are the task's exact and near
        duplicates as the bucketed decide stage found them (:mod:`~h5corpus.build.buckets`); the
        decider's own id set and index are then left alone, and only the budgets and counts run."""
        rec, docs = inp.record, inp.docs
        self._add_read_counts(rec)
        ids = docs["id"]
        if exact is not None:
            dup = np.asarray(exact, dtype=bool)
        else:
            dup = self.seen.contains(ids) if ids.size else np.zeros(0, bool)
            self.seen.add(ids[~dup])
        if near is not None:
            near = np.asarray(near, dtype=bool) & ~dup
        else:
            near = self._near(dup, inp.signatures)
        keep = ~dup & ~near
        over = self._budgets(keep, docs)
        decision = np.where(keep, docs["split"].astype(np.uint8) + 1, 0).astype(np.uint8)
        self._add_kept(docs, keep, dup, near, over, inp.meta)
        lines = self._explain_lines(ids, dup, near, over, inp.meta) if self.explain else []
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
        self, ids: np.ndarray, dup: np.ndarray, near: np.ndarray, over: np.ndarray, meta: Mapping[str, Any] | None
    ) -> list[dict[str, Any]]:
        """The task's drop lines, the read stage's and this stage's, merged in record order."""
        ex = (meta or {}).get("explain") or {}
        rows = ex.get("rows") or []
        mine: list[tuple[int, dict[str, Any]]] = []
        for i in np.flatnonzero(dup | near | over).tolist():
            o, read_id, src, lk, lv, lang, prob = rows[i]
            reason = "exact_dup" if dup[i] else "near_dup" if near[i] else "over_budget"
            info = {"lang": lang, "lang_prob": prob} if lang is not None else None
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
    budgets, as the incremental driver does."""
    out = DecideResult()
    for inp in inputs:
        decision, lines = decider.feed(inp)
        out.decisions.append(decision)
        out.explain_lines += lines
        if decider.can_stop_early and decider.filled:
            break
    out.splits = decider.finish()
    return out
