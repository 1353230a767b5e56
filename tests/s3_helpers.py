"""The tests' S3 side: a real moto server on loopback with one bucket, and a corpus folder copied
into it with plain s3fs (not h5corpus's upload)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from testkit.clusters import EngineUnavailable, engine_unavailable
from testkit.objectstores import MotoS3


@contextmanager
def moto_bucket(folder: Path, bucket: str) -> Iterator[MotoS3]:
    """A moto S3 server started in ``folder`` with ``bucket`` created, the AWS environment
    pointing at it while the block runs (a missing ``moto_server`` skips, or fails under CI)."""
    try:
        server = MotoS3.start(folder)
    except EngineUnavailable as e:
        engine_unavailable(str(e))
    with server, pytest.MonkeyPatch.context() as mp:
        for k, v in server.env().items():
            mp.setenv(k, v)
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        yield server


def put_corpus(manifest: Path, bucket: str, prefix: str) -> str:
    """Copy the corpus folder of ``manifest`` under ``s3://<bucket>/<prefix>/``; the manifest's URL."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    root = manifest.parent.parent
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fs.put_file(str(p), f"{bucket}/{prefix}/{p.relative_to(root).as_posix()}")
    return f"s3://{bucket}/{prefix}/manifests/shards.json"


def small_shards_corpus(root: Path) -> Path:
    """A byte-tokenized stdlib corpus in ~12 train shards of ~128 Ki tokens (8 Ki-token chunks):
    many shards of a few hundred KB, what the object-storage tests fetch; its manifest."""
    from tests.helpers import BYTE_IDENTITY, byte_encode, stdlib_texts, write_corpus

    return write_corpus(root, stdlib_texts(60), byte_encode, BYTE_IDENTITY, chunk_tokens=1 << 13, shard_tokens=1 << 17)
