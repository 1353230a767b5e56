"""Hostile shards and manifests: the reader refuses what breaks the format contract, naming the
shard, before serving a byte; validate has no blind spots; nothing hangs, nothing tracebacks.

Every corruption here is made in the test, on a fresh corpus, with h5py or plain file writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5corpus.storage.format import FormatError
from h5corpus.storage.manifest import read_manifest, write_manifest
from h5corpus.storage.reader import open_corpus
from h5corpus.storage.validate import validate_corpus
from tests.helpers import subprocess_env


def _first_shard(manifest: Path, split: str = "train") -> tuple[dict, Path]:
    raw = json.loads(manifest.read_text())
    entry = next(s for s in raw["shards"] if s["split"] == split)
    return entry, (manifest.parent / entry["path"]).resolve()


def _relist_size(manifest: Path, shard: Path) -> None:
    """Make the manifest's byte count match the (mutated) file, so only the mutation is left to find."""
    raw = json.loads(manifest.read_text())
    for s in raw["shards"]:
        if (manifest.parent / s["path"]).resolve() == shard:
            s["bytes"] = shard.stat().st_size
    manifest.write_text(json.dumps(raw))


def _replace_dataset(shard: Path, name: str, data: np.ndarray) -> None:
    with h5py.File(shard, "r+") as f:
        del f[name]
        f.create_dataset(name, data=data, chunks=True, maxshape=(None,) + data.shape[1:])


def _cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "h5corpus", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
        cwd=cwd,
    )


def _open_and_touch(manifest: Path, split: str = "train") -> None:
    """Open ``split`` and read from its first shard: tokens, offsets, ids and flags. Format version 3
    opens from the manifest alone and checks a shard when a process first touches it (ids and
    flags, proven against the manifest's index hash, when they are first read)."""
    c = open_corpus(manifest, split)
    c.tokens(0, 1)
    c.doc_offsets_range(0, 1)
    assert c.doc_ids.shape[0] == c.doc_flags.shape[0] == c.num_documents


def _no_traceback(p: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr[-2000:]


# -- the reader checks at open ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["<u4", "<f4", ">u2"])
def test_reader_refuses_tokens_of_another_dtype_or_byte_order(stdlib_manifest, dtype):
    """The /tokens dataset's real dtype and byte order are checked, not only the dtype attribute."""
    _, shard = _first_shard(stdlib_manifest)
    with h5py.File(shard, "r") as f:
        toks = f["tokens"][:]
        chunks = f["tokens"].chunks
    with h5py.File(shard, "r+") as f:
        del f["tokens"]
        f.create_dataset("tokens", data=toks.astype(dtype), chunks=chunks, maxshape=(None,))
    _relist_size(stdlib_manifest, shard)
    with pytest.raises(FormatError, match=rf"{shard.name}: /tokens is .* expected 1-D <u2"):
        _open_and_touch(stdlib_manifest, "train")
    rep = validate_corpus(stdlib_manifest, workers=1)
    assert any(f.code == "tokens" and shard.name in f.shard for f in rep.findings)


@pytest.mark.parametrize("mutation", ["decreasing", "past_the_end", "ids_short", "flags_long", "offsets_int32"])
def test_reader_refuses_a_broken_document_index(stdlib_manifest, tmp_path, mutation):
    """Decreasing offsets, an offset past the shard's tokens, one id row short, a flag too many,
    offsets of another dtype: open_corpus refuses naming the shard, and inspect exits 1 with it."""
    _, shard = _first_shard(stdlib_manifest)
    with h5py.File(shard, "r") as f:
        offs = f["doc_offsets"][:]
    side = Path(str(shard) + ".docs")  # format version 4: ids and flags in the sidecar
    ids_bytes = side.read_bytes()
    n = (len(ids_bytes) - 96) // 17
    if mutation == "decreasing":
        offs[3], offs[4] = offs[4], offs[3]
        _replace_dataset(shard, "doc_offsets", offs)
    elif mutation == "past_the_end":
        offs[-1] += 100
        _replace_dataset(shard, "doc_offsets", offs)
    elif mutation == "ids_short":  # one id row short: the header's count and the bytes say n - 1
        head = ids_bytes[:16] + (n - 1).to_bytes(8, "little") + ids_bytes[24:96]
        side.write_bytes(head + ids_bytes[96 : 96 + 16 * (n - 1)] + ids_bytes[96 + 16 * n :][:-1])
    elif mutation == "flags_long":
        side.write_bytes(ids_bytes + b"\x00")
    else:
        _replace_dataset(shard, "doc_offsets", offs.astype("<i4"))
    _relist_size(stdlib_manifest, shard)
    with pytest.raises(FormatError, match=shard.name):
        _open_and_touch(stdlib_manifest, "train")
    p = _cli("inspect", str(stdlib_manifest), "--seq-len", "512")
    _no_traceback(p)
    assert p.returncode == 1 and shard.name in p.stderr and "ALL CHECKS PASSED" not in p.stdout


def test_reader_refuses_a_missing_dataset_naming_the_shard(stdlib_manifest):
    _, shard = _first_shard(stdlib_manifest)
    with h5py.File(shard, "r+") as f:
        del f["chunk_xxh3"]
    _relist_size(stdlib_manifest, shard)
    with pytest.raises(FormatError, match=rf"{shard.name}: dataset /chunk_xxh3 is missing"):
        _open_and_touch(stdlib_manifest, "train")


@pytest.mark.parametrize("keep", ["half", "2k"])
def test_truncated_shard_is_refused_at_once(stdlib_manifest, keep):
    """A shard cut to half or to 2 KB is refused by open_corpus and by inspect within seconds
    (never read as zeros, never a hang in HDF5's retries), even when the manifest lists the cut size."""
    _, shard = _first_shard(stdlib_manifest, "validation")
    size = shard.stat().st_size
    os.truncate(shard, size // 2 if keep == "half" else 2048)
    with pytest.raises(FormatError, match=rf"{shard.name}: file is .* bytes, manifest says {size:,}"):
        _open_and_touch(stdlib_manifest, "validation")
    _relist_size(stdlib_manifest, shard)
    with pytest.raises(FormatError, match=shard.name):
        _open_and_touch(stdlib_manifest, "validation")
    p = _cli("inspect", str(stdlib_manifest), "--split", "validation", timeout=60)
    _no_traceback(p)
    assert p.returncode == 1 and shard.name in p.stderr


def test_a_shard_replaced_under_an_open_corpus_is_refused(stdlib_manifest, tmp_path):
    """A Corpus opened before the files were replaced (a rebuild into the same paths) refuses to
    apply its old index to the new files, in this process and in a DataLoader worker."""
    import pickle

    c = open_corpus(stdlib_manifest, "train")
    fresh = open_corpus(stdlib_manifest, "train")  # opened, never read: version 3 has not looked at the shard
    c.document(0)  # this one has read it: it knows the file
    _, shard = _first_shard(stdlib_manifest)
    other = tmp_path / "other.h5"
    shutil.copyfile(shard, other)
    with h5py.File(other, "r+") as f:  # same layout, other bytes: a "rebuilt" shard
        f["tokens"][:10] = 1
    os.replace(other, shard)
    clone = pickle.loads(pickle.dumps(c))  # what a DataLoader worker receives
    c.close()  # its maps of the old file served the old, verified bytes; reopened, the file is another
    for corpus in (c, clone):
        with pytest.raises(FormatError, match=rf"{shard.name}: the shard changed since this corpus was opened"):
            corpus.document(0)
    with pytest.raises(FormatError, match=rf"{shard.name}: chunk 0 of /tokens .* fails its checksum"):
        fresh.document(0)  # the trust chain refuses the other bytes


def test_reader_and_validator_agree_with_the_writer_on_an_intact_corpus(stdlib_manifest):
    """The checks refuse nothing the writer writes (the control for every test above)."""
    for split in ("train", "validation"):
        c = open_corpus(stdlib_manifest, split)
        assert c.num_documents > 0 and c.document(c.num_documents - 1)[-1] == c.eos_id
    assert validate_corpus(stdlib_manifest, workers=2).ok


# -- manifests: paths, duplicates, unlisted files -------------------------------------------------


def _edit(manifest: Path, fn) -> None:
    raw = json.loads(manifest.read_text())
    fn(raw)
    manifest.write_text(json.dumps(raw))


@pytest.mark.parametrize("path", ["/etc/passwd.h5", "../../outside.h5", "../shards/../../x.h5"])
def test_shard_paths_must_stay_inside_the_shards_folder(stdlib_manifest, path):
    """An absolute or escaping shard path is refused by every entry point, and validate never
    scans outside the corpus's folders for unlisted files."""
    _edit(stdlib_manifest, lambda raw: raw["shards"][0].update(path=path))
    with pytest.raises(FormatError, match="shard path"):
        read_manifest(stdlib_manifest)
    with pytest.raises(FormatError):
        _open_and_touch(stdlib_manifest, "train")
    p = _cli("validate", str(stdlib_manifest))
    _no_traceback(p)
    assert p.returncode == 1 and "shard path" in p.stdout + p.stderr
    assert len([x for x in (p.stdout + p.stderr).splitlines() if x.startswith("FAIL")]) == 1
    p = _cli("inspect", str(stdlib_manifest))
    _no_traceback(p)
    assert p.returncode == 1


def test_removed_entries_do_not_hide_their_files(stdlib_manifest):
    """Files in the corpus's split folders that the manifest does not list are reported, also when
    a whole split (or every shard) is dropped from the manifest."""
    raw = json.loads(stdlib_manifest.read_text())
    val = [s["path"] for s in raw["shards"] if s["split"] == "validation"]
    assert val
    _edit(stdlib_manifest, lambda r: r.update(shards=[s for s in r["shards"] if s["split"] == "train"][:1]))
    rep = validate_corpus(stdlib_manifest, workers=1)
    unlisted = {f.shard for f in rep.findings if f.code == "unlisted"}
    assert {Path(p).name for p in val} <= {Path(p).name for p in unlisted}
    _edit(stdlib_manifest, lambda r: r.update(shards=[], splits={}))
    rep = validate_corpus(stdlib_manifest, workers=1)
    unlisted = {f.shard for f in rep.findings if f.code == "unlisted"}
    assert not rep.ok and len({p for p in unlisted if p.endswith(".h5")}) == len(raw["shards"])
    assert {p + ".docs" for p in unlisted if p.endswith(".h5")} == {p for p in unlisted if p.endswith(".docs")}


def test_one_file_listed_twice_under_two_spellings_or_as_a_copy_is_refused(stdlib_manifest):
    """Duplicates are found by resolved path (``./``, ``..``, symlinks) and by content (a copy)."""
    first = json.loads(stdlib_manifest.read_text())["shards"][0]
    d, name = first["path"].rsplit("/", 1)
    _edit(stdlib_manifest, lambda r: r["shards"].append(dict(first, path=f"{d}/./{name}")))
    with pytest.raises(FormatError, match="already lists"):
        _open_and_touch(stdlib_manifest, "train")
    _edit(stdlib_manifest, lambda r: r["shards"].pop())
    src = (stdlib_manifest.parent / first["path"]).resolve()
    shutil.copyfile(src, src.with_name("copy.h5"))
    _edit(stdlib_manifest, lambda r: r["shards"].append(dict(first, path=f"{d}/copy.h5")))
    with pytest.raises(FormatError, match="holds the same documents"):
        _open_and_touch(stdlib_manifest, "train")
    link = src.with_name("link.h5")
    os.symlink(src, link)
    _edit(stdlib_manifest, lambda r: r["shards"][-1].update(path=f"{d}/link.h5"))
    with pytest.raises(FormatError, match="already lists"):
        read_manifest(stdlib_manifest)


_BAD_VALUES = {
    "tokens_string": lambda r: r["shards"][0].update(tokens="12"),
    "tokens_null": lambda r: r["shards"][0].update(tokens=None),
    "tokens_list": lambda r: r["shards"][0].update(tokens=[1]),
    "tokens_float": lambda r: r["shards"][0].update(tokens=12.0),
    "bytes_negative": lambda r: r["shards"][0].update(bytes=-1),
    "split_unknown": lambda r: r["shards"][0].update(split="test"),
    "chunk_tokens_zero": lambda r: r.update(chunk_tokens=0),
    "eos_id_string": lambda r: r["tokenizer"].update(eos_id="50256"),
    "sha256_short": lambda r: r["shards"][0].update(sha256="abc"),
    "shards_object": lambda r: r.update(shards={"a": 1}),
    "splits_tokens_string": lambda r: r["splits"]["train"].update(tokens="x"),
}


@pytest.mark.parametrize("case", sorted(_BAD_VALUES))
def test_malformed_manifest_values_name_the_field(stdlib_manifest, case):
    _edit(stdlib_manifest, _BAD_VALUES[case])
    with pytest.raises(FormatError, match="manifest field"):
        read_manifest(stdlib_manifest)
    p = _cli("validate", str(stdlib_manifest))
    _no_traceback(p)
    assert p.returncode == 1 and "FAIL <manifest>" in p.stdout + p.stderr


@pytest.mark.parametrize(
    "text",
    [
        b'{"format": "h5corpus", "version": 1, "chunk_tokens": NaN}',
        b'{"format": "h5corpus", "version": 1, "chunk_tokens": Infinity}',
        b'{"format": "h5corpus", "version": 1, "chunk_tokens": 1e400}',
        b'{"format": "h5corpus", "version": 1, "x": "\xff\xfe"}',
        b"[" * 100_000 + b"]" * 100_000,
        b"",
        b"[]",
    ],
    ids=["nan", "infinity", "overflow", "bad_utf8", "deep", "empty", "array"],
)
def test_unparseable_manifests_fail_cleanly(tmp_path, text):
    m = tmp_path / "shards.json"
    m.write_bytes(text)
    with pytest.raises(FormatError, match=str(m)):
        read_manifest(m)
    for cmd in ("validate", "inspect"):
        p = _cli(cmd, str(m), timeout=60)
        _no_traceback(p)
        assert p.returncode == 1, (cmd, p.stdout, p.stderr)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_manifest_path_that_is_not_a_file_fails_at_once(tmp_path, kind):
    m = tmp_path / "shards.json"
    if kind == "directory":
        m.mkdir()
    else:
        os.mkfifo(m)
    with pytest.raises(FormatError, match="manifest path is"):
        read_manifest(m)
    for cmd in ("validate", "inspect"):
        p = _cli(cmd, str(m), timeout=60)
        _no_traceback(p)
        assert p.returncode == 1 and "manifest path is" in p.stdout + p.stderr


def test_manifest_follows_the_umask(stdlib_manifest, tmp_path):
    """The manifest gets the mode a plain open() gives under the umask (others can read the corpus)."""
    m = read_manifest(stdlib_manifest)
    old = os.umask(0o022)
    try:
        write_manifest(tmp_path / "m.json", m)
        assert (tmp_path / "m.json").stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        write_manifest(tmp_path / "n.json", m)
        assert (tmp_path / "n.json").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


# -- command-line arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (["validate", "{m}", "--workers", "0"], "--workers must be >= 1"),
        (["validate", "{m}", "--workers", "-3"], "--workers must be >= 1"),
        (["inspect", "{m}", "--seq-len", "0"], "--seq-len must be >= 1"),
        (["inspect", "{m}", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["inspect", "ftp://bucket/manifests/shards.json"], "ftp:// manifests are not supported"),
        (["validate", "ftp://bucket/shards.json"], "ftp:// manifests are not supported"),
    ],
)
def test_bad_arguments_are_usage_errors(stdlib_manifest, args, needle):
    p = _cli(*[a.format(m=stdlib_manifest) for a in args])
    _no_traceback(p)
    assert p.returncode == 2 and needle in p.stderr, (p.returncode, p.stderr)


def test_a_nul_byte_in_a_path_is_refused(stdlib_manifest):
    with pytest.raises(FormatError, match="NUL"):
        read_manifest(str(stdlib_manifest) + "\0.bak")


def test_inspect_plot_without_matplotlib_says_what_to_install(stdlib_manifest, tmp_path):
    """Checked before any work: exit 2 naming the package (matplotlib made unimportable)."""
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.argv = ['h5corpus'] + sys.argv[1:]; "
        "from h5corpus.cli import main; main()"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, "inspect", str(stdlib_manifest), "--plot", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    _no_traceback(p)
    assert p.returncode == 2 and "matplotlib" in p.stderr and not (tmp_path / "x.png").exists()
