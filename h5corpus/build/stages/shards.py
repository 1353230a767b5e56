"""The build's shard files: their names, and writing a task's documents into a sequence of them.

Final shards are ``<shards_dir>/<split>/<split>-<task>-<n>.h5`` (:func:`final_shard_name`): task
index and sequence number in input order, each written by :func:`sortable_number`, so sorting the
names (bytewise) sorts the corpus at any size. Below 100,000 tasks and 1,000 shards per task the
names are the plain zero-padded ``<task:05d>-<n:03d>``; a wider number is prefixed with a letter
that says how many digits it has beyond the width (``a`` one more, ``b`` two, ...), and letters sort
after digits: ``train-99999-999.h5`` < ``train-99999-a1000.h5`` < ``train-a100000-000.h5``.
Candidate shards, in a task's candidate folder, are ``<split>-<n>.h5``. Each shard of format
version 4 has its sidecar beside it (``<shard>.docs``, :func:`~h5corpus.storage.format.docs_path`:
its document ids and flags), which the build moves, syncs and deletes with it. Nothing else in the
build spells a shard file name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...storage import format as fmt
from ...storage.format import PARTIAL_SUFFIX, ShardRecord, TokenizerIdentity
from ...storage.validate import ShardExpectation, check_shard
from ...storage.writer import ShardWriter, fsync_files

# -- names ------------------------------------------------------------------------------------
TASK_DIGITS = 5
"""Digits of a task index in a shard name below 100,000 tasks."""
SEQUENCE_DIGITS = 3
"""Digits of a shard's sequence number within its task below 1,000 shards."""
_NUMBER = r"(\d{%d}|[a-z]\d+)"
#: A shard file name: split, task index, sequence number within the task (:func:`sortable_number`).
SHARD_NAME = re.compile(r"^(train|validation)-%s-%s\.h5$" % (_NUMBER % TASK_DIGITS, _NUMBER % SEQUENCE_DIGITS))


def sortable_number(x: int, width: int) -> str:
    """``x`` as ``width`` zero-padded digits when it fits, else a letter then its digits: ``a`` for
    ``width + 1`` digits, ``b`` for ``width + 2``, ... (up to ``z``). Bytewise order of the strings
    is numeric order for any ``x >= 0``."""
    if x < 0:
        raise ValueError(f"shard numbers are >= 0, got {x}")
    digits = str(x)
    if len(digits) <= width:
        return digits.zfill(width)
    extra = len(digits) - width
    if extra > 26:
        raise ValueError(f"{x} has more than {width + 26} digits")
    return chr(ord("a") + extra - 1) + digits


def parse_sortable_number(s: str, width: int) -> int:
    """The number :func:`sortable_number` wrote (ValueError for anything it would not write)."""
    if len(s) == width and s.isdigit():
        return int(s)
    if s[:1].isalpha() and s[1:].isdigit() and s[1:2] != "0" and len(s) - 1 == width + ord(s[0]) - ord("a") + 1:
        return int(s[1:])
    raise ValueError(f"{s!r} is not a shard number of width {width}")


def shard_file_name(split: str, task: int, n: int) -> str:
    """``<split>-<task>-<n>.h5``: a task's ``n``-th shard of ``split``; ``<task:05d>-<n:03d>`` below
    100,000 tasks and 1,000 shards per task, sortable in input order at any size."""
    return f"{split}-{sortable_number(task, TASK_DIGITS)}-{sortable_number(n, SEQUENCE_DIGITS)}.h5"


def parse_shard_file_name(name: str) -> tuple[str, int, int] | None:
    """``(split, task, n)`` of a name :func:`shard_file_name` writes, else None."""
    m = SHARD_NAME.match(name)
    if m is None:
        return None
    try:
        return (
            m.group(1),
            parse_sortable_number(m.group(2), TASK_DIGITS),
            parse_sortable_number(m.group(3), SEQUENCE_DIGITS),
        )
    except ValueError:
        return None


def candidate_shard_name(split: str, n: int) -> str:
    """Name of a candidate shard inside its task's candidate folder."""
    return f"{split}-{sortable_number(n, SEQUENCE_DIGITS)}.h5"


def final_shard_name(split: str, task: int, n: int) -> str:
    """Path of a final shard relative to the shards folder."""
    return f"{split}/{shard_file_name(split, task, n)}"


def candidate_number(name: str) -> int:
    """``n`` of a candidate shard name ``<split>-<n>.h5``."""
    return parse_sortable_number(Path(name).stem.rsplit("-", 1)[1], SEQUENCE_DIGITS)


def parse_build_file(name: str) -> tuple[str, int, int, bool] | None:
    """``(split, task, n, partial)`` when ``name`` is exactly a name the build writes: a final shard
    name as :func:`shard_file_name` spells it, or that name plus ``.partial`` (a shard being written),
    or either with the sidecar's ``.docs`` after the shard name (``train-00000-000.h5.docs``, its
    ``.partial``); else None. ``train-00000-000.h5.sha256``, ``train-00000-draft.h5``, ``train-0000-000.h5``,
    ``train-000000-000.h5`` and ``train-a012345-000.h5`` are not the build's;
    ``train-a123456-a1234.h5`` is."""
    partial = name.endswith(PARTIAL_SUFFIX)
    base = name[: -len(PARTIAL_SUFFIX)] if partial else name
    base = base[: -len(fmt.DOCS_SUFFIX)] if base.endswith(fmt.DOCS_SUFFIX) else base
    parsed = parse_shard_file_name(base)
    if parsed is None or shard_file_name(*parsed) != base:
        return None
    split, task, n = parsed
    return split, task, n, partial


def build_file_task(p: Path) -> int | None:
    """The task index of a file the build writes (:func:`parse_build_file`) that lies in the folder
    of its split; else None."""
    parsed = parse_build_file(p.name)
    if parsed is None or p.parent.name != parsed[0]:
        return None
    return parsed[1]


def is_final_shard(p: Path) -> bool:
    """True for a file named exactly like a final shard, in the folder of its split."""
    parsed = parse_build_file(p.name)
    return parsed is not None and not parsed[3] and p.parent.name == parsed[0] and p.suffix != fmt.DOCS_SUFFIX


def record_files(info: ShardRecord) -> list[str]:
    """The files of a written shard: the shard and, version 4, its sidecar."""
    return [info.path] if info.docs_sha256 is None else [info.path, str(fmt.docs_path(info.path))]


def our_shard_files(shards_dir: Path, task: int | None = None) -> list[Path]:
    """The files in ``<shards_dir>/<split>/`` (of task ``task``, or of every task) named exactly like
    the build's shards or their ``.partial`` files: the only files the build ever deletes there
    (docs/BUILD.md, "What the build deletes"). Folders are never listed."""
    out: list[Path] = []
    for split in fmt.SPLITS:
        d = shards_dir / split
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            t = build_file_task(p)
            if t is not None and (task is None or t == task) and not p.is_dir():
                out.append(p)
    return out


def task_shard_files(shards_dir: Path, index: int) -> list[Path]:
    """Final shard files of task ``index`` on disk, and their ``.partial`` files (the names its
    finish stage writes, cleared before it writes them)."""
    return our_shard_files(shards_dir, index)


# -- writing a task's shards --------------------------------------------------------------------
#: Writers whose HDF5 file failed to close (a full disk), kept for the life of the process: freeing
#: the h5py objects of such a file crashes HDF5 (a segfault in the worker, after it reported the
#: error). A worker process ends with ``os._exit``, so they are never freed.
_UNCLOSABLE: list[ShardWriter] = []


class Syncer:
    """fsync files on one background thread (fsync and the tokenizer both release the GIL, so the
    disk flush of one shard overlaps the encoding of the next). ``wait()`` returns once every
    submitted file is durable, re-raising the first error."""

    def __init__(self) -> None:
        self.ex = ThreadPoolExecutor(1, thread_name_prefix="h5corpus-fsync")
        self.futures: list[Any] = []

    def submit(self, path: str | Path | list[str]) -> None:
        paths = path if isinstance(path, list) else [path]
        self.futures.append(self.ex.submit(fsync_files, paths, dirs=False))

    def wait(self) -> None:
        try:
            for f in self.futures:
                f.result()
        finally:
            self.futures.clear()
            self.ex.shutdown(wait=True)

    def abandon(self) -> None:
        self.ex.shutdown(wait=False)


class ShardSequence:
    """One split's documents of one task, in order, into shards of at most ``shard_tokens`` tokens
    (greedy, documents whole; a longer single document gets a shard of its own). The read stage's
    candidates and the finish stage's copies both use it, so a shard's boundaries depend only on
    the documents it holds, never on how they were batched.

    The writer does not fsync: each closed shard goes to ``syncer`` (fsynced in the background
    while this process goes on tokenizing), or is fsynced by :meth:`close` itself. The build fsyncs
    the shards' folders before it writes the manifest that lists them."""

    def __init__(
        self,
        directory: Path,
        name: Callable[[int], str],
        split: str,
        identity: TokenizerIdentity,
        chunk_tokens: int,
        shard_tokens: int,
        syncer: Syncer | None = None,
        *,
        loss_mask: bool = False,
        bos_id: int | None = None,
    ) -> None:
        self.directory, self.name, self.split = directory, name, split
        self.identity, self.chunk_tokens, self.cap = identity, chunk_tokens, shard_tokens
        self.syncer = syncer
        self.loss_mask, self.bos_id = loss_mask, bos_id
        """A fine-tuning build's shards: ``/loss_spans`` (every :meth:`add` gives the ranges) and the BOS id."""
        self.w: ShardWriter | None = None
        self.infos: list[ShardRecord] = []

    def add(
        self,
        flat: np.ndarray,
        lengths: np.ndarray,
        ids: np.ndarray,
        flags: np.ndarray,
        loss_spans: np.ndarray | None = None,
    ) -> None:
        """Append documents (``loss_spans``: a fine-tuning sequence's (k, 2) trained-on ranges, in
        positions of ``flat``)."""
        i, n, pos = 0, lengths.size, 0
        while i < n:
            if self.w is None:
                self.w = ShardWriter(
                    self.directory / self.name(len(self.infos)),
                    split=self.split,
                    tokenizer=self.identity,
                    chunk_tokens=self.chunk_tokens,
                    fsync=False,
                    loss_mask=self.loss_mask,
                    bos_id=self.bos_id,
                )
            cs = np.cumsum(lengths[i:])
            k = int(np.searchsorted(cs, self.cap - self.w.tokens, side="right"))
            if k == 0:
                if self.w.tokens == 0:
                    k = 1
                else:
                    self._close()
                    continue
            take = int(cs[k - 1])
            loss = None
            if loss_spans is not None:  # the ranges of these documents, in their own positions
                a, b = np.searchsorted(loss_spans[:, 0], [pos, pos + take])
                loss = loss_spans[a:b] - pos
            self.w.add_documents(flat[pos : pos + take], lengths[i : i + k], ids[i : i + k], flags[i : i + k], loss)
            pos += take
            i += k
            if self.w.tokens >= self.cap:
                self._close()

    def _close(self) -> None:
        if self.w is not None:
            info = self.w.close()
            self.infos.append(info)
            self.w = None
            if self.syncer is not None:
                self.syncer.submit(record_files(info))

    def close(self) -> list[ShardRecord]:
        self._close()
        if self.syncer is None:
            fsync_files([p for i in self.infos for p in record_files(i)], dirs=False)
        return self.infos

    def abort(self) -> None:
        """Drop the shard being written (its partial file is deleted). Runs while another error
        propagates, so it does not raise one of its own: a writer whose file HDF5 could not close
        (the disk filled up under it) is kept in :data:`_UNCLOSABLE` instead."""
        if self.w is not None:
            w, self.w = self.w, None
            try:
                w.abort()
            except Exception:
                _UNCLOSABLE.append(w)


def shards_intact(
    directory: Path, shards: Sequence[ShardRecord], identity: TokenizerIdentity, chunk_tokens: int
) -> bool:
    """True when every listed shard (paths relative to ``directory``) is on disk and matches its hashes."""
    expect = ShardExpectation.of(identity, chunk_tokens)
    return all(
        not check_shard(str(directory / s.path), s, expect)[0] and _loss_intact(directory / s.path, s) for s in shards
    )


def _loss_intact(path: Path, s: ShardRecord) -> bool:
    """A fine-tuning shard's ``/loss_spans`` matches its record's ``loss_sha256`` (True without one)."""
    if s.loss_sha256 is None:
        return True
    try:
        with h5py.File(path, "r") as f:
            spans = np.asarray(f[fmt.LOSS_SPANS][()], dtype=np.int64)
    except (OSError, KeyError):
        return False
    return fmt.loss_spans_sha256(spans) == s.loss_sha256
