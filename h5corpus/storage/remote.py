"""Object storage through fsspec: URLs, one filesystem per process, transfers with time-outs,
bounded retries and one-line errors (docs/READING.md, "Corpora on object storage").

Schemes and the maintained fsspec backend each needs (installed by an extra, imported lazily):
``s3://`` (s3fs, ``h5corpus[s3]``), ``gs://`` (gcsfs, ``h5corpus[gcs]``), ``az://`` / ``abfs://``
(adlfs, ``h5corpus[azure]``), ``hf://`` (huggingface_hub's ``HfFileSystem``, ``h5corpus[hf]``),
``http://`` / ``https://`` (aiohttp, ``h5corpus[remote]``). Credentials come only from each
backend's own configuration (environment variables, profiles, token files) or the caller's
``storage_options``; no message this module makes ever holds them (:func:`redact`).
"""

from __future__ import annotations

import os
import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .format import FormatError

#: scheme -> (fsspec protocol, the module its backend needs, the extra that installs it)
SCHEMES: dict[str, tuple[str, str, str]] = {
    "s3": ("s3", "s3fs", "s3"),
    "gs": ("gs", "gcsfs", "gcs"),
    "gcs": ("gs", "gcsfs", "gcs"),
    "az": ("az", "adlfs", "azure"),
    "abfs": ("abfs", "adlfs", "azure"),
    "hf": ("hf", "huggingface_hub", "hf"),
    "http": ("http", "aiohttp", "remote"),
    "https": ("https", "aiohttp", "remote"),
}

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")
_QUERY = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s?#]*)[?#][^\s'\"]*")
T = TypeVar("T")


class RemoteError(FormatError):
    """A corpus on object storage cannot be read or written: a missing bucket or object, a denied
    request, a time-out, or bytes that differ from the manifest. The message is one line naming
    the URL (credentials removed) and the shard."""


def is_remote(path: Any) -> bool:
    """True when ``path`` is a URL of a scheme in :data:`SCHEMES`."""
    m = _URL.match(str(path)) if isinstance(path, (str, os.PathLike)) else None
    return m is not None and m.group(1).lower() in SCHEMES


def redact(text: str) -> str:
    """``text`` with the user-info (``user:secret@``) and query string (signatures, tokens) of
    every URL in it removed."""
    return _QUERY.sub(r"\1", _USERINFO.sub(r"\1", text))


def join_url(base_url: str, relative: str) -> str:
    """``relative`` (a POSIX path) resolved against the folder of ``base_url``."""
    m = _URL.match(base_url)
    if m is None:
        raise ValueError(f"{base_url!r} is not a URL")
    head, rest = base_url[: m.end()], base_url[m.end() :].split("?", 1)[0]
    return head + posixpath.normpath(posixpath.join(posixpath.dirname(rest), relative))


@dataclass(frozen=True)
class RemoteOptions:
    """How a process talks to object storage.

    ``timeout_s``: connect and per-read time-out of every request (a stalled server fails after it
    instead of hanging); ``retries``: attempts per transfer after the first, with exponential
    back-off from ``backoff_s`` (a partial download resumes where it stopped);
    ``prefetch_workers``: shards downloaded at once per process; ``storage_options``: extra keyword
    arguments for the fsspec backend (e.g. ``endpoint_url``); they are never logged or shown;
    ``proof``: how a downloaded shard is proven before it is renamed into place: ``"sha256"``
    (``h5corpus validate``'s checks of the shard: the sha256 of its tokens and of its index) or
    ``"checksums"`` (the reader's trust chain, eagerly: the checksum tables against the manifest's
    ``sums_sha256``, every chunk against its xxh3-64; about 5x cheaper)."""

    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 0.5
    prefetch_workers: int = 8
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    proof: str = "sha256"

    def __post_init__(self) -> None:
        if self.proof not in ("sha256", "checksums"):
            raise ValueError(f"proof must be 'sha256' or 'checksums', got {self.proof!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.retries < 0 or self.prefetch_workers < 1:
            raise ValueError("retries must be >= 0 and prefetch_workers >= 1")


def _backend_options(protocol: str, opts: RemoteOptions) -> dict[str, Any]:
    """Time-outs (and no hidden retry loop: :func:`with_retries` owns retries) per backend."""
    t = opts.timeout_s
    kw: dict[str, Any] = {}
    if protocol == "s3":
        kw["config_kwargs"] = {"connect_timeout": t, "read_timeout": t, "retries": {"max_attempts": 1}}
    elif protocol in ("http", "https"):
        import aiohttp

        kw["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t)}
    kw.update(opts.storage_options)
    return kw


def filesystem(url: str, opts: RemoteOptions) -> Any:
    """A new fsspec filesystem for ``url``'s scheme (the caller keeps one per process);
    ImportError naming the extra to install when its backend is missing."""
    scheme = _URL.match(url).group(1).lower()  # type: ignore[union-attr]
    protocol, module, extra = SCHEMES[scheme]
    try:
        __import__(module)
        import fsspec
    except ImportError:
        raise ImportError(f"{scheme}:// corpora need the {module} package: pip install 'h5corpus[{extra}]'") from None
    fs = fsspec.filesystem(protocol, skip_instance_cache=True, **_backend_options(protocol, opts))
    if protocol == "s3":
        fs.retries = 1  # s3fs's own loop would retry a stalled read 5 times; ours bounds it
    return fs


def fs_path(url: str) -> str:
    """The path an fsspec filesystem takes for ``url`` (HTTP keeps the whole URL)."""
    m = _URL.match(url)
    assert m is not None
    return url if m.group(1).lower() in ("http", "https") else url[m.end() :]


def _denied(e: BaseException) -> bool:
    """A refusal: PermissionError (s3fs, gcsfs), HTTP 401/403 (aiohttp), AccessDenied (botocore)."""
    return isinstance(e, PermissionError) or getattr(e, "status", None) in (401, 403) or "AccessDenied" in str(e)


def describe_failure(e: BaseException, timeout_s: float) -> str:
    """One phrase for a failed request (never the credentials the backend used)."""
    name = type(e).__name__
    text = redact(str(e).splitlines()[0] if str(e) else "")
    if isinstance(e, FileNotFoundError):
        return "not found (no such bucket or object)"
    if _denied(e):
        return "access denied (check the backend's credentials: environment or profile)"
    if isinstance(e, TimeoutError) or "timeout" in name.lower() or "timed out" in text.lower():
        return f"timed out (no answer within {timeout_s:g} s)"
    return f"failed ({name}: {text[:200]})" if text else f"failed ({name})"


def retryable(e: BaseException) -> bool:
    """Worth another attempt: not a missing object or a refusal."""
    return not (isinstance(e, (FileNotFoundError, IsADirectoryError, RemoteError)) or _denied(e))


def with_retries(call: Callable[[], T], opts: RemoteOptions, what: str) -> T:
    """``call()`` with up to ``opts.retries`` more attempts (back-off ``backoff_s * 2**i``) for
    transient failures; :class:`RemoteError` ``"<what>: <why>"`` once attempts are spent."""
    attempt = 0
    while True:
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - backends raise many types; all become one line
            if isinstance(e, RemoteError):
                raise
            if not retryable(e) or attempt >= opts.retries:
                tries = f" after {attempt + 1} attempts" if attempt else ""
                raise RemoteError(f"{what}: {describe_failure(e, opts.timeout_s)}{tries}") from None
            time.sleep(opts.backoff_s * (2**attempt))
            attempt += 1
