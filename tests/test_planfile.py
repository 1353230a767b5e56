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

import hashlib
import json
import math
import multiprocessing
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from typer.testing import CliRunner

from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus
from h5corpus.cli import app
from h5corpus.loaders import chunking, epochplan, planfile
from h5corpus.loaders.epochplan import PlanSettings, plan_epoch
from h5corpus.loaders.mixture import mix
from h5corpus.loaders.planfile import PlanFileError, ensure_plan_file, materialize, open_plan_file
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
    """(first byte of the flat arrays, header) of a plan file, from its documented layout
    (preamble, header, checksum table, arrays, each 64-byte aligned)."""
    raw = path.read_bytes()
    magic, hlen, _ = struct.unpack_from("<8sQ32s16x", raw, 0)
    assert magic == b"H5CPLAN\x01"
    header = json.loads(raw[64 : 64 + hlen])
    return -(-(64 + hlen) // 64) * 64 + -(-(8 * header["sums"][0]) // 64) * 64, header


def _records(path: Path) -> tuple[int, np.ndarray]:
    """(first byte of the records, (M + 1,) record offsets) of a plan file, from its documented layout."""
    body, header = _header(path)
    a = header["arrays"]["mb_offsets"]
    offsets = np.frombuffer(path.read_bytes(), "<u8", a["shape"][0], body + a["offset"])
    return body + header["records"]["offset"], offsets.astype(np.int64)


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def test_plan_file_records_follow_the_documented_layout(stdlib_manifest, tmp_path, monkeypatch):
    """Each record parsed by this test from the layout the module documents (head, relative pack
    starts, seg_start, seg_doc, seg_within, seg_len; xxh3-64 seeded by the identity's sha256)
    against the in-memory plan's microbatch; the writer builds them ~50 segments at a time."""
    monkeypatch.setattr(planfile, "RECORD_SEGMENTS", 50)
    corpus = open_corpus(stdlib_manifest, "train")
    ds = BestFitDataset(corpus, **MODES["bfd"], plan_dir=tmp_path / "plans")
    ds.shared_plan(0)
    [f] = plan_files(tmp_path / "plans")
    ident = ds.plan_identity(0)
    key = json.dumps([ident["fingerprint"], dict(ident["settings"]), 0], sort_keys=True)
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    at, offsets = _records(f)
    raw = f.read_bytes()
    mem = BestFitDataset(corpus, **MODES["bfd"]).shared_plan(0)
    assert offsets.size - 1 == mem.num_microbatches > 8
    for g in range(mem.num_microbatches):
        rec = raw[at + offsets[g] : at + offsets[g + 1]]
        checksum, index, P, S = struct.unpack_from("<QQII", rec)
        assert (index, len(rec) % 8, checksum) == (g, 0, xxhash.xxh3_64_intdigest(rec[8:], seed))
        cols = np.frombuffer(rec, "<i8", P + 1 + 3 * S, 24)
        want = mem.microbatch(g)
        assert P == int(want.mb_packs[1]) and np.array_equal(cols[: P + 1], want.pack_starts)
        for k, name in enumerate(("seg_start", "seg_doc", "seg_within")):
            assert np.array_equal(cols[P + 1 + k * S : P + 1 + (k + 1) * S], getattr(want, name))
        assert np.array_equal(np.frombuffer(rec, "<i4", S, 24 + 8 * (P + 1 + 3 * S)), want.seg_len)
    with pytest.raises(IndexError, match=f"microbatch {mem.num_microbatches} outside"):
        ds.shared_plan(0).microbatch(mem.num_microbatches)


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
    # a record byte (its checksum, its head, its segments) or an offset byte: the microbatch that
    # reads it is refused (oracle: the undamaged file's record offsets, in the documented layout)
    at, offsets = _records(f)
    mid = (int(offsets[3]) + int(offsets[4])) // 2
    damaged = "(fails its checksum|is damaged|is another record)"
    for where, g in ((at + offsets[5], 5), (at + offsets[6] + 9, 6), (at + mid, 3), (at + mid + 1, 3)):
        _flip(f, int(where))
        with pytest.raises(PlanFileError, match=f"microbatch {g} {damaged}"):
            digests(BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir))
        shutil.copyfile(tmp_path / "good", f)
    mb = header["arrays"]["mb_offsets"]
    for byte in (0, 1):  # offset 7 moved by 1 or by 256 bytes: microbatch 6 (its end) is read first
        _flip(f, body + mb["offset"] + 8 * 7 + byte)
        with pytest.raises(PlanFileError, match=f"microbatch 6 {damaged}"):
            digests(BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir))
        shutil.copyfile(tmp_path / "good", f)
    _flip(f, body + header["arrays"]["source_tokens"]["offset"] + 8)
    ds = BestFitDataset(corpus, **MODES["buffer"], plan_dir=pdir)
    ds.seek(2)
    with pytest.raises(PlanFileError, match="source_tokens' block 0"):
        ds.state_dict()


def test_a_record_of_another_plan_fails_its_checksum(stdlib_manifest, tmp_path):
    """Epoch 1's record of microbatch g, spliced whole into epoch 0's file where its record g of
    the same size lies (a well-formed record with the right index): refused, because a record's
    checksum is seeded by its plan's identity."""
    corpus = open_corpus(stdlib_manifest, "train")
    ds = BestFitDataset(corpus, **MODES["buffer"], plan_dir=tmp_path / "plans")
    files = []
    for e in (0, 1):
        ds.shared_plan(e)
        files.append(next(p for p in plan_files(tmp_path / "plans") if p.name.endswith(f"-e{e}.h5cplan")))
    (at0, off0), (at1, off1) = _records(files[0]), _records(files[1])
    n = min(off0.size, off1.size) - 1
    same = np.flatnonzero(np.diff(off0[: n + 1]) == np.diff(off1[: n + 1]))
    g = int(same[same > 0][0])
    raw0, raw1 = bytearray(files[0].read_bytes()), files[1].read_bytes()
    assert raw1[at1 + off1[g] : at1 + off1[g + 1]] != raw0[at0 + off0[g] : at0 + off0[g + 1]]
    raw0[at0 + off0[g] : at0 + off0[g + 1]] = raw1[at1 + off1[g] : at1 + off1[g + 1]]
    files[0].write_bytes(bytes(raw0))
    sp = BestFitDataset(corpus, **MODES["buffer"], plan_dir=tmp_path / "plans").shared_plan(0)
    sp.microbatch(g - 1)  # its neighbours are intact
    with pytest.raises(PlanFileError, match=f"microbatch {g} fails its checksum"):
        sp.microbatch(g)


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
