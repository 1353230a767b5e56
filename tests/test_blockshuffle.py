"""The shard-block shuffle (``shuffle_block_shards``) of both loaders: the order against
independent oracles (the window layout and the chunking rule recomputed here, blocks found from
the sequence itself), the same global sequence on any cluster shape, resume, plan files, and cold
epochs from a real S3 server (moto) that read shards as they arrive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from h5corpus import BestFitDataset, LoaderStateError, SlidingWindowDataset, open_corpus
from h5corpus.loaders import blockshuffle
from h5corpus.loaders.bestfit import write_plans
from h5corpus.loaders.epochplan import pack_fill
from h5corpus.storage.manifest import read_manifest
from tests.helpers import (
    REPO,
    assert_two_ranks_of_two_workers_replay,
    batch_digest,
    naive_chunks,
    subprocess_env,
)
from tests.s3_helpers import moto_bucket, small_shards_corpus
from tests.s3_helpers import put_corpus as s3_put_corpus

BUCKET = "blocks"
SEQ = 256


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return small_shards_corpus(tmp_path_factory.mktemp("block-corpus"))


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_bucket(tmp_path_factory.mktemp("moto"), BUCKET) as server:
        yield server


def put_corpus(manifest: Path, prefix: str) -> str:
    """The corpus copied under ``s3://<BUCKET>/<prefix>/`` with plain s3fs; its manifest's URL."""
    return s3_put_corpus(manifest, BUCKET, prefix)


def window(source, blocks=None, **kw) -> SlidingWindowDataset:
    return SlidingWindowDataset(source, SEQ, 8, seed=3, shuffle_block_shards=blocks, **kw)


def bestfit(source, blocks=None, **kw) -> BestFitDataset:
    return BestFitDataset(source, 2 * SEQ, 4, 16, seed=3, shuffle_block_shards=blocks, **kw)


def digests(ds) -> list[str]:
    return [batch_digest(b) for b in ds]


def assert_blocks(shard_seq: list[int], counts: dict[int, int], K: int) -> None:
    """The oracle of the block order, found from the sequence alone: from each position on, the
    next ``K`` distinct shards met (fewer at the end) form a block, and the block's stretch of the
    sequence is exactly every item of those shards and nothing else."""
    pos, blocks = 0, 0
    while pos < len(shard_seq):
        members: list[int] = []
        for s in shard_seq[pos:]:
            if s not in members:
                members.append(s)
            if len(members) == K:
                break
        n = sum(counts[s] for s in members)
        assert sorted(set(shard_seq[pos : pos + n])) == sorted(members), f"block {blocks} mixes other shards"
        assert len(members) == K or pos + n == len(shard_seq)
        pos, blocks = pos + n, blocks + 1
    assert blocks == -(-len(counts) // K)


def window_layout(c, L: int) -> np.ndarray:
    """Every epoch-mode window start, recomputed from the rule: window k of shard s starts at
    shard_start[s] + k * L while the window's L + 1 tokens fit the shard."""
    sts = [int(x) for x in c.shard_token_starts]
    return np.array([a + k * L for a, b in zip(sts[:-1], sts[1:]) for k in range((b - a - 1) // L)], dtype=np.int64)


@pytest.mark.parametrize("K", [1, 3, 4])
def test_window_block_order_is_a_permutation_grouped_by_blocks_of_shards(corpus, K):
    c = open_corpus(corpus)
    layout = window_layout(c, SEQ)
    for epoch in (0, 1):
        starts = window(c, K).plan(epoch)
        assert np.array_equal(np.sort(starts), layout)  # every window (every pair of its span) once
        shard = (np.searchsorted(c.shard_token_starts, starts, side="right") - 1).tolist()
        counts = {s: shard.count(s) for s in set(shard)}
        assert len(counts) == c.num_shards and min(counts.values()) > 0
        assert_blocks(shard, counts, K)
        if K > 1:  # windows are shuffled inside a block, not read shard after shard
            assert sum(a != b for a, b in zip(shard[:-1], shard[1:])) > 10 * c.num_shards
    assert not np.array_equal(window(c, K).plan(0), window(c, K).plan(1))
    assert np.array_equal(window(c, K).plan(0), window(c, K).plan(0))
    assert not np.array_equal(window(c, K).plan(0), window(c).plan(0))


@pytest.mark.parametrize("K", [2, 5])
def test_bestfit_block_stream_and_every_pair_once(corpus, K):
    c = open_corpus(corpus)
    lengths = c.doc_lengths()
    chunks = naive_chunks(lengths.tolist(), 2 * SEQ)  # the oracle's chunks, in corpus order
    doc_shard = np.searchsorted(c.shard_doc_starts, np.arange(lengths.size), side="right") - 1
    ds = bestfit(c, K, with_segments=True)
    stream = ds.plan().stream
    assert np.array_equal(np.sort(stream), np.arange(len(chunks)))
    shard = [int(doc_shard[chunks[i][0]]) for i in stream.tolist()]
    assert_blocks(shard, {s: shard.count(s) for s in set(shard)}, K)
    segs = np.concatenate([b.segments.numpy() for b in ds])
    assert sorted(map(tuple, segs.tolist())) == sorted(chunks)  # every next-token pair exactly once


def test_same_batches_on_one_rank_and_on_two_ranks_of_two_workers(corpus):
    c = open_corpus(corpus)
    for make in (window, bestfit):
        assert_two_ranks_of_two_workers_replay(lambda make=make, **kw: make(c, 2, **kw))


def test_resume_continues_on_another_world_size_and_refuses_another_block_setting(corpus):
    c = open_corpus(corpus)
    for make in (window, bestfit):
        full = digests(make(c, 3, rank=0, world_size=1))
        ds = make(c, 3, rank=0, world_size=2)
        it = iter(ds)
        for _ in range(5):
            next(it)
        state = ds.state_dict()
        assert state["position"] == 10 and state["settings"]["shuffle_block_shards"] == 3
        again = make(c, 3, rank=0, world_size=1)
        again.load_state_dict(state)
        assert digests(again) == full[10:]
        for other in (None, 2):
            with pytest.raises(LoaderStateError, match="shuffle_block_shards"):
                make(c, other).load_state_dict(state)
        assert "shuffle_block_shards" not in make(c).state_dict()["settings"]  # the default's state is as before


def test_plan_files_are_keyed_by_the_block_setting(corpus, tmp_path):
    c = open_corpus(corpus)
    common = dict(max_seq_len=2 * SEQ, batch_size=4, packing_buffer=16, seed=3)
    plain = write_plans(corpus, tmp_path, [0], **common)
    blocked = write_plans(corpus, tmp_path, [0], shuffle_block_shards=2, **common)
    assert plain != blocked and len(list(tmp_path.glob("*.h5cplan"))) == 2
    want = digests(bestfit(c, 2))
    assert digests(bestfit(c, 2, plan_dir=tmp_path)) == want
    assert digests(bestfit(c, plan_dir=tmp_path)) == digests(bestfit(c)) != want


def test_bad_settings_are_refused_by_name(corpus):
    c = open_corpus(corpus)
    for bad in (0, -1, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="shuffle_block_shards"):
            window(c, bad)
    with pytest.raises(ValueError, match="shuffle_block_shards"):
        SlidingWindowDataset(c, SEQ, 8, mode="random", shuffle_block_shards=2)
    with pytest.raises(ValueError, match="shuffle_block_shards"):
        bestfit(c, 2, shuffle=False)
    with pytest.raises(ValueError, match="shuffle_block_shards"):
        bestfit([c, c], 2)


def test_cold_epoch_from_s3_reads_shards_as_they_arrive(corpus, s3, tmp_path, monkeypatch):
    monkeypatch.setattr(blockshuffle, "PREFETCH_TOKENS", 1)  # ask for the next block only: a bound to assert
    url = put_corpus(corpus, "cold")
    local = open_corpus(corpus)
    plans = tmp_path / "plans"
    write_plans(
        corpus, plans, [0], max_seq_len=2 * SEQ, batch_size=4, packing_buffer=16, seed=3, shuffle_block_shards=1
    )
    for name, make, kw in (("window", window, {}), ("bestfit", bestfit, {"plan_dir": plans})):
        c = open_corpus(url, cache_dir=tmp_path / f"cache-{name}")
        it = iter(make(c, 1, **kw))
        first = batch_digest(next(it))
        cached_at_first = int(c.cached_shards().sum())
        got = [first] + [batch_digest(b) for b in it]
        assert got == digests(make(local, 1))  # the local path's batches, every one
        # the first batch needed only its block's shards (the loaders asked for the next block's
        # too, as the first two plan steps touch at most two blocks: 4 shards); the rest were
        # fetched while the epoch ran
        assert cached_at_first <= 4 < c.num_shards, (name, cached_at_first)
        assert c.cached_shards().all()
        c.close()
    gets = s3.gets(BUCKET)
    train = [e.path.split("../")[-1] for e in read_manifest(corpus).shards_of("train")]
    assert {k: gets[f"cold/{k}"] for k in train} == {k: 2 for k in train}  # once per cache (two caches)


def test_two_ranks_two_workers_cold_from_one_cache(corpus, s3, tmp_path):
    url = put_corpus(corpus, "cold-ddp")
    cache, env = tmp_path / "cache", subprocess_env()
    script = str(REPO / "tests" / "remote_epoch.py")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                script,
                url,
                str(cache),
                "0",
                str(r),
                "2",
                "2",
                str(tmp_path / f"r{r}.json"),
                "window",
                "2",
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    local = open_corpus(corpus)
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())["digests"]
        assert got == digests(window(local, 2, rank=r, world_size=2))
    gets = s3.gets(BUCKET)
    train = [e.path.split("../")[-1] for e in read_manifest(corpus).shards_of("train")]
    assert {k: gets[f"cold-ddp/{k}"] for k in train} == {k: 1 for k in train}  # each shard once, 4 processes


def test_pack_fill_with_block_shuffle_on_the_dev_train_split(dev_manifest):
    c = open_corpus(dev_manifest, "train")
    lengths, sds = c.doc_lengths(), c.shard_doc_starts
    base = pack_fill(lengths, 4096, 35, 64, 0, "buffer")
    assert base.fill > 0.999  # docs/PACKING.md section 6: 0.99904
    for K in (1, 2):
        f = pack_fill(lengths, 4096, 35, 64, 0, "buffer", shuffle_block_shards=K, shard_doc_starts=sds)
        assert f.real_tokens == base.real_tokens  # the same pairs, another order
        assert f.fill > 0.998, (K, f.fill)
        print(f"dev train, {c.num_shards} shards, buffer 64, shuffle_block_shards={K}: fill {f.fill:.5f}")


def test_a_file_sized_first_and_written_in_parts_is_hashed_as_it_lands(tmp_path, s3):
    """s3fs fetches a large object in concurrent ranged parts into a file truncated to its full
    size first; the download's byte count (the callback hook's value) bounds what StreamHash
    reads, so its digest is the file's (no zeros hashed, no second pass)."""
    import hashlib

    import s3fs
    from fsspec.callbacks import Callback

    from h5corpus.storage.cache import StreamHash

    data = np.random.default_rng(1).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()
    want = hashlib.sha256(data).hexdigest()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, default_block_size=1 << 20)  # 5 ranged parts
    fs.pipe_file(f"{BUCKET}/big.bin", data)
    part = tmp_path / "big.download"
    part.touch()
    hasher = StreamHash(str(part))
    fs.get_file(f"{BUCKET}/big.bin", str(part), callback=Callback(hooks={"hash": hasher.poke}))
    assert part.read_bytes() == data
    assert hasher.finish() == (want, len(data))
    gets = s3.gets(BUCKET)
    assert gets["big.bin"] >= 5  # it did take the concurrent ranged path


def test_plan_command_writes_the_block_shuffled_plan(corpus, tmp_path):
    from typer.testing import CliRunner

    from h5corpus.cli import app

    pdir = tmp_path / "plans"
    args = ["plan", str(corpus), "--plan-dir", str(pdir), "--max-seq-len", str(2 * SEQ), "--batch-size", "4"]
    res = CliRunner().invoke(app, [*args, "--packing-buffer", "16", "--seed", "3", "--shuffle-block-shards", "2"])
    assert res.exit_code == 0, res.output
    assert res.output.split() == [str(p) for p in pdir.glob("*.h5cplan")]
    c = open_corpus(corpus)
    assert digests(bestfit(c, 2, plan_dir=pdir)) == digests(bestfit(c, 2))
    assert len(list(pdir.glob("*.h5cplan"))) == 1  # the dataset found the command's file
    bad = CliRunner().invoke(app, [*args, "--shuffle-block-shards", "0"])
    assert bad.exit_code == 2 and "shuffle_block_shards" in bad.output and "Traceback" not in bad.output


def test_shards_in_order_and_missing_shards(corpus):
    """The cold loaders' shard sets of token positions, against a per-position search."""
    import bisect

    from h5corpus.loaders.bestfit import missing_shards, shards_in_order

    c = open_corpus(corpus)
    sts = c.shard_token_starts.tolist()
    assert c.num_shards > 3
    pos = np.random.default_rng(0).integers(0, c.num_tokens, size=500)
    of = [bisect.bisect_right(sts, int(p)) - 1 for p in pos]
    first_need = list(dict.fromkeys(of))  # each shard once, in order of first appearance
    assert shards_in_order(c, pos).tolist() == first_need
    have = np.zeros(c.num_shards, bool)
    have[::2] = True
    assert missing_shards(c, pos, have).tolist() == sorted(s for s in set(of) if not have[s])
    assert missing_shards(c, pos, np.ones(c.num_shards, bool)).size == 0
