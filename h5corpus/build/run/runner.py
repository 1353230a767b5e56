"""``h5corpus build``: raw text -> tokenized shards + manifest, in parallel, deterministically,
resumably. See ``docs/BUILD.md``.

:func:`build_corpus` is the entry point. It resolves the sources and the tokenizer, takes the lock,
checks what the output folders already hold and plans the *tasks*
(:func:`~h5corpus.build.input.sources.plan_tasks`); :func:`~.prepare.prepare` makes the encoder, the
decider and the plan (:mod:`~h5corpus.build.stages.buildplan`); :func:`run_stages` then submits
them to Slurm (:func:`~.slurm.submit_slurm`) or drives them here (:func:`~.drive.drive`, on the
local process pool or Ray):

1. **read** (:func:`~h5corpus.build.stages.tasks.read_task`, parallel, one call per task) on an executor;
2. **decide** (:class:`~h5corpus.build.stages.decide.Decider`, in input order, in memory as far as
   the read tasks allow, or in buckets): exact and near dedup across tasks, budgets; reading stops
   at the task where every budget is filled;
3. **finish** (:func:`~h5corpus.build.stages.tasks.finish_task`, parallel) as soon as a task is decided;
4. **commit** (:func:`~h5corpus.build.stages.commit.commit`): the manifest, last and atomically.

Every output byte is a function of the inputs and the settings, never of the worker count or
timing, so any worker count gives identical files, and a build killed at any moment (``kill -9``)
finishes on re-run with the same bytes: completed stages are reused after their hashes are
checked, everything else is redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...storage.format import TokenizerIdentity
from ...storage.manifest import read_manifest
from ..config import DEFAULT_SHARD_TOKENS, BuildConfig, BuildConflict, ExecutorKind
from ..input.sources import plan_tasks, resolve_sources
from ..oserrors import BuildOSError, as_build_os_error, check_output_kinds, check_writable, os_step
from ..report import BuildReport, check_build_sections, report_from_manifest
from ..stages.buildplan import read_plan_run
from ..stages.sftread import refuse_non_record_sources, sft_spec
from ..stages.shards import our_shard_files
from ..stages.statedir import StateDir
from ..tokenize.encoders import fast_encoder
from ..tokenize.tokenizer import load_tokenizer
from .drive import BucketedDecide, DecideForm, InMemoryDecide, drive
from .executor import BuildLock, Executor, LocalExecutor
from .prepare import Background, Prepared, Target, prepare
from .ray_executor import RayExecutor
from .slurm import submit_slurm

__all__ = ["DEFAULT_SHARD_TOKENS", "build_corpus", "run_stages"]


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
    sft = sft_spec(cfg, tok)  # a fine-tuning build encodes with the reference encoder (offsets)
    loading = Background(fast_encoder, tok, cfg.fast_encoders) if cfg.fast_path and sft is None else None
    inputs = resolve_sources(list(cfg.sources), hf_cache_dir=cfg.hf_cache_dir, text_field=cfg.text_field)
    settings = cfg.settings()
    if sft is not None:
        refuse_non_record_sources(inputs)
        settings["sft"] = sft.settings()
    sources = {"inputs": [i.describe() for i in inputs]}
    run_id = {"settings": settings, "tokenizer": tok.identity.to_json(), "sources": [i.spec for i in inputs]}
    target = Target(
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
        sft=sft,
    )
    try:
        with BuildLock(shards_dir, manifest_path) as lock:
            if not lock.writable:
                assert lock.refusal is not None
                return _read_only(target, lock.refusal, t_start)
            return _build(target, inputs, lock, t_start)
    except (OSError, RuntimeError) as e:  # a failed call no step above named: say what is known
        raise as_build_os_error(e, "build into", shards_dir) or e from None


def _build(target: Target, inputs: list[Any], lock: BuildLock, t_start: float) -> BuildReport:
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
    return run_stages(prepare(target, tasks, resumed, t_start), lock)


def run_stages(prep: Prepared, lock: BuildLock) -> BuildReport:
    """Run a prepared build the way its settings say: submitted to Slurm, or driven here on the
    local process pool or Ray, deciding in memory or in buckets."""
    cfg = prep.cfg
    if cfg.executor == ExecutorKind.SLURM:
        return submit_slurm(prep, lock)
    executor: Executor
    if cfg.executor == ExecutorKind.RAY:
        executor = RayExecutor(cfg.ray, prep.target.state.root, count_progress=cfg.progress)
    else:
        workers = min(max(1, int(cfg.workers or os.cpu_count() or 1)), max(len(prep.tasks), 1))
        executor = LocalExecutor(workers, lock_fds=lock.fds, count_progress=cfg.progress)
    decide: DecideForm = BucketedDecide(prep.buckets) if prep.buckets else InMemoryDecide(prep.decider.can_stop_early)
    return drive(prep, executor, decide)


def _read_only(target: Target, refused: BuildOSError, t_start: float) -> BuildReport:
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


def _resumable(t: Target) -> bool:
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


def _check_fresh_output(t: Target, t_start: float) -> BuildReport | None:
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
