"""The node-local cache of remote shards, shared by every process on a node (docs/READING.md,
"Corpora on object storage").

Layout: ``<cache_dir>/<key>/`` mirrors one manifest (``key`` names its URL and its bytes): the
manifest's copy at ``<key>/<folder>/<name>.json`` and each shard at the path the manifest gives it,
so the reader opens cached shards as it opens local ones. Beside each shard ``<shard>.lock`` (its
download lock; its mtime is the shard's last use) and, while it downloads, ``<shard>.download``.

* **Downloaded once, never served unverified.** A process takes the shard's lock
  (``fcntl.flock``), downloads into ``<shard>.download`` (resuming the bytes a killed process
  left), checks size and sha256 against the manifest, and only then renames it into place; a
  process that wanted the same shard waits on the lock, then finds it there. A file at a shard's
  name is therefore always whole and proven; a ``.download`` is never opened as a shard.
* **Leases.** A reader holds a shared lock (``LOCK_SH``) on the cached file while its corpus has
  the shard open (:class:`Lease`); eviction takes ``LOCK_EX | LOCK_NB``, so it skips any shard a
  live reader holds. A lease is taken on the ``.download`` file before the rename, so no eviction
  can slip between download and first use.
* **Bounded.** Before a download, shards are evicted least recently used first until the cache
  fits ``cache_limit`` with every download in flight counted at its full size (each writes its
  byte count into its lock file while it runs, so concurrent downloads make room for each other). Leased shards are never evicted: the cache exceeds the
  limit by at most the shards readers hold open at once (a corpus whose split does not fit keeps
  few open per process, :meth:`RemoteShards.open_cap`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .format import FormatError, ShardExpectation, ShardRecord, docs_problems, file_sha256
from .remote import RemoteError, RemoteOptions, filesystem, fs_path, join_url, redact, with_retries

LOCK_SUFFIX = ".lock"
DOWNLOAD_SUFFIX = ".download"
_EVICT_LOCK = ".evict.lock"
#: bytes per read when a download resumes (a fresh one uses the backend's own whole-object copy)
RESUME_BLOCK = 16 << 20


class Lease:
    """A shared lock on one cached shard file: while any process holds one, no process evicts it.
    :meth:`release` (or garbage collection) closes the descriptor; a forked child closing its copy
    leaves the parent's lock in place (flock locks belong to the open file, not the process)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.release()
        except OSError:
            pass


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def take_lease(path: str) -> Lease | None:
    """A lease on the cached shard at ``path``, or None when it is not (or no longer) there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an eviction holds it
    if not _same_file(fd, path):  # evicted between open and lock
        os.close(fd)
        return None
    return Lease(fd, path)


def _locked(path: str) -> int:
    """An exclusive flock on ``path`` (created if missing), waiting for it; returns the fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def verify_shard(path: str, entry: ShardRecord, expect: ShardExpectation) -> str:
    """ "" when the shard file at ``path`` is what ``entry`` says (size, attributes, index, every
    checksum, the sha256 of its tokens and of its index: ``h5corpus validate``'s checks of one
    shard), else the first problem found."""
    from .validate import check_shard  # the validator's one-shard check; imported when needed

    findings, _ = check_shard(path, entry, expect, sidecar=False)  # a sidecar is fetched (and proven) apart
    return "" if not findings else f"{findings[0].code}: {findings[0].message}"


def prove_by_checksums(path: str, entry: ShardRecord, expect: ShardExpectation) -> str:
    """ "" when the shard at ``path`` proves itself through the reader's trust chain, eagerly: its
    size, attributes and datasets, both checksum tables against the manifest's ``sums_sha256``,
    and every ``/tokens`` and ``/doc_offsets`` chunk against its xxh3-64 checksum (ids and flags
    are proven against ``index_sha256`` when read); else the first problem found."""
    from . import format as fmt
    from .readpaths import h5open, read_checksums

    if _size(path) != entry.bytes:
        return f"size: file is {_size(path):,} bytes, manifest says {entry.bytes:,}"
    try:
        with h5open(path) as f:
            ds = {k: f.get(k) for k in fmt.datasets_of(expect.version)}
            problems = expect.attr_problems(fmt.check_attrs(f.attrs, path), entry.split)
            problems += fmt.dataset_problems(ds, expect)
            if not problems and ds[fmt.TOKENS].shape[0] != entry.tokens:
                problems.append(fmt.Problem("tokens", f"/tokens holds {ds[fmt.TOKENS].shape[0]:,} tokens"))
            if not problems:
                problems += fmt.v3_index_layout_problems(ds, entry.tokens, entry.documents, expect.chunk_tokens)
            if problems:
                return f"{problems[0].code}: {problems[0].message}"
            sums, osums = read_checksums(ds[fmt.CHUNK_CHECKSUMS]), read_checksums(ds[fmt.OFFSETS_CHECKSUMS])
            if fmt.sums_sha256(sums, osums) != entry.sums_sha256:
                return "sums_sha256: the checksum tables differ from the manifest's sums_sha256"
            for name, n, chunk, table in (
                (fmt.TOKENS, entry.tokens, expect.chunk_tokens, sums),
                (fmt.DOC_OFFSETS, entry.documents + 1, fmt.OFFSETS_CHUNK_V3, osums),
            ):
                k = _first_bad_chunk(ds[name], n, chunk, table)
                if k >= 0:
                    return f"chunk_checksum: /{name} chunk {k:,} fails its checksum"
    except (OSError, KeyError, ValueError, RuntimeError) as e:  # RuntimeError: corrupt HDF5 metadata
        return f"unreadable: {e}"
    return ""


def _first_bad_chunk(ds: Any, n: int, chunk: int, table: Any) -> int:
    """The first chunk of ``ds[:n]`` whose xxh3-64 differs from ``table``, or -1. Chunks stored
    raw are hashed in place through a memory map of the file (no copy); others are read by HDF5."""
    import mmap

    import numpy as np

    from . import format as fmt

    path = ds.file.filename
    layout, _ = fmt.chunk_byte_layout(ds, n, os.path.getsize(path))
    mm = None
    if layout is not None and n:
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        for k in range(-(-n // chunk)):
            a, b = k * chunk, min((k + 1) * chunk, n)
            if mm is not None and int(layout[k]) >= 0:
                view = np.frombuffer(mm, dtype=ds.dtype, count=b - a, offset=int(layout[k]))
            else:
                view = np.empty(b - a, dtype=ds.dtype)
                ds.read_direct(view, source_sel=np.s_[a:b])
            ok = fmt.chunk_checksum(view) == int(table[k])
            del view
            if not ok:
                return k
    finally:
        if mm is not None:
            mm.close()
    return -1


#: how a downloaded shard is proven before it is renamed into place (``RemoteOptions.proof``)
PROOFS = {"sha256": verify_shard, "checksums": prove_by_checksums}


#: bytes the hashing thread of a download reads from its file at a time
HASH_BLOCK = 4 << 20
#: writes (s3fs: 64 KiB each) after which a download's hashing thread is woken
POKES_PER_WAKE = 32


class StreamHash:
    """The sha256 of a file hashed *while* another thread writes it front to back (a download):
    a thread reads each block once it has landed (from the page cache; hashlib releases the GIL)
    so that the whole-file proof costs no pass after the download. The writer calls :meth:`poke`
    after each write (the backend's progress callback); the thread wakes every
    :data:`POKES_PER_WAKE` pokes (or 50 ms, for a backend that reports none). A poke with the
    backend's byte count (fsspec's callback hooks: ``poke(size, value)``) bounds what the thread
    reads to the bytes written so far, so a file sized before its bytes arrive (s3fs's concurrent
    ranged parts, written in offset order once fetched) is hashed as its parts land, never its
    zeros. :meth:`finish`, once the writer is done, returns (hex digest, bytes hashed). A writer
    that writes out of order or replaces the file makes the digest differ:
    :func:`prove_by_file_hash` then hashes the finished file once before it refuses anything."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._h, self._n, self._error, self._pokes, self._finished = hashlib.sha256(), 0, False, 0, False
        self._written: int | None = None  # bytes the writer reported written (None: read to the end)
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="h5c-hash", daemon=True)
        self._thread.start()

    def poke(self, size: Any = None, value: Any = None, **_: Any) -> None:
        if isinstance(value, int):
            self._written = value
        self._pokes += 1
        if self._pokes % POKES_PER_WAKE == 0:
            with self._wake:
                self._wake.notify()

    def _run(self) -> None:
        buf = bytearray(HASH_BLOCK)
        view = memoryview(buf)
        try:
            while True:
                finished = self._finished  # read once more after the writer is done
                limit = None if finished else self._written
                want = HASH_BLOCK if limit is None else min(HASH_BLOCK, limit - self._n)
                got = os.preadv(self._fd, [view[:want]], self._n) if want > 0 else 0
                if got:
                    self._h.update(view[:got])
                    self._n += got
                elif finished:
                    return
                else:
                    with self._wake:
                        if not self._finished:
                            self._wake.wait(0.05)
        except OSError:
            self._error = True

    def finish(self) -> tuple[str, int]:
        with self._wake:
            self._finished = True
            self._wake.notify()
        self._thread.join()
        os.close(self._fd)
        return ("" if self._error else self._h.hexdigest()), self._n


def prove_by_file_hash(path: str, entry: ShardRecord, streamed: str) -> str:
    """ "" when the file at ``path`` has the manifest's size and whole-file sha256
    (``file_sha256``); ``streamed`` is the digest taken during the download (re-hashed from the
    file once when it differs); else the problem."""
    if _size(path) != entry.bytes:
        return f"size: file is {_size(path):,} bytes, manifest says {entry.bytes:,}"
    got = streamed if streamed == entry.file_sha256 else file_sha256(path)
    if got != entry.file_sha256:
        return f"file_sha256: file hash {got[:12]}... differs from the manifest's {str(entry.file_sha256)[:12]}..."
    return ""


class ShardCache:
    """The cache folder of a node: eviction under a byte limit (module docstring)."""

    def __init__(self, root: str | os.PathLike[str], limit: int | None) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"cache_limit must be >= 0 bytes, got {limit}")
        self.root, self.limit = Path(root).absolute(), limit

    def entries(self) -> tuple[list[tuple[float, int, str]], int]:
        """(last use, bytes, path) of every cached shard, and the bytes of cache in use (cached
        shards and downloads in progress)."""
        cached, total = [], 0
        for folder, _dirs, files in os.walk(self.root):
            names = set(files)
            for name in files:
                p = os.path.join(folder, name)
                try:
                    if name.endswith(DOWNLOAD_SUFFIX):  # in flight: its reservation, or what it holds
                        lock = p[: -len(DOWNLOAD_SUFFIX)] + LOCK_SUFFIX
                        total += max(os.path.getsize(p), _reservation(lock))
                    elif name + LOCK_SUFFIX in names:
                        size = os.path.getsize(p)
                        total += size
                        cached.append((os.path.getmtime(p + LOCK_SUFFIX), size, p))
                except FileNotFoundError:  # evicted or renamed meanwhile
                    continue
        return cached, total

    def make_room(self, need: int) -> None:
        """Evict least recently used shards no reader holds until ``need`` more bytes fit the
        limit, counting every download in flight at its full size (its reservation); when nothing
        more can go (leased shards stay) the cache runs over."""
        if self.limit is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        gate = _locked(str(self.root / _EVICT_LOCK))
        try:
            cached, total = self.entries()
            for _, size, path in sorted(cached):
                if total + need <= self.limit:
                    break
                if _evict(path):
                    total -= size
        finally:
            os.close(gate)

    def used_bytes(self) -> int:
        return self.entries()[1]


def _evict(path: str) -> bool:
    """Remove a cached shard unless a reader holds a lease on it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    try:
        if _same_file(fd, path):
            os.unlink(path)
            return True
        return False
    finally:
        os.close(fd)


class RemoteShards:
    """The shards of one remote manifest, fetched into a :class:`ShardCache` on demand: what a
    :class:`~h5corpus.storage.reader.Corpus` calls where it maps a shard to the file it opens.
    Pickles as its settings; each process makes its own filesystem and prefetch threads."""

    def __init__(
        self, manifest_url: str, cache: ShardCache, options: RemoteOptions, split_bytes: int, expect: ShardExpectation
    ) -> None:
        self.url, self.cache, self.options = manifest_url, cache, options
        #: what every shard of the manifest must be (attributes, dtypes, chunking, version)
        self.expect = expect
        #: bytes of the split's shards: whether the whole split fits the cache
        self.split_bytes = split_bytes
        self._local: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_local"] = {}
        return d

    def _state(self) -> dict[str, Any]:
        """This process's filesystem, prefetch pool and in-flight prefetches."""
        if self._local.get("pid") != os.getpid():
            self._local = {"pid": os.getpid(), "lock": threading.Lock(), "inflight": {}}
        return self._local

    def fs(self) -> Any:
        st = self._state()
        with st["lock"]:
            if "fs" not in st:
                st["fs"] = filesystem(self.url, self.options)
            return st["fs"]

    def fits(self) -> bool:
        """The whole split fits the cache limit (then a corpus may keep every shard open)."""
        return self.cache.limit is None or self.split_bytes <= self.cache.limit

    def open_cap(self, default: int, largest: int) -> int:
        """Shards one process keeps open: ``default`` when the split fits the cache, else as many
        as a quarter of the limit holds (at least 1), so that a few readers leave room to evict."""
        if self.fits() or self.cache.limit is None:
            return default
        return max(1, min(default, self.cache.limit // max(4 * largest, 1)))

    def shard_url(self, entry: ShardRecord) -> str:
        return join_url(self.url, entry.path)

    # -- fetching ---------------------------------------------------------------------------------
    def acquire(self, entry: ShardRecord, local: str) -> Lease:
        """A lease on ``entry``'s cached file at ``local``, downloading (and verifying) it first
        when it is not cached; :class:`RemoteError` naming the URL and the shard otherwise."""
        for _ in range(16):
            lease = take_lease(local)
            if lease is None:
                lease = self._download(entry, local)
            if lease is not None:
                _touch(local + LOCK_SUFFIX)
                return lease
        raise RemoteError(
            f"{redact(self.shard_url(entry))}: shard {entry.path}: evicted again and again (cache too small?)"
        )

    def _download(self, entry: ShardRecord, local: str) -> Lease | None:
        """Under the shard's lock: the lease of a copy another process finished meanwhile, or
        download, verify, lease and rename into place."""
        os.makedirs(os.path.dirname(local), exist_ok=True)
        gate = _locked(local + LOCK_SUFFIX)
        try:
            lease = take_lease(local)
            if lease is not None:
                return lease
            part = local + DOWNLOAD_SUFFIX
            os.ftruncate(gate, 0)  # reserve the shard's bytes: concurrent downloads make room for each other
            os.pwrite(gate, str(entry.bytes).encode(), 0)
            open(part, "ab").close()
            self.cache.make_room(0)
            url = self.shard_url(entry)
            where = f"{redact(url)}: shard {entry.path}"
            resumed = _size(part) > 0
            try:
                fd, problem = self._fetch_verified(url, part, entry, where)
                if fd is None and resumed:  # the bytes kept from a killed download were stale: once afresh
                    fd, problem = self._fetch_verified(url, part, entry, where)
            except Exception:  # a failure we report leaves nothing half-written (a kill leaves a resumable part)
                _unlink(part)
                raise
            if fd is None:
                raise RemoteError(f"{where}: the downloaded bytes differ from the manifest ({problem}); refused")
            os.replace(part, local)
            return Lease(fd, local)
        finally:
            os.ftruncate(gate, 0)
            os.close(gate)

    def _fetch_verified(self, url: str, part: str, entry: ShardRecord, where: str) -> tuple[int | None, str]:
        """Download (or finish) ``part``; (a shared-locked fd on it, "") when it holds what the
        manifest says, else (None, the first problem) with ``part`` removed. A manifest entry with
        ``file_sha256`` is proven by the whole file's sha256, hashed while the bytes arrive
        (:class:`StreamHash`); one without it by ``RemoteOptions.proof`` (:data:`PROOFS`)."""
        fs, path = self.fs(), fs_path(url)
        if _size(part) > entry.bytes:  # not a prefix of the shard: start afresh
            os.unlink(part)
        open(part, "ab").close()
        streaming = StreamHash(part) if entry.file_sha256 else None
        try:
            poke = streaming.poke if streaming is not None else None
            with_retries(lambda: _transfer(fs, path, part, entry.bytes, poke), self.options, where)
        finally:
            streamed = streaming.finish()[0] if streaming is not None else ""
        fd = os.open(part, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH)
        if entry.file_sha256:  # proven as it arrived; else by the fallback proofs
            problem = prove_by_file_hash(part, entry, streamed)
        else:
            problem = PROOFS[self.options.proof](part, entry, self.expect)
        if not problem:
            return fd, ""
        os.close(fd)
        os.unlink(part)
        return None, problem

    def acquire_docs(self, entry: ShardRecord, local: str) -> None:
        """Bring a version 4 shard's sidecar (``<shard>.docs``: its ids and flags) into the cache at
        ``local`` unless it is there: downloaded under its own lock into ``<local>.download``,
        proven against the manifest (``docs_sha256``, its binding to the shard) and only then
        renamed into place. Fetched only when ids or flags are asked for, never to serve tokens;
        a few hundredths of its shard's size, it is evicted like a shard. :class:`RemoteError`
        naming the URL and the shard when it cannot be fetched or is not what the manifest proves."""
        if entry.docs_path is None or os.path.exists(local):
            return
        os.makedirs(os.path.dirname(local), exist_ok=True)
        gate = _locked(local + LOCK_SUFFIX)
        try:
            if os.path.exists(local):
                return
            part, url = local + DOWNLOAD_SUFFIX, join_url(self.url, entry.docs_path)
            where = f"{redact(url)}: document sidecar of shard {entry.path}"
            _unlink(part)
            with_retries(lambda: _transfer(self.fs(), fs_path(url), part, entry.docs_bytes), self.options, where)
            with open(part, "rb") as fh:
                bad = docs_problems(fh.read(entry.docs_bytes + 1), entry)
            if bad:
                _unlink(part)
                raise RemoteError(f"{where}: the downloaded bytes differ from the manifest ({bad[0].message}); refused")
            os.replace(part, local)
        finally:
            os.close(gate)

    def prefetch(self, items: list[tuple[ShardRecord, str]]) -> None:
        """Start downloading the shards not cached yet in the background (at most
        ``prefetch_workers`` at once per process); failures surface when a read needs the shard."""
        st = self._state()
        for entry, local in items:
            if os.path.exists(local) or local in st["inflight"]:
                continue
            if len(st["inflight"]) >= 4 * self.options.prefetch_workers:
                break
            pool = st.get("pool")
            if pool is None:
                pool = st["pool"] = ThreadPoolExecutor(self.options.prefetch_workers, thread_name_prefix="h5c-fetch")
            fut = pool.submit(self._quiet_fetch, entry, local)
            st["inflight"][local] = fut
            fut.add_done_callback(lambda _f, k=local, d=st["inflight"]: d.pop(k, None))

    def _quiet_fetch(self, entry: ShardRecord, local: str) -> None:
        try:
            self.acquire(entry, local).release()
        except Exception:  # noqa: BLE001 - the read that needs the shard raises it
            pass

    def fetch_all(self, items: list[tuple[ShardRecord, str]]) -> None:
        """Download every shard of ``items`` not cached yet, ``prefetch_workers`` at once, and
        wait; raises the first failure. Processes start at different shards (by pid) so that
        several fetching one corpus share the work instead of queueing on the same locks."""
        if not items:
            return
        k = os.getpid() % len(items)
        order = items[k:] + items[:k]
        with ThreadPoolExecutor(self.options.prefetch_workers, thread_name_prefix="h5c-fetch") as pool:
            futs: list[Future] = [pool.submit(self.acquire, e, p) for e, p in order if not os.path.exists(p)]
            for f in futs:
                f.result().release()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _reservation(lock: str) -> int:
    """Bytes a download in flight reserved (written in its lock file), 0 if none."""
    try:
        with open(lock, "rb") as fh:
            return int(fh.read(32) or 0)
    except (OSError, ValueError):
        return 0


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _transfer(fs: Any, path: str, part: str, size: int, poke: Callable[..., None] | None = None) -> None:
    """Bring ``part`` to ``size`` bytes of the object: the backend's whole-object copy when
    nothing is there yet, else ranged reads from where it stops (a resumed download);
    ``poke()`` after each write (:class:`StreamHash`)."""
    from fsspec.callbacks import Callback

    have = _size(part)
    if have > size:
        os.unlink(part)
        have = 0
    if have == 0:
        fs.get_file(path, part, callback=Callback(hooks={"hash": poke}) if poke is not None else Callback())
        return
    if have == size:
        return
    sized = {"size": size} if path.startswith(("http://", "https://")) else {}  # no HEAD probe over HTTP
    with fs.open(path, "rb", block_size=RESUME_BLOCK, cache_type="none", **sized) as src, open(part, "ab") as out:
        src.seek(have)
        while block := src.read(RESUME_BLOCK):
            out.write(block)
            out.flush()
            if poke is not None:
                poke()


def default_cache_dir() -> Path:
    """``$H5CORPUS_REMOTE_CACHE``, else ``~/.cache/h5corpus/remote`` (put it on a node-local disk)."""
    env = os.environ.get("H5CORPUS_REMOTE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "h5corpus" / "remote"


def open_remote_manifest(
    url: str, split: str, cache_dir: str | os.PathLike[str] | None, cache_limit: int | None, options: RemoteOptions
) -> tuple[Any, RemoteShards]:
    """Fetch, copy into the cache and check the manifest at ``url``; returns the parsed
    :class:`~h5corpus.storage.manifest.Manifest` (its path: the copy, so shard paths resolve into
    the cache) and the :class:`RemoteShards` that fetch ``split``'s shards."""
    from .manifest import MAX_MANIFEST_BYTES, read_manifest

    cache = ShardCache(cache_dir if cache_dir is not None else default_cache_dir(), cache_limit)
    fs, shown = filesystem(url, options), redact(url)

    # one GET (fsspec's HTTP size probe reports a time-out as "not found")
    data = with_retries(lambda: fs.cat_file(fs_path(url)), options, f"{shown}: manifest")
    if len(data) > MAX_MANIFEST_BYTES:
        raise RemoteError(f"{shown}: {len(data):,} bytes is too large for a manifest")
    key = hashlib.sha256(f"{shown}\0{hashlib.sha256(data).hexdigest()}".encode()).hexdigest()[:24]
    parts = url.split("?", 1)[0].rstrip("/").split("/")
    local = cache.root / key / (parts[-2] if len(parts) > 3 else "manifests") / parts[-1]
    if not local.exists():
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, local)
    try:
        m = read_manifest(local, compact=True)
    except FormatError as e:  # name the URL, not the cache's copy
        raise FormatError(str(e).replace(str(local), shown)) from None
    split_bytes = sum(e.bytes for e in m.shards_of(split))
    expect = ShardExpectation.of(m.tokenizer, m.chunk_tokens, m.dtype, m.version)
    shards = RemoteShards(url, cache, options, split_bytes, expect)
    shards._state()["fs"] = fs  # this process's client, already connected (making one costs ~0.1 s)
    return m, shards
