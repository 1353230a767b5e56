"""Real Slurm and Ray clusters on this machine, for the tests of the cluster executors (no mocks).

``SlurmCluster.start(root)`` runs munged, slurmctld and slurmd as a one-node cluster whose every
file (key, sockets, state, spool, logs, ``slurm.conf``) lies under ``root`` and whose ports are
free ones picked at start, so a Slurm the machine already runs is never touched. ``RayCluster.start
(root)`` runs a Ray head and a second node (its own raylet) joined with ``ray start --address``,
both on loopback addresses. Both are context managers; ``stop()`` ends every process they started
and raises if one is left. The pytest fixtures ``slurm_cluster`` and ``ray_cluster`` (session
scope, registered in ``tests/conftest.py``) wrap them; benches may use the classes directly.

Where an engine cannot start here (binaries missing, not root for Slurm) ``start`` raises
``EngineUnavailable`` and the fixtures skip with its reason, or fail when
``H5CORPUS_REQUIRE_CLUSTERS=1`` (CI). Every wait has a timeout and a message naming what it waited
for, with the daemon's log tail. docs/SCALING.md ("Test clusters") explains the settings. Both
engines and their process bookkeeping share this one module so tests and benches import one place.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TypeVar

import pytest

from testkit.corpora import subprocess_env

REQUIRE_CLUSTERS_ENV = "H5CORPUS_REQUIRE_CLUSTERS"
SLURM_TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
)
_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")  # daemons live here; a user's PATH may lack them
T = TypeVar("T")


class EngineUnavailable(RuntimeError):
    """The engine cannot run on this machine (binaries missing, not root): skip, don't fail."""


def engine_unavailable(reason: str):
    """Skip the requesting test with ``reason``; fail it instead when ``H5CORPUS_REQUIRE_CLUSTERS=1``."""
    if os.environ.get(REQUIRE_CLUSTERS_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_CLUSTERS_ENV}=1: this machine must run the engines)", pytrace=False)
    pytest.skip(reason)


def wait_until(
    poll: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.1, logs: tuple[Path, ...] = ()
) -> T:
    """Call ``poll`` until it returns something other than None; TimeoutError naming ``what``, with
    the last lines of ``logs``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = poll()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            tails = "".join("\n" + log_tail(p) for p in logs)
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}{tails}")
        time.sleep(interval_s)


def free_port() -> int:
    """A TCP port free on every interface now (the kernel's pick; daemons bind it moments later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def find_binary(name: str) -> str | None:
    """``name`` on PATH, in the sbin folders, or beside this Python (a venv's ``ray``)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", ""), *_SBIN])
    return shutil.which(name, path=path)


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"({path}: {e})"
    return f"--- last lines of {path} ---\n" + "\n".join(text[-lines:])


# --- processes -------------------------------------------------------------------------------------


class Proc(NamedTuple):
    pid: int
    state: str  # one letter of /proc/PID/stat; "Z" is a zombie (exited, not reaped)
    parent: int
    session: int
    cmdline: tuple[str, ...]


def processes() -> list[Proc]:
    """Every process on the machine, read from /proc (those that vanish mid-read are left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = tuple(a.decode(errors="replace") for a in fh.read().split(b"\0") if a)
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
        out.append(Proc(int(entry), fields[0], int(fields[1]), int(fields[3]), cmd))
    return out


def _references(pid: int, root: str) -> bool:
    """Whether process ``pid`` has its cwd, an open file or its command line under ``root``."""
    try:
        links = [os.readlink(f"/proc/{pid}/cwd")]
        links += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any(link == root or link.startswith(root + os.sep) for link in links)


def live_processes(sessions: set[int], root: Path | None = None) -> list[Proc]:
    """Processes not yet exited that belong to ``sessions`` or (``root``) use files under ``root``."""
    me = {os.getpid(), os.getppid()}
    root_s = str(root) if root is not None else None
    found = []
    for p in processes():
        if p.state == "Z" or p.pid in me:
            continue
        in_root = root_s is not None and (any(root_s in a for a in p.cmdline) or _references(p.pid, root_s))
        if p.session in sessions or in_root:
            found.append(p)
    return found


def kill_all(sessions: set[int], root: Path | None, timeout_s: float = 10.0) -> None:
    """SIGKILL what ``live_processes`` finds and their descendants (a job step's children need not
    touch ``root``) until none is left; raise naming the survivors after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {p.pid: p for p in live_processes(sessions, root)}
        if not left:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"{p.pid} {' '.join(p.cmdline)[:80]}" for p in left.values())
            raise RuntimeError(f"processes left after stopping the cluster: {names}")
        everyone = processes()
        grew = True
        while grew:
            children = [p for p in everyone if p.parent in left and p.pid not in left and p.pid != os.getpid()]
            left.update((p.pid, p) for p in children)
            grew = bool(children)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


@dataclass
class Daemon:
    """A process started in its own session with its output in ``log``."""

    name: str
    log: Path
    popen: subprocess.Popen

    @classmethod
    def start(cls, name: str, argv: list[str], log: Path, env: dict[str, str], cwd: Path) -> Daemon:
        with open(log, "ab") as fh:
            popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                start_new_session=True,
            )  # fmt: skip
        return cls(name, log, popen)

    def check_alive(self, extra_log: Path | None = None) -> None:
        if self.popen.poll() is not None:
            tails = log_tail(self.log) + ("\n" + log_tail(extra_log) if extra_log else "")
            raise RuntimeError(f"{self.name} exited with status {self.popen.returncode}\n{tails}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout_s)


def _cluster_root(prefix: str) -> Path:
    """A fresh folder with a short path: Unix socket paths (Ray's, munge's) must stay < 108 bytes."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


# --- Slurm -----------------------------------------------------------------------------------------

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")

SLURM_CONF = """\
# One-node test cluster generated by testkit/clusters.py; every path under {root}.
ClusterName=h5ctest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=batch_sched_delay=0,sched_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
MinJobAge=3600
NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 {hardware} State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmJob(NamedTuple):
    """One row of ``squeue``: a job, or one element of an array (``array_task_id`` not None)."""

    job_id: str  # as Slurm prints it: "12" or "12_3"
    array_job_id: str
    array_task_id: int | None
    state: str  # PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, ...
    reason: str  # why pending: "Dependency", "DependencyNeverSatisfied", "None", ...


def _node_hardware(slurmd: str) -> str:
    """This machine's CPUs, sockets, cores, threads and memory as ``slurmd -C`` detects them (the
    node is drained if slurm.conf claims more than slurmd finds)."""
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    found = dict(re.findall(r"(\w+)=(\S+)", out))
    missing = [k for k in keys if k not in found]
    if missing:
        raise RuntimeError(f"`slurmd -C` did not report {missing}: {out!r}")
    return " ".join(f"{k}={found[k]}" for k in keys)


class _StopOnExit:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class SlurmCluster(_StopOnExit):
    """A running one-node Slurm cluster. Run its commands with ``env`` (``SLURM_CONF`` names its
    slurm.conf); jobs inherit the submitting environment (``sbatch --export=ALL``, Slurm's default)."""

    root: Path
    conf: Path
    env: dict[str, str]
    node: str
    partition: str
    cpus: int  # what the node offers: one job step per CPU at a time (CR_CPU)
    ready_s: float = 0.0  # seconds from the first daemon's start to the node being idle
    daemons: list[Daemon] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path, timeout_s: float = 60.0) -> SlurmCluster:
        """Write the configuration under ``root`` and start munged, slurmctld and slurmd; return once
        the node is idle. EngineUnavailable when the binaries are missing or not running as root."""
        bins = {name: find_binary(name) for name in SLURM_BINARIES}
        missing = [name for name, path in bins.items() if path is None]
        if missing:
            raise EngineUnavailable(
                f"Slurm not installed: {', '.join(missing)} not found (apt-get install slurm-wlm munge)"
            )
        if os.geteuid() != 0:
            raise EngineUnavailable("the test Slurm cluster runs its daemons as root (SlurmUser=root); not root here")
        root.chmod(0o755)  # munged wants every folder above its socket searchable by all
        for sub in ("munge", "state", "spool", "run", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o755)  # munged: the socket's folder searchable by all, writable by root only
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        conf = root / "slurm.conf"
        hardware = _node_hardware(bins["slurmd"])
        conf.write_text(
            SLURM_CONF.format(
                root=root,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                node="h5cnode",
                partition="debug",
                hardware=hardware,
            )
        )
        env = {k: v for k, v in subprocess_env().items() if not k.startswith(("SLURM_", "SBATCH_", "SQUEUE_"))}
        env["SLURM_CONF"] = str(conf)
        cpus = int(re.search(r"CPUs=(\d+)", hardware).group(1))
        cluster = cls(root, conf, env, "h5cnode", "debug", cpus)
        try:
            cluster._start_daemons(bins, timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_daemons(self, bins: dict[str, str], timeout_s: float) -> None:
        t0 = time.monotonic()
        m = self.root / "munge"
        munged = [
            bins["munged"], "--foreground", f"--key-file={m}/munge.key", f"--socket={m}/munge.socket",
            f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed", f"--log-file={m}/munged.log",
        ]  # fmt: skip
        self.daemons.append(Daemon.start("munged", munged, self.root / "log" / "munged.out", self.env, self.root))
        logs = (self.root / "log" / "munged.out", m / "munged.log")
        wait_until(lambda: self._alive_and((m / "munge.socket").exists()), timeout_s, "munged's socket", logs=logs)
        ctld = [bins["slurmctld"], "-D", "-i", "-f", str(self.conf)]
        self.daemons.append(Daemon.start("slurmctld", ctld, self.root / "log" / "slurmctld.out", self.env, self.root))
        slurmd = [bins["slurmd"], "-D", "-N", self.node, "-f", str(self.conf)]
        self.daemons.append(Daemon.start("slurmd", slurmd, self.root / "log" / "slurmd.out", self.env, self.root))
        logs = (self.root / "log" / "slurmctld.log", self.root / "log" / "slurmd.log")
        idle = f"Slurm node {self.node} idle"
        wait_until(lambda: self._alive_and(self._node_state() == "idle"), timeout_s, idle, logs=logs)
        self.ready_s = time.monotonic() - t0

    def _alive_and(self, ready: bool) -> bool | None:
        for d in self.daemons:
            own_log = self.root / ("munge/munged.log" if d.name == "munged" else f"log/{d.name}.log")
            d.check_alive(own_log)
        return True if ready else None

    def _node_state(self) -> str:
        try:
            out = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", timeout_s=10, check=False)
        except subprocess.TimeoutExpired:
            return ""
        return out.stdout.strip()

    def run(self, *argv: str, timeout_s: float = 30.0, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm command (``sbatch``, ``squeue``, ...) against this cluster; output as text.
        RuntimeError with stderr when ``check`` and it fails."""
        cmd = [find_binary(argv[0]) or argv[0], *argv[1:]]
        kw.setdefault("cwd", self.root)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout_s, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, *args: str, script: str | None = None, cwd: Path | None = None) -> str:
        """Submit a batch job; return its job id (the array's id for ``--array``). ``script`` is the
        job script's text (fed on stdin); without it, ``args`` must name a script file or ``--wrap``."""
        proc = self.run("sbatch", "--parsable", *args, input=script, cwd=cwd or self.root)
        return proc.stdout.strip().split(";")[0]

    def scancel(self, *job_ids: str) -> None:
        """Cancel jobs or array elements ("12", "12_3")."""
        self.run("scancel", *job_ids)

    def jobs(self, job_id: str) -> list[SlurmJob]:
        """The job ``job_id``, or every element of the array ``job_id``, as squeue lists them (finished
        ones too: MinJobAge keeps them for an hour; sacct needs slurmdbd, which this cluster lacks)."""
        fmt = "%i|%F|%K|%T|%r"
        out = self.run("squeue", "-h", "-r", "--states=all", "-j", job_id, "-o", fmt).stdout
        rows = []
        for line in out.splitlines():
            jid, array_id, task, state, reason = line.strip().split("|")
            task_id = int(task) if task.isdigit() else None
            rows.append(SlurmJob(jid, array_id, task_id, state, reason))
        return rows

    def states(self, job_id: str) -> dict[str, str]:
        """{job id as printed ("12_3"): state} for ``job_id`` and its array elements."""
        return {j.job_id: j.state for j in self.jobs(job_id)}

    def wait(self, job_id: str, timeout_s: float = 60.0) -> dict[str, str]:
        """Wait until the job (every element of an array) has finished, however; return ``states``."""

        def finished() -> dict[str, str] | None:
            states = self.states(job_id)
            return states if states and all(s in SLURM_TERMINAL_STATES for s in states.values()) else None

        logs = (self.root / "log" / "slurmctld.log",)
        try:
            return wait_until(finished, timeout_s, f"Slurm job {job_id} to finish", interval_s=0.2, logs=logs)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\njobs now: {self.jobs(job_id)}") from None

    def stop(self) -> None:
        """Cancel every job, shut the daemons down, kill what is left (job steps included: slurmstepd
        outlives slurmd) and raise if a process of this cluster survives."""
        if any(d.name == "slurmctld" and d.popen.poll() is None for d in self.daemons):
            with contextlib.suppress(RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                self.run("scancel", f"--user={os.geteuid()}", timeout_s=10)
                wait_until(self._no_job_running, 20.0, "cancelled Slurm jobs to end", interval_s=0.2)
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.run("scontrol", "shutdown", timeout_s=10)
        for d in reversed(self.daemons):  # slurmd, slurmctld, then munged (the others need it to stop)
            d.stop()
        kill_all({d.popen.pid for d in self.daemons}, self.root)

    def _no_job_running(self) -> bool | None:
        out = self.run("squeue", "-h", "-o", "%T", "--states=RUNNING,COMPLETING,CONFIGURING", timeout_s=10).stdout
        return True if not out.strip() else None


# --- Ray -------------------------------------------------------------------------------------------

RAY_HEAD_IP, RAY_WORKER_IP = "127.0.0.2", "127.0.0.3"  # loopback; Ray rewrites 127.0.0.1 to the LAN address
RAY_OBJECT_STORE_BYTES = 80 * 2**20  # Ray's minimum is 75 MiB; the tests move small objects only

_NODES_SCRIPT = """\
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
keys = ("NodeID", "NodeManagerAddress", "Alive", "Resources")
print(json.dumps([{k: n[k] for k in keys} for n in ray.nodes()]))
"""


@dataclass
class RayCluster(_StopOnExit):
    """A running two-node Ray cluster on loopback: the head (``head_node_id``) and a second node with
    its own raylet (``worker_node_id``), one CPU each. ``env`` is the environment for a driver in a
    subprocess (``RAY_ADDRESS`` set); ``shared_dir`` is a folder both nodes see."""

    root: Path
    address: str  # the GCS "host:port": ray.init(address=...), ray start --address, --ray-address
    env: dict[str, str]
    shared_dir: Path
    head_node_id: str = ""
    worker_node_id: str = ""
    cpus_per_node: int = 1
    ready_s: float = 0.0  # seconds from `ray start --head` to both nodes alive in the GCS
    daemons: list[Daemon] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path, timeout_s: float = 120.0) -> RayCluster:
        """Start the head and the second node under ``root``; return once both are alive.
        EngineUnavailable when Ray is not installed (``pip install -e '.[cluster]'``)."""
        import importlib.util

        ray_cli = find_binary("ray")
        if importlib.util.find_spec("ray") is None or ray_cli is None:
            raise EngineUnavailable("Ray not installed (pip install -e '.[cluster]')")
        env = {k: v for k, v in subprocess_env().items() if k != "RAY_ADDRESS"}
        env["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report leaves the machine
        cluster = cls(root, "", env, root / "shared")
        cluster.shared_dir.mkdir(parents=True, exist_ok=True)
        try:
            cluster._start_nodes(ray_cli, timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_node(self, ray_cli: str, name: str, args: list[str], timeout_s: float) -> str:
        argv = [
            ray_cli, "start", "--block", "--disable-usage-stats", f"--temp-dir={self.root / name}",
            f"--num-cpus={self.cpus_per_node}", f"--object-store-memory={RAY_OBJECT_STORE_BYTES}",
            f"--dashboard-agent-listen-port={free_port()}", "--min-worker-port=0", "--max-worker-port=0", *args,
        ]  # fmt: skip
        daemon = Daemon.start(f"ray node {name}", argv, self.root / f"{name}.log", self.env, self.root)
        self.daemons.append(daemon)

        def started() -> str | None:
            daemon.check_alive()
            text = daemon.log.read_text(errors="replace")
            return text if "Ray runtime started" in text else None

        return wait_until(started, timeout_s, f"`ray start` of the {name} node", logs=(daemon.log,))

    def _start_nodes(self, ray_cli: str, timeout_s: float) -> None:
        t0 = time.monotonic()
        head_args = ["--head", f"--node-ip-address={RAY_HEAD_IP}", "--port=0", "--include-dashboard=false"]
        head_args.append(f"--dashboard-port={free_port()}")
        log = self._start_node(ray_cli, "head", head_args, timeout_s)
        found = re.search(r"ray start --address='([^']+)'", log)
        if found is None:
            raise RuntimeError(f"no address in the head's output\n{log_tail(self.daemons[0].log)}")
        self.address = found.group(1)
        self.env["RAY_ADDRESS"] = self.address
        self._start_node(
            ray_cli, "worker", [f"--address={self.address}", f"--node-ip-address={RAY_WORKER_IP}"], timeout_s
        )

        def both_alive() -> list[dict] | None:
            alive = [n for n in self.nodes() if n["Alive"]]
            return alive if len(alive) == 2 else None

        logs = tuple(d.log for d in self.daemons)
        alive = wait_until(both_alive, timeout_s, "both Ray nodes alive in the GCS", interval_s=0.5, logs=logs)
        for n in alive:
            if "node:__internal_head__" in n["Resources"]:
                self.head_node_id = n["NodeID"]
            else:
                self.worker_node_id = n["NodeID"]
        self.ready_s = time.monotonic() - t0

    def nodes(self, timeout_s: float = 60.0) -> list[dict]:
        """``ray.nodes()`` (NodeID, NodeManagerAddress, Alive, Resources) from a fresh driver process,
        so it works whether or not the caller is connected."""
        proc = subprocess.run(
            [sys.executable, "-c", _NODES_SCRIPT, self.address], capture_output=True, text=True, env=self.env,
            timeout=timeout_s, cwd=self.root,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"listing Ray nodes failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    @contextlib.contextmanager
    def connect(self) -> Iterator:
        """Connect this process as a driver (``ray.init(address=...)``); yields the ``ray`` module and
        disconnects after."""
        import ray

        if ray.is_initialized():
            raise RuntimeError("this process is already a Ray driver (ray.shutdown() first)")
        ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()

    def task_pids(self, function_name: str) -> list[int]:
        """Worker processes of this cluster running a task of ``function_name`` now (Ray titles a
        busy worker ``ray::<function name>``)."""
        title = f"ray::{function_name}"
        procs = live_processes({d.popen.pid for d in self.daemons})
        return [p.pid for p in procs if p.cmdline and p.cmdline[0].split(" ")[0] == title]

    def wait_for_task_pid(self, function_name: str, timeout_s: float = 60.0) -> int:
        """The pid of the one worker running ``function_name``, once there is one."""

        def one() -> int | None:
            pids = self.task_pids(function_name)
            if len(pids) > 1:
                raise RuntimeError(f"{len(pids)} workers run {function_name}: {pids}")
            return pids[0] if pids else None

        return wait_until(one, timeout_s, f"a Ray worker running {function_name}")

    def stop(self) -> None:
        """SIGKILL every process of both nodes (``ray stop --force``, limited to this cluster: ``ray
        stop`` would end every Ray on the machine) and raise if one survives."""
        kill_all({d.popen.pid for d in self.daemons}, self.root)
        for d in self.daemons:
            d.stop()


# --- pytest fixtures (registered in tests/conftest.py) ---------------------------------------------


def _session_cluster(cls, prefix: str) -> Iterator:
    root = _cluster_root(prefix)
    unavailable = None
    try:
        cluster = cls.start(root)
    except EngineUnavailable as e:
        unavailable = str(e)
    except BaseException as e:
        raise RuntimeError(f"{cls.__name__} did not start (its files are kept in {root}): {e}") from e
    if unavailable is not None:
        shutil.rmtree(root, ignore_errors=True)
        engine_unavailable(unavailable)
    try:
        yield cluster
    finally:
        cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A one-node Slurm cluster for the whole session (mark its tests ``slurm``)."""
    yield from _session_cluster(SlurmCluster, "h5c-slurm-")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A two-node Ray cluster for the whole session (mark its tests ``ray``)."""
    yield from _session_cluster(RayCluster, "h5c-ray-")
