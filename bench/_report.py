"""Shared output step of the benchmarks: the JSON report, with where and how it was measured.

Every report :func:`emit` writes carries a ``meta`` section (bench name, machine, UTC date, the
command line) and, when the bench names them, its headline ``figures`` (one short label -> one
value with its unit, as text). ``bench/benchmarks_table.py`` turns the saved reports in
``bench/results/*.json`` into the one table of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
"""Where saved reports live (one JSON per bench and section)."""


def machine() -> str:
    """The machine in a few words: CPU model, logical cores, OS."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def meta(bench: str) -> dict[str, str]:
    """Where, when and how this process measures: the ``meta`` section of a report."""
    return {
        "bench": bench,
        "machine": machine(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
    }


def emit(
    report: dict[str, Any], out: Path | None, indent: int = 2, *, figures: Mapping[str, str] | None = None
) -> None:
    """Print ``report`` as JSON on stdout, with its ``meta`` (and ``figures`` when given), and, if
    ``out`` is given, write it there too (``bench/results/NAME.json`` feeds docs/BENCHMARKS.md)."""
    bench = Path(sys.argv[0]).stem
    full = {"meta": meta(bench), **({"figures": dict(figures)} if figures else {}), **report}
    text = json.dumps(full, indent=indent)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
