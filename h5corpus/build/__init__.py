"""Building a corpus: sources -> tokenizer -> stages (read, decide, finish, commit) -> shards + manifest.

Imports :mod:`h5corpus.storage` (to write and check shards) and :mod:`h5corpus.filters` (the
optional document filters); nothing imports it but the CLI and the inspection layer. See
``docs/BUILD.md`` and ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

from .runner import (
    BuildConfig,
    BuildConflict,
    BuildError,
    BuildReport,
    build_corpus,
    document_split,
    filtered_total,
    format_report,
    parse_max_tokens,
)

__all__ = [
    "BuildConfig",
    "BuildConflict",
    "BuildError",
    "BuildReport",
    "build_corpus",
    "document_split",
    "filtered_total",
    "format_report",
    "parse_max_tokens",
]
