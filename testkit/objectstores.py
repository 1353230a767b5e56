"""Real object-storage servers on loopback for the remote-corpus tests and bench (no mocks).

* :class:`MotoS3`: moto's standalone S3-protocol server (``moto_server`` from ``moto[server]``)
  on a free loopback port; :meth:`MotoS3.gets` counts the GETs it served per object from its
  request log. :meth:`MotoS3.env` is the standard AWS configuration (endpoint, dummy keys) a
  client process needs: credentials reach s3fs only through the environment, as in production.
* :class:`Nginx`: Debian's nginx as a non-daemon with a config written here, serving a folder
  over HTTP on a free loopback port (optionally rate-limited, to catch a download in flight);
  :meth:`Nginx.gets` counts GETs per path from its access log.
* :class:`StallServer`: a TCP server that accepts connections and never answers.

``start`` raises :class:`~testkit.clusters.EngineUnavailable` when the binary is missing; the
fixtures in ``tests/test_remote.py`` then skip with the reason, or fail under
``H5CORPUS_REQUIRE_CLUSTERS=1`` (CI, where ``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

from testkit.clusters import EngineUnavailable, free_port, log_tail, wait_until

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REQUEST = re.compile(r'"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/[0-9.]+" (\d{3})')


def _count_gets(log: Path, prefix: str = "") -> Counter:
    """GET requests per path (query string dropped) with a 2xx status, from a request log."""
    counts: Counter = Counter()
    text = _ANSI.sub("", log.read_text(errors="replace")) if log.exists() else ""
    for method, path, status in _REQUEST.findall(text):
        if method == "GET" and status.startswith("2"):
            p = path.split("?", 1)[0]
            if p.startswith(prefix):
                counts[p[len(prefix) :]] += 1
    return counts


def _wait_port(port: int, proc: subprocess.Popen, log: Path, what: str) -> None:
    def up() -> bool | None:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail(log)}")
        with socket.socket() as s:
            s.settimeout(0.2)
            return True if s.connect_ex(("127.0.0.1", port)) == 0 else None

    wait_until(up, 30.0, f"{what} on 127.0.0.1:{port}", logs=(log,))


class _Server:
    proc: subprocess.Popen
    log: Path

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class MotoS3(_Server):
    """moto's S3 server on loopback; objects live in its memory until it stops."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.endpoint = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, root: Path) -> MotoS3:
        exe = shutil.which("moto_server", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        if exe is None:
            raise EngineUnavailable("moto_server not found (pip install 'moto[server]')")
        root.mkdir(parents=True, exist_ok=True)
        port, log = free_port(), root / "moto.log"
        proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(port)],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait_port(port, proc, log, "moto_server")
        return cls(proc, port, log)

    def env(self) -> dict[str, str]:
        """The standard AWS settings a client needs for this server (dummy credentials)."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def gets(self, bucket: str) -> Counter:
        """GETs served per key of ``bucket``."""
        return _count_gets(self.log, f"/{bucket}/")


class Nginx(_Server):
    """nginx serving ``folder`` on loopback (non-daemon, config and logs under ``root``)."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, access: Path) -> None:
        self.proc, self.port, self.log, self.access = proc, port, log, access
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, root: Path, folder: Path, limit_rate: str | None = None) -> Nginx:
        exe = shutil.which("nginx", path=os.environ["PATH"] + os.pathsep + "/usr/sbin:/usr/local/sbin")
        if exe is None:
            raise EngineUnavailable("nginx not found (apt-get install nginx-light)")
        root.mkdir(parents=True, exist_ok=True)
        port, log, access = free_port(), root / "error.log", root / "access.log"
        temp = "".join(f"  {k}_temp_path {root / k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        rate = f"    limit_rate {limit_rate};\n" if limit_rate else ""
        conf = root / "nginx.conf"
        conf.write_text(
            f"daemon off;\nmaster_process off;\npid {root / 'nginx.pid'};\nerror_log {log} info;\n"
            "events { worker_connections 256; }\n"
            f"http {{\n  access_log {access};\n{temp}  default_type application/octet-stream;\n"
            f"  server {{\n    listen 127.0.0.1:{port};\n    root {folder};\n{rate}"
            "    location /denied/ { return 403; }\n  }\n}\n"
        )
        proc = subprocess.Popen(
            [exe, "-c", str(conf), "-p", str(root), "-e", str(log)],
            stdout=(root / "stdout.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait_port(port, proc, root / "stdout.log", "nginx")
        return cls(proc, port, log, access)

    def gets(self) -> Counter:
        """GETs served per path."""
        return _count_gets(self.access)


class StallServer:
    """Accepts TCP connections on loopback and never sends a byte (a stalled storage server)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._held: list[socket.socket] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self._held.append(conn)

    def __enter__(self) -> StallServer:
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join(5)
        for c in self._held:
            c.close()
        self.sock.close()


def wait_for_file(path: Path, min_bytes: int, timeout_s: float = 30.0) -> int:
    """Wait until ``path`` holds at least ``min_bytes``; its size."""

    def grown() -> int | None:
        try:
            n = path.stat().st_size
        except FileNotFoundError:
            return None
        return n if n >= min_bytes else None

    return wait_until(grown, timeout_s, f"{path} to reach {min_bytes:,} bytes", interval_s=0.02)


__all__ = ["MotoS3", "Nginx", "StallServer", "wait_for_file"]
