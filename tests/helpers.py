"""Test helpers: an independent way to write corpora (the writer API + a tokenizer), used as the
oracle that loaders, the build and validate are compared against."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import h5py
import numpy as np

from h5corpus.storage import format as fmt
from h5corpus.storage.format import TokenizerIdentity
from h5corpus.storage.manifest import Manifest, write_manifest
from h5corpus.storage.writer import ShardWriter

REPO = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """``$H5CORPUS_SHARED`` or ``../shared`` beside the repository."""
    return Path(os.environ.get("H5CORPUS_SHARED", REPO.parent / "shared")).absolute()


def stdlib_texts(limit: int = 200, min_chars: int = 200) -> list[str]:
    """Real text that ships with every Python: the standard library's own source files, in sorted
    path order (deterministic on one Python version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for p in sorted(root.glob("*.py")):
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(t) >= min_chars:
            out.append(t)
        if len(out) >= limit:
            break
    return out


def read_jsonl_texts(paths: Iterable[Path]) -> list[str]:
    out = []
    for p in paths:
        with open(p, encoding="utf-8") as fh:
            for line in fh:
                out.append(json.loads(line)["text"])
    return out


def oracle_stream(manifest: Path, split: str = "train", dtype=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, doc_offsets, shard_starts) of ``split`` read with plain h5py, shard by shard in
    manifest order: the independent oracle the reader and loaders are compared with. ``dtype``
    casts the tokens (default: as stored)."""
    import h5py

    from h5corpus.storage.manifest import read_manifest

    m = read_manifest(manifest)
    toks, offs, starts = [], [np.zeros(1, np.int64)], [0]
    for s in m.shards_of(split):
        with h5py.File(m.shard_path(s), "r") as f:
            t, o = f["tokens"][:], f["doc_offsets"][:]
        toks.append(t)
        offs.append(o[1:] + starts[-1])
        starts.append(starts[-1] + t.size)
    t = np.concatenate(toks)
    return (t if dtype is None else t.astype(dtype)), np.concatenate(offs), np.array(starts, np.int64)


GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_tiktoken():
    """(tiktoken Encoding of GPT-2 from the shared ``gpt2.tiktoken``, its identity, dev corpus files),
    or None when ../shared is absent. Used by the benchmarks as the fast reference encoder."""
    sh = shared_dir()
    dev = sorted((sh / "corpora" / "dev").glob("*.jsonl"))
    tk = sh / "tokenizers" / "gpt2" / "gpt2.tiktoken"
    if not (dev and tk.exists()):
        return None
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    enc = tiktoken.Encoding(
        "gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(str(tk)),
        special_tokens={"<|endoftext|>": 50256},
    )
    ident = TokenizerIdentity(name="gpt2", revision="bench", sha256="b" * 64, vocab_size=50257, eos_id=50256)
    return enc, ident, dev


# A byte-level identity used where no real tokenizer is needed: id = UTF-8 byte, EOS = 256.
BYTE_IDENTITY = TokenizerIdentity(name="test-bytes", revision="local", sha256="0" * 64, vocab_size=257, eos_id=256)


def byte_encode(texts: Sequence[str]) -> list[np.ndarray]:
    return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]


def doc_id(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def write_corpus(
    root: Path,
    texts: Sequence[str],
    encode: Callable[[Sequence[str]], list],
    identity: TokenizerIdentity,
    *,
    chunk_tokens: int = 1 << 14,
    shard_tokens: int = 1 << 20,
    validation_every: int = 20,
) -> Path:
    """Write ``texts`` (deduplicated, in order) into shards under ``root/shards`` and a manifest at
    ``root/manifests/shards.json``. Every ``validation_every``-th document goes to validation.
    Returns the manifest path."""
    root = Path(root)
    manifest_path = root / "manifests" / "shards.json"
    seen: set[bytes] = set()
    docs: dict[str, list[tuple[np.ndarray, bytes]]] = {"train": [], "validation": []}
    ids = encode(list(texts))
    for i, (t, ids_i) in enumerate(zip(texts, ids)):
        d = doc_id(t)
        if d in seen or not t:
            continue
        seen.add(d)
        a = np.append(np.asarray(ids_i, dtype=np.int64), identity.eos_id)
        docs["validation" if i % validation_every == validation_every - 1 else "train"].append((a, d))
    m = Manifest(
        tokenizer=identity,
        dtype="uint16" if identity.vocab_size <= 65536 else "uint32",
        chunk_tokens=chunk_tokens,
        shards_dir="../shards",
    )
    for split, items in docs.items():
        shard_no, w = 0, None
        for a, d in items:
            if w is None:
                w = ShardWriter(
                    root / "shards" / split / f"{split}-{shard_no:05d}.h5",
                    split=split,
                    tokenizer=identity,
                    chunk_tokens=chunk_tokens,
                )
            w.add_document(a, d)
            if w.tokens >= shard_tokens:
                m.shards.append(w.close().relative_to(manifest_path.parent))
                w, shard_no = None, shard_no + 1
        if w is not None:
            m.shards.append(w.close().relative_to(manifest_path.parent))
        m.splits[split] = {
            "documents": sum(s.documents for s in m.shards_of(split)),
            "tokens": sum(s.tokens for s in m.shards_of(split)),
        }
    write_manifest(manifest_path, m)
    return manifest_path


def write_jsonl(path: Path, texts) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return path


def read_built(manifest: Path) -> dict[str, list[tuple[bytes, np.ndarray, int]]]:
    """Every stored document per split, in manifest order, read with h5py alone (independent of
    the reader): (doc id, tokens, flags)."""
    m = json.loads(manifest.read_text())
    out: dict[str, list] = {s: [] for s in fmt.SPLITS}
    for s in m["shards"]:
        with h5py.File(manifest.parent / s["path"], "r") as f:
            toks = f["tokens"][:]
            offs = f["doc_offsets"][:]
            ids = f["doc_ids"][:]
            flags = f["doc_flags"][:]
        for i in range(offs.size - 1):
            out[s["split"]].append((ids[i].tobytes(), toks[offs[i] : offs[i + 1]], int(flags[i])))
    return out


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root (relative paths), the build's lock files excluded (they
    hold a pid): ``.build.lock`` of a shards folder and ``.<manifest>.lock`` beside a manifest."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not (p.name.startswith(".") and p.name.endswith(".lock"))
    }


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def reference_quality_reason(text: str, t) -> str | None:
    """The quality rules one by one from their definitions (no batching, no bounds, plain sorts);
    ``t`` is a :class:`~h5corpus.filters.quality.QualityThresholds`."""
    from h5corpus.filters import quality, words
    from h5corpus.filters.quality import _text_rules
    from h5corpus.filters.words import CJK, LOWER, NONASCII, UPPER

    w = words.split_words(text)
    nw = len(w)
    if nw < t.min_words:
        return "min_words"
    if t.max_words is not None and nw > t.max_words:
        return "max_words"
    if nw == 0:
        return None
    single = ((w.bits & CJK) != 0) & (w.chars == 1)
    nc = int(single.sum())
    if 2 * nc < nw:
        mean = (int(w.chars.sum()) - nc) / max(nw - nc, 1)
        if not t.min_mean_word_length <= mean <= t.max_mean_word_length:
            return "mean_word_length"
    if int(((w.bits & (UPPER | LOWER)) == UPPER).sum()) > t.max_uppercase_words * nw:
        return "uppercase_words"
    if int(((w.bits & (UPPER | LOWER | NONASCII)) != 0).sum()) < t.min_alpha_words * nw:
        return "alpha_words"
    r = _text_rules(text, t, nw)
    if r is not None:
        return r
    k = quality.CJK_NGRAM_SCALE if 2 * nc >= nw else 1
    if any(quality.top_ngram_fraction(w, n * k) > lim for n, lim in t.max_top_ngram.items()):
        return "top_ngram"
    if any(quality.dup_ngram_fraction(w, n * k) > lim for n, lim in t.max_dup_ngram.items()):
        return "dup_ngram"
    return None


def bpe_tokenizer_json(merges: list[tuple[str, str]], *, normalizer=None, pre_tokenizer=None) -> dict:
    """A byte-level BPE tokenizer.json: the 256 byte symbols, then one id per merge, then EOS."""
    from h5corpus.build.tokenizer import byte_level_alphabet

    alpha = byte_level_alphabet()
    vocab = {alpha[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    eos = len(vocab)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": eos,
                "content": "<|endoftext|>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer
        or {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }


# -- loaders -------------------------------------------------------------------------------------
# Oracles of the loaders' documented rules (docs/PACKING.md), written as plain loops that share no
# code with h5corpus.loaders, and batch comparisons used by several loader tests and benchmarks.

#: The tensor fields of a VarlenBatch that two equal batches agree on (plus ``max_seqlen``).
BATCH_TENSORS = ("input_ids", "targets", "position_ids", "cu_seqlens", "pack_lengths")


def naive_chunks(doc_lengths: Sequence[int], max_seq_len: int) -> list[tuple[int, int, int]]:
    """``(document, start, inputs)`` of every chunk, documents in order, by the rule of
    docs/PACKING.md: a document of N tokens has N - 1 next-token pairs, cut into consecutive chunks
    of ``max_seq_len`` inputs plus a shorter last one (none for N < 2)."""
    out = []
    for d, n in enumerate(int(x) for x in doc_lengths):
        start = 0
        while start < n - 1:
            out.append((d, start, min(max_seq_len, n - 1 - start)))
            start += max_seq_len
    return out


def naive_buffer_packs(
    lengths: Sequence[int], capacity: int, buffer_size: int, states: list | None = None
) -> list[list[int]]:
    """Buffer best fit as docs/PACKING.md states it, by plain scans of the buffer (O(n x buffer)):
    the buffer (stream indices in arrival order) is topped up to ``buffer_size`` before every pick;
    a pack takes the longest buffered chunk that fits its room (the oldest among equals) until none
    fits. Returns the packs (stream indices in pick order); with ``states`` (a list), appends
    ``(cursor, sorted buffer)`` after every pack (a pack that ends exactly full makes no further
    pick, hence no top-up)."""
    n, buf, packs, pos = len(lengths), [], [], 0
    while pos < n or buf:
        room, pack = capacity, []
        while room:
            while len(buf) < buffer_size and pos < n:
                buf.append(pos)
                pos += 1
            bj, bl = -1, 0
            for j, i in enumerate(buf):
                if bl < lengths[i] <= room:
                    bj, bl = j, lengths[i]
            if bj < 0:
                break
            pack.append(buf.pop(bj))
            room -= bl
        packs.append(pack)
        if states is not None:
            states.append((pos, sorted(buf)))
    return packs


def naive_bfd_packs(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing as docs/PACKING.md states it, by plain scans of the open packs
    (O(n x packs)): chunks longest first (ties in index order), each into the open pack with the
    least room that still fits it (among equal rooms, the pack that reached that room last), else
    into a new pack. Returns the packs (indices in placement order), in opening order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    room: list[int] = []
    since: list[int] = []  # since[j]: step at which pack j reached its current room
    for step, i in enumerate(order):
        n, best = lengths[i], -1
        for j, r in enumerate(room):
            if n <= r and (best < 0 or r < room[best] or (r == room[best] and since[j] > since[best])):
                best = j
        if best < 0:
            best = len(packs)
            packs.append([])
            room.append(capacity)
            since.append(step)
        packs[best].append(i)
        room[best] -= n
        since[best] = step
    return packs


def assert_same_batch(got, want) -> None:
    """Two VarlenBatches hold equal fields (dtype included), ``max_seqlen`` and counts."""
    import torch

    for f in BATCH_TENSORS:
        g, w = getattr(got, f), getattr(want, f)
        assert g.dtype == w.dtype, f"{f}: {g.dtype} != {w.dtype}"
        assert torch.equal(g.cpu(), w.cpu()), f
    assert got.max_seqlen == want.max_seqlen
    assert (got.num_tokens, got.num_targets, got.num_segments, got.num_packs) == (
        want.num_tokens,
        want.num_targets,
        want.num_segments,
        want.num_packs,
    )


def batches_equal(a, b) -> bool:
    """The fields of :data:`BATCH_TENSORS` and ``max_seqlen`` are equal."""
    import torch

    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in BATCH_TENSORS) and a.max_seqlen == b.max_seqlen


def batch_digest(b) -> str:
    """sha1 over ``max_seqlen`` and the fields of :data:`BATCH_TENSORS` (read back to the host)."""
    h = hashlib.sha1(str(b.max_seqlen).encode())
    for f in BATCH_TENSORS:
        h.update(getattr(b, f).cpu().numpy().tobytes())
    return h.hexdigest()


def owned(batch):
    """A private copy of a batch received from a DataLoader worker: its shared-memory tensors each
    hold a file descriptor, so a test that keeps a whole epoch copies them (``clone()``)."""
    return batch.clone()


# -- build
_READ_STAGE = (
    "import json, sys\n"
    "from h5corpus.build.plan import StageContext\n"
    "from h5corpus.build.tasks import read_task\n"
    "print(json.dumps(read_task(StageContext.load(sys.argv[1]), int(sys.argv[2])).to_json()))\n"
)


def run_read_stage(state: Path, index: int, cwd: Path) -> dict:
    """Run the read stage of task ``index`` in a fresh interpreter that has only the state folder
    (``StageContext.load``), from ``cwd``; returns the record it printed."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", _READ_STAGE, str(state), str(index)],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def read_stage_files(state: Path, index: int) -> dict[str, str]:
    """sha256 of every file task ``index``'s read stage wrote (table, signatures, meta, candidate
    shards), its record excluded."""
    stem = f"{index:05d}"
    files = [
        p
        for p in (state / "read").rglob("*")
        if p.is_file() and p.relative_to(state / "read").parts[0].startswith(stem)
    ]
    return {
        p.relative_to(state).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(files)
        if p.name != f"{stem}.json"
    }


def without_timings(record: dict) -> dict:
    """A stage record without its CPU timings (the only field that differs between runs)."""
    return {k: v for k, v in record.items() if k != "seconds"}
