"""``h5corpus build``: raw text -> tokenized shards + manifest, in parallel, deterministically,
resumably. See ``docs/BUILD.md``.

The build runs in three phases over *tasks* (``sources.plan_tasks``: a byte range of a ``.jsonl``,
row groups of a parquet file, a compressed file, a run of ``.txt`` files), numbered in input order:

1. **read** (parallel, one job per task): stream records, apply the optional filters, hash each
   document's UTF-8 text (document id = sha256), drop duplicates inside the task, tokenize
   (appending EOS, or cutting at ``max_document_tokens``), and write the task's documents into its
   *candidate* shards (``ShardWriter``, in the state folder) plus a per-document table (id, tokens,
   characters, split, flags). A completion record (JSON, written last) carries their hashes.
2. **decide** (main process, sequential in input order, cheap): global exact dedup across tasks
   (first occurrence wins), near-duplicate index (filters' signatures), ``--max-tokens`` budgets
   (whole documents in input order until a budget is filled; the last one is kept whole). Reading
   stops at the task where every budget is filled. With ``explain_drops``, every document read
   but not stored gets a JSON line here, in input order.
3. **finish** (parallel, one job per task): a task that keeps all its candidates has them renamed
   into place as ``shards/<split>/<split>-<task:05d>-<n:03d>.h5``; otherwise its kept documents are
   copied into new shards of those names (at most ``shard_tokens`` tokens each, documents whole).

The manifest is written last, atomically. Every output byte is a function of the inputs and the
settings, never of the worker count or timing, so any worker count gives identical files, and a
build killed at any moment (``kill -9``) finishes on re-run with the same bytes: completed tasks
are reused after their hashes are checked, everything else is redone. A lock file
(``fcntl.flock``) makes a second concurrent build into the same shards folder fail clearly.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import queue
import re
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import h5py
import numpy as np

from .. import __version__
from ..storage import format as fmt
from ..storage.format import PARTIAL_SUFFIX, ShardRecord, TokenizerIdentity
from ..storage.manifest import (
    DEFAULT_MANIFEST,
    DEFAULT_SHARDS_DIR,
    Manifest,
    read_manifest,
    write_json_atomic,
    write_manifest,
)
from ..storage.writer import ShardWriter, fsync_dir, fsync_files
from .sources import BadRecord, Input, Task, TaskReader, plan_tasks, resolve_sources
from .tokenizer import Encoder, HFEncoder, Tokenizer, fast_encoder, load_tokenizer, prove_same_ids

DEFAULT_SPLIT_SEED = 20261003
DEFAULT_VALIDATION_FRACTION = 0.05
#: Input bytes per task: small enough to balance 2+ workers and bound the reading past a filled
#: budget, large enough that each task's shards are not tiny.
DEFAULT_TASK_BYTES = 16 << 20
#: Most tokens one shard holds (a single longer document gets a shard of its own).
DEFAULT_SHARD_TOKENS = 1 << 27
#: Skipped records listed per task and in the manifest (all are counted).
MAX_LISTED = 100
#: Text the build samples from its own input (the first documents of each task, in input order)
#: to prove a fast encoder equal to ``tokenizers``: at most this many characters in all ...
PROOF_SAMPLE_CHARS = 64 << 10
#: ... and at most this many from one task, so the sample spans the inputs.
PROOF_SAMPLE_TASK_CHARS = 8 << 10
STATE_DIR = ".build"
LOCK_FILE = ".build.lock"
SHARD_NAME = re.compile(r"^(train|validation)-(\d{5})-(\d{3})\.h5$")
#: Per-document table of a read task.
DOC_DTYPE = np.dtype([("id", "V32"), ("tokens", "<i8"), ("chars", "<i8"), ("split", "u1"), ("flags", "u1")])
"""Per document: sha256 id, tokens as stored (EOS included; the cut length if truncated), characters
of the text, split index (0 train, 1 validation), FLAG_* bits."""
#: Documents are encoded (and written) in batches of this many documents / characters: large
#: batches keep the tokenizer's tables in cache between calls (~3% less encode CPU than 1 MB ones).
_ENCODE_BATCH_DOCS = 2048
_ENCODE_BATCH_CHARS = 8 << 20
#: Documents go through ``filters.process_batch`` in batches of this size.
_FILTER_BATCH_DOCS = 256
_FILTER_BATCH_CHARS = 1 << 20
#: Version of the state files (read records, tables, meta): records of another version are redone.
_STATE_VERSION = 2


class BuildError(Exception):
    """The input is bad (a record that cannot be read under ``on_error="fail"``): names file and line."""


class BuildConflict(Exception):
    """The output is in use or holds something else: another build holds the lock, the manifest was
    built with another tokenizer or other settings, or an interrupted build used other settings."""


# -- the filter seam (issue 7 plugs in here) ----------------------------------------------------
@runtime_checkable
class DocumentFilters(Protocol):
    """What the build needs from cleaning / quality / language / PII / near-dedup stages.

    Required:

    * ``process(text) -> (text_or_None, drop_reason_or_None)``: return the (possibly cleaned) text
      to keep it, or ``(None, reason)`` to drop it; called once per document in phase 1, in input
      order within a task, in a worker process (the object is inherited by fork or pickled).
    * ``counters() -> Mapping[str, int]``: monotonically growing per-rule counters of this process's
      copy. The build takes the difference across each task and sums tasks in input order, so they
      merge deterministically across workers.

    Optional:

    * ``process_batch(texts, *, signatures) -> [result]``: the fast path, called instead of
      ``process`` with up to 256 documents (or ~1 M characters) at a time. Each result has
      ``.text``/``.reason`` as ``process`` would give, and may carry ``.signature`` and ``.info``
      (a mapping; ``info["lang"]``/``info["lang_prob"]`` are recorded per document).
    * ``signature(text) -> object``: a picklable near-duplicate signature (e.g. a MinHash) of a kept
      text, computed in phase 1 when a batch result carries none.
    * ``near_duplicate_index() -> index | None`` where ``index.add(signature) -> bool`` (True = a
      near duplicate of something added before): phase 2 creates one index per build and feeds it
      the signatures of exact-dedup survivors, in global input order. None = near-dedup off (no
      signature is computed).
    * ``describe() -> Mapping``: JSON-able settings, recorded in the manifest and part of the
      build fingerprint (changing them invalidates an interrupted build).
    * ``timings() -> Mapping[str, float]``: growing seconds per stage (build report only).
    * ``warm_up()``: load models; called once in the main process before the workers fork.
    * ``config.lang`` (truthy): the filters detect languages; the manifest then counts stored
      documents per language (``splits.<split>.languages``).
    """

    def process(self, text: str) -> tuple[str | None, str | None]: ...

    def counters(self) -> Mapping[str, int]: ...


# -- configuration ------------------------------------------------------------------------------
@dataclass(kw_only=True)
class BuildConfig:
    """Everything a build depends on. Paths are relative to the current directory."""

    sources: Sequence[str] = ("stdlib",)
    """SOURCE specs (files, folders, globs, ``hf://datasets/...@REV/PATH``, ``stdlib``), in input order."""
    tokenizer: str = "gpt2"
    """Tokenizer spec: ``gpt2``, ``bytes``, or a path to ``tokenizer.json`` / its folder."""
    shards_dir: str | os.PathLike[str] = DEFAULT_SHARDS_DIR
    manifest: str | os.PathLike[str] = DEFAULT_MANIFEST
    workers: int | None = None
    """Worker processes (default: all cores). Never changes the output."""
    text_field: str = "text"
    """JSON field / parquet column holding the text."""
    split_seed: int = DEFAULT_SPLIT_SEED
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION
    """Probability that a document goes to validation (by hash of id and seed), in [0, 1]."""
    max_tokens: Mapping[str, int] | None = None
    """Per-split token budgets (EOS included): whole documents in input order until filled, the
    last one kept whole. A split without a budget keeps all its documents."""
    max_document_tokens: int | None = None
    """Cut longer documents to this many tokens when writing (no EOS after a cut; flagged)."""
    on_error: str = "fail"
    """``fail``: a bad record stops the build, naming file and line. ``skip``: count and list it."""
    overwrite: bool = False
    """Delete the manifest, this build's shards and any interrupted state first."""
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    """Most tokens per shard file (a longer single document gets its own shard)."""
    chunk_tokens: int = fmt.DEFAULT_CHUNK_TOKENS
    """HDF5 chunk size of ``/tokens``, in tokens."""
    task_bytes: int = DEFAULT_TASK_BYTES
    """Input bytes per task (the unit of parallel work, resume and shard naming)."""
    filters: DocumentFilters | None = None
    """Optional :class:`DocumentFilters` (cleaning, quality, language, PII, near-dedup)."""
    fast_path: bool = True
    """Use a proven-equal fast encoder (tiktoken / raw bytes) when the tokenizer allows one."""
    progress: bool = False
    """Show a tqdm bar (documents, tokens, tokens/s) on stderr."""
    hf_cache_dir: str | os.PathLike[str] | None = None
    """Hugging Face hub cache (default: ``$HF_HUB_CACHE`` or ``~/.cache/huggingface/hub``)."""
    eos_token: str | None = None
    """End-of-document token text (default: the first of ``<|endoftext|>``, ``</s>``, ... present)."""
    explain_drops: str | os.PathLike[str] | None = None
    """Write one JSON line per document that was read but not stored (id of the text as read,
    source, line/row, reason), in input order, atomically. Not part of the build's settings: it
    never changes a shard or the manifest."""

    def check(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not self.sources:
            raise ValueError("sources: give at least one SOURCE")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not 0.0 <= float(self.validation_fraction) <= 1.0:
            raise ValueError(f"validation_fraction must be in [0, 1], got {self.validation_fraction}")
        if int(self.split_seed) < 0:
            raise ValueError(f"split_seed must be >= 0, got {self.split_seed}")
        for k, v in (self.max_tokens or {}).items():
            if k not in fmt.SPLITS:
                raise ValueError(f"max_tokens: unknown split {k!r} (splits: {', '.join(fmt.SPLITS)})")
            if int(v) <= 0:
                raise ValueError(f"max_tokens: budget for {k} must be positive, got {v}")
        if self.max_document_tokens is not None and int(self.max_document_tokens) < 1:
            raise ValueError(f"max_document_tokens must be >= 1, got {self.max_document_tokens}")
        if self.on_error not in ("fail", "skip"):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {self.on_error!r}")
        for name in ("shard_tokens", "chunk_tokens", "task_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.filters is not None and not callable(getattr(self.filters, "process", None)):
            raise ValueError("filters must have a process(text) -> (text_or_None, reason_or_None) method")

    def settings(self) -> dict[str, Any]:
        """The settings that determine the output bytes (recorded in the manifest)."""
        f = self.filters
        fdesc: Any = None
        if f is not None:
            fdesc = dict(f.describe()) if callable(getattr(f, "describe", None)) else {"class": type(f).__qualname__}
        return {
            "text_field": self.text_field,
            "split_seed": int(self.split_seed),
            "validation_fraction": float(self.validation_fraction),
            "max_tokens": {k: int(v) for k, v in sorted((self.max_tokens or {}).items())} or None,
            "max_document_tokens": None if self.max_document_tokens is None else int(self.max_document_tokens),
            "shard_tokens": int(self.shard_tokens),
            "chunk_tokens": int(self.chunk_tokens),
            "task_bytes": int(self.task_bytes),
            "filters": fdesc,
            "format_version": fmt.FORMAT_VERSION,
        }


def parse_max_tokens(spec: str) -> dict[str, int]:
    """``"train=8M,validation=100k"`` -> ``{"train": 8_000_000, "validation": 100_000}``.
    Suffixes k/M/B (powers of 1000) and ``_`` separators are accepted."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" not in part:
            raise ValueError(f"--max-tokens: {part!r} is not SPLIT=N (e.g. train=8M,validation=100k)")
        k, v = (x.strip() for x in part.split("=", 1))
        if k not in fmt.SPLITS:
            raise ValueError(f"--max-tokens: unknown split {k!r} (splits: {', '.join(fmt.SPLITS)})")
        m = re.fullmatch(r"(\d[\d_]*(?:\.\d+)?)\s*([kKmMbBgG]?)", v)
        if not m:
            raise ValueError(f"--max-tokens: {v!r} is not a token count (e.g. 8000000, 8M, 100k)")
        mult = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}[m.group(2).lower()]
        n = int(float(m.group(1).replace("_", "")) * mult)
        if n <= 0:
            raise ValueError(f"--max-tokens: budget for {k} must be positive")
        out[k] = n
    if not out:
        raise ValueError("--max-tokens: give SPLIT=N pairs, e.g. train=8M,validation=100k")
    return out


# -- splitting ----------------------------------------------------------------------------------
def _split_prefix(seed: int) -> bytes:
    return b"h5corpus-split:%d:" % int(seed)


def _split_threshold(validation_fraction: float) -> int:
    return min(int(float(validation_fraction) * (1 << 64)), 1 << 64)


def document_split(
    doc_id: bytes, *, seed: int = DEFAULT_SPLIT_SEED, validation_fraction: float = DEFAULT_VALIDATION_FRACTION
) -> str:
    """The split of a document: ``validation`` when the first 8 bytes (big-endian) of
    ``sha256(b"h5corpus-split:<seed>:" + doc_id)``, read as a fraction of 2**64, fall below
    ``validation_fraction``; else ``train``. ``doc_id`` is the 32-byte sha256 of the UTF-8 text."""
    u = int.from_bytes(hashlib.sha256(_split_prefix(seed) + doc_id).digest()[:8], "big")
    return fmt.SPLITS[1] if u < _split_threshold(validation_fraction) else fmt.SPLITS[0]


# -- report -------------------------------------------------------------------------------------
_SPLIT_KEYS = (
    "documents",
    "tokens",
    "pairs",
    "characters",
    "duplicates",
    "near_duplicates",
    "over_budget",
    "truncated",
    "skipped",
    "shards",
)
#: Drop reasons of the build's own dedup stages (the rest of ``splits.<split>.dropped`` are the filters').
DEDUP_REASONS = ("exact_dup", "near_dup")


def _empty_split() -> dict[str, Any]:
    d: dict[str, Any] = {k: 0 for k in _SPLIT_KEYS}
    d["dropped"] = {}
    return d


def filtered_total(split: Mapping[str, Any]) -> int:
    """Documents of a split that the filter stages dropped (``dropped`` without the dedup stages)."""
    d = split.get("dropped")
    if isinstance(d, int):  # a manifest written before per-rule counts
        return d
    return sum(int(v) for k, v in (split.get("dropped") or {}).items() if k not in DEDUP_REASONS)


@dataclass
class BuildReport:
    """What a build did. ``splits`` holds the manifest's per-split figures."""

    manifest: str
    shards_dir: str
    tokenizer: dict[str, Any]
    splits: dict[str, dict[str, Any]]
    tasks: int = 0
    tasks_read: int = 0
    """Tasks that are part of the corpus (all, unless budgets stopped reading early)."""
    tasks_reused: int = 0
    """Tasks whose completed work from an interrupted run was checked and reused."""
    shards_written: int = 0
    shards_reused: int = 0
    encoder: str = ""
    """Encoder that tokenized this run: tiktoken, bytes or tokenizers."""
    encoder_note: str = ""
    """Why the fast path was not used, when it was not."""
    skipped_total: int = 0
    skipped_records: list[str] = field(default_factory=list)
    """``file:line: reason`` of skipped records (the first :data:`MAX_LISTED`)."""
    filter_counters: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    """Worker CPU seconds per phase-1 step, summed over the tasks read: ``read`` (parse, hash,
    split, dedup), ``filter`` (all filter stages; ``filter:<stage>`` each), ``encode``
    (tokenization), ``write`` (shards and tables), ``total``. This run's tasks only (tasks reused
    from an interrupted run are not counted). Not in the manifest."""
    explain_drops: str | None = None
    """Path of the ``--explain-drops`` file written, if any."""
    explained: int = 0
    """Lines written to it."""
    tokens_encoded: int = 0
    """Tokens this run tokenized (EOS included; duplicates within a task are not tokenized)."""
    elapsed_s: float = 0.0
    up_to_date: bool = False
    """The manifest already described this exact build; nothing was done."""
    resumed: bool = False

    @property
    def tokens(self) -> int:
        return sum(int(s["tokens"]) for s in self.splits.values())

    @property
    def documents(self) -> int:
        return sum(int(s["documents"]) for s in self.splits.values())

    @property
    def tokens_per_s(self) -> float:
        """Corpus tokens per second of this run's wall time."""
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def dropped(self) -> dict[str, int]:
        """Per-rule drops over all splits (``splits.<split>.dropped`` added up), sorted by rule."""
        out: dict[str, int] = {}
        for st in self.splits.values():
            d = st.get("dropped")
            for k, v in d.items() if isinstance(d, Mapping) else ():
                out[k] = out.get(k, 0) + int(v)
        return dict(sorted(out.items()))

    def filter_summary(self) -> dict[str, Any]:
        """What each stage removed or changed: ``dropped`` per rule (dedup included), ``changed``
        (documents extracted from HTML, repaired by ftfy, whitespace-normalized, PII-scrubbed),
        ``pii`` replacements per kind, ``languages`` of the stored documents, and the seconds the
        filters and the tokenizer took in the workers (``x_tokenize`` = filter / encode time)."""
        c = self.filter_counters
        out: dict[str, Any] = {"dropped": self.dropped()}
        changed = {
            name: int(c[key])
            for name, key in (
                ("html_extracted", "clean:html"),
                ("unicode_repaired", "clean:unicode"),
                ("whitespace_normalized", "clean:whitespace"),
                ("pii_scrubbed", "pii:docs"),
            )
            if c.get(key)
        }
        if changed:
            out["changed"] = changed
        pii = {k[4:]: int(v) for k, v in c.items() if k.startswith("pii:") and k != "pii:docs" and v}
        if pii:
            out["pii"] = pii
        langs: dict[str, int] = {}
        for st in self.splits.values():
            for k, v in (st.get("languages") or {}).items():
                langs[k] = langs.get(k, 0) + int(v)
        if langs:
            out["languages"] = dict(sorted(langs.items(), key=lambda kv: (-kv[1], kv[0])))
        sec = self.seconds
        if sec.get("filter") and sec.get("encode"):
            out["seconds"] = {
                k: round(v, 3) for k, v in sec.items() if k == "filter" or k.startswith("filter:") or k == "encode"
            }
            out["x_tokenize"] = round(sec["filter"] / sec["encode"], 3)
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["seconds"] = {k: round(v, 3) for k, v in self.seconds.items()}
        d["filters"] = self.filter_summary()
        d["tokens_per_s"] = round(self.tokens_per_s, 1)
        d["elapsed_s"] = round(self.elapsed_s, 3)
        d["tokens"] = self.tokens
        d["documents"] = self.documents
        return d


# -- small helpers ------------------------------------------------------------------------------
def _sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while b := fh.read(block):
            h.update(b)
    return h.hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class _Lock:
    """Exclusive ``flock`` on ``<shards_dir>/.build.lock`` for the life of a build."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> _Lock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise BuildConflict(
                f"another h5corpus build is writing into {self.path.parent} (lock {self.path} held by pid {holder}); "
                "wait for it to finish, or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


class _SeenIds:
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


# -- worker side --------------------------------------------------------------------------------
@dataclass
class _Job:
    """What every worker needs; inherited at fork (or pickled for spawn)."""

    encoder: Any
    identity: TokenizerIdentity
    state: str
    shards_dir: str
    text_field: str
    seed: int
    fraction: float
    on_error: str
    filters: Any
    chunk_tokens: int
    shard_tokens: int
    max_document_tokens: int | None
    want_signatures: bool = False
    explain: bool = False
    """Record what ``--explain-drops`` needs (locations, ids as read) in each task's meta file."""
    newlines_before: dict[int, int] | None = None
    """Task index -> line breaks before the task's first byte (JSONL tasks inside a file; explain only)."""
    record_lang: bool = False
    """Record each stored document's detected language (the filters' ``info["lang"]``)."""
    progress: Any = None
    lock_fd: int | None = None
    parent_pid: int = 0


_W: _Job | None = None

#: Fault injection for the crash-consistency tests: ``POINT`` or ``POINT:N`` SIGKILLs the whole build
#: (main process and workers) the N-th time (default 1st) one process reaches that point.
CRASH_ENV = "H5CORPUS_TEST_CRASH_AT"
_crash_counts: dict[str, int] = {}


def _crash_point(point: str) -> None:
    want = os.environ.get(CRASH_ENV)
    if not want:
        return
    name, _, nth = want.partition(":")
    if name != point:
        return
    _crash_counts[point] = _crash_counts.get(point, 0) + 1
    if _crash_counts[point] == int(nth or 1):
        if _W is not None and _W.parent_pid:
            os.kill(_W.parent_pid, signal.SIGKILL)  # the build dies; workers follow (PDEATHSIG)
        os.kill(os.getpid(), signal.SIGKILL)


def _init_worker(job: _Job) -> None:
    global _W
    _W = job
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    if job.lock_fd is not None:
        try:
            os.close(job.lock_fd)  # the lock belongs to the main process alone
        except OSError:
            pass
    if sys.platform.startswith("linux"):
        try:  # die with the main process (kill -9 of the build leaves no orphan writers)
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass
        if job.parent_pid and os.getppid() != job.parent_pid:
            os._exit(1)


class _Progress:
    """Counters shared with workers: documents, tokens (an ``mp.Array('q', 2)``)."""

    def __init__(self, arr: Any) -> None:
        self.arr = arr

    def add(self, docs: int, tokens: int) -> None:
        if self.arr is not None:
            with self.arr.get_lock():
                self.arr[0] += docs
                self.arr[1] += tokens


def _p1_paths(state: Path, index: int) -> dict[str, Path]:
    stem = state / "p1" / f"{index:05d}"
    return {
        "record": stem.with_suffix(".json"),
        "docs": stem.with_suffix(".docs"),
        "sig": stem.with_suffix(".sig"),
        "meta": stem.with_suffix(".meta"),
        "cand": stem,
    }


def _p3_record_path(state: Path, index: int) -> Path:
    return state / "p3" / f"{index:05d}.json"


def _write_state_json(path: Path, obj: Any) -> None:
    """Atomic (temp file + rename) but not fsynced: every state file is verified by hash before
    reuse, so a record that outlived its data after a power loss is detected and redone."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


class _ShardSeq:
    """One split's documents of one task, in order, into shards of at most ``shard_tokens`` tokens
    (greedy, documents whole; a longer single document gets a shard of its own). Phase 1 and the
    phase 3 rewrite both use it, so a shard's boundaries depend only on the documents it holds."""

    def __init__(
        self,
        directory: Path,
        name: Any,
        split: str,
        identity: TokenizerIdentity,
        chunk_tokens: int,
        shard_tokens: int,
        syncer: _Syncer | None = None,
    ) -> None:
        # The writer does not fsync: each closed shard goes to ``syncer`` (a background thread that
        # fsyncs it while this process goes on tokenizing), or is fsynced by close() itself. The
        # build fsyncs the shards' folders before it writes the manifest that lists them.
        self.directory, self.name, self.split = directory, name, split
        self.identity, self.chunk_tokens, self.cap = identity, chunk_tokens, shard_tokens
        self.syncer = syncer
        self.w: ShardWriter | None = None
        self.infos: list[Any] = []

    def add(self, flat: np.ndarray, lengths: np.ndarray, ids: np.ndarray, flags: np.ndarray) -> None:
        i, n, pos = 0, lengths.size, 0
        while i < n:
            if self.w is None:
                self.w = ShardWriter(
                    self.directory / self.name(len(self.infos)),
                    split=self.split,
                    tokenizer=self.identity,
                    chunk_tokens=self.chunk_tokens,
                    fsync=False,
                )
            cs = np.cumsum(lengths[i:])
            k = int(np.searchsorted(cs, self.cap - self.w.tokens, side="right"))
            if k == 0:
                if self.w.tokens == 0:
                    k = 1
                else:
                    self._close()
                    continue
            take = int(cs[k - 1])
            self.w.add_documents(flat[pos : pos + take], lengths[i : i + k], ids[i : i + k], flags[i : i + k])
            pos += take
            i += k
            if self.w.tokens >= self.cap:
                self._close()

    def _close(self) -> None:
        if self.w is not None:
            info = self.w.close()
            self.infos.append(info)
            self.w = None
            if self.syncer is not None:
                self.syncer.submit(info.path)

    def close(self) -> list[Any]:
        self._close()
        if self.syncer is None:
            fsync_files([i.path for i in self.infos], dirs=False)
        return self.infos

    def abort(self) -> None:
        if self.w is not None:
            self.w.abort()
            self.w = None


class _Syncer:
    """fsync files on one background thread (fsync and the tokenizer both release the GIL, so the
    disk flush of one shard overlaps the encoding of the next). ``wait()`` returns once every
    submitted file is durable, re-raising the first error."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.ex = ThreadPoolExecutor(1, thread_name_prefix="h5corpus-fsync")
        self.futures: list[Any] = []

    def submit(self, path: Path) -> None:
        self.futures.append(self.ex.submit(fsync_files, [path], dirs=False))

    def wait(self) -> None:
        try:
            for f in self.futures:
                f.result()
        finally:
            self.futures.clear()
            self.ex.shutdown(wait=True)


class _LocatingReader(TaskReader):
    """A :class:`TaskReader` that also names where each record came from, for ``--explain-drops``:
    ``(file, "line", n)`` for JSONL (1-based line), ``(file, "row", n)`` for parquet (0-based row),
    ``(file, None, None)`` for ``.txt``. Call :meth:`location` right after a record is yielded.

    JSONL line numbers come from the reader's own ``where`` (the line it just parsed); the count of
    lines before the task's byte range is given (``newlines_before``, counted once per file by the
    main process) instead of re-reading the file prefix for every task."""

    def __init__(self, task: Task, text_field: str, newlines_before: int) -> None:
        super().__init__(task, text_field)
        self._newlines_before = int(newlines_before)
        self._where: Any = None

    def _line_base(self, path: str, first: int) -> int:  # type: ignore[override]
        t = self.task
        extra = 0
        if first > t.start:  # the partial line skipped at the start of the range
            with open(path, "rb") as fh:
                fh.seek(t.start)
                extra = fh.read(first - t.start).count(b"\n")
        return self._newlines_before + extra + 1

    def _jsonl_record(self, line: bytes, where: Any) -> Any:
        self._where = where
        return super()._jsonl_record(line, where)

    def location(self, ordinal: int) -> tuple[str, str | None, int | None]:
        """Where record number ``ordinal`` (0-based, bad records included) of the task is."""
        t = self.task
        if t.kind == "parquet":
            return t.files[0].name, "row", t.first_row + ordinal
        if t.kind == "text":
            return t.files[ordinal].name, None, None
        name, _, line = self._where().rpartition(":")
        return name, "line", int(line)


def _newlines_before(tasks: Sequence[Task]) -> dict[int, int]:
    """For every uncompressed-JSONL task that starts inside its file: the number of line breaks
    before its first byte (one sequential pass per file)."""
    out: dict[int, int] = {}
    by_file: dict[str, list[Task]] = {}
    for t in tasks:
        if t.kind == "jsonl" and t.start > 0:
            by_file.setdefault(t.files[0].path, []).append(t)
    for path, ts in by_file.items():
        ts.sort(key=lambda t: t.start)
        n = pos = 0
        with open(path, "rb") as fh:
            for t in ts:
                while pos < t.start:
                    b = fh.read(min(t.start - pos, 1 << 24))
                    if not b:
                        break
                    n += b.count(b"\n")
                    pos += len(b)
                out[t.index] = n
    return out


def _explain_line(
    doc_id: str,
    loc: tuple[str, str | None, int | None],
    reason: str,
    info: Mapping[str, Any] | None = None,
    dup_of: str | None = None,
) -> dict[str, Any]:
    """One ``--explain-drops`` record: id (sha256 hex of the text as read), source, line/row,
    reason, and what is known and cheap: the detected language, the stored copy of an exact duplicate."""
    d: dict[str, Any] = {"id": doc_id, "source": loc[0]}
    if loc[1] is not None:
        d[loc[1]] = loc[2]
    d["reason"] = reason
    if info and "lang" in info:
        d["lang"] = info["lang"]
        d["lang_prob"] = round(float(info["lang_prob"]), 4)
    if dup_of is not None:
        d["duplicate_of"] = dup_of
    return d


def _read_job(task: Task) -> dict[str, Any]:
    """Phase 1 for one task: read, filter, hash, dedup within the task, tokenize, and write every
    kept document into the task's *candidate* shards (in the state folder) plus a per-document
    table. Returns the completion record (also written to the state folder, last)."""
    J = _W
    assert J is not None
    c_start = time.process_time()  # per-step timings are CPU seconds of this (single-threaded) worker
    state = Path(J.state)
    paths = _p1_paths(state, task.index)
    shutil.rmtree(paths["cand"], ignore_errors=True)  # leftovers of a killed attempt
    paths["cand"].mkdir(parents=True)
    tmp = f".tmp{os.getpid()}"
    dtype = fmt.token_dtype(J.identity.vocab_size)
    eos = J.identity.eos_id
    eos_arr = np.array([eos], dtype=dtype)
    mdt = J.max_document_tokens
    prefix = _split_prefix(J.seed)
    threshold = _split_threshold(J.fraction)
    filters = J.filters
    # Signatures are only computed when phase 2 has a near-duplicate index to feed them to.
    sig_fn = getattr(filters, "signature", None) if J.want_signatures else None
    batch_fn = getattr(filters, "process_batch", None) if filters is not None else None
    has_counters = filters is not None and callable(getattr(filters, "counters", None))
    counters0 = dict(filters.counters()) if has_counters else {}
    has_timings = filters is not None and callable(getattr(filters, "timings", None))
    timings0 = dict(filters.timings()) if has_timings else {}
    progress = _Progress(J.progress)
    sha256 = hashlib.sha256
    clock = time.process_time
    secs = {"filter": 0.0, "encode": 0.0, "write": 0.0}

    def split_of(doc_id: bytes) -> int:
        return 1 if int.from_bytes(sha256(prefix + doc_id).digest()[:8], "big") < threshold else 0

    counts = [{"duplicates": 0, "skipped": 0, "filtered": {}} for _ in fmt.SPLITS]
    skip_codes: dict[str, int] = {}
    listed: list[str] = []
    skipped_total = 0
    seen: set[bytes] = set()
    sigs: list[Any] = []
    explain = J.explain
    ex_drops: list[tuple[int, dict[str, Any]]] = []  # (record ordinal, explain line) of drops here
    ex_rows: list[list[Any]] = []  # per table row: [ordinal, id as read, source, "line"/"row", n, lang, prob]
    row_lang: list[str | None] | None = [] if J.record_lang else None
    n_docs = 0
    n_tokens = 0
    doc_hash = sha256()
    b_texts: list[str] = []
    b_ids: list[bytes] = []
    b_chars: list[int] = []
    b_split: list[int] = []
    b_size = 0
    syncer = _Syncer()
    seqs = [
        _ShardSeq(
            paths["cand"],
            (lambda n, s=split: f"{s}-{n:03d}.h5"),
            split,
            J.identity,
            J.chunk_tokens,
            J.shard_tokens,
            syncer,
        )
        for split in fmt.SPLITS
    ]
    docs_tmp = paths["docs"].with_name(paths["docs"].name + tmp)
    docs_fh = open(docs_tmp, "wb")

    def flush() -> None:
        nonlocal n_docs, n_tokens, b_size
        if not b_texts:
            return
        c0 = clock()
        arrs = J.encoder.encode_batch(b_texts)
        c1 = clock()
        secs["encode"] += c1 - c0
        n = len(arrs)
        full = np.fromiter((a.size + 1 for a in arrs), dtype=np.int64, count=n)
        stored = np.minimum(full, mdt) if mdt else full
        flags = (stored < full).astype(np.uint8) * fmt.FLAG_TRUNCATED
        split = np.asarray(b_split, dtype=np.uint8)
        ids = np.frombuffer(b"".join(b_ids), dtype=np.uint8).reshape(n, fmt.DOC_ID_BYTES)
        for s in (0, 1):
            sel = np.flatnonzero(split == s)
            if not sel.size:
                continue
            lens = stored[sel]
            if not flags[sel].any():  # every document whole: its ids, then EOS
                parts = []
                for i in sel.tolist():
                    parts.append(arrs[i])
                    parts.append(eos_arr)
                flat = np.concatenate(parts, dtype=dtype, casting="unsafe")
            else:
                flat = np.empty(int(lens.sum()), dtype=dtype)
                pos = 0
                for i in sel.tolist():
                    a = arrs[i]
                    m = int(stored[i])
                    if m == a.size + 1:
                        flat[pos : pos + m - 1] = a
                        flat[pos + m - 1] = eos
                    else:  # cut at max_document_tokens: the first m ids, no EOS
                        flat[pos : pos + m] = a[:m]
                    pos += m
            try:
                seqs[s].add(flat, lens, ids[sel], flags[sel])
            except ValueError as e:  # the writer refused the ids (out of range, EOS inside a document)
                raise BuildError(f"{task.label}: tokenizer output cannot be stored: {e}") from None
        rows = np.empty(n, dtype=DOC_DTYPE)
        rows["id"] = np.frombuffer(b"".join(b_ids), dtype="V32")
        rows["tokens"] = stored
        rows["chars"] = b_chars
        rows["split"] = split
        rows["flags"] = flags
        rb = rows.tobytes()
        docs_fh.write(rb)
        doc_hash.update(rb)
        n_docs += n
        n_tokens += int(stored.sum())
        progress.add(n, int(stored.sum()))
        b_texts.clear(), b_ids.clear(), b_chars.clear(), b_split.clear()
        b_size = 0
        secs["write"] += clock() - c1

    try:

        def keep(
            text: str,
            data: bytes,
            sig: Any = None,
            info: Mapping[str, Any] | None = None,
            ordinal: int = 0,
            loc: Any = None,
            read_id: bytes | None = None,
        ) -> None:
            """A document past the filters: id, split, empty/duplicate checks, encode batch.
            ``read_id``: id of the text as read, when the filters changed it."""
            doc_id = sha256(data).digest()
            s = split_of(doc_id)
            if not text:
                counts[s]["skipped"] += 1
                skip_codes["empty"] = skip_codes.get("empty", 0) + 1
                if explain:
                    ex_drops.append((ordinal, _explain_line((read_id or doc_id).hex(), loc, "empty", info)))
                return
            if doc_id in seen:
                counts[s]["duplicates"] += 1
                if explain:
                    ex_drops.append(
                        (ordinal, _explain_line((read_id or doc_id).hex(), loc, "exact_dup", info, dup_of=doc_id.hex()))
                    )
                return
            seen.add(doc_id)
            if sig_fn is not None:
                sigs.append(sig if sig is not None else sig_fn(text))
            if row_lang is not None:
                row_lang.append(info.get("lang") if info else None)
            if explain:
                lang = info.get("lang") if info else None
                ex_rows.append(
                    [
                        ordinal,
                        (read_id or doc_id).hex(),
                        loc[0],
                        loc[1],
                        loc[2],
                        lang,
                        None if lang is None else round(float(info["lang_prob"]), 4),
                    ]
                )  # type: ignore[index]
            push(text, doc_id, s)

        def push(text: str, doc_id: bytes, s: int) -> None:
            """Queue a kept document for the next encode batch."""
            nonlocal b_size
            b_texts.append(text)
            b_ids.append(doc_id)
            b_chars.append(len(text))
            b_split.append(s)
            b_size += len(text)
            if len(b_texts) >= _ENCODE_BATCH_DOCS or b_size >= _ENCODE_BATCH_CHARS:
                flush()

        def filtered(
            text: str,
            data: bytes,
            new: str | None,
            reason: str | None,
            sig: Any = None,
            info: Mapping[str, Any] | None = None,
            ordinal: int = 0,
            loc: Any = None,
        ) -> None:
            if new is None:
                read_id = sha256(data).digest()
                c = counts[split_of(read_id)]["filtered"]
                r = str(reason or "filtered")
                c[r] = c.get(r, 0) + 1
                if explain:
                    ex_drops.append((ordinal, _explain_line(read_id.hex(), loc, r, info)))
                return
            if new is text:
                keep(new, data, sig, info, ordinal, loc)
            else:
                keep(
                    new,
                    new.encode("utf-8"),
                    sig,
                    info,
                    ordinal,
                    loc,
                    read_id=sha256(data).digest() if explain else None,
                )

        # documents waiting for a filters.process_batch call: (text, data, ordinal, location)
        pending: list[tuple[str, bytes, int, Any]] = []
        pending_chars = 0

        def drain() -> None:
            nonlocal pending_chars
            if pending:
                c0 = clock()
                results = batch_fn([p[0] for p in pending], signatures=sig_fn is not None)
                secs["filter"] += clock() - c0
                for (text, data, k, loc), r in zip(pending, results):
                    filtered(
                        text, data, r.text, r.reason, getattr(r, "signature", None), getattr(r, "info", None), k, loc
                    )
                pending.clear()
                pending_chars = 0

        reader = (
            _LocatingReader(task, J.text_field, (J.newlines_before or {}).get(task.index, 0))
            if explain
            else TaskReader(task, J.text_field)
        )
        loc: Any = None

        def bad(rec: BadRecord) -> None:
            nonlocal skipped_total
            if J.on_error == "fail":
                raise BuildError(f"{rec} (pass --on-error skip to skip and count bad records)")
            s = split_of(sha256(rec.where.encode()).digest())
            counts[s]["skipped"] += 1
            skip_codes[rec.code] = skip_codes.get(rec.code, 0) + 1
            skipped_total += 1
            if len(listed) < MAX_LISTED:
                listed.append(str(rec))

        if filters is None and not explain:
            # The plain build: keep() inlined (same decisions, in the same order), ~2x less Python
            # per document, which matters next to a tokenizer that does ~1 us of work per token.
            for rec in reader:
                if type(rec) is not tuple:
                    bad(rec)  # type: ignore[arg-type]
                    continue
                text, data = rec
                doc_id = sha256(data).digest()
                s = 1 if int.from_bytes(sha256(prefix + doc_id).digest()[:8], "big") < threshold else 0
                if not text:
                    counts[s]["skipped"] += 1
                    skip_codes["empty"] = skip_codes.get("empty", 0) + 1
                    continue
                if doc_id in seen:
                    counts[s]["duplicates"] += 1
                    continue
                seen.add(doc_id)
                push(text, doc_id, s)
        for k, rec in enumerate(() if filters is None and not explain else reader):
            if isinstance(rec, BadRecord):
                bad(rec)
                continue
            text, data = rec
            if explain:
                loc = reader.location(k)  # type: ignore[attr-defined]
            if batch_fn is not None:
                pending.append((text, data, k, loc))
                pending_chars += len(text)
                if len(pending) >= _FILTER_BATCH_DOCS or pending_chars >= _FILTER_BATCH_CHARS:
                    drain()
            elif filters is not None:
                c0 = clock()
                new, reason = filters.process(text)
                info = getattr(filters, "last_info", None)
                secs["filter"] += clock() - c0
                filtered(text, data, new, reason, None, info, k, loc)
            else:
                keep(text, data, None, None, k, loc)
        drain()
        flush()
        cands = [info.with_path(Path(info.path).name).to_json() for seq in seqs for info in seq.close()]
        syncer.wait()  # every candidate durable before the record that lists it
        _crash_point("read-candidates")
        docs_fh.close()
        os.replace(docs_tmp, paths["docs"])
        sig_sha = None
        if sig_fn is not None:
            blob = pickle.dumps(sigs, protocol=4)
            sig_tmp = paths["sig"].with_name(paths["sig"].name + tmp)
            sig_tmp.write_bytes(blob)
            os.replace(sig_tmp, paths["sig"])
            sig_sha = hashlib.sha256(blob).hexdigest()
        meta_sha = None
        if row_lang is not None or explain:
            meta = {"lang": row_lang, "explain": {"drops": ex_drops, "rows": ex_rows} if explain else None}
            blob = json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            meta_tmp = paths["meta"].with_name(paths["meta"].name + tmp)
            meta_tmp.write_bytes(blob)
            os.replace(meta_tmp, paths["meta"])
            meta_sha = hashlib.sha256(blob).hexdigest()
    except BaseException:
        syncer.ex.shutdown(wait=False)
        for seq in seqs:
            seq.abort()
        docs_fh.close()
        docs_tmp.unlink(missing_ok=True)
        raise
    fc: dict[str, int] = {}
    if has_counters:
        after = dict(filters.counters())
        fc = {k: int(v) - int(counters0.get(k, 0)) for k, v in after.items()}
    total = time.process_time() - c_start
    seconds = {"total": total, "read": total - sum(secs.values()), **secs}
    if has_timings:
        for k2, v in filters.timings().items():
            seconds[f"filter:{k2}"] = float(v) - float(timings0.get(k2, 0.0))
    record = {
        "state_version": _STATE_VERSION,
        "task": task.key,
        "index": task.index,
        "encoder": J.encoder.name,
        "explain": explain,
        "documents": n_docs,
        "tokens": n_tokens,
        "files": {"docs": doc_hash.hexdigest(), "sig": sig_sha, "meta": meta_sha},
        "candidates": cands,
        "counts": {split: counts[i] for i, split in enumerate(fmt.SPLITS)},
        "skipped_total": skipped_total,
        "skip_codes": skip_codes,
        "skipped_records": listed,
        "filter_counters": fc,
        "seconds": {k2: round(v, 4) for k2, v in seconds.items()},
    }
    _write_state_json(paths["record"], record)
    _crash_point("read-record")
    return record


def _task_shard_files(shards_dir: Path, index: int) -> list[Path]:
    out = []
    for split in fmt.SPLITS:
        d = shards_dir / split
        if d.is_dir():
            out.extend(sorted(d.glob(f"{split}-{index:05d}-*.h5*")))
    return out


def _shards_intact(
    directory: Path, shards: Sequence[Mapping[str, Any]], identity: TokenizerIdentity, chunk_tokens: int
) -> bool:
    """True when every listed shard (paths relative to ``directory``) is on disk and matches its hashes."""
    from ..storage.validate import ShardExpectation, check_shard

    expect = ShardExpectation.of(identity, chunk_tokens)
    for s in shards:
        findings, _ = check_shard(str(directory / s["path"]), ShardRecord.from_json(s, "state record"), expect)
        if findings:
            return False
    return True


def _final_name(split: str, index: int, n: int) -> str:
    return f"{split}/{split}-{index:05d}-{n:03d}.h5"


def _finish_job(
    index: int, key: str, decision: np.ndarray, p1: dict[str, Any], p1_reused: bool, reuse: dict[str, Any] | None
) -> dict[str, Any]:
    """Phase 3 for one task: its final shards. Reuses a completed write record whose shards verify;
    else, when the task keeps every candidate document, renames the candidate shards into place;
    else writes a filtered copy of them. Returns the write record, or ``{"candidates_missing": True}``
    when the candidates are gone or damaged (the task is then read again)."""
    J = _W
    assert J is not None
    state = Path(J.state)
    shards_dir = Path(J.shards_dir)
    dec_sha = hashlib.sha256(decision.tobytes()).hexdigest()
    if reuse is not None and reuse.get("task") == key and reuse.get("decision_sha256") == dec_sha:
        if _shards_intact(shards_dir, reuse["shards"], J.identity, J.chunk_tokens):
            return dict(reuse, reused=True)
    for p in _task_shard_files(shards_dir, index):
        p.unlink(missing_ok=True)
    cand_dir = _p1_paths(state, index)["cand"]
    cands = [dict(c, path=c["path"]) for c in p1["candidates"]]
    present = all(
        (cand_dir / c["path"]).is_file() and (cand_dir / c["path"]).stat().st_size == c["bytes"] for c in cands
    )
    if not present or (p1_reused and not _shards_intact(cand_dir, cands, J.identity, J.chunk_tokens)):
        return {"candidates_missing": True}
    shards: list[dict[str, Any]] = []
    if bool((decision != 0).all()):
        for c in cands:
            n = int(Path(c["path"]).stem.rsplit("-", 1)[1])
            rel = _final_name(c["split"], index, n)
            (shards_dir / c["split"]).mkdir(parents=True, exist_ok=True)
            os.replace(cand_dir / c["path"], shards_dir / rel)
            shards.append(dict(c, path=rel))
            _crash_point("finish-renamed")
    elif (decision != 0).any():
        docs = np.fromfile(_p1_paths(state, index)["docs"], dtype=DOC_DTYPE)
        for s, split in enumerate(fmt.SPLITS):
            keep = decision[docs["split"] == s] != 0
            if not keep.any():
                continue
            seq = _ShardSeq(
                shards_dir,
                (lambda n, sp=split: _final_name(sp, index, n)),
                split,
                J.identity,
                J.chunk_tokens,
                J.shard_tokens,
            )
            at = 0  # position of the current candidate shard's first document among this split's documents
            try:
                for c in (c for c in cands if c["split"] == split):
                    k = keep[at : at + int(c["documents"])]
                    at += int(c["documents"])
                    if not k.any():
                        continue
                    with h5py.File(cand_dir / c["path"], "r") as f:
                        offs = f[fmt.DOC_OFFSETS][:]
                        ids = f[fmt.DOC_IDS][:]
                        flags = f[fmt.DOC_FLAGS][:]
                        tokens = f[fmt.TOKENS]
                        sel = np.flatnonzero(k)
                        lens = (offs[1:] - offs[:-1])[sel]
                        # Read in blocks of ~8M tokens; gather the kept documents' tokens.
                        i = 0
                        while i < sel.size:
                            j = i + max(1, int(np.searchsorted(np.cumsum(lens[i:]), 8 << 20, side="right")))
                            lo, hi = int(offs[sel[i]]), int(offs[sel[j - 1] + 1])
                            block = tokens[lo:hi]
                            part = lens[i:j]
                            rel = np.repeat(offs[sel[i:j]] - lo - (np.cumsum(part) - part), part)
                            seq.add(
                                block[rel + np.arange(int(part.sum()), dtype=np.int64)],
                                part,
                                ids[sel[i:j]],
                                flags[sel[i:j]],
                            )
                            i = j
                for info in seq.close():
                    shards.append(info.relative_to(shards_dir).to_json())
                    _crash_point("finish-copied")
            except BaseException:
                seq.abort()
                raise
    record = {"task": key, "index": index, "decision_sha256": dec_sha, "shards": shards}
    _write_state_json(_p3_record_path(state, index), record)
    _crash_point("finish-record")
    shutil.rmtree(cand_dir, ignore_errors=True)
    return dict(record, reused=False)


# -- phase 2 ------------------------------------------------------------------------------------
class _Decider:
    """Global decisions in input order: exact dedup, near-dedup, budgets. Deterministic."""

    def __init__(self, cfg: BuildConfig) -> None:
        self.seen = _SeenIds()
        f = cfg.filters
        # A filters object may return None here: near-dedup is off.
        self.index = (
            f.near_duplicate_index() if f is not None and callable(getattr(f, "near_duplicate_index", None)) else None
        )
        b = cfg.max_tokens or {}
        self.budget = [b.get(s) for s in fmt.SPLITS]
        self.used = [0, 0]
        frac = float(cfg.validation_fraction)
        # A split that can receive no document needs nothing; reading stops only when every
        # split that can receive documents has a budget and it is filled.
        self.needs = [frac < 1.0, frac > 0.0]
        self.splits = {s: _empty_split() for s in fmt.SPLITS}
        self.languages = _filters_detect_language(f)
        """Count stored documents per detected language (``splits.<split>.languages``)."""
        if self.languages:
            for st in self.splits.values():
                st["languages"] = {}
        self.explain = cfg.explain_drops is not None

    @property
    def can_stop_early(self) -> bool:
        """Every split that can receive documents has a budget (so reading may stop before the end)."""
        return all((not need) or b is not None for b, need in zip(self.budget, self.needs))

    @property
    def filled(self) -> bool:
        return all((not need) or (b is not None and u >= b) for b, u, need in zip(self.budget, self.used, self.needs))

    def feed(
        self, docs: np.ndarray, sigs: list[Any] | None, rec: Mapping[str, Any], meta: Mapping[str, Any] | None = None
    ) -> tuple[np.ndarray, list[dict[str, Any]]]:
        """Decide one task's documents (table order): 0 = not stored, 1 = train, 2 = validation.
        Also returns the task's ``--explain-drops`` lines in input order (when asked for)."""
        for split in fmt.SPLITS:
            c = rec["counts"][split]
            st = self.splits[split]
            for k in ("duplicates", "skipped"):
                st[k] += int(c[k])
            for r, n in c["filtered"].items():
                st["dropped"][r] = st["dropped"].get(r, 0) + int(n)
        ids = docs["id"]
        dup = self.seen.contains(ids) if ids.size else np.zeros(0, bool)
        self.seen.add(ids[~dup])
        near = np.zeros(ids.size, dtype=bool)
        if self.index is not None and sigs is not None:
            for i in np.flatnonzero(~dup).tolist():
                if self.index.add(sigs[i]):
                    near[i] = True
        stored = docs["tokens"]
        split = docs["split"]
        keep = ~dup & ~near
        over = np.zeros(ids.size, dtype=bool)
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
        decision = np.where(keep, split.astype(np.uint8) + 1, 0).astype(np.uint8)
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
        lines: list[dict[str, Any]] = []
        if self.explain:
            ex = (meta or {}).get("explain") or {}
            rows = ex.get("rows") or []
            mine: list[tuple[int, dict[str, Any]]] = []
            for i in np.flatnonzero(dup | near | over).tolist():
                o, read_id, src, lk, lv, lang, prob = rows[i]
                reason = "exact_dup" if dup[i] else "near_dup" if near[i] else "over_budget"
                info = {"lang": lang, "lang_prob": prob} if lang is not None else None
                mine.append(
                    (
                        o,
                        _explain_line(
                            read_id, (src, lk, lv), reason, info, dup_of=bytes(ids[i]).hex() if dup[i] else None
                        ),
                    )
                )
            merged = sorted([tuple(x) for x in ex.get("drops") or []] + mine, key=lambda x: x[0])
            lines = [d for _, d in merged]
        return decision, lines

    def finish(self) -> None:
        """Fold the dedup stages into ``dropped`` and sort the per-split mappings."""
        for st in self.splits.values():
            d = st["dropped"]
            if st["duplicates"]:
                d["exact_dup"] = int(st["duplicates"])
            if st["near_duplicates"]:
                d["near_dup"] = int(st["near_duplicates"])
            st["dropped"] = dict(sorted(d.items()))
            if "languages" in st:
                st["languages"] = dict(sorted(st["languages"].items()))


def _filters_detect_language(f: Any) -> bool:
    """True when the filters run language ID (a :class:`h5corpus.filters.DocumentFilter` with
    ``lang``, or any object whose ``config.lang`` is set)."""
    return bool(getattr(getattr(f, "config", None), "lang", None))


# -- the build ----------------------------------------------------------------------------------
def _mp_context():
    import multiprocessing as mp

    # fork: workers inherit the loaded encoder and filters (no re-import, no pickling). Safe here:
    # the main process holds no open HDF5 file and has started no thread pool when it forks.
    return mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")


class _Pool:
    """A process pool whose results arrive on a queue as (kind, task index, result | exception)."""

    def __init__(self, n: int, job: _Job) -> None:
        self.q: queue.Queue = queue.Queue()
        self.pool = _mp_context().Pool(n, initializer=_init_worker, initargs=(job,))
        self.pids = {p.pid for p in getattr(self.pool, "_pool", [])}
        self.outstanding = 0

    def submit(self, kind: str, index: int, fn: Any, *args: Any) -> None:
        self.outstanding += 1
        self.pool.apply_async(
            fn,
            args,
            callback=lambda r: self.q.put((kind, index, r)),
            error_callback=lambda e: self.q.put((kind, index, e)),
        )

    def get(self, timeout: float) -> tuple[str, int, Any] | None:
        try:
            item = self.q.get(timeout=timeout)
        except queue.Empty:
            # multiprocessing.Pool silently replaces a dead worker and never returns its job:
            # notice the death instead of waiting forever.
            # Workers never exit during a build, so a changed worker set means one died.
            procs = list(getattr(self.pool, "_pool", []))
            if {p.pid for p in procs} != self.pids or any(p.exitcode is not None for p in procs):
                raise BuildError(
                    "a worker process died (killed, or out of memory?); completed work is kept: "
                    "re-run the same command to resume"
                ) from None
            return None
        self.outstanding -= 1
        return item

    def close(self, wait: bool, join: bool = True) -> None:
        """Stop the workers: let them finish (``wait``) or terminate them; ``join`` waits for their
        exit (else call :meth:`join` later: exiting takes a few ms that can overlap other work)."""
        if wait:
            self.pool.close()
        else:
            self.pool.terminate()
        if join:
            self.pool.join()

    def join(self) -> None:
        self.pool.join()


def _read_p1(state: Path, task: Task) -> dict[str, Any] | None:
    """A task's read record, if present, for this task's input, with its table intact."""
    p = _p1_paths(state, task.index)
    try:
        rec = json.loads(p["record"].read_text())
    except (OSError, ValueError):
        return None
    if rec.get("state_version") != _STATE_VERSION or rec.get("task") != task.key or not p["docs"].exists():
        return None
    if _sha256_file(p["docs"]) != rec["files"]["docs"]:
        return None
    for k in ("sig", "meta"):
        if rec["files"].get(k) and (not p[k].exists() or _sha256_file(p[k]) != rec["files"][k]):
            return None
    return rec


def _load_docs(
    state: Path, task: Task, rec: Mapping[str, Any]
) -> tuple[np.ndarray, list[Any] | None, dict[str, Any] | None]:
    """A read task's table, signatures and meta (languages, explain data), hash-checked."""
    p = _p1_paths(state, task.index)
    raw = p["docs"].read_bytes()
    if hashlib.sha256(raw).hexdigest() != rec["files"]["docs"]:
        raise BuildConflict(
            f"{p['docs']}: a build state file changed during the build (is another process writing there?)"
        )
    docs = np.frombuffer(raw, dtype=DOC_DTYPE)
    sigs = pickle.loads(p["sig"].read_bytes()) if rec["files"].get("sig") else None
    meta = None
    if rec["files"].get("meta"):
        mraw = p["meta"].read_bytes()
        if hashlib.sha256(mraw).hexdigest() != rec["files"]["meta"]:
            raise BuildConflict(
                f"{p['meta']}: a build state file changed during the build (is another process writing there?)"
            )
        meta = json.loads(mraw)
    return docs, sigs, meta


def _sample_texts(tasks: Sequence[Task], text_field: str, limit_chars: int, per_task: int) -> list[str]:
    """The first documents of each task in input order (whole documents, the last one of a task
    cut at a line break), up to ``per_task`` characters per task and ``limit_chars`` in all."""
    out: list[str] = []
    total = 0
    for t in tasks:
        here = 0
        for rec in TaskReader(t, text_field):
            if isinstance(rec, BadRecord) or not rec[0]:
                continue
            text = rec[0]
            room = min(per_task - here, limit_chars - total)
            if len(text) > room:
                cut = text.rfind("\n", 0, room)
                text = text[: cut if cut > 0 else room]
            out.append(text)
            here += len(text)
            total += len(text)
            if here >= per_task or total >= limit_chars or len(text) < len(rec[0]):
                break
        if total >= limit_chars:
            break
    return out


def _ours(p: Path) -> bool:
    return bool(SHARD_NAME.match(p.name)) and p.parent.name == p.name.split("-", 1)[0]


def _our_shard_files(shards_dir: Path) -> list[Path]:
    out: list[Path] = []
    for split in fmt.SPLITS:
        d = shards_dir / split
        if d.is_dir():
            out.extend(p for p in sorted(d.iterdir()) if _ours(p) or p.name.endswith(".h5" + PARTIAL_SUFFIX))
    return out


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

    Raises ValueError (bad settings), :class:`~h5corpus.tokenize.TokenizerError` /
    :class:`~h5corpus.sources.SourceError` (spec cannot be resolved), :class:`BuildConflict`
    (lock held, output built otherwise) and :class:`BuildError` (bad input under
    ``on_error="fail"``; completed work is kept, so fixing the input and re-running resumes).
    """
    t_start = time.perf_counter()
    cfg = config
    cfg.check()
    tok = load_tokenizer(cfg.tokenizer, eos_token=cfg.eos_token, cache_dir=cfg.hf_cache_dir)
    ident = tok.identity
    inputs = resolve_sources(list(cfg.sources), hf_cache_dir=cfg.hf_cache_dir)
    shards_dir = Path(cfg.shards_dir).absolute()
    manifest_path = Path(cfg.manifest).absolute()
    state = shards_dir / STATE_DIR
    workers = max(1, int(cfg.workers or os.cpu_count() or 1))
    settings = cfg.settings()
    sources_desc = {"inputs": [i.describe() for i in inputs]}
    run_id = {"settings": settings, "tokenizer": ident.to_json(), "sources": list(cfg.sources)}
    fingerprint = hashlib.sha256(_canonical({"run": run_id, "sources": sources_desc})).hexdigest()

    with _Lock(shards_dir / LOCK_FILE) as lock:
        if cfg.overwrite:
            manifest_path.unlink(missing_ok=True)
            shutil.rmtree(state, ignore_errors=True)
            for p in _our_shard_files(shards_dir):
                p.unlink(missing_ok=True)
        resumed = state.is_dir() and (state / "plan.json").exists()
        if resumed:
            try:
                plan = json.loads((state / "plan.json").read_text())
            except ValueError:
                plan = {}
            if plan.get("run") != run_id:
                old = plan.get("run") or {}
                if old.get("tokenizer") and not TokenizerIdentity.from_json(old["tokenizer"]).same_ids(ident):
                    raise _tokenizer_conflict(state, TokenizerIdentity.from_json(old["tokenizer"]), ident)
                raise BuildConflict(
                    f"{state} holds an interrupted build with other settings ({_diff_keys(old.get('settings') or {}, settings)}"
                    f"{'; sources ' + repr(old.get('sources')) if old.get('sources') != list(cfg.sources) else ''}); "
                    "re-run that build to finish it, or pass --overwrite to start over"
                )
        else:
            if manifest_path.exists():
                m = read_manifest(manifest_path)
                if not m.tokenizer.same_ids(ident):
                    raise _tokenizer_conflict(manifest_path, m.tokenizer, ident)
                b = m.extra.get("build") or {}
                if b.get("fingerprint") == fingerprint:
                    gone = [
                        e.path
                        for e in m.shards
                        if not m.shard_path(e).is_file() or m.shard_path(e).stat().st_size != e.bytes
                    ]
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
                    return _report_from_manifest(m, shards_dir, time.perf_counter() - t_start)
                raise BuildConflict(
                    f"{manifest_path} exists and was built from other inputs or settings "
                    f"({_diff_keys(b.get('settings') or {}, settings)}); pass --overwrite to replace it, "
                    "or choose another --manifest/--shards-dir"
                )
            stray = [p for p in _our_shard_files(shards_dir) if not p.name.endswith(PARTIAL_SUFFIX)]
            if stray:
                raise BuildConflict(
                    f"{shards_dir} already holds {len(stray)} shard files ({stray[0].name}, ...) that no manifest or "
                    "interrupted build here accounts for; pass --overwrite to delete them, or choose another --shards-dir"
                )
            shutil.rmtree(state, ignore_errors=True)  # a state folder without its plan cannot be trusted
            for sub in ("p1", "p3"):
                (state / sub).mkdir(parents=True, exist_ok=True)
            write_json_atomic(state / "plan.json", {"run": run_id})
        for sub in ("p1", "p3"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        for p in list((state / "p1").glob("*.tmp*")):
            p.unlink(missing_ok=True)
        for p in _our_shard_files(shards_dir):
            if p.name.endswith(PARTIAL_SUFFIX):
                p.unlink(missing_ok=True)

        tasks = plan_tasks(inputs, task_bytes=int(cfg.task_bytes))
        return _run(
            cfg,
            tok,
            inputs,
            tasks,
            shards_dir,
            manifest_path,
            state,
            workers,
            settings,
            sources_desc,
            fingerprint,
            resumed,
            lock,
            t_start,
        )


def _run(
    cfg: BuildConfig,
    tok: Tokenizer,
    inputs: list[Input],
    tasks: list[Task],
    shards_dir: Path,
    manifest_path: Path,
    state: Path,
    workers: int,
    settings: dict[str, Any],
    sources_desc: dict[str, Any],
    fingerprint: str,
    resumed: bool,
    lock: _Lock,
    t_start: float,
) -> BuildReport:
    ident = tok.identity
    T = len(tasks)
    workers = min(workers, max(T, 1))
    # Encoder: a fast one if the tokenizer allows it; proven on a sample below before any of its
    # output is used. Records made by another encoder than the final one are redone.
    encoder: Encoder = HFEncoder(tok)
    note = ""
    fast: Encoder | None = None
    if cfg.fast_path:
        fast, why = fast_encoder(tok)
        if fast is None:
            note = f"fast path not applicable: {why}"
        else:
            encoder = fast
    p1: dict[int, dict[str, Any]] = {}
    for t in tasks:
        rec = _read_p1(state, t)
        if rec is not None:
            p1[t.index] = rec
    p1_before = set(p1)  # records from an interrupted run: their candidate shards are re-hashed before use
    p3_old: dict[int, dict[str, Any]] = {}
    for t in tasks:
        try:
            r = json.loads(_p3_record_path(state, t.index).read_text())
            if r.get("task") == t.key:
                p3_old[t.index] = r
        except (OSError, ValueError):
            pass

    progress_arr = _mp_context().Array("q", 2) if cfg.progress else None
    decider = _Decider(cfg)
    in_order = decider.can_stop_early
    explain = cfg.explain_drops is not None
    newlines = _newlines_before(tasks) if explain else None
    warm_up = getattr(cfg.filters, "warm_up", None)
    if callable(warm_up):
        warm_up()  # load models once, before forking: the workers share them
    report = BuildReport(
        manifest=str(manifest_path),
        shards_dir=str(shards_dir),
        tokenizer=ident.to_json(),
        splits={},
        tasks=T,
        resumed=resumed,
    )

    def make_job(enc: Encoder) -> _Job:
        return _Job(
            encoder=enc,
            identity=ident,
            state=str(state),
            shards_dir=str(shards_dir),
            text_field=cfg.text_field,
            seed=int(cfg.split_seed),
            fraction=float(cfg.validation_fraction),
            on_error=cfg.on_error,
            filters=cfg.filters,
            chunk_tokens=int(cfg.chunk_tokens),
            shard_tokens=int(cfg.shard_tokens),
            max_document_tokens=cfg.max_document_tokens,
            progress=progress_arr,
            lock_fd=lock.fd,
            parent_pid=os.getpid(),
            want_signatures=decider.index is not None and callable(getattr(cfg.filters, "signature", None)),
            explain=explain,
            newlines_before=newlines,
            record_lang=decider.languages,
        )

    def usable(rec: Mapping[str, Any]) -> bool:
        # A record from an interrupted run without --explain-drops lacks the locations: read again.
        return rec["encoder"] in ("tokenizers", encoder.name) and (rec.get("explain") or not explain)

    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(
            total=None, unit="tok", unit_scale=True, desc="build", file=sys.stderr, dynamic_ncols=True, mininterval=0.25
        )
    explain_path = Path(cfg.explain_drops).absolute() if cfg.explain_drops is not None else None
    explain_tmp = explain_path.with_name(f".{explain_path.name}.tmp{os.getpid()}") if explain_path else None
    if explain_path is not None and explain_path.parent.is_dir():
        for p in explain_path.parent.glob(f".{explain_path.name}.tmp*"):
            if p.name[len(explain_path.name) + 5 :].isdigit():
                p.unlink(missing_ok=True)  # left by a killed build
    explain_fh = None  # opened at the first decision (after every fork of the pool)
    pool = _Pool(workers, make_job(encoder))
    proof_done = fast is None or encoder is not fast
    try:
        # Work lists. A read record made by an encoder not (yet) proven waits for the proof.
        order = [t.index for t in tasks]
        if not in_order:
            order.sort(key=lambda i: (-tasks[i].nbytes, i))  # longest first balances the workers
        to_read = [i for i in order if i not in p1]
        read_pending: set[int] = set()
        window = workers + 1 if in_order else T

        def submit_reads() -> None:
            while to_read and len(read_pending) < window and cut is None:
                i = to_read.pop(0)
                read_pending.add(i)
                pool.submit("read", i, _read_job, tasks[i])

        cut: int | None = None
        submit_reads()
        if not proof_done:
            assert fast is not None
            sample = _sample_texts(tasks, cfg.text_field, PROOF_SAMPLE_CHARS, PROOF_SAMPLE_TASK_CHARS)
            diff = prove_same_ids(HFEncoder(tok), fast, sample)
            proof_done = True
            if diff is not None:
                # Not equal: drop everything the fast encoder made, restart on tokenizers.
                note = f"fast path ({fast.name}) disabled: {diff}"
                pool.close(wait=False)
                encoder = HFEncoder(tok)
                for i in [i for i, r in p1.items() if not usable(r)]:
                    del p1[i]
                to_read = [i for i in order if i not in p1]
                read_pending.clear()
                pool = _Pool(workers, make_job(encoder))
                submit_reads()
        for i in [i for i, r in p1.items() if not usable(r)]:
            del p1[i]
            if i not in read_pending and i not in to_read:
                to_read.append(i)
        submit_reads()
        report.encoder = encoder.name
        report.encoder_note = note
        report.tasks_reused = sum(1 for i in p1)

        decisions: dict[int, np.ndarray] = {}
        p3: dict[int, dict[str, Any]] = {}
        write_pending: set[int] = set()
        reread_then_write: set[int] = set()
        next_decide = 0
        last_tok = 0
        while True:
            # Phase 2 in input order, as far as read records allow.
            while cut is None and next_decide < T and next_decide in p1:
                i = next_decide
                rec = p1[i]
                if cfg.on_error == "fail" and rec["skipped_total"]:
                    raise BuildError(
                        f"{rec['skipped_records'][0]} (recorded by an earlier run with --on-error skip; "
                        "pass --on-error skip, or fix the input)"
                    )
                docs, sigs, meta = _load_docs(state, tasks[i], rec)
                decisions[i], lines = decider.feed(docs, sigs, rec, meta)
                if explain_tmp is not None:
                    if explain_fh is None:
                        explain_tmp.parent.mkdir(parents=True, exist_ok=True)
                        explain_fh = open(explain_tmp, "w", encoding="utf-8")
                    for d in lines:
                        explain_fh.write(json.dumps(d, ensure_ascii=False) + "\n")
                    report.explained += len(lines)
                write_pending.add(i)
                pool.submit("finish", i, _finish_job, i, tasks[i].key, decisions[i], rec, i in p1_before, p3_old.get(i))
                _crash_point("decided")
                next_decide += 1
                if decider.can_stop_early and decider.filled:
                    cut = i
            if cut is None and next_decide == T:
                cut = T - 1
            if cut is not None and not write_pending and not reread_then_write:
                break
            submit_reads()
            item = pool.get(timeout=0.1)
            if bar is not None and progress_arr is not None:
                d, k = progress_arr[0], progress_arr[1]
                bar.update(k - last_tok)
                last_tok = k
                bar.set_postfix_str(f"docs={d:,} tasks read={len(p1)}/{T} done={len(p3)}", refresh=False)
            if item is None:
                continue
            kind, i, res = item
            if isinstance(res, BaseException):
                raise res
            if kind == "read":
                read_pending.discard(i)
                report.tokens_encoded += int(res["tokens"])
                if cut is not None and i > cut:
                    continue  # read past the budgets: not part of the corpus
                p1[i] = res
                if i in reread_then_write:
                    reread_then_write.discard(i)
                    write_pending.add(i)
                    pool.submit("finish", i, _finish_job, i, tasks[i].key, decisions[i], res, False, None)
            else:
                write_pending.discard(i)
                if res.get("candidates_missing"):
                    reread_then_write.add(i)
                    pool.submit("read", i, _read_job, tasks[i])
                    continue
                p3[i] = res
                if res.get("reused"):
                    report.shards_reused += len(res["shards"])
                else:
                    report.shards_written += len(res["shards"])
        pool.close(wait=bool(not read_pending), join=False)  # joined once the manifest is written
    except BaseException:
        pool.close(wait=False)
        if bar is not None:
            bar.close()
        if explain_fh is not None:
            explain_fh.close()
        if explain_tmp is not None:
            explain_tmp.unlink(missing_ok=True)
        raise
    if bar is not None:
        bar.close()
    assert cut is not None
    kept_tasks = range(cut + 1)
    report.tasks_read = cut + 1

    # -- manifest, written last ---------------------------------------------------------------
    entries: list[ShardRecord] = []
    final_paths: list[Path] = []
    for split in fmt.SPLITS:
        for i in kept_tasks:
            for s in p3[i]["shards"]:
                if s["split"] == split:
                    final_paths.append(shards_dir / s["path"])
                    d = dict(s, path=Path(os.path.relpath(shards_dir / s["path"], manifest_path.parent)).as_posix())
                    entries.append(ShardRecord.from_json(d, "write record"))
    decider.finish()
    splits = decider.splits
    for name, st in splits.items():
        st["pairs"] = st["tokens"] - st["documents"]
        st["shards"] = sum(1 for e in entries if e.split == name)
    listed: list[str] = []
    skip_codes: dict[str, int] = {}
    fcount: dict[str, int] = {}
    for i in kept_tasks:
        rec = p1[i]
        listed.extend(rec["skipped_records"][: MAX_LISTED - len(listed)])
        for k, v in rec["skip_codes"].items():
            skip_codes[k] = skip_codes.get(k, 0) + int(v)
        for k, v in rec["filter_counters"].items():
            fcount[k] = fcount.get(k, 0) + int(v)
    skipped_total = sum(int(p1[i]["skipped_total"]) for i in kept_tasks)
    seconds: dict[str, float] = {}
    for i in kept_tasks:
        if i in p1_before:
            continue  # timed by an earlier run
        for k, v in p1[i].get("seconds", {}).items():
            seconds[k] = seconds.get(k, 0.0) + float(v)
    build_info = {
        "fingerprint": fingerprint,
        "settings": settings,
        "on_error": cfg.on_error,
        "h5corpus_version": __version__,
        "tasks": T,
        "tasks_read": cut + 1,
        "skip_reasons": dict(sorted(skip_codes.items())),
        "skipped_records": listed,
        "skipped_records_total": skipped_total,
    }
    extra: dict[str, Any] = {"source": sources_desc, "build": build_info}
    if cfg.filters is not None:
        extra["filters"] = {"settings": settings["filters"], "counters": dict(sorted(fcount.items()))}
    m = Manifest(
        tokenizer=ident,
        dtype=fmt.dtype_name(fmt.token_dtype(ident.vocab_size)),
        chunk_tokens=int(cfg.chunk_tokens),
        shards=entries,
        splits=splits,
        extra=extra,
    )
    if explain_tmp is not None and explain_path is not None:
        if explain_fh is None:  # no task was decided
            explain_fh = open(explain_tmp, "w", encoding="utf-8")
        explain_fh.flush()
        os.fsync(explain_fh.fileno())
        explain_fh.close()
        os.replace(explain_tmp, explain_path)
        report.explain_drops = str(cfg.explain_drops)
    # Every listed shard durable before the manifest that lists it: the data was fsynced when the
    # shard was written (phase 1, or phase 3's copy); the renames into place, by their folders.
    for d in dict.fromkeys(p.parent for p in final_paths):
        fsync_dir(d)
    _crash_point("manifest-before")
    write_manifest(manifest_path, m)
    _crash_point("manifest-after")
    listed_paths = {m.shard_path(e) for e in entries}
    for p in _our_shard_files(shards_dir):
        if p.absolute() not in listed_paths:
            p.unlink(missing_ok=True)  # from tasks read past a budget, or an earlier partition
    shutil.rmtree(state, ignore_errors=True)
    pool.join()

    report.splits = splits
    report.skipped_total = skipped_total
    report.skipped_records = listed
    report.filter_counters = dict(sorted(fcount.items()))
    report.seconds = dict(sorted(seconds.items()))
    report.elapsed_s = time.perf_counter() - t_start
    return report


def _report_from_manifest(m: Manifest, shards_dir: Path, elapsed: float) -> BuildReport:
    b = m.extra.get("build") or {}
    return BuildReport(
        manifest=str(m.path),
        shards_dir=str(shards_dir),
        tokenizer=m.tokenizer.to_json(),
        splits=m.splits,
        tasks=int(b.get("tasks", 0)),
        tasks_read=int(b.get("tasks_read", 0)),
        skipped_total=int(b.get("skipped_records_total", 0)),
        skipped_records=list(b.get("skipped_records", [])),
        filter_counters=dict((m.extra.get("filters") or {}).get("counters", {})),
        elapsed_s=elapsed,
        up_to_date=True,
    )


def format_report(report: BuildReport) -> str:
    """The human summary the CLI prints: one row per split, then totals, speed, what each filter
    stage removed or changed, and skipped records. The ``dropped`` column counts the filter
    stages' drops; exact and near duplicates have their own columns."""
    cols = ["documents", "tokens", "pairs", "duplicates", "dropped", "truncated", "skipped"]
    for extra in ("near_duplicates", "over_budget"):
        if any(int(s.get(extra, 0)) for s in report.splits.values()):
            cols.insert(-1, extra)
    head = "up to date" if report.up_to_date else ("resumed and built" if report.resumed else "built")
    tok = report.tokenizer
    lines = [
        f"{head} {report.manifest} (tokenizer {tok.get('name')}"
        + (f", encoder {report.encoder}" if report.encoder else "")
        + ")"
    ]
    if report.encoder_note:
        lines.append(f"  note: {report.encoder_note}")
    width = {c: max(len(c), 12) for c in cols}

    def cell(st: Mapping[str, Any], c: str) -> int:
        return filtered_total(st) if c == "dropped" else int(st.get(c, 0))

    lines.append("  " + "split".ljust(12) + "".join(c.replace("_", " ").rjust(width[c] + 2) for c in cols))
    for name, st in report.splits.items():
        lines.append("  " + name.ljust(12) + "".join(f"{cell(st, c):,}".rjust(width[c] + 2) for c in cols))
    shards = sum(int(s.get("shards", 0)) for s in report.splits.values())
    lines.append(
        f"  {report.tokens:,} tokens in {shards} shards from {report.tasks_read}/{report.tasks} tasks"
        + (f" ({report.tasks_reused} reused after hash checks)" if report.tasks_reused else "")
        + f"; elapsed {report.elapsed_s:.2f} s, {report.tokens_per_s / 1e6:.2f} M tokens/s"
    )
    if report.filter_counters:
        fs = report.filter_summary()
        dropped = {k: v for k, v in fs["dropped"].items() if k not in DEDUP_REASONS}
        lang = {k[5:]: v for k, v in dropped.items() if k.startswith("lang:")}
        parts = [f"{k} {v:,}" for k, v in dropped.items() if not k.startswith("lang:")]
        if lang:
            top = sorted(lang.items(), key=lambda kv: (-kv[1], kv[0]))
            shown = ", ".join(f"{k} {v:,}" for k, v in top[:6]) + (f", {len(top) - 6} more" if len(top) > 6 else "")
            parts.append(f"lang {sum(lang.values()):,} ({shown})")
        c = report.filter_counters
        lines.append(
            f"  filters: {int(c.get('docs', 0)):,} documents in, {int(c.get('kept', 0)):,} out; "
            f"dropped: {', '.join(parts) or 'none'}"
        )
        changed = fs.get("changed", {})
        if changed:
            txt = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in changed.items())
            pii = fs.get("pii")
            if pii:
                txt += " (" + ", ".join(f"{k} {v:,}" for k, v in pii.items()) + " replaced)"
            lines.append(f"  filters changed documents: {txt}")
        if fs.get("languages"):
            top = list(fs["languages"].items())
            lines.append(
                "  languages stored: "
                + ", ".join(f"{k} {v:,}" for k, v in top[:8])
                + (f", {len(top) - 8} more" if len(top) > 8 else "")
            )
        if "x_tokenize" in fs:
            sec = fs["seconds"]
            stages = ", ".join(f"{k[7:]} {v:.2f}" for k, v in sec.items() if k.startswith("filter:"))
            lines.append(
                f"  filter time {sec['filter']:.2f} s ({stages}) = {fs['x_tokenize']:.2f}x "
                f"tokenization {sec['encode']:.2f} s (worker CPU seconds)"
            )
    if report.explain_drops:
        lines.append(f"  explained {report.explained:,} dropped documents in {report.explain_drops}")
    if report.skipped_total:
        lines.append(
            f"  skipped {report.skipped_total:,} bad records"
            + (
                f" (first {len(report.skipped_records)} listed)"
                if len(report.skipped_records) < report.skipped_total
                else ""
            )
            + ":"
        )
        lines.extend(f"    {r}" for r in report.skipped_records)
    return "\n".join(lines)
