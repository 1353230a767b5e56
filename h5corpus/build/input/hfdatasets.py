"""Hugging Face ``datasets`` as build sources: ``Dataset``, ``IterableDataset`` and ``DatasetDict``
split objects, ``save_to_disk`` folders, and hub files that are not parquet (jsonl, json, csv, tsv,
arrow), which ``datasets``' own builders read.

Every source becomes tasks of one of these kinds (docs/BUILD.md, "Hugging Face datasets"):

* ``datasets-table``: rows ``[start, stop)`` of a ``Dataset`` whose table lives in Arrow files (the
  cache files ``load_dataset`` or ``map`` wrote, a ``save_to_disk`` folder). The task names the
  files, their row counts and the column-level transforms ``datasets`` replays on them (renames,
  column selections, slices, schema metadata), plus the indices file of a shuffled or filtered
  dataset, so any process can reopen them with pyarrow, memory-mapped, from the plan alone.
* ``datasets-object``: rows of a ``Dataset`` held in memory, or shard ``start`` of
  ``extra["num_shards"]`` (``IterableDataset.shard(n, i, contiguous=True)``) of an
  ``IterableDataset``. The object exists only in the process that planned the build; the local
  executor's forked workers inherit it with the plan, and a process that loads the plan from the
  state folder gets a :class:`SourceError` that says so.
* ``datasets-file:<builder>``: one file of a hub dataset, streamed by
  ``datasets.load_dataset(builder, data_files=[file], streaming=True)``.

Tasks are cut from the data alone (a ``Dataset``: by the UTF-8 bytes of its text column, plus one
per row; an ``IterableDataset``: by its shards; hub files: one per file), never from the worker
count, so the output is the same for any number of workers. ``datasets`` is imported only when such
a source is used: the import takes seconds.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .sources import DATASETS_KIND_PREFIX, Input, SourceError, SourceFile, Task

TABLE_KIND = DATASETS_KIND_PREFIX + "table"
OBJECT_KIND = DATASETS_KIND_PREFIX + "object"
FILE_KIND_PREFIX = DATASETS_KIND_PREFIX + "file:"
#: Hub file name ending -> (format, as the manifest records it; the ``datasets`` builder reading it).
HUB_FORMATS = {
    ".parquet": ("parquet", None),
    ".arrow": ("arrow", "arrow"),
    ".jsonl": ("jsonl", "json"),
    ".jsonl.gz": ("jsonl", "json"),
    ".json": ("json", "json"),
    ".json.gz": ("json", "json"),
    ".csv": ("csv", "csv"),
    ".csv.gz": ("csv", "csv"),
    ".tsv": ("tsv", "csv"),
}
#: Rows per read batch (as the parquet reader).
BATCH_ROWS = 1024
#: Rows whose text lengths are summed at a time when cutting a ``Dataset`` into tasks.
_CUT_ROWS = 1 << 20
#: Replays (``datasets.table`` re-applies these to a memory-mapped table on unpickling) that only
#: rename, select or slice columns and rows: the reader re-applies them to the reopened file.
_COLUMN_REPLAYS = frozenset({"replace_schema_metadata", "rename_columns", "select", "drop", "drop_columns", "slice"})
_REVISION_RE = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class DatasetSource:
    """A ``datasets`` object as a build SOURCE, with the split and the text column to read.

    ``BuildConfig(sources=[ds])`` takes a ``Dataset`` or ``IterableDataset`` as it is; wrap it
    (or a ``DatasetDict``) to choose ``split`` or ``text_column``."""

    dataset: Any
    """A ``Dataset``, ``IterableDataset``, ``DatasetDict`` or ``IterableDatasetDict``."""
    split: str | None = None
    """The split of a dict to read (needed when it holds more than one)."""
    text_column: str | None = None
    """The column holding the text (default: ``BuildConfig.text_field``)."""


@dataclass(frozen=True)
class ArrowBlock:
    """One Arrow file of a ``Dataset``'s table: where it is, its rows as the dataset sees them, and
    the column-level replays (``[name, args, kwargs]``) that turn the file's table into them."""

    path: str
    rows: int
    replays: list[Any]

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "replays": self.replays}


@dataclass(frozen=True)
class ResolvedDataset:
    """A ``datasets`` source, resolved: what the planner needs (never persisted)."""

    obj: Any
    column: str
    name: str
    """The Input's spec: names the dataset in messages and ``where`` strings."""
    fingerprint: str
    iterable: bool
    blocks: tuple[ArrowBlock, ...] | None
    """The table's files in row order; None when the table is (partly) in memory."""
    indices: ArrowBlock | None
    """The indices file (shuffle, filter, select); None when there is none."""


# -- resolving ----------------------------------------------------------------------------------
def _datasets_module(obj: Any):
    if not any(c.__module__.partition(".")[0] == "datasets" for c in type(obj).__mro__):
        raise SourceError(
            f"sources: {obj!r:.60} is not a SOURCE (give a path, hf://datasets/ORG/NAME@REV/PATH, "
            "'stdlib', or a datasets Dataset / IterableDataset / DatasetDict, optionally in DatasetSource(...))"
        )
    import datasets

    return datasets


def _pick_split(src: DatasetSource, ds_mod: Any) -> tuple[Any, str | None]:
    obj = src.dataset
    if isinstance(obj, (ds_mod.DatasetDict, ds_mod.IterableDatasetDict)):
        names = list(obj)
        what = type(obj).__name__
        if src.split is None:
            if len(names) != 1:
                raise SourceError(
                    f"sources: a {what} with splits {', '.join(names) or '(none)'}: choose one, "
                    f"DatasetSource(d, split={(names or ['train'])[0]!r})"
                )
            return obj[names[0]], names[0]
        if src.split not in obj:
            raise SourceError(f"sources: the {what} has no split {src.split!r} (splits: {', '.join(names)})")
        return obj[src.split], src.split
    if not isinstance(obj, (ds_mod.Dataset, ds_mod.IterableDataset)):
        raise SourceError(f"sources: a datasets {type(obj).__name__} is not a SOURCE (give a Dataset, ...)")
    if src.split is not None and str(obj.split) != src.split:
        raise SourceError(f"sources: split={src.split!r} chooses a split of a DatasetDict; this is one dataset")
    return obj, (None if obj.split is None else str(obj.split))


def resolve_dataset_object(source: Any, text_field: str, *, spec: str | None = None) -> Input:
    """The :class:`~h5corpus.build.input.sources.Input` of a ``datasets`` object (or a
    :class:`DatasetSource`); raises :class:`SourceError` for anything else, a missing split, or a
    text column that is missing or not a string column."""
    src = source if isinstance(source, DatasetSource) else DatasetSource(source)
    ds_mod = _datasets_module(src.dataset)
    obj, split = _pick_split(src, ds_mod)
    column = src.text_column or text_field
    if isinstance(obj, ds_mod.IterableDataset):
        return _resolve_iterable(obj, column, split, spec)
    return _resolve_table(obj, column, split, spec)


def resolve_saved_dataset(spec: str, folder: Path, text_field: str) -> Input:
    """A ``Dataset.save_to_disk`` folder as a SOURCE (memory-mapped, so its tasks run anywhere)."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise SourceError(
            f"{spec}: a saved DatasetDict (splits {', '.join(splits) or '(none)'}); give one split's folder, "
            f"e.g. {folder / (splits or ['train'])[0]}"
        )
    import datasets

    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:
        raise SourceError(f"{spec}: not a readable datasets folder ({type(e).__name__}: {e})") from None
    return resolve_dataset_object(ds, text_field, spec=spec)


def _check_column(name: str, column: str, features: Any) -> None:
    if features is None:  # an IterableDataset of unknown features: the reader checks every row
        return
    if column not in features:
        raise SourceError(
            f"{name}: no column {column!r} (columns: {', '.join(list(features)[:12])}); "
            "choose one with DatasetSource(..., text_column=...) or --text-field"
        )
    import pyarrow as pa

    feature = features[column]
    typ = getattr(feature, "pa_type", None)
    is_view = getattr(pa.types, "is_string_view", lambda t: False)  # pyarrow >= 16
    if typ is None or not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or is_view(typ)):
        raise SourceError(f"{name}: column {column!r} is {feature}, not a string column")


def _meta(ds: Any, what: str, split: str | None, column: str, fingerprint: str) -> dict[str, Any]:
    info = ds.info
    meta: dict[str, Any] = {"dataset": what, "column": column, "fingerprint": fingerprint}
    for key in ("builder_name", "config_name", "dataset_name", "version"):
        value = getattr(info, key, None)
        if value:
            meta[key] = str(value)
    if split:
        meta["split"] = split
    return meta


def _resolve_table(ds: Any, column: str, split: str | None, spec: str | None) -> Input:
    fingerprint = str(ds._fingerprint)
    name = spec or f"datasets.Dataset(fingerprint={fingerprint}{', split=' + split if split else ''}, column={column})"
    _check_column(name, column, ds.features)
    blocks, indices, reopenable = _arrow_blocks(ds)
    meta = _meta(ds, "Dataset", split, column, fingerprint)
    meta["rows"] = len(ds)
    revision = _revision(ds)
    if revision:
        meta["revision"] = revision
    files: list[SourceFile] = []
    if reopenable:
        for b in [*blocks, *([indices] if indices else [])]:
            st = os.stat(b.path)
            files.append(SourceFile(Path(b.path).name, b.path, "arrow", st.st_size, st.st_mtime_ns))
    resolved = ResolvedDataset(
        ds, column, name, fingerprint, False, tuple(blocks) if reopenable else None, indices if reopenable else None
    )
    return Input(spec=name, kind="datasets", files=tuple(files), meta=meta, dataset=resolved)


def _resolve_iterable(ds: Any, column: str, split: str | None, spec: str | None) -> Input:
    if getattr(ds, "_distributed", None) is not None:
        raise SourceError(
            "sources: an IterableDataset split with split_dataset_by_node: give the whole dataset "
            "(the build divides the work itself)"
        )
    fingerprint = _iterable_fingerprint(ds)
    name = spec or (
        f"datasets.IterableDataset(fingerprint={fingerprint}{', split=' + split if split else ''}, column={column})"
    )
    _check_column(name, column, ds.features)
    meta = _meta(ds, "IterableDataset", split, column, fingerprint)
    meta["num_shards"] = int(ds.num_shards)
    resolved = ResolvedDataset(ds, column, name, fingerprint, True, None, None)
    return Input(spec=name, kind="datasets", files=(), meta=meta, dataset=resolved)


def _iterable_fingerprint(ds: Any) -> str:
    """``datasets``' Hasher over the pipeline (its data sources and steps); a fresh random value
    when it cannot hash it (the build then cannot be resumed)."""
    from datasets.fingerprint import Hasher, generate_random_fingerprint

    try:
        return str(Hasher.hash(ds._ex_iterable))
    except Exception:
        return "random-" + str(generate_random_fingerprint())


def _replays(table: Any) -> list[Any] | None:
    out = []
    for name, args, kwargs in getattr(table, "replays", None) or []:
        if name not in _COLUMN_REPLAYS:
            return None
        try:
            item = json.loads(json.dumps([name, list(args), dict(kwargs)]))
        except (TypeError, ValueError):
            return None
        if item != [name, _as_lists(list(args)), _as_lists(dict(kwargs))]:
            return None
        out.append(item)
    return out


def _as_lists(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_as_lists(v) for v in x]
    if isinstance(x, dict):
        return {k: _as_lists(v) for k, v in x.items()}
    return x


def _block(table: Any) -> ArrowBlock | None:
    from datasets.table import MemoryMappedTable

    if not isinstance(table, MemoryMappedTable):
        return None
    replays = _replays(table)
    if replays is None:
        return None
    return ArrowBlock(os.path.abspath(table.path), int(table.num_rows), replays)


def _arrow_blocks(ds: Any) -> tuple[list[ArrowBlock], ArrowBlock | None, bool]:
    """The table's files in row order, the indices file, and whether those alone give the
    dataset's rows (no in-memory part, no transform the reader could not replay)."""
    from datasets.table import ConcatenationTable

    data = ds.data
    if isinstance(data, ConcatenationTable):
        rows = data.blocks
        found = [_block(r[0]) if len(r) == 1 else None for r in rows]
    else:
        found = [_block(data)]
    blocks = [b for b in found if b is not None]
    indices = None
    ok = len(blocks) == len(found) and bool(blocks)
    if ds._indices is not None:
        indices = _block(ds._indices)
        ok = ok and indices is not None
    return blocks, indices, ok


def _revision(ds: Any) -> str | None:
    """The hub commit of a dataset ``load_dataset`` prepared from the hub: the name of the folder
    holding its cache files (``<cache>/<org>___<name>/<config>/<version>/<commit>/``)."""
    folders = {Path(f["filename"]).parent.name for f in ds.cache_files}
    if len(folders) == 1:
        (folder,) = folders
        if _REVISION_RE.fullmatch(folder):
            return folder
    return None


def hub_files_to_read(spec: str, names: Sequence[str]) -> tuple[str, list[tuple[int, str]]]:
    """Which files of a hub listing the build reads, and as what: (format, [(index, file kind)]).

    The listing must hold one data format (parquet, arrow, jsonl, csv or tsv); ``.json`` files are
    data only when nothing else is (they are usually metadata, e.g. a ``save_to_disk`` folder's)."""
    by_format: dict[str, list[tuple[int, str]]] = {}
    for i, n in enumerate(names):
        low = n.lower()
        for ext in sorted(HUB_FORMATS, key=len, reverse=True):
            if low.endswith(ext):
                fmt, builder = HUB_FORMATS[ext]
                by_format.setdefault(fmt, []).append((i, "parquet" if builder is None else FILE_KIND_PREFIX + builder))
                break
    data = sorted(f for f in by_format if f != "json")
    if len(data) > 1:
        raise SourceError(
            f"{spec}: holds {' and '.join(data)} files; name one kind, e.g. {spec.rstrip('/')}/**/*.{data[0]}"
        )
    if not by_format:
        raise SourceError(f"{spec}: no data files there ({', '.join(sorted(set(HUB_FORMATS)))})")
    fmt = data[0] if data else "json"
    return fmt, by_format[fmt]


def builder_options(f: SourceFile, column: str) -> dict[str, Any]:
    """Options for ``datasets``' builder. CSV: the text column is read as written (``converters``:
    no number parsing; ``na_filter=False``: a document "NA" or "" stays text, not null)."""
    if not f.kind.endswith(":csv"):
        return {}
    opts: dict[str, Any] = {"converters": {column: str}, "na_filter": False}
    if f.name.lower().endswith(".tsv"):
        opts["sep"] = "\t"
    return opts


def warm_up_file_reader(f: SourceFile) -> None:
    """Import ``datasets`` and what its builder for ``f`` loads on first use (pandas, torch: seconds)
    here, in the planning process, so the local executor's forked workers inherit them instead of
    each importing them again. Errors are left to the reader, which names the file."""
    try:
        import datasets

        datasets.load_dataset(
            f.kind[len(FILE_KIND_PREFIX) :],
            data_files=[f.path],
            split="train",
            streaming=True,
            **builder_options(f, "text"),
        )
    except Exception:
        pass


# -- planning -----------------------------------------------------------------------------------
def _row_ranges(ds: Any, column: str, task_bytes: int) -> list[tuple[int, int, int]]:
    """Rows ``[0, len(ds))`` cut into runs of about ``task_bytes`` bytes, counting each row as its
    text's UTF-8 bytes plus one (so empty rows count too): ``(start, stop, bytes)`` in row order; a
    run ends at the first row that brings it to ``task_bytes``."""
    import pyarrow.compute as pc

    n = len(ds)
    lengths = pc.binary_length(ds.data.column(column))
    indices = ds._indices.column(0) if ds._indices is not None else None
    out: list[tuple[int, int, int]] = []
    start, acc = 0, 0
    for a in range(0, n, _CUT_ROWS):
        m = min(_CUT_ROWS, n - a)
        part = lengths.slice(a, m) if indices is None else pc.take(lengths, indices.slice(a, m))
        cum = np.cumsum(pc.fill_null(part, 0).to_numpy().astype(np.int64) + 1)
        base = 0
        while True:
            j = int(np.searchsorted(cum, base + task_bytes - acc, side="left"))
            if j >= m:
                acc += int(cum[-1]) - base
                break
            out.append((start, a + j + 1, acc + int(cum[j]) - base))
            start, acc, base = a + j + 1, 0, int(cum[j])
    if start < n or not out:
        out.append((start, n, acc))
    return out


def plan_dataset_tasks(inp: Input, *, task_bytes: int, first_index: int) -> list[Task]:
    """The tasks of a ``datasets`` Input, numbered from ``first_index``."""
    r: ResolvedDataset = inp.dataset
    live = SourceFile(name=r.name, path="", kind=OBJECT_KIND, size=0)
    if r.iterable:
        n = int(r.obj.num_shards)
        extra = {"name": r.name, "column": r.column, "fingerprint": r.fingerprint, "num_shards": n}
        return [
            Task(index=first_index + i, kind=OBJECT_KIND, files=(live,), start=i, stop=i + 1, extra=extra, live=r.obj)
            for i in range(n)
        ]
    tasks = []
    for k, (a, b, nbytes) in enumerate(_row_ranges(r.obj, r.column, task_bytes)):
        if r.blocks is None:
            extra = {"name": r.name, "column": r.column, "fingerprint": r.fingerprint}
            files: tuple[SourceFile, ...] = (live,)
            kind, obj = OBJECT_KIND, r.obj
        else:
            files, extra = _table_task_files(inp, r, a, b)
            kind, obj = TABLE_KIND, None
        tasks.append(
            Task(
                index=first_index + k,
                kind=kind,
                files=files,
                start=a,
                stop=b,
                first_row=a,
                nbytes=nbytes,
                extra=extra,
                live=obj,
            )
        )
    return tasks


def _table_task_files(inp: Input, r: ResolvedDataset, a: int, b: int) -> tuple[tuple[SourceFile, ...], dict]:
    """The files a ``datasets-table`` task over rows ``[a, b)`` opens, and its ``extra``: without an
    indices file only the blocks the rows lie in, else every block and the indices file (last)."""
    assert r.blocks is not None
    bounds = np.cumsum([0] + [blk.rows for blk in r.blocks])
    if r.indices is None:
        first = max(0, int(np.searchsorted(bounds, a, side="right")) - 1)
        last = max(first + 1, int(np.searchsorted(bounds, b, side="left")))
        chosen = list(range(first, min(last, len(r.blocks))))
    else:
        chosen = list(range(len(r.blocks)))
    extra: dict[str, Any] = {
        "name": r.name,
        "column": r.column,
        "base_row": int(bounds[chosen[0]]),
        "blocks": [r.blocks[i].to_json() for i in chosen],
        "indices": None if r.indices is None else r.indices.to_json(),
    }
    files = tuple(inp.files[i] for i in chosen) + ((inp.files[-1],) if r.indices is not None else ())
    return files, extra
