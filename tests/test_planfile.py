"""Plan files: the best-fit loader's epoch plan computed once, shared through the filesystem.

A dataset with ``plan_dir`` yields exactly the batches of the in-memory plan (the reference is
the same dataset without ``plan_dir``); a file written once is reused by later datasets and
processes; ``len()`` and iteration from an existing file never ask the corpus for its document
lengths (the O(documents) call); a stale file (other epoch, settings or corpus) or a damaged one
(a flipped header or array byte) is never used; concurrent processes write a plan once; the
``h5corpus plan`` command writes the files a dataset then reads. Argument validation of the
loaders' epochs, positions and mixture sizes is here too (one rule, a message naming the argument).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus
from h5corpus.cli import app
from h5corpus.loaders import chunking, epochplan
from h5corpus.loaders.epochplan import PlanSettings, plan_epoch
from h5corpus.loaders.mixture import mix
from h5corpus.loaders.planfile import BLOCK, DTYPES, PlanFileError, ensure_plan_file, materialize, open_plan_file
from h5corpus.loaders.state import LoaderStateError
from tests.helpers import batch_digest, interleave_ranks

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create", "ignore:'set_vital' is deprecated")

MODES = {
    "buffer": dict(max_seq_len=1024, batch_size=5, packing_buffer=32, seed=3),
    "bfd": dict(max_seq_len=1024, batch_size=5, packing_buffer=400, seed=3, mode="bfd"),
}


class NoLengths:
    """A corpus that refuses the O(documents) calls (everything else passes through)."""

    def __init__(self, corpus) -> None:
        self._corpus = corpus

    def doc_lengths(self):
        raise AssertionError("doc_lengths() called: O(documents) work with a plan file present")

    def __getattr__(self, name):
        return getattr(self._corpus, name)


def digests(ds) -> list[str]:
    return [batch_digest(b) for b in ds]


def plan_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.h5cplan"))


@pytest.mark.parametrize("mode", list(MODES))
def test_plan_file_gives_the_in_memory_sequence_and_is_reused(stdlib_manifest, tmp_path, mode):
    corpus = open_corpus(stdlib_manifest, "train")
    kw = MODES[mode]
    ref = digests(BestFitDataset(corpus, **kw, with_segments=True))
    pdir = tmp_path / "plans"
    ds = BestFitDataset(corpus, **kw, plan_dir=pdir, with_segments=True)
    assert len(ds) == len(ref)
    assert digests(ds) == ref
    [f] = plan_files(pdir)
    stamp = f.stat().st_mtime_ns, f.stat().st_ino
    again = BestFitDataset(NoLengths(corpus), **kw, plan_dir=pdir, with_segments=True)
    assert len(again) == len(ref) and digests(again) == ref  # from the file: no doc_lengths() call
    assert (f.stat().st_mtime_ns, f.stat().st_ino) == stamp and plan_files(pdir) == [f]


def test_plan_file_across_ranks_and_workers_and_resume(stdlib_manifest, tmp_path):
    """2 ranks x 2 DataLoader workers from one plan file: the 1-process sequence, equal counts;
    a state saved mid-epoch resumes on 1 rank with the next microbatch."""
    corpus = open_corpus(stdlib_manifest, "train")
    ref = digests(BestFitDataset(corpus, **MODES["buffer"]))
    pdir = tmp_path / "plans"
    per_rank = []
    for r in range(2):
        ds = BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir, rank=r, world_size=2)
        per_rank.append([batch_digest(b) for b in StatefulDataLoader(ds, batch_size=None, num_workers=2)])
        assert len(per_rank[-1]) == len(ds) == -(-len(ref) // 2)
    got = interleave_ranks(per_rank)
    assert got == [ref[i % len(ref)] for i in range(len(got))]
    ds = BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir, rank=0, world_size=2)
    it = iter(ds)
    for _ in range(3):
        next(it)
    st = ds.state_dict()
    one = BestFitDataset(NoLengths(corpus), **MODES["buffer"], plan_dir=pdir)
    one.load_state_dict(st)
    assert digests(one) == ref[6:]
    assert len(plan_files(pdir)) == 1


def test_a_stale_plan_file_is_never_used(stdlib_manifest, tmp_path):
    corpus = open_corpus(stdlib_manifest, "train")
    pdir = tmp_path / "plans"
    ds = BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir)
    ds.shared_plan(0)
    [f0] = plan_files(pdir)
    for field, identity in (
        ("epoch", ds.plan_identity(1)),
        ("settings", BestFitDataset(corpus, **{**MODES["buffer"], "seed": 4}).plan_identity(0)),
        ("fingerprint", {**ds.plan_identity(0), "fingerprint": "0" * 64}),
    ):
        with pytest.raises(PlanFileError, match=f"stale, its {field}"):
            open_plan_file(f0, identity)
    # epoch 0's file placed under epoch 1's name: refused and rewritten, epoch 1 served
    ds.shared_plan(1)
    f1 = next(p for p in plan_files(pdir) if p != f0)
    shutil.copyfile(f0, f1)
    ref1 = digests(BestFitDataset(corpus, **MODES["buffer"], epoch=1))
    with pytest.warns(UserWarning, match="stale, its epoch"):
        got = digests(BestFitDataset(corpus, **MODES["buffer"], epoch=1, plan_dir=pdir))
    assert got == ref1


def _header(path: Path) -> tuple[int, dict]:
    """(first byte of the arrays, header) of a plan file, from its documented layout (preamble,
    header, checksum table, arrays, each 64-byte aligned)."""
    raw = path.read_bytes()
    magic, hlen, _ = struct.unpack_from("<8sQ32s16x", raw, 0)
    assert magic == b"H5CPLAN\x01"
    header = json.loads(raw[64 : 64 + hlen])
    return -(-(64 + hlen) // 64) * 64 + -(-(8 * header["sums"][0]) // 64) * 64, header


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_damaged_plan_file_is_never_used(stdlib_manifest, tmp_path):
    corpus = open_corpus(stdlib_manifest, "train")
    pdir = tmp_path / "plans"
    ref = digests(BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir))
    [f] = plan_files(pdir)
    body, header = _header(f)
    _flip(f, 64 + 10)  # a header byte: refused at open, rewritten
    with pytest.raises(PlanFileError, match="damaged"):
        open_plan_file(f, BestFitDataset(corpus, **MODES["buffer"]).plan_identity(0))
    with pytest.warns(UserWarning, match="damaged"):
        assert digests(BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir)) == ref
    shutil.copyfile(f, tmp_path / "good")
    _flip(
        f, -(-(64 + len(json.dumps(header, sort_keys=True))) // 64) * 64 + 3
    )  # a checksum-table byte: refused at open
    with pytest.raises(PlanFileError, match="checksum table fails"):
        open_plan_file(f, BestFitDataset(corpus, **MODES["buffer"]).plan_identity(0))
    shutil.copyfile(tmp_path / "good", f)
    # an array byte: its microbatch is refused when first read (oracle: the undamaged file's bounds)
    good = open_plan_file(f, BestFitDataset(corpus, **MODES["buffer"]).plan_identity(0))
    seg_mb = np.repeat(np.arange(good.num_microbatches), np.diff(good._arrays["pack_starts"][good._arrays["mb_packs"]]))
    for name in ("seg_start", "seg_len", "mb_packs", "mb_sums"):
        shutil.copyfile(f, tmp_path / "good")
        a = header["arrays"][name]
        _flip(f, body + a["offset"] + a["nbytes"] // 2)
        row = a["nbytes"] // 2 // np.dtype(DTYPES[name]).itemsize
        want = {
            "seg_start": f"microbatch {seg_mb[row]} fails its checksum",
            "seg_len": f"microbatch {seg_mb[row]} (fails its checksum|is damaged)",
            "mb_packs": f"microbatch {row - 1} (fails its checksum|is damaged)",  # the first that reads it
            "mb_sums": f"'mb_sums' block {a['nbytes'] // 2 // BLOCK} fails its checksum",
        }[name]
        ds = BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir)
        with pytest.raises(PlanFileError, match=want):
            digests(ds)
        shutil.copyfile(tmp_path / "good", f)
    _flip(f, body + header["arrays"]["source_tokens"]["offset"] + 8)
    ds = BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir)
    ds.seek(2)
    with pytest.raises(PlanFileError, match="source_tokens' block 0"):
        ds.state_dict()


def _count_builds(folder: str, log: str) -> int:
    """One process of the race below: the plan of fixed lengths; each build appends to ``log``."""
    lengths = np.random.default_rng(0).integers(2, 3000, size=5000)
    settings = PlanSettings(1024, 4, 16)

    def build():
        with open(log, "a") as f:
            f.write("built\n")
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return materialize(plan_epoch(lengths, settings), offsets)

    identity = {"fingerprint": "f" * 64, "settings": settings.as_dict(), "epoch": 0}
    return ensure_plan_file(folder, identity, build)[0].num_microbatches


def test_concurrent_processes_write_a_plan_once(tmp_path):
    log = tmp_path / "builds.log"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        counts = pool.starmap(_count_builds, [(str(tmp_path / "plans"), str(log))] * 3)
    assert log.read_text().count("built") == 1
    assert len(set(counts)) == 1 and counts[0] > 0
    assert len(plan_files(tmp_path / "plans")) == 1


def test_plan_command_writes_the_files_a_dataset_reads(stdlib_manifest, tmp_path):
    pdir = tmp_path / "plans"
    args = ["plan", str(stdlib_manifest), "--plan-dir", str(pdir), "--max-seq-len", "1024", "--batch-size", "5"]
    res = CliRunner().invoke(app, [*args, "--packing-buffer", "32", "--seed", "3", "--epochs", "2"])
    assert res.exit_code == 0, res.output
    files = plan_files(pdir)
    assert len(files) == 2 and sorted(res.output.split()) == [str(p) for p in files]
    stamps = [p.stat().st_mtime_ns for p in files]
    corpus = open_corpus(stdlib_manifest, "train")
    for e in (0, 1):
        ref = digests(BestFitDataset(corpus, **MODES["buffer"], epoch=e))
        assert digests(BestFitDataset(NoLengths(corpus), **MODES["buffer"], epoch=e, plan_dir=pdir)) == ref
    assert [p.stat().st_mtime_ns for p in files] == stamps
    bad = CliRunner().invoke(app, [*args, "--mode", "greedy"])
    assert bad.exit_code == 2 and "mode must be one of" in bad.output and "Traceback" not in bad.output


BAD_EPOCHS = [1.5, "2", True, None, math.nan, math.inf, -1, 2.0]


@pytest.mark.parametrize("value", BAD_EPOCHS, ids=repr)
def test_epochs_are_validated_with_one_rule(stdlib_manifest, value):
    corpus = open_corpus(stdlib_manifest, "train")
    for make in (
        lambda **k: BestFitDataset(corpus, **MODES["buffer"], **k),
        lambda **k: SlidingWindowDataset(corpus, 700, 6, **k),
    ):
        ds = make()
        if value is not None:  # None is seek's default (the current epoch)
            with pytest.raises(ValueError, match="epoch must be an integer"):
                ds.seek(0, epoch=value)
        with pytest.raises(ValueError, match="epoch must be an integer"):
            ds.set_epoch(value)
        with pytest.raises(ValueError, match="epoch must be an integer"):
            make(epoch=value)
        with pytest.raises(ValueError, match="epoch must be an integer"):
            ds.num_microbatches(value if value is not None else -1)


@pytest.mark.parametrize("value", [1.5, "0", True, math.nan, -1], ids=repr)
def test_positions_ranks_and_world_sizes_are_validated(stdlib_manifest, value):
    corpus = open_corpus(stdlib_manifest, "train")
    ds = BestFitDataset(corpus, **MODES["buffer"])
    with pytest.raises(ValueError, match="position"):
        ds.seek(value)
    with pytest.raises(ValueError, match="rank"):
        BestFitDataset(corpus, **MODES["buffer"], rank=value, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        BestFitDataset(corpus, **MODES["buffer"], rank=0, world_size=value)


@pytest.mark.parametrize("value", [1.7, "5", True, 0, -3, math.inf], ids=repr)
def test_mix_tokens_per_epoch_is_validated(stdlib_manifest, value):
    with pytest.raises(ValueError, match="tokens_per_epoch must be an integer"):
        mix([stdlib_manifest, stdlib_manifest], tokens_per_epoch=value)


def test_deeply_nested_state_values_are_refused_naming_the_field(stdlib_manifest):
    corpus = open_corpus(stdlib_manifest, "train")
    ds = BestFitDataset(corpus, **MODES["buffer"])
    st = ds.state_dict()
    deep: object = 0
    for _ in range(100_000):
        deep = [deep]
    for field in ("epoch", "tokens"):
        with pytest.raises(LoaderStateError, match=f"'{field}'"):
            ds.load_state_dict({**st, field: deep})
    nested = {**st, "settings": {**st["settings"], "seed": deep}}
    with pytest.raises(LoaderStateError, match="seed"):
        ds.load_state_dict(nested)
    with pytest.raises(LoaderStateError, match="writer.start"):
        ds.load_state_dict({**st, "writer": {**st["writer"], "start": deep}})


def test_a_mixture_plan_file_gives_the_in_memory_sequence_and_source_tokens(stdlib_manifest, tmp_path):
    corpus = open_corpus(stdlib_manifest, "train")
    val = open_corpus(stdlib_manifest, "validation")
    kw = dict(MODES["buffer"], with_segments=True)
    ref_ds = BestFitDataset(mix({"train": corpus, "val": val}, {"train": 1, "val": 3}), **kw)
    ref = digests(ref_ds)
    ds = BestFitDataset(mix({"train": corpus, "val": val}, {"train": 1, "val": 3}), **kw, plan_dir=tmp_path)
    assert digests(ds) == ref and len(plan_files(tmp_path)) == 1
    for d in (ref_ds, ds):
        d.seek(3)
    assert ds.state_dict()["source_tokens"] == ref_ds.state_dict()["source_tokens"]
    other = BestFitDataset(mix({"train": corpus, "val": val}, {"train": 1, "val": 2}), **kw, plan_dir=tmp_path)
    other.shared_plan(0)
    assert len(plan_files(tmp_path)) == 2  # other weights: another plan file, never the first one


@pytest.mark.parametrize("value", [1.5, "8", True, math.nan, None], ids=repr)
def test_loader_sizes_follow_the_same_rule(stdlib_manifest, value):
    corpus = open_corpus(stdlib_manifest, "train")
    for name in ("max_seq_len", "batch_size", "seed", "packing_buffer"):
        if value is None and name == "packing_buffer":
            continue  # None: the mode's default
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            BestFitDataset(corpus, **{**MODES["buffer"], name: value})
    for name in ("seq_len", "batch_size", "seed"):
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            SlidingWindowDataset(corpus, **{"seq_len": 700, "batch_size": 6, name: value})
    if value is not None:
        with pytest.raises(ValueError, match="windows_per_epoch must be an integer"):
            SlidingWindowDataset(corpus, 700, 6, mode="random", windows_per_epoch=value)


def test_old_loader_names_still_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="import it from h5corpus.loaders.epochplan"):
        from h5corpus.loaders.plan import pack_fill  # the import is what is tested
    assert pack_fill is epochplan.pack_fill
    lengths = np.array([10, 3, 1, 9000])
    with pytest.warns(DeprecationWarning, match="use document_chunks"):
        old = chunking.chunk_layout(lengths, 4096)
    assert all(np.array_equal(a, b) for a, b in zip(old, chunking.document_chunks(lengths, 4096)))


def test_seg_starts_is_the_microbatches_segment_starts_end_to_end(stdlib_manifest, tmp_path):
    """The loaders' prefetch lookahead (one slice of the plan) against the microbatches it spans."""
    corpus = open_corpus(stdlib_manifest, "train")
    for plan_dir in (None, tmp_path / "plans"):  # in memory and memory-mapped from a plan file
        sp = BestFitDataset(corpus, **MODES["buffer"], plan_dir=plan_dir).shared_plan(0)
        M = sp.num_microbatches
        assert M > 8
        for g0, g1 in ((0, M), (0, 1), (3, 8), (M - 2, M), (5, 5)):
            want = [sp.microbatch(g).seg_start for g in range(g0, g1)]
            got = sp.seg_starts(g0, g1)
            assert np.array_equal(got, np.concatenate(want) if want else np.zeros(0, np.int64))
