"""The build's state folder, the stage records kept in it, and the names of shard files.

Layout of ``<shards_dir>/.build/`` (it exists only while a build runs or after it was interrupted)::

    plan.json                the persisted plan (:class:`h5corpus.build.stages.buildplan.BuildPlan`)
    tokenizer.json           the tokenizer's JSON, so a process with only this folder can encode
    read/00042.json          ReadRecord of task 42 (written last: its presence means "read done")
    read/00042.docs          per-document table, DOC_DTYPE records in table order
    read/00042.sig.npy       near-dedup signatures of the table's documents, (documents, k) array
    read/00042.meta.json     languages, perplexities and --explain-drops data, when asked for
    read/00042/              candidate shards: train-000.h5, validation-000.h5, ...
    finish/00042.json        FinishRecord of task 42 (its final shards)

Every record is a versioned dataclass that round-trips through JSON (``to_json``/``from_json``);
a record of another version, or whose files do not match its hashes, is redone, never trusted.
State files are written atomically (temp file + rename) without fsync: each is verified by hash
before reuse, so one that outlived its data after a power loss is detected and redone. Only
``plan.json`` is fsynced: a state folder whose plan is lost cannot be resumed.

Shard files are named in :mod:`h5corpus.build.stages.shards`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...storage.format import ShardRecord
from ...storage.writer import fsync_dir
from ..config import BuildConflict

STATE_DIR = ".build"
LOCK_FILE = ".build.lock"
#: Version of the read stage's files (record, table, signatures, meta): other versions are redone.
READ_RECORD_VERSION = 4
#: Version of the finish stage's record.
FINISH_RECORD_VERSION = 1
#: Version of :class:`TaskDecision`'s JSON.
DECISION_VERSION = 1

DOC_DTYPE = np.dtype([("id", "V32"), ("tokens", "<i8"), ("chars", "<i8"), ("split", "u1"), ("flags", "u1")])
"""Per document of a read task's table: sha256 id, tokens as stored (EOS included; the cut length
if truncated), characters of the text, split index (0 train, 1 validation), FLAG_* bits."""


def manifest_lock_path(manifest: Path) -> Path:
    """The lock file of a manifest: ``.<name>.lock`` beside it (symbolic links resolved, so every
    path to one manifest names one lock file)."""
    p = Path(manifest).absolute().resolve()
    return p.with_name(f".{p.name}.lock")


class RecordError(ValueError):
    """A state record is of another version or lacks a field (the stage is then redone)."""


# -- records ------------------------------------------------------------------------------------
def _check_version(d: Mapping[str, Any], want: int, what: str) -> None:
    if not isinstance(d, Mapping) or d.get("version") != want:
        got = d.get("version") if isinstance(d, Mapping) else None
        raise RecordError(f"{what} version {got!r} is not {want}")


@dataclass(frozen=True, kw_only=True)
class SplitTally:
    """What the read stage counted for one split without storing a document."""

    duplicates: int = 0
    """Exact duplicates of a document earlier in the same task."""
    skipped: int = 0
    """Empty texts, and bad records under ``on_error="skip"``."""
    filtered: dict[str, int] = field(default_factory=dict)
    """Filter drops per reason."""

    def to_json(self) -> dict[str, Any]:
        return {"duplicates": self.duplicates, "skipped": self.skipped, "filtered": dict(self.filtered)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SplitTally:
        return cls(
            duplicates=int(d["duplicates"]),
            skipped=int(d["skipped"]),
            filtered={str(k): int(v) for k, v in d["filtered"].items()},
        )


@dataclass(frozen=True, kw_only=True)
class ReadRecord:
    """The read stage's result for one task (``read/<task>.json``)."""

    index: int
    task: str
    """The task's key (:attr:`h5corpus.build.input.sources.Task.key`): its input's identity."""
    encoder: str
    """Encoder that produced the tokens (``fastokens``, ``tiktoken``, ``bytes``, ``tokenizers``)."""
    explain: bool
    """The meta file holds what ``--explain-drops`` needs."""
    documents: int
    """Rows of the table (documents in the candidate shards)."""
    tokens: int
    docs_sha256: str
    signatures_sha256: str | None
    meta_sha256: str | None
    candidates: tuple[ShardRecord, ...]
    """Candidate shards, paths relative to the task's candidate folder, split by split."""
    counts: dict[str, SplitTally]
    skipped_total: int
    """Bad records skipped (``on_error="skip"``)."""
    skip_codes: dict[str, int]
    skipped_records: list[str]
    filter_counters: dict[str, int]
    seconds: dict[str, float]
    """Worker CPU seconds per step (report only)."""
    encoder_fallbacks: int = 0
    """Documents the fast encoder raised on, encoded by the reference instead (report only)."""
    version: int = READ_RECORD_VERSION

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["candidates"] = [c.to_json() for c in self.candidates]
        d["counts"] = {k: v.to_json() for k, v in self.counts.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ReadRecord:
        _check_version(d, READ_RECORD_VERSION, "read record")
        try:
            kw = {f.name: d[f.name] for f in dataclasses.fields(cls)}
            kw["candidates"] = tuple(ShardRecord.from_json(c, "read record") for c in d["candidates"])
            kw["counts"] = {k: SplitTally.from_json(v) for k, v in d["counts"].items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise RecordError(f"read record lacks or mistypes {e}") from None
        return cls(**kw)


@dataclass(frozen=True, kw_only=True)
class TaskDecision:
    """What the decide stage concluded for one task: per table row, 0 = not stored, 1 = train,
    2 = validation; plus what the finish stage needs to act on it."""

    index: int
    task: str
    keep: np.ndarray
    """uint8 per table row (0 / split index + 1)."""
    candidates: tuple[ShardRecord, ...]
    """The read record's candidate shards."""
    verify_candidates: bool
    """Re-hash the candidates before using them (they come from an interrupted run)."""
    version: int = DECISION_VERSION

    @property
    def sha256(self) -> str:
        """Hex sha256 of ``keep``'s bytes (recorded by the finish stage)."""
        return hashlib.sha256(np.ascontiguousarray(self.keep, dtype=np.uint8).tobytes()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        """The decision without ``keep`` (stored beside it as ``.npy``), with its hash."""
        return {
            "version": self.version,
            "index": self.index,
            "task": self.task,
            "keep_sha256": self.sha256,
            "candidates": [c.to_json() for c in self.candidates],
            "verify_candidates": self.verify_candidates,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], keep: np.ndarray) -> TaskDecision:
        _check_version(d, DECISION_VERSION, "decision")
        out = cls(
            index=int(d["index"]),
            task=str(d["task"]),
            keep=np.asarray(keep, dtype=np.uint8),
            candidates=tuple(ShardRecord.from_json(c, "decision") for c in d["candidates"]),
            verify_candidates=bool(d["verify_candidates"]),
        )
        if out.sha256 != d["keep_sha256"]:
            raise RecordError(f"decision of task {out.index}: keep array does not match its sha256")
        return out


@dataclass(frozen=True, kw_only=True)
class FinishRecord:
    """The finish stage's result for one task (``finish/<task>.json``): its final shards."""

    index: int
    task: str
    decision_sha256: str
    """:attr:`TaskDecision.sha256` of the decision it carried out."""
    shards: tuple[ShardRecord, ...]
    """Final shards, paths relative to the shards folder, in split then sequence order."""
    reused: bool = False
    """Found complete from an earlier run (not serialized)."""
    version: int = FINISH_RECORD_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "index": self.index,
            "task": self.task,
            "decision_sha256": self.decision_sha256,
            "shards": [s.to_json() for s in self.shards],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FinishRecord:
        _check_version(d, FINISH_RECORD_VERSION, "finish record")
        try:
            return cls(
                index=int(d["index"]),
                task=str(d["task"]),
                decision_sha256=str(d["decision_sha256"]),
                shards=tuple(ShardRecord.from_json(s, "finish record") for s in d["shards"]),
            )
        except (KeyError, TypeError) as e:
            raise RecordError(f"finish record lacks or mistypes {e}") from None


# -- the folder ---------------------------------------------------------------------------------
def sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while b := fh.read(block):
            h.update(b)
    return h.hexdigest()


def write_state_file(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Atomic (temp file + rename); not fsynced unless ``durable`` (see the module docstring)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temporary file behind
        raise
    if durable:
        fsync_dir(path.parent)


def write_state_json(path: Path, obj: Any) -> None:
    write_state_file(path, json.dumps(obj, sort_keys=True).encode("utf-8"))


@dataclass(frozen=True)
class ReadPaths:
    """The files of one task's read stage."""

    record: Path
    docs: Path
    signatures: Path
    meta: Path
    candidates: Path
    """Folder of the candidate shards."""


@dataclass(frozen=True)
class StateDir:
    """The state folder of one shards folder (``<shards_dir>/.build``)."""

    root: Path

    @classmethod
    def of(cls, shards_dir: Path) -> StateDir:
        return cls(Path(shards_dir).absolute() / STATE_DIR)

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer.json"

    def read_paths(self, index: int) -> ReadPaths:
        stem = self.root / "read" / f"{index:05d}"
        return ReadPaths(
            record=stem.with_suffix(".json"),
            docs=stem.with_suffix(".docs"),
            signatures=stem.with_suffix(".sig.npy"),
            meta=stem.with_suffix(".meta.json"),
            candidates=stem,
        )

    def finish_record_path(self, index: int) -> Path:
        return self.root / "finish" / f"{index:05d}.json"

    def create(self) -> None:
        """Make the stage folders; delete temporary files a killed process left in them."""
        for sub in ("read", "finish"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
            for p in list((self.root / sub).glob("*.tmp*")):
                p.unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def recorded_tasks(self) -> set[int]:
        """Indices of the tasks that have a read or finish record file here, of this plan or of an
        earlier one (valid or not): the tasks whose shard files this build may have made."""
        out: set[int] = set()
        for sub in ("read", "finish"):
            d = self.root / sub
            if d.is_dir():
                out.update(int(p.stem) for p in d.glob("*.json") if p.stem.isdigit())
        return out

    # -- read records ---------------------------------------------------------------------------
    def load_read_record(self, index: int, task_key: str) -> ReadRecord | None:
        """Task ``index``'s read record if present, of this version, for this input (``task_key``),
        with its table, signatures and meta files matching their hashes; else None."""
        p = self.read_paths(index)
        try:
            rec = ReadRecord.from_json(json.loads(p.record.read_text()))
        except (OSError, ValueError):
            return None
        if rec.task != task_key or rec.index != index or not p.docs.exists():
            return None
        if sha256_file(p.docs) != rec.docs_sha256:
            return None
        for path, want in ((p.signatures, rec.signatures_sha256), (p.meta, rec.meta_sha256)):
            if want and (not path.exists() or sha256_file(path) != want):
                return None
        return rec

    def load_read_outputs(self, rec: ReadRecord) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any] | None]:
        """A read task's table, signatures and meta (languages, explain data), hash-checked."""
        p = self.read_paths(rec.index)
        docs = np.frombuffer(_checked_bytes(p.docs, rec.docs_sha256), dtype=DOC_DTYPE)
        sigs = None
        if rec.signatures_sha256:
            raw = _checked_bytes(p.signatures, rec.signatures_sha256)
            sigs = np.load(io.BytesIO(raw), allow_pickle=False)
        meta = json.loads(_checked_bytes(p.meta, rec.meta_sha256)) if rec.meta_sha256 else None
        return docs, sigs, meta

    # -- finish records -------------------------------------------------------------------------
    def load_finish_record(self, index: int, task_key: str) -> FinishRecord | None:
        try:
            rec = FinishRecord.from_json(json.loads(self.finish_record_path(index).read_text()))
        except (OSError, ValueError):
            return None
        return rec if rec.task == task_key and rec.index == index else None

    def write_finish_record(self, rec: FinishRecord) -> None:
        write_state_json(self.finish_record_path(rec.index), rec.to_json())


def _checked_bytes(path: Path, want: str | None) -> bytes:
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != want:
        raise BuildConflict(f"{path}: a build state file changed during the build (is another process writing there?)")
    return raw


def signatures_array(sigs: Sequence[np.ndarray], where: str) -> np.ndarray:
    """Stack per-document signatures into one (documents, k) array, refusing ragged or mixed ones."""
    if not sigs:
        return np.zeros((0, 0), dtype=np.uint32)
    first = np.asarray(sigs[0])
    for i, s in enumerate(sigs):
        a = np.asarray(s)
        if a.ndim != 1 or a.shape != first.shape or a.dtype != first.dtype or a.dtype == object:
            raise ValueError(
                f"{where}: near-duplicate signature {i} is {a.dtype}{list(a.shape)}, expected a 1-D numeric array "
                f"like the first one ({first.dtype}{list(first.shape)})"
            )
    return np.stack([np.asarray(s) for s in sigs])
