"""What the input modules share: a resolved SOURCE (:class:`Input`), its files (:class:`SourceFile`),
the unit of work (:class:`Task`), a record that is not a document (:class:`BadRecord`) and the
``datasets`` task kinds. It imports no other input module, so :mod:`.sources`, :mod:`.hfdatasets`,
:mod:`.records` and :mod:`.hfrecords` import it and never one another in a circle."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Task and file kinds read through :mod:`h5corpus.build.input.hfdatasets` start with this.
DATASETS_KIND_PREFIX = "datasets-"
TABLE_KIND = DATASETS_KIND_PREFIX + "table"
OBJECT_KIND = DATASETS_KIND_PREFIX + "object"
FILE_KIND_PREFIX = DATASETS_KIND_PREFIX + "file:"

#: A document as read: its text and the text's UTF-8 bytes (``data`` hashes to the document id).
Doc = tuple[str, bytes]


class SourceError(ValueError):
    """A SOURCE argument cannot be resolved: missing path, unsupported type, empty match (usage error)."""


@dataclass(frozen=True)
class SourceFile:
    """One input file."""

    name: str
    """Display name, stable across machines: the path as globbed/listed, ``<stdlib>/json/decoder.py``,
    or the path inside a hub repository."""
    path: str
    """Where to open it: an absolute local path (so any process can open it, whatever its current
    folder) or an ``hf://`` fsspec URL."""
    kind: str
    """Reader kind: jsonl, jsonl.gz, jsonl.zst, parquet, text."""
    size: int
    """Bytes on disk (or on the hub)."""
    mtime_ns: int = 0
    """Local modification time (0 for remote files); only used to notice edits between resumes."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "kind": self.kind, "size": self.size, "mtime_ns": self.mtime_ns}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SourceFile:
        return cls(
            name=str(d["name"]),
            path=str(d["path"]),
            kind=str(d["kind"]),
            size=int(d["size"]),
            mtime_ns=int(d["mtime_ns"]),
        )


@dataclass(frozen=True)
class Input:
    """One resolved SOURCE argument."""

    spec: str
    """The SOURCE as given, or (a ``datasets`` object) a description of it: part of the build's identity."""
    kind: str
    """files | stdlib | hf | datasets"""
    files: tuple[SourceFile, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    """hf: repo, revision, path; stdlib: python version; datasets: fingerprint, builder, split, ..."""
    dataset: Any = field(default=None, compare=False, repr=False)
    """datasets: the resolved object (:class:`~h5corpus.build.input.hfdatasets.ResolvedDataset`) the
    planner cuts into tasks; never described or persisted."""

    def describe(self) -> dict[str, Any]:
        """JSON-able description for the manifest (no absolute paths, no mtimes)."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.name}\t{f.size}\n".encode())
        d: dict[str, Any] = {
            "spec": self.spec,
            "kind": self.kind,
            "files": len(self.files),
            "bytes": sum(f.size for f in self.files),
            "listing_sha256": h.hexdigest(),
        }
        d.update(self.meta)
        return d


@dataclass(frozen=True)
class Task:
    """A unit of reading, tokenizing and shard writing. ``index`` is its place in input order."""

    index: int
    kind: str
    files: tuple[SourceFile, ...]
    """One file, or a run of ``.txt`` files."""
    start: int = 0
    """jsonl: first byte offset; parquet: first row group."""
    stop: int = -1
    """jsonl: end byte offset (exclusive); parquet: end row group (exclusive); -1 = to the end."""
    first_row: int = 0
    """parquet: index of the first row of ``start`` (for messages)."""
    nbytes: int = 0
    """Approximate input bytes (for scheduling and progress)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """JSON-able reader parameters of the ``datasets-*`` kinds (column, row counts, ...); part of the key."""
    live: Any = field(default=None, compare=False, repr=False)
    """``datasets-object`` tasks: the in-memory object they read, held only by the planning process
    (and the local executor's forked workers); never persisted."""

    def to_json(self) -> dict[str, Any]:
        """Everything a reader needs (the persisted plan holds this): no re-listing, no footers."""
        d = {
            "index": self.index,
            "kind": self.kind,
            "files": [f.to_json() for f in self.files],
            "start": self.start,
            "stop": self.stop,
            "first_row": self.first_row,
            "nbytes": self.nbytes,
        }
        if self.extra:
            d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Task:
        return cls(
            index=int(d["index"]),
            kind=str(d["kind"]),
            files=tuple(SourceFile.from_json(f) for f in d["files"]),
            start=int(d["start"]),
            stop=int(d["stop"]),
            first_row=int(d["first_row"]),
            nbytes=int(d["nbytes"]),
            extra=dict(d.get("extra") or {}),
        )

    @property
    def key(self) -> str:
        """Identity of the task's input (paths, range, sizes, mtimes): a resumed build reuses a
        task's outputs only when its key is unchanged."""
        parts = [self.kind, str(self.start), str(self.stop)] + [f"{f.path}|{f.size}|{f.mtime_ns}" for f in self.files]
        if self.extra:
            parts.append(json.dumps(self.extra, sort_keys=True, separators=(",", ":")))
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    @property
    def label(self) -> str:
        """Short description for messages."""
        if self.kind.startswith(DATASETS_KIND_PREFIX):
            return datasets_task_label(self)
        f = self.files[0].name
        if self.kind == "text" and len(self.files) > 1:
            return f"{f} (+{len(self.files) - 1} files)"
        if self.kind == "jsonl" and (self.start or self.stop >= 0):
            return f"{f} [bytes {self.start:,}-{self.stop:,}]" if self.stop >= 0 else f"{f} [bytes {self.start:,}-]"
        if self.kind == "parquet" and (self.start or self.stop >= 0):
            return f"{f} [row groups {self.start}-{self.stop}]"
        return f


@dataclass(frozen=True)
class BadRecord:
    """A record that is not a usable document. ``where`` names file and line/row."""

    where: str
    reason: str
    code: str
    """Kind: invalid_utf8, invalid_unicode, malformed_json, not_object, missing_field, not_string,
    too_long (over the record limit), unreadable, truncated, changed (the file changed while the
    build read it: always stops the build)."""
    fatal: bool = False
    """True when the rest of the task could not be read (corrupt stream, unreadable file)."""

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def in_process_only(task: Task) -> bool:
    """True for a task that only the planning process (and the local executor's forked workers)
    can run: it reads an in-memory object the plan cannot hold."""
    return task.kind == OBJECT_KIND


def datasets_task_label(task: Task) -> str:
    """Short description of a ``datasets-*`` task for messages."""
    if task.kind.startswith(FILE_KIND_PREFIX):
        return task.files[0].name
    name = task.extra.get("name", task.files[0].name)
    if "num_shards" in task.extra:
        return f"{name} [shard {task.start}/{task.extra['num_shards']}]"
    return f"{name} [rows {task.start:,}-{task.stop:,}]"


def datasets_record_location(task: Task, ordinal: int) -> tuple[str, str | None, int | None]:
    """Where record ``ordinal`` (0-based, bad records included) of a ``datasets-*`` task is:
    ``(dataset or file, "row", row)``: the dataset's row, or the row within the shard or file."""
    if task.kind.startswith(FILE_KIND_PREFIX):
        return task.files[0].name, "row", ordinal
    if "num_shards" in task.extra:
        return f"{task.extra['name']} shard {task.start}/{task.extra['num_shards']}", "row", ordinal
    return str(task.extra["name"]), "row", task.start + ordinal
