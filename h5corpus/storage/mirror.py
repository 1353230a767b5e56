"""A whole remote corpus brought into the node cache, for the commands that read every shard:
``h5corpus validate`` and ``h5corpus inspect`` given a manifest URL (docs/READING.md, "Corpora on
object storage").

Every shard of every split is fetched through the same :class:`~h5corpus.storage.cache.RemoteShards`
a reader uses (once per node, proven before its rename, ``prefetch_workers`` at once), so the
commands then run on the cached copies exactly as on a local corpus. No ``cache_limit``: the
commands need every shard at once.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from .cache import open_remote_manifest
from .format import docs_path
from .remote import RemoteError, RemoteOptions, redact
from .validate import Finding, ValidationReport, validate_corpus


def mirror_corpus(
    url: str, cache_dir: str | os.PathLike[str] | None = None, options: RemoteOptions | None = None
) -> tuple[Path, dict[str, str]]:
    """Fetch the manifest at ``url`` and every shard it lists (and, version 4, its sidecar) into the cache; returns the path of
    the manifest's cached copy (its shard paths resolve into the cache) and, per shard that could
    not be fetched or was refused, its manifest path -> the one-line reason. Raises
    :class:`RemoteError` / :class:`~h5corpus.storage.format.FormatError` for the manifest itself."""
    opts = options if options is not None else RemoteOptions()
    m, shards = open_remote_manifest(url, "train", cache_dir, None, opts)
    failures: dict[str, str] = {}
    with ThreadPoolExecutor(opts.prefetch_workers, thread_name_prefix="h5c-fetch") as pool:
        futs = {pool.submit(shards.acquire, e, m.shard_path_str(e)): e for e in m.shards}
        for f in as_completed(futs):
            try:
                f.result().release()
            except RemoteError as e:
                failures[futs[f].path] = str(e)
        sides = {pool.submit(shards.acquire_docs, e, str(docs_path(m.shard_path_str(e)))): e for e in m.shards}
        for f in as_completed(sides):  # version 4: each shard's ids and flags (validate checks them)
            try:
                f.result()
            except RemoteError as e:
                failures.setdefault(sides[f].path, str(e))
    assert m.path is not None
    return Path(m.path), failures


def validate_remote(
    url: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    options: RemoteOptions | None = None,
    workers: int | None = None,
    deep: bool = False,
) -> ValidationReport:
    """:func:`~h5corpus.storage.validate.validate_corpus` of the corpus at ``url``, on its copies
    in the node cache; a shard that cannot be fetched or whose download was refused (its bytes
    differ from the manifest) is a ``download`` finding naming the URL."""
    local, failures = mirror_corpus(url, cache_dir, options)
    report = validate_corpus(local, workers=workers, deep=deep)
    report.manifest = redact(url)
    report.findings = [f for f in report.findings if not (f.shard in failures and f.code == "missing")]
    report.findings += [Finding(s, "download", msg) for s, msg in failures.items()]
    report.findings.sort(key=lambda f: (f.shard or "", f.code))
    return report
