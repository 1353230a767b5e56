"""Test helpers: an independent way to write corpora (the writer API + a tokenizer), used as the
oracle that loaders, the build and validate are compared against."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from h5corpus.format import TokenizerIdentity
from h5corpus.manifest import Manifest, ShardEntry, write_manifest
from h5corpus.writer import ShardWriter

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

    from h5corpus.manifest import read_manifest

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

    enc = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(tk)),
                            special_tokens={"<|endoftext|>": 50256})
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
    m = Manifest(tokenizer=identity, dtype="uint16" if identity.vocab_size <= 65536 else "uint32", chunk_tokens=chunk_tokens)
    for split, items in docs.items():
        shard_no, w = 0, None
        for a, d in items:
            if w is None:
                w = ShardWriter(root / "shards" / split / f"{split}-{shard_no:05d}.h5", split=split,
                                tokenizer=identity, chunk_tokens=chunk_tokens)
            w.add_document(a, d)
            if w.tokens >= shard_tokens:
                m.shards.append(ShardEntry.from_info(w.close(), manifest_path.parent))
                w, shard_no = None, shard_no + 1
        if w is not None:
            m.shards.append(ShardEntry.from_info(w.close(), manifest_path.parent))
        m.splits[split] = {
            "documents": sum(s.documents for s in m.shards_of(split)),
            "tokens": sum(s.tokens for s in m.shards_of(split)),
        }
    write_manifest(manifest_path, m)
    return manifest_path
