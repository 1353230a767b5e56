"""Streaming a task's records: documents ``(text, utf8_bytes)`` or :class:`BadRecord`, in input order.

:class:`TaskReader` reads one :class:`~h5corpus.build.input.sources.Task` (a byte range of a JSONL file, row
groups of a parquet file, a compressed file, a run of ``.txt`` files). Memory holds one 1 MiB block
of JSONL lines, one parquet row batch, or one ``.txt`` document at a time. :class:`LocatingReader`
also names where each record came from (``--explain-drops``); :func:`sample_texts` takes the
fast-path proof's sample.
The read stage takes JSONL and parquet as runs of documents (:meth:`TaskReader.jsonl_chunks`,
:meth:`TaskReader.parquet_chunks`), whose records equal the per-record reader's.

The module runs past 600 lines because each format's per-record and run readers share their
stream handling and are meant to be read side by side.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from typing import Any

from .sources import DATASETS_KIND_PREFIX, SourceFile, Task, open_parquet
from .zstdframes import StreamError as _StreamError
from .zstdframes import Truncated as _Truncated
from .zstdframes import zstd_end_problem

#: Rows per parquet read batch.
PARQUET_BATCH_ROWS = 1024
#: Rows per parquet read batch of :func:`sample_texts`, which takes a task's first few documents:
#: pyarrow decodes the pages a batch needs, not the row group's whole column.
SAMPLE_PARQUET_BATCH_ROWS = 64
#: JSON lines are parsed leniently about raw control characters inside strings (unambiguous in
#: line-delimited JSON); one decoder for all lines (``json.loads(..., strict=False)`` builds one per call).
_JSON = json.JSONDecoder(strict=False)
try:  # faster than the json module (docs/BUILD.md); strict RFC 8259 (see _jsonl_record)
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - orjson is a dependency; the json module gives the same records
    _fast_loads = None


@dataclass(frozen=True)
class BadRecord:
    """A record that is not a usable document. ``where`` names file and line/row."""

    where: str
    reason: str
    code: str
    """Kind: invalid_utf8, invalid_unicode, malformed_json, not_object, missing_field, not_string,
    unreadable."""
    fatal: bool = False
    """True when the rest of the task could not be read (corrupt stream, unreadable file)."""

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


#: A document as read: its text and the text's UTF-8 bytes (``data`` hashes to the document id).
Doc = tuple[str, bytes]


def _utf8(text: str) -> bytes | None:
    """UTF-8 bytes of ``text``; None when it holds lone surrogates (JSON ``\\ud800`` escapes)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None


#: Bytes read at a time from a JSONL stream (lines are split out of each block).
_JSONL_BLOCK = 1 << 20


#: The UTF-8 byte order mark. Skipped at the very start of a JSONL file (RFC 8259 lets a parser
#: ignore it there); anywhere else it is data, and not JSON whitespace, so a line that starts with
#: one is malformed JSON.
UTF8_BOM = b"\xef\xbb\xbf"


class _JsonlStream:
    """A JSONL file's bytes in blocks. ``read(n)`` gives the next bytes, ``b""`` at the end; a
    compressed stream is read with ``read1``, so everything decompressed before the stream breaks
    off is delivered before the error. Once ``read`` gave ``b""``, :meth:`check_end` raises
    :class:`_Truncated` when the file was cut short (gzip's reader raises ``EOFError`` itself;
    zstd's ends silently, so its frames are walked: :func:`zstd_end_problem`)."""

    def __init__(self, fh: Any, read: Any, kind: str, path: str, errors: tuple[type[Exception], ...] = ()) -> None:
        self.fh, self.read, self.kind, self.path = fh, read, kind, path
        self.errors = errors
        """What the decompressor raises on corrupt data (besides OSError/ValueError)."""

    @classmethod
    def open(cls, f: SourceFile) -> _JsonlStream:
        if f.kind == "jsonl":
            fh = open(f.path, "rb")
            return cls(fh, fh.read, "jsonl", f.path)
        if f.kind == "jsonl.gz":
            import gzip
            import zlib

            gz = gzip.open(f.path, "rb")
            return cls(gz, gz.read1, "gzip", f.path, (zlib.error,))
        if f.kind == "jsonl.zst":
            import zstandard

            raw = open(f.path, "rb")
            try:
                zr = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True, read_across_frames=True)
            except Exception:
                raw.close()
                raise
            return cls(zr, zr.read1, "zstd", f.path, (zstandard.ZstdError,))
        raise ValueError(f.kind)

    def check_end(self) -> None:
        if self.kind == "zstd":
            zstd_end_problem(self.path)

    def __enter__(self) -> _JsonlStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fh.close()


def _read_past_bom(read: Any) -> tuple[bytes, int]:
    """The first block of a file without a leading UTF-8 BOM, and the bytes skipped (0 or 3)."""
    block = read(_JSONL_BLOCK)
    while block and len(block) < len(UTF8_BOM) and UTF8_BOM.startswith(block):
        more = read(_JSONL_BLOCK)
        if not more:
            break
        block += more
    if block.startswith(UTF8_BOM):
        return block[len(UTF8_BOM) :] or read(_JSONL_BLOCK), len(UTF8_BOM)
    return block, 0


def _truncation(stream: _JsonlStream, e: BaseException, last_line: int, inside: bool) -> str:
    """The reason of a truncation record: where the stream ends, the last complete line, what is missing."""
    missing = f": {e}" if isinstance(e, _Truncated) and str(e) else ", before its end-of-stream marker"
    if inside:
        done = f"the last complete line is {last_line:,}" if last_line else "no line is complete"
        return f"truncated: the {stream.kind} stream ends inside this line{missing} ({done})"
    if last_line:
        return f"truncated: the {stream.kind} stream ends after line {last_line:,} (the last complete line){missing}"
    return f"truncated: the {stream.kind} stream ends before its first line{missing}"


class _LineNumbers:
    """Where a JSONL task's lines are: :meth:`where` names line ``n`` (1-based, counted from the
    task's first line) as ``file:line``, counting the lines before the task only when one is named."""

    def __init__(self, reader: TaskReader, f: SourceFile) -> None:
        self.reader, self.f = reader, f
        self.first = 0
        """Byte offset of the task's first line (set once the stream is positioned)."""
        self._base: int | None = None

    def where(self, n: int) -> str:
        if self._base is None:
            self._base = self.reader._line_base(self.f.path, self.first)
        return f"{self.f.name}:{self._base + n - 1}"


def _lines_starting_before(lines: list[bytes], start: int, stop: int) -> int:
    """How many of ``lines`` (the first one starting at byte ``start``, each followed by a newline)
    start before byte ``stop``."""
    starts = list(accumulate((len(x) + 1 for x in lines), initial=start))
    return bisect_left(starts, stop, 0, len(lines))


def _texts_of(lines: list[bytes], field: str) -> list[str] | None:
    """The string ``field`` of every line when each one is a JSON object that has it (parsed by
    orjson, whose result :meth:`TaskReader._jsonl_record` would take for each); else None."""
    if _fast_loads is None:
        return None
    try:
        texts = list(map(itemgetter(field), map(_fast_loads, lines)))
    except (ValueError, KeyError, TypeError):  # a blank or malformed line, not an object, no field
        return None
    return texts if set(map(type, texts)) <= {str} else None


class TaskReader:
    """Stream one task's records: documents ``(text, utf8_bytes)`` (text possibly empty) or
    :class:`BadRecord`.

    Lines that are empty or whitespace only are not records (they are passed over silently).
    """

    def __init__(self, task: Task, text_field: str = "text", *, parquet_batch_rows: int = 0) -> None:
        self.task = task
        self.text_field = text_field
        self.parquet_batch_rows = parquet_batch_rows or PARQUET_BATCH_ROWS
        """Rows per parquet read batch (a reader that needs only the first rows takes fewer)."""

    def __iter__(self) -> Iterator[Doc | BadRecord]:
        k = self.task.kind
        if k in ("jsonl", "jsonl.gz", "jsonl.zst"):
            return self._jsonl()
        if k == "parquet":
            return self._parquet()
        if k == "text":
            return self._text()
        if k.startswith(DATASETS_KIND_PREFIX):
            from .hfrecords import read_records

            return read_records(self.task, self.text_field)
        raise ValueError(f"unknown task kind {k!r}")

    # jsonl --------------------------------------------------------------------------------------
    @staticmethod
    def _line_base(fh_path: str, first: int) -> int:
        """1-based number of the line starting at byte ``first`` (counted only when needed)."""
        if first == 0:
            return 1
        n = 0
        with open(fh_path, "rb") as fh:
            left = first
            while left > 0:
                b = fh.read(min(left, 1 << 24))
                if not b:
                    break
                n += b.count(b"\n")
                left -= len(b)
        return n + 1

    def _jsonl_record(self, line: bytes, where) -> Doc | BadRecord:
        # Fast path: orjson accepts a subset of what json(strict=False) accepts (RFC 8259: valid
        # UTF-8, no raw control characters in strings, no lone surrogate escapes, no NaN) and parses
        # that subset to the same objects. Its result is used only for the common case, an object
        # whose text field is a string; everything else (errors included) goes through the json
        # module below, so every BadRecord and every document is exactly what it gives.
        if _fast_loads is not None:
            try:
                obj = _fast_loads(line)
            except ValueError:
                obj = None
            if type(obj) is dict:
                v = obj.get(self.text_field)
                if type(v) is str:
                    return v, v.encode("utf-8")  # no lone surrogates: orjson rejects them
        return self._jsonl_record_slow(line, where)

    def _jsonl_record_slow(self, line: bytes, where) -> Doc | BadRecord:
        try:
            s = line.decode("utf-8")
        except UnicodeDecodeError as e:
            return BadRecord(
                where(), f"invalid UTF-8 (byte 0x{line[e.start]:02x} at offset {e.start} of the line)", "invalid_utf8"
            )
        try:
            obj = _JSON.decode(s)
        except ValueError as e:
            return BadRecord(where(), f"malformed JSON ({e})", "malformed_json")
        except RecursionError:
            return BadRecord(where(), "malformed JSON (nested too deeply to parse)", "malformed_json")
        if not isinstance(obj, dict):
            return BadRecord(where(), f"not a JSON object (a {_type_name(obj)})", "not_object")
        if self.text_field not in obj:
            keys = ", ".join(list(obj)[:8])
            return BadRecord(where(), f"no field {self.text_field!r} (fields: {keys})", "missing_field")
        v = obj[self.text_field]
        if not isinstance(v, str):
            return BadRecord(where(), f"field {self.text_field!r} is {_type_name(v)}, not a string", "not_string")
        data = _utf8(v)
        if data is None:
            return BadRecord(
                where(),
                f"field {self.text_field!r} holds a lone UTF-16 surrogate escape (not valid Unicode)",
                "invalid_unicode",
            )
        return v, data

    def _jsonl(self) -> Iterator[Doc | BadRecord]:
        at = _LineNumbers(self, self.task.files[0])
        n = 0  # the line just parsed (``where`` names it)

        def where() -> str:
            return at.where(n)

        for block in self._jsonl_blocks(at):
            if type(block) is BadRecord:
                yield block
                continue
            first, lines = block  # type: ignore[misc]
            for i, line in enumerate(lines):
                if not line or line.isspace():
                    continue
                n = first + i + 1
                yield self._jsonl_record(line, where)

    def jsonl_chunks(self) -> Iterator[DocChunk | BadRecord]:
        """A JSONL task's records, a block of lines at a time: runs of documents ``(texts, datas)``
        and bad records, in line order. A block whose every line is an object with a string field
        (the common case) costs no Python step per line beyond parsing it; any other block goes
        line by line through the records of :meth:`_jsonl`."""
        at = _LineNumbers(self, self.task.files[0])
        for block in self._jsonl_blocks(at):
            if type(block) is BadRecord:
                yield block
                continue
            first, lines = block  # type: ignore[misc]
            texts = _texts_of(lines, self.text_field)
            if texts is not None:
                if texts:
                    yield texts, list(map(str.encode, texts))  # no lone surrogates: orjson rejects them
                continue
            run: list[str] = []
            datas: list[bytes] = []
            for i, line in enumerate(lines):
                if not line or line.isspace():
                    continue
                rec = self._jsonl_record(line, lambda n=first + i + 1: at.where(n))
                if type(rec) is tuple:
                    run.append(rec[0])
                    datas.append(rec[1])
                    continue
                if run:
                    yield run, datas
                    run, datas = [], []
                yield rec  # type: ignore[misc]
            if run:
                yield run, datas

    def _jsonl_blocks(self, at: _LineNumbers) -> Iterator[tuple[int, list[bytes]] | BadRecord]:
        """The task's lines (empty and blank ones included), a block read at a time, as (lines
        before them, lines); a fatal :class:`BadRecord` where the stream breaks off or cannot be read."""
        t = self.task
        f = t.files[0]
        lineno = 0
        try:
            stream = _JsonlStream.open(f)
        except OSError as e:
            yield BadRecord(f.name, f"cannot open ({e.strerror or e})", "unreadable", fatal=True)
            return
        pending: list[bytes] = []  # pieces of a line that continues in the next block
        with stream:
            read = stream.read
            try:
                fh = stream.fh
                if t.kind == "jsonl" and t.start > 0:
                    fh.seek(t.start - 1)
                    if fh.read(1) != b"\n":
                        fh.readline()  # this line belongs to the previous range
                pos = at.first = fh.tell() if t.kind == "jsonl" else 0
                stop = t.stop if t.kind == "jsonl" else -1
                # Read in blocks and split them into lines (a line belongs to the task when it starts
                # before ``stop``); far fewer calls than readline() per record.
                if pos == 0:
                    block, pos = _read_past_bom(read)  # pos: bytes of the file, the BOM included
                else:
                    block = read(_JSONL_BLOCK)
                eof = False
                while not eof:
                    if not block:
                        stream.check_end()
                        eof = True
                        lines = [b"".join(pending)] if pending else []
                    elif b"\n" not in block:
                        pending.append(block)  # joined once, when the line ends: linear in its length
                        block = read(_JSONL_BLOCK)
                        continue
                    else:
                        if pending:
                            pending.append(block)
                            block = b"".join(pending)
                        lines = block.split(b"\n")
                        last = lines.pop()
                        pending = [last] if last else []
                    start, pos = pos, pos + sum(map(len, lines)) + len(lines)  # each line and its newline
                    if stop >= 0 and pos > stop:  # the task's range ends in this block
                        keep = _lines_starting_before(lines, start, stop)
                        if keep:
                            yield lineno, lines[:keep]
                        return
                    if lines:
                        yield lineno, lines
                        lineno += len(lines)
                    block = read(_JSONL_BLOCK)
            except (_Truncated, EOFError) as e:  # gzip's reader raises EOFError
                lineno += 1
                yield BadRecord(
                    at.where(lineno), _truncation(stream, e, lineno - 1, bool(pending)), "truncated", fatal=True
                )
            except (OSError, ValueError, _StreamError, *stream.errors) as e:  # a corrupt stream, an I/O error
                lineno += 1
                yield BadRecord(
                    at.where(lineno), f"unreadable from here on ({type(e).__name__}: {e})", "unreadable", fatal=True
                )

    # parquet ------------------------------------------------------------------------------------
    def _parquet(self) -> Iterator[Doc | BadRecord]:
        for chunk in self.parquet_chunks():
            if isinstance(chunk, BadRecord):
                yield chunk
            else:
                yield from zip(*chunk)

    def parquet_chunks(self) -> Iterator[DocChunk | BadRecord]:
        """A parquet task's records, a row batch at a time: runs of documents as ``(texts, datas)``
        (``datas``: each text's UTF-8 bytes, as views of the column's own buffer where it has one)
        and bad records, in row order. No Python work per row beyond making its ``str``."""
        t = self.task
        f = t.files[0]
        try:
            pf = open_parquet(f.path)
            n_groups = pf.metadata.num_row_groups
        except Exception as e:
            yield BadRecord(f.name, f"cannot open as parquet ({type(e).__name__}: {e})", "unreadable", fatal=True)
            return
        stop = n_groups if t.stop < 0 else t.stop
        groups = list(range(t.start, stop))
        n_rows = sum(pf.metadata.row_group(i).num_rows for i in groups)
        row = t.first_row
        fld = self.text_field
        why = _not_a_text_column(pf.schema_arrow, fld)
        if why is not None:
            reason, code = why
            for r in range(row, row + n_rows):
                yield BadRecord(f"{f.name} row {r}", reason, code)
            return
        if not groups:
            return
        try:
            # use_threads=False: the worker decodes on its own thread (workers are the parallelism)
            batches = pf.iter_batches(
                batch_size=self.parquet_batch_rows, row_groups=groups, columns=[fld], use_threads=False
            )
            for batch in batches:
                col = batch.column(0)
                yield from _string_chunks(col, f"{f.name} row ", row, fld)
                row += len(col)
        except Exception as e:
            yield BadRecord(
                f"{f.name} row {row}", f"unreadable from here on ({type(e).__name__}: {e})", "unreadable", fatal=True
            )

    # text ---------------------------------------------------------------------------------------
    def _text(self) -> Iterator[Doc | BadRecord]:
        for f in self.task.files:
            try:
                with open(f.path, "rb") as fh:
                    raw = fh.read()
            except OSError as e:
                yield BadRecord(f.name, f"cannot read ({e.strerror or e})", "unreadable")
                continue
            try:
                yield raw.decode("utf-8"), raw
            except UnicodeDecodeError as e:
                line = raw.count(b"\n", 0, e.start) + 1
                yield BadRecord(
                    f.name,
                    f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start:,}, line {line})",
                    "invalid_utf8",
                )


def _is_text_type(typ: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ))


def _not_a_text_column(schema: Any, fld: str) -> tuple[str, str] | None:
    """(reason, code) when column ``fld`` of a parquet file cannot hold texts, else None. A string
    column may be dictionary-encoded (``dictionary<values=string>``, e.g. written from a categorical)."""
    import pyarrow as pa

    if fld not in schema.names:
        return f"no column {fld!r} (columns: {', '.join(schema.names[:8])})", "missing_field"
    typ = schema.field(fld).type
    if _is_text_type(typ) or (pa.types.is_dictionary(typ) and _is_text_type(typ.value_type)):
        return None
    return f"column {fld!r} is {typ}, not a string", "not_string"


#: A run of documents of one row batch: their texts and the texts' UTF-8 bytes (``bytes`` or views).
DocChunk = tuple[list[str], list[Any]]


def _utf8_views(col: Any) -> list[Any] | None:
    """Each value's UTF-8 bytes as a view of a string array's data buffer, or None for an array
    without that layout (string views)."""
    import numpy as np
    import pyarrow as pa

    if pa.types.is_string(col.type):
        width = np.int32
    elif pa.types.is_large_string(col.type):
        width = np.int64
    else:
        return None
    bufs = col.buffers()
    offs = np.frombuffer(bufs[1], dtype=width)[col.offset : col.offset + len(col) + 1].tolist()
    data = memoryview(bufs[2]) if bufs[2] is not None else memoryview(b"")
    return [data[a:b] for a, b in zip(offs[:-1], offs[1:])]


def _string_chunks(col: Any, where: str, row: int, fld: str) -> Iterator[DocChunk | BadRecord]:
    """One row batch of the text column (rows ``row``, ``row + 1``, ...) as document runs and bad
    records, in row order."""
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    try:
        texts = col.to_pylist()
    except Exception:  # invalid UTF-8 somewhere in the batch: find the row
        yield from _rows_one_by_one(col, where, row, fld)
        return
    if col.null_count == 0:
        datas = _utf8_views(col)
        yield texts, datas if datas is not None else [v.encode("utf-8") for v in texts]
        return
    run: list[str] = []
    for i, v in enumerate(texts):
        if v is None:
            if run:
                yield run, [x.encode("utf-8") for x in run]
                run = []
            yield BadRecord(f"{where}{row + i}", f"field {fld!r} is null, not a string", "not_string")
        else:
            run.append(v)
    if run:
        yield run, [x.encode("utf-8") for x in run]


def _rows_one_by_one(col: Any, where: str, row: int, fld: str) -> Iterator[DocChunk | BadRecord]:
    for i in range(len(col)):
        try:
            v = col[i].as_py()
        except Exception as e:
            yield BadRecord(f"{where}{row + i}", f"invalid string ({type(e).__name__}: {e})", "invalid_utf8")
            continue
        if v is None:
            yield BadRecord(f"{where}{row + i}", f"field {fld!r} is null, not a string", "not_string")
        else:
            yield [v], [v.encode("utf-8")]


class LocatingReader(TaskReader):
    """A :class:`TaskReader` that also names where each record came from, for ``--explain-drops``:
    ``(file, "line", n)`` for JSONL (1-based line), ``(file, "row", n)`` for parquet (0-based row),
    ``(file, None, None)`` for ``.txt``. Call :meth:`location` right after a record is yielded.

    JSONL line numbers come from the reader's own ``where`` (the line it just parsed); the count of
    lines before the task's byte range is given (``newlines_before``, counted once per file by
    :func:`newlines_before`) instead of re-reading the file prefix for every task."""

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

    def _jsonl_record(self, line: bytes, where: Any) -> Doc | BadRecord:
        self._where = where
        return super()._jsonl_record(line, where)

    def location(self, ordinal: int) -> tuple[str, str | None, int | None]:
        """Where record number ``ordinal`` (0-based, bad records included) of the task is."""
        t = self.task
        if t.kind.startswith(DATASETS_KIND_PREFIX):
            from .hfrecords import record_location

            return record_location(t, ordinal)
        if t.kind == "parquet":
            return t.files[0].name, "row", t.first_row + ordinal
        if t.kind == "text":
            return t.files[ordinal].name, None, None
        name, _, line = self._where().rpartition(":")
        return name, "line", int(line)


def newlines_before(tasks: Sequence[Task]) -> dict[int, int]:
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


def sample_texts(tasks: Sequence[Task], text_field: str, limit_chars: int, per_task: int) -> list[str]:
    """The first documents of each task in input order (whole documents, the last one of a task
    cut at a line break), up to ``per_task`` characters per task and ``limit_chars`` in all."""
    out: list[str] = []
    total = 0
    for t in tasks:
        here = 0
        for rec in TaskReader(t, text_field, parquet_batch_rows=SAMPLE_PARQUET_BATCH_ROWS):
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
