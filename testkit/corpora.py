"""Corpora, tokenizers and reference algorithms shared by the tests and the benches (so neither
imports the other): the shared data folder, stdlib and dev-corpus texts, byte and GPT-2 (tiktoken)
encoders, hand-written corpora and FineWeb-schema parquet, the O(n^2) reference packers, and the
environment of a child process that imports this checkout."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from h5corpus.storage.format import TokenizerIdentity
from h5corpus.storage.manifest import Manifest, write_manifest
from h5corpus.storage.writer import ShardWriter

REPO = Path(__file__).resolve().parent.parent
"""The checkout's root."""


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


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    return env


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


def write_fineweb_parquet(path: Path, texts, row_group_size: int) -> Path:
    """``texts`` as a parquet file with FineWeb's schema (synthetic metadata), ``row_group_size`` rows per group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("text", pa.string()),
            ("id", pa.string()),
            ("dump", pa.string()),
            ("url", pa.string()),
            ("date", pa.string()),
            ("file_path", pa.string()),
            ("language", pa.string()),
            ("language_score", pa.float64()),
            ("token_count", pa.int64()),
        ]
    )
    n = len(texts)
    table = pa.table(
        {
            "text": texts,
            "id": [f"<urn:uuid:{i:08d}>" for i in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{i}" for i in range(n)],
            "date": ["2024-02-20T00:00:00Z"] * n,
            "file_path": ["s3://commoncrawl/crawl-data/x.warc.gz"] * n,
            "language": ["en"] * n,
            "language_score": [0.9] * n,
            "token_count": [len(t) // 4 for t in texts],
        },
        schema=schema,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path
