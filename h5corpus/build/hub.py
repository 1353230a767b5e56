"""Where the Hugging Face hub cache is and whether the hub may be asked: shared by the tokenizer
(``gpt2`` from the cache) and the sources (``hf://`` specs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit


def hf_cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The Hugging Face hub cache: ``explicit``, else ``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
    ``~/.cache/huggingface/hub`` (read at call time, so tests and callers can redirect it)."""
    if explicit is not None:
        return Path(explicit)
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE says not to ask the hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


#: Seconds the network probe of :func:`hub_unreachable` may take (name lookup plus connect).
HUB_PROBE_TIMEOUT_S = 3.0


#: The probe :func:`hub_unreachable` runs in a child interpreter: connect to argv[1]:argv[2] within
#: argv[3] seconds; exit 0 when connected, else print why and exit 1.
_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError as e:
    print(e.strerror or e)
    sys.exit(1)
"""


def hub_unreachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str:
    """Why the Hugging Face hub (``$HF_ENDPOINT``, or the HTTPS proxy when one is set) cannot be
    reached, or "" when a TCP connection to it opens within ``timeout_s`` (name lookup included).
    The probe runs in a child process, killed at the limit: a name lookup that hangs (no route to
    the resolver) cannot be interrupted in a thread, and a thread left in it aborts the process at
    exit (``FATAL: exception not rethrown``)."""
    proxy = next(
        (os.environ[k] for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy") if os.environ.get(k)), ""
    )
    url = urlsplit(
        proxy
        if "://" in proxy
        else (f"http://{proxy}" if proxy else os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    )
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    cmd = [sys.executable, "-I", "-S", "-c", _PROBE, host, str(port), str(timeout_s)]
    try:
        # the child's own limit covers lookup and connect; one more second for it to start
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 1.0, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"{'proxy ' if proxy else ''}{host}:{port}: no answer within {timeout_s + 1.0:g} s"
    except OSError as e:
        return f"cannot run the network probe ({e.strerror or e})"
    if p.returncode == 0:
        return ""
    return f"{'proxy ' if proxy else ''}{host}:{port}: {p.stdout.strip() or 'no connection'}"
