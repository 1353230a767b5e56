"""Hugging Face `datasets` as build sources: `Dataset` (Arrow-backed and in memory), `DatasetDict`
splits, `IterableDataset`, `save_to_disk` folders, and hub files that are not parquet (jsonl, csv,
tsv, arrow) through `hf://` from a local hub cache built here.

The oracle is the JSONL route: the same rows written as JSONL and built by the JSONL reader give
byte-identical shards (one task each), or the same stored documents in the same order (several
tasks, cut differently). Datasets are tiny and built from standard-library text with the offline
`bytes` tokenizer; one test uses the dev corpus with GPT-2 (`H5CORPUS_SHARED`).
"""

from __future__ import annotations

import csv
import gzip
import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from h5corpus.build import BuildConfig, BuildError, DatasetSource, build_corpus
from h5corpus.build.input.sources import SourceError
from tests.helpers import (
    read_built,
    read_stage_files,
    run_read_stage,
    stdlib_texts,
    subprocess_env,
    tree,
    without_timings,
    write_jsonl,
)

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """The ``datasets`` module, its cache (lock files, ``load_dataset`` output) under the test's
    temp folder. Imported here, not at collection: the import takes seconds."""
    import datasets

    cache = tmp_path_factory.mktemp("hf-datasets-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        mp.setenv("HF_DATASETS_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield datasets


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Rows in input order: real text, exact duplicates, an empty text, NUL bytes, non-ASCII, and
    texts a CSV or JSON reader might turn into something else ("NA", "123", "null", quotes)."""
    t = stdlib_texts(60)
    extra = ["", "NA", "123", "null", 'a "quoted", comma\nand a newline', "nul\x00byte", "ünïcødé 😀 \u2028 end"]
    return t[:30] + [t[3]] + extra + t[30:] + [t[40], t[3]]


def cfg(root: Path, sources, **kw) -> BuildConfig:
    kw.setdefault("tokenizer", "bytes")
    kw.setdefault("workers", 1)
    kw.setdefault("chunk_tokens", 4096)
    kw.setdefault("shard_tokens", 150_000)
    return BuildConfig(sources=sources, shards_dir=root / "shards", manifest=root / "manifests" / "shards.json", **kw)


def manifest(root: Path) -> dict:
    return json.loads((root / "manifests" / "shards.json").read_text())


def split_counts(root: Path) -> dict:
    """The manifest's per-split counts but the shard count (which follows the task cut)."""
    return {s: {k: v for k, v in d.items() if k != "shards"} for s, d in manifest(root)["splits"].items()}


def stored(root: Path) -> dict:
    """Every stored document per split, in order: (id, token bytes, flags)."""
    return {
        s: [(i, t.tobytes(), f) for i, t, f in docs]
        for s, docs in read_built(root / "manifests" / "shards.json").items()
    }


def jsonl_build(root: Path, rows: list[str], **kw) -> Path:
    """The oracle: ``rows`` as one JSONL file, built by the JSONL reader (one task)."""
    src = write_jsonl(root / "rows.jsonl", rows)
    build_corpus(cfg(root / "out", [str(src)], **kw))
    return root / "out"


# -- Dataset objects ------------------------------------------------------------------------------
def test_dataset_and_the_same_rows_as_jsonl_give_identical_shards(tmp_path, ds, texts):
    """The done-when check: a Dataset (in memory, one task) and its rows as JSONL give the same
    shard files byte for byte and the same split counts, with 1 and 2 workers and with budgets."""
    d = ds.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
    for kw in ({}, {"workers": 2}, {"max_tokens": {"train": 300_000, "validation": 20_000}}):
        ref = jsonl_build(tmp_path / "j", texts, **kw)
        rep = build_corpus(cfg(tmp_path / "d", [d], **kw))
        assert rep.tasks == 1 and rep.documents > 10
        assert tree(tmp_path / "d" / "shards") == tree(ref / "shards")
        assert manifest(tmp_path / "d")["splits"] == manifest(ref)["splits"]
        for p in (tmp_path / "d", tmp_path / "j"):
            shutil.rmtree(p)


@pytest.mark.parametrize(
    "transform",
    ["plain", "shuffle", "filter", "select_range", "select_list", "rename", "concatenate", "map_in_memory"],
)
def test_dataset_rows_in_tasks_equal_the_jsonl_route_for_any_worker_count(tmp_path, ds, texts, transform):
    """An Arrow-backed Dataset (save_to_disk + load_from_disk) after each transform is cut into
    several row-range tasks; 1 and 2 workers give identical bytes, and the stored documents equal
    the JSONL build of the dataset's own rows (``d[column]``, as datasets reads them). File-backed
    results are ``datasets-table`` tasks (reopenable anywhere); in-memory ones ``datasets-object``."""
    ds.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(str(tmp_path / "saved"))
    d = ds.load_from_disk(str(tmp_path / "saved"))
    column = "text"
    d = {
        "plain": lambda: d,
        "shuffle": lambda: d.shuffle(seed=7),
        "filter": lambda: d.filter(lambda r: r["n"] % 3 != 1),
        "select_range": lambda: d.select(range(9, 61)),
        "select_list": lambda: d.select([5, 2, 69, 3, 3, 40, *range(69, -1, -1)]),
        "rename": lambda: d.rename_column("text", "body"),
        "concatenate": lambda: ds.concatenate_datasets([d.select(range(40, 70)), d]),
        "map_in_memory": lambda: d.map(lambda r: {"text": r["text"][::-1]}, keep_in_memory=True),
    }[transform]()
    if transform == "rename":
        column = "body"
    rows = list(d[column])
    ref = jsonl_build(tmp_path / "j", rows)
    src = DatasetSource(d, text_column=column)
    trees = []
    for w in (1, 2):
        rep = build_corpus(cfg(tmp_path / f"w{w}", [src], workers=w, task_bytes=50_000))
        trees.append(tree(tmp_path / f"w{w}"))
    plan_kinds = {t["kind"] for t in _plan_tasks(d, column)}
    in_memory = transform in ("select_list", "map_in_memory")
    assert plan_kinds == {"datasets-object" if in_memory else "datasets-table"}
    assert rep.tasks > 3
    assert trees[0] == trees[1]
    assert stored(tmp_path / "w1") == stored(ref)
    assert split_counts(tmp_path / "w1") == split_counts(ref)


def _plan_tasks(d, column: str) -> list[dict]:
    from h5corpus.build.input.sources import plan_tasks, resolve_sources

    return [t.to_json() for t in plan_tasks(resolve_sources([DatasetSource(d, text_column=column)]), task_bytes=50_000)]


def test_row_ranges_are_cut_by_text_bytes(ds):
    """Tasks cover every row once, in order, and each closes at the first row that brings its
    UTF-8 text bytes (plus one per row) to task_bytes (independent sum over the rows)."""
    rows = ["x" * (i % 170) + "é" * (i % 5) for i in range(3000)] + [""] * 300
    d = ds.Dataset.from_dict({"text": rows})
    tasks = _plan_tasks(d, "text")
    assert [t["start"] for t in tasks] == [0] + [t["stop"] for t in tasks[:-1]] and tasks[-1]["stop"] == len(rows)
    for t in tasks:
        sizes = [len(r.encode()) + 1 for r in rows[t["start"] : t["stop"]]]
        assert t["nbytes"] == sum(sizes)
        if t is not tasks[-1]:
            assert sum(sizes) >= 50_000 > sum(sizes[:-1])


def test_bad_rows_name_the_dataset_row(tmp_path, ds, texts):
    """A null text is a bad record naming the dataset and row: the build stops under fail, and
    under skip it is counted and listed exactly as the JSONL route counts a null text."""
    rows = texts[:20] + [None] + texts[20:40]
    d = ds.Dataset.from_dict({"text": rows})
    with pytest.raises(
        BuildError, match=r"datasets\.Dataset\(fingerprint=\w+, column=text\) row 20: field 'text' is null"
    ):
        build_corpus(cfg(tmp_path / "f", [d]))
    rep = build_corpus(cfg(tmp_path / "s", [d], on_error="skip"))
    assert rep.skipped_total == 1 and "row 20" in rep.skipped_records[0]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    build_corpus(cfg(tmp_path / "j", [str(src)], on_error="skip"))
    assert tree(tmp_path / "s" / "shards") == tree(tmp_path / "j" / "shards")


def test_explain_drops_name_dataset_rows(tmp_path, ds, texts):
    """--explain-drops locates each dropped document by the dataset and its row."""
    d = ds.Dataset.from_dict({"text": texts})
    build_corpus(cfg(tmp_path / "o", [d], task_bytes=50_000, explain_drops=tmp_path / "drops.jsonl"))
    lines = [json.loads(x) for x in (tmp_path / "drops.jsonl").read_text().splitlines()]
    want = []
    seen = set()
    for i, t in enumerate(texts):
        if t == "":
            want.append((i, "empty"))
        elif t in seen:
            want.append((i, "exact_dup"))
        seen.add(t)
    assert [(x["row"], x["reason"]) for x in lines] == want
    assert {x["source"] for x in lines} == {manifest(tmp_path / "o")["source"]["inputs"][0]["spec"]}


# -- choosing splits and columns, refusals --------------------------------------------------------
def test_dataset_dict_split_text_column_and_clear_refusals(tmp_path, ds, texts):
    """A DatasetDict split and a text column are chosen with DatasetSource; ambiguous or wrong
    choices are SourceErrors naming what there is."""
    from datasets.distributed import split_dataset_by_node

    dd = ds.DatasetDict(
        train=ds.Dataset.from_dict({"content": texts[:40], "n": list(range(40))}),
        test=ds.Dataset.from_dict({"content": texts[40:], "n": list(range(len(texts) - 40))}),
    )
    rep = build_corpus(cfg(tmp_path / "t", [DatasetSource(dd, split="test", text_column="content")]))
    ref = jsonl_build(tmp_path / "j", texts[40:])
    assert tree(tmp_path / "t" / "shards") == tree(ref / "shards") and rep.documents > 0
    [inp] = manifest(tmp_path / "t")["source"]["inputs"]
    assert (inp["split"], inp["column"], inp["rows"], inp["fingerprint"]) == (
        "test",
        "content",
        len(texts) - 40,
        dd["test"]._fingerprint,
    )
    refusals = [
        (dd, r"DatasetDict with splits train, test: choose one"),
        (DatasetSource(dd, split="validation"), r"no split 'validation' \(splits: train, test\)"),
        (DatasetSource(dd, split="train"), r"no column 'text' \(columns: content, n\)"),
        (DatasetSource(dd, split="train", text_column="n"), r"column 'n' is Value\('int64'\), not a string column"),
        (42, r"sources: 42 is not a SOURCE"),
        (
            split_dataset_by_node(dd["train"].to_iterable_dataset(), rank=0, world_size=2),
            r"split_dataset_by_node: give the whole dataset",
        ),
    ]
    for source, match in refusals:
        with pytest.raises(SourceError, match=match):
            build_corpus(cfg(tmp_path / "x", [source]))


def test_manifest_records_fingerprint_builder_split_and_hub_revision(tmp_path, ds, texts):
    """load_dataset's Dataset: the manifest records its fingerprint, builder, config, split and
    rows; a dataset whose cache folder is a 40-hex commit (where load_dataset puts a hub dataset)
    records it as the revision."""
    src = write_jsonl(tmp_path / "in" / "rows.jsonl", texts)
    d = ds.load_dataset("json", data_files=str(src), split="train", cache_dir=str(tmp_path / "cache"))
    build_corpus(cfg(tmp_path / "o", [d]))
    [inp] = manifest(tmp_path / "o")["source"]["inputs"]
    assert {k: inp[k] for k in ("kind", "dataset", "builder_name", "config_name", "split", "rows", "fingerprint")} == {
        "kind": "datasets",
        "dataset": "Dataset",
        "builder_name": "json",
        "config_name": "default",
        "split": "train",
        "rows": len(texts),
        "fingerprint": d._fingerprint,
    }
    assert "revision" not in inp and inp["files"] == len(d.cache_files)
    assert tree(tmp_path / "o" / "shards") == tree(jsonl_build(tmp_path / "j", texts) / "shards")
    d.save_to_disk(str(tmp_path / REV))
    build_corpus(cfg(tmp_path / "r", [ds.load_from_disk(str(tmp_path / REV))]))
    assert manifest(tmp_path / "r")["source"]["inputs"][0]["revision"] == REV


# -- IterableDataset ------------------------------------------------------------------------------
def _shards_of(texts: list[str], n: int) -> list[list[str]]:
    k = -(-len(texts) // n)
    return [texts[i * k : (i + 1) * k] for i in range(n)]


def test_iterable_dataset_one_task_per_shard_equals_the_jsonl_route(tmp_path, ds, texts):
    """An IterableDataset from a generator over 4 shards: 4 tasks (shard(4, i)), identical bytes
    for 1 and 2 workers, stored documents equal to the JSONL build of the shards' rows in order;
    with one shard the shard files equal the JSONL route's byte for byte. A row without the text
    column is a bad record naming shard and row."""
    parts = _shards_of(texts, 4)

    def rows(shards):
        for s in shards:
            yield from ({"text": t} for t in s)

    it = ds.IterableDataset.from_generator(rows, gen_kwargs={"shards": parts})
    trees = []
    for w in (1, 2):
        rep = build_corpus(cfg(tmp_path / f"w{w}", [it], workers=w))
        assert rep.tasks == 4
        trees.append(tree(tmp_path / f"w{w}"))
    assert trees[0] == trees[1]
    ref = jsonl_build(tmp_path / "j", [t for p in parts for t in p])
    assert stored(tmp_path / "w1") == stored(ref)
    one = ds.IterableDataset.from_generator(rows, gen_kwargs={"shards": [texts]})
    build_corpus(cfg(tmp_path / "one", [one]))
    assert tree(tmp_path / "one" / "shards") == tree(ref / "shards")
    [inp] = manifest(tmp_path / "w1")["source"]["inputs"]
    assert (inp["dataset"], inp["num_shards"], inp["builder_name"]) == ("IterableDataset", 4, "generator")

    def odd(shards):
        yield {"text": "fine"}
        yield {"body": "no text column here"}

    bad = ds.IterableDataset.from_generator(odd, gen_kwargs={"shards": [0]})
    with pytest.raises(BuildError, match=r"shard 0/1 row 1: no field 'text' \(fields: body\)"):
        build_corpus(cfg(tmp_path / "bad", [bad]))


def test_to_iterable_dataset_shards_equal_the_dataset(tmp_path, ds, texts):
    """Dataset.to_iterable_dataset(num_shards=3) stores the same documents as the Dataset."""
    d = ds.Dataset.from_dict({"text": texts})
    rep = build_corpus(cfg(tmp_path / "i", [d.to_iterable_dataset(num_shards=3)], workers=2))
    assert rep.tasks == 3
    build_corpus(cfg(tmp_path / "d", [d]))
    assert stored(tmp_path / "i") == stored(tmp_path / "d")


def test_streaming_load_dataset_dict_with_one_split_equals_the_jsonl_route(tmp_path, ds, texts):
    """load_dataset(..., streaming=True) without a split gives an IterableDatasetDict: its only split
    is read (one task per data file), storing the JSONL route's documents; the manifest names it."""
    a = write_jsonl(tmp_path / "in" / "a.jsonl", texts[:35])
    b = write_jsonl(tmp_path / "in" / "b.jsonl", texts[35:])
    it = ds.load_dataset("json", data_files=[str(a), str(b)], streaming=True)
    assert isinstance(it, ds.IterableDatasetDict) and list(it) == ["train"]
    rep = build_corpus(cfg(tmp_path / "s", [it], workers=2))
    assert rep.tasks == 2
    build_corpus(cfg(tmp_path / "j", [str(a), str(b)]))
    assert stored(tmp_path / "s") == stored(tmp_path / "j")
    [inp] = manifest(tmp_path / "s")["source"]["inputs"]
    assert (inp["dataset"], inp["split"], inp["num_shards"], inp["builder_name"]) == (
        "IterableDataset",
        "train",
        2,
        "json",
    )


# -- the persisted plan: other processes, kill -9 and resume -------------------------------------
_DATASET_BUILD = (
    "import json, sys\n"
    "import datasets\n"
    "from h5corpus.build import BuildConfig, build_corpus\n"
    "cfg = json.loads(sys.argv[1])\n"
    "texts = json.loads(open(sys.argv[2], encoding='utf-8').read())\n"
    "if cfg['sources'] == ['<in-memory>']:\n"
    "    cfg['sources'] = [datasets.Dataset.from_dict({'text': texts})]\n"
    "build_corpus(BuildConfig(**cfg))\n"
)


def _killed_build(tmp_path: Path, root: Path, sources: list[str], texts: list[str], point: str) -> Path:
    """Run a build in a subprocess killed at ``point`` (H5CORPUS_TEST_CRASH_AT); its state folder."""
    from h5corpus.build.run.executor import CRASH_ENV

    (tmp_path / "texts.json").write_text(json.dumps(texts), encoding="utf-8")
    c = {k: v for k, v in asdict(cfg(root, sources, task_bytes=50_000)).items() if k != "filters"}
    c = {k: (str(v) if isinstance(v, Path) else v) for k, v in c.items()}
    p = subprocess.run(
        [sys.executable, "-c", _DATASET_BUILD, json.dumps(c), str(tmp_path / "texts.json")],
        env=dict(subprocess_env(), **{CRASH_ENV: point}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == -9, (p.returncode, p.stderr[-2000:])
    return root / "shards" / ".build"


def test_arrow_backed_tasks_run_from_the_state_folder_in_another_process_and_resume(tmp_path, ds, texts):
    """A save_to_disk folder given as SOURCE: a build killed after its first read record leaves a
    plan from which a fresh interpreter (nothing but the state folder) reruns that task to the same
    record and files; resuming gives the uninterrupted build's bytes."""
    folder = tmp_path / "saved"
    ds.Dataset.from_dict({"text": texts}).save_to_disk(str(folder))
    build_corpus(cfg(tmp_path / "ref", [str(folder)], task_bytes=50_000))
    root = tmp_path / "b"
    state = _killed_build(tmp_path, root, [str(folder)], texts, "read-record")
    [rec_path] = (state / "read").glob("*.json")
    index = int(rec_path.stem)
    plan = json.loads((state / "plan.json").read_text())
    assert plan["tasks"][index]["kind"] == "datasets-table"
    before = read_stage_files(state, index)
    (tmp_path / "elsewhere").mkdir()
    got = run_read_stage(state, index, cwd=tmp_path / "elsewhere")
    assert without_timings(got) == without_timings(json.loads(rec_path.read_text())) and got["documents"] > 0
    assert read_stage_files(state, index) == before
    rep = build_corpus(cfg(root, [str(folder)], task_bytes=50_000))
    assert rep.resumed and rep.tasks_reused >= 1
    assert tree(root) == tree(tmp_path / "ref")


def test_in_memory_tasks_refuse_another_process_and_resume_with_the_same_rows(tmp_path, ds, texts):
    """An in-memory Dataset: a process that loads the plan from the state folder gets a SourceError
    saying the task needs the planning process; re-running the build with the same rows (same
    fingerprint) in a new process resumes it to the uninterrupted build's bytes."""
    from h5corpus.build.stages.buildplan import StageContext
    from h5corpus.build.stages.tasks import read_task

    build_corpus(cfg(tmp_path / "ref", [ds.Dataset.from_dict({"text": texts})], task_bytes=50_000))
    root = tmp_path / "b"
    state = _killed_build(tmp_path, root, ["<in-memory>"], texts, "decided:2")
    ctx = StageContext.load(state)
    assert ctx.plan.tasks[0].kind == "datasets-object" and ctx.plan.tasks[0].live is None
    with pytest.raises(SourceError, match=r"in-memory datasets object that only the process that planned"):
        read_task(ctx, 0)
    rep = build_corpus(cfg(root, [ds.Dataset.from_dict({"text": texts})], task_bytes=50_000))
    assert rep.resumed and rep.tasks_reused >= 2
    assert tree(root) == tree(tmp_path / "ref")


@pytest.mark.parametrize("executor", ["ray", "slurm"])
def test_cluster_executors_refuse_in_memory_datasets_before_submitting(tmp_path, ds, texts, executor):
    """Ray and Slurm workers load the plan from the state folder, where an in-memory Dataset cannot
    be: the build refuses it up front, naming the remedy, and neither writes a plan nor submits."""
    with pytest.raises(SourceError, match=r"held in this process's memory.*save_to_disk"):
        build_corpus(cfg(tmp_path, [ds.Dataset.from_dict({"text": texts})], executor=executor, task_bytes=50_000))
    assert not list((tmp_path / "shards").glob(".build/plan*"))
    assert not (tmp_path / "manifests" / "shards.json").exists()


def test_cli_builds_a_save_to_disk_folder_and_refuses_a_dataset_dict_folder(tmp_path, ds, texts):
    """`h5corpus build FOLDER` reads a save_to_disk folder (exit 0, validated, the JSONL route's
    shards); a saved DatasetDict folder is a usage error naming its splits (exit 2)."""
    ds.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    ds.DatasetDict(a=ds.Dataset.from_dict({"text": ["x"]})).save_to_disk(str(tmp_path / "dict"))
    env = dict(subprocess_env(), HF_DATASETS_CACHE=str(tmp_path / "cache"))

    def cli(src: Path, out: Path):
        args = ["build", str(src), "--tokenizer", "bytes", "--workers", "1", "--validate"]
        args += ["--shards-dir", str(out / "shards"), "--manifest", str(out / "manifests" / "shards.json")]
        args += ["--shard-tokens", "150000"]
        return subprocess.run([sys.executable, "-m", "h5corpus", *args], env=env, capture_output=True, text=True)

    p = cli(tmp_path / "saved", tmp_path / "o")
    assert p.returncode == 0, p.stderr[-2000:]
    ref = jsonl_build(tmp_path / "j", texts, chunk_tokens=BuildConfig().chunk_tokens)
    assert tree(tmp_path / "o" / "shards") == tree(ref / "shards")
    p = cli(tmp_path / "dict", tmp_path / "o2")
    assert p.returncode == 2 and "a saved DatasetDict (splits a); give one split's folder" in p.stderr


# -- hub datasets that are not parquet -------------------------------------------------------------
def _snapshot(tmp_path: Path) -> Path:
    snap = tmp_path / "hub" / "datasets--org--name" / "snapshots" / REV
    snap.mkdir(parents=True)
    (snap / ".gitattributes").write_text("*.arrow filter=lfs\n")
    (snap / "README.md").write_text("---\nlicense: mit\n---\n")
    return snap


def _hub(tmp_path: Path, name: str, path: str, **kw) -> BuildConfig:
    kw.setdefault("workers", 2)
    return cfg(tmp_path / name, [f"hf://datasets/org/name@{REV}/{path}"], hf_cache_dir=tmp_path / "hub", **kw)


def test_hub_jsonl_files_read_by_datasets_equal_the_jsonl_route(tmp_path, ds, texts, monkeypatch):
    """hf://datasets/ORG/NAME@REV/PATH over jsonl (and jsonl.gz) files of a local hub snapshot: one
    task per file, read by datasets' json builder, gives the shards the build's own JSONL reader
    gives for the same files; the manifest records repo, revision, path and format."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = _snapshot(tmp_path)
    a = write_jsonl(snap / "data" / "part-0.jsonl", texts[:40])
    b = write_jsonl(snap / "data" / "part-1.jsonl", texts[40:])
    rep = build_corpus(_hub(tmp_path, "h", "data"))
    assert rep.tasks == 2
    build_corpus(cfg(tmp_path / "j", [str(a), str(b)]))
    assert tree(tmp_path / "h" / "shards") == tree(tmp_path / "j" / "shards")
    [inp] = manifest(tmp_path / "h")["source"]["inputs"]
    assert (inp["repo"], inp["revision"], inp["path"], inp["format"], inp["files"]) == (
        "org/name",
        REV,
        "data",
        "jsonl",
        2,
    )
    (snap / "gz").mkdir()
    for p in (a, b):
        (snap / "gz" / (p.name + ".gz")).write_bytes(gzip.compress(p.read_bytes()))
    build_corpus(_hub(tmp_path, "gz", "gz"))
    assert tree(tmp_path / "gz" / "shards") == tree(tmp_path / "j" / "shards")


def test_hub_csv_tsv_and_arrow_files_keep_every_text_as_written(tmp_path, ds, texts, monkeypatch):
    """CSV and TSV (quotes, commas, newlines, "NA", "123", "null", "" stay text) and an Arrow stream
    file on the hub store exactly the documents of the JSONL route; a folder of mixed formats is
    refused naming them, and a glob chooses one."""
    import pyarrow as pa

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = _snapshot(tmp_path)
    (snap / "csv").mkdir()
    with open(snap / "csv" / "rows.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "text"])
        w.writerows([i, t] for i, t in enumerate(texts) if "\x00" not in t)  # pandas stops a field at NUL
    with open(snap / "csv" / "rows.tsv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, delimiter="\t")
        w.writerow(["text", "id"])
        w.writerows([t, i] for i, t in enumerate(texts) if "\x00" not in t)
    (snap / "arrow").mkdir()
    table = pa.table({"text": texts, "n": list(range(len(texts)))})
    with pa.OSFile(str(snap / "arrow" / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=17)
    (snap / "arrow" / "dataset_info.json").write_text("{}")
    no_nul = [t for t in texts if "\x00" not in t]
    ref = jsonl_build(tmp_path / "j", no_nul, validation_fraction=0.0)
    for name, path in (("csv", "csv/*.csv"), ("tsv", "csv/rows.tsv")):
        build_corpus(_hub(tmp_path, name, path, validation_fraction=0.0))
        assert stored(tmp_path / name) == stored(ref), name
    build_corpus(_hub(tmp_path, "arrow", "arrow"))
    assert tree(tmp_path / "arrow" / "shards") == tree(jsonl_build(tmp_path / "ja", texts) / "shards")
    assert manifest(tmp_path / "arrow")["source"]["inputs"][0]["format"] == "arrow"
    with pytest.raises(SourceError, match=r"holds csv and tsv files; name one kind"):
        build_corpus(_hub(tmp_path, "x", "csv"))
    with pytest.raises(SourceError, match=r"no data files there"):
        build_corpus(_hub(tmp_path, "x", "README.md"))


# -- the dev corpus -------------------------------------------------------------------------------
def test_dev_corpus_through_load_dataset_equals_the_jsonl_route(tmp_path, ds, shared, gpt2_json):
    """The dev corpus loaded with load_dataset("json") (Arrow cache files) and built with GPT-2 on
    2 workers stores the same documents, in the same order, as the JSONL route over the same files."""
    files = sorted((shared / "corpora" / "dev").glob("*.jsonl"))
    if not files:
        pytest.skip(f"dev corpus not found under {shared / 'corpora' / 'dev'} (set H5CORPUS_SHARED)")
    features = ds.Features({k: ds.Value("string") for k in ("id", "text", "source", "url")})  # url: some files
    d = ds.load_dataset(
        "json", data_files=[str(f) for f in files], split="train", cache_dir=str(tmp_path / "c"), features=features
    )
    rep = build_corpus(cfg(tmp_path / "d", [d], tokenizer=str(gpt2_json), workers=2, shard_tokens=1 << 22))
    build_corpus(
        cfg(tmp_path / "j", [str(f) for f in files], tokenizer=str(gpt2_json), workers=2, shard_tokens=1 << 22)
    )
    assert rep.encoder != "tokenizers" and rep.documents > 10_000
    assert stored(tmp_path / "d") == stored(tmp_path / "j")
    assert split_counts(tmp_path / "d") == split_counts(tmp_path / "j")
