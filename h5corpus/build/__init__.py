"""Building a corpus: sources -> tokenizer -> stages (read, decide, finish, commit) -> shards + manifest.

Imports :mod:`h5corpus.storage` (to write and check shards) and :mod:`h5corpus.filters` (the
optional document filters); nothing imports it but the CLI and the inspection layer. See
``docs/BUILD.md`` and ``docs/ARCHITECTURE.md``.

Modules: :mod:`~.config` (settings, split rule, errors), :mod:`~.sources` (SOURCE specs -> tasks),
:mod:`~.readers` (a task's records), :mod:`~.hfdatasets` and :mod:`~.hfreaders` (``datasets``
sources and their tasks' records), :mod:`~.tokenizer` and :mod:`~.encoders`, :mod:`~.plan` (the
persisted plan, the stage context), :mod:`~.tasks` (read and finish stages), :mod:`~.decide`,
:mod:`~.commit`, :mod:`~.state` (state folder, records, shard names), :mod:`~.executor`,
:mod:`~.explain`, :mod:`~.report`, :mod:`~.runner` (the driver, :func:`build_corpus`).
"""

from __future__ import annotations

from .config import BuildConfig, BuildConflict, BuildError, document_split, parse_max_tokens
from .hfdatasets import DatasetSource
from .report import BuildReport, filtered_total, format_report
from .runner import build_corpus

__all__ = [
    "BuildConfig",
    "BuildConflict",
    "BuildError",
    "BuildReport",
    "DatasetSource",
    "build_corpus",
    "document_split",
    "filtered_total",
    "format_report",
    "parse_max_tokens",
]
