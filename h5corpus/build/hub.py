"""Where the Hugging Face hub cache is and whether the hub may be asked: shared by the tokenizer
(``gpt2`` from the cache) and the sources (``hf://`` specs)."""

from __future__ import annotations

import os
from pathlib import Path


def hf_cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The Hugging Face hub cache: ``explicit``, else ``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
    ``~/.cache/huggingface/hub`` (read at call time, so tests and callers can redirect it)."""
    if explicit is not None:
        return Path(explicit)
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE says not to ask the hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
