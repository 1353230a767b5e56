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
from .format import FormatError, ShardRecord, TokenizerIdentity
from .writer import fsync_dir

DEFAULT_MANIFEST = Path("manifests") / "shards.json"
DEFAULT_SHARDS_DIR = Path("shards")


@dataclass(kw_only=True)
class Manifest:
    """The parsed ``shards.json``.

    ``splits`` holds per-split build figures (``documents``, ``tokens``, ``duplicates``, ``skipped``,
    ...); ``extra`` keeps every other top-level key (``source``, ``build``, ``filters``) untouched.
    """

    tokenizer: TokenizerIdentity
    dtype: str
    chunk_tokens: int
    shards: list[ShardRecord] = field(default_factory=list)
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

    def shard_path(self, entry: ShardRecord) -> Path:
        """Absolute path of ``entry``'s file."""
        return Path(os.path.normpath(self.root / entry.path))

    def shards_of(self, split: str) -> list[ShardRecord]:
        """Shards of ``split`` in manifest order (the corpus's global token order)."""
        return [s for s in self.shards if s.split == split]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update(
            {
                "format": fmt.FORMAT_NAME,
                "version": fmt.FORMAT_VERSION,
                "manifest_version": fmt.MANIFEST_VERSION,
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
                f"{where}: format version {d.get('version')!r} is not supported (this h5corpus reads "
                f"version {fmt.FORMAT_VERSION})"
            )
        if d.get("manifest_version", 1) != fmt.MANIFEST_VERSION:
            raise FormatError(
                f"{where}: manifest_version {d.get('manifest_version')!r} is not supported (this h5corpus reads "
                f"version {fmt.MANIFEST_VERSION})"
            )
        for k in fmt.MANIFEST_KEYS:
            if k not in d and k != "manifest_version":  # absent in manifests written before it existed
                raise FormatError(f"{where}: manifest lacks key {k!r}")
        known = {*fmt.MANIFEST_KEYS, "splits"}
        return cls(
            tokenizer=TokenizerIdentity.from_json(d["tokenizer"]),
            dtype=fmt.dtype_name(d["dtype"]),
            chunk_tokens=int(d["chunk_tokens"]),
            shards=[ShardRecord.from_json(s, where) for s in d["shards"]],
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
