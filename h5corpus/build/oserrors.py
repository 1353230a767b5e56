"""OS failures of a build as one clear error, and output paths of the wrong kind refused up front.

A build writes into its shards folder, its manifest's folder and (``--explain-drops``) one more
file. Whatever the OS refuses there (a full disk, a read-only or unwritable folder, an I/O error)
ends the build with :class:`BuildOSError`, whose message is one line:
``cannot <operation> <path>: <reason> [<ERRNO>]``. Nothing completed is lost: each stage's output
stays in the state folder and is reused after its hashes are checked, so re-running the same
command once the cause is fixed resumes and ends with the bytes of an uninterrupted build.

A path of the wrong kind (a folder where the manifest goes, a file where the shards folder goes)
is a usage error, refused before any work by :func:`check_output_kinds` (ValueError).
"""

from __future__ import annotations

import errno as _errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: HDF5's file driver reports failed system calls inside its message (``errno = 28, ...``);
#: h5py raises them as RuntimeError or OSError without ``errno`` set.
_HDF5_ERRNO = re.compile(r"\berrno = (\d+)")
_HDF5_FILE = re.compile(r"\b(?:file)?name = '([^']*)'")

#: Errors that say the output cannot be written (the others: I/O errors and the like).
_NO_ROOM = (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG)
NOT_WRITABLE = (_errno.EROFS, _errno.EACCES, _errno.EPERM)


class BuildOSError(OSError):
    """The OS refused something the build needed. ``errno``, ``strerror`` and ``filename`` are
    those of the failed call; ``op`` names the operation. Completed work is kept: re-run the same
    command after fixing the cause to resume."""

    def __init__(self, op: str, path: str | os.PathLike[str], err: int | None, reason: str, context: str = "") -> None:
        reason = " ".join(str(reason).split())  # one line, whatever the OS or HDF5 said
        super().__init__(err, reason, str(path))
        self.op = op
        code = _errno.errorcode.get(err or 0, "")
        self.message = f"cannot {op} {path}: {reason}" + (f" [{code}]" if code else "") + context

    def __str__(self) -> str:
        return self.message

    @property
    def hint(self) -> str:
        """What to do about it, for the CLI."""
        if self.errno in _NO_ROOM:
            what = "free space"
        elif self.errno in NOT_WRITABLE:
            what = "make it writable (or choose another --shards-dir/--manifest)"
        else:
            what = "fix the cause"
        return f"nothing written is lost: {what}, then re-run the same command to resume"


def os_error_info(exc: BaseException) -> tuple[int, str | None, str] | None:
    """``(errno, filename or None, reason)`` when ``exc`` is a failed system call (an OSError with
    ``errno``, or an h5py error whose HDF5 message carries one); else None."""
    if isinstance(exc, BuildOSError):
        return exc.errno or 0, exc.filename, exc.strerror or str(exc)
    text = str(exc)
    m = _HDF5_ERRNO.search(text)
    if m is not None and isinstance(exc, (OSError, RuntimeError)):  # HDF5's message: several lines of details
        err = int(m.group(1))
        f = _HDF5_FILE.search(text)
        return err, f.group(1) if f else getattr(exc, "filename", None), os.strerror(err)
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno, None if exc.filename is None else str(exc.filename), exc.strerror or os.strerror(exc.errno)
    return None


def as_build_os_error(
    exc: BaseException, op: str, path: str | os.PathLike[str], context: str = ""
) -> BuildOSError | None:
    """``exc`` as a :class:`BuildOSError` naming ``op`` on ``path`` (and the file the failed call
    names, when that is another one); None when ``exc`` is not a failed system call."""
    if isinstance(exc, BuildOSError):
        return exc
    info = os_error_info(exc)
    if info is None:
        return None
    err, filename, reason = info
    if filename and Path(filename) != Path(path):
        reason = f"{filename}: {reason}"
    return BuildOSError(op, path, err, reason, context)


@contextmanager
def os_step(op: str, path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn a failed system call inside the block into :class:`BuildOSError` (``cannot <op> <path>``)."""
    try:
        yield
    except BuildOSError:
        raise
    except Exception as e:
        err = as_build_os_error(e, op, path)
        if err is None:
            raise
        raise err from e


def refusal(op: str, path: str | os.PathLike[str]) -> BuildOSError:
    """Why ``path`` cannot be written: a read-only file system (that of its nearest existing
    ancestor), or else no permission."""
    p = Path(path)
    existing = p.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    ro = False
    try:
        ro = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        pass
    err = _errno.EROFS if ro else _errno.EACCES
    return BuildOSError(op, p, err, os.strerror(err))


def check_writable(op: str, path: Path) -> None:
    """Raise :class:`BuildOSError` (``cannot <op> <path>``) when the folder that would hold ``path``
    (its nearest existing ancestor, if it does not exist yet) cannot be written."""
    folder = Path(path).absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise refusal(op, path)


def check_output_kinds(shards_dir: Path, manifest: Path, explain_drops: Path | None = None) -> None:
    """Refuse (ValueError, a usage error) output paths of the wrong kind before any work: a shards
    folder that is a file, a manifest or drop list that is a folder or not a regular file, or a
    path below something that is not a folder, or a path that holds a NUL byte (the OS would read
    it cut short, as another file)."""
    for option, p in (("--shards-dir", shards_dir), ("--manifest", manifest), ("--explain-drops", explain_drops)):
        if p is not None and "\0" in str(p):
            raise ValueError(f"{option}: {str(p)!r} holds a NUL byte")
    _check_folder("--shards-dir", shards_dir)
    for option, p in (("--manifest", manifest), ("--explain-drops", explain_drops)):
        if p is None:
            continue
        if p.is_dir():
            raise ValueError(f"{option} {p} is a folder, not a file")
        if p.exists() and not p.is_file():
            raise ValueError(f"{option} {p} is not a regular file")
        _check_folder(option, p.parent, below=p)


def _check_folder(option: str, folder: Path, below: Path | None = None) -> None:
    """``folder`` is a folder or can be made one: it and its nearest existing ancestor are folders."""
    p = folder
    while not p.exists() and p != p.parent:
        if p.is_symlink():
            raise ValueError(f"{option} {below or folder}: {p} is a dangling symbolic link")
        p = p.parent
    if not p.is_dir():
        kind = "a file" if p.is_file() else "not a folder"
        where = below or folder
        raise ValueError(
            f"{option} {where}: {p} is {kind}, not a folder" if p != where else f"{option} {p} is {kind}, not a folder"
        )
