"""What every way of running a build does before its stages run: :func:`prepare`.

One plain function, shared by the local and Ray drivers (:func:`~.drive.drive`) and by Slurm
submission (:func:`~.slurm.submit_slurm`): it refuses what the chosen executor cannot run, makes the
build's one :class:`~h5corpus.build.stages.decide.Decider`, picks the decide form (in memory, or
:func:`decide_buckets` buckets), takes the fast encoder loaded on a thread (:class:`Background`),
reads the proof's sample and makes the :class:`~h5corpus.build.stages.buildplan.BuildPlan`.
:func:`prove` then proves the fast encoder on that sample (the driver while its workers read; Slurm
before it submits anything) and, on a difference, gives the plan for ``tokenizers``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..config import (
    BuildConfig,
    ExecutorKind,
    SigningFilters,
    SplitRule,
    filters_detect_language,
    filters_near_index,
    filters_score_perplexity,
)
from ..input.hfrecords import in_process_only, task_label
from ..input.records import newlines_before, sample_texts
from ..input.sources import SourceError, Task
from ..report import BuildReport
from ..stages.buckets import lsh_params
from ..stages.buildplan import BuildPlan, filters_spec, rebuild_filters
from ..stages.decide import Decider
from ..stages.sftread import SFTSpec
from ..stages.statedir import StateDir
from ..tokenize.encoders import Encoder, HFEncoder
from ..tokenize.proof import prove_fast_path
from ..tokenize.tokenizer import Tokenizer, library_versions, source_sha256

#: Text the build samples from its own input (the first documents of each task, in input order)
#: to prove a fast encoder equal to ``tokenizers``: at most this many characters in all ...
PROOF_SAMPLE_CHARS = 64 << 10
#: ... and at most this many from one task, so the sample spans the inputs.
PROOF_SAMPLE_TASK_CHARS = 8 << 10
#: Input bytes per decide bucket when the count is picked automatically (~1 M documents of web
#: text: a bucket's sort then needs ~100 MB; docs/SCALING.md).
BUCKET_INPUT_BYTES = 1 << 30


class Background:
    """``fn(*args)`` on a thread of its own, started now; :meth:`result` joins it and returns (or
    raises) what it gave."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._out: tuple[bool, Any] = (False, None)
        self._fn, self._args = fn, args
        self._thread = threading.Thread(target=self._call, name=f"h5corpus-{getattr(fn, '__name__', 'load')}")
        self._thread.daemon = True
        self._thread.start()

    def _call(self) -> None:
        try:
            self._out = (True, self._fn(*self._args))
        except BaseException as e:  # noqa: BLE001 - re-raised by result(), in the caller's thread
            self._out = (False, e)

    def result(self) -> Any:
        self._thread.join()
        ok, value = self._out
        if not ok:
            raise value
        return value


@dataclass(frozen=True)
class Target:
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
    fast_loading: Background | None = None
    """The fast encoder being loaded (:func:`~h5corpus.build.tokenize.encoders.fast_encoder` on a thread)."""
    sft: SFTSpec | None = None
    """A fine-tuning build's settings (``BuildConfig.loss_on``), resolved; None for pretraining."""


@dataclass
class EncoderChoice:
    """The build's encoder: the fast one once loaded (unproven until :func:`prove`), else the
    reference; ``note`` says why a fast path does not apply or was dropped."""

    encoder: Encoder
    reference: Encoder
    fast: Encoder | None = None
    note: str = ""
    sample: list[str] = dataclasses.field(default_factory=list)
    """The proof's sample of the build's own input (empty when there is no fast encoder)."""


@dataclass
class Prepared:
    """A build ready to run: :func:`prepare`'s answer, the input of every way of running."""

    target: Target
    tasks: list[Task]
    resumed: bool
    t_start: float
    decider: Decider
    buckets: int
    """Decide buckets: 0 decides in memory in the driver."""
    choice: EncoderChoice
    plan: BuildPlan

    @property
    def cfg(self) -> BuildConfig:
        return self.target.cfg


def new_decider(cfg: BuildConfig) -> Decider:
    """The decide stage's state for ``cfg`` (budgets, near dedup, languages, drop list, worst fraction)."""
    f = cfg.filters
    return Decider(
        budgets=cfg.max_tokens,
        validation_fraction=float(cfg.validation_fraction),
        near_index=filters_near_index(f),
        count_languages=filters_detect_language(f),
        explain=cfg.explain_drops is not None,
        drop_worst_fraction=cfg.drop_worst_fraction,
    )


def auto_buckets(tasks: Sequence[Task]) -> int:
    """One decide bucket per :data:`BUCKET_INPUT_BYTES` of input (at least one)."""
    return max(1, math.ceil(sum(int(t.nbytes) for t in tasks) / BUCKET_INPUT_BYTES))


def decide_buckets(cfg: BuildConfig, tasks: Sequence[Task], can_stop_early: bool) -> int:
    """The decide buckets of this build: 0 for the in-memory decide (see :class:`BuildConfig
    <h5corpus.build.config.BuildConfig>`'s ``decide_buckets``)."""
    if cfg.decide_buckets is not None:
        return int(cfg.decide_buckets)
    if cfg.executor == ExecutorKind.SLURM:
        return auto_buckets(tasks)
    if cfg.executor == ExecutorKind.LOCAL or can_stop_early:
        return 0
    return auto_buckets(tasks)


def refuse_in_process_tasks(executor: str, tasks: Sequence[Task]) -> None:
    """An in-memory ``datasets`` object cannot travel in the plan: refuse it before submitting."""
    held = [t for t in tasks if in_process_only(t)]
    if held:
        raise SourceError(
            f"--executor {executor}: {task_label(held[0])} ({len(held)} task(s)) reads a datasets object held in this "
            "process's memory, which other processes cannot open; save it with save_to_disk() (or flatten_indices()) "
            "and build from the folder, or use --executor local"
        )


def prepare(target: Target, tasks: list[Task], resumed: bool, t_start: float) -> Prepared:
    """Everything before the stages, for any executor (see the module docstring)."""
    cfg = target.cfg
    if cfg.executor != ExecutorKind.LOCAL:
        rebuild_filters(filters_spec(cfg.filters))  # the workers rebuild them from the plan: fail here, not there
        refuse_in_process_tasks(cfg.executor, tasks)
    decider = new_decider(cfg)
    buckets = decide_buckets(cfg, tasks, decider.can_stop_early)
    if buckets or cfg.executor == ExecutorKind.SLURM:
        lsh_params(decider.index)  # refuses an index the buckets cannot reproduce
    choice = _take_encoder(target, tasks)
    plan = make_plan(target, tasks, choice.encoder, decider, buckets)
    return Prepared(target, tasks, resumed, t_start, decider, buckets, choice, plan)


def _take_encoder(target: Target, tasks: Sequence[Task]) -> EncoderChoice:
    """Read the proof's sample while the fast encoder loads, then take it (once) if it applies."""
    reference = HFEncoder(target.tok)
    loading = target.fast_loading
    if loading is None:
        return EncoderChoice(encoder=reference, reference=reference)
    cfg = target.cfg
    sample = sample_texts(tasks, cfg.text_field, PROOF_SAMPLE_CHARS, PROOF_SAMPLE_TASK_CHARS, int(cfg.max_record_bytes))
    library_versions(), source_sha256()  # computed once per process; the proof's cache key
    fast, why = loading.result()
    if fast is None:
        return EncoderChoice(encoder=reference, reference=reference, note=f"fast path not applicable: {why}")
    note = f"not applicable: {why}" if why else ""
    return EncoderChoice(encoder=fast, reference=reference, fast=fast, note=note, sample=sample)


def make_plan(target: Target, tasks: Sequence[Task], encoder: Encoder, decider: Decider, buckets: int) -> BuildPlan:
    """The persisted plan of this build with ``encoder``: everything a stage in any process needs."""
    cfg = target.cfg
    explain = cfg.explain_drops is not None
    return BuildPlan(
        run=target.run_id,
        fingerprint=target.fingerprint,
        shards_dir=str(target.shards_dir),
        tokenizer=target.tok.identity,
        encoder=encoder.name,
        tasks=tuple(tasks),
        text_field=cfg.text_field,
        split=SplitRule(int(cfg.split_seed), float(cfg.validation_fraction)),
        on_error=cfg.on_error,
        max_record_bytes=int(cfg.max_record_bytes),
        chunk_tokens=int(cfg.chunk_tokens),
        shard_tokens=int(cfg.shard_tokens),
        max_document_tokens=None if cfg.max_document_tokens is None else int(cfg.max_document_tokens),
        filters=filters_spec(cfg.filters),
        want_signatures=decider.index is not None and isinstance(cfg.filters, SigningFilters),
        record_lang=decider.languages,
        explain=explain,
        newlines_before=newlines_before(tasks) if explain else {},
        record_perplexity=filters_score_perplexity(cfg.filters),
        drop_worst_fraction=cfg.drop_worst_fraction,
        perplexity_scores=None if cfg.perplexity_scores is None else str(Path(cfg.perplexity_scores).absolute()),
        decide_buckets=buckets,
        manifest=str(target.manifest_path),
        sources=dict(target.sources),
        explain_drops=None if cfg.explain_drops is None else str(Path(cfg.explain_drops).absolute()),
        sft=None if target.sft is None else target.sft.to_json(),
    )


def prove(prep: Prepared) -> BuildPlan | None:
    """Prove the fast encoder on the sample; None when it stands (or there is none), else the plan
    for the encoder chosen instead (``prep.choice`` updated, with the reason in its note)."""
    c = prep.choice
    if c.fast is None or c.encoder is not c.fast:
        return None
    chosen, note = prove_fast_path(c.reference, c.fast, c.sample, names=prep.cfg.fast_encoders)
    if chosen is c.fast:
        return None
    c.note = "; ".join(filter(None, (c.note, note)))
    c.encoder = chosen
    prep.plan = dataclasses.replace(prep.plan, encoder=chosen.name)
    return prep.plan


def new_report(prep: Prepared) -> BuildReport:
    """The report a run fills in."""
    t = prep.target
    return BuildReport(
        manifest=str(t.manifest_path),
        shards_dir=str(t.shards_dir),
        tokenizer=t.tok.identity.to_json(),
        splits={},
        tasks=len(prep.tasks),
        resumed=prep.resumed,
        executor=str(ExecutorKind(prep.cfg.executor).value),
        decide_buckets=prep.buckets,
    )


def progress_bar(unit: str, desc: str, total: int | None = None, every_s: float = 0.25) -> tqdm:
    """A progress bar on stderr, redrawn at most every ``every_s`` seconds."""
    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "tok",
        desc=desc,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=every_s,
    )
