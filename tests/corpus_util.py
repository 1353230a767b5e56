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
