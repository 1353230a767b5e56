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
    "FORMAT_VERSION": "storage.format",
    "FormatError": "storage.format",
    "ChunkChecksumError": "storage.format",
    "TokenizerIdentity": "storage.format",
    "ShardWriter": "storage.writer",
    "ShardRecord": "storage.format",
    "Manifest": "storage.manifest",
    "read_manifest": "storage.manifest",
    "write_manifest": "storage.manifest",
    "validate_corpus": "storage.validate",
    "ValidationReport": "storage.validate",
    # reading and batches
    "open_corpus": "storage.reader",
    "Corpus": "storage.reader",
    "UnverifiedCorpusWarning": "storage.reader",
    "open_live": "storage.reader",
    "VarlenBatch": "loaders.batch",
    "IGNORE_INDEX": "loaders.batch",
    "BatchError": "loaders.batch",
    "collate_varlen": "loaders.batch",
    "concat_batches": "loaders.batch",
    "SlidingWindowDataset": "loaders.window",
    "BestFitDataset": "loaders.bestfit",
    "mix": "loaders.mixture",
    "Mixture": "loaders.mixture",
    "LoaderStateError": "loaders.state",
    "split_tokens": "loaders.chunking",
    "causal_attention": "loaders.attention",
    "packed_loss": "loaders.attention",
    # building
    "build_corpus": "build",
    "BuildConfig": "build",
    "DatasetSource": "build",
    "load_tokenizer": "build.tokenize.tokenizer",
    # filters (optional extra "filters")
    "FilterConfig": "filters",
    "DocumentFilter": "filters",
    "QualityThresholds": "filters.quality",
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
