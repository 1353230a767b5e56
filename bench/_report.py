"""Shared output step of the benchmarks: print the JSON report and optionally save it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(report: dict[str, Any], out: Path | None, indent: int = 2) -> None:
    """Print ``report`` as JSON on stdout and, if ``out`` is given, write it there too."""
    text = json.dumps(report, indent=indent)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
