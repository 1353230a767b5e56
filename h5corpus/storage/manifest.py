"""``manifests/shards.json``: the list of shards, their hashes, and the corpus-wide facts.

Key names are part of the format contract (docs/FORMAT.md). Shard paths are relative to the
manifest's directory, so moving ``shards/`` and ``manifests/`` together keeps a manifest valid.
The file is written atomically (temp file, fsync, rename): a reader sees the old or the new
manifest, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import stat
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import format as fmt
from .format import FormatError, ShardRecord, TokenizerIdentity
from .shardtable import ShardColumns, ShardTable

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
    shards: Sequence[ShardRecord] = field(default_factory=list)
    """In manifest order; a :class:`~h5corpus.storage.shardtable.ShardTable` when read from a file."""
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    shards_dir: str | None = None
    """POSIX path, relative to the manifest's folder, of the folder every shard lies in (under its
    split's subfolder): the build records it. Absent (older or hand-written manifests): the
    manifest folder's parent, which holds ``manifests/`` and ``shards/`` in the default layout."""
    version: int = fmt.FORMAT_VERSION
    """Format version of the corpus: every shard it lists is of this version (a build writes
    :data:`~h5corpus.storage.format.FORMAT_VERSION`; version 1 corpora are still read)."""
    path: Path | None = None
    """Where it was read from or last written to (not serialized)."""

    @property
    def verified(self) -> bool:
        """True when the shards carry chunk checksums (version >= 2), so every read is verified."""
        return self.version >= 2

    @property
    def root(self) -> Path:
        """Directory shard paths are relative to."""
        if self.path is None:
            raise ValueError("manifest has no path yet")
        return self.path.absolute().parent

    @property
    def shards_root(self) -> Path:
        """Absolute folder that must hold every shard of this manifest (see :attr:`shards_dir`)."""
        return Path(os.path.normpath(self.root / (self.shards_dir or "..")))

    def split_folders(self) -> list[Path]:
        """Folders a shard of this corpus may lie in: ``<shards_dir>/<split>`` for each split (when
        :attr:`shards_dir` is recorded) and the folder of every listed shard."""
        folders = [self.shards_root / s for s in fmt.SPLITS] if self.shards_dir else []
        folders += [self.shard_path(e).parent for e in self.shards]
        return list(dict.fromkeys(folders))

    @property
    def corpus_root(self) -> Path:
        """The corpus's folder: the manifest folder's parent (it holds ``manifests/`` and
        ``shards/`` in the default layout). Every path a manifest names must lie inside it."""
        return Path(os.path.normpath(self.root.parent))

    def check_paths(self, where: str) -> None:
        """Raise :class:`FormatError` naming ``where`` and the shard when ``shards_dir`` or a shard
        path is absolute, when ``shards_dir`` leaves :attr:`corpus_root`, when a shard path leaves
        :attr:`shards_root` (both judged on the paths as written, after removing ``.`` and ``..``
        textually, never by following them through the filesystem), or when a path names a file
        already listed (compared after resolving symbolic links too)."""
        if self.shards_dir is not None and (os.path.isabs(self.shards_dir) or "\0" in self.shards_dir):
            raise FormatError(f"{where}: shards_dir {self.shards_dir!r} must be a relative path")
        root, corpus = self.shards_root, self.corpus_root
        if os.path.commonpath([corpus, root]) != str(corpus):
            raise FormatError(
                f"{where}: shards_dir {self.shards_dir!r} leaves the corpus folder {corpus} (the manifest folder's parent)"
            )
        folders: dict[str, str] = {}  # each shard folder resolved once (realpath costs a stat per component)
        links: dict[str, set[str] | None] = {}  # and listed once: which of its names are symbolic links
        inside, base = str(root).rstrip(os.sep) + os.sep, str(self.root)

        def real(path: str) -> str:
            if os.path.isabs(path) or "\0" in path:
                raise FormatError(f"{where}: shard path {path!r} must be relative to the manifest's folder")
            p = os.path.normpath(os.path.join(base, path))
            if not p.startswith(inside):
                raise FormatError(f"{where}: shard path {path!r} leaves the corpus's shards folder {root}")
            folder, name = os.path.split(p)
            if folder not in folders:
                folders[folder], links[folder] = os.path.realpath(folder), _symlinks_in(folder)
            linked = name in links[folder] if links[folder] is not None else os.path.islink(p)
            return os.path.realpath(p) if linked else os.path.join(folders[folder], name)

        # one 8-byte digest per file, not a set of path strings: what a reading process keeps of a
        # parse stays ~constant (the allocator keeps the pages of freed strings)
        keys = np.array([_digest64(real(path)) for path in _shard_paths(self.shards)], np.uint64).reshape(-1, 1)
        pair = _first_repeat(keys)
        if pair is not None and real(self.shards[pair[0]].path) == real(self.shards[pair[1]].path):
            first, again = self.shards[pair[0]].path, self.shards[pair[1]].path
            raise FormatError(f"{where}: shard {again!r} is the file {first!r} already lists")
        rows, tokens = _content_rows(self.shards)
        live = np.flatnonzero(tokens > 0)  # the build never writes two shards of the same documents
        pair = _first_repeat(rows[live])
        if pair is not None:
            first, again = self.shards[int(live[pair[0]])].path, self.shards[int(live[pair[1]])].path
            raise FormatError(f"{where}: shard {again!r} holds the same documents as {first!r}")

    def check_claims(self, where: str) -> None:
        """Raise :class:`FormatError` naming ``where`` and the shard when an entry's counts are
        ones no real file could hold (:func:`~h5corpus.storage.format.claim_problems`), or when a
        version 3 entry lacks ``sums_sha256`` (the link from the manifest to its checksums), or a
        version 4 entry ``docs_sha256`` (its sidecar's)."""
        itemsize = fmt.token_dtype(self.tokenizer.vocab_size).itemsize
        for e in _claim_suspects(self.shards, itemsize, self.chunk_tokens, self.version >= 3):
            if self.version >= 3 and e.sums_sha256 is None:
                raise FormatError(f"{where}: shard {e.path!r}: a version {self.version} entry needs sums_sha256")
            if not fmt.ids_in_shard(self.version) and e.docs_sha256 is None:
                raise FormatError(f"{where}: shard {e.path!r}: a version {self.version} entry needs docs_sha256")
            bad = fmt.claim_problems(e, itemsize, self.chunk_tokens)
            if bad:
                raise FormatError(f"{where}: shard {e.path!r} {bad[0].message}")

    def shard_path(self, entry: ShardRecord) -> Path:
        """Absolute path of ``entry``'s file."""
        return Path(self.shard_path_str(entry))

    def shard_path_str(self, entry: ShardRecord) -> str:
        """:meth:`shard_path` as a string (per-shard work at open stays in ``os.path``)."""
        hit = self.__dict__.get("_root_str")
        if hit is None or hit[0] != self.path:
            hit = self.__dict__["_root_str"] = (self.path, str(self.root))
        return os.path.normpath(os.path.join(hit[1], entry.path))

    def shards_of(self, split: str) -> Sequence[ShardRecord]:
        """Shards of ``split`` in manifest order (the corpus's global token order)."""
        if isinstance(self.shards, ShardTable):
            mask = self.shards.split_mask(split)
            return self.shards if mask.all() else self.shards.take(np.flatnonzero(mask))
        return [s for s in self.shards if s.split == split]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update(
            {
                "format": fmt.FORMAT_NAME,
                "version": int(self.version),
                "manifest_version": fmt.MANIFEST_VERSION,
                "tokenizer": self.tokenizer.to_json(),
                "dtype": self.dtype,
                "chunk_tokens": int(self.chunk_tokens),
                "shards": [s.to_json() for s in self.shards],
                "splits": self.splits,
            }
        )
        if self.shards_dir is not None:
            d["shards_dir"] = self.shards_dir
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> Manifest:
        """A checked manifest's object (:func:`parse_manifest_text`), its shards as a list of records."""
        if not isinstance(d, Mapping):
            raise FormatError(f"{where}: manifest is not a JSON object")
        if d.get("format") != fmt.FORMAT_NAME:
            raise FormatError(f"{where}: not an h5corpus manifest (format = {d.get('format')!r})")
        version = fmt.check_version(d.get("version"), where, "format version")
        if d.get("manifest_version", 1) != fmt.MANIFEST_VERSION:
            raise FormatError(
                f"{where}: manifest_version {d.get('manifest_version')!r} is not supported (this h5corpus reads "
                f"version {fmt.MANIFEST_VERSION})"
            )
        for k in fmt.MANIFEST_KEYS:
            if k not in d and k != "manifest_version":  # absent in manifests written before it existed
                raise FormatError(f"{where}: manifest lacks key {k!r}")
        known = {*fmt.MANIFEST_KEYS, "splits", "shards_dir"}
        return cls(
            tokenizer=TokenizerIdentity.from_json(d["tokenizer"]),
            dtype=fmt.dtype_name(d["dtype"]),
            chunk_tokens=int(d["chunk_tokens"]),
            shards=[ShardRecord.from_json(s, where) for s in d["shards"]],
            splits=dict(d.get("splits") or {}),
            extra={k: v for k, v in d.items() if k not in known},
            shards_dir=d.get("shards_dir"),
            version=version,
        )


def _symlinks_in(folder: str) -> set[str] | None:
    """Names of the symbolic links in ``folder`` (one directory listing instead of a stat per
    shard), or None when it cannot be listed."""
    try:
        with os.scandir(folder) as it:
            return {d.name for d in it if d.is_symlink()}
    except OSError:
        return None


def _claim_suspects(
    shards: Sequence[ShardRecord], itemsize: int, chunk_tokens: int, sums: bool
) -> Sequence[ShardRecord]:
    """The shards :meth:`Manifest.check_claims` must look at one by one: all of a list; of a table,
    those its columns flag (in float64, with a margin: the exact check decides)."""
    if not isinstance(shards, ShardTable):
        return shards
    tok, docs, size = (shards.column(k).astype(np.float64) for k in ("tokens", "documents", "bytes"))
    room = size * fmt.MAX_CLAIM_RATIO + chunk_tokens * itemsize
    flag = (docs > tok) | (tok * itemsize > room * (1 - 1e-9))
    if sums and shards.digests("sums_sha256") is None:
        return shards  # some entry lacks it: the loop names the first
    return shards.take(np.flatnonzero(flag))


def _shard_paths(shards: Sequence[ShardRecord]) -> Any:
    """Every shard's path as written, one at a time (a table's without building its records)."""
    if isinstance(shards, ShardTable):
        return (shards.path(i) for i in range(len(shards)))
    return (e.path for e in shards)


def _content_rows(shards: Sequence[ShardRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(n, 8) uint64: each shard's sha256 ++ index_sha256, and (n,) its token count."""
    if isinstance(shards, ShardTable):
        both = [shards.digests(k) for k in ("sha256", "index_sha256")]
        cols = [np.zeros((len(shards), 32), np.uint8) if d is None else d for d in both]
        return np.concatenate(cols, axis=1).view(np.uint64), shards.column("tokens")
    raw = bytes.fromhex("".join(e.sha256 + e.index_sha256 for e in shards))
    tokens = np.array([e.tokens for e in shards], np.int64)
    return np.frombuffer(raw, np.uint8).reshape(-1, 64).copy().view(np.uint64), tokens


def _digest64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _first_repeat(rows: np.ndarray) -> tuple[int, int] | None:
    """(i, j): the first row j equal to an earlier row i of the (n, k) array ``rows``, or None."""
    if rows.shape[0] < 2:
        return None
    order = np.lexsort(rows.T[::-1])  # stable: equal rows keep their order
    ranked = rows[order]
    same = (ranked[1:] == ranked[:-1]).all(axis=1)
    if not same.any():
        return None
    j = int(order[1:][same].min())
    i = int(np.flatnonzero((rows == rows[j]).all(axis=1))[0])
    return i, j


#: Largest manifest read (a manifest lists ~250 bytes per shard: this is millions of shards).
MAX_MANIFEST_BYTES = 1 << 30


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows a float")
    return v


def _schema_validator(schema: dict[str, Any]) -> Any:
    import jsonschema

    base = jsonschema.Draft202012Validator
    strict_int = base.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    return jsonschema.validators.extend(base, type_checker=strict_int)(schema)


def _without_shard_items(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``shards`` checked as an array only: its items are checked by
    :func:`_shard_entry_problem` (the same rules, ~100x faster than jsonschema per entry, which
    matters at 10,000 shards)."""
    props = dict(schema["properties"])
    props["shards"] = {"type": "array"}
    return dict(schema, properties=props)


_JSON_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) in (int, float),
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
}


def _is_type(v: Any, want: str | list[str]) -> bool:
    """JSON Schema's ``type`` keyword (one name or a list of names; ``true`` is no integer)."""
    return any(_JSON_TYPES[w](v) for w in ([want] if isinstance(want, str) else want))


def _same(a: Any, b: Any) -> bool:
    """JSON equality of two scalars (``1`` is not ``true``, ``1.0`` is not ``1``)."""
    return type(a) is type(b) and a == b


def _conforms(v: Any, schema: dict[str, Any]) -> bool:
    """Whether ``v`` (parsed JSON) satisfies ``schema``, for the keywords the manifest schema uses
    (``integer`` meaning a JSON integer, as in :func:`_schema_validator`). False for a keyword it
    does not know, so that jsonschema then gives the verdict: this is the fast path of every open
    (importing jsonschema costs a process ~3 MB and ~60 ms), never a second opinion."""
    for key, want in schema.items():
        if key == "$schema":
            continue
        if key == "type":
            ok = _is_type(v, want)
        elif key == "const":
            ok = _same(v, want)
        elif key == "enum":
            ok = any(_same(v, w) for w in want)
        elif key in ("required", "properties", "additionalProperties"):
            ok = not isinstance(v, dict) or _object_conforms(v, key, want, schema)
        elif key == "items":
            ok = not isinstance(v, list) or all(_conforms(x, want) for x in v)
        elif key == "pattern":
            ok = not isinstance(v, str) or re.search(want, v) is not None
        elif key in ("minimum", "maximum"):
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            ok = not num or (v >= want if key == "minimum" else v <= want)
        elif key == "minLength":
            ok = not isinstance(v, str) or len(v) >= want
        else:
            return False
        if not ok:
            return False
    return True


def _object_conforms(v: dict[str, Any], key: str, want: Any, schema: dict[str, Any]) -> bool:
    """:func:`_conforms`'s object keywords."""
    if key == "required":
        return all(k in v for k in want)
    if key == "properties":
        return all(_conforms(v[k], sub) for k, sub in want.items() if k in v)
    known = schema.get("properties", {})
    return all(_conforms(x, want) for k, x in v.items() if k not in known)


_HEX64 = re.compile(r"[0-9a-f]{64}")
_SHARD_SCHEMA = fmt.MANIFEST_SCHEMA["properties"]["shards"]["items"]


_SHARD_PROPS = _SHARD_SCHEMA["properties"]
_INT_KEYS = tuple(k for k, r in _SHARD_PROPS.items() if r.get("type") == "integer")
_HEX_KEYS = tuple(k for k, r in _SHARD_PROPS.items() if "pattern" in r)
_ENUM_KEYS = tuple((k, r["enum"]) for k, r in _SHARD_PROPS.items() if "enum" in r)


def _shard_entry_problem(e: Any) -> tuple[str, str] | None:
    """(field, message) of the first rule of the manifest schema's shard entry that ``e`` breaks,
    or None: an object with every required key, ``path`` a non-empty string, ``split`` a known
    split, counts non-negative JSON integers, hashes 64 lowercase hex digits."""
    if type(e) is not dict:
        return "", f"{e!r} is not of type 'object'"
    for k in _SHARD_SCHEMA["required"]:
        if k not in e:
            return "", f"{k!r} is a required property"
    for k in _INT_KEYS:
        v = e.get(k, 0)
        if type(v) is not int or v < 0:
            return k, f"{v!r} is not a non-negative integer"
    for k in _HEX_KEYS:
        v = e.get(k, "0" * 64)
        if type(v) is not str or not _HEX64.fullmatch(v):
            return k, f"{v!r} is not 64 lowercase hex digits"
    for k, allowed in _ENUM_KEYS:
        if e[k] not in allowed:
            return k, f"{e[k]!r} is not one of {allowed}"
    if type(e["path"]) is not str or not e["path"]:
        return "path", f"{e['path']!r} is not a non-empty string"
    return None


def parse_manifest_text(data: bytes, where: str) -> dict[str, Any]:
    """Decode, parse and schema-check manifest bytes; :class:`FormatError` naming ``where`` and the
    offending field for anything else than a well-formed manifest (invalid UTF-8, NaN/Infinity,
    numbers that overflow, nesting too deep, a value of the wrong type or range)."""
    d = _decode_manifest(data, where, None)
    for i, e in enumerate(d["shards"]):
        bad = _shard_entry_problem(e)
        if bad is not None:
            field = f"shards[{i}]" + (f".{bad[0]}" if bad[0] else "")
            raise FormatError(f"{where}: manifest field {field}: {bad[1]}")
    return d


def _decode_manifest(data: bytes, where: str, hook: Any) -> dict[str, Any]:
    """The manifest's JSON object (``hook``: json's ``object_hook``), its format, version and
    top-level schema checked (the shard entries are the caller's to check)."""
    try:
        text = data.decode("utf-8")
        d = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, object_hook=hook)
    except UnicodeDecodeError as e:
        raise FormatError(f"{where}: manifest is not UTF-8 ({e.reason} at byte {e.start:,})") from None
    except RecursionError:
        raise FormatError(f"{where}: manifest is nested too deeply to be a manifest") from None
    except ValueError as e:  # JSONDecodeError is one
        raise FormatError(f"{where}: manifest is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise FormatError(f"{where}: manifest is not a JSON object")
    if d.get("format") != fmt.FORMAT_NAME:
        raise FormatError(f"{where}: not an h5corpus manifest (format = {d.get('format')!r})")
    fmt.check_version(d.get("version"), where, "format version")
    top = _without_shard_items(fmt.MANIFEST_SCHEMA)
    err = None
    if not _conforms(d, top):  # jsonschema names what is wrong
        err = next(iter(sorted(_schema_validator(top).iter_errors(d), key=lambda e: list(e.absolute_path))), None)
    if err is not None:
        field = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in err.absolute_path).lstrip(".")
        raise FormatError(f"{where}: manifest field {field or '(top level)'}: {err.message}")
    return d


#: What the streaming parse leaves in ``shards`` for an entry it turned into columns, or refused.
_TAKEN, _REFUSED = object(), object()


def parse_manifest_columns(data: bytes, where: str) -> tuple[dict[str, Any], ShardTable]:
    """:func:`parse_manifest_text` holding one shard entry at a time: each entry becomes a row of
    a :class:`~h5corpus.storage.shardtable.ShardTable` as the parser completes it, so the peak and
    the leftover memory of a parse do not grow with the shards (a parse tree is ~1 KB per shard,
    and the allocator keeps part of it after it is freed). Returns the manifest object (its
    ``shards`` emptied) and the table. A manifest with shard-like objects elsewhere than in
    ``shards`` is parsed the plain way."""
    cols, bad, required = ShardColumns(where), [], _SHARD_SCHEMA["required"]

    def entry(obj: dict[str, Any]) -> Any:
        if not all(k in obj for k in required):
            return obj
        problem = _shard_entry_problem(obj)
        if problem is None:
            cols.add(obj)
            return _TAKEN
        bad.append((len(cols) + len(bad), *problem))
        return _REFUSED

    d = _decode_manifest(data, where, entry)
    shards = d["shards"]
    if len(shards) != len(cols) + len(bad) or any(x is not _TAKEN and x is not _REFUSED for x in shards):
        d = parse_manifest_text(data, where)  # shard-like objects elsewhere: the plain way names them
        return dict(d, shards=[]), ShardTable.from_json(d["shards"], where)
    if bad:
        i, key, message = bad[0]
        raise FormatError(f"{where}: manifest field shards[{i}]" + (f".{key}" if key else "") + f": {message}")
    return dict(d, shards=[]), cols.table()


def read_manifest(path: str | os.PathLike[str], *, compact: bool = False) -> Manifest:
    """Parse and check a manifest (schema, versions, shard paths inside its shards folder, no shard
    listed twice); errors name the file. FileNotFoundError when there is none.

    ``compact``: hold the shards as a read-only :class:`~h5corpus.storage.shardtable.ShardTable`
    (about 170 bytes per shard instead of about 1 KB; what every reading process keeps) instead of
    a list of :class:`~h5corpus.storage.format.ShardRecord`; and take it from the manifest's table
    file (:func:`write_table_file`) when that file is current: memory-mapped, in a time that does
    not grow with the shards, instead of parsing ``shards.json``."""
    p = _manifest_file(path)
    st = _manifest_stat(p)
    if compact:
        m = _from_table_file(p, st)
        if m is not None:
            return m
    return _parse_manifest_file(p, st, compact)


def _manifest_file(path: str | os.PathLike[str]) -> Path:
    if "://" in str(path):
        raise FormatError(
            f"{path}: object-storage manifests are not supported (no SWMR or memory maps there); copy or mount "
            "the corpus on a local or network filesystem"
        )
    p = Path(path)
    if "\0" in str(p):
        raise FormatError(f"{str(p)!r}: a path cannot hold a NUL byte")
    return p


def _manifest_stat(p: Path) -> os.stat_result:
    try:
        st = p.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: manifest not found (build a corpus first: h5corpus build ...)") from None
    except OSError as e:
        raise FormatError(f"{p}: cannot read the manifest ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise FormatError(f"{p}: the manifest path is {kind}")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise FormatError(f"{p}: {st.st_size:,} bytes is too large for a manifest")
    return st


def _parse_manifest_file(p: Path, st: os.stat_result, compact: bool) -> Manifest:
    """:func:`read_manifest` from ``shards.json`` itself: parsed, schema-checked, paths and claims checked."""
    try:
        data = p.read_bytes()
    except OSError as e:
        raise FormatError(f"{p}: cannot read the manifest ({e.strerror})") from None
    if compact:
        d, table = parse_manifest_columns(data, str(p))
        m = Manifest.from_json(d, str(p))
        m.shards = table
    else:
        m = Manifest.from_json(parse_manifest_text(data, str(p)), str(p))
    del data
    m.path = p.absolute()
    m.check_paths(str(p))
    m.check_claims(str(p))
    if st.st_size > RELEASE_AFTER_BYTES:
        release_freed_memory()
    return m


# -- the table file (docs/FORMAT.md, "The table file") ---------------------------------------------------


def _file_key(st: os.stat_result) -> list[int]:
    """What says a manifest is the file a table file was made from: inode, size, mtime (ns). An
    atomic rewrite (a new inode) or any write (size, mtime) changes it."""
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _folder_keys(m: Manifest) -> list[list[Any]]:
    """Each folder a shard of ``m`` may lie in (relative to the manifest's folder) and its mtime
    (ns): an entry added, removed or renamed there (a shard swapped for a symbolic link) changes it."""
    out = []
    for folder in m.split_folders():
        with contextlib.suppress(OSError):
            out.append([os.path.relpath(folder, m.root), os.stat(folder).st_mtime_ns])
    return out


#: Table-file columns hashed when first used (all but the splits: 1 byte per shard), not at open.
_DEFERRED_COLUMNS = ("paths", "ends", "int:", "hex:", "present:")


def _from_table_file(p: Path, st: os.stat_result) -> Manifest | None:
    """The compact manifest from ``p``'s table file, or None when there is none or it is not
    current: damaged, made from another manifest file (:func:`_file_key`), or a shard folder
    changed since (:func:`_folder_keys`). Everything :func:`read_manifest` checks was checked
    by :func:`write_table_file` on this same file and folders. Paths and hashes are hashed when
    first used; if they fail then, they are taken from ``shards.json`` (:func:`_reread_table`)."""
    tpath = fmt.table_path(p)
    got = fmt.decode_table(map_readonly(tpath), defer=_DEFERRED_COLUMNS)
    if got is None:
        return None
    head, cols, unchecked = got
    try:
        if head.get("manifest") != _file_key(st):
            return None
        if any(os.stat(p.parent / folder).st_mtime_ns != mtime for folder, mtime in head["folders"]):
            return None
    except (OSError, KeyError, TypeError, ValueError):
        return None

    def check() -> ShardTable | None:
        if all(fmt.table_column_ok(cols[k], want) for k, want in unchecked.items()):
            return None
        return _reread_table(p, tpath, cols["splits"])

    try:
        m = Manifest.from_json(dict(head["object"], shards=[]), str(p))
        m.shards = ShardTable.from_columns(cols, str(tpath), check)
    except (FormatError, KeyError, TypeError, ValueError, AttributeError):
        return None
    m.path = p.absolute()
    return m


def table_manifest(path: str | os.PathLike[str]) -> Manifest | None:
    """The manifest as the table file beside ``path`` gives it to readers when that file is
    current, else None (readers then parse ``path``): for ``validate``, which compares the two."""
    p = _manifest_file(path)
    return _from_table_file(p, _manifest_stat(p))


def _reread_table(p: Path, tpath: Path, splits: np.ndarray) -> ShardTable:
    """``shards.json``'s table, for a table file whose columns failed their digests when first
    used; :class:`FormatError` naming both when it lists other shards than the table file did."""
    fresh = _parse_manifest_file(p, _manifest_stat(p), compact=True).shards
    assert isinstance(fresh, ShardTable)
    if len(fresh) != splits.size or any((fresh.split_mask(s) != (splits == i)).any() for i, s in enumerate(fmt.SPLITS)):
        raise FormatError(f"{tpath}: damaged, and {p} lists other shards now; reopen the corpus")
    return fresh


def map_readonly(path: Path) -> Any:
    """A read-only memory map of ``path``, or b"" when it is absent, empty or unreadable (for the
    readers' caches beside a manifest: the layout and table files)."""
    try:
        with open(path, "rb") as fh:
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return b""


def write_table_file(path: str | os.PathLike[str]) -> Path:
    """Parse and check the manifest at ``path`` as :func:`read_manifest` does and write its table
    file beside it (``<manifest>.table``, atomically): the shard list as memory-mappable columns,
    keyed by the manifest file and its shard folders as they are now, so that readers open the
    corpus without parsing ``shards.json``. Raises what :func:`read_manifest` raises, and
    :class:`FormatError` when the manifest changes while it is read. Returns the table file's path."""
    p = _manifest_file(path)
    st = _manifest_stat(p)
    m = _parse_manifest_file(p, st, compact=True)
    folders = _folder_keys(m)
    m.check_paths(str(p))  # again, after the folders' mtimes were taken: a later change is seen
    if _file_key(_manifest_stat(p)) != _file_key(st):
        raise FormatError(f"{p}: the manifest changed while its table file was written")
    assert isinstance(m.shards, ShardTable)
    header = {"manifest": _file_key(st), "folders": folders, "object": replace(m, shards=[]).to_json()}
    out = fmt.table_path(p)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:  # no fsync: a cache; a torn file fails its digests and the manifest is parsed instead
        tmp.write_bytes(fmt.encode_table(header, m.shards.columns()))
        os.chmod(tmp, _umask_file_mode())
        _outlast(tmp, max([st.st_mtime_ns, *(t for _, t in folders)]), p)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _outlast(tmp: Path, latest: int, where: Path) -> None:
    """Return once the filesystem's clock, as ``tmp``'s mtime shows it, is past ``latest`` (the
    newest mtime a table file keys on): file times tick coarsely (a few ms; whole seconds on some
    filesystems), and a write in the same tick as the one keyed would keep its mtime.
    :class:`FormatError` when that takes over 2.5 s (an mtime in the future)."""
    deadline = time.monotonic() + 2.5
    while os.stat(tmp).st_mtime_ns <= latest:
        if time.monotonic() > deadline:
            raise FormatError(f"{where}: its mtime or a shard folder's is in the future; no table file written")
        time.sleep(0.002)
        os.utime(tmp)


#: Manifests larger than this (about 500 shards) hand their parse's freed memory back to the OS.
RELEASE_AFTER_BYTES = 256 << 10


def release_freed_memory() -> None:
    """Return the heap pages freed by a large parse to the OS (glibc's ``malloc_trim``; nothing
    elsewhere). A manifest's parse tree is ~1 KB per shard and freed at once, but the allocator
    keeps freed pages resident between live blocks: measured at 10,000 shards, 2.2 MB of anonymous
    memory in every reading process, for ~0.4 ms."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return
    trim(0)


def _umask_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (mkstemp always gives 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as sorted, indented JSON via temp file + fsync + rename; the file gets the
    mode a plain ``open()`` would (the umask's), so whoever can read the shards can read it."""
    p = Path(path).absolute()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        os.fchmod(fd, _umask_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2, sort_keys=True, ensure_ascii=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
        from .writer import fsync_dir  # here: the writer imports h5py, which reading needs not

        fsync_dir(p.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(path: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write ``manifest`` atomically to ``path`` and remember the path."""
    write_json_atomic(path, manifest.to_json())
    manifest.path = Path(path).absolute()
