"""Executors run stage calls (:class:`~h5corpus.build.stages.tasks.StageCall`) somewhere and hand back
their results; they decide nothing about the build.

:class:`Executor` is the whole interface the driver uses: ``start`` with a context, ``submit`` calls,
``next_result`` as they complete, ``cancel`` everything, ``shutdown``. A call carries only a stage
name, a task index and (for ``finish``) the decision, so an executor whose workers live in other
processes or on other nodes can run it from the state folder
(:meth:`~h5corpus.build.stages.buildplan.StageContext.load`) and :func:`~h5corpus.build.stages.tasks.run_stage`.

:class:`LocalExecutor` is a process pool on this machine, and all the worker plumbing lives here:
forked workers that inherit the context (encoder and filters loaded once), die with the main
process (``PR_SET_PDEATHSIG`` on Linux), close their copy of the build lock, share progress
counters, and turn the stages' named steps into test crash points (:data:`CRASH_ENV`).
:class:`BuildLock` is what a build holds on its shards folder and its manifest: run markers
(:mod:`~h5corpus.build.stages.runmarker`), which work on NFS and Lustre where ``flock`` does not.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

from ..config import BuildError
from ..oserrors import NOT_WRITABLE, BuildOSError, as_build_os_error
from ..stages.buildplan import StageContext
from ..stages.dispatch import run_stage
from ..stages.runmarker import RunMarker
from ..stages.state import LOCK_FILE, manifest_lock_path
from ..stages.tasks import StageCall

#: Fault injection for the crash-consistency tests: ``POINT`` or ``POINT:N`` SIGKILLs the whole build
#: (main process and workers) the N-th time (default 1st) one process reaches that point.
CRASH_ENV = "H5CORPUS_TEST_CRASH_AT"


@dataclass
class StageResult:
    """A finished call: its value (a record, or None), or the exception it raised."""

    call: StageCall
    value: Any = None
    error: BaseException | None = None


class Executor(Protocol):
    """What the driver needs from whatever runs the stages."""

    workers: int

    def driver_events(self) -> LocalEvents:
        """Events of the main process (the driver's own steps: ``decided``, ``manifest-*``)."""
        return LocalEvents(CrashPoints())

    def start(self, ctx: StageContext) -> None:
        """Get ready to run calls with ``ctx`` (again after :meth:`cancel`, e.g. with another encoder)."""

    def submit(self, call: StageCall) -> None:
        """Queue a call; it runs when a worker is free, in submission order."""

    def next_result(self, timeout: float) -> StageResult | None:
        """The next finished call, or None after ``timeout`` seconds. Raises when a worker is lost."""

    def progress(self) -> tuple[int, int] | None:
        """Documents and tokens written so far by this executor's workers, if it counts them."""

    def cancel(self) -> None:
        """Stop every running and queued call now; their results never arrive."""

    def shutdown(self, *, wait: bool) -> None:
        """No more calls: let the running ones finish (``wait``) or stop them."""


class CrashPoints:
    """The stages' named steps as test crash points (``H5CORPUS_TEST_CRASH_AT=POINT[:N]``), counted
    per process; ``parent_pid`` (a worker's) is killed first, so the whole build dies at once."""

    def __init__(self, parent_pid: int | None = None) -> None:
        want = os.environ.get(CRASH_ENV) or ""
        self.point, _, nth = want.partition(":")
        self.nth = int(nth or 1)
        self.count = 0
        self.parent_pid = parent_pid

    def __call__(self, name: str) -> None:
        if name != self.point:
            return
        self.count += 1
        if self.count == self.nth:
            if self.parent_pid:
                os.kill(self.parent_pid, signal.SIGKILL)  # the build dies; workers follow (PDEATHSIG)
            os.kill(os.getpid(), signal.SIGKILL)


class LocalEvents:
    """Stage events of a process of the local executor: crash points and shared progress counters."""

    def __init__(self, crash: CrashPoints, counters: Any = None) -> None:
        self.crash, self.counters = crash, counters

    def step(self, name: str) -> None:
        self.crash(name)

    def progress(self, documents: int, tokens: int) -> None:
        if self.counters is not None:
            with self.counters.get_lock():
                self.counters[0] += documents
                self.counters[1] += tokens


class BuildLock:
    """The run markers a build holds for its whole life, so that no two builds write one shards
    folder or one manifest at once: ``<shards_dir>/.build.lock`` and ``.<manifest name>.lock``
    beside the manifest (:func:`~h5corpus.build.stages.state.manifest_lock_path`), taken in that order.
    Each holds host, pid and start time, for the message a second build prints; a second build
    refuses while the first is alive and replaces a stale marker. They are removed when the build
    ends (a Slurm build hands them over to its jobs: :meth:`update`, :meth:`hand_over`).

    Where a folder cannot be written (read-only file system, no permission), no marker can be
    created there: a live marker already there still refuses the build, else :attr:`writable` is
    False with :attr:`refusal` saying why, and such a build may only find its output up to date.
    :attr:`fds` is empty: a marker holds no descriptor for forked workers to close.
    """

    def __init__(self, shards_dir: Path, manifest: Path) -> None:
        shards_dir, manifest = Path(shards_dir), Path(manifest)
        wanted = [
            (shards_dir / LOCK_FILE, f"into {shards_dir}"),
            (manifest_lock_path(manifest), f"the manifest {manifest}"),
        ]
        seen: set[Path] = set()
        self.markers: list[RunMarker] = []
        for path, what in wanted:
            key = path.absolute().resolve()
            if key not in seen:
                seen.add(key)
                self.markers.append(RunMarker(path, what))
        self.held: list[RunMarker] = []
        self.fds: tuple[int, ...] = ()
        self.writable = True
        self.refusal: BuildOSError | None = None

    def __enter__(self) -> BuildLock:
        try:
            for marker in self.markers:
                self._take(marker)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _take(self, marker: RunMarker) -> None:
        try:
            marker.acquire()
        except OSError as e:
            failed = as_build_os_error(e, "create the run marker", marker.path)
            if failed is None or e.errno not in NOT_WRITABLE:
                raise failed or e from None
            marker.check_not_alive()  # a live build there (one that may write) still refuses
            self.writable = False
            self.refusal = self.refusal or _refusal_of(failed, marker.path.parent)
            return
        self.held.append(marker)

    @property
    def cancel_jobs(self) -> list[str]:
        """Slurm jobs of replaced runs that would pend forever (the caller cancels them; a Slurm
        run's two markers name the same jobs, listed once)."""
        return list(dict.fromkeys(j for m in self.markers for j in m.cancel_jobs))

    def update(self, **fields: Any) -> None:
        """Rewrite every held marker with more fields (``kind="slurm", jobs=[...]``)."""
        for marker in self.held:
            marker.update(**fields)

    def hand_over(self) -> None:
        """Leave the markers in place: the build's jobs hold the output now."""
        for marker in self.held:
            marker.hand_over()
        self.held = []

    def __exit__(self, *exc: Any) -> None:
        for marker in reversed(self.held):
            marker.release()
        self.held = []


def _refusal_of(failed: BuildOSError, folder: Path) -> BuildOSError:
    """``failed`` (a marker that could not be created) as the refusal to write into ``folder``."""
    return BuildOSError("write into", folder, failed.errno, failed.strerror or "")


def _mp_context():
    import multiprocessing as mp

    # fork: workers inherit the loaded encoder and filters (no re-import, no pickling). Safe here:
    # the main process holds no open HDF5 file when it forks, and its threads besides the main
    # one (the run markers' heartbeats) only sleep and touch a file, holding no lock a child needs.
    return mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _worker_main(
    ctx: StageContext, conn: Connection, counters: Any, lock_fds: tuple[int, ...], parent_pid: int
) -> None:
    """A local worker: run the calls that arrive on ``conn`` until told to stop (None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    for fd in lock_fds:
        try:
            os.close(fd)  # the locks belong to the main process alone
        except OSError:
            pass
    if sys.platform.startswith("linux"):
        try:  # die with the main process (kill -9 of the build leaves no orphan writers)
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass
        if os.getppid() != parent_pid:
            os._exit(1)
    ctx.events = LocalEvents(CrashPoints(parent_pid), counters)
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        if call is None:
            return
        try:
            conn.send(StageResult(call, value=run_stage(ctx, call)))
        except BaseException as e:  # noqa: BLE001 - handed to the driver, which re-raises it
            conn.send(StageResult(call, error=_picklable(e)))


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


class LocalExecutor:
    """``workers`` forked processes on this machine, each running one call at a time."""

    def __init__(self, workers: int, *, lock_fds: Sequence[int] = (), count_progress: bool = False) -> None:
        self.workers = int(workers)
        self.lock_fds = tuple(lock_fds)
        self.counters = _mp_context().Array("q", 2) if count_progress else None
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.busy: dict[int, StageCall] = {}  # worker slot -> its call
        self.queue: deque[StageCall] = deque()

    def driver_events(self) -> LocalEvents:
        """Events of the main process (the driver's own steps: ``decided``, ``manifest-*``)."""
        return LocalEvents(CrashPoints())

    def start(self, ctx: StageContext) -> None:
        mp = _mp_context()
        for _ in range(self.workers):
            mine, theirs = mp.Pipe()
            p = mp.Process(
                target=_worker_main, args=(ctx, theirs, self.counters, self.lock_fds, os.getpid()), daemon=True
            )
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)

    def submit(self, call: StageCall) -> None:
        self.queue.append(call)
        self._dispatch()

    def _dispatch(self) -> None:
        for slot in range(len(self.conns)):
            if not self.queue:
                return
            if slot not in self.busy:
                call = self.queue.popleft()
                self.busy[slot] = call
                self.conns[slot].send(call)

    def next_result(self, timeout: float) -> StageResult | None:
        ready = wait([self.conns[s] for s in self.busy] + [p.sentinel for p in self.procs], timeout)
        for slot, conn in enumerate(self.conns):
            if conn in ready and slot in self.busy:
                try:
                    res: StageResult = conn.recv()
                except EOFError:
                    break
                del self.busy[slot]
                self._dispatch()
                return res
        if any(p.exitcode is not None for p in self.procs):
            raise BuildError(
                "a worker process died (killed, or out of memory?); completed work is kept: "
                "re-run the same command to resume"
            )
        return None

    def progress(self) -> tuple[int, int] | None:
        return None if self.counters is None else (int(self.counters[0]), int(self.counters[1]))

    def cancel(self) -> None:
        for p in self.procs:
            p.kill()
        self._join()

    def shutdown(self, *, wait: bool) -> None:
        """Stop the workers: let them exit when idle (``wait``), else kill them; :meth:`join` reaps
        them (exiting takes a few ms that can overlap the caller's work)."""
        self.queue.clear()
        if not wait or self.busy:
            for p in self.procs:
                p.kill()
            return
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass

    def join(self) -> None:
        self._join()

    def _join(self) -> None:
        for p in self.procs:
            p.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self.busy = [], [], {}
        self.queue.clear()
