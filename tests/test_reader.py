"""Corpus reader: global token stream across shards, both read paths, compressed shards, checks on
open, pickling under fork and spawn, manifest refresh, and live (SWMR) reading of a shard being written."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import pickle
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5corpus.storage.format import FormatError, TokenizerIdentity
from h5corpus.storage.manifest import Manifest, read_manifest, write_manifest
from h5corpus.storage.reader import open_corpus, open_live
from h5corpus.storage.writer import ShardWriter
from tests.helpers import BYTE_IDENTITY, byte_encode, doc_id, oracle_stream, read_doc_meta, stdlib_texts


def random_ranges(
    n_tokens: int, shard_starts: np.ndarray, chunk: int, count: int, seed: int = 0
) -> list[tuple[int, int]]:
    """Ranges that start/end at and around chunk and shard boundaries, plus random ones."""
    rng = np.random.default_rng(seed)
    edges = sorted(set(shard_starts.tolist()) | set(range(0, n_tokens, chunk)))
    out = [(0, n_tokens), (0, 0), (n_tokens, n_tokens), (n_tokens - 1, n_tokens)]
    for e in rng.choice(edges, size=min(count, len(edges)), replace=False).tolist():
        for a, b in ((e - 1, e + 1), (e, e + 5), (e - 300, e), (e - 7000, e + 9000)):
            out.append((max(0, a), min(n_tokens, b)))
    for _ in range(count):
        a = int(rng.integers(0, n_tokens))
        out.append((a, int(min(n_tokens, a + rng.integers(0, 3 * chunk)))))
    return out


def recompress(manifest: Path, root: Path, compression: str) -> Path:
    """Copy ``manifest``'s corpus document by document into shards written with ``compression``."""
    m = read_manifest(manifest)
    out = Manifest(tokenizer=m.tokenizer, dtype=m.dtype, chunk_tokens=m.chunk_tokens)
    mpath = root / "manifests" / "shards.json"
    for s in m.shards:
        with h5py.File(m.shard_path(s), "r") as f:
            toks, offs = f["tokens"][:], f["doc_offsets"][:]
        ids, flags = read_doc_meta(m.shard_path(s))
        with ShardWriter(
            root / "shards" / s.path.split("/", 2)[-1],
            split=s.split,
            tokenizer=m.tokenizer,
            chunk_tokens=m.chunk_tokens,
            compression=compression,
        ) as w:
            w.add_documents(toks, np.diff(offs), ids, flags)
        out.shards.append(w.info.relative_to(mpath.parent))
    write_manifest(mpath, out)
    return mpath


# -- the global stream ------------------------------------------------------------------------------


@pytest.mark.parametrize("read_path", ["auto", "h5py"])
def test_tokens_equal_concatenated_shards_across_chunk_and_shard_boundaries(stdlib_manifest, read_path):
    """tokens(a, b) equals the shard-by-shard concatenation for ranges at, across and between chunk
    and shard boundaries, including the final partial chunk of every shard; on both read paths."""
    c = open_corpus(stdlib_manifest, "train", read_path=read_path)
    toks, offs, starts = oracle_stream(stdlib_manifest)
    assert c.num_shards >= 5 and c.num_tokens == toks.size and c.num_documents == offs.size - 1
    np.testing.assert_array_equal(c.doc_offsets, offs)
    np.testing.assert_array_equal(c.shard_token_starts, starts)
    assert any(int(n) % c.chunk_tokens for n in np.diff(starts)), "want shards ending in a partial chunk"
    assert set(c.read_paths()) == {"mmap" if read_path == "auto" else "h5py"}
    for a, b in random_ranges(c.num_tokens, starts, c.chunk_tokens, 150):
        np.testing.assert_array_equal(c.tokens(a, b), toks[a:b], err_msg=f"[{a}, {b})")
    out = np.zeros(5000, np.int64)
    np.testing.assert_array_equal(c.tokens(10, 5010, out=out), toks[10:5010])
    for i in (0, 1, c.num_documents // 2, c.num_documents - 1):
        np.testing.assert_array_equal(c.document(i), toks[offs[i] : offs[i + 1]])


def test_reads_across_every_gap_between_file_chunks(stdlib_manifest):
    """Where HDF5 placed an index block between two consecutive /tokens chunks (found with
    h5py's chunk_iter), ranges crossing that boundary still equal the stream."""
    c = open_corpus(stdlib_manifest, "train")
    toks, _, starts = oracle_stream(stdlib_manifest)
    gaps = 0
    for s, path in enumerate(c.paths):
        with h5py.File(path, "r") as f:
            info: list = []
            f["tokens"].id.chunk_iter(info.append)
        info.sort(key=lambda i: i.chunk_offset[0])
        for prev, nxt in zip(info[:-1], info[1:]):
            if nxt.byte_offset != prev.byte_offset + prev.size:
                gaps += 1
                g = int(starts[s]) + nxt.chunk_offset[0]
                for a, b in ((g - 1, g + 1), (g - 3000, g + 5000), (g - c.chunk_tokens, g + 2 * c.chunk_tokens)):
                    a, b = max(a, int(starts[s])), min(b, int(starts[s + 1]))
                    np.testing.assert_array_equal(c.tokens(a, b), toks[a:b])
                    np.testing.assert_array_equal(c.gather(np.array([a]), b - a)[0], toks[a:b])
    assert gaps >= 3, "expected index blocks between some chunks"


def test_gather_equals_tokens_for_every_window_even_across_shards(stdlib_manifest):
    """gather(starts, n) row j == tokens(starts[j], starts[j] + n), into any integer dtype."""
    c = open_corpus(stdlib_manifest, "train")
    toks, _, starts = oracle_stream(stdlib_manifest)
    rng = np.random.default_rng(1)
    st = np.concatenate([rng.integers(0, c.num_tokens - 1025, 300), starts[1:-1] - 500, [0, c.num_tokens - 1025]])
    for dtype in (np.uint16, np.int64):
        g = c.gather(st, 1025, out=np.empty((st.size, 1025), dtype))
        for j, a in enumerate(st.tolist()):
            np.testing.assert_array_equal(g[j], toks[a : a + 1025])
    for bad in (c.num_tokens - 10, -1):
        with pytest.raises(IndexError, match="outside"):
            c.gather(np.array([0, bad]), 11)


def test_compressed_shards_read_identically_through_hdf5(stdlib_manifest, tmp_path):
    """gzip and lzf shards take the HDF5 path and return the same tokens and documents as raw ones;
    forcing the memory-map path on them is refused, naming the shard."""
    raw = open_corpus(stdlib_manifest, "train")
    toks, _, starts = oracle_stream(stdlib_manifest)
    for comp in ("gzip", "lzf"):
        mpath = recompress(stdlib_manifest, tmp_path / comp, comp)
        c = open_corpus(mpath, "train")
        assert c.read_paths() == ["h5py"] * c.num_shards
        np.testing.assert_array_equal(c.doc_offsets, raw.doc_offsets)
        for a, b in random_ranges(c.num_tokens, starts, c.chunk_tokens, 40, seed=2):
            np.testing.assert_array_equal(c.tokens(a, b), toks[a:b])
        with pytest.raises(FormatError, match=r"train-00000\.h5.*compressed"):
            open_corpus(mpath, "train", read_path="mmap").tokens(0, 10)


def test_dev_corpus_gpt2_tokens_equal_stream_on_mmap_path(dev_manifest):
    """Real GPT-2 shards: the memory-map path serves every shard and equals plain h5py reads."""
    c = open_corpus(dev_manifest, "train")
    toks, offs, starts = oracle_stream(dev_manifest)
    assert c.dtype == np.uint16 and c.eos_id == 50256 and c.num_shards >= 3
    assert c.read_paths() == ["mmap"] * c.num_shards
    np.testing.assert_array_equal(c.doc_offsets, offs)
    for a, b in random_ranges(c.num_tokens, starts, c.chunk_tokens, 200, seed=3):
        np.testing.assert_array_equal(c.tokens(a, b), toks[a:b])
    ends = toks[offs[1:] - 1]
    assert (ends == 50256).all()


# -- checks on open ---------------------------------------------------------------------------------


def test_open_refuses_other_tokenizer_and_index_disagreeing_with_manifest(stdlib_manifest):
    """A different tokenizer identity, or a shard whose index disagrees with the manifest, is refused
    with an error naming the manifest or shard; out-of-range reads raise IndexError."""
    other = TokenizerIdentity(name="x", revision="local", sha256="1" * 64, vocab_size=257, eos_id=256)
    with pytest.raises(FormatError, match="tokenizer"):
        open_corpus(stdlib_manifest, "train", tokenizer=other)
    open_corpus(stdlib_manifest, "train", tokenizer=BYTE_IDENTITY)  # the same identity is fine
    c = open_corpus(stdlib_manifest, "train")
    with pytest.raises(IndexError, match="outside"):
        c.tokens(0, c.num_tokens + 1)
    with pytest.raises(IndexError, match="outside"):
        c.document(c.num_documents)
    raw = json.loads(stdlib_manifest.read_text())
    raw["shards"][1]["documents"] += 1
    stdlib_manifest.write_text(json.dumps(raw))
    c = open_corpus(stdlib_manifest, "train")  # version 3 opens from the manifest alone ...
    first = int(c.shard_token_starts[1])
    np.testing.assert_array_equal(c.tokens(0, 10), open_corpus(stdlib_manifest, "train").tokens(0, 10))
    for read in (lambda: c.tokens(first, first + 1), lambda: c.doc_offsets, lambda: c.doc_index_at(np.array([first]))):
        with pytest.raises(FormatError, match=r"train-00001\.h5.*manifest says"):  # ... and checks a shard when touched
            read()


def test_reads_while_the_caller_holds_a_shard_open_without_swmr(stdlib_manifest):
    """HDF5 refuses to open one file with two different SWMR flags in a process; the reader falls
    back to a plain read-only open for finished shards, on both read paths."""
    m = read_manifest(stdlib_manifest)
    with h5py.File(m.shard_path(m.shards[0]), "r") as held:
        want = held["tokens"][:1000]
        for read_path in ("auto", "h5py"):
            c = open_corpus(stdlib_manifest, "train", read_path=read_path)
            np.testing.assert_array_equal(c.tokens(0, 1000), want)
            c.close()


# -- processes --------------------------------------------------------------------------------------


def _child_read(corpus_bytes: bytes, ranges, q) -> None:
    c = pickle.loads(corpus_bytes)
    q.put([hashlib.sha256(c.tokens(a, b).tobytes()).hexdigest() for a, b in ranges] + [c.doc_id(3)])


def _child_read_inherited(c, ranges, q) -> None:
    q.put([hashlib.sha256(c.tokens(a, b).tobytes()).hexdigest() for a, b in ranges] + [c.doc_id(3)])


@pytest.mark.parametrize("read_path", ["auto", "h5py"])
def test_pickles_without_handles_and_reads_in_fork_and_spawn_children(stdlib_manifest, read_path):
    """A Corpus with open handles pickles as paths + offsets (no doc ids, no handles); a spawned
    child reopens the files, and a forked child never reuses the parent's handles; both read the
    same tokens as the parent."""
    c = open_corpus(stdlib_manifest, "train", read_path=read_path)
    ranges = [(0, 100), (c.num_tokens - 5000, c.num_tokens), (400_000, 430_000)]
    want = [hashlib.sha256(c.tokens(a, b).tobytes()).hexdigest() for a, b in ranges] + [c.doc_id(3)]
    assert c._readers  # the parent holds open handles now
    blob = pickle.dumps(c)
    assert b"HDF5" not in blob and len(blob) < 64 * 1024 + 16 * c.num_documents
    c2 = pickle.loads(blob)
    assert c2._readers == {} and c2._doc_ids is None and c2.doc_id(3) == c.doc_id(3)
    for ctx_name, target, arg in (("spawn", _child_read, blob), ("fork", _child_read_inherited, c)):
        ctx = mp.get_context(ctx_name)
        q = ctx.Queue()
        p = ctx.Process(target=target, args=(arg, ranges, q))
        p.start()
        got = q.get(timeout=120)
        p.join(30)
        assert p.exitcode == 0 and got == want, ctx_name
    assert c.tokens(0, 100).tobytes() == c2.tokens(0, 100).tobytes()  # parent handles still fine


def test_refresh_follows_shards_appended_to_the_manifest(stdlib_manifest, tmp_path):
    """refresh() on a manifest corpus appends shards added to the split and exposes their documents;
    a rewritten (not appended) shard list is refused."""
    c = open_corpus(stdlib_manifest, "train")
    n_docs, n_tok = c.num_documents, c.num_tokens
    assert c.refresh() == 0
    m = read_manifest(stdlib_manifest)
    texts = [t[::-1] for t in stdlib_texts(10)]  # new documents
    ids = byte_encode(texts)
    with ShardWriter(
        stdlib_manifest.parent.parent / "shards" / "train" / "train-99999.h5",
        split="train",
        tokenizer=BYTE_IDENTITY,
        chunk_tokens=m.chunk_tokens,
    ) as w:
        for t, a in zip(texts, ids):
            w.add_document(np.append(a, 256), doc_id(t))
    m.shards.append(w.info.relative_to(stdlib_manifest.parent))
    write_manifest(stdlib_manifest, m)
    assert c.refresh() == len(texts)
    assert c.num_documents == n_docs + len(texts) and c.num_tokens == n_tok + w.info.tokens
    np.testing.assert_array_equal(c.document(n_docs + 2)[:-1], ids[2])
    assert c.doc_id(n_docs + 2) == doc_id(texts[2])[:16].hex()  # version 3 stores 128 bits of the sha256
    m.shards = m.shards[1:]
    write_manifest(stdlib_manifest, m)
    with pytest.raises(FormatError, match="changed under an open corpus"):
        c.refresh()


# -- live reading -----------------------------------------------------------------------------------


def _live_writer(path: str, source_manifest: str, chunk_tokens: int, max_docs: int, pause_s: float) -> None:
    """Write the first ``max_docs`` documents of ``source_manifest``'s train split to ``path``,
    slowly, so that a reader polls many intermediate states."""
    src = open_corpus(source_manifest, "train")
    with ShardWriter(path, split="train", tokenizer=src.tokenizer, chunk_tokens=chunk_tokens) as w:
        for i in range(min(max_docs, src.num_documents)):
            w.add_document(src.document(i), src.doc_ids[i].tobytes())
            if i % 5 == 0:
                time.sleep(pause_s)


def poll_live_shard(final: Path, source: Path, *, max_docs: int, chunk_tokens: int, pause_s: float) -> tuple[int, int]:
    """Run a writer process on ``final`` and poll it with open_live until it completes. Asserts,
    at every poll, that each newly exposed document is complete (ends with the only EOS it holds)
    and equals the source document; returns (polls that saw new documents, documents). A second
    corpus on the same shard polls alongside (HDF5 misreads after a refresh when one process has
    the same dataset open twice; the reader must share one handle)."""
    ctx = mp.get_context("spawn")
    writer = ctx.Process(target=_live_writer, args=(str(final), str(source), chunk_tokens, max_docs, pause_s))
    writer.start()
    src = open_corpus(source, "train")
    deadline = time.time() + 120
    c = None
    while c is None and time.time() < deadline:
        try:
            c = open_live(final)
        except (FileNotFoundError, FormatError):
            time.sleep(0.01)
    assert c is not None, "writer never created the shard"
    twin = open_live(final)
    growing_polls, seen = 0, 0
    while time.time() < deadline:
        new = c.refresh()
        twin.refresh()
        n = c.num_documents
        assert c.num_tokens == int(c.doc_offsets[-1]) and n >= seen
        for i in range(seen, n):
            d = c.document(i)
            assert d[-1] == c.eos_id and np.count_nonzero(d == c.eos_id) == 1, f"torn document {i}"
            np.testing.assert_array_equal(d, src.document(i))
            if i < twin.num_documents:
                np.testing.assert_array_equal(twin.document(i), d)
        if new and not c.complete:
            growing_polls += 1
        seen = n
        if c.complete:
            break
        time.sleep(0.005)
    writer.join(60)
    assert writer.exitcode == 0 and c.complete
    final_c = open_live(final)
    assert final_c.complete and final_c.num_documents == c.num_documents == min(max_docs, src.num_documents)
    np.testing.assert_array_equal(final_c.doc_offsets, c.doc_offsets)
    # format version 4: ids and flags arrive with the finished shard's sidecar
    assert [c.doc_id(i) for i in range(c.num_documents)] == [src.doc_id(i) for i in range(c.num_documents)]
    assert c.read_paths() == ["mmap"]  # finished: switched to the fast path
    return growing_polls, c.num_documents


def test_live_reader_never_sees_a_torn_document_and_ends_equal_to_final(stdlib_manifest, tmp_path):
    """A reader polling a shard that another process is writing (SWMR) only ever exposes complete
    documents, each equal to what was written, and ends with exactly the final file's documents."""
    polls, docs = poll_live_shard(tmp_path / "live.h5", stdlib_manifest, max_docs=150, chunk_tokens=2048, pause_s=0.02)
    assert docs == 150 and polls >= 5


def test_live_reader_on_gpt2_dev_documents(dev_manifest, tmp_path):
    """Same invariant on real GPT-2 documents from the dev corpus (a live build)."""
    polls, docs = poll_live_shard(tmp_path / "live.h5", dev_manifest, max_docs=1500, chunk_tokens=4096, pause_s=0.005)
    assert docs == 1500 and polls >= 5


def test_open_live_pickles_and_finishes_in_a_thread(tmp_path):
    """open_live in-process: a pickled live corpus reads the same prefix; after close() and rename
    the corpus reports complete and sees every document."""
    texts = stdlib_texts(40)
    ids = byte_encode(texts)
    final = tmp_path / "s.h5"
    w = ShardWriter(final, split="train", tokenizer=BYTE_IDENTITY, chunk_tokens=1024)
    for t, a in zip(texts[:20], ids[:20]):
        w.add_document(np.append(a, 256), doc_id(t))
    c = open_live(w.path)  # the .partial name works too
    assert not c.complete and 0 < c.num_documents <= 20
    c2 = pickle.loads(pickle.dumps(c))
    assert c2.num_documents == c.num_documents
    np.testing.assert_array_equal(c2.tokens(0, c.num_tokens), c.tokens(0, c.num_tokens))
    for t, a in zip(texts[20:], ids[20:]):
        w.add_document(np.append(a, 256), doc_id(t))
    w.close()
    c.refresh()
    assert c.complete and c.num_documents == len(texts) and c.split == "train"
    for i, a in enumerate(ids):
        np.testing.assert_array_equal(c.document(i)[:-1], a)
    assert open_live(final).num_documents == len(texts)
