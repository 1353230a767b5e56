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

import gzip
import json
import os
import zlib
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate
from operator import itemgetter
from typing import Any

import numpy as np

from ..config import DEFAULT_MAX_RECORD_BYTES
from .hfrecords import read_records as read_dataset_records
from .inputs import DATASETS_KIND_PREFIX, BadRecord, Doc, SourceFile, Task, datasets_record_location
from .sources import open_parquet
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


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


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


class _Changed(Exception):
    """The file is not the one planned: its size or modification time changed during the build."""


def _check_unchanged(fh: Any, f: SourceFile) -> None:
    """Raise :class:`_Changed` when the open file ``fh`` no longer has the size and modification
    time recorded when the build planned it (a local file cut short, grown or rewritten)."""
    st = os.fstat(fh.fileno())
    if st.st_size != f.size or (f.mtime_ns and st.st_mtime_ns != f.mtime_ns):
        raise _Changed(
            f"the file changed while the build read it ({f.size:,} bytes when planned, now {st.st_size:,}"
            f"{'' if st.st_mtime_ns == f.mtime_ns else ', modified since'}); re-run the build once it is complete"
        )


class _LineCutter:
    """The lines of one JSONL task, out of a stream's blocks, holding at most ``limit`` bytes of a
    line that has not ended: a longer line is reported as a :class:`BadRecord` (``too_long``)
    naming its line and byte offset, and passed over without being kept. ``pos`` is the byte
    offset (in the decompressed stream) where the current line starts; ``lineno`` the lines of
    the task before it."""

    def __init__(self, stream: _JsonlStream, at: _LineNumbers, limit: int) -> None:
        self.stream, self.at, self.limit = stream, at, limit
        self.f = at.f
        self.pos = 0
        self.lineno = 0
        self.pending: list[bytes] = []  # pieces of the current line (one join when it ends)
        self.pending_bytes = 0

    def _first_block(self, task: Task) -> bytes:
        """Position the stream at the task's first line; return the first block from there."""
        read, fh = self.stream.read, self.stream.fh
        if task.kind == "jsonl" and task.start > 0:
            fh.seek(task.start - 1)
            self.pos = task.start
            if fh.read(1) != b"\n":  # this line belongs to the previous range: pass over it
                rest = self._past_newline(read(_JSONL_BLOCK))
                self.at.first = self.pos
                return rest
            self.at.first = self.pos
            return read(_JSONL_BLOCK)
        block, self.pos = _read_past_bom(read)  # pos: bytes of the file, the BOM included
        return block

    def _past_newline(self, block: bytes) -> bytes:
        """Read on from ``block`` to just after the next newline, keeping nothing; ``pos`` moves
        with it. Returns what follows the newline (``b""`` at the end of the stream)."""
        while block:
            nl = block.find(b"\n")
            if nl >= 0:
                self.pos += nl + 1
                return block[nl + 1 :] or self.stream.read(_JSONL_BLOCK)
            self.pos += len(block)
            if self.stream.kind == "jsonl" and self.pos > self.f.size:
                raise _Changed(f"the file grew past its planned {self.f.size:,} bytes while the build read it")
            block = self.stream.read(_JSONL_BLOCK)
        return block

    def _too_long(self, n: int, at_byte: int) -> BadRecord:
        return BadRecord(
            self.at.where(n),
            f"record longer than {self.limit:,} bytes (--max-record-bytes) at byte offset {at_byte:,}",
            "too_long",
        )

    def _runs(self, lines: list[bytes]) -> Iterator[tuple[int, list[bytes]] | BadRecord]:
        """``(lines before them, lines)`` of the task's next ``lines``, a too-long one in between as
        its :class:`BadRecord`; ``lineno`` and ``pos`` move past them."""
        if lines and max(map(len, lines)) > self.limit:
            first, start = 0, self.pos
            for i, line in enumerate(lines):
                if len(line) > self.limit:
                    if i > first:
                        yield self.lineno + first, lines[first:i]
                    yield self._too_long(self.lineno + i + 1, start)
                    first = i + 1
                start += len(line) + 1
            if first < len(lines):
                yield self.lineno + first, lines[first:]
        elif lines:
            yield self.lineno, lines
        self.lineno += len(lines)
        self.pos += sum(map(len, lines)) + len(lines)  # each line and its newline

    def lines(self, task: Task) -> Iterator[tuple[int, list[bytes]] | BadRecord]:
        """The task's lines (empty and blank ones included) as ``(lines before them, lines)``, a
        block read at a time (a line belongs to the task when it starts before ``task.stop``)."""
        read = self.stream.read
        stop = task.stop if task.kind == "jsonl" else -1
        block = self._first_block(task)
        while True:
            if not block:
                self.stream.check_end()
                if self.stream.kind == "jsonl":
                    _check_unchanged(self.stream.fh, self.f)
                tail = [b"".join(self.pending)] if self.pending else []
                self.pending, self.pending_bytes = [], 0
                yield from self._runs(tail)
                return
            if b"\n" not in block:
                if stop >= 0 and self.pos >= stop:
                    return  # the line starting here belongs to the next task
                self.pending.append(block)
                self.pending_bytes += len(block)
                if self.pending_bytes > self.limit:
                    yield self._too_long(self.lineno + 1, self.pos)
                    self.pos += self.pending_bytes
                    self.pending, self.pending_bytes = [], 0
                    self.lineno += 1
                    block = self._past_newline(read(_JSONL_BLOCK))
                    continue
                block = read(_JSONL_BLOCK)
                continue
            if self.pending:
                self.pending.append(block)
                block = b"".join(self.pending)
            lines = block.split(b"\n")
            last = lines.pop()
            self.pending, self.pending_bytes = ([last], len(last)) if last else ([], 0)
            if stop >= 0 and self.pos + sum(map(len, lines)) + len(lines) > stop:  # the range ends here
                yield from self._runs(lines[: _lines_starting_before(lines, self.pos, stop)])
                return
            yield from self._runs(lines)
            block = read(_JSONL_BLOCK)


class TaskReader:
    """Stream one task's records: documents ``(text, utf8_bytes)`` (text possibly empty) or
    :class:`BadRecord`.

    Lines that are empty or whitespace only are not records (they are passed over silently).
    """

    def __init__(
        self,
        task: Task,
        text_field: str = "text",
        *,
        parquet_batch_rows: int = 0,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        self.task = task
        self.text_field = text_field
        self.max_record_bytes = int(max_record_bytes)
        """Longest record read, in bytes (a JSON line, a parquet cell, a ``.txt`` file); a longer
        one is a :class:`BadRecord` (``too_long``), never held in memory whole."""
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
            return read_dataset_records(self.task, self.text_field)
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
        nul = line.find(b"\0")
        if nul >= 0:  # lenient about other raw control characters, not about NUL: a sign of binary data
            return BadRecord(
                where(), f"raw NUL byte at offset {nul} of the line (JSON writes it \\u0000)", "malformed_json"
            )
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
        before them, lines); a too-long line as its :class:`BadRecord`; a fatal one where the
        stream breaks off, cannot be read, or the file changed since the build planned it."""
        f = self.task.files[0]
        try:
            stream = _JsonlStream.open(f)
        except OSError as e:
            yield BadRecord(f.name, f"cannot open ({e.strerror or e})", "unreadable", fatal=True)
            return
        with stream:
            cut = _LineCutter(stream, at, self.max_record_bytes)
            try:
                yield from cut.lines(self.task)
            except _Changed as e:
                yield BadRecord(at.where(cut.lineno + 1), str(e), "changed", fatal=True)
            except (_Truncated, EOFError) as e:  # gzip's reader raises EOFError
                reason = _truncation(stream, e, cut.lineno, bool(cut.pending))
                yield BadRecord(at.where(cut.lineno + 1), reason, "truncated", fatal=True)
            except (OSError, ValueError, _StreamError, *stream.errors) as e:  # a corrupt stream, an I/O error
                yield BadRecord(
                    at.where(cut.lineno + 1),
                    f"unreadable from here on ({type(e).__name__}: {e})",
                    "unreadable",
                    fatal=True,
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
                yield from _bounded_chunks(col, f"{f.name} row ", row, fld, self.max_record_bytes)
                row += len(col)
        except Exception as e:
            yield BadRecord(
                f"{f.name} row {row}", f"unreadable from here on ({type(e).__name__}: {e})", "unreadable", fatal=True
            )

    # text ---------------------------------------------------------------------------------------
    def _text(self) -> Iterator[Doc | BadRecord]:
        limit = self.max_record_bytes
        for f in self.task.files:
            try:
                with open(f.path, "rb") as fh:
                    _check_unchanged(fh, f)
                    raw = fh.read(limit + 1) if f.size <= limit else b""
            except _Changed as e:
                yield BadRecord(f.name, str(e), "changed", fatal=True)
                return
            except OSError as e:
                yield BadRecord(f.name, f"cannot read ({e.strerror or e})", "unreadable")
                continue
            if f.size > limit or len(raw) > limit:
                reason = f"a file of {max(f.size, len(raw)):,} bytes, longer than {limit:,} (--max-record-bytes)"
                yield BadRecord(f.name, reason, "too_long")
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


def _cell_bytes(col: Any) -> Any:
    """int64 UTF-8 bytes of every value of a string row batch (0 for a null), without decoding a
    dictionary-encoded column (its values' lengths, taken by index)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(col.type):
        lengths = pc.binary_length(col.dictionary).take(col.indices)
    elif pa.types.is_string_view(col.type):  # 16-byte views, the length first
        views = np.frombuffer(col.buffers()[1], dtype=np.int32).reshape(-1, 4)
        return views[col.offset : col.offset + len(col), 0].astype(np.int64)
    else:
        lengths = pc.binary_length(col)
    return lengths.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _bounded_chunks(col: Any, where: str, row: int, fld: str, limit: int) -> Iterator[DocChunk | BadRecord]:
    """:func:`_string_chunks` of a row batch whose values may exceed ``limit`` bytes: such a value
    is a :class:`BadRecord` (``too_long``), never decoded; the others are decoded in runs of at
    most ``limit`` bytes, so a dictionary-encoded column that repeats one long value is never
    decoded all at once."""
    n = _cell_bytes(col)
    if n.size == 0 or (int(n.max()) <= limit and int(n.sum()) <= max(limit, 1 << 28)):
        yield from _string_chunks(col, where, row, fld)  # the common case: nothing to split
        return
    a, total = 0, 0
    for i in range(n.size + 1):  # a Python step per row only for a batch holding a too-long value
        if i < n.size and n[i] <= limit and total + n[i] <= limit:
            total += int(n[i])
            continue
        if i > a:
            yield from _string_chunks(col.slice(a, i - a), where, row + a, fld)
        if i == n.size:
            return
        if n[i] > limit:
            reason = f"record longer than {limit:,} bytes (--max-record-bytes): {int(n[i]):,} bytes"
            yield BadRecord(f"{where}{row + i}", reason, "too_long")
            a, total = i + 1, 0
        else:
            a, total = i, int(n[i])


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

    def __init__(
        self, task: Task, text_field: str, newlines_before: int, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    ) -> None:
        super().__init__(task, text_field, max_record_bytes=max_record_bytes)
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
            return datasets_record_location(t, ordinal)
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


def sample_texts(
    tasks: Sequence[Task],
    text_field: str,
    limit_chars: int,
    per_task: int,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> list[str]:
    """The first documents of each task in input order (whole documents, the last one of a task
    cut at a line break), up to ``per_task`` characters per task and ``limit_chars`` in all."""
    out: list[str] = []
    total = 0
    for t in tasks:
        here = 0
        reader = TaskReader(
            t, text_field, parquet_batch_rows=SAMPLE_PARQUET_BATCH_ROWS, max_record_bytes=max_record_bytes
        )
        for rec in reader:
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
