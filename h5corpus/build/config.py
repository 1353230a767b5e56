"""What a build depends on: :class:`BuildConfig`, the split rule it defines, the filters seam, errors.

Nothing here touches the disk; the other build modules take these objects as explicit inputs.
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..storage import format as fmt
from ..storage.manifest import DEFAULT_MANIFEST, DEFAULT_SHARDS_DIR

DEFAULT_SPLIT_SEED = 20261003
DEFAULT_VALIDATION_FRACTION = 0.05
#: Input bytes per task: small enough to balance 2+ workers and bound the reading past a filled
#: budget, large enough that each task's shards are not tiny.
DEFAULT_TASK_BYTES = 16 << 20
#: Most tokens one shard holds (a single longer document gets a shard of its own).
DEFAULT_SHARD_TOKENS = 1 << 27
#: Skipped records listed per task and in the manifest (all are counted).
MAX_LISTED = 100
#: What a fine-tuning build trains on (``BuildConfig.loss_on``, ``--loss-on``; docs/BUILD.md).
LOSS_ON = ("assistant", "completion", "all")


class BuildError(Exception):
    """The input is bad (a record that cannot be read under ``on_error="fail"``): names file and line."""


class BuildConflict(Exception):
    """The output is in use or holds something else: another build holds the lock, the manifest was
    built with another tokenizer or other settings, or an interrupted build used other settings."""


# -- the filter seam ----------------------------------------------------------------------------
@runtime_checkable
class BuildFilters(Protocol):
    """What the build needs from cleaning / quality / language / PII / near-dedup stages
    (:class:`h5corpus.filters.DocumentFilter` is the implementation the CLI uses, and implements
    every protocol below).

    * ``process(text) -> (text_or_None, drop_reason_or_None)``: return the (possibly cleaned) text
      to keep it, or ``(None, reason)`` to drop it; called once per document by the read stage, in
      input order within a task, in a worker process (the object is inherited by fork or pickled).
    * ``counters() -> Mapping[str, int]``: monotonically growing per-rule counters of this process's
      copy. The build takes the difference across each task and sums tasks in input order, so they
      merge deterministically across workers.

    What more a filters object can do is one protocol each, checked with ``isinstance``:
    :class:`BatchFilters`, :class:`SigningFilters`, :class:`NearDedupFilters`,
    :class:`DescribedFilters`, :class:`TimedFilters`, :class:`WarmFilters`, :class:`ConfiguredFilters`.
    """

    def process(self, text: str) -> tuple[str | None, str | None]: ...

    def counters(self) -> Mapping[str, int]: ...


@runtime_checkable
class BatchFilters(Protocol):
    """The fast path, called instead of ``process`` with up to 256 documents (or ~1 M characters) at
    a time. Each result has ``.text``/``.reason`` as ``process`` would give, ``.signature`` (or None)
    and ``.info`` (a mapping or None; ``info["lang"]``/``info["lang_prob"]``/``info["perplexity"]``
    are recorded per document). Results do not depend on how documents are batched."""

    def process_batch(self, texts: Sequence[str], *, signatures: bool = False) -> Sequence[Any]: ...


@runtime_checkable
class SigningFilters(Protocol):
    """A near-duplicate signature (e.g. a MinHash: a 1-D array of one dtype and length within a
    build) of a kept text, computed by the read stage when a batch result carries none."""

    def signature(self, text: str) -> np.ndarray: ...


@runtime_checkable
class NearDedupFilters(Protocol):
    """``near_duplicate_index() -> index | None`` where ``index.add(signature) -> bool`` (True = a
    near duplicate of something added before): the decide stage creates one index per build and
    feeds it the signatures of exact-dedup survivors, in global input order. None = near-dedup off."""

    def near_duplicate_index(self) -> Any: ...


@runtime_checkable
class DescribedFilters(Protocol):
    """JSON-able settings, recorded in the manifest and part of the build fingerprint (changing them
    invalidates an interrupted build)."""

    def describe(self) -> Mapping[str, Any]: ...


@runtime_checkable
class TimedFilters(Protocol):
    """Growing CPU seconds per filter stage (build report only)."""

    def timings(self) -> Mapping[str, float]: ...


@runtime_checkable
class WarmFilters(Protocol):
    """Load models once, in the main process, before the workers fork (they share them)."""

    def warm_up(self) -> None: ...


@runtime_checkable
class ConfiguredFilters(Protocol):
    """Filters with a :class:`h5corpus.filters.FilterConfig`-like ``config``: ``config.lang``
    (languages are detected; the manifest counts stored documents per language) and
    ``config.perplexity_model`` (every document is scored)."""

    config: Any


@runtime_checkable
class InfoFilters(Protocol):
    """``last_info``: facts about the last document :meth:`BuildFilters.process` saw (a mapping)."""

    last_info: Mapping[str, Any]


def filters_near_index(f: BuildFilters | None) -> Any:
    """The build's near-duplicate index from ``f`` (None: near dedup off)."""
    return f.near_duplicate_index() if isinstance(f, NearDedupFilters) else None


def filters_detect_language(f: BuildFilters | None) -> bool:
    """True when the filters run language ID (their ``config.lang`` is set)."""
    return isinstance(f, ConfiguredFilters) and bool(getattr(f.config, "lang", None))


def filters_score_perplexity(f: BuildFilters | None) -> bool:
    """True when the filters score every document by perplexity (their ``config.perplexity_model``
    is set); their batch results then carry ``info["perplexity"]``, which the read stage records per
    document."""
    return isinstance(f, ConfiguredFilters) and bool(getattr(f.config, "perplexity_model", None))


def __getattr__(name: str) -> Any:
    if name == "DocumentFilters":
        warnings.warn("h5corpus.build.config.DocumentFilters is now BuildFilters", DeprecationWarning, stacklevel=2)
        return BuildFilters
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- configuration ------------------------------------------------------------------------------
class ExecutorKind(str, Enum):
    """Where the stages run (``BuildConfig.executor``, ``--executor``)."""

    LOCAL = "local"
    RAY = "ray"
    SLURM = "slurm"


class OnError(str, Enum):
    """What a bad record does (``BuildConfig.on_error``, ``--on-error``)."""

    FAIL = "fail"
    """Stop the build naming file and line (:class:`BuildError`)."""
    SKIP = "skip"
    """Count and list it; the build goes on."""


EXECUTORS = tuple(k.value for k in ExecutorKind)


@dataclass(kw_only=True)
class RayOptions:
    """``executor="ray"``: where the cluster is and what a stage task asks of it (docs/SCALING.md)."""

    address: str | None = None
    """``auto``, ``HOST:PORT`` of the cluster's GCS, or None: ``$RAY_ADDRESS``, else ``auto``."""
    cpus_per_task: float = 1.0
    """CPUs Ray reserves for each stage task (a task runs one process)."""
    max_retries: int = 3
    """Times Ray reruns a task whose worker or node died (stages are idempotent)."""


@dataclass(kw_only=True)
class SlurmOptions:
    """``executor="slurm"``: the job arrays' resources and how the command behaves (docs/SCALING.md)."""

    partition: str | None = None
    time: str | None = None
    """Time limit of every job (``sbatch --time``), e.g. ``2:00:00``."""
    cpus_per_task: int = 1
    max_array_size: int = 1000
    """Most elements per job array (the cluster's ``MaxArraySize``); more tasks make several arrays."""
    sbatch_args: Sequence[str] = ()
    """Extra ``sbatch`` arguments for every job, e.g. ``--account=x``, ``--mem=8G``."""
    dry_run: bool = False
    """Write the plan and the scripts, print the scripts; submit nothing."""
    wait: bool = False
    """Follow the jobs with a progress bar until the manifest is written (or a job fails)."""
    python: str | None = None
    """Interpreter the jobs run (default: this one, ``sys.executable``)."""


#: Default of :attr:`BuildConfig.max_record_bytes`: 64 MiB, far above any real document (a long
#: book is a few MB) and small enough that a worker holding one stays well inside its memory.
DEFAULT_MAX_RECORD_BYTES = 64 << 20


@dataclass(kw_only=True)
class BuildConfig:
    """Everything a build depends on. Paths are relative to the current directory."""

    sources: Sequence[Any] = ("stdlib",)
    """SOURCE specs (files, folders, globs, ``hf://datasets/...@REV/PATH``, ``stdlib``) and ``datasets``
    objects (``Dataset``, ``IterableDataset``, :class:`~h5corpus.build.input.hfdatasets.DatasetSource`), in
    input order."""
    tokenizer: str = "gpt2"
    """Tokenizer spec: ``gpt2``, ``bytes``, or a path to ``tokenizer.json`` / its folder."""
    shards_dir: str | os.PathLike[str] = DEFAULT_SHARDS_DIR
    manifest: str | os.PathLike[str] = DEFAULT_MANIFEST
    workers: int | None = None
    """Worker processes (default: all cores). Never changes the output."""
    text_field: str = "text"
    """JSON field / parquet or ``datasets`` column holding the text."""
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
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """Longest record read, in bytes: a JSON line, a parquet cell, a ``.txt`` file. A longer one is
    a bad record (``too_long``: file, line or row, byte offset), read past without being held in
    memory; it stops the build, or is counted under ``on_error="skip"``. Bounds a worker's memory
    on an input without line ends (docs/BUILD.md, "Limits")."""
    overwrite: bool = False
    """Delete the manifest, this build's shards and any interrupted state first."""
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    """Most tokens per shard file (a longer single document gets its own shard)."""
    chunk_tokens: int = fmt.DEFAULT_CHUNK_TOKENS
    """HDF5 chunk size of ``/tokens``, in tokens."""
    task_bytes: int = DEFAULT_TASK_BYTES
    """Input bytes per task (the unit of parallel work, resume and shard naming)."""
    filters: BuildFilters | None = None
    """Optional :class:`BuildFilters` (cleaning, quality, language, PII, near-dedup)."""
    fast_path: bool = True
    """Use a proven-equal fast encoder (fastokens / tiktoken / kitoken / unigram / raw bytes) when the tokenizer allows one."""
    fast_encoders: Sequence[str] | None = None
    """The fast encoders to try, in order (default ``bytes``, ``fastokens``, ``tiktoken``, ``kitoken``, ``unigram``; each
    where it applies, each proven before use). For tests and benchmarks: never changes a byte."""
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
    executor: str = "local"
    """Where the stages run: ``local`` (a process pool here), ``ray`` (tasks on a Ray cluster) or
    ``slurm`` (job arrays). Never changes the output (docs/SCALING.md)."""
    decide_buckets: int | None = None
    """Buckets of the decide stage: 0 decides in memory in the driver (the local executor's way);
    N >= 1 partitions exact and near dedup into N tasks. None: in memory on the local executor and
    whenever budgets can stop reading early, else one bucket per GiB of input. Never changes the
    output."""
    drop_worst_fraction: float | None = None
    """Drop this fraction, in [0, 1), of the documents that reach the decide stage's worst-fraction
    rule (after the filters and exact and near dedup, before the budgets): those with the highest
    perplexity, ties by input position (docs/FILTERS.md). Needs filters with a perplexity model;
    every task is then read before any is decided."""
    perplexity_scores: str | os.PathLike[str] | None = None
    """Write each scored document's perplexity to this TSV file at commit (docs/FILTERS.md). Not part
    of the build's settings: it never changes a shard or the manifest."""
    loss_on: str | None = None
    """A fine-tuning build (docs/BUILD.md, "Fine-tuning corpora"): records are chat
    (``messages``), ``prompt``/``completion`` or ``text`` (+ ``no_loss_ranges``) objects, and the
    shards store which positions are trained on: ``assistant`` (every assistant turn),
    ``completion`` (the last one), ``all``. None: a pretraining build."""
    chat_template: str | os.PathLike[str] | None = None
    """A fine-tuning build's chat template: a ``tokenizer_config.json`` or its folder (default:
    the one beside the tokenizer file, when there is one)."""
    bos: str | None = None
    """A fine-tuning build's BOS before every document: ``"tokenizer"`` (the tokenizer config's
    ``bos_token``) or an id; None: no BOS."""
    ray: RayOptions = field(default_factory=RayOptions)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)

    def __post_init__(self) -> None:
        # a config read back from JSON (``dataclasses.asdict``) gives the options as mappings
        if isinstance(self.ray, Mapping):
            self.ray = RayOptions(**self.ray)
        if isinstance(self.slurm, Mapping):
            self.slurm = SlurmOptions(**self.slurm)

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
        if self.on_error not in tuple(e.value for e in OnError):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {self.on_error!r}")
        n = self.max_record_bytes
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_record_bytes must be a positive integer (bytes), got {n!r}")
        for name in ("shard_tokens", "chunk_tokens", "task_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.decide_buckets is not None and int(self.decide_buckets) < 0:
            raise ValueError(f"decide_buckets must be >= 0, got {self.decide_buckets}")
        if self.executor == "slurm" and self.decide_buckets == 0:
            raise ValueError("the slurm executor has no driver to decide in memory: decide_buckets must be >= 1")
        if float(self.ray.cpus_per_task) <= 0 or int(self.ray.max_retries) < 0:
            raise ValueError("ray: cpus_per_task must be > 0 and max_retries >= 0")
        if int(self.slurm.cpus_per_task) < 1 or int(self.slurm.max_array_size) < 1:
            raise ValueError("slurm: cpus_per_task and max_array_size must be >= 1")
        known = ("bytes", "fastokens", "tiktoken", "kitoken", "unigram")
        for name in self.fast_encoders or ():
            if name not in known:
                raise ValueError(f"fast_encoders: unknown encoder {name!r} (known: {', '.join(known)})")
        if self.filters is not None and not isinstance(self.filters, BuildFilters):
            raise ValueError(
                "filters must have process(text) -> (text_or_None, reason_or_None) and counters() (BuildFilters)"
            )
        self._check_perplexity()
        self._check_sft()

    def _check_sft(self) -> None:
        if self.loss_on is None:
            if self.chat_template is not None or self.bos is not None:
                raise ValueError("chat_template and bos are settings of a fine-tuning build: give loss_on (--loss-on)")
            return
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"loss_on (--loss-on) must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}")
        f = self.filters
        changing = ("clean", "fix_unicode", "normalize_whitespace", "scrub_pii")
        if isinstance(f, ConfiguredFilters) and any(getattr(f.config, k, False) for k in changing):
            raise ValueError(
                "a fine-tuning build (--loss-on) takes filters that keep or drop records (quality, language, "
                "near dedup, perplexity), not ones that change the text (--clean, --fix-unicode, "
                "--normalize-whitespace, --scrub-pii): they would move the trained-on ranges"
            )
        if self.explain_drops is not None:
            raise ValueError("--explain-drops is not available in a fine-tuning build (--loss-on)")

    def _check_perplexity(self) -> None:
        scored = filters_score_perplexity(self.filters)
        f = self.drop_worst_fraction
        if f is not None:
            if not 0.0 <= float(f) < 1.0:
                raise ValueError(f"drop_worst_fraction must be in [0, 1), got {f}")
            if not scored:
                raise ValueError("drop_worst_fraction needs a perplexity model (--perplexity-model)")
        if self.perplexity_scores is not None and not scored:
            raise ValueError("perplexity_scores needs a perplexity model (--perplexity-model)")

    def settings(self) -> dict[str, Any]:
        """The settings that determine the output bytes (recorded in the manifest;
        ``drop_worst_fraction`` only when set, so builds without it keep their fingerprint)."""
        f = self.filters
        fdesc: Any = None
        if f is not None:
            fdesc = dict(f.describe()) if isinstance(f, DescribedFilters) else {"class": type(f).__qualname__}
        out = {
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
        if self.drop_worst_fraction is not None:
            out["drop_worst_fraction"] = float(self.drop_worst_fraction)
        if int(self.max_record_bytes) != DEFAULT_MAX_RECORD_BYTES:  # decides which records are bad
            out["max_record_bytes"] = int(self.max_record_bytes)
        return out


def parse_byte_size(option: str, text: str) -> int:
    """``"64M"`` -> 67108864: a positive whole number of bytes, with an optional binary suffix
    K, M, G (powers of 1024; ``KiB``, ``MB`` and the like read the same) and ``_`` separators.
    Raises ValueError naming ``option``."""
    m = re.fullmatch(r"(\d[\d_]*)\s*(?:([kKmMgG])(?:i?[bB])?)?", text.strip())
    n = 0
    if m:
        shift = {None: 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower() if m.group(2) else None]
        n = int(m.group(1).replace("_", "")) << shift
    if n < 1:
        raise ValueError(f"{option}: {text!r} is not a positive number of bytes (e.g. 67108864, 64M, 512K)")
    return n


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


# -- the split rule -----------------------------------------------------------------------------
#: ``h.digest()`` of a hash object, called from C (``map``).
_DIGEST = operator.methodcaller("digest")


@dataclass(frozen=True)
class SplitRule:
    """Which split a document goes to, from its id alone (docs/BUILD.md, "split"): ``validation``
    when the first 8 bytes (big-endian) of ``sha256(b"h5corpus-split:<seed>:" + doc_id)``, read as
    a fraction of 2**64, fall below ``validation_fraction``; else ``train``. The only
    implementation of the rule: the read stage, bad records and :func:`document_split` all use it."""

    seed: int = DEFAULT_SPLIT_SEED
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION

    def indices(self, doc_ids: Sequence[bytes]) -> np.ndarray:
        """uint8 split index per 32-byte id (0 = ``train``, 1 = ``validation``), for a batch."""
        prefix = b"h5corpus-split:%d:" % int(self.seed)
        digests = b"".join(map(_DIGEST, map(hashlib.sha256, map(prefix.__add__, doc_ids))))  # no bytecode per id
        heads = np.frombuffer(digests, dtype=">u8")[::4]  # the first 8 of each digest's 32 bytes
        threshold = min(int(float(self.validation_fraction) * (1 << 64)), 1 << 64)
        if threshold >= 1 << 64:  # fraction 1: every value is below 2**64
            return np.ones(heads.size, dtype=np.uint8)
        return (heads < np.uint64(threshold)).astype(np.uint8)

    def split_of(self, doc_id: bytes) -> str:
        """The split name of one document id."""
        return fmt.SPLITS[int(self.indices([doc_id])[0])]


def document_split(
    doc_id: bytes, *, seed: int = DEFAULT_SPLIT_SEED, validation_fraction: float = DEFAULT_VALIDATION_FRACTION
) -> str:
    """The split of a document (:class:`SplitRule`); ``doc_id`` is the 32-byte sha256 of its UTF-8 text."""
    return SplitRule(int(seed), float(validation_fraction)).split_of(doc_id)
