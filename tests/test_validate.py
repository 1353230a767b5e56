"""validate beyond the corruption matrix of test_storage.py: EOS placement when the hashes agree,
the opt-in ``deep`` scan, worker-count independence, and compressed shards checked in processes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import xxhash

from h5corpus.storage.manifest import Manifest, read_manifest, write_manifest
from h5corpus.storage.validate import validate_corpus
from h5corpus.storage.writer import ShardWriter
from tests.helpers import BYTE_IDENTITY, byte_encode, doc_id, rebind_sidecar, stdlib_texts


def _edit_tokens_and_rehash(manifest: Path, k: int, edits: dict[int, int]) -> str:
    """Set ``tokens[pos] = value`` in shard ``k`` and make the manifest's hashes agree with the
    edited file, as if a buggy writer had produced it. Returns the shard's manifest path."""
    m = read_manifest(manifest)
    p = m.shard_path(m.shards[k])
    with h5py.File(p, "r+") as f:
        for pos, value in edits.items():
            f["tokens"][pos] = value
        toks, C = f["tokens"][:].astype("<u2"), f["tokens"].chunks[0]
        sums = np.array([xxhash.xxh3_64_intdigest(toks[a : a + C].tobytes()) for a in range(0, toks.size, C)], "<u8")
        f["chunk_xxh3"][:] = sums  # the buggy writer checksums what it wrote
        osums = f["offsets_xxh3"][:].astype("<u8").tobytes()  # offsets unchanged: their checksums hold
        index = f["doc_offsets"][:].tobytes() + sums.tobytes() + osums  # version 4: ids are the sidecar's
    raw = json.loads(manifest.read_text())
    raw["shards"][k]["sha256"] = hashlib.sha256(toks.tobytes()).hexdigest()
    raw["shards"][k]["index_sha256"] = hashlib.sha256(index).hexdigest()
    raw["shards"][k]["sums_sha256"] = hashlib.sha256(sums.tobytes() + osums).hexdigest()
    raw["shards"][k]["bytes"] = p.stat().st_size
    rebind_sidecar(p, raw["shards"][k])  # and its sidecar names the shard it wrote
    manifest.write_text(json.dumps(raw))
    return m.shards[k].path


def _offsets(manifest: Path, k: int) -> np.ndarray:
    m = read_manifest(manifest)
    with h5py.File(m.shard_path(m.shards[k]), "r") as f:
        return f["doc_offsets"][:]


def test_document_without_eos_is_named_even_when_hashes_agree(stdlib_manifest):
    """EOS at every document end is checked on the tokens themselves, not inferred from the hash."""
    offs = _offsets(stdlib_manifest, 1)
    name = _edit_tokens_and_rehash(stdlib_manifest, 1, {int(offs[5]) - 1: ord("x")})
    r = validate_corpus(stdlib_manifest, workers=2)
    assert [(f.shard, f.code) for f in r.findings] == [(name, "eos")], r.findings
    assert "document 4," in r.findings[0].message and f"token {int(offs[5]) - 1:,}" in r.findings[0].message


def test_deep_scan_finds_what_only_a_buggy_writer_could_write(stdlib_manifest):
    """Under matching hashes, an id >= vocab_size is named by the default check (a max per block),
    an EOS inside a document only by ``deep=True`` / ``--deep`` (the sha256 proves the tokens are
    the ones written; the writer refuses both)."""
    offs = _offsets(stdlib_manifest, 0)
    name = _edit_tokens_and_rehash(stdlib_manifest, 0, {int(offs[2]) + 1: BYTE_IDENTITY.eos_id, int(offs[7]) + 3: 300})
    default = validate_corpus(stdlib_manifest, workers=2)
    assert [(f.shard, f.code) for f in default.findings] == [(name, "range")], default.findings
    assert "token id 300 >= vocab_size 257" in default.findings[0].message
    deep = validate_corpus(stdlib_manifest, workers=2, deep=True)
    assert {(f.shard, f.code) for f in deep.findings} == {(name, "range"), (name, "eos")}, deep.findings
    cli = subprocess.run(
        [sys.executable, "-m", "h5corpus", "validate", str(stdlib_manifest), "--deep"], capture_output=True, text=True
    )
    assert cli.returncode == 1 and f"FAIL {name}: range" in cli.stderr, cli.stderr


def test_findings_do_not_depend_on_worker_count(stdlib_manifest):
    """Serial and threaded runs report the same findings (per-thread buffers are reused from shard to
    shard, so a leak between shards would show up as a difference)."""
    m = read_manifest(stdlib_manifest)
    with h5py.File(m.shard_path(m.shards[0]), "r+") as f:
        f["tokens"][123] = (int(f["tokens"][123]) + 1) % 256
    with h5py.File(m.shard_path(m.shards[2]), "r+") as f:
        f["doc_offsets"][4] += 1
    reports = [validate_corpus(stdlib_manifest, workers=w) for w in (1, 2, 3)]
    assert reports[0].findings and all(r.findings == reports[0].findings for r in reports), [
        r.findings for r in reports
    ]
    assert reports[0].failing_shards == sorted({m.shards[0].path, m.shards[2].path})


def test_compressed_shards_validate_in_processes(tmp_path):
    """Compressed shards (decoded under h5py's global lock) are checked in spawned processes when
    there are several; a flipped token is still named, intact shards still pass."""
    texts = stdlib_texts(90)
    m = Manifest(tokenizer=BYTE_IDENTITY, dtype="uint16", chunk_tokens=4096)
    for k, part in enumerate((texts[0::3], texts[1::3], texts[2::3])):
        with ShardWriter(
            tmp_path / "shards" / f"train-{k}.h5",
            split="train",
            tokenizer=BYTE_IDENTITY,
            chunk_tokens=4096,
            compression="gzip" if k < 2 else None,
        ) as w:
            for t, ids in zip(part, byte_encode(part)):
                w.add_document(np.append(ids, 256), doc_id(t))
        m.shards.append(w.info.relative_to(tmp_path / "manifests"))
    mpath = tmp_path / "manifests" / "shards.json"
    write_manifest(mpath, m)
    r = validate_corpus(mpath, workers=2)
    assert r.ok, r.findings
    assert r.bytes_hashed == 2 * r.tokens
    with h5py.File(tmp_path / "shards" / "train-1.h5", "r+") as f:
        f["tokens"][777] = (int(f["tokens"][777]) + 1) % 256
    r = validate_corpus(mpath, workers=2)
    assert r.failing_shards == ["../shards/train-1.h5"], r.findings
    assert "sha256" in {f.code for f in r.findings}  # and "size": a recompressed chunk changes the file size
