"""``manifests/shards.json``: the list of shards, their hashes, and the corpus-wide facts.

Key names are part of the format contract (docs/FORMAT.md). Shard paths are relative to the
manifest's directory, so moving ``shards/`` and ``manifests/`` together keeps a manifest valid.
The file is written atomically (temp file, fsync, rename): a reader sees the old or the new
manifest, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import format as fmt
from .format import FormatError, TokenizerIdentity
from .writer import ShardInfo, fsync_dir

DEFAULT_MANIFEST = Path("manifests") / "shards.json"
DEFAULT_SHARDS_DIR = Path("shards")

_SHARD_KEYS = ("path", "split", "tokens", "documents", "sha256", "index_sha256", "bytes")


@dataclass(kw_only=True)
class ShardEntry:
    """One shard as listed in the manifest."""

    path: str
    """POSIX path relative to the manifest's directory."""
    split: str
    tokens: int
    documents: int
    sha256: str
    index_sha256: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _SHARD_KEYS}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> ShardEntry:
        missing = [k for k in _SHARD_KEYS if k not in d]
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

    @classmethod
    def from_info(cls, info: ShardInfo, manifest_dir: Path) -> ShardEntry:
        rel = Path(os.path.relpath(info.path, manifest_dir.absolute())).as_posix()
        return cls(
            path=rel,
            split=info.split,
            tokens=info.tokens,
            documents=info.documents,
            sha256=info.sha256,
            index_sha256=info.index_sha256,
            bytes=info.bytes,
        )


@dataclass(kw_only=True)
class Manifest:
    """The parsed ``shards.json``.

    ``splits`` holds per-split build figures (``documents``, ``tokens``, ``duplicates``, ``skipped``,
    ...); ``extra`` keeps every other top-level key (``source``, ``build``, ``filters``) untouched.
    """

    tokenizer: TokenizerIdentity
    dtype: str
    chunk_tokens: int
    shards: list[ShardEntry] = field(default_factory=list)
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    """Where it was read from or last written to (not serialized)."""

    @property
    def root(self) -> Path:
        """Directory shard paths are relative to."""
        if self.path is None:
            raise ValueError("manifest has no path yet")
        return self.path.absolute().parent

    def shard_path(self, entry: ShardEntry) -> Path:
        """Absolute path of ``entry``'s file."""
        return Path(os.path.normpath(self.root / entry.path))

    def shards_of(self, split: str) -> list[ShardEntry]:
        """Shards of ``split`` in manifest order (the corpus's global token order)."""
        return [s for s in self.shards if s.split == split]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update(
            {
                "format": fmt.FORMAT_NAME,
                "version": fmt.FORMAT_VERSION,
                "tokenizer": self.tokenizer.to_json(),
                "dtype": self.dtype,
                "chunk_tokens": int(self.chunk_tokens),
                "shards": [s.to_json() for s in self.shards],
                "splits": self.splits,
            }
        )
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> Manifest:
        if not isinstance(d, Mapping):
            raise FormatError(f"{where}: manifest is not a JSON object")
        if d.get("format") != fmt.FORMAT_NAME:
            raise FormatError(f"{where}: not an h5corpus manifest (format = {d.get('format')!r})")
        if d.get("version") != fmt.FORMAT_VERSION:
            raise FormatError(
                f"{where}: manifest version {d.get('version')!r} is not supported (this h5corpus reads "
                f"version {fmt.FORMAT_VERSION})"
            )
        for k in ("tokenizer", "dtype", "chunk_tokens", "shards"):
            if k not in d:
                raise FormatError(f"{where}: manifest lacks key {k!r}")
        known = {"format", "version", "tokenizer", "dtype", "chunk_tokens", "shards", "splits"}
        return cls(
            tokenizer=TokenizerIdentity.from_json(d["tokenizer"]),
            dtype=fmt.dtype_name(d["dtype"]),
            chunk_tokens=int(d["chunk_tokens"]),
            shards=[ShardEntry.from_json(s, where) for s in d["shards"]],
            splits=dict(d.get("splits") or {}),
            extra={k: v for k, v in d.items() if k not in known},
        )


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse and check a manifest; errors name the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: manifest not found (build a corpus first: h5corpus build ...)") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{p}: manifest is not valid JSON ({e})") from None
    m = Manifest.from_json(d, str(p))
    m.path = p.absolute()
    return m


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as sorted, indented JSON via temp file + fsync + rename."""
    p = Path(path).absolute()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2, sort_keys=True, ensure_ascii=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
        fsync_dir(p.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(path: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write ``manifest`` atomically to ``path`` and remember the path."""
    write_json_atomic(path, manifest.to_json())
    manifest.path = Path(path).absolute()
