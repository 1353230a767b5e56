"""Building a corpus: sources -> tokenizer -> stages (read, decide, finish, commit) -> shards + manifest.

Imports :mod:`h5corpus.storage` (to write and check shards) and :mod:`h5corpus.filters` (the
optional document filters); nothing imports it but the CLI and the inspection layer. See
``docs/BUILD.md`` and ``docs/ARCHITECTURE.md``.

Subpackages, each owning one job: :mod:`.input` (SOURCE specs -> tasks -> records),
:mod:`.tokenize` (tokenizer, encoders, the fast-path proof), :mod:`.stages` (the build plan, the
state folder, the read/decide/finish/commit stages and their dispatcher) and :mod:`.run` (the
driver :func:`build_corpus` and the executors). :mod:`.config` (settings, split rule, errors),
:mod:`.oserrors` and :mod:`.report` are shared by all of them.
"""

from __future__ import annotations

from .config import BuildConfig, BuildConflict, BuildError, document_split, parse_byte_size, parse_max_tokens
from .input.hfdatasets import DatasetSource
from .report import BuildReport, filtered_total, format_report
from .run.runner import build_corpus

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
    "parse_byte_size",
    "parse_max_tokens",
]
