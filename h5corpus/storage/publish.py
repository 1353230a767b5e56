"""``h5corpus upload``: publish a finished local corpus to object storage, shards first and the
manifest last, so a reader never finds a manifest whose shards are missing (docs/READING.md,
"Corpora on object storage").

Every shard is proven against its manifest entry (size, sha256) before it leaves, so a corrupt
local shard is never published, and the published manifest records each shard's whole-file
sha256 (``file_sha256``, docs/FORMAT.md) so that readers prove downloads as they arrive. The
upload resumes: a journal beside the manifest (``.<name>.upload.json``) records each shard (and
its file hash) once its upload has finished, and a rerun skips the shards it lists whose object
is there with the right size. Object stores replace an object
whole on each PUT, so a shard interrupted mid-upload is either absent or complete remotely.
A version 4 shard's sidecar (its document ids and flags, ``<shard>.docs``) is proven against the
manifest's ``docs_sha256`` and uploaded just before its shard, so it too precedes the manifest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cache import verify_shard
from .format import FormatError, ShardExpectation, ShardRecord, docs_path, docs_problems, file_sha256
from .manifest import read_manifest, write_json_atomic
from .remote import RemoteError, RemoteOptions, filesystem, fs_path, is_remote, redact, with_retries


@dataclass
class UploadReport:
    manifest_url: str
    shards: int
    uploaded: int
    skipped: int
    bytes_uploaded: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__, manifest_url=redact(self.manifest_url))


def _journal_path(manifest: Path) -> Path:
    return manifest.with_name(f".{manifest.name}.upload.json")


def _load_journal(path: Path, dest: str) -> dict[str, list[str]]:
    """url -> [tokens sha256, file sha256] of each shard whose upload to ``dest`` finished."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return {}
    done = d.get("done", {}) if d.get("dest") == redact(dest) else {}
    return {u: v for u, v in done.items() if isinstance(v, list) and len(v) == 2}


def published_manifest(path: str | os.PathLike[str], file_hashes: dict[str, str]) -> bytes:
    """The manifest at ``path`` as published: its JSON with each shard entry's ``file_sha256``
    (``file_hashes``: entry path -> hex) added, written like a local manifest (sorted, indented)."""
    d = json.loads(Path(path).read_text(encoding="utf-8"))
    for s in d["shards"]:
        s["file_sha256"] = file_hashes[s["path"]]
    return (json.dumps(d, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def upload_corpus(
    manifest: str | os.PathLike[str],
    dest: str,
    *,
    options: RemoteOptions | None = None,
    progress: Callable[[str], None] | None = None,
) -> UploadReport:
    """Upload the corpus of ``manifest`` (format version 3 or 4) under the URL ``dest`` (its folder:
    paths below it are the corpus folder's, e.g. ``<dest>/manifests/shards.json``); returns what
    was done. Raises :class:`~h5corpus.storage.remote.RemoteError` (one line: URL and shard) when
    storage refuses, :class:`FormatError` when a local shard differs from its entry."""
    opts = options if options is not None else RemoteOptions()
    if not is_remote(dest):
        raise ValueError(f"upload destination must be an object-storage URL (s3://, gs://, az://, hf://), got {dest!r}")
    m = read_manifest(manifest)
    if m.version < 3:
        raise FormatError(f"{manifest}: only format version 3 and 4 corpora are read from object storage; rebuild it")
    root, base = m.corpus_root, dest.rstrip("/")
    expect = ShardExpectation.of(m.tokenizer, m.chunk_tokens, m.dtype, m.version)
    fs = filesystem(base, opts)
    journal = _journal_path(Path(manifest).absolute())
    done = _load_journal(journal, base)
    files: dict[str, str] = {}  # entry path -> whole-file sha256, for the published manifest
    rep = UploadReport(base + "/" + Path(os.path.relpath(m.path, root)).as_posix(), len(m.shards), 0, 0, 0)  # type: ignore[arg-type]
    for e in m.shards:
        local = m.shard_path_str(e)
        url = base + "/" + Path(os.path.relpath(local, root)).as_posix()
        where = f"{redact(url)}: shard {e.path}"
        prior = done.get(url)
        if prior and prior[0] == e.sha256 and _uploaded(fs, url, e, opts, where):
            files[e.path] = prior[1]
            rep.skipped += 1
            continue
        files[e.path] = _check_local(local, e, expect)
        if e.docs_path is not None:  # the sidecar first: a shard is never published without it
            side, side_url = str(docs_path(local)), url + (e.docs_path[len(e.path) :])
            _check_docs(side, e)
            with_retries(lambda p=side, u=side_url: fs.put_file(p, fs_path(u)), opts, f"{where} (sidecar)")
            rep.bytes_uploaded += e.docs_bytes
        with_retries(lambda p=local, u=url: fs.put_file(p, fs_path(u)), opts, where)
        done[url] = [e.sha256, files[e.path]]
        write_json_atomic(journal, {"dest": redact(base), "done": done})
        rep.uploaded += 1
        rep.bytes_uploaded += e.bytes
        if progress is not None:
            progress(f"uploaded {e.path} ({e.bytes:,} bytes)")
    data = published_manifest(m.path, files)  # type: ignore[arg-type]
    with_retries(lambda: fs.pipe_file(fs_path(rep.manifest_url), data), opts, f"{redact(rep.manifest_url)}: manifest")
    journal.unlink(missing_ok=True)
    return rep


def _uploaded(fs: Any, url: str, e: ShardRecord, opts: RemoteOptions, where: str) -> bool:
    """The shard's object (and, version 4, its sidecar's) is there with the listed size."""
    if with_retries(lambda: _remote_size(fs, url), opts, where) != e.bytes:
        return False
    if e.docs_path is None:
        return True
    side = url + e.docs_path[len(e.path) :]
    return with_retries(lambda: _remote_size(fs, side), opts, f"{where} (sidecar)") == e.docs_bytes


def _check_docs(path: str, e: ShardRecord) -> None:
    """Refuse to publish a sidecar that is not what the manifest proves (missing, corrupt, another shard's)."""
    try:
        with open(path, "rb") as fh:
            bad = docs_problems(fh.read(e.docs_bytes + 1), e)
    except FileNotFoundError:
        raise FormatError(f"{path}: the document sidecar of shard {e.path} is missing; not uploaded") from None
    if bad:
        raise FormatError(f"{path}: {bad[0].message}; not uploaded (run h5corpus validate)")


def _remote_size(fs: Any, url: str) -> int | None:
    try:
        return int(fs.size(fs_path(url)))
    except FileNotFoundError:
        return None


def _check_local(path: str, e: ShardRecord, expect: ShardExpectation) -> str:
    """Refuse to publish a shard that is not what its manifest entry says; returns the file's
    sha256 (hashed first: the check then reads it from the page cache)."""
    digest = file_sha256(path)
    problem = verify_shard(path, e, expect)
    if problem:
        raise FormatError(f"{path}: {problem}; not uploaded (run h5corpus validate)")
    return digest


__all__ = ["RemoteError", "UploadReport", "upload_corpus"]
