"""The Ray executor: stage calls as Ray tasks on an existing cluster (``--executor ray``).

Each :class:`~h5corpus.build.stages.tasks.StageCall` becomes one task (``num_cpus`` = ``cpus_per_task``,
``max_retries`` on worker or node loss: every stage is idempotent, so a rerun task gives the same
files). A task gets nothing but the state folder's path, the plan's sha256 and the call; it loads
its :class:`~h5corpus.build.stages.buildplan.StageContext` from the state folder (once per worker process and
plan, :func:`_context`) and returns the stage's record, which flows back to the driver's loop and
progress bar. So sources, shards and the state folder must be on a filesystem every node mounts at
the same path: :meth:`RayExecutor.start` checks it on every node (a probe file written by the
driver, read back by a task pinned to each node), and a task that cannot see the state folder fails
naming the path and its node.

Only :mod:`ray` itself is needed on the nodes besides h5corpus (no runtime environment is shipped).
"""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from ..config import BuildConflict, BuildError, RayOptions
from ..stages.buildplan import StageContext
from ..stages.dispatch import run_stage
from ..stages.tasks import StageCall
from .executor import CrashPoints, LocalEvents, StageResult

_LOADED: dict[str, tuple[str, StageContext]] = {}
"""Per worker process: state folder -> (plan sha256, its context). A memo of what the plan says (the
tokenizer and filters take ~0.1-1 s to load); every call still names its state folder and plan."""


def _node() -> str:
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only for a message
        ip = "?"
    return f"{socket.gethostname()} ({ip})"


def _context(state_dir: str, plan_sha: str) -> StageContext:
    """The context of the build in ``state_dir`` whose plan has sha256 ``plan_sha``, loaded once."""
    plan = Path(state_dir) / "plan.json"
    got = _LOADED.get(state_dir)
    if got is not None and got[0] == plan_sha:
        return got[1]
    try:
        data = plan.read_bytes()
    except OSError as e:
        raise BuildConflict(
            f"node {_node()} cannot read the build's state folder {state_dir} ({e.strerror}): sources, shards and "
            "the state folder must be on a filesystem every node mounts at the same path"
        ) from None
    if hashlib.sha256(data).hexdigest() != plan_sha:
        raise BuildConflict(
            f"node {_node()} sees another plan in {state_dir} than the driver wrote: is that path a different "
            "filesystem on this node? (it must be one every node shares)"
        )
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per task, as the local workers
    ctx = StageContext.load(state_dir)
    _LOADED.clear()
    _LOADED[state_dir] = (plan_sha, ctx)
    return ctx


def _run(state_dir: str, plan_sha: str, call: StageCall) -> Any:
    return run_stage(_context(state_dir, plan_sha), call)


# One function per stage, so a worker's process title (``ray::read_stage``) says what it runs.
def read_stage(state_dir: str, plan_sha: str, call: StageCall) -> Any:
    return _run(state_dir, plan_sha, call)


def keys_stage(state_dir: str, plan_sha: str, call: StageCall) -> Any:
    return _run(state_dir, plan_sha, call)


def bucket_stage(state_dir: str, plan_sha: str, call: StageCall) -> Any:
    return _run(state_dir, plan_sha, call)


def finish_stage(state_dir: str, plan_sha: str, call: StageCall) -> Any:
    return _run(state_dir, plan_sha, call)


_STAGE_FUNCTIONS = {"read": read_stage, "keys": keys_stage, "bucket": bucket_stage, "finish": finish_stage}


def probe_state(state_dir: str, name: str, token: str) -> str | None:
    """On a node: None when ``state_dir/name`` holds ``token``, else what is wrong (naming the node)."""
    path = Path(state_dir) / name
    try:
        seen = path.read_text()
    except OSError as e:
        return f"node {_node()} cannot read {path} ({e.strerror})"
    return None if seen == token else f"node {_node()} reads other content in {path}: not the driver's filesystem"


class RayExecutor:
    """Stage calls as tasks on the Ray cluster at ``options.address`` (the :class:`Executor` interface)."""

    def __init__(self, options: RayOptions, state_dir: Path, *, count_progress: bool = False) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--executor ray needs Ray: pip install 'h5corpus[cluster]'") from None
        self.ray = ray
        self.options = options
        self.state_dir = str(Path(state_dir).absolute())
        address = options.address or os.environ.get("RAY_ADDRESS") or "auto"
        self.own = not ray.is_initialized()
        if self.own:
            try:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise BuildConflict(
                    f"no Ray cluster at {address!r} ({e}); start one (`ray start --head`) or pass --ray-address HOST:PORT"
                ) from None
        cpus = float(ray.cluster_resources().get("CPU", 0))
        if cpus < float(options.cpus_per_task):
            raise BuildConflict(
                f"the Ray cluster at {address!r} has {cpus:g} CPUs; a stage task asks for {options.cpus_per_task:g}"
            )
        self.workers = max(1, int(cpus // float(options.cpus_per_task)))
        self.count_progress = count_progress
        self.pending: dict[Any, StageCall] = {}
        self.remote = {stage: ray.remote(fn) for stage, fn in _STAGE_FUNCTIONS.items()}
        self.plan_sha = ""
        self.documents = self.tokens = 0

    def driver_events(self) -> LocalEvents:
        return LocalEvents(CrashPoints())

    def start(self, ctx: StageContext) -> None:
        self.plan_sha = hashlib.sha256(ctx.state.plan.read_bytes()).hexdigest()
        self._check_every_node()

    def _check_every_node(self) -> None:
        """Every alive node sees the state folder the driver wrote (a probe file, read back there)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray = self.ray
        token = uuid.uuid4().hex
        name = f".probe-{token}"
        probe = Path(self.state_dir) / name
        probe.write_text(token)
        try:
            task = ray.remote(num_cpus=0, max_retries=self.options.max_retries)(probe_state)
            refs = [
                task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                    self.state_dir, name, token
                )
                for n in ray.nodes()
                if n.get("Alive")
            ]
            problems = [p for p in ray.get(refs, timeout=300) if p is not None]
        finally:
            probe.unlink(missing_ok=True)
        if problems:
            raise BuildConflict(
                "; ".join(problems) + ": sources, shards and the state folder must be on a filesystem every Ray node "
                "mounts at the same path"
            )

    def submit(self, call: StageCall) -> None:
        ref = (
            self.remote[call.stage]
            .options(
                num_cpus=float(self.options.cpus_per_task),
                max_retries=int(self.options.max_retries),
                retry_exceptions=False,  # a stage's own error (bad input) is an answer, not a loss
                name=f"{call.stage}_stage",
            )
            .remote(self.state_dir, self.plan_sha, call)
        )
        self.pending[ref] = call

    def next_result(self, timeout: float) -> StageResult | None:
        if not self.pending:
            return None
        ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        if not ready:
            return None
        call = self.pending.pop(ready[0])
        try:
            value = self.ray.get(ready[0])
        except self.ray.exceptions.RayTaskError as e:
            return StageResult(call, error=getattr(e, "cause", None) or e)
        except self.ray.exceptions.RayError as e:
            raise BuildError(
                f"the Ray task running {call.stage} of {call.index} was lost {self.options.max_retries + 1} times "
                f"({type(e).__name__}); completed work is kept: re-run the same command to resume"
            ) from None
        if call.stage == "read" and value is not None:
            self.documents += int(value.documents)
            self.tokens += int(value.tokens)
        return StageResult(call, value=value)

    def progress(self) -> tuple[int, int] | None:
        return (self.documents, self.tokens) if self.count_progress else None

    def cancel(self) -> None:
        for ref in list(self.pending):
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 - a task that already ended cannot be cancelled
                pass
        self.pending.clear()

    def shutdown(self, *, wait: bool) -> None:
        if not wait:
            self.cancel()

    def join(self) -> None:
        self.cancel()
        if self.own and self.ray.is_initialized():
            self.ray.shutdown()
