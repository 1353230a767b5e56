"""The commit stage: the manifest, written last and atomically, once every listed shard is durable.

:func:`commit` gathers the finish records of the tasks that are part of the corpus (shards in split,
then task, then sequence order: the corpus's global token order), adds up what the read records
counted, publishes the ``--explain-drops`` file, fsyncs the shards' folders, writes the manifest,
and removes the shard files it made that nothing lists any more (shards of tasks read past a
budget, an earlier partition's files; :func:`remove_unlisted`) and the state folder.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import __version__
from ...storage import format as fmt
from ...storage.format import FormatError
from ...storage.manifest import Manifest, write_manifest, write_table_file
from ...storage.reader import write_layout_file
from ...storage.writer import fsync_dir
from ..config import MAX_LISTED
from ..oserrors import os_step
from .buildplan import StageContext
from .explain import ExplainFile
from .scores import write_scores
from .sftread import SFTSpec, add_trained_tokens
from .shards import build_file_task, our_shard_files
from .statedir import FinishRecord, ReadRecord, TaskDecision


@dataclass
class CommitTotals:
    """What the read records of the corpus's tasks add up to (manifest and report)."""

    skipped_total: int = 0
    skipped_records: list[str] = field(default_factory=list)
    skip_codes: dict[str, int] = field(default_factory=dict)
    filter_counters: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    """Worker CPU seconds per step, of the tasks this run read."""
    encoder_fallbacks: int = 0


def add_up(reads: Sequence[ReadRecord], timed: set[int]) -> CommitTotals:
    """Sum the read records (in input order); ``seconds`` only over the tasks in ``timed``."""
    t = CommitTotals()
    for rec in reads:
        t.skipped_records.extend(rec.skipped_records[: MAX_LISTED - len(t.skipped_records)])
        for k, v in rec.skip_codes.items():
            t.skip_codes[k] = t.skip_codes.get(k, 0) + int(v)
        for k, v in rec.filter_counters.items():
            t.filter_counters[k] = t.filter_counters.get(k, 0) + int(v)
        t.skipped_total += int(rec.skipped_total)
        t.encoder_fallbacks += int(rec.encoder_fallbacks)
        if rec.index in timed:
            for k, v in rec.seconds.items():
                t.seconds[k] = t.seconds.get(k, 0.0) + float(v)
    t.skip_codes = dict(sorted(t.skip_codes.items()))
    t.filter_counters = dict(sorted(t.filter_counters.items()))
    t.seconds = dict(sorted(t.seconds.items()))
    return t


def _manifest_extra(
    plan: Any, reads: Sequence[ReadRecord], totals: CommitTotals, sources: Mapping[str, Any]
) -> dict[str, Any]:
    """The manifest's build-specific sections: ``source``, ``build`` and (with filters) ``filters``."""
    settings = plan.run["settings"]
    build_info = {
        "fingerprint": plan.fingerprint,
        "settings": settings,
        "on_error": plan.on_error,
        "h5corpus_version": __version__,
        "tasks": len(plan.tasks),
        "tasks_read": len(reads),
        "skip_reasons": totals.skip_codes,
        "skipped_records": totals.skipped_records,
        "skipped_records_total": totals.skipped_total,
    }
    extra: dict[str, Any] = {"source": dict(sources), "build": build_info}
    if plan.filters is not None:
        extra["filters"] = {"settings": settings["filters"], "counters": totals.filter_counters}
    if plan.sft is not None:  # a fine-tuning corpus: its shards store loss masks
        extra[fmt.SFT_KEY] = SFTSpec.from_json(plan.sft).manifest_facts()
    return extra


def _publish_beside(
    ctx: StageContext,
    reads: Sequence[ReadRecord],
    finishes: Mapping[int, FinishRecord],
    explain: ExplainFile | None,
    decisions: Mapping[int, TaskDecision] | None,
) -> None:
    """Before the manifest: the drop list and the perplexity scores published, every listed shard's
    folder synced."""
    plan, shards_dir = ctx.plan, ctx.shards_dir
    if explain is not None:
        with os_step("write the drop list", explain.path):
            explain.publish()
    if plan.perplexity_scores is not None:
        if decisions is None:
            raise ValueError("commit: the --perplexity-scores file needs the tasks' decisions")
        with os_step("write the perplexity scores", Path(plan.perplexity_scores)):
            write_scores(plan.perplexity_scores, ctx.state, reads, decisions)
    # Every listed shard durable before the manifest that lists it: the data was fsynced when the
    # shard was written (read stage, or the finish stage's copy); the renames into place, by their folders.
    for d in dict.fromkeys((shards_dir / s.path).parent for rec in reads for s in finishes[rec.index].shards):
        with os_step("sync the folder", d):
            fsync_dir(d)


def commit(
    ctx: StageContext,
    *,
    manifest_path: Path,
    splits: dict[str, dict[str, Any]],
    reads: Sequence[ReadRecord],
    finishes: Mapping[int, FinishRecord],
    totals: CommitTotals,
    sources: Mapping[str, Any],
    explain: ExplainFile | None = None,
    decisions: Mapping[int, TaskDecision] | None = None,
) -> Manifest:
    """Write the manifest of the tasks ``reads`` (input order; each has its entry in ``finishes``);
    ``splits`` is the decide stage's result (``pairs`` and ``shards`` are added here);
    ``decisions`` (of the same tasks) are needed only for the plan's ``--perplexity-scores`` file."""
    plan, shards_dir = ctx.plan, ctx.shards_dir
    entries = [
        s.with_path(Path(os.path.relpath(shards_dir / s.path, manifest_path.parent)).as_posix())
        for split in fmt.SPLITS
        for rec in reads
        for s in finishes[rec.index].shards
        if s.split == split
    ]
    for name, st in splits.items():
        st["pairs"] = st["tokens"] - st["documents"]
        st["shards"] = sum(1 for e in entries if e.split == name)
    if plan.sft is not None:
        add_trained_tokens(splits, shards_dir, [s for rec in reads for s in finishes[rec.index].shards])
    extra = _manifest_extra(plan, reads, totals, sources)
    m = Manifest(
        tokenizer=plan.tokenizer,
        dtype=fmt.dtype_name(fmt.token_dtype(plan.tokenizer.vocab_size)),
        chunk_tokens=plan.chunk_tokens,
        shards=entries,
        splits=splits,
        extra=extra,
        shards_dir=Path(os.path.relpath(shards_dir, manifest_path.parent)).as_posix(),
    )
    _publish_beside(ctx, reads, finishes, explain, decisions)
    ctx.step("manifest-before")
    with os_step("write the manifest", manifest_path):
        write_manifest(manifest_path, m)
    ctx.step("manifest-after")
    remove_unlisted(ctx, {p for e in entries for p in (m.shard_path(e), fmt.docs_path(m.shard_path(e)))})
    write_reader_caches(manifest_path)  # last: the table file keys on the shard folders as they end up
    ctx.state.remove()
    return m


def write_reader_caches(manifest_path: Path) -> None:
    """Write the manifest's layout file (readers' fast first touch of a shard) and table file
    (their open without parsing ``shards.json``): docs/FORMAT.md. Without them readers do the
    same checks the slow way, so a failure removes the stale file and the build goes on."""
    for write, path in (
        (write_layout_file, fmt.layout_path(manifest_path)),
        (write_table_file, fmt.table_path(manifest_path)),
    ):
        try:
            write(manifest_path)
        except (OSError, FormatError):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)


def remove_unlisted(ctx: StageContext, listed: set[Path]) -> None:
    """Delete the shard files this build made that the manifest does not list (tasks read past a
    budget, an earlier partition of changed inputs): files named exactly like the build's shards
    (or their ``.partial``) of a task that has a record in the state folder. Nothing else."""
    recorded = ctx.state.recorded_tasks()
    for p in our_shard_files(ctx.shards_dir):
        if p.absolute() not in listed and build_file_task(p) in recorded:
            with os_step("delete", p):
                p.unlink(missing_ok=True)
