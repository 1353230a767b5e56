"""A fine-tuning build's records: :class:`SFTRecordReader` streams one task's JSON objects
(``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` lines or ``.parquet`` rows) as rendered documents with
their trained-on character ranges (:func:`~h5corpus.build.input.chat.sft_text`).

Each record comes out as ``(text, utf8_bytes, spans, where)``: the text the document id hashes,
the character ranges trained on and ``file:line`` (or ``file row n``), which names the record in
an error found after encoding (an EOS inside it). A record that cannot be a document is a
:class:`~h5corpus.build.input.inputs.BadRecord` naming file, line and field (code
``invalid_record``), like any bad record of the pretraining build (``--on-error``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .chat import ChatTemplate, RecordError, SFTText, sft_text
from .inputs import BadRecord, Task
from .records import _JSON, TaskReader, _fast_loads, _utf8
from .sources import open_parquet

#: Task kinds a fine-tuning build reads (JSON objects per line, or parquet rows).
SFT_KINDS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet")
#: Parquet columns a fine-tuning record may use (the others are not read).
SFT_COLUMNS = ("messages", "prompt", "completion", "text", "no_loss_ranges")
#: One fine-tuning document: text, its UTF-8 bytes, trained-on character ranges, where it was read.
SFTDoc = tuple[str, bytes, tuple[tuple[int, int], ...], str]


def render_record(rec: Any, template: ChatTemplate | None, loss_on: str, bos_text: str | None) -> SFTText:
    """One parsed record as its document (:func:`sft_text`), refusing a rendered text that already
    starts with the BOS the build prepends (``bos_text``: the template's ``bos_token`` when a BOS
    is asked for). Raises :class:`RecordError` naming the field."""
    doc = sft_text(rec, template, loss_on)
    if bos_text and doc.text.startswith(bos_text):
        raise RecordError("the chat template already writes the BOS token; drop --bos")
    return doc


class SFTRecordReader(TaskReader):
    """A task's fine-tuning records, in input order (module docstring)."""

    def __init__(
        self, task: Task, template: ChatTemplate | None, loss_on: str, bos_text: str | None, max_record_bytes: int
    ) -> None:
        super().__init__(task, max_record_bytes=max_record_bytes)
        self.template, self.loss_on, self.bos_text = template, loss_on, bos_text

    def __iter__(self) -> Iterator[Any]:
        if self.task.kind not in SFT_KINDS:  # refused when the build is planned; never reached
            raise ValueError(f"{self.task.label}: a fine-tuning build reads .jsonl and .parquet records")
        return super().__iter__()

    def _document(self, obj: Any, where: Callable[[], str]) -> SFTDoc | BadRecord:
        try:
            doc = render_record(obj, self.template, self.loss_on, self.bos_text)
        except RecordError as e:
            return BadRecord(where(), str(e), "invalid_record")
        data = _utf8(doc.text)
        if data is None:
            return BadRecord(
                where(), "the text holds a lone UTF-16 surrogate escape (not valid Unicode)", "invalid_unicode"
            )
        return doc.text, data, doc.spans, where()

    def _jsonl_record(self, line: bytes, where: Any) -> Any:  # type: ignore[override]
        obj: Any = None
        parsed = False
        if _fast_loads is not None:
            try:
                obj, parsed = _fast_loads(line), True
            except ValueError:
                pass
        if not parsed and b"\0" not in line:
            try:
                obj, parsed = _JSON.decode(line.decode("utf-8")), True
            except (ValueError, RecursionError):
                pass
        if not parsed:  # the pretraining reader's checks name what is wrong with the line
            return self._jsonl_record_slow(line, where)
        return self._document(obj, where)

    def _parquet(self) -> Iterator[Any]:  # type: ignore[override]
        t = self.task
        f = t.files[0]
        try:
            pf = open_parquet(f.path)
            stop = pf.metadata.num_row_groups if t.stop < 0 else t.stop
            cols = [c for c in SFT_COLUMNS if c in pf.schema_arrow.names]
            batches = pf.iter_batches(
                batch_size=self.parquet_batch_rows,
                row_groups=list(range(t.start, stop)),
                columns=cols,
                use_threads=False,
            )
        except Exception as e:
            yield BadRecord(f.name, f"cannot open as parquet ({type(e).__name__}: {e})", "unreadable", fatal=True)
            return
        row = t.first_row
        try:
            for batch in batches:
                for rec in batch.to_pylist():
                    yield self._document(_present(rec), lambda r=row: f"{f.name} row {r}")
                    row += 1
        except Exception as e:
            yield BadRecord(
                f"{f.name} row {row}", f"unreadable from here on ({type(e).__name__}: {e})", "unreadable", fatal=True
            )


def _present(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A parquet row without its null columns (a table mixing record shapes leaves the others null)."""
    return {k: v for k, v in rec.items() if v is not None}
