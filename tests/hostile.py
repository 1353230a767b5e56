"""Running a command against a hostile input and measuring what it cost: exit code, output, and
the peak resident memory of that process and its workers (measured by a small wrapper process), with a wall-clock limit
so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import subprocess_env

MiB = 1 << 20


@dataclass(frozen=True)
class Measured:
    """What one command did."""

    returncode: int
    stdout: str
    stderr: str
    peak_rss: int
    """Peak resident set size, in bytes, of the process or of the largest of the descendants it
    waited for (worker processes included: ``RUSAGE_CHILDREN`` of the wrapper that ran it)."""
    timed_out: bool

    def one_clear_error(self, code: int, *needles: str) -> str:
        """Assert exit ``code``, no traceback, no hang, and exactly one ``error: ...`` line on
        stderr holding every one of ``needles``; return that line."""
        assert not self.timed_out, f"hung: {self.stderr[-2000:]}"
        assert self.returncode == code, (self.returncode, self.stdout[-2000:], self.stderr[-2000:])
        assert "Traceback" not in self.stderr and "FATAL" not in self.stderr, self.stderr[-4000:]
        errors = [x for x in self.stderr.splitlines() if x.startswith("error: ")]
        assert len(errors) == 1, self.stderr[-4000:]
        for needle in needles:
            assert needle in errors[0], (needle, errors[0])
        return errors[0]


#: Runs argv[2:] and writes the peak RSS (KiB) of it and its waited-for descendants to argv[1]. The
#: measured command must be forked from a small process: Linux keeps a process's ``ru_maxrss``
#: across exec, so a child forked straight from a large pytest would report pytest's own peak.
_WRAP = """
import os, resource, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_DFL)
rc = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
if rc < 0:
    signal.signal(-rc, signal.SIG_DFL)
    os.kill(os.getpid(), -rc)
sys.exit(rc)
"""


def run_measured(
    args: list[str], *, cwd: Path | None = None, timeout: float = 180.0, env: dict | None = None
) -> Measured:
    """Run ``args`` (a command line; ``python -m h5corpus`` when it starts with ``h5corpus``)."""
    if args[0] == "h5corpus":
        args = [sys.executable, "-m", "h5corpus", *args[1:]]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile() as rss:
        wrapped = [sys.executable, "-c", _WRAP, rss.name, *args]
        proc = subprocess.Popen(
            wrapped, cwd=cwd, env=env or subprocess_env(), stdout=out, stderr=err, start_new_session=True
        )
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            os.killpg(proc.pid, 9)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status = os.waitpid(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Measured(
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            int(Path(rss.name).read_text() or 0) * 1024,
            killed.is_set(),
        )


def python_measured(code: str, *, timeout: float = 180.0) -> Measured:
    """Run Python ``code`` in a fresh interpreter with the repository importable."""
    return run_measured([sys.executable, "-c", code], timeout=timeout)
