"""Deprecated name of :mod:`h5corpus.loaders.epochplan` (the loaders' epoch plan, not the build's
plan): every name still resolves, with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings
from typing import Any

from . import epochplan


def __getattr__(name: str) -> Any:
    value = getattr(epochplan, name)  # AttributeError for a name epochplan lacks
    warnings.warn(
        f"h5corpus.loaders.plan.{name} is deprecated: import it from h5corpus.loaders.epochplan",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
