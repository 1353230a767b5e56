"""The on-disk contract of an h5corpus shard (format v1). See ``docs/FORMAT.md``.

Every name, dtype and attribute the writer, reader and validator use is defined here once,
so that the three cannot drift apart. Bump :data:`FORMAT_VERSION` on any layout change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "h5corpus"
FORMAT_VERSION = 1

#: 1-D token ids, uint16 or uint32, chunked with ``chunk_tokens``, ``maxshape=(None,)``.
TOKENS = "tokens"
#: int64, length documents + 1, starts at 0, non-decreasing, last = token count.
DOC_OFFSETS = "doc_offsets"
#: uint8 (documents, 32): sha256 of each source document's UTF-8 text.
DOC_IDS = "doc_ids"
#: uint8 (documents,): per-document flag bits (see ``FLAG_*``).
DOC_FLAGS = "doc_flags"

#: The document was cut at ``--max-document-tokens``: it has no EOS (a cut is never a real end).
FLAG_TRUNCATED = 1

DOC_ID_BYTES = 32

#: Default tokens per HDF5 chunk: 2**18 tokens = 512 KiB at uint16, inside h5py's 10 KiB-1 MiB
#: guidance and a multiple of every power-of-two window stride up to 256Ki. ``bench/bench_storage.py``
#: measures the alternatives (docs/BENCHMARKS.md).
DEFAULT_CHUNK_TOKENS = 1 << 18

#: Index datasets grow in chunks of this many documents.
INDEX_CHUNK_DOCS = 4096

#: Root attributes every shard carries; written once, before SWMR starts.
REQUIRED_ATTRS = (
    "format",
    "version",
    "split",
    "dtype",
    "eos_id",
    "chunk_tokens",
    "tokenizer_name",
    "tokenizer_revision",
    "tokenizer_sha256",
    "vocab_size",
)

SPLITS = ("train", "validation")

#: A shard is written at ``<name>.h5`` + this suffix and renamed into place when complete; nothing
#: treats a file with it as a shard.
PARTIAL_SUFFIX = ".partial"

#: The keys of a shard record (one manifest entry), in order.
SHARD_KEYS = ("path", "split", "tokens", "documents", "sha256", "index_sha256", "bytes")


class FormatError(ValueError):
    """A file or manifest does not follow the h5corpus format contract."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id below ``vocab_size`` (uint16 up to 65,536 ids)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= (1 << 16) else np.dtype("<u4")


def dtype_name(dtype: np.dtype | str) -> str:
    """Canonical manifest spelling of a token dtype: ``"uint16"`` or ``"uint32"``."""
    name = np.dtype(dtype).name
    if name not in ("uint16", "uint32"):
        raise FormatError(f"token dtype must be uint16 or uint32, got {name}")
    return name


@dataclass(frozen=True, kw_only=True)
class TokenizerIdentity:
    """What makes token ids comparable: two corpora with equal identities share one id space."""

    name: str
    """Tokenizer spec as given (``gpt2``, a path, ``bytes``)."""
    revision: str
    """Hub revision (commit sha) or ``"local"``."""
    sha256: str
    """Hex sha256 of the tokenizer's JSON serialization."""
    vocab_size: int
    """Number of ids, special tokens included; every stored id is below it."""
    eos_id: int
    """Id appended once at each real document end."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "revision": self.revision,
            "sha256": self.sha256,
            "vocab_size": int(self.vocab_size),
            "eos_id": int(self.eos_id),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TokenizerIdentity:
        try:
            return cls(
                name=str(d["name"]),
                revision=str(d["revision"]),
                sha256=str(d["sha256"]),
                vocab_size=int(d["vocab_size"]),
                eos_id=int(d["eos_id"]),
            )
        except KeyError as e:
            raise FormatError(f"tokenizer identity lacks key {e.args[0]!r}") from None

    def same_ids(self, other: TokenizerIdentity) -> bool:
        """True when both produce the same ids (name and revision may differ for one JSON)."""
        return (self.sha256, self.vocab_size, self.eos_id) == (other.sha256, other.vocab_size, other.eos_id)


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """What is recorded about one finished shard: the writer returns it, the manifest lists it,
    build state records carry it, the validator checks a file against it."""

    path: str
    """POSIX path of the shard file: relative to the manifest's folder inside a manifest;
    absolute when returned by :meth:`ShardWriter.close <h5corpus.storage.writer.ShardWriter.close>`."""
    split: str
    tokens: int
    """Token count, EOS ids included."""
    documents: int
    sha256: str
    """Hex sha256 of the little-endian bytes of ``tokens[0:tokens]``."""
    index_sha256: str
    """Hex sha256 of doc_offsets ++ doc_ids ++ doc_flags (:func:`index_sha256`)."""
    bytes: int
    """File size on disk, in bytes."""

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SHARD_KEYS}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> ShardRecord:
        """Parse one record; :class:`FormatError` naming ``where`` and the shard when keys lack."""
        missing = [k for k in SHARD_KEYS if k not in d]
        if missing:
            raise FormatError(f"{where}: shard entry {d.get('path', '?')!r} lacks keys {missing}")
        return cls(
            path=str(d["path"]),
            split=str(d["split"]),
            tokens=int(d["tokens"]),
            documents=int(d["documents"]),
            sha256=str(d["sha256"]),
            index_sha256=str(d["index_sha256"]),
            bytes=int(d["bytes"]),
        )

    def with_path(self, path: str | os.PathLike[str]) -> ShardRecord:
        """The same shard recorded under another path (POSIX spelling)."""
        return dataclasses.replace(self, path=Path(path).as_posix())

    def relative_to(self, folder: str | os.PathLike[str]) -> ShardRecord:
        """The same shard with its path relative to ``folder`` (e.g. the manifest's folder)."""
        return self.with_path(os.path.relpath(Path(self.path).absolute(), Path(folder).absolute()))


def shard_attrs(*, split: str, dtype: np.dtype, chunk_tokens: int, tokenizer: TokenizerIdentity) -> dict[str, Any]:
    """Root attributes of a v1 shard, in the order they are written."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "split": split,
        "dtype": dtype_name(dtype),
        "eos_id": int(tokenizer.eos_id),
        "chunk_tokens": int(chunk_tokens),
        "tokenizer_name": tokenizer.name,
        "tokenizer_revision": tokenizer.revision,
        "tokenizer_sha256": tokenizer.sha256,
        "vocab_size": int(tokenizer.vocab_size),
    }


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.generic):
        return v.item()
    return v


def check_attrs(attrs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Return a shard's root attributes as plain Python values; raise :class:`FormatError` naming
    ``where`` unless they declare format ``h5corpus`` version 1 and carry every required key."""
    got = {k: _plain(attrs[k]) for k in attrs.keys()}
    if got.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not an h5corpus shard (format attribute = {got.get('format')!r})")
    if got.get("version") != FORMAT_VERSION:
        raise FormatError(
            f"{where}: h5corpus format version {got.get('version')!r} is not supported "
            f"(this h5corpus reads version {FORMAT_VERSION}); rebuild the corpus or upgrade h5corpus"
        )
    missing = [k for k in REQUIRED_ATTRS if k not in got]
    if missing:
        raise FormatError(f"{where}: missing root attributes {missing}")
    return got


def tokens_sha256_update(h: hashlib._Hash, tokens: np.ndarray) -> None:
    """Feed ``tokens`` to ``h`` as little-endian bytes (the manifest's ``sha256`` definition)."""
    a = np.ascontiguousarray(tokens)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    h.update(memoryview(a).cast("B"))


def index_sha256(doc_offsets: np.ndarray, doc_ids: np.ndarray, doc_flags: np.ndarray) -> str:
    """Hex sha256 of ``doc_offsets`` (int64 LE) ++ ``doc_ids`` (raw bytes) ++ ``doc_flags`` (uint8)."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(doc_offsets, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(doc_ids, dtype=np.uint8).tobytes())
    h.update(np.ascontiguousarray(doc_flags, dtype=np.uint8).tobytes())
    return h.hexdigest()
