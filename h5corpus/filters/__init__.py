"""Document filters: cleaning, language ID, heuristic quality rules, PII scrubbing, near-dedup.

Imports nothing else of h5corpus (the build calls into it through a small duck-typed seam). Each
stage's third-party dependency is imported only when that stage is on (extra ``filters``). See
``docs/FILTERS.md``.
"""

from __future__ import annotations

from .pipeline import (
    FILTERS_VERSION,
    DocumentFilter,
    FilterConfig,
    FilterResult,
    backend_versions,
    dropped_counts,
    merge_stats,
    parse_lang_codes,
)
from .quality import QualityThresholds

__all__ = [
    "FILTERS_VERSION",
    "DocumentFilter",
    "FilterConfig",
    "FilterResult",
    "QualityThresholds",
    "backend_versions",
    "dropped_counts",
    "merge_stats",
    "parse_lang_codes",
]
