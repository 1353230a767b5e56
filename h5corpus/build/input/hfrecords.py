"""Reading the ``datasets-*`` tasks :mod:`h5corpus.build.input.hfdatasets` plans: records
``(text, utf8_bytes)`` or :class:`~h5corpus.build.input.records.BadRecord`, in row order, in batches of
:data:`~h5corpus.build.input.hfdatasets.BATCH_ROWS` rows.

``datasets-table`` tasks reopen their Arrow files with pyarrow (memory-mapped; ``datasets`` is not
imported); ``datasets-object`` tasks read the object the task holds (``Task.live``);
``datasets-file:<builder>`` tasks stream their file with ``datasets.load_dataset``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .hfdatasets import BATCH_ROWS, FILE_KIND_PREFIX, OBJECT_KIND, TABLE_KIND, builder_options
from .records import BadRecord, Doc
from .sources import SourceError, Task


# -- reading ------------------------------------------------------------------------------------
def in_process_only(task: Task) -> bool:
    """True for a task that only the planning process (and the local executor's forked workers)
    can run: it reads an in-memory object the plan cannot hold."""
    return task.kind == OBJECT_KIND


def task_label(task: Task) -> str:
    """Short description of a ``datasets-*`` task for messages."""
    if task.kind.startswith(FILE_KIND_PREFIX):
        return task.files[0].name
    name = task.extra.get("name", task.files[0].name)
    if "num_shards" in task.extra:
        return f"{name} [shard {task.start}/{task.extra['num_shards']}]"
    return f"{name} [rows {task.start:,}-{task.stop:,}]"


def record_location(task: Task, ordinal: int) -> tuple[str, str | None, int | None]:
    """Where record ``ordinal`` (0-based, bad records included) of a ``datasets-*`` task is:
    ``(dataset or file, "row", row)``: the dataset's row, or the row within the shard or file."""
    if task.kind.startswith(FILE_KIND_PREFIX):
        return task.files[0].name, "row", ordinal
    if "num_shards" in task.extra:
        return f"{task.extra['name']} shard {task.start}/{task.extra['num_shards']}", "row", ordinal
    return str(task.extra["name"]), "row", task.start + ordinal


def read_records(task: Task, text_field: str) -> Iterator[Doc | BadRecord]:
    """Stream a ``datasets-*`` task's records: ``(text, utf8_bytes)`` or :class:`BadRecord`, in row order."""
    if task.kind == TABLE_KIND:
        return _table_records(task)
    if task.kind == OBJECT_KIND:
        if task.live is None:
            raise SourceError(
                f"{task_label(task)}: this task reads an in-memory datasets object that only the process "
                "that planned the build holds, so it cannot run from the state folder in another process. "
                "Run the build with the local executor, or give a dataset backed by Arrow files "
                "(save_to_disk, then load_from_disk or the folder as SOURCE; or Dataset.flatten_indices() "
                "on a file-backed dataset)"
            )
        if "num_shards" in task.extra:
            return _shard_records(task)
        return _memory_records(task)
    if task.kind.startswith(FILE_KIND_PREFIX):
        return _file_records(task, text_field)
    raise ValueError(f"unknown task kind {task.kind!r}")


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _value_record(v: Any, where: str, column: str) -> Doc | BadRecord:
    if type(v) is str:
        try:
            return v, v.encode("utf-8")
        except UnicodeEncodeError:
            return BadRecord(
                where, f"field {column!r} holds a lone UTF-16 surrogate (not valid Unicode)", "invalid_unicode"
            )
    return BadRecord(where, f"field {column!r} is {_type_name(v)}, not a string", "not_string")


def _arrow_records(col: Any, name: str, first_row: int, column: str) -> Iterator[Doc | BadRecord]:
    """Records of an Arrow string column whose first value is row ``first_row`` of ``name``."""
    try:
        values: list[Any] = col.to_pylist()
    except Exception:  # invalid UTF-8 somewhere in the batch: find the row
        values = []
        for i in range(len(col)):
            try:
                values.append(col[i].as_py())
            except Exception as e:
                values.append(
                    BadRecord(
                        f"{name} row {first_row + i}", f"invalid string ({type(e).__name__}: {e})", "invalid_utf8"
                    )
                )
    for i, v in enumerate(values):
        yield v if isinstance(v, BadRecord) else _value_record(v, f"{name} row {first_row + i}", column)


def _open_block(path: str, block: Mapping[str, Any]) -> Any:
    """The table of one Arrow file as the dataset saw it (memory-mapped, replays applied)."""
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        table = pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        table = pa.ipc.open_file(source).read_all()
    for name, args, kwargs in block["replays"]:
        table = getattr(table, name)(*args, **kwargs)
    if table.num_rows != int(block["rows"]):
        raise ValueError(
            f"{Path(path).name} has {table.num_rows:,} rows, the plan {int(block['rows']):,} (changed since?)"
        )
    return table


def _table_records(task: Task) -> Iterator[Doc | BadRecord]:
    import pyarrow as pa

    x = task.extra
    name, column = str(x["name"]), str(x["column"])
    n = task.stop - task.start
    try:
        blocks = x["blocks"]
        tables = [_open_block(f.path, b) for f, b in zip(task.files, blocks)]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        texts = table.column(column)
        indices = None
        if x["indices"] is not None:
            indices = _open_block(task.files[len(blocks)].path, x["indices"]).column(0).slice(task.start, n)
    except Exception as e:
        yield BadRecord(
            f"{name} row {task.start}", f"cannot reopen ({type(e).__name__}: {e})", "unreadable", fatal=True
        )
        return
    row = task.start
    try:
        for off in range(0, n, BATCH_ROWS):
            m = min(BATCH_ROWS, n - off)
            if indices is None:
                col = texts.slice(task.start - int(x["base_row"]) + off, m)
            else:
                col = texts.take(indices.slice(off, m))
            yield from _arrow_records(col, name, row, column)
            row += m
    except Exception as e:
        yield BadRecord(
            f"{name} row {row}", f"unreadable from here on ({type(e).__name__}: {e})", "unreadable", fatal=True
        )


def _memory_records(task: Task) -> Iterator[Doc | BadRecord]:
    name, column = str(task.extra["name"]), str(task.extra["column"])
    view = task.live.with_format("arrow", columns=[column])  # the stored column (no transform), indices applied
    row = task.start
    try:
        while row < task.stop:
            m = min(BATCH_ROWS, task.stop - row)
            yield from _arrow_records(view[row : row + m].column(0), name, row, column)
            row += m
    except Exception as e:
        yield BadRecord(
            f"{name} row {row}", f"unreadable from here on ({type(e).__name__}: {e})", "unreadable", fatal=True
        )


def _shard_records(task: Task) -> Iterator[Doc | BadRecord]:
    x = task.extra
    column, n = str(x["column"]), int(x["num_shards"])
    where = f"{x['name']} shard {task.start}/{n}"
    row = 0
    try:
        shard = task.live.shard(num_shards=n, index=task.start, contiguous=True).with_format(None)
        for example in shard:
            if column in example:
                yield _value_record(example[column], f"{where} row {row}", column)
            else:
                keys = ", ".join(list(example)[:8])
                yield BadRecord(f"{where} row {row}", f"no field {column!r} (fields: {keys})", "missing_field")
            row += 1
    except Exception as e:
        yield BadRecord(
            f"{where} row {row}", f"unreadable from here on ({type(e).__name__}: {e})", "unreadable", fatal=True
        )


def _file_records(task: Task, column: str) -> Iterator[Doc | BadRecord]:
    f = task.files[0]
    builder = task.kind[len(FILE_KIND_PREFIX) :]
    row = 0
    try:
        import datasets

        ds = datasets.load_dataset(
            builder, data_files=[f.path], split="train", streaming=True, **builder_options(f, column)
        )
        for table in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):
            if column in table.column_names:
                yield from _arrow_records(table.column(column), f.name, row, column)
            else:
                reason = f"no field {column!r} (fields: {', '.join(table.column_names[:8])})"
                for r in range(row, row + table.num_rows):
                    yield BadRecord(f"{f.name} row {r}", reason, "missing_field")
            row += table.num_rows
    except Exception as e:
        yield BadRecord(
            f"{f.name} row {row}", f"unreadable from here on ({type(e).__name__}: {e})", "unreadable", fatal=True
        )
