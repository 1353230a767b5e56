"""``--explain-drops``: one JSON line per document that was read but not stored, in input order.

The read stage records, per task, the location and id-as-read of its documents and the lines of
what it dropped itself (filters, empty texts, duplicates inside the task); the decide stage adds
the lines of its own drops (exact and near duplicates across tasks, the worst-fraction rule,
over budget) and writes each
task's lines, in input order, to a temporary file that :meth:`ExplainFile.publish` renames into
place before the manifest is written. The line format is in docs/FILTERS.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO


def explain_line(
    doc_id: str,
    loc: tuple[str, str | None, int | None],
    reason: str,
    info: Mapping[str, Any] | None = None,
    dup_of: str | None = None,
) -> dict[str, Any]:
    """One record: id (sha256 hex of the text as read), source, line/row, reason, and what is known
    and cheap: the detected language, the perplexity, the stored copy of an exact duplicate."""
    d: dict[str, Any] = {"id": doc_id, "source": loc[0]}
    if loc[1] is not None:
        d[loc[1]] = loc[2]
    d["reason"] = reason
    if info and "lang" in info:
        d["lang"] = info["lang"]
        d["lang_prob"] = round(float(info["lang_prob"]), 4)
    if info and info.get("perplexity") is not None:
        d["perplexity"] = round(float(info["perplexity"]), 4)
    if dup_of is not None:
        d["duplicate_of"] = dup_of
    return d


class ExplainFile:
    """The drop list being written: a temporary file beside ``path``, renamed into place at the end."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()
        self.tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        self.fh: TextIO | None = None  # opened at the first write (after the workers have forked)
        self.lines = 0
        if self.path.parent.is_dir():
            for p in self.path.parent.glob(f".{self.path.name}.tmp*"):
                if p.name[len(self.path.name) + 5 :].isdigit():
                    p.unlink(missing_ok=True)  # left by a killed build

    def write(self, lines: Iterable[Mapping[str, Any]]) -> None:
        if self.fh is None:
            self.tmp.parent.mkdir(parents=True, exist_ok=True)
            self.fh = open(self.tmp, "w", encoding="utf-8")
        for d in lines:
            self.fh.write(json.dumps(d, ensure_ascii=False) + "\n")
            self.lines += 1

    def publish(self) -> None:
        """Make the file durable and rename it into place."""
        self.write(())
        assert self.fh is not None
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        if self.fh is not None:
            self.fh.close()
        self.tmp.unlink(missing_ok=True)
