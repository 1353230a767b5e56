"""A manifest's shard list held as columns: what every reading process keeps of ``shards.json``.

A parsed manifest entry as Python objects (a :class:`~h5corpus.storage.format.ShardRecord`, its
path and five hex strings) costs about 1 KB; at 10,000 shards that is 10 MB of anonymous memory
in every DataLoader worker of every rank. :class:`ShardTable` keeps the same facts in numpy
columns (paths in one byte string, counts as int64, each sha256 as 32 bytes: about 170 bytes per
shard) and builds a :class:`ShardRecord` only when one is asked for. It is an immutable
``Sequence[ShardRecord]``: code that iterates a manifest's shards reads it as it reads a list.
"""

from __future__ import annotations

import binascii
import dataclasses
import os
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, overload

import numpy as np

from . import format as fmt
from .format import FormatError, ShardRecord

_FIELDS = {f.name for f in dataclasses.fields(ShardRecord)}
_PROPS = fmt.MANIFEST_SCHEMA["properties"]["shards"]["items"]["properties"]
#: integer fields of a shard entry (counts), stored as int64 columns
INT_KEYS = tuple(k for k, r in _PROPS.items() if r.get("type") == "integer" and k in _FIELDS)
#: sha256 fields of a shard entry (64 hex digits), stored as (n, 32) uint8 columns
HEX_KEYS = tuple(k for k, r in _PROPS.items() if "pattern" in r and k in _FIELDS)
_INT64_MAX = (1 << 63) - 1


class ShardTable(Sequence[ShardRecord]):
    """``n`` shard records as columns (see the module docstring). Indexing gives a
    :class:`ShardRecord`; a slice or :meth:`take` gives another table."""

    def __init__(
        self,
        paths: bytes,
        ends: np.ndarray,
        splits: np.ndarray,
        ints: dict[str, np.ndarray],
        hexes: dict[str, tuple[np.ndarray, np.ndarray | None]],
        rows: np.ndarray | None = None,
    ) -> None:
        self._init(_Bulk(_Columns(paths, ends, ints, hexes)), splits, rows)

    def _init(self, bulk: _Bulk, splits: np.ndarray, rows: np.ndarray | None) -> None:
        #: every path's UTF-8 bytes end to end (path i is ``paths[ends[i-1]:ends[i]]``), per
        #: integer key (n,) int64 (absent when no entry has the key), per hash key ((n, 32) uint8,
        #: (n,) bool "present" or None when all are): :attr:`_paths`, :attr:`_ends`, ...
        self._bulk = bulk
        #: per shard: its split's index in :data:`~h5corpus.storage.format.SPLITS`
        self._splits = splits
        #: a view's positions in those columns (None: all of them, in order)
        self._rows = rows

    @classmethod
    def _sharing(cls, bulk: _Bulk, splits: np.ndarray, rows: np.ndarray | None = None) -> ShardTable:
        """A table on ``bulk``'s columns (shared, made when first used)."""
        t = cls.__new__(cls)
        t._init(bulk, splits, rows)
        return t

    @property
    def _paths(self) -> bytes | memoryview:
        return self._bulk.get().paths

    @property
    def _ends(self) -> np.ndarray:
        return self._bulk.get().ends

    @property
    def _ints(self) -> dict[str, np.ndarray]:
        return self._bulk.get().ints

    @property
    def _hexes(self) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
        return self._bulk.get().hexes

    @classmethod
    def from_json(cls, entries: list[dict[str, Any]], where: str) -> ShardTable:
        """Columns of schema-checked manifest entries (:func:`~h5corpus.storage.manifest.parse_manifest_text`);
        :class:`FormatError` naming ``where`` and the shard when a required key lacks or a count
        does not fit int64."""
        for e in entries:
            missing = [k for k in fmt.SHARD_KEYS if k not in e]
            if missing:
                raise FormatError(f"{where}: shard entry {e.get('path', '?')!r} lacks keys {missing}")
        cols = ShardColumns(where)
        for e in entries:
            cols.add(e)
        return cols.table()

    @classmethod
    def of(cls, records: Sequence[ShardRecord]) -> ShardTable:
        """A table of ``records`` (e.g. what a writer returned)."""
        if isinstance(records, ShardTable):
            return records
        return cls.from_json([r.to_json() for r in records], "shard records")

    def columns(self) -> dict[str, np.ndarray]:
        """This table's columns by name (what :meth:`from_columns` takes back): ``paths`` (every
        path's UTF-8 bytes), ``ends``, ``splits``, ``int:<key>``, ``hex:<key>`` and, where some
        shard lacks that hash, ``present:<key>``."""
        t = self._materialized()
        cols = {"paths": np.frombuffer(t._paths, np.uint8), "ends": t._ends, "splits": t._splits}
        cols.update({f"int:{k}": v for k, v in t._ints.items()})
        for k, (col, present) in t._hexes.items():
            cols[f"hex:{k}"] = col
            if present is not None:
                cols[f"present:{k}"] = present.astype(np.uint8)
        return cols

    @classmethod
    def from_columns(
        cls, cols: dict[str, np.ndarray], where: str, check: Callable[[], ShardTable | None] | None = None
    ) -> ShardTable:
        """The table of :meth:`columns` (e.g. read-only views of a memory map: nothing is
        copied). :class:`FormatError` naming ``where`` when a column is unknown, of another
        dtype or length, or the paths do not end where ``ends`` says (checked when first used).
        ``check``: called the first time a column other than the splits is used; when it returns
        a table (these columns failed their digests: the same shards, read elsewhere), that
        table's columns are used."""
        n = len(cols.get("splits", ()))

        def col(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            c = cols.get(name)
            if c is None or c.dtype != np.dtype(dtype) or c.shape != shape:
                raise FormatError(f"{where}: table column {name!r} is missing or not {dtype} {shape}")
            return c

        ends, splits = col("ends", "<i8", (n,)), col("splits", "|u1", (n,))
        ints = {k: col(f"int:{k}", "<i8", (n,)) for k in INT_KEYS if f"int:{k}" in cols}
        hexes: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
        for k in HEX_KEYS:
            if f"hex:{k}" in cols:
                present = col(f"present:{k}", "|u1", (n,)).view(bool) if f"present:{k}" in cols else None
                hexes[k] = (col(f"hex:{k}", "|u1", (n, 32)), present)
        known = {
            "paths",
            "ends",
            "splits",
            *(f"{p}:{k}" for p in ("int", "hex", "present") for k in (*INT_KEYS, *HEX_KEYS)),
        }
        if set(cols) - known or "paths" not in cols or (splits >= len(fmt.SPLITS)).any():
            raise FormatError(f"{where}: table columns {sorted(set(cols) - known)} or splits are not a shard table")

        def bulk() -> _Columns:  # what ``check`` proves, when first used
            other = check() if check is not None else None
            if other is not None:
                return other._bulk.get()
            paths = cols["paths"]
            if paths.dtype != np.uint8 or paths.ndim != 1 or (n and (np.diff(ends, prepend=0) < 0).any()):
                raise FormatError(f"{where}: table column 'paths' or 'ends' is not a shard table's")
            if paths.size != (int(ends[-1]) if n else 0):
                raise FormatError(f"{where}: table column 'paths' does not end where 'ends' says")
            return _Columns(memoryview(paths), ends, ints, hexes)

        return cls._sharing(_Bulk(None, bulk), splits)

    # -- Sequence --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._splits.size if self._rows is None else self._rows.size)

    def _at(self, i: int) -> int:
        """Position in the columns of shard ``i`` (negative counts from the end)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"shard {i} of {n}")
        i = int(i) % n
        return i if self._rows is None else int(self._rows[i])

    def _view(self, col: np.ndarray) -> np.ndarray:
        return col if self._rows is None else col[self._rows]

    @overload
    def __getitem__(self, i: int) -> ShardRecord: ...
    @overload
    def __getitem__(self, i: slice) -> ShardTable: ...
    def __getitem__(self, i: int | slice) -> ShardRecord | ShardTable:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        i = self._at(i)
        kw: dict[str, Any] = {"path": self._path(i), "split": fmt.SPLITS[self._splits[i]]}
        for k, col in self._ints.items():
            kw[k] = int(col[i])
        for k, (col, present) in self._hexes.items():
            if present is None or present[i]:
                kw[k] = col[i].tobytes().hex()
        return ShardRecord(**kw)

    def __iter__(self) -> Iterator[ShardRecord]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # mutable-equal, like a list

    def __repr__(self) -> str:
        return f"ShardTable({len(self):,} shards)"

    # -- columns ---------------------------------------------------------------------------------
    def path(self, i: int) -> str:
        """Shard ``i``'s path as the manifest writes it."""
        return self._path(self._at(i))

    def _path(self, i: int) -> str:
        lo = int(self._ends[i - 1]) if i else 0
        return bytes(self._paths[lo : int(self._ends[i])]).decode("utf-8", "surrogatepass")

    def column(self, key: str) -> np.ndarray:
        """(n,) int64 of an integer key (``tokens``, ``documents``, ``bytes``, ...); zeros when no
        entry has it."""
        col = self._ints.get(key)
        if col is None:
            if key not in INT_KEYS:
                raise KeyError(key)
            return np.zeros(len(self), np.int64)
        return self._view(col)

    def has(self, key: str) -> bool:
        """Whether any shard has the hash ``key`` (e.g. ``loss_sha256``: a fine-tuning corpus)."""
        col = self._hexes.get(key)
        return col is not None and (col[1] is None or bool(self._view(col[1]).any()))

    def split_mask(self, split: str) -> np.ndarray:
        """(n,) bool: which shards belong to ``split``."""
        return self._view(self._splits) == fmt.SPLITS.index(split)

    def _complete(self, key: str) -> np.ndarray | None:
        """The (all shards, 32) column of hash ``key`` when every shard of this table has it, else None."""
        col = self._hexes.get(key)
        if col is None or (col[1] is not None and not self._view(col[1]).all()):
            return None
        return col[0]

    def digests(self, key: str) -> np.ndarray | None:
        """(n, 32) uint8: every shard's ``key`` hash as bytes; None when some shard lacks it."""
        col = self._complete(key)
        return None if col is None else self._view(col)

    def hex_blocks(self, key: str, rows: int = 256) -> Iterator[bytes] | None:
        """Every shard's ``key`` hash in hex (64 ASCII bytes per shard), ``rows`` shards at a
        time: joined, what a loop of ``record.<key>.encode()`` gives; None when some shard lacks it.
        (A hash over them needs no copy of the whole column.)"""
        table, picks = self._complete(key), self._rows
        if table is None:
            return None
        return (
            binascii.hexlify((table[lo : lo + rows] if picks is None else table[picks[lo : lo + rows]]).tobytes())
            for lo in range(0, len(self), rows)
        )

    def take(self, idx: np.ndarray) -> ShardTable:
        """The shards at positions ``idx`` (in that order), as a table sharing this one's columns."""
        idx = np.asarray(idx, np.int64).reshape(-1)
        if idx.size and not (-len(self) <= int(idx.min()) and int(idx.max()) < len(self)):
            raise IndexError(f"shards {idx.min()}..{idx.max()} of {len(self)}")
        idx = idx % max(len(self), 1)
        rows = idx if self._rows is None else self._rows[idx]
        return ShardTable._sharing(self._bulk, self._splits, rows)

    def _materialized(self) -> ShardTable:
        """This table with columns of its own shards only."""
        if self._rows is None:
            return self
        idx = self._rows
        starts = np.concatenate([[0], self._ends[:-1]]) if self._ends.size else self._ends
        parts = [bytes(self._paths[int(starts[i]) : int(self._ends[i])]) for i in idx.tolist()]
        ends = np.cumsum([len(p) for p in parts], dtype=np.int64) if parts else np.zeros(0, np.int64)
        hexes = {k: (c[idx], None if p is None else p[idx]) for k, (c, p) in self._hexes.items()}
        return ShardTable(b"".join(parts), ends, self._splits[idx], {k: c[idx] for k, c in self._ints.items()}, hexes)

    def __add__(self, other: ShardTable) -> ShardTable:
        """This table's shards, then ``other``'s."""
        a, b = self._materialized(), other._materialized()
        n, m = len(a), len(b)
        ends = np.concatenate([a._ends, b._ends + (int(a._ends[-1]) if n else 0)])
        ints = {k: np.concatenate([a.column(k), b.column(k)]) for k in {*a._ints, *b._ints}}
        hexes = {}
        for k in {*a._hexes, *b._hexes}:
            (ca, pa), (cb, pb) = a._hex_or_absent(k, n), b._hex_or_absent(k, m)
            present = np.concatenate([pa, pb])
            hexes[k] = (np.concatenate([ca, cb]), None if present.all() else present)
        return ShardTable(bytes(a._paths) + bytes(b._paths), ends, np.concatenate([a._splits, b._splits]), ints, hexes)

    def _hex_or_absent(self, key: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        col = self._hexes.get(key)
        if col is None:
            return np.zeros((n, 32), np.uint8), np.zeros(n, bool)
        return col[0], np.ones(n, bool) if col[1] is None else col[1]


class _Columns(NamedTuple):
    paths: bytes | memoryview
    ends: np.ndarray
    ints: dict[str, np.ndarray]
    hexes: dict[str, tuple[np.ndarray, np.ndarray | None]]


class _Bulk:
    """A table's columns but the splits (nearly all its bytes), shared by its views; a table
    file's are made (``make``: digests and structure checked, once) when first used, not at open."""

    def __init__(self, columns: _Columns | None, make: Callable[[], _Columns] | None = None) -> None:
        self._columns, self._make = columns, make

    def get(self) -> _Columns:
        if self._columns is None:
            assert self._make is not None
            self._columns = self._make()
        return self._columns

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a corpus sent to a spawned worker) as checked columns of its own."""
        c = self.get()
        return (_Bulk, (_Columns(bytes(c.paths), c.ends, c.ints, c.hexes),))


class RootedPaths(Sequence[str]):
    """The absolute paths of a table's shards under ``root`` (the manifest's folder), each built
    when asked for (``os.path.normpath(os.path.join(root, path))``)."""

    def __init__(self, root: str, table: ShardTable) -> None:
        self.root, self.table = root, table

    def __len__(self) -> int:
        return len(self.table)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[k] for k in range(len(self))[i]]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"shard {i} of {n}")
        return os.path.normpath(os.path.join(self.root, self.table.path(int(i) % n)))


class ShardColumns:
    """Manifest entries added one at a time (:meth:`add`) into growing buffers, so that a parser
    can drop each entry as soon as it is read (no object is kept per entry); :meth:`table` makes
    the :class:`ShardTable`."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._paths, self._ends, self._splits = bytearray(), array("q"), bytearray()
        self._ints = {k: array("q") for k in INT_KEYS}
        self._hex = {k: bytearray() for k in HEX_KEYS}
        self._present = {k: bytearray() for k in HEX_KEYS}
        self._seen: set[str] = set()

    def __len__(self) -> int:
        return len(self._splits)

    def add(self, e: dict[str, Any]) -> None:
        """Append one schema-checked entry; :class:`FormatError` naming the shard when a count does
        not fit int64."""
        self._paths += str(e["path"]).encode("utf-8", "surrogatepass")
        self._ends.append(len(self._paths))
        self._splits.append(fmt.SPLITS.index(e["split"]))
        for k, col in self._ints.items():
            v = e.get(k)
            if v is not None:
                self._seen.add(k)
            if not 0 <= (v or 0) <= _INT64_MAX:
                raise FormatError(f"{self.where}: shard {e['path']!r}: {k} {v!r} is out of range")
            col.append(v or 0)
        for k, col in self._hex.items():
            v = e.get(k)
            col += _ZERO_HASH if v is None else bytes.fromhex(v)
            self._present[k].append(v is not None)

    def table(self) -> ShardTable:
        n = len(self)
        ints = {k: np.frombuffer(self._ints[k], np.int64).copy() for k in INT_KEYS if k in self._seen}
        hexes = {}
        for k in HEX_KEYS:
            present = np.frombuffer(self._present[k], np.uint8).astype(bool)
            if present.any():
                col = np.frombuffer(bytes(self._hex[k]), np.uint8).reshape(n, 32)
                hexes[k] = (col, None if present.all() else present)
        ends = np.frombuffer(self._ends, np.int64).copy()
        return ShardTable(bytes(self._paths), ends, np.frombuffer(bytes(self._splits), np.uint8), ints, hexes)


_ZERO_HASH = bytes(32)
