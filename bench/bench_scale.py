"""The same build through the local, Ray and Slurm executors; per-task and per-stage costs; the decide
stage's memory per million documents, in memory vs bucketed.

    flock /tmp/h5corpus-bench.lock python bench/bench_scale.py [--rounds 2] [--docs 200000]
        [--corpus ../shared/corpora/dev] [--tokenizer ../shared/tokenizers/gpt2/tokenizer.json]
        [--skip-engines] [--out bench/results/scale.json]

* ``engines``: one build (the dev corpus with GPT-2, ``--task-bytes 4000000``, so ~9 tasks) through
  ``--executor local`` (2 workers; decided in memory, and with ``--decide-buckets 2``), ``ray``
  (tests/clusters.py: two nodes of 1 CPU on this machine) and ``slurm`` (one node, 2 CPUs; needs
  root), best of ``--rounds``; each engine's wall time as a ratio to the local build's. The
  clusters' start-up is reported apart, never timed in a build.
* ``fixed_costs``: what one stage call costs an engine beyond its work: a ``build-stage`` command
  that finds its record done (process start, imports, loading the plan: every Slurm array element
  pays it), a Ray no-op task's round trip on the warm cluster, and the latency of a one-job Slurm
  submission and of an ``afterok`` link (submission to completion of a no-op job, and of its
  dependent).
* ``stages``: every stage of the same build run in this process from the state folder, one after
  the other (``h5corpus.build.stages.dispatch``): seconds per call, and per stage (wall and CPU seconds).
* ``decide_memory``: a synthetic JSONL corpus of ``--docs`` short documents (10 % exact copies,
  20 % near copies: one word changed) read with ``--near-dedup``; then the decide stage over its
  state folder in memory (:func:`h5corpus.build.stages.decide.decide`, the in-memory ids and LSH index)
  and bucketed (every bucket, then the merge) with 1 and 8 buckets: tracemalloc peak per process,
  as bytes per million documents, and seconds. Both give the same decisions (checked here).

Prints JSON with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from _report import emit  # bench/ is on sys.path when a bench runs as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.clusters import EngineUnavailable, RayCluster, SlurmCluster, _cluster_root, wait_until  # noqa: E402
from tests.helpers import subprocess_env  # noqa: E402


def cli_build(args: list[str], out: Path, env: dict[str, str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    where = ["--shards-dir", str(out / "shards"), "--manifest", str(out / "manifests" / "shards.json")]
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "h5corpus", "build", *args, *where], env=env, capture_output=True, text=True, cwd=out
    )
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"build {args} failed: {p.stderr[-2000:]}")
    return dt


def best(fn, rounds: int) -> float:
    return min(fn() for _ in range(rounds))


# -- engines and their fixed costs ------------------------------------------------------------------


def engines(args: list[str], rounds: int, tmp: Path) -> dict:
    env = subprocess_env()
    out: dict = {"build_args": args, "seconds": {}, "ready_s": {}}
    sec = out["seconds"]
    sec["local_2_workers"] = best(lambda: cli_build(args + ["--workers", "2"], tmp / "local", env), rounds)
    sec["local_2_workers_bucketed"] = best(
        lambda: cli_build(args + ["--workers", "2", "--decide-buckets", "2"], tmp / "localb", env), rounds
    )
    out["fixed_costs"] = {"build_stage_noop_s": noop_stage_command(args, tmp, env)}
    try:
        root = _cluster_root("h5c-ray-")
        with RayCluster.start(root) as ray:
            out["ready_s"]["ray"] = round(ray.ready_s, 2)
            ra = args + ["--executor", "ray", "--ray-address", ray.address, "--decide-buckets", "2"]
            sec["ray"] = best(lambda: cli_build(ra, ray.shared_dir / "b", ray.env), rounds)
            out["fixed_costs"]["ray_noop_task_s"] = ray_noop(ray)
        shutil.rmtree(root, ignore_errors=True)  # stopped cleanly: its files go (a failed start keeps them)
    except EngineUnavailable as e:
        out["ray"] = f"skipped: {e}"
    try:
        root = _cluster_root("h5c-slurm-")
        with SlurmCluster.start(root) as slurm:
            out["ready_s"]["slurm"] = round(slurm.ready_s, 2)
            sa = args + ["--executor", "slurm", "--decide-buckets", "2", "--wait"]
            sec["slurm"] = best(lambda: cli_build(sa, tmp / "slurm", slurm.env), rounds)
            out["fixed_costs"].update(slurm_latency(slurm, tmp))
        shutil.rmtree(root, ignore_errors=True)
    except EngineUnavailable as e:
        out["slurm"] = f"skipped: {e}"
    base = sec["local_2_workers"]
    out["ratio_to_local"] = {k: round(v / base, 2) for k, v in sec.items()}
    out["seconds"] = {k: round(v, 3) for k, v in sec.items()}
    return out


def noop_stage_command(args: list[str], tmp: Path, env: dict[str, str]) -> float:
    """Seconds of a ``build-stage read`` whose record is already there (median of 5)."""
    out = tmp / "noop"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    where = ["--shards-dir", str(out / "shards"), "--manifest", str(out / "m.json")]
    subprocess.run([sys.executable, "-m", "h5corpus", "build", *args, *where, "--executor", "slurm", "--dry-run"],
                   env=env, capture_output=True, check=True, cwd=out)  # fmt: skip
    state = str(out / "shards" / ".build")
    cmd = [sys.executable, "-m", "h5corpus", "build-stage", "read", "--state", state, "--task-index", "0"]
    subprocess.run(cmd, env=env, capture_output=True, check=True)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[2], 3)


def _noop() -> int:
    return 0


def ray_noop(cluster: RayCluster) -> float:
    with cluster.connect() as ray:
        f = ray.remote(num_cpus=1)(_noop)
        ray.get([f.remote() for _ in range(4)])  # start the workers
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            ray.get(f.remote())
            times.append(time.perf_counter() - t0)
    return round(sorted(times)[15], 4)


def slurm_latency(cluster: SlurmCluster, tmp: Path) -> dict:
    """Submission -> COMPLETED of a no-op job, and of a job afterok on it (median of 3)."""
    one, link = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        a = cluster.sbatch("--output=/dev/null", "--wrap=true")
        b = cluster.sbatch(f"--dependency=afterok:{a}", "--output=/dev/null", "--wrap=true")
        cluster.wait(a)
        t1 = time.perf_counter()
        cluster.wait(b)
        one.append(t1 - t0)
        link.append(time.perf_counter() - t1)
    return {"slurm_job_s": round(sorted(one)[1], 3), "slurm_afterok_link_s": round(sorted(link)[1], 3)}


# -- stages in process ------------------------------------------------------------------------------


def stages(args: list[str], tmp: Path) -> dict:
    from h5corpus.build.stages import dispatch as st

    out = tmp / "stages"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    where = ["--shards-dir", str(out / "shards"), "--manifest", str(out / "m.json")]
    subprocess.run([sys.executable, "-m", "h5corpus", "build", *args, *where, "--executor", "slurm", "--dry-run", "--decide-buckets", "2"],
                   env=subprocess_env(), capture_output=True, check=True, cwd=out)  # fmt: skip
    state = out / "shards" / ".build"
    status = st.stage_status(state)
    t: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def timed(name, fn, *a):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(state, *a)
        t.setdefault(name, []).append(time.perf_counter() - t0)
        cpu.setdefault(name, []).append(time.process_time() - c0)

    for i in range(status["tasks"]):
        timed("read", st.stage_read, i)
    for b in range(status["buckets"]):
        timed("bucket", st.stage_bucket, b)
    timed("decide", st.stage_decide)
    for i in range(status["tasks"]):
        timed("finish", st.stage_finish, i)
    timed("commit", st.stage_commit)
    return {
        "tasks": status["tasks"],
        "buckets": status["buckets"],
        "per_call_s": {k: round(sum(v) / len(v), 4) for k, v in t.items()},
        "per_stage_s": {k: round(sum(v), 3) for k, v in t.items()},
        # CPU seconds of this process: what a stage costs a core, less sensitive to the machine's load
        "per_call_cpu_s": {k: round(sum(v) / len(v), 4) for k, v in cpu.items()},
        "per_stage_cpu_s": {k: round(sum(v), 3) for k, v in cpu.items()},
    }


# -- decide memory ----------------------------------------------------------------------------------


def synthetic_corpus(path: Path, n: int, seed: int = 3) -> None:
    """``n`` documents of 100 words: 10 % exact copies and 20 % near copies (one word changed: a
    Jaccard similarity of ~0.9 over 5-word shingles) of earlier ones, the rest new."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(20000)]
    docs: list[str] = []
    with open(path, "w") as fh:
        for _ in range(n):
            r = rng.random()
            if docs and r < 0.1:
                text = rng.choice(docs)
            elif docs and r < 0.3:
                words = rng.choice(docs).split()
                words[rng.randrange(len(words))] = rng.choice(vocab)
                text = " ".join(words)
            else:
                text = " ".join(rng.choice(vocab) for _ in range(100))
            if len(docs) < 50000:
                docs.append(text)
            fh.write(json.dumps({"text": text}) + "\n")


def _peak(fn):
    """(result, tracemalloc peak bytes, seconds): timed in a run of its own (tracing slows Python
    several times), then traced in a second run."""
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    tracemalloc.start()
    tracemalloc.reset_peak()
    result = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, peak, dt


def decide_memory(n: int, tmp: Path) -> dict:
    from concurrent.futures import ProcessPoolExecutor

    from h5corpus.build.stages import dispatch as st
    from h5corpus.build.stages.buckets import bucket_file, run_bucket
    from h5corpus.build.stages.buildplan import StageContext
    from h5corpus.build.stages.decide import DecideInput, Decider, decide
    from h5corpus.build.stages.merge import merge_buckets

    out = tmp / "mem"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    synthetic_corpus(out / "syn.jsonl", n)
    args = [str(out / "syn.jsonl"), "--tokenizer", "bytes", "--near-dedup", "--task-bytes", "4000000"]
    where = ["--shards-dir", str(out / "shards"), "--manifest", str(out / "m.json")]
    subprocess.run([sys.executable, "-m", "h5corpus", "build", *args, *where, "--executor", "slurm", "--dry-run"],
                   env=subprocess_env(), capture_output=True, check=True, cwd=out)  # fmt: skip
    state = out / "shards" / ".build"
    tasks = st.stage_status(state)["tasks"]
    with ProcessPoolExecutor(2) as pool:
        list(pool.map(st.stage_read, [state] * tasks, range(tasks)))
    ctx = StageContext.load(state)
    reads = st.load_read_records(ctx)
    lsh = st.stage_lsh(ctx)

    def in_memory():
        inputs = (DecideInput(r, *ctx.state.load_read_outputs(r)) for r in reads)
        return decide(Decider.for_plan(ctx.plan, ctx.filters), inputs)

    want, peak, dt = _peak(in_memory)
    res: dict = {"documents": n, "tasks": tasks}
    res["in_memory"] = {
        "peak_bytes": peak,
        "peak_bytes_per_million_docs": int(peak * 1e6 / n),
        "seconds_per_million_docs": round(dt * 1e6 / n, 2),
    }

    def one_bucket(b: int, buckets: int):
        bucket_file(ctx.state, b, "").unlink(missing_ok=True)  # never reuse: measure the work
        return run_bucket(ctx.state, reads, lsh, b, buckets)

    for buckets in (1, 8):
        peaks, secs, records = [], 0.0, []
        for b in range(buckets):
            rec, bpeak, bdt = _peak(lambda: one_bucket(b, buckets))
            records.append(rec)
            peaks.append(bpeak)
            secs += bdt
        got, mpeak, mdt = _peak(lambda: merge_buckets(ctx, reads, records, lsh))
        same = (
            all((got.decisions[d.index].keep == d.keep).all() for d in want.decisions)
            and got.decider.splits == want.splits
        )
        res[f"bucketed_{buckets}"] = {
            "bucket_peak_bytes": max(peaks),
            "merge_peak_bytes": mpeak,
            "bucket_peak_bytes_per_million_docs": int(max(peaks) * 1e6 / n),
            "merge_peak_bytes_per_million_docs": int(mpeak * 1e6 / n),
            "bucket_seconds_per_million_docs": round(secs * 1e6 / n, 2),
            "merge_seconds_per_million_docs": round(mdt * 1e6 / n, 2),
            "near_fallbacks": got.fallbacks,
            "same_decisions_as_in_memory": bool(same),
        }
    res["kept_documents"] = sum(int(s["documents"]) for s in want.splits.values())
    res["near_duplicates"] = sum(int(s["near_duplicates"]) for s in want.splits.values())
    res["exact_duplicates"] = sum(int(s["duplicates"]) for s in want.splits.values())
    return res


def progress(report: dict, out: Path | None) -> None:
    """Each part as it ends, on stderr and in ``out``: a later part's failure keeps the earlier ones."""
    print(json.dumps(report), file=sys.stderr, flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared = Path(os.environ.get("H5CORPUS_SHARED", REPO.parent / "shared"))
    ap.add_argument("--corpus", type=Path, default=shared / "corpora" / "dev")
    ap.add_argument("--tokenizer", type=Path, default=shared / "tokenizers" / "gpt2" / "tokenizer.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    args = [str(a.corpus), "--tokenizer", str(a.tokenizer), "--task-bytes", "4000000", "--shard-tokens", "4000000"]
    report: dict = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="h5c-bench-scale-") as d:
        tmp = Path(d)
        if not a.skip_engines:
            report["engines"] = engines(args, a.rounds, tmp)
            progress(report, a.out)
        report["stages"] = stages(args, tmp)
        progress(report, a.out)
        report["decide_memory"] = decide_memory(a.docs, tmp)
    report["load_after"] = os.getloadavg()
    emit(report, a.out)


if __name__ == "__main__":
    main()


__all__ = ["wait_until"]
