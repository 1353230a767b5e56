"""The run marker: one build at a time per shards folder, on any filesystem.

``fcntl.flock`` is not reliable on NFS and Lustre (it may be local to a client, or not supported), so
a build marks its output with a file created atomically in the shards folder (``.build.lock``):
the JSON ``{"host", "pid", "started", "kind", ...}`` is written to a uniquely named file that is
then ``link()``-ed to the marker's name, which fails when the name exists (``link`` is atomic on
NFS, where ``O_EXCL`` was not before NFSv3). The holder removes it when the build ends.

Whether a marker's run is still alive:

- ``kind: "process"`` (a driver: the local and Ray executors), on this host (same host name and boot
  id): alive while a process with that pid and start time exists. On another host: alive while the
  marker's modification time, refreshed every :data:`HEARTBEAT_S` seconds by the holder, is younger
  than :data:`STALE_AFTER_S`, measured against a file touched now in the same folder (so the file
  server's clock, not this host's, decides).
- ``kind: "slurm"``: alive while one of its jobs is queued or running (``squeue``) and can still
  run: once an element failed, was cancelled or pends with ``DependencyNeverSatisfied``, the jobs
  after its stage wait for nothing and do not count (the new run cancels them). Where ``squeue``
  cannot answer, the run is taken to be alive.
- A file that is not JSON is the lock of a version that used ``flock``: alive while locked.

A live marker refuses the build (:class:`~h5corpus.build.config.BuildConflict`, naming host, pid,
start time, jobs). A stale one is replaced (atomically: renamed away, checked to be the one judged
stale, then the new marker linked), and :attr:`RunMarker.replaced` says whose it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..config import BuildConflict

HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0
_NEVER = "DependencyNeverSatisfied"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), or None if it is gone
    ("" when alive but unknown)."""
    if pid <= 0:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return ""
        return ""
    return stat[stat.rindex(")") + 2 :].split()[19]


def this_process() -> dict[str, Any]:
    """The marker of a driver running in this process."""
    return {
        "kind": "process",
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid": os.getpid(),
        "pid_start": _proc_start(os.getpid()) or "",
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def describe(m: Mapping[str, Any]) -> str:
    """``host vm, pid 42, started 2026-...`` (+ the Slurm jobs)."""
    out = f"host {m.get('host', '?')}, pid {m.get('pid', '?')}, started {m.get('started', '?')}"
    if m.get("jobs"):
        out += f", Slurm jobs {' '.join(m['jobs'])}"
    return out


_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def slurm_chain_alive(
    chain: Sequence[Sequence[str]], env: Mapping[str, str] | None = None
) -> tuple[bool | None, list[str]]:
    """Whether a chain of Slurm jobs (job ids per stage, in chain order) can still make progress,
    and the ids of its jobs that never will (to cancel). A stage with an element that failed, was
    cancelled or pends forever (``DependencyNeverSatisfied``) breaks the chain: every job after
    it waits for nothing. Elements of the broken stage itself that still run, or jobs of earlier
    stages, keep the run alive. None when ``squeue`` cannot tell."""
    jobs = [j for ids in chain for j in ids]
    if not jobs:
        return False, []
    try:
        p = subprocess.run(
            ["squeue", "-h", "-r", "--states=all", "-j", ",".join(jobs), "-o", "%i|%F|%T|%r"],
            capture_output=True, text=True, timeout=60, env=None if env is None else dict(env),
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None, []
    if p.returncode != 0:
        # squeue refuses ids it no longer knows ("Invalid job id"): those jobs are long gone
        return (False, []) if "Invalid job id" in p.stderr else (None, [])
    by_array: dict[str, list[tuple[str, str, str]]] = {}
    for line in p.stdout.splitlines():
        jid, array, state, reason = (line.strip().split("|") + ["", "", ""])[:4]
        by_array.setdefault(array or jid, []).append((jid, state, reason))
    alive, broken, never = False, False, []
    for ids in chain:
        rows = [r for j in ids for r in by_array.get(j, [])]
        if broken:
            never += [jid for jid, state, _ in rows if state in _ACTIVE]
            continue
        for jid, state, reason in rows:
            if state == "PENDING" and reason == _NEVER:
                never.append(jid)
                broken = True
            elif state in _ACTIVE:
                alive = True
            elif state != "COMPLETED":
                broken = True
    return alive, never


class RunMarker:
    """The marker file of one output (see the module docstring). Use as a context manager, or
    :meth:`acquire` / :meth:`release`."""

    def __init__(self, path: Path, what: str, *, slurm_env: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self.what = what
        """What the marker protects, for messages (``into shards``)."""
        self.slurm_env = slurm_env
        self.held: dict[str, Any] | None = None
        self.replaced: dict[str, Any] | None = None
        """The stale marker this one replaced, if any."""
        self.cancel_jobs: list[str] = []
        """Slurm jobs of the replaced run that would pend forever (the caller cancels them)."""
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- taking and giving back --------------------------------------------------------------------
    def acquire(self, content: dict[str, Any] | None = None) -> RunMarker:
        content = dict(content or this_process())
        content["token"] = uuid.uuid4().hex
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            if self._link(content):
                self.held = content
                self._start_heartbeat()
                return self
            raw = self._read_raw()
            if raw is None:
                continue  # removed meanwhile: try again
            self._refuse_if_alive(raw)
            self._remove_stale(raw)
        raise BuildConflict(f"{self.path}: could not take the run marker (another build keeps replacing it)")

    def check_not_alive(self) -> None:
        """Raise :class:`~h5corpus.build.config.BuildConflict` when a live run holds the marker (what
        a build that cannot create one, on read-only storage, still checks)."""
        raw = self._read_raw()
        if raw is not None:
            self._refuse_if_alive(raw)

    def _refuse_if_alive(self, raw: bytes) -> None:
        live, why = self._alive(raw)
        if live:
            raise BuildConflict(
                f"another h5corpus build is writing {self.what} (run marker {self.path}: {why}); "
                f"wait for it to finish, or stop it first (if it is not running, delete {self.path})"
            )

    def _link(self, content: dict[str, Any]) -> bool:
        tmp = self.path.with_name(f"{self.path.name}.{content['token']}")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(content, fh, sort_keys=True)
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):  # a read-only folder refuses even this
                tmp.unlink(missing_ok=True)

    def _read_raw(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def _remove_stale(self, raw: bytes) -> None:
        grave = self.path.with_name(f"{self.path.name}.stale.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, grave)
        except FileNotFoundError:
            return
        if grave.read_bytes() != raw:  # another build replaced it meanwhile: put that one back
            with contextlib.suppress(FileExistsError):
                os.link(grave, self.path)
        else:
            self.replaced = _parse(raw)
        grave.unlink(missing_ok=True)

    def update(self, **fields: Any) -> None:
        """Rewrite the held marker with more fields (e.g. ``kind="slurm", jobs=[...]``), atomically."""
        assert self.held is not None
        self.held = {**self.held, **fields}
        tmp = self.path.with_name(f"{self.path.name}.{self.held['token']}.new")
        tmp.write_text(json.dumps(self.held, sort_keys=True))
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Remove the marker if it is still this one."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self.held is not None:
            now = _parse(self._read_raw() or b"")
            if now is not None and now.get("token") == self.held["token"]:
                self.path.unlink(missing_ok=True)
            self.held = None

    def hand_over(self) -> None:
        """Stop heart-beating and leave the marker in place: its jobs hold the output now."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        self.held = None

    def __enter__(self) -> RunMarker:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- liveness ----------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._beat = threading.Thread(target=beat, name="h5corpus-run-marker", daemon=True)
        self._beat.start()

    def _alive(self, raw: bytes) -> tuple[bool, str]:
        m = _parse(raw)
        if m is None:
            return _flock_held(self.path, raw)
        why = describe(m)
        if m.get("kind") == "slurm":
            alive, never = slurm_chain_alive(m.get("chain") or [m.get("jobs") or []], self.slurm_env)
            if alive is None:
                return True, why + " (squeue cannot say whether they still run here)"
            self.cancel_jobs = never if not alive else []
            return alive, why
        if m.get("host") == socket.gethostname() and m.get("boot_id") == _boot_id():
            start = _proc_start(int(m.get("pid") or 0))
            return start is not None and start in ("", str(m.get("pid_start"))), why
        age = _age(self.path)
        return age is None or age < STALE_AFTER_S, why + (f", last heartbeat {age:.0f} s ago" if age else "")


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        m = json.loads(raw)
    except ValueError:
        return None
    return m if isinstance(m, dict) else None


def _flock_held(path: Path, raw: bytes) -> tuple[bool, str]:
    """A marker of a version that used ``flock`` (a pid, left in place): alive while locked."""
    pid = raw.decode(errors="replace").strip() or "?"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False, ""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False, ""
    except BlockingIOError:
        return True, f"held with flock by pid {pid}"
    except OSError:
        return False, ""
    finally:
        os.close(fd)


def _age(path: Path) -> float | None:
    """Seconds since ``path`` was last modified, by the clock of the filesystem that holds it."""
    probe = path.with_name(f".{path.name}.clock.{uuid.uuid4().hex}")
    try:
        probe.touch()
        return probe.stat().st_mtime - path.stat().st_mtime
    except OSError:
        return None
    finally:
        probe.unlink(missing_ok=True)


def remove_marker_of(path: Path, accept: Callable[[Mapping[str, Any]], bool]) -> bool:
    """Remove the marker at ``path`` when ``accept(its content)``; True if removed (the commit
    stage of a Slurm build ends its run this way)."""
    m = _parse(path.read_bytes()) if path.exists() else None
    if m is None or not accept(m):
        return False
    path.unlink(missing_ok=True)
    return True
