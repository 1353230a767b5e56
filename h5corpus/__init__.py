"""h5corpus: raw text -> tokenized, sharded, verifiable HDF5 corpus -> padding-free varlen batches.

Public names are imported lazily so that ``import h5corpus`` (and the CLI) stay fast and
torch is loaded only by the loaders that need it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # storage contract
    "FORMAT_VERSION": "format",
    "FormatError": "format",
    "TokenizerIdentity": "format",
    "ShardWriter": "writer",
    "ShardInfo": "writer",
    "Manifest": "manifest",
    "ShardEntry": "manifest",
    "read_manifest": "manifest",
    "write_manifest": "manifest",
    "validate_corpus": "validate",
    "ValidationReport": "validate",
    # reading and batches
    "open_corpus": "reader",
    "Corpus": "reader",
    "open_live": "reader",
    "VarlenBatch": "batch",
    "IGNORE_INDEX": "batch",
    "collate_varlen": "batch",
    "concat_batches": "batch",
    "SlidingWindowDataset": "window",
    "BestFitDataset": "packing",
    "split_tokens": "packing",
    "causal_attention": "attention",
    "packed_loss": "attention",
    # building
    "build": "build",
    "BuildConfig": "build",
    "load_tokenizer": "tokenize",
    # filters (optional extra "filters")
    "FilterConfig": "filters",
    "DocumentFilter": "filters",
    "QualityThresholds": "quality",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'h5corpus' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
