"""The persisted plan of a build, and the context every stage runs in.

:class:`BuildPlan` is written to the state folder (``plan.json``, with ``tokenizer.json`` beside it)
before any stage runs. It holds the task list (files, byte and row ranges, sizes: all a reader
needs), the settings, the tokenizer's identity, the encoder and the build's fingerprint, so that
any process -- a worker of another executor, another node, an array job -- can run task *i* from
the state folder alone, without listing the inputs again or reading parquet footers:
:meth:`StageContext.load` rebuilds the tokenizer, the encoder and the filters from it.

The driver writes the plan at the start of every run (a resumed run plans its inputs again: a task
whose files changed gets a new key and is redone); it rewrites it once more only when the fast
encoder's proof fails, naming ``tokenizers`` as the encoder from then on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from ...filters.pipeline import DocumentFilter
from ...storage.format import TokenizerIdentity
from ..config import DEFAULT_MAX_RECORD_BYTES, BuildConflict, SplitRule
from ..input.sources import Task
from ..tokenize.encoders import Encoder, encoder_named
from ..tokenize.tokenizer import Tokenizer
from .statedir import StateDir, write_state_file

PLAN_VERSION = 1


class StageEvents(Protocol):
    """How a stage tells its executor what it is doing (never needed for its result)."""

    def step(self, name: str) -> None:
        """The stage passed the named point (``read-candidates``, ``read-record``, ``finish-renamed``,
        ...; docs/BUILD.md lists them). The local executor injects test crashes here."""

    def progress(self, documents: int, tokens: int) -> None:
        """Documents and tokens just written."""


class NoEvents:
    """Events nobody listens to (a stage run outside an executor)."""

    def step(self, name: str) -> None:
        pass

    def progress(self, documents: int, tokens: int) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class BuildPlan:
    """Everything a stage needs besides the state folder's records (``plan.json``)."""

    run: dict[str, Any]
    """What identifies the build (settings, tokenizer identity, SOURCE specs): an interrupted build
    resumes only with an equal ``run``."""
    fingerprint: str
    """sha256 over ``run`` and the inputs' description (the manifest's ``build.fingerprint``)."""
    shards_dir: str
    """Absolute path of the shards folder."""
    tokenizer: TokenizerIdentity
    encoder: str
    """The encoder the read stage uses (``tiktoken``, ``bytes``, ``tokenizers``)."""
    tasks: tuple[Task, ...]
    text_field: str
    split: SplitRule
    on_error: str
    chunk_tokens: int
    shard_tokens: int
    max_document_tokens: int | None
    filters: dict[str, Any] | None = None
    """``{"kind": FilterKind, "description": {...}}`` of the filters object, or None."""
    want_signatures: bool = False
    """The read stage computes near-dedup signatures (the decide stage has an index to feed)."""
    record_lang: bool = False
    """The read stage records each stored document's detected language."""
    explain: bool = False
    """The read stage records what ``--explain-drops`` needs."""
    record_perplexity: bool = False
    """The read stage records each table row's perplexity (``meta["perplexity"]``)."""
    drop_worst_fraction: float | None = None
    """``--drop-worst-fraction`` (the decide stage's worst-fraction rule), or None."""
    newlines_before: dict[int, int] = field(default_factory=dict)
    """Task index -> line breaks before its first byte (JSONL tasks inside a file; explain only)."""
    decide_buckets: int = 0
    """Buckets of the decide stage (:mod:`~h5corpus.build.stages.buckets`); 0: the in-memory decide. The read
    stage writes each task's sorted keys when it is not 0. Never changes an output byte."""
    manifest: str | None = None
    """Absolute path of the manifest (for a commit stage run from the state folder alone)."""
    sources: dict[str, Any] | None = None
    """The inputs' description (the manifest's ``source``), for the same."""
    explain_drops: str | None = None
    """Absolute path of the ``--explain-drops`` file, when asked for."""
    perplexity_scores: str | None = None
    """Absolute path of the ``--perplexity-scores`` file, when asked for."""
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """Longest record the read stage reads (:attr:`BuildConfig.max_record_bytes`)."""
    sft: dict[str, Any] | None = None
    """A fine-tuning build's settings (:class:`~h5corpus.build.stages.sftread.SFTSpec`: what to
    train on, the BOS id, the chat template's source), or None for a pretraining build."""
    version: int = PLAN_VERSION

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["tokenizer"] = self.tokenizer.to_json()
        d["tasks"] = [t.to_json() for t in self.tasks]
        d["split"] = {"seed": self.split.seed, "validation_fraction": self.split.validation_fraction}
        d["newlines_before"] = {str(k): v for k, v in self.newlines_before.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BuildPlan:
        if not isinstance(d, Mapping) or d.get("version") != PLAN_VERSION:
            raise ValueError(
                f"plan version {d.get('version') if isinstance(d, Mapping) else None!r} is not {PLAN_VERSION}"
            )
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d or f.name not in _OPTIONAL_FIELDS}
        kw["tokenizer"] = TokenizerIdentity.from_json(d["tokenizer"])
        kw["tasks"] = tuple(Task.from_json(t) for t in d["tasks"])
        kw["split"] = SplitRule(int(d["split"]["seed"]), float(d["split"]["validation_fraction"]))
        kw["newlines_before"] = {int(k): int(v) for k, v in d["newlines_before"].items()}
        return cls(**kw)

    def write(self, state: StateDir, tokenizer_json: str | None = None) -> None:
        """Write ``plan.json`` (atomically and durably) and ``tokenizer.json``, when given."""
        if tokenizer_json is not None:
            write_state_file(state.tokenizer, tokenizer_json.encode("utf-8"))
        write_state_file(state.plan, json.dumps(self.to_json(), sort_keys=True).encode("utf-8"), durable=True)


_OPTIONAL_FIELDS = (
    "decide_buckets",
    "max_record_bytes",
    "manifest",
    "sources",
    "explain_drops",
    "record_perplexity",
    "drop_worst_fraction",
    "perplexity_scores",
    "sft",
)
"""Fields a plan written before they existed lacks (their defaults apply)."""


def read_plan_run(state: StateDir) -> dict[str, Any] | None:
    """The ``run`` identity of the plan in ``state``, or None when there is no readable plan."""
    try:
        d = json.loads(state.plan.read_text())
    except (OSError, ValueError):
        return None
    return d.get("run") if isinstance(d, dict) else None


class FilterKind(str, Enum):
    """The filter classes a stage in another process can rebuild from a plan: a fixed registry
    (:data:`FILTER_KINDS`). A plan names a kind, never a module, so nothing read from the state
    folder chooses the code that runs."""

    DOCUMENT_FILTER = "document-filter"


FILTER_KINDS: dict[FilterKind, type[DocumentFilter]] = {FilterKind.DOCUMENT_FILTER: DocumentFilter}
"""Kind -> class (with ``describe()`` and the ``from_description`` classmethod)."""


def filters_spec(filters: Any) -> dict[str, Any] | None:
    """How to rebuild ``filters`` in another process (see :meth:`StageContext.load`): its
    :class:`FilterKind` and description; kind None for a class outside the registry (such filters
    run only with the local executor, whose workers inherit the object)."""
    if filters is None:
        return None
    kind = next((k for k, c in FILTER_KINDS.items() if type(filters) is c), None)
    desc = dict(filters.describe()) if kind is not None else None
    return {"kind": None if kind is None else kind.value, "class": type(filters).__qualname__, "description": desc}


def rebuild_filters(spec: Mapping[str, Any] | None) -> Any:
    """The filters object ``spec`` (:func:`filters_spec`) describes, made by the registry's class
    for its kind (:data:`FILTER_KINDS`); raises :class:`BuildConflict` for a kind outside the
    registry, or filters that describe themselves otherwise than the plan says."""
    if spec is None:
        return None
    try:
        cls = FILTER_KINDS[FilterKind(spec.get("kind"))]
    except ValueError:
        raise BuildConflict(
            f"the build's filters (kind {spec.get('kind')!r}, class {spec.get('class')!r}) cannot be rebuilt from "
            f"the plan: only {', '.join(k.value for k in FilterKind)} can; run such a build with the local executor"
        ) from None
    if not isinstance(spec.get("description"), Mapping):
        raise BuildConflict(f"the build plan's filters field has no description (kind {spec.get('kind')!r})")
    filters = cls.from_description(spec["description"])
    if json.loads(json.dumps(dict(filters.describe()))) != json.loads(json.dumps(spec["description"])):
        raise BuildConflict(f"the build's filters ({spec['kind']}) describe themselves otherwise here than in the plan")
    return filters


@dataclass
class StageContext:
    """What a stage function runs with: the plan, the state folder, and the objects built from the
    plan once per process (encoder, filters). Passed explicitly to every stage; never global."""

    plan: BuildPlan
    state: StateDir
    encoder: Encoder
    filters: Any = None
    events: StageEvents = field(default_factory=NoEvents)

    @property
    def shards_dir(self) -> Path:
        return Path(self.plan.shards_dir)

    def step(self, name: str) -> None:
        self.events.step(name)

    @classmethod
    def load(cls, state_dir: str | Path, *, events: StageEvents | None = None) -> StageContext:
        """The context of the build whose state folder is ``state_dir`` (``<shards_dir>/.build``),
        rebuilt from ``plan.json`` and ``tokenizer.json`` alone."""
        state = StateDir(Path(state_dir).absolute())
        try:
            plan = BuildPlan.from_json(json.loads(state.plan.read_text()))
            json_text = state.tokenizer.read_text(encoding="utf-8")
        except (OSError, ValueError, KeyError) as e:
            raise BuildConflict(f"{state.root}: no usable build plan ({type(e).__name__}: {e})") from None
        tok = Tokenizer(plan.tokenizer, json_text)
        if hashlib.sha256(json_text.encode("utf-8")).hexdigest() != plan.tokenizer.sha256:
            raise BuildConflict(f"{state.tokenizer}: does not match the plan's tokenizer sha256")
        return cls(
            plan=plan,
            state=state,
            encoder=encoder_named(tok, plan.encoder),
            filters=rebuild_filters(plan.filters),
            events=events or NoEvents(),
        )
