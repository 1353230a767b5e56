"""Shared fixtures.

Core fixtures use text that ships with Python (the standard library's sources) and a byte-level
identity, so the suite runs on any machine. Fixtures that need the GPT-2 files or the dev corpus
find them under ``$H5CORPUS_SHARED`` (default ``../shared``) and skip with the reason when absent.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from h5corpus.storage.format import TokenizerIdentity

# Real Slurm and Ray clusters (session scope, started on first use; tests/clusters.py). Tests that
# use them are marked `slurm` / `ray`.
from testkit.clusters import ray_cluster, slurm_cluster  # noqa: F401  (pytest finds fixtures by name)
from tests.helpers import BYTE_IDENTITY, byte_encode, shared_dir, stdlib_texts, write_corpus


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _h5corpus_cache_dir(tmp_path_factory):
    """Keep h5corpus's proof/ranks cache (``h5corpus.tokenize.cache_dir``) inside the test session,
    never in the user's ~/.cache (an explicit H5CORPUS_CACHE_DIR from the caller is kept)."""
    import os

    if os.environ.get("H5CORPUS_CACHE_DIR"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("H5CORPUS_CACHE_DIR", str(tmp_path_factory.mktemp("h5corpus-cache")))
        yield


@pytest.fixture(scope="session")
def shared() -> Path:
    return shared_dir()


@pytest.fixture(scope="session")
def gpt2_json(shared: Path) -> Path:
    p = shared / "tokenizers" / "gpt2" / "tokenizer.json"
    if not p.exists():
        pytest.skip(f"GPT-2 tokenizer.json not found at {p} (set H5CORPUS_SHARED)")
    return p


@pytest.fixture(scope="session")
def gpt2(gpt2_json: Path):
    """The HF ``tokenizers`` GPT-2 tokenizer from the shared folder."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(gpt2_json))


@pytest.fixture(scope="session")
def gpt2_identity(gpt2_json: Path) -> TokenizerIdentity:
    return TokenizerIdentity(
        name=str(gpt2_json),
        revision="local",
        sha256=hashlib.sha256(gpt2_json.read_bytes()).hexdigest(),
        vocab_size=50257,
        eos_id=50256,
    )


@pytest.fixture(scope="session")
def dev_dir(shared: Path) -> Path:
    p = shared / "corpora" / "dev"
    if not p.is_dir() or not any(p.glob("*.jsonl")):
        pytest.skip(f"dev corpus not found at {p} (set H5CORPUS_SHARED)")
    return p


@pytest.fixture(scope="session")
def dev_texts(dev_dir: Path) -> list[str]:
    """Every document of the dev corpus, files in sorted order, lines in order."""
    from tests.helpers import read_jsonl_texts

    return read_jsonl_texts(sorted(dev_dir.glob("*.jsonl")))


@pytest.fixture(scope="session")
def gpt2_encode(gpt2):
    def enc(texts):
        return [
            np.asarray(e.ids, dtype=np.int64) for e in gpt2.encode_batch_fast(list(texts), add_special_tokens=False)
        ]

    return enc


@pytest.fixture(scope="session")
def dev_manifest(tmp_path_factory, dev_texts, gpt2_encode, gpt2_identity) -> Path:
    """The whole dev corpus tokenized with GPT-2 (~10M tokens) written through the writer API:
    several shards per split, 64Ki-token chunks. Returns the manifest path."""
    root = tmp_path_factory.mktemp("dev-gpt2")
    return write_corpus(root, dev_texts, gpt2_encode, gpt2_identity, chunk_tokens=1 << 16, shard_tokens=3_000_000)


@pytest.fixture(scope="session")
def dev_gpt2_ids(gpt2_json: Path, dev_texts) -> list[np.ndarray]:
    """Reference GPT-2 ids (HF ``tokenizers``; special-token text encoded as text, no EOS) of every
    dev document, in ``dev_texts`` order. The oracle for the build and the tiktoken fast path."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(gpt2_json))
    tok.encode_special_tokens = True
    return [
        np.asarray(e.ids, dtype=np.uint32) for e in tok.encode_batch_fast(list(dev_texts), add_special_tokens=False)
    ]


@pytest.fixture(scope="session")
def stdlib_corpus_texts() -> list[str]:
    return stdlib_texts()


@pytest.fixture
def stdlib_manifest(tmp_path, stdlib_corpus_texts) -> Path:
    """Standard-library sources as byte ids (vocab 257), small chunks so documents span chunks and
    shards. Fresh per test, so tests may corrupt it."""
    return write_corpus(
        tmp_path,
        stdlib_corpus_texts,
        byte_encode,
        BYTE_IDENTITY,
        chunk_tokens=4096,
        shard_tokens=400_000,
        validation_every=10,
    )
