"""Where documents come from: SOURCE specs -> input files -> tasks -> streamed records.

A SOURCE is one of

* a file: ``.jsonl`` (also ``.jsonl.gz`` / ``.jsonl.zst``; one JSON object per line, text in
  ``text_field``), ``.parquet`` (a string column ``text_field``, plain or dictionary-encoded),
  ``.txt`` (the whole file is one document);
* a folder (every supported file below it, recursively, sorted by relative path; other files and
  dot-files are ignored);
* a glob (``data/**/*.jsonl``; sorted; every match must be a supported file);
* ``hf://datasets/ORG/NAME@REVISION/PATH`` -- parquet files of a Hugging Face dataset at a pinned
  40-hex commit, e.g. FineWeb's sample::

      hf://datasets/HuggingFaceFW/fineweb@9bb295ddab0e05d785b879661af7260fed5140fc/sample/10BT

  read from the local hub cache when the snapshot is there (offline), else streamed from the hub
  with ranged reads;
* ``stdlib`` -- the running Python's standard library sources (every ``*.py`` outside test
  folders and site-packages, one document per file): real text that ships with every Python, so
  a build runs on a fresh machine with no network;
* a Hugging Face ``datasets`` object (``Dataset``, ``IterableDataset``, a ``DatasetDict`` split,
  optionally wrapped in :class:`~h5corpus.build.input.hfdatasets.DatasetSource`) or a ``save_to_disk``
  folder; hub files that are not parquet (jsonl, json, csv, tsv, arrow) are read with
  ``datasets``' own builders (:mod:`h5corpus.build.input.hfdatasets`).

Input order is the order of the SOURCE arguments, then file order within each, then line/row order.
The unit of work is a :class:`Task`: a byte range of an uncompressed ``.jsonl`` (whole lines: a
line belongs to the range holding its first byte), a run of row groups of a parquet file, a whole
compressed file, or a run of consecutive ``.txt`` files. Tasks are planned from file sizes and
parquet footers only; no document is read while planning. A task serializes to JSON
(:meth:`Task.to_json`), so the persisted plan carries everything its reader needs
(:mod:`h5corpus.build.input.records` streams its records).
"""

from __future__ import annotations

import glob as globlib
import os
import re
import stat
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..hub import hf_cache_dir as hub_cache_dir
from ..hub import hub_offline, hub_unreachable
from .hfdatasets import (
    hub_files_to_read,
    plan_dataset_tasks,
    resolve_dataset_object,
    resolve_saved_dataset,
    warm_up_file_reader,
)
from .inputs import DATASETS_KIND_PREFIX, Input, SourceError, SourceFile, Task

__all__ = ["DATASETS_KIND_PREFIX", "Input", "SourceError", "SourceFile", "Task", "plan_tasks", "resolve_sources"]

#: File name ending -> reader kind.
EXTENSIONS = {
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".parquet": "parquet",
    ".txt": "text",
}
STDLIB_SPEC = "stdlib"
HF_PREFIX = "hf://"
#: A hub organisation or dataset name (the hub's own rule: no ``..`` or ``--``, no leading or
#: trailing ``-``/``.``, at most 96 characters).
_HF_NAME_RE = re.compile(r"(?!.*(?:--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_HF_RE = re.compile(r"^hf://datasets/(?P<org>[^/@]+)/(?P<name>[^/@]+)@(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
#: Files that make a folder a ``datasets`` ``save_to_disk`` folder (read as one dataset).
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


# -- resolving SOURCE specs ---------------------------------------------------------------------
def kind_of(path: str) -> str | None:
    low = path.lower()
    for ext in sorted(EXTENSIONS, key=len, reverse=True):
        if low.endswith(ext):
            return EXTENSIONS[ext]
    return None


def _local_file(name: str, path: Path, kind: str) -> SourceFile:
    try:
        st = path.stat()
    except OSError as e:
        raise SourceError(f"{name}: cannot stat ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):  # /dev/zero, a FIFO: no size, no end, or not readable twice
        raise SourceError(f"{name}: not a regular file (devices, FIFOs and sockets cannot be read as a SOURCE)")
    return SourceFile(name=name, path=str(path.absolute()), kind=kind, size=st.st_size, mtime_ns=st.st_mtime_ns)


def stdlib_files() -> list[tuple[str, Path]]:
    """(display name, path) of the standard library's ``*.py`` files outside test folders, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("."))
        rel = Path(dirpath).relative_to(root)
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                out.append(((rel / fn).as_posix(), Path(dirpath) / fn))
    out.sort(key=lambda t: t[0])
    return [(f"<stdlib>/{r}", p) for r, p in out]


def parse_hf_spec(spec: str) -> tuple[str, str, str]:
    """``hf://datasets/ORG/NAME@REV/PATH`` -> (``ORG/NAME``, REV, PATH). REV must be a 40-hex commit."""
    m = _HF_RE.match(spec)
    if not m:
        raise SourceError(
            f"{spec}: a hub source is hf://datasets/ORG/NAME@REVISION/PATH, e.g. "
            "hf://datasets/HuggingFaceFW/fineweb@9bb295ddab0e05d785b879661af7260fed5140fc/sample/10BT"
        )
    for part in (m["org"], m["name"]):
        if not _HF_NAME_RE.fullmatch(part):
            raise SourceError(
                f"{spec}: {part!r} is not a hub repository name (letters, digits, '-', '_', '.'; no '..' or '--')"
            )
    sub = (m["path"] or "").strip("/")
    if any(part in (".", "..") for part in sub.split("/")):
        raise SourceError(f"{spec}: the path inside the repository may not hold '.' or '..' components")
    rev = m["rev"]
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        raise SourceError(
            f"{spec}: pin the dataset to a commit (40 hex digits after '@'), not {rev!r}, so the build is reproducible"
        )
    return f"{m['org']}/{m['name']}", rev, sub


def _hub_listing(local: Path, snap: Path, sub: str) -> list[tuple[str, Path]]:
    """(path in the repository, local path) of the files a cached snapshot holds at ``sub`` (a
    file, a folder: every file below it but dot-files, or a glob), in path order."""
    if local.is_file():
        return [(sub, local)]
    if local.is_dir():
        found = sorted(p for p in local.rglob("*") if p.is_file())
    elif any(ch in sub for ch in "*?[") and snap.is_dir():
        found = [Path(m) for m in sorted(globlib.glob(str(snap / sub), recursive=True)) if Path(m).is_file()]
    else:
        return []
    out = [(p.relative_to(snap).as_posix(), p) for p in found]
    return [(n, p) for n, p in out if not any(part.startswith(".") for part in n.split("/"))]


def _resolve_hf(spec: str, cache_dir: Path) -> Input:
    repo, rev, sub = parse_hf_spec(spec)
    meta: dict[str, Any] = {"repo": repo, "revision": rev, "path": sub}
    snap = cache_dir / f"datasets--{repo.replace('/', '--')}" / "snapshots" / rev
    local = snap / sub if sub else snap
    try:
        listing = _hub_listing(local, snap, sub)
    except OSError as e:  # a path too long for the file system, a cache folder that cannot be read
        raise SourceError(f"{spec}: cannot look in the local Hugging Face cache ({e.strerror or e})") from None
    if listing:
        fmt, chosen = hub_files_to_read(spec, [n for n, _ in listing])
        files = [_local_file(listing[i][0], listing[i][1], kind) for i, kind in chosen]
        return _hub_input(spec, fmt, files, meta)
    if hub_offline():
        raise SourceError(f"{spec}: not in the local Hugging Face cache ({local}) and HF_HUB_OFFLINE is set")
    unreachable = hub_unreachable()
    if unreachable:  # fail now: the hub client would retry for many seconds before giving up
        raise SourceError(
            f"{spec}: not in the local Hugging Face cache ({local}) and the hub could not be reached ({unreachable})"
        )
    try:
        from huggingface_hub import HfFileSystem

        fs = HfFileSystem()
        base = f"datasets/{repo}@{rev}" + (f"/{sub}" if sub else "")
        if any(ch in sub for ch in "*?["):
            paths = sorted(p for p in fs.glob(base) if fs.isfile(p))
        elif fs.isfile(base):
            paths = [base]
        else:
            paths = sorted(fs.find(base))
        prefix = f"datasets/{repo}@{rev}/"
        names = [p[len(prefix) :] if p.startswith(prefix) else p for p in paths]
    except Exception as e:
        raise SourceError(
            f"{spec}: not in the local Hugging Face cache ({local}) and the hub could not be listed ({type(e).__name__}: {e})"
        ) from None
    if not paths:
        raise SourceError(f"{spec}: no files at that path")
    fmt, chosen = hub_files_to_read(spec, names)
    files = []
    for i, kind in chosen:
        try:
            size = int(fs.info(paths[i]).get("size") or 0)
        except Exception as e:
            raise SourceError(f"{spec}: cannot stat {names[i]} on the hub ({type(e).__name__}: {e})") from None
        files.append(SourceFile(name=names[i], path=HF_PREFIX + paths[i], kind=kind, size=size))
    return _hub_input(spec, fmt, files, meta)


def _hub_input(spec: str, fmt: str, files: list[SourceFile], meta: dict[str, Any]) -> Input:
    if fmt != "parquet":  # read by datasets' builders (parquet by the build's own reader)
        meta["format"] = fmt
        warm_up_file_reader(files[0])
    return Input(spec=spec, kind="hf", files=tuple(files), meta=meta)


def _stdlib_input() -> Input:
    """The ``stdlib`` SOURCE: the running Python's standard library sources."""
    files = tuple(_local_file(n, p, "text") for n, p in stdlib_files())
    return Input(
        spec=STDLIB_SPEC, kind="stdlib", files=files, meta={"python": ".".join(map(str, sys.version_info[:3]))}
    )


def resolve_sources(
    specs: Sequence[Any], *, hf_cache_dir: str | os.PathLike[str] | None = None, text_field: str = "text"
) -> list[Input]:
    """Resolve SOURCE arguments to files, in input order. Raises :class:`SourceError` naming the
    spec for a missing path, an unsupported file type, or a pattern that matches nothing.

    A spec is a string (or path), or a ``datasets`` object (:mod:`h5corpus.build.input.hfdatasets`),
    whose text column defaults to ``text_field``."""
    if not specs:
        raise SourceError("no SOURCE given")
    out: list[Input] = []
    for spec in specs:
        if isinstance(spec, os.PathLike):
            spec = os.fspath(spec)
        if not isinstance(spec, str):
            out.append(resolve_dataset_object(spec, text_field))
            continue
        if spec == STDLIB_SPEC:
            out.append(_stdlib_input())
            continue
        if spec.startswith(HF_PREFIX):
            out.append(_resolve_hf(spec, hub_cache_dir(hf_cache_dir)))
            continue
        p = Path(spec)
        files_l: list[SourceFile] = []
        if p.is_dir() and any((p / n).is_file() for n in SAVED_DATASET_MARKERS):
            out.append(resolve_saved_dataset(spec, p, text_field))
            continue
        if p.is_dir():
            for q in sorted(p.rglob("*"), key=lambda q: q.relative_to(p).as_posix()):
                rel = q.relative_to(p)
                if any(part.startswith(".") for part in rel.parts) or q.is_dir():
                    continue
                k = kind_of(q.name)
                if k:
                    files_l.append(_local_file(q.as_posix(), q, k))
            if not files_l:
                raise SourceError(f"{spec}: folder holds no supported files ({', '.join(EXTENSIONS)})")
        elif p.exists() or os.path.lexists(p):
            k = kind_of(p.name)
            if k is None:
                raise SourceError(f"{spec}: unsupported file type (supported: {', '.join(EXTENSIONS)})")
            files_l.append(_local_file(spec, p, k))
        elif any(ch in spec for ch in "*?["):
            matches = sorted(globlib.glob(spec, recursive=True))
            for m in matches:
                if Path(m).is_dir():
                    continue
                k = kind_of(m)
                if k is None:
                    raise SourceError(
                        f"{spec}: matches {m}, an unsupported file type (supported: {', '.join(EXTENSIONS)})"
                    )
                files_l.append(_local_file(m, Path(m), k))
            if not files_l:
                raise SourceError(f"{spec}: pattern matches no files")
        else:
            raise SourceError(f"{spec}: no such file or folder")
        out.append(Input(spec=spec, kind="files", files=tuple(files_l)))
    return out


# -- planning tasks -----------------------------------------------------------------------------
def open_parquet(path: str):
    import pyarrow.parquet as pq

    if path.startswith(HF_PREFIX):
        from huggingface_hub import HfFileSystem

        fh = HfFileSystem().open(path[len(HF_PREFIX) :], "rb", block_size=8 << 20)
        return pq.ParquetFile(fh)
    return pq.ParquetFile(path)


def _parquet_cuts(f: SourceFile, task_bytes: int) -> list[dict[str, Any]]:
    """A parquet file's tasks (as :class:`Task` fields): runs of row groups of about ``task_bytes``,
    or the whole file as one task (its reader reports a footer that cannot be read)."""
    try:
        md = open_parquet(f.path).metadata
        sizes = [md.row_group(i).total_byte_size for i in range(md.num_row_groups)]
        rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
    except Exception:
        return [{"kind": "parquet", "files": (f,), "nbytes": f.size}]
    if not sizes:
        return [{"kind": "parquet", "files": (f,), "nbytes": f.size}]
    out: list[dict[str, Any]] = []
    a, acc, first_row = 0, 0, 0
    for i, s in enumerate(sizes):
        acc += s
        if acc >= task_bytes or i == len(sizes) - 1:
            whole = a == 0 and i == len(sizes) - 1
            out.append(
                {
                    "kind": "parquet",
                    "files": (f,),
                    "start": 0 if whole else a,
                    "stop": -1 if whole else i + 1,
                    "first_row": first_row,
                    "nbytes": acc,
                }
            )
            first_row += sum(rows[a : i + 1])
            a, acc = i + 1, 0
    return out


def plan_tasks(inputs: Sequence[Input], *, task_bytes: int) -> list[Task]:
    """Cut the inputs into tasks of about ``task_bytes`` input bytes, in input order.

    Depends only on file sizes and parquet footers, so the same inputs and ``task_bytes`` always
    give the same tasks (and shard names). A parquet file that cannot be opened becomes one task
    whose reader reports the error.
    """
    if task_bytes <= 0:
        raise ValueError(f"task_bytes must be positive, got {task_bytes}")
    tasks: list[Task] = []

    def add(**kw: Any) -> None:
        tasks.append(Task(index=len(tasks), **kw))

    for inp in inputs:
        if inp.kind == "datasets":
            tasks.extend(plan_dataset_tasks(inp, task_bytes=task_bytes, first_index=len(tasks)))
            continue
        group: list[SourceFile] = []
        group_bytes = 0
        for f in inp.files:
            if f.kind == "text":
                group.append(f)
                group_bytes += f.size
                if group_bytes >= task_bytes:
                    add(kind="text", files=tuple(group), nbytes=group_bytes)
                    group, group_bytes = [], 0
                continue
            if group:
                add(kind="text", files=tuple(group), nbytes=group_bytes)
                group, group_bytes = [], 0
            if f.kind == "jsonl" and f.size > task_bytes:
                n = -(-f.size // task_bytes)
                step = -(-f.size // n)
                for a in range(0, f.size, step):
                    b = min(a + step, f.size)
                    add(kind="jsonl", files=(f,), start=a, stop=b if b < f.size else -1, nbytes=b - a)
            elif f.kind == "parquet":
                for kw in _parquet_cuts(f, task_bytes):
                    add(**kw)
            else:
                add(kind=f.kind, files=(f,), nbytes=f.size)
        if group:
            add(kind="text", files=tuple(group), nbytes=group_bytes)
    return tasks
