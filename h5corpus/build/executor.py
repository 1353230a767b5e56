"""Executors run stage calls (:class:`~h5corpus.build.tasks.StageCall`) somewhere and hand back
their results; they decide nothing about the build.

:class:`Executor` is the whole interface the driver uses: ``start`` with a context, ``submit`` calls,
``next_result`` as they complete, ``cancel`` everything, ``shutdown``. A call carries only a stage
name, a task index and (for ``finish``) the decision, so an executor whose workers live in other
processes or on other nodes can run it from the state folder
(:meth:`~h5corpus.build.plan.StageContext.load`) and :func:`~h5corpus.build.tasks.run_stage`.

:class:`LocalExecutor` is a process pool on this machine, and all the worker plumbing lives here:
forked workers that inherit the context (encoder and filters loaded once), die with the main
process (``PR_SET_PDEATHSIG`` on Linux), close their copy of the build lock, share progress
counters, and turn the stages' named steps into test crash points (:data:`CRASH_ENV`).
:class:`BuildLock` is the lock a build holds on its shards folder: a run marker
(:mod:`~h5corpus.build.runmarker`), which works on NFS and Lustre where ``flock`` does not.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

from .config import BuildError
from .plan import StageContext
from .runmarker import RunMarker
from .stages import run_stage
from .tasks import StageCall

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
    """The run marker ``<shards_dir>/.build.lock`` for the life of a build (host, pid, start time; a
    second build refuses while the first is alive, and replaces a stale one). ``fd`` is None: there
    is no descriptor for forked workers to close."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.marker = RunMarker(path, f"into {path.parent}")

    def __enter__(self) -> BuildLock:
        self.marker.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.marker.release()


def _mp_context():
    import multiprocessing as mp

    # fork: workers inherit the loaded encoder and filters (no re-import, no pickling). Safe here:
    # the main process holds no open HDF5 file when it forks, and its one thread besides the main
    # one (the run marker's heartbeat) only sleeps and touches a file, holding no lock a child needs.
    return mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _worker_main(ctx: StageContext, conn: Connection, counters: Any, lock_fd: int | None, parent_pid: int) -> None:
    """A local worker: run the calls that arrive on ``conn`` until told to stop (None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    if lock_fd is not None:
        try:
            os.close(lock_fd)  # the lock belongs to the main process alone
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

    def __init__(self, workers: int, *, lock_fd: int | None = None, count_progress: bool = False) -> None:
        self.workers = int(workers)
        self.lock_fd = lock_fd
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
                target=_worker_main, args=(ctx, theirs, self.counters, self.lock_fd, os.getpid()), daemon=True
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
