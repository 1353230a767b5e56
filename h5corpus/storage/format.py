"""The on-disk contract of an h5corpus corpus (shard format v4, reading v1-v3 too; manifest v1). See ``docs/FORMAT.md``.

Every fact of the layout that the writer, the reader, the validator and the build's resume rely
on is defined here once, so that they cannot drift apart: dataset names and dtypes, the HDF5
format bounds, the partial-file suffix, the root attributes (and the tokenizer identity they
encode), the checks of a shard's index, where the chunks of ``/tokens`` lie in the file (the
memory-map read path), the per-chunk checksums, and the manifest's keys and version. Bump
:data:`FORMAT_VERSION` on any change of a shard's layout and :data:`MANIFEST_VERSION` on any change
of the manifest's.

Module size: the contract is one module on purpose (one place for every fact of the layout), hence
longer than the usual ~600 lines' guidance would give one module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

FORMAT_NAME = "h5corpus"
#: The version this h5corpus writes. 2: per-chunk checksums (``/chunk_xxh3``), a compressed final
#: chunk, compressed index datasets, fixed-length string attributes (docs/FORMAT.md).
#: 3: a lazily consulted, verified index: ``/doc_offsets`` in raw chunks that a reader maps,
#: ``/offsets_xxh3`` (one checksum per offsets chunk), 128-bit stored ids, and the manifest's
#: ``sums_sha256`` proving both checksum tables.
#: 4: document ids and flags out of the shard, in a sidecar file beside it (``<shard>.docs``,
#: :data:`DOCS_SUFFIX`) that the manifest proves (``docs_sha256``); readers never open it to serve tokens.
FORMAT_VERSION = 4
#: Versions this h5corpus reads (version 1 shards carry no checksums: reads are unverified).
READABLE_VERSIONS = (1, 2, 3, 4)
#: Versions :class:`~h5corpus.storage.writer.ShardWriter` writes (3: ids and flags in the shard).
WRITABLE_VERSIONS = (3, 4)
#: Version of the manifest's layout (``manifest_version`` key); manifests written before the key
#: existed are version 1.
MANIFEST_VERSION = 1

#: HDF5 file-format bounds of every shard: low = the oldest format with SWMR (HDF5 1.10), high =
#: HDF5 1.14's. A newer HDF5 then writes the same objects (same bytes) instead of its newest
#: formats, and any HDF5 >= 1.10 reads the shards.
LIBVER = ("v110", "v114")

#: 1-D token ids, uint16 or uint32, chunked with ``chunk_tokens``, ``maxshape=(None,)``.
TOKENS = "tokens"
#: int64, length documents + 1, starts at 0, non-decreasing, last = token count.
DOC_OFFSETS = "doc_offsets"
#: uint8 (documents, 32): sha256 of each source document's UTF-8 text.
DOC_IDS = "doc_ids"
#: uint8 (documents,): per-document flag bits (see ``FLAG_*``).
DOC_FLAGS = "doc_flags"
#: uint64 (chunks,), version 2: xxh3-64 of each ``/tokens`` chunk's tokens as little-endian bytes
#: (the last chunk: only its ``T - k * chunk_tokens`` real tokens), chunk k = ``tokens[k*C:(k+1)*C]``.
CHUNK_CHECKSUMS = "chunk_xxh3"
#: uint64 (offsets chunks,), version 3: xxh3-64 of each ``/doc_offsets`` chunk's real entries as
#: little-endian int64 bytes, chunk k = ``doc_offsets[k*OC:(k+1)*OC]`` (``OC`` = :data:`OFFSETS_CHUNK_V3`).
OFFSETS_CHECKSUMS = "offsets_xxh3"
#: Every dataset of a version 1 shard, in the order the index hash covers the index ones.
DATASETS_V1 = (TOKENS, DOC_OFFSETS, DOC_IDS, DOC_FLAGS)
#: Every dataset of a version 2 shard, in the order the index hash covers the index ones.
DATASETS_V2 = (TOKENS, DOC_OFFSETS, DOC_IDS, DOC_FLAGS, CHUNK_CHECKSUMS)
#: Every dataset of a version 3 shard, in the order the index hash covers the index ones.
DATASETS_V3 = (TOKENS, DOC_OFFSETS, DOC_IDS, DOC_FLAGS, CHUNK_CHECKSUMS, OFFSETS_CHECKSUMS)
#: Every dataset of a version 4 shard, in the order the index hash covers the index ones (ids and
#: flags live in the shard's sidecar, :data:`DOCS_SUFFIX`).
DATASETS = (TOKENS, DOC_OFFSETS, CHUNK_CHECKSUMS, OFFSETS_CHECKSUMS)


def datasets_of(version: int) -> tuple[str, ...]:
    """The datasets a shard of format ``version`` holds."""
    return {1: DATASETS_V1, 2: DATASETS_V2, 3: DATASETS_V3}.get(version, DATASETS)


def ids_in_shard(version: int) -> bool:
    """True when a shard of format ``version`` stores ``/doc_ids`` and ``/doc_flags`` itself
    (versions 1-3); version 4 keeps them in its sidecar (:func:`docs_path`)."""
    return version < 4


#: Stored dtypes of the index datasets (little-endian where it matters).
OFFSETS_DTYPE = np.dtype("<i8")
DOC_ID_DTYPE = np.dtype("u1")
FLAGS_DTYPE = np.dtype("u1")
CHECKSUM_DTYPE = np.dtype("<u8")

#: The document was cut at ``--max-document-tokens``: it has no EOS (a cut is never a real end).
FLAG_TRUNCATED = 1

#: Width of a document id as the build computes it: the sha256 of the document's UTF-8 text.
DOC_ID_BYTES = 32
#: Width of a stored id in a version 3 shard: the first 16 bytes (128 bits) of that sha256, ample
#: for 10^12 documents (collision odds ~10^-15) at half the bytes.
STORED_ID_BYTES_V3 = 16


def stored_id_bytes(version: int) -> int:
    """Bytes per row of ``/doc_ids`` in a shard of format ``version`` (32, or 16 from version 3)."""
    return DOC_ID_BYTES if version < 3 else STORED_ID_BYTES_V3


#: Default tokens per HDF5 chunk: 2**18 tokens = 512 KiB at uint16, inside h5py's 10 KiB-1 MiB
#: guidance and a multiple of every power-of-two window stride up to 256Ki. ``bench/bench_storage.py``
#: measures the alternatives (docs/BENCHMARKS.md).
DEFAULT_CHUNK_TOKENS = 1 << 18

#: Version 1 index datasets grow in chunks of this many documents.
INDEX_CHUNK_DOCS = 4096
#: Version 2 chunk sizes of the index datasets, in entries: each dataset's last chunk is stored
#: whole, so they bound the padding per shard (1 KiB of offsets, 1 KiB of ids, 512 bytes of flags,
#: 256 bytes of checksums at most; docs/FORMAT.md measures the choice).
OFFSETS_CHUNK = 128
IDS_CHUNK = 32
FLAGS_CHUNK = 512
#: ``/chunk_xxh3`` grows in chunks of this many checksums (one per ``/tokens`` chunk).
CHECKSUM_CHUNK = 32
#: Version 3: ``/doc_offsets`` entries per chunk (8 KiB): the unit a reader maps, verifies (one
#: checksum each) and touches; the last chunk is stored whole (<= 8 KiB of padding per shard).
OFFSETS_CHUNK_V3 = 1024
#: Version 3: rows of ``/doc_ids`` per chunk (1 KiB of 16-byte ids).
IDS_CHUNK_V3 = 64
#: zlib level of a version 2 shard's final ``/tokens`` chunk (HDF5's deflate filter; level 6 is
#: zlib's default trade-off between time and size, docs/FORMAT.md).
DEFLATE_LEVEL = 6

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

#: Attributes that must equal the manifest's (name and revision of the tokenizer are informational:
#: one tokenizer JSON may be named differently).
MATCHED_ATTRS = ("split", "dtype", "chunk_tokens", "eos_id", "vocab_size", "tokenizer_sha256")

SPLITS = ("train", "validation")

#: A shard is written at ``<name>.h5`` + this suffix and renamed into place when complete; nothing
#: treats a file with it as a shard.
PARTIAL_SUFFIX = ".partial"

#: The keys of a shard record (one manifest entry), in order.
SHARD_KEYS = ("path", "split", "tokens", "documents", "sha256", "index_sha256", "bytes")
#: Keys of a version 3 shard record: also ``sums_sha256`` (the checksum tables' hash).
SHARD_KEYS_V3 = (*SHARD_KEYS, "sums_sha256")
#: Keys of a version 4 shard record: also the sidecar's ``docs_sha256`` and ``docs_bytes``.
SHARD_KEYS_V4 = (*SHARD_KEYS_V3, "docs_sha256", "docs_bytes")
_HEX64 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_COUNT = {"type": "integer", "minimum": 0}

#: JSON Schema (draft 2020-12) of a manifest: every entry point checks a manifest against it before
#: using a value of it. ``integer`` means a JSON integer (``5.0`` is refused).
MANIFEST_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["format", "version", "tokenizer", "dtype", "chunk_tokens", "shards"],
    "properties": {
        "format": {"const": "h5corpus"},
        "version": {"type": "integer"},
        "manifest_version": {"type": "integer"},
        "tokenizer": {
            "type": "object",
            "required": ["name", "revision", "sha256", "vocab_size", "eos_id"],
            "properties": {
                "name": {"type": "string"},
                "revision": {"type": "string"},
                "sha256": _HEX64,
                "vocab_size": {"type": "integer", "minimum": 1, "maximum": 1 << 32},
                "eos_id": _COUNT,
            },
        },
        "dtype": {"enum": ["uint16", "uint32"]},
        "chunk_tokens": {"type": "integer", "minimum": 1, "maximum": 1 << 40},
        "shards_dir": {"type": "string", "minLength": 1},
        "shards": {
            "type": "array",
            "items": {
                "type": "object",
                "required": list(("path", "split", "tokens", "documents", "sha256", "index_sha256", "bytes")),
                "properties": {
                    "path": {"type": "string", "minLength": 1},
                    "split": {"enum": ["train", "validation"]},
                    "tokens": _COUNT,
                    "documents": _COUNT,
                    "sha256": _HEX64,
                    "index_sha256": _HEX64,
                    "sums_sha256": _HEX64,
                    "file_sha256": _HEX64,
                    "bytes": _COUNT,
                    "loss_sha256": _HEX64,
                    "loss_spans": _COUNT,
                    "docs_sha256": _HEX64,
                    "docs_bytes": _COUNT,
                },
            },
        },
        "sft": {
            "type": "object",
            "properties": {
                "loss_mask": {"type": "boolean"},
                "bos_id": {"type": ["integer", "null"], "minimum": 0},
                "loss_on": {"type": ["string", "null"]},
            },
        },
        "splits": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {"tokens": _COUNT, "documents": _COUNT, "shards": _COUNT},
            },
        },
    },
}

#: Top-level manifest keys every manifest has; the rest (``splits``, ``source``, ``build``,
#: ``filters``) are build figures that readers keep but do not need.
MANIFEST_KEYS = ("format", "version", "manifest_version", "tokenizer", "dtype", "chunk_tokens", "shards")


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


@dataclass(frozen=True, kw_only=True, slots=True)  # slots: ~300 bytes less per shard a reader holds
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
    """Hex sha256 of doc_offsets ++ doc_ids ++ doc_flags (++ the checksum tables; :func:`index_sha256`)."""
    bytes: int
    """File size on disk, in bytes."""
    sums_sha256: str | None = None
    """Version 3: hex sha256 of ``/chunk_xxh3`` ++ ``/offsets_xxh3`` (:func:`sums_sha256`), the
    link from the manifest to every checksum a reader trusts; None for older versions."""
    loss_sha256: str | None = None
    """Hex sha256 of the shard's optional ``/loss_spans`` (:func:`loss_spans_sha256`); None: the
    shard has no loss mask (every target trained on)."""
    loss_spans: int = 0
    """Ranges in ``/loss_spans`` (0 without a loss mask)."""
    file_sha256: str | None = None
    """Optional: hex sha256 of the whole shard file's bytes, recorded by ``h5corpus upload`` so a
    download is proven as it arrives (docs/FORMAT.md); None when not recorded."""
    docs_sha256: str | None = None
    """Version 4: hex sha256 of the whole sidecar file (:func:`docs_path`: the shard's document ids
    and flags); None for older versions."""
    docs_bytes: int = 0
    """Version 4: the sidecar file's size in bytes (0 for older versions)."""

    @property
    def docs_path(self) -> str | None:
        """Version 4: the path of this shard's sidecar (:func:`docs_path`, same spelling as
        :attr:`path`); None for a shard that keeps its ids itself."""
        return None if self.docs_sha256 is None else self.path + DOCS_SUFFIX

    def to_json(self) -> dict[str, Any]:
        keys = SHARD_KEYS if self.sums_sha256 is None else SHARD_KEYS_V3 if self.docs_sha256 is None else SHARD_KEYS_V4
        d = {k: getattr(self, k) for k in keys}
        if self.loss_sha256 is not None:  # only fine-tuning shards carry the keys
            d["loss_sha256"], d["loss_spans"] = self.loss_sha256, int(self.loss_spans)
        if self.file_sha256 is not None:
            d["file_sha256"] = self.file_sha256
        return d

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
            sums_sha256=None if d.get("sums_sha256") is None else str(d["sums_sha256"]),
            loss_sha256=None if d.get("loss_sha256") is None else str(d["loss_sha256"]),
            loss_spans=int(d.get("loss_spans", 0)),
            file_sha256=None if d.get("file_sha256") is None else str(d["file_sha256"]),
            docs_sha256=None if d.get("docs_sha256") is None else str(d["docs_sha256"]),
            docs_bytes=int(d.get("docs_bytes", 0)),
        )

    def with_path(self, path: str | os.PathLike[str]) -> ShardRecord:
        """The same shard recorded under another path (POSIX spelling)."""
        return dataclasses.replace(self, path=Path(path).as_posix())

    def relative_to(self, folder: str | os.PathLike[str]) -> ShardRecord:
        """The same shard with its path relative to ``folder`` (e.g. the manifest's folder)."""
        return self.with_path(os.path.relpath(Path(self.path).absolute(), Path(folder).absolute()))


def shard_attrs(
    *, split: str, dtype: np.dtype, chunk_tokens: int, tokenizer: TokenizerIdentity, version: int = FORMAT_VERSION
) -> dict[str, Any]:
    """Root attributes of a shard of format ``version`` (default: the current one), in the order they are written."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return {
        "format": FORMAT_NAME,
        "version": int(version),
        "split": split,
        "dtype": dtype_name(dtype),
        "eos_id": int(tokenizer.eos_id),
        "chunk_tokens": int(chunk_tokens),
        "tokenizer_name": tokenizer.name,
        "tokenizer_revision": tokenizer.revision,
        "tokenizer_sha256": tokenizer.sha256,
        "vocab_size": int(tokenizer.vocab_size),
    }


def identity_from_attrs(attrs: Mapping[str, Any]) -> TokenizerIdentity:
    """The tokenizer identity a shard's root attributes record (the inverse of :func:`shard_attrs`);
    ``attrs`` as returned by :func:`check_attrs`."""
    return TokenizerIdentity(
        name=str(attrs["tokenizer_name"]),
        revision=str(attrs["tokenizer_revision"]),
        sha256=str(attrs["tokenizer_sha256"]),
        vocab_size=int(attrs["vocab_size"]),
        eos_id=int(attrs["eos_id"]),
    )


class Problem(NamedTuple):
    """One way a shard breaks the contract: ``code`` is the validator's finding code (``attrs``,
    ``offsets``, ``index``, ``tokens``, ...), ``message`` says what is wrong, with figures;
    ``fatal``: nothing else of the shard can be checked."""

    code: str
    message: str
    fatal: bool = False


def dataset_problems(f: Any, expect: ShardExpectation) -> list[Problem]:
    """The datasets of an open shard (an ``h5py.File``, or a mapping of its dataset names to
    datasets) against the contract: all of its version's
    present, ``/tokens`` 1-D in the manifest's dtype and little-endian byte order, chunked in chunks
    of ``chunk_tokens``. (The index datasets' dtypes are checked on the arrays, by :func:`check_index`;
    the checksums' count by :func:`checksum_problems`.)"""
    import h5py

    missing = [n for n in datasets_of(expect.version) if not isinstance(f.get(n), h5py.Dataset)]
    if missing:
        return [Problem("format", f"dataset /{missing[0]} is missing", fatal=True)]
    t = f[TOKENS]
    want = np.dtype(expect.dtype).newbyteorder("<")
    if t.dtype.str != want.str or t.ndim != 1:
        return [
            Problem(
                "tokens",
                f"/tokens is {t.dtype.str} with shape {t.shape}, expected 1-D {want.str} ({want.name}, little-endian)",
                fatal=True,
            )
        ]
    if t.chunks != (expect.chunk_tokens,):
        return [Problem("tokens", f"/tokens chunks {t.chunks}, expected ({expect.chunk_tokens},)")]
    if expect.version >= 2:
        c = f[CHUNK_CHECKSUMS]
        if c.dtype.str != CHECKSUM_DTYPE.str or c.ndim != 1:
            return [
                Problem("checksums", f"/{CHUNK_CHECKSUMS} is {c.dtype.str} {c.shape}, expected 1-D <u8", fatal=True)
            ]
    return []


def v3_index_layout_problems(f: Any, num_tokens: int, num_documents: int, chunk_tokens: int) -> list[Problem]:
    """A version 3 shard's index datasets (``f``: an open file, or a mapping of dataset names to
    datasets) against the manifest's counts, from their shapes and
    chunk indexes only (nothing proportional to the counts is read): ``/doc_offsets`` 1-D
    little-endian int64, ``num_documents + 1`` entries, unfiltered, in chunks of
    :data:`OFFSETS_CHUNK_V3`, every chunk allocated; ``/offsets_xxh3`` 1-D ``<u8`` with one checksum
    per offsets chunk; ``/chunk_xxh3`` with one per ``/tokens`` chunk; ``/tokens`` with every
    chunk allocated (a dataset resized without writing its chunks reads as fill values)."""
    o, osums, t = f[DOC_OFFSETS], f[OFFSETS_CHECKSUMS], f[TOKENS]
    if o.dtype.str != OFFSETS_DTYPE.str or o.ndim != 1 or o.chunks != (OFFSETS_CHUNK_V3,):
        return [
            Problem(
                "offsets",
                f"/doc_offsets is {o.dtype.str} {o.shape} in chunks {o.chunks}, expected 1-D <i8 "
                f"in chunks ({OFFSETS_CHUNK_V3},)",
                fatal=True,
            )
        ]
    if o.id.get_create_plist().get_nfilters():
        return [Problem("offsets", "/doc_offsets is stored filtered; version 3 stores it raw", fatal=True)]
    if o.shape[0] != num_documents + 1:
        return [
            Problem(
                "offsets",
                f"/doc_offsets lists {o.shape[0] - 1:,} documents, manifest says {num_documents:,}",
                fatal=True,
            )
        ]
    if osums.dtype.str != CHECKSUM_DTYPE.str or osums.ndim != 1:
        return [
            Problem(
                "checksums", f"/{OFFSETS_CHECKSUMS} is {osums.dtype.str} {osums.shape}, expected 1-D <u8", fatal=True
            )
        ]
    for name, ds, n, c in (
        (TOKENS, t, num_tokens, chunk_tokens),
        (DOC_OFFSETS, o, num_documents + 1, OFFSETS_CHUNK_V3),
    ):
        have, want = ds.id.get_num_chunks(), -(-n // c)
        if have != want:
            what = "tokens" if name == TOKENS else "offsets"
            msg = f"/{name} has {have:,} chunks stored, {n:,} entries need {want:,} (resized without data?)"
            return [Problem(what, msg, fatal=True)]
    out = checksum_problems(f[CHUNK_CHECKSUMS].shape[0], num_tokens, chunk_tokens)
    out += checksum_problems(osums.shape[0], num_documents + 1, OFFSETS_CHUNK_V3, OFFSETS_CHECKSUMS)
    return out


def checksum_problems(
    n_checksums: int, num_tokens: int, chunk_tokens: int, name: str = CHUNK_CHECKSUMS
) -> list[Problem]:
    """A version 2 shard holds one checksum per ``/tokens`` chunk: ``ceil(num_tokens / chunk_tokens)``
    (version 3 also one per ``/doc_offsets`` chunk: ``name`` = :data:`OFFSETS_CHECKSUMS`, counts in entries)."""
    want = -(-num_tokens // chunk_tokens)
    if n_checksums != want:
        what = "tokens" if name == CHUNK_CHECKSUMS else "offsets"
        return [
            Problem(
                "checksums",
                f"/{name} holds {n_checksums:,} checksums, but {num_tokens:,} {what} in chunks of "
                f"{chunk_tokens:,} make {want:,} chunks",
            )
        ]
    return []


@dataclass(frozen=True)
class ShardExpectation:
    """What a manifest says every one of its shards is (the corpus-wide facts)."""

    dtype: str
    chunk_tokens: int
    eos_id: int
    vocab_size: int
    tokenizer_sha256: str
    version: int = FORMAT_VERSION
    """The shards' format version: a manifest's shards are all of the manifest's version."""

    @classmethod
    def of(
        cls, tokenizer: TokenizerIdentity, chunk_tokens: int, dtype: str | None = None, version: int = FORMAT_VERSION
    ) -> ShardExpectation:
        """Shards of ``tokenizer`` ids in chunks of ``chunk_tokens`` tokens (``dtype`` defaults to
        the one :func:`token_dtype` gives the vocabulary), of format ``version``."""
        return cls(
            dtype=dtype or dtype_name(token_dtype(tokenizer.vocab_size)),
            chunk_tokens=int(chunk_tokens),
            eos_id=int(tokenizer.eos_id),
            vocab_size=int(tokenizer.vocab_size),
            tokenizer_sha256=tokenizer.sha256,
            version=int(version),
        )

    def attr_problems(self, attrs: Mapping[str, Any], split: str) -> list[Problem]:
        """The :data:`MATCHED_ATTRS` of ``attrs`` (from :func:`check_attrs`) that differ from what
        the manifest says a ``split`` shard is."""
        want = {
            "version": self.version,
            "split": split,
            "dtype": self.dtype,
            "chunk_tokens": self.chunk_tokens,
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
            "tokenizer_sha256": self.tokenizer_sha256,
        }
        return [
            Problem("attrs", f"attribute {k} = {attrs.get(k)!r}, manifest says {want[k]!r}")
            for k in ("version", *MATCHED_ATTRS)
            if attrs.get(k) != want[k]
        ]


def check_index(
    doc_offsets: np.ndarray,
    doc_ids: np.ndarray,
    doc_flags: np.ndarray,
    *,
    num_tokens: int,
    num_documents: int | None = None,
    id_bytes: int = DOC_ID_BYTES,
) -> list[Problem]:
    """Everything the index promises that needs no token read: dtypes, shapes, offsets from 0,
    non-decreasing, ending at ``num_tokens`` (the length of ``/tokens``), one id row of
    ``id_bytes`` (:func:`stored_id_bytes`) and one flag per document, and ``num_documents``
    documents when given (the manifest's count). Empty = intact."""
    out: list[Problem] = []
    docs = max(int(doc_offsets.size) - 1, 0)
    if doc_offsets.dtype != OFFSETS_DTYPE or doc_offsets.ndim != 1:
        out.append(Problem("offsets", f"/doc_offsets is {doc_offsets.dtype} {doc_offsets.shape}, expected 1-D int64"))
    if num_documents is not None and docs != num_documents:
        out.append(Problem("offsets", f"/doc_offsets lists {docs:,} documents, manifest says {num_documents:,}"))
    if doc_ids.dtype != DOC_ID_DTYPE or doc_ids.shape != (docs, id_bytes):
        out.append(
            Problem("index", f"/doc_ids is {doc_ids.dtype} {doc_ids.shape}, expected uint8 ({docs:,}, {id_bytes})")
        )
    if doc_flags.dtype != FLAGS_DTYPE or doc_flags.shape != (docs,):
        out.append(Problem("index", f"/doc_flags is {doc_flags.dtype} {doc_flags.shape}, expected uint8 ({docs:,},)"))
    if doc_offsets.size == 0 or doc_offsets.ndim != 1 or doc_offsets[0] != 0:
        out.append(Problem("offsets", "/doc_offsets does not start at 0"))
        return out
    down = doc_offsets[1:] < doc_offsets[:-1]
    if down.any():
        i = int(np.argmax(down))
        out.append(
            Problem(
                "offsets",
                f"/doc_offsets decreases at document {i:,} ({doc_offsets[i]:,} -> {doc_offsets[i + 1]:,})",
            )
        )
    if doc_offsets[-1] != num_tokens:
        out.append(
            Problem("offsets", f"/doc_offsets ends at {int(doc_offsets[-1]):,}, but /tokens holds {num_tokens:,}")
        )
    return out


def chunk_byte_layout(ds: Any, n_tokens: int, file_size: int) -> tuple[np.ndarray | None, str]:
    """Where the chunks of a 1-D ``/tokens`` h5py dataset covering ``[0, n_tokens)`` lie in the
    file, for the memory-map read path: ``(offsets, "")`` with the byte offset of every chunk, or
    ``(None, why not)``.

    Every chunk but the last must be stored raw: allocated, every filter of the pipeline skipped
    (its filter mask; a version 1 shard has no pipeline), ``chunk_tokens * itemsize`` bytes, inside
    the file's ``file_size`` bytes. Then token ``i`` of such a chunk lies at
    ``offsets[i // C] + (i % C) * itemsize``. The last chunk may instead be stored filtered (a
    version 2 shard's compressed final chunk, or the only chunk of a compressed shard): its offset
    is then -1 and the reader decodes it into memory through HDF5."""
    if ds.chunks is None or len(ds.chunks) != 1:
        return None, "tokens are not chunked in 1-D"
    n_filters = ds.id.get_create_plist().get_nfilters()
    raw_mask = (1 << n_filters) - 1  # every filter skipped
    C = ds.chunks[0]
    n_chunks = -(-n_tokens // C)
    offsets = np.full(n_chunks, -2, dtype=np.int64)
    chunk_bytes = C * ds.dtype.itemsize
    bad: list[str] = []

    def visit(info: Any) -> None:
        k = info.chunk_offset[0] // C
        if k >= n_chunks:
            return
        if info.byte_offset + info.size > file_size:
            bad.append(f"chunk {k} (offset {info.byte_offset}, {info.size} bytes) lies past the file's end")
        elif info.filter_mask != raw_mask:
            if k != n_chunks - 1:
                bad.append(f"chunk {k} is stored filtered (tokens are compressed)")
            offsets[k] = -1
        elif info.size != chunk_bytes:
            bad.append(f"chunk {k} (offset {info.byte_offset}, {info.size} bytes, mask {info.filter_mask})")
        else:
            offsets[k] = info.byte_offset

    if hasattr(ds.id, "chunk_iter"):
        ds.id.chunk_iter(visit)
    else:  # pragma: no cover - HDF5 < 1.13
        for i in range(ds.id.get_num_chunks()):
            visit(ds.id.get_chunk_info(i))
    if bad:
        return None, "unexpected chunk layout: " + bad[0]
    if n_chunks and offsets.min() < -1:
        return None, f"chunk {int(np.argmin(offsets))} is not allocated"
    return offsets, ""


# -- the final chunk in stored deflate blocks (mapped, never decoded into memory) -------------------

#: Bytes of real tokens per stored deflate block of a final partial ``/tokens`` chunk: a multiple of
#: every token width (2 and 4 bytes) under deflate's 65,535-byte limit for a stored block.
STORED_BLOCK_BYTES = 65532


def stored_tail_chunk(chunk: np.ndarray, real_bytes: int) -> bytes:
    """The final partial ``/tokens`` chunk as a zlib stream that HDF5's deflate filter decodes to
    the whole chunk (``chunk``: its tokens, then zero padding), laid out so that a reader can map
    its real tokens instead of decoding them: the first ``real_bytes`` bytes in *stored* deflate
    blocks of :data:`STORED_BLOCK_BYTES` (5 header bytes each, the tokens verbatim after them), then
    the zero padding as one compressed final block, then the Adler-32 of the whole chunk. Costs 5
    bytes per 64 KiB of tokens and a few bytes for the padding; :func:`stored_tail_runs` finds the
    runs again."""
    raw = memoryview(np.ascontiguousarray(chunk)).cast("B")
    out = bytearray(b"\x78\x01")  # zlib header: deflate, 32 KiB window, no dictionary
    for a in range(0, real_bytes, STORED_BLOCK_BYTES):
        n = min(STORED_BLOCK_BYTES, real_bytes - a)
        out += bytes((0, n & 0xFF, n >> 8, ~n & 0xFF, (~n >> 8) & 0xFF))  # BFINAL 0, BTYPE 00, LEN, NLEN
        out += raw[a : a + n]
    pad = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate: its last block is final
    out += pad.compress(raw[real_bytes:]) + pad.flush()
    out += zlib.adler32(raw).to_bytes(4, "big")
    return bytes(out)


def stored_block_runs(offset: int, real_bytes: int, n_runs: int) -> list[tuple[int, int]]:
    """The ``(byte offset, bytes)`` of the real tokens of a final chunk stored at ``offset`` by
    :func:`stored_tail_chunk`, computed (not read): [] unless ``n_runs`` is the number of blocks
    that writer makes of ``real_bytes`` bytes."""
    n = -(-real_bytes // STORED_BLOCK_BYTES)
    if n_runs <= 0 or n != n_runs:
        return []
    heads = [offset + 2 + k * (5 + STORED_BLOCK_BYTES) for k in range(n)]
    return [(h + 5, min(STORED_BLOCK_BYTES, real_bytes - k * STORED_BLOCK_BYTES)) for k, h in enumerate(heads)]


def _regular_stored_runs(data: Any, offset: int, size: int, real_bytes: int) -> list[tuple[int, int]] | None:
    """:func:`stored_tail_runs` of the blocks :func:`stored_tail_chunk` writes (every one
    :data:`STORED_BLOCK_BYTES` long but the last), their headers checked in one vectorized read;
    None when they are laid out otherwise."""
    n = -(-real_bytes // STORED_BLOCK_BYTES)
    heads = offset + 2 + np.arange(n, dtype=np.int64) * (5 + STORED_BLOCK_BYTES)
    if n == 0 or int(heads[-1]) + 5 + real_bytes - (n - 1) * STORED_BLOCK_BYTES > offset + size:
        return None
    h = np.frombuffer(data, np.uint8)[heads[:, None] + np.arange(5)].astype(np.int64)
    lens = np.full(n, STORED_BLOCK_BYTES, np.int64)
    lens[-1] = real_bytes - (n - 1) * STORED_BLOCK_BYTES
    if (
        (h[:, 0] != 0).any()
        or ((h[:, 1] | h[:, 2] << 8) != lens).any()
        or ((h[:, 3] | h[:, 4] << 8) != (lens ^ 0xFFFF)).any()
    ):
        return None
    return list(zip((heads + 5).tolist(), lens.tolist()))


def stored_tail_runs(data: Any, offset: int, size: int, real_bytes: int, itemsize: int) -> list[tuple[int, int]] | None:
    """Where the real tokens of a final chunk written by :func:`stored_tail_chunk` lie: the
    ``(byte offset, bytes)`` of each stored block covering its first ``real_bytes`` bytes, read
    from ``data`` (the file's bytes, e.g. its memory map) at the chunk's ``offset`` and stored
    ``size``. None when the chunk is not in that form (another writer's deflate stream: it is then
    decoded). The headers are only a map: the chunk's checksum proves the bytes found there."""
    pos, end, runs, got = offset + 2, offset + size, [], 0
    if size < 2 or bytes(data[offset : offset + 2]) != b"\x78\x01":
        return None
    fast = _regular_stored_runs(data, offset, size, real_bytes)
    if fast is not None:
        return fast
    while got < real_bytes:
        if pos + 5 > end or data[pos] != 0:  # not a stored, non-final block
            return None
        n = data[pos + 1] | data[pos + 2] << 8
        if n ^ (data[pos + 3] | data[pos + 4] << 8) != 0xFFFF or n == 0 or n % itemsize or pos + 5 + n > end:
            return None
        n_real = min(n, real_bytes - got)
        runs.append((pos + 5, n_real))
        got += n_real
        pos += 5 + n
    return runs


def final_chunk_extent(ds: Any, offsets: np.ndarray | None) -> tuple[int, int] | None:
    """``(byte offset, stored bytes)`` of the final ``/tokens`` chunk of an h5py dataset whose
    :func:`chunk_byte_layout` is ``offsets``, when that chunk is stored filtered (offset -1); else None."""
    if offsets is None or not offsets.size or int(offsets[-1]) != -1:
        return None
    info = ds.id.get_chunk_info_by_coord(((offsets.size - 1) * ds.chunks[0],))
    return int(info.byte_offset), int(info.size)


# -- the layout file: a proof cache that lets a first touch skip HDF5 (version 3) ---------------------

#: Suffix of a manifest's layout file (``shards.json`` -> ``shards.json.layout``), beside it.
LAYOUT_SUFFIX = ".layout"
#: First 8 bytes of a layout file.
LAYOUT_MAGIC = b"H5CLAY01"
#: Columns of a layout file's per-shard row (int64): the shard file's size and mtime (ns) when it was
#: checked, the counts of token-chunk addresses, offsets-chunk addresses, ``/chunk_xxh3`` and
#: ``/offsets_xxh3`` entries, the final chunk's stored extent (offset, bytes; 0, 0 when raw), where
#: the row's payload starts in the file, and its xxh3-64 digest (row and payload).
LAYOUT_COLUMNS = (
    "size",
    "mtime_ns",
    "tokens",
    "offsets",
    "sums",
    "osums",
    "tail_offset",
    "tail_bytes",
    "tail_runs",
    "at",
    "xxh3",
)


class ShardLayout(NamedTuple):
    """What a first touch of a finished version 3 shard needs, as found by the full (HDF5) check:
    the file's size and mtime then, the byte offset of every ``/tokens`` chunk (-1: the final one,
    stored filtered at ``tail``) and ``/doc_offsets`` chunk, both checksum tables, and
    ``tail_runs``: the number of stored deflate blocks of the final chunk as
    :func:`stored_tail_chunk` lays them out, found when the entry was made (0: decode it)."""

    size: int
    mtime_ns: int
    tokens: np.ndarray
    tail: tuple[int, int]
    offsets: np.ndarray
    chunk_sums: np.ndarray
    offsets_sums: np.ndarray
    tail_runs: int = 0


def layout_path(manifest_path: str | os.PathLike[str]) -> Path:
    """The layout file of the manifest at ``manifest_path``."""
    p = Path(manifest_path)
    return p.with_name(p.name + LAYOUT_SUFFIX)


def _layout_row(lay: ShardLayout, at: int) -> tuple[np.ndarray, bytes]:
    payload = b"".join(
        np.ascontiguousarray(a, dt).tobytes()
        for a, dt in ((lay.tokens, "<i8"), (lay.offsets, "<i8"), (lay.chunk_sums, "<u8"), (lay.offsets_sums, "<u8"))
    )
    counts = (lay.tokens.size, lay.offsets.size, lay.chunk_sums.size, lay.offsets_sums.size)
    row = np.array([lay.size, lay.mtime_ns, *counts, *lay.tail, lay.tail_runs, at, 0], "<i8")
    row[-1] = np.int64(np.uint64(xxhash.xxh3_64_intdigest(row[:-1].tobytes() + payload)).astype(np.int64))
    return row, payload


def encode_layouts(layouts: list[ShardLayout | None]) -> bytes:
    """A layout file's bytes: magic, shard count, one row of :data:`LAYOUT_COLUMNS` per manifest
    shard (in manifest order; a shard without a layout has a row of zeros), then the payloads
    (token-chunk and offsets-chunk addresses, the two checksum tables), all little-endian."""
    n, cols = len(layouts), len(LAYOUT_COLUMNS)
    at = 16 + n * cols * 8
    rows, payloads = np.zeros((n, cols), "<i8"), []
    for k, lay in enumerate(layouts):
        if lay is not None:
            rows[k], payload = _layout_row(lay, at)
            payloads.append(payload)
            at += len(payload)
    return LAYOUT_MAGIC + np.array([n], "<i8").tobytes() + rows.tobytes() + b"".join(payloads)


def decode_layout(data: Any, shard: int, n_shards: int) -> ShardLayout | None:
    """Shard ``shard``'s layout from a layout file's bytes ``data`` (e.g. a memory map) of a
    manifest of ``n_shards`` shards, or None when the file does not hold one for it: another shard
    count, a zero row, a payload outside the file, a digest that fails (a damaged file is never used)."""
    cols = len(LAYOUT_COLUMNS)
    if len(data) < 16 + n_shards * cols * 8 or bytes(data[:8]) != LAYOUT_MAGIC:
        return None
    if int(np.frombuffer(data, "<i8", 1, 8)[0]) != n_shards or not 0 <= shard < n_shards:
        return None
    row = np.frombuffer(data, "<i8", cols, 16 + shard * cols * 8)
    size, mtime, nt, no, ns, nos, toff, tbytes, truns, at, _ = row.tolist()
    counts = (nt, no, ns, nos)
    if size <= 0 or min(counts) < 0 or at < 16 or at + 8 * sum(counts) > len(data):
        return None
    payload = bytes(data[at : at + 8 * sum(counts)])
    if np.int64(np.uint64(xxhash.xxh3_64_intdigest(row[:-1].tobytes() + payload)).astype(np.int64)) != row[-1]:
        return None
    ends = np.cumsum((0,) + counts) * 8
    arrs = [np.frombuffer(payload, dt, c, int(a)) for dt, c, a in zip(("<i8", "<i8", "<u8", "<u8"), counts, ends)]
    return ShardLayout(size, mtime, arrs[0], (toff, tbytes), arrs[1], arrs[2], arrs[3], truns)


# -- the table file: the manifest's shard list, memory-mapped at open (a proof cache, any version) ----

#: Suffix of a manifest's table file (``shards.json`` -> ``shards.json.table``), beside it.
TABLE_SUFFIX = ".table"
#: First 8 bytes of a table file.
TABLE_MAGIC = b"H5CTAB01"
_TABLE_HEAD = 24  # magic, header length (int64), header xxh3-64 (uint64)


def table_path(manifest_path: str | os.PathLike[str]) -> Path:
    """The table file of the manifest at ``manifest_path``."""
    p = Path(manifest_path)
    return p.with_name(p.name + TABLE_SUFFIX)


def encode_table(header: dict[str, Any], columns: dict[str, np.ndarray]) -> bytes:
    """A table file's bytes: :data:`TABLE_MAGIC`, the header's length (int64) and xxh3-64 (uint64),
    the header (UTF-8 JSON: ``header`` plus ``columns``, each column's name, dtype, shape, byte
    offset and xxh3-64), then each column's bytes at an 8-byte-aligned offset, little-endian."""
    parts, listed, at = [], [], 0
    for name, col in columns.items():
        raw = np.ascontiguousarray(col, col.dtype.newbyteorder("<")).tobytes()
        listed.append([name, col.dtype.newbyteorder("<").str, list(col.shape), at, xxhash.xxh3_64_intdigest(raw)])
        parts.append(raw + bytes(-len(raw) % 8))
        at += len(parts[-1])
    head = json.dumps(dict(header, columns=listed), separators=(",", ":")).encode()
    head += b" " * (-(len(head) + _TABLE_HEAD) % 8)
    lead = TABLE_MAGIC + np.array([len(head), xxhash.xxh3_64_intdigest(head)], "<u8").tobytes()
    return lead + head + b"".join(parts)


def decode_table(
    data: Any, defer: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, int]] | None:
    """``(header, columns, unchecked)`` of a table file's bytes ``data`` (e.g. a memory map; the
    columns are read-only views of it), or None when they are not a whole, undamaged table file:
    another magic, a header or column digest that fails, a column outside the file. Columns whose
    name starts with one of ``defer`` are not hashed here: ``unchecked`` maps each to its digest,
    for :func:`table_column_ok` when it is first used."""
    if len(data) < _TABLE_HEAD or bytes(data[:8]) != TABLE_MAGIC:
        return None
    size, digest = (int(v) for v in np.frombuffer(data, "<u8", 2, 8))
    start = _TABLE_HEAD + size
    if start > len(data) or xxhash.xxh3_64_intdigest(memoryview(data)[_TABLE_HEAD:start]) != digest:
        return None
    columns, unchecked = {}, {}
    try:
        header = json.loads(bytes(data[_TABLE_HEAD:start]))
        for name, dtype, shape, at, want in header.pop("columns"):
            dt = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            if at < 0 or start + at + count * dt.itemsize > len(data):
                return None
            col = np.frombuffer(data, dt, count, start + at).reshape(shape)
            if str(name).startswith(defer):
                unchecked[str(name)] = int(want)
            elif not table_column_ok(col, want):
                return None
            columns[str(name)] = col
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return header, columns, unchecked


def table_column_ok(col: np.ndarray, digest: int) -> bool:
    """Whether a table file's column hashes to its listed xxh3-64 ``digest``."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(col)) == digest


#: Deprecated name of :func:`chunk_byte_layout` (the loaders' ``chunking.chunk_layout`` is another thing).
chunk_layout = chunk_byte_layout


# -- chunk checksums (version 2) ---------------------------------------------------------------------


class ChunkChecksumError(FormatError):
    """A chunk of ``/tokens`` does not match its stored checksum: the shard is corrupt. Names the
    shard file (:attr:`path`), the chunk (:attr:`chunk`) and its shard-local token range."""

    def __init__(self, path: str, chunk: int, lo: int, hi: int, detail: str) -> None:
        self.path, self.chunk, self.token_range = path, chunk, (lo, hi)
        super().__init__(
            f"{path}: chunk {chunk:,} of /tokens (tokens [{lo:,}, {hi:,}) of the shard) {detail}: "
            "the shard is corrupt; run h5corpus validate"
        )


def chunk_checksum(tokens: np.ndarray) -> int:
    """xxh3-64 of ``tokens`` (one chunk's real tokens) as little-endian bytes, as an unsigned int."""
    a = np.ascontiguousarray(tokens)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return xxhash.xxh3_64_intdigest(memoryview(a).cast("B"))


def pieces_checksum(pieces: list[np.ndarray]) -> int:
    """:func:`chunk_checksum` of the concatenation of ``pieces`` (a chunk mapped in several runs),
    without concatenating them."""
    if len(pieces) == 1:
        return chunk_checksum(pieces[0])
    h = xxhash.xxh3_64()
    for p in pieces:
        a = np.ascontiguousarray(p)
        h.update(memoryview(a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a).cast("B"))
    return h.intdigest()


def chunk_checksums(tokens: np.ndarray, chunk_tokens: int, first_chunk: int = 0) -> np.ndarray:
    """(chunks,) uint64 :func:`chunk_checksum` of every ``chunk_tokens`` slice of ``tokens`` (the
    last one may be shorter); ``tokens`` starts on a chunk boundary."""
    n = -(-tokens.size // chunk_tokens)
    return np.fromiter(
        (chunk_checksum(tokens[k * chunk_tokens : (k + 1) * chunk_tokens]) for k in range(n)), CHECKSUM_DTYPE, n
    )


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.generic):
        return v.item()
    return v


def check_attrs(attrs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Return a shard's root attributes as plain Python values; raise :class:`FormatError` naming
    ``where`` unless they declare format ``h5corpus`` of a version in :data:`READABLE_VERSIONS` and
    carry every required key."""
    got = {k: _plain(attrs[k]) for k in attrs.keys()}
    if got.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not an h5corpus shard (format attribute = {got.get('format')!r})")
    check_version(got.get("version"), where)
    missing = [k for k in REQUIRED_ATTRS if k not in got]
    if missing:
        raise FormatError(f"{where}: missing root attributes {missing}")
    return got


def check_version(version: Any, where: str, what: str = "h5corpus format version") -> int:
    """``version`` if this h5corpus reads it (:data:`READABLE_VERSIONS`), else :class:`FormatError`
    naming ``where``."""
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise FormatError(
            f"{where}: {what} {version!r} is not supported (this h5corpus reads versions {readable}); "
            "rebuild the corpus or upgrade h5corpus"
        )
    return int(version)


def tokens_sha256_update(h: hashlib._Hash, tokens: np.ndarray) -> None:
    """Feed ``tokens`` to ``h`` as little-endian bytes (the manifest's ``sha256`` definition)."""
    a = np.ascontiguousarray(tokens)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    h.update(memoryview(a).cast("B"))


def index_sha256(
    doc_offsets: np.ndarray,
    doc_ids: np.ndarray,
    doc_flags: np.ndarray,
    checksums: np.ndarray | None = None,
    offsets_checksums: np.ndarray | None = None,
) -> str:
    """Hex sha256 of ``doc_offsets`` (int64 LE) ++ ``doc_ids`` (raw bytes) ++ ``doc_flags`` (uint8),
    followed in version 2 by the chunk ``checksums`` (uint64 LE), in version 3 also by the
    ``offsets_checksums`` (uint64 LE): the manifest's hash then proves the checksums too.
    ``checksums=None`` is the version 1 definition."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(doc_offsets, dtype=OFFSETS_DTYPE).tobytes())
    h.update(np.ascontiguousarray(doc_ids, dtype=DOC_ID_DTYPE).tobytes())
    h.update(np.ascontiguousarray(doc_flags, dtype=FLAGS_DTYPE).tobytes())
    if checksums is not None:
        h.update(np.ascontiguousarray(checksums, dtype=CHECKSUM_DTYPE).tobytes())
    if offsets_checksums is not None:
        h.update(np.ascontiguousarray(offsets_checksums, dtype=CHECKSUM_DTYPE).tobytes())
    return h.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a shard file's bytes: a manifest entry's optional ``file_sha256``."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def sums_sha256(chunk_sums: np.ndarray, offsets_sums: np.ndarray) -> str:
    """Version 3: hex sha256 of ``/chunk_xxh3`` ++ ``/offsets_xxh3`` (uint64 LE): recorded in the
    manifest, it proves every checksum a reader trusts (the trust chain: manifest -> checksum
    tables -> chunks), at a cost of 8 bytes per chunk, not per document."""
    h = hashlib.sha256(np.ascontiguousarray(chunk_sums, dtype=CHECKSUM_DTYPE).tobytes())
    h.update(np.ascontiguousarray(offsets_sums, dtype=CHECKSUM_DTYPE).tobytes())
    return h.hexdigest()


#: Largest compression ratio a shard's size is believed to hide (deflate tops out near 1,032:1;
#: 65,536:1 leaves room for any filter). A manifest entry claiming more tokens than its file could
#: hold at this ratio is refused before any work proportional to the claim.
MAX_CLAIM_RATIO = 1 << 16


def claim_problems(entry: ShardRecord, itemsize: int, chunk_tokens: int) -> list[Problem]:
    """Counts of a manifest entry no real file of ``entry.bytes`` could hold: more documents than
    tokens (documents are never empty), or more token bytes than :data:`MAX_CLAIM_RATIO` times the
    file (plus one chunk)."""
    if entry.documents > entry.tokens:
        return [Problem("documents", f"claims {entry.documents:,} documents in {entry.tokens:,} tokens")]
    room = entry.bytes * MAX_CLAIM_RATIO + chunk_tokens * itemsize
    if entry.tokens * itemsize > room:
        return [
            Problem(
                "tokens",
                f"claims {entry.tokens:,} tokens, more than a {entry.bytes:,}-byte file can hold",
            )
        ]
    return []


# -- supervised fine-tuning: the optional loss mask (docs/FORMAT.md, "Loss masks") ---------------
#: Optional dataset: (K, 2) little-endian int64 ``[start, end)`` token ranges of the shard whose
#: positions are *trained-on targets* (the token at ``p``, predicted from the tokens before it in
#: its document, counts in the loss iff ``p`` lies in a range). Sorted, disjoint, never adjacent
#: (adjacent ranges are merged), each inside one document and never covering a document's first
#: token (no token predicts it). Absent: every target of the shard is trained on.
LOSS_SPANS = "loss_spans"
LOSS_SPANS_DTYPE = np.dtype("<i8")
#: Ranges per chunk of ``/loss_spans`` (16 KiB chunks).
LOSS_SPANS_CHUNK = 1024
#: Manifest key (top level) of the fine-tuning facts: ``{"loss_mask": bool, "bos_id": int | null,
#: "loss_on": str | null}``; absent for a pretraining corpus.
SFT_KEY = "sft"


def loss_spans_sha256(spans: np.ndarray) -> str:
    """Hex sha256 of ``/loss_spans`` as little-endian int64 bytes, row-major: the manifest's
    ``loss_sha256`` of a shard, checked by the reader when it first reads the ranges and by
    ``validate``."""
    return hashlib.sha256(np.ascontiguousarray(spans, dtype=LOSS_SPANS_DTYPE).reshape(-1, 2).tobytes()).hexdigest()


def loss_span_problems(spans: np.ndarray, doc_offsets: np.ndarray) -> list[Problem]:
    """``/loss_spans`` (K, 2) against the shard's ``doc_offsets``: int64 pairs, ``start < end``,
    sorted, disjoint and not adjacent, each inside one document after its first token. Vectorized."""
    s = np.asarray(spans)
    if s.ndim != 2 or s.shape[1] != 2 or s.dtype.kind != "i":
        return [Problem("loss_spans", f"/{LOSS_SPANS} is {s.dtype} {s.shape}, expected (K, 2) int64", fatal=True)]
    if not s.size:
        return []
    lo, hi = s[:, 0], s[:, 1]
    if (hi <= lo).any():
        k = int(np.flatnonzero(hi <= lo)[0])
        return [
            Problem("loss_spans", f"range {k:,} of /{LOSS_SPANS} is empty or reversed ({int(lo[k])}, {int(hi[k])})")
        ]
    if (lo[1:] <= hi[:-1]).any():
        k = int(np.flatnonzero(lo[1:] <= hi[:-1])[0]) + 1
        return [Problem("loss_spans", f"range {k:,} of /{LOSS_SPANS} overlaps, touches or precedes the one before")]
    doc = np.searchsorted(doc_offsets, lo, side="right") - 1
    ok = (doc >= 0) & (doc < doc_offsets.size - 1)
    docc = np.clip(doc, 0, max(doc_offsets.size - 2, 0))
    ok &= (lo > doc_offsets[docc]) & (hi <= doc_offsets[np.minimum(docc + 1, doc_offsets.size - 1)])
    if not ok.all():
        k = int(np.flatnonzero(~ok)[0])
        return [
            Problem(
                "loss_spans",
                f"range {k:,} of /{LOSS_SPANS} ({int(lo[k])}, {int(hi[k])}) leaves its document or covers its first token",
            )
        ]
    return []


# -- version 4: document ids and flags in a sidecar file beside the shard -------------------------
#: Suffix of a version 4 shard's sidecar: ``train-00000-000.h5`` -> ``train-00000-000.h5.docs``
#: (appended, so that no ``*.h5`` pattern matches a sidecar and any shard name has one).
DOCS_SUFFIX = ".docs"
#: First 8 bytes of a sidecar file.
DOCS_MAGIC = b"H5CDOCS1"
#: Bytes of a sidecar's header: magic (8), format version (u32), id bytes (u32), documents (u64),
#: the shard's token count (u64), its token ``sha256`` and its ``index_sha256`` (32 raw bytes each),
#: little-endian. Then ``documents`` ids of ``id bytes`` each (row-major), then one flag byte each.
DOCS_HEADER_BYTES = 96


def docs_path(shard_path: str | os.PathLike[str]) -> Path:
    """The sidecar of the version 4 shard at ``shard_path`` (:data:`DOCS_SUFFIX` appended)."""
    p = Path(shard_path)
    return p.with_name(p.name + DOCS_SUFFIX)


def index_sha256_v4(doc_offsets: np.ndarray, checksums: np.ndarray, offsets_checksums: np.ndarray) -> str:
    """Version 4's ``index_sha256``: hex sha256 of ``doc_offsets`` (int64 LE) ++ ``/chunk_xxh3`` ++
    ``/offsets_xxh3`` (uint64 LE): what the shard itself holds (ids and flags are the sidecar's,
    proven by ``docs_sha256``). :func:`index_sha256` with no ids and no flags."""
    empty = np.zeros((0, STORED_ID_BYTES_V3), DOC_ID_DTYPE)
    return index_sha256(doc_offsets, empty, np.zeros(0, FLAGS_DTYPE), checksums, offsets_checksums)


def encode_docs(ids: np.ndarray, flags: np.ndarray, *, tokens: int, tokens_sha256: str, index_sha: str) -> bytes:
    """A version 4 sidecar's bytes: the header (:data:`DOCS_HEADER_BYTES`, binding it to its shard
    by token count, token ``sha256`` and ``index_sha256``), the ids (n, 16) and the flags (n,)."""
    ids = np.ascontiguousarray(ids, DOC_ID_DTYPE).reshape(-1, STORED_ID_BYTES_V3)
    flags = np.ascontiguousarray(flags, FLAGS_DTYPE).reshape(-1)
    if ids.shape[0] != flags.size:
        raise ValueError(f"{ids.shape[0]} ids but {flags.size} flags")
    head = np.array([FORMAT_VERSION, STORED_ID_BYTES_V3], "<u4").tobytes()
    head += np.array([flags.size, tokens], "<u8").tobytes()
    head += bytes.fromhex(tokens_sha256) + bytes.fromhex(index_sha)
    return DOCS_MAGIC + head + ids.tobytes() + flags.tobytes()


def docs_problems(data: bytes, entry: ShardRecord) -> list[Problem]:
    """A sidecar's bytes ``data`` against its shard's manifest ``entry``: its size and sha256
    (``docs_bytes``, ``docs_sha256``), the header (magic, version, 16-byte ids) and its binding to
    this shard (document and token counts, the token ``sha256`` and ``index_sha256`` it was
    written with: a sidecar of another shard names another). Empty = what the manifest proves."""
    n = len(data)
    if n < DOCS_HEADER_BYTES or data[:8] != DOCS_MAGIC:
        return [
            Problem("docs", f"the sidecar is not an h5corpus document file ({n:,} bytes, no {DOCS_MAGIC!r} header)")
        ]
    version, id_bytes = np.frombuffer(data, "<u4", 2, 8).tolist()
    docs, tokens = np.frombuffer(data, "<u8", 2, 16).tolist()
    bound = (data[32:64].hex(), data[64:96].hex())
    if version != 4 or id_bytes != STORED_ID_BYTES_V3:
        return [Problem("docs", f"the sidecar's header says version {version}, {id_bytes}-byte ids; expected 4, 16")]
    if bound != (entry.sha256, entry.index_sha256) or tokens != entry.tokens:
        return [
            Problem(
                "docs",
                f"the sidecar belongs to another shard (its header names tokens sha256 {bound[0][:16]}..., "
                f"{tokens:,} tokens; this shard's is {entry.sha256[:16]}..., {entry.tokens:,} tokens)",
            )
        ]
    if docs != entry.documents or n != DOCS_HEADER_BYTES + docs * (id_bytes + 1):
        msg = f"the sidecar holds {docs:,} documents in {n:,} bytes; the shard has {entry.documents:,}"
        return [Problem("docs", msg)]
    if n != entry.docs_bytes:
        return [Problem("docs", f"the sidecar is {n:,} bytes, manifest says {entry.docs_bytes:,}")]
    if hashlib.sha256(data).hexdigest() != entry.docs_sha256:
        return [Problem("docs", "the sidecar's sha256 differs from the manifest's docs_sha256 (corrupt)")]
    return []


def decode_docs(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The ids (n, 16) and flags (n,) of a sidecar's bytes (checked first with :func:`docs_problems`)."""
    n = int(np.frombuffer(data, "<u8", 1, 16)[0])
    ids = np.frombuffer(data, DOC_ID_DTYPE, n * STORED_ID_BYTES_V3, DOCS_HEADER_BYTES).reshape(n, STORED_ID_BYTES_V3)
    flags = np.frombuffer(data, FLAGS_DTYPE, n, DOCS_HEADER_BYTES + n * STORED_ID_BYTES_V3)
    return ids, flags


def read_docs(path: str | os.PathLike[str], entry: ShardRecord, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The ids and flags of the sidecar at ``path`` of the shard of ``entry``, proven against the
    manifest first; :class:`FormatError` naming ``where`` (the shard) when it is missing, unreadable
    or not what the manifest proves."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(max(entry.docs_bytes, DOCS_HEADER_BYTES) + 1)  # a longer file is refused by size
    except FileNotFoundError:
        raise FormatError(
            f"{where}: its document sidecar {Path(path).name} is missing; run h5corpus validate"
        ) from None
    except OSError as e:
        raise FormatError(f"{where}: cannot read its document sidecar {path} ({e.strerror or e})") from None
    bad = docs_problems(data, entry)
    if bad:
        raise FormatError(f"{where}: {bad[0].message}; run h5corpus validate")
    return decode_docs(data)
