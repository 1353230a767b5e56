"""Corpora on object storage, against real servers on loopback (testkit/objectstores.py): moto's
S3 server with s3fs as the client, Debian's nginx for HTTP range reads, and a server that never
answers. The oracle is the local corpus: the same batches, every one, from s3://, http:// and the
path; GETs are counted in the servers' own request logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus
from h5corpus.storage.cache import DOWNLOAD_SUFFIX, LOCK_SUFFIX, ShardCache, take_lease
from h5corpus.storage.manifest import read_manifest
from h5corpus.storage.remote import RemoteError, RemoteOptions, redact
from testkit.clusters import EngineUnavailable, engine_unavailable
from testkit.objectstores import Nginx, StallServer, wait_for_file
from tests.helpers import REPO, batch_digest, subprocess_env
from tests.s3_helpers import moto_bucket, small_shards_corpus
from tests.s3_helpers import put_corpus as s3_put_corpus

BUCKET = "corpora"
SECRET = "testing-secret"  # MotoS3.env()'s dummy secret: must never appear in a message


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return small_shards_corpus(tmp_path_factory.mktemp("remote-corpus"))


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_bucket(tmp_path_factory.mktemp("moto"), BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def nginx(tmp_path_factory, corpus):
    try:
        server = Nginx.start(tmp_path_factory.mktemp("nginx"), corpus.parent.parent)
    except EngineUnavailable as e:
        engine_unavailable(str(e))
    with server:
        yield server


def put_corpus(manifest: Path, prefix: str) -> str:
    """The corpus copied under ``s3://<BUCKET>/<prefix>/`` with plain s3fs; its manifest's URL."""
    return s3_put_corpus(manifest, BUCKET, prefix)


def epoch_digests(source, loader: str = "window", seq_len: int = 256, **kw) -> list[str]:
    if loader == "bestfit":
        ds = BestFitDataset(source, 2 * seq_len, 4, 16, seed=3, **kw)
    else:
        ds = SlidingWindowDataset(source, seq_len, 8, seed=3, **kw)
    return [batch_digest(b) for b in ds]


def cached_shards(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*.h5") if p.is_file())


def test_same_batches_from_s3_http_and_local_path(corpus, s3, nginx, tmp_path):
    url = put_corpus(corpus, "same")
    for loader in ("window", "bestfit"):
        want = epoch_digests(open_corpus(corpus), loader)
        assert len(want) > 10
        got_s3 = epoch_digests(open_corpus(url, cache_dir=tmp_path / f"c-s3-{loader}"), loader)
        got_http = epoch_digests(  # and the cheaper proof of downloads
            open_corpus(
                nginx.url + "/manifests/shards.json",
                cache_dir=tmp_path / f"c-http-{loader}",
                remote=RemoteOptions(proof="checksums"),
            ),
            loader,
        )
        assert got_s3 == want
        assert got_http == want
    shards = [e.path.split("/")[-1] for e in read_manifest(corpus).shards_of("train")]
    cached = [p.name for p in cached_shards(tmp_path / "c-s3-window")]
    assert sorted(cached) == sorted(shards)  # the train split's shards, nothing else
    assert not list((tmp_path / "c-s3-window").rglob("*" + DOWNLOAD_SUFFIX))
    assert not list((tmp_path / "c-s3-window").rglob("*.docs"))  # sidecars only when ids are asked for


def test_two_ranks_two_workers_share_one_cache_and_download_each_shard_once(corpus, s3, tmp_path):
    url = put_corpus(corpus, "shared")
    cache, env = tmp_path / "cache", subprocess_env()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "remote_epoch.py"),
                url,
                str(cache),
                "0",
                str(r),
                "2",
                "2",
                str(tmp_path / f"rank{r}.json"),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())["digests"]
        assert got == epoch_digests(open_corpus(corpus), rank=r, world_size=2)
    gets = s3.gets(BUCKET)
    train = [e.path.split("../")[-1] for e in read_manifest(corpus).shards_of("train")]
    assert {k: gets[f"shared/{k}"] for k in train} == {k: 1 for k in train}  # each shard once, for 4 processes


def test_cache_smaller_than_the_corpus_completes_the_epoch_with_the_same_batches(corpus, s3, tmp_path):
    url = put_corpus(corpus, "small-cache")
    sizes = [e.bytes for e in read_manifest(corpus).shards_of("train")]
    limit = sum(sizes) // 2
    assert max(sizes) < limit < sum(sizes)
    cache = tmp_path / "cache"
    c = open_corpus(url, cache_dir=cache, cache_limit=limit)
    assert c.remote and not open_corpus(corpus).remote
    assert c.run_table() is None  # the split does not fit: shards are opened a few at a time
    for loader in ("window", "bestfit"):  # long windows: fewer batches, each from several shards
        assert epoch_digests(c, loader, 2048) == epoch_digests(open_corpus(corpus), loader, 2048)
    c.close()
    assert ShardCache(cache, limit).used_bytes() <= limit + max(sizes)  # at most the one shard held open
    gets = s3.gets(BUCKET)
    fetched = sum(n for k, n in gets.items() if k.startswith("small-cache/shards/train/"))
    assert fetched > len(sizes)  # evicted shards were fetched again


def test_eviction_never_removes_a_leased_shard(corpus, s3, tmp_path):
    url = put_corpus(corpus, "lease")
    cache = tmp_path / "cache"
    c = open_corpus(url, cache_dir=cache)
    c.tokens(0, 10)  # shard 0: fetched, leased while open
    c.run_table()  # every shard fetched and open
    held = cached_shards(cache)
    assert len(held) == c.num_shards
    ShardCache(cache, 0).make_room(1)
    assert cached_shards(cache) == held  # every one leased: nothing evicted
    lease = take_lease(str(held[0]))
    c.close()
    ShardCache(cache, 0).make_room(1)
    assert cached_shards(cache) == [held[0]]  # only the one a lease still holds
    lease.release()
    ShardCache(cache, 0).make_room(1)
    assert cached_shards(cache) == []
    assert c.tokens(0, 100).tolist() == open_corpus(corpus).tokens(0, 100).tolist()  # fetched again


@pytest.mark.parametrize("proof", ["sha256", "checksums"])
def test_a_shard_corrupted_on_the_server_is_refused_by_name(corpus, s3, tmp_path, proof):
    import s3fs

    url = put_corpus(corpus, f"corrupt-{proof}")
    e = read_manifest(corpus).shards_of("train")[1]
    assert e.file_sha256 is None  # a corpus published without file hashes: proven by the fallback
    key = f"{BUCKET}/corrupt-{proof}/shards/train/{Path(e.path).name}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF  # a token byte: same size, other content
    fs.pipe_file(key, bytes(data))
    cache = tmp_path / "cache"
    c = open_corpus(url, cache_dir=cache, remote=RemoteOptions(proof=proof))
    c.tokens(0, 10)  # shard 0 is fine
    with pytest.raises(RemoteError) as err:
        c.tokens(int(c.shard_token_starts[1]), int(c.shard_token_starts[1]) + 10)
    msg = str(err.value)
    assert "\n" not in msg and f"s3://{key}" in msg and e.path in msg and "refused" in msg
    assert SECRET not in msg
    name = Path(e.path).name
    assert not [p for p in cache.rglob(name + "*") if not p.name.endswith(LOCK_SUFFIX)]  # nothing half-written


def test_upload_records_file_hashes_and_a_download_that_differs_is_refused(corpus, s3, tmp_path):
    import hashlib

    import s3fs

    from h5corpus.storage.publish import upload_corpus

    rep = upload_corpus(corpus, f"s3://{BUCKET}/hashed")
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    published = json.loads(fs.cat_file(rep.manifest_url[len("s3://") :]))
    m = read_manifest(corpus)
    for entry, local in zip(published["shards"], m.shards):  # the oracle: hashlib over the local file
        assert entry["file_sha256"] == hashlib.sha256(Path(m.shard_path_str(local)).read_bytes()).hexdigest()
    assert epoch_digests(open_corpus(rep.manifest_url, cache_dir=tmp_path / "ok")) == epoch_digests(open_corpus(corpus))
    e = m.shards_of("train")[2]
    key = f"{BUCKET}/hashed/shards/train/{Path(e.path).name}"
    data = bytearray(fs.cat_file(key))
    data[100] ^= 0x01  # one bit of the superblock's padding region: same size, other bytes
    fs.pipe_file(key, bytes(data))
    cache = tmp_path / "bad"
    c = open_corpus(rep.manifest_url, cache_dir=cache)
    with pytest.raises(RemoteError) as err:
        c.tokens(int(c.shard_token_starts[2]), int(c.shard_token_starts[2]) + 10)
    msg = str(err.value)
    assert msg.startswith(f"s3://{key}: shard {e.path}: the downloaded bytes differ from the manifest (file_sha256")
    assert "\n" not in msg and "refused" in msg and SECRET not in msg
    assert not [p for p in cache.rglob(Path(e.path).name + "*") if not p.name.endswith(LOCK_SUFFIX)]


def test_v4_ids_come_from_the_uploaded_sidecars_fetched_only_when_asked_for(corpus, s3, tmp_path):
    """An uploaded format version 4 corpus: every sidecar is published (before the manifest);
    reading tokens fetches no sidecar; ``Corpus.doc_ids`` fetches them into the cache, proven, and
    equals the local ids; a sidecar changed on the server is refused, naming its URL and shard."""
    import s3fs

    from h5corpus.storage.publish import upload_corpus

    rep = upload_corpus(corpus, f"s3://{BUCKET}/v4ids")
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    m = read_manifest(corpus)
    assert m.version == 4
    for e in m.shards:  # oracle: the local sidecar's bytes
        key = f"{BUCKET}/v4ids/shards/{e.path.split('shards/', 1)[1]}.docs"
        assert fs.cat_file(key) == Path(m.shard_path_str(e) + ".docs").read_bytes()
    local = open_corpus(corpus, "train")
    c = open_corpus(rep.manifest_url, "train", cache_dir=tmp_path / "c")
    np.testing.assert_array_equal(c.tokens(0, 1000), local.tokens(0, 1000))
    assert not list((tmp_path / "c").rglob("*.docs"))
    np.testing.assert_array_equal(c.doc_ids, local.doc_ids)
    np.testing.assert_array_equal(c.doc_flags, local.doc_flags)
    assert len(list((tmp_path / "c").rglob("*.h5.docs"))) == len(m.shards_of("train"))
    e = m.shards_of("train")[1]
    key = f"{BUCKET}/v4ids/shards/{e.path.split('shards/', 1)[1]}.docs"
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0x01
    fs.pipe_file(key, bytes(data))
    cold = open_corpus(rep.manifest_url, "train", cache_dir=tmp_path / "cold")
    with pytest.raises(RemoteError) as err:
        cold.shard_doc_meta(1)
    msg = str(err.value)
    assert (
        msg.startswith(f"s3://{key}: document sidecar of shard {e.path}: the downloaded bytes differ")
        and "\n" not in msg
    )
    assert not list((tmp_path / "cold").rglob("*.docs"))  # nothing unproven kept


def test_validate_and_inspect_take_a_manifest_url_through_the_cache(corpus, s3, tmp_path):
    import s3fs

    from h5corpus.storage.publish import upload_corpus

    url = upload_corpus(corpus, f"s3://{BUCKET}/cli").manifest_url
    env = dict(subprocess_env(), H5CORPUS_REMOTE_CACHE=str(tmp_path / "cache"))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "h5corpus", *args], env=env, capture_output=True, text=True, timeout=300
        )

    m = read_manifest(corpus)
    r = cli("validate", url, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["manifest"], rep["shards"], rep["findings"]) == (url, len(m.shards), [])
    local, remote = cli("inspect", str(corpus), "--json"), cli("inspect", url, "--json")
    assert remote.returncode == 0, remote.stderr
    want, got = json.loads(local.stdout), json.loads(remote.stdout)
    assert got["splits"] == want["splits"] and got["splits"]  # the same figures from the cached copies
    e = m.shards[3]
    key = f"{BUCKET}/cli/shards/{e.path.split('shards/', 1)[1]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0x01
    fs.pipe_file(key, bytes(data))
    env["H5CORPUS_REMOTE_CACHE"] = str(tmp_path / "cold")
    r = cli("validate", url)
    assert r.returncode == 1 and f"FAIL {e.path}: download: s3://{key}: shard {e.path}: " in r.stdout + r.stderr


def test_a_file_written_out_of_order_is_hashed_again_not_refused(tmp_path):
    """StreamHash reads a download front to back as it grows; a writer of ranged parts (holes
    first) makes its digest differ, and the proof then hashes the finished file once."""
    import hashlib
    import threading

    from h5corpus.storage.cache import StreamHash, prove_by_file_hash
    from h5corpus.storage.format import ShardRecord

    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    want = hashlib.sha256(data).hexdigest()
    kw = dict(path="x.h5", split="train", tokens=0, documents=0, sha256="0" * 64, index_sha256="0" * 64)
    entry = ShardRecord(**kw, bytes=len(data), file_sha256=want)
    for order in ([0, 1, 2], [2, 0, 1]):  # in order; the last part first (a hole, then the rest)
        part = tmp_path / f"x-{order[0]}.download"
        part.touch()
        hasher = StreamHash(str(part))
        fd = os.open(part, os.O_WRONLY)

        def write(fd=fd, order=order) -> None:
            for k in order:
                os.pwrite(fd, data[k << 20 : (k + 1) << 20], k << 20)
                time.sleep(0.05)

        t = threading.Thread(target=write)
        t.start()
        t.join()
        os.close(fd)
        streamed, n = hasher.finish()
        assert n == len(data)
        if order == [0, 1, 2]:  # (out of order, the digest depends on when the thread read the hole)
            assert streamed == want
        assert prove_by_file_hash(str(part), entry, streamed) == ""
    bad = ShardRecord(**kw, bytes=len(data), file_sha256="f" * 64)
    assert prove_by_file_hash(str(part), bad, want).startswith("file_sha256: file hash ")


def test_a_download_killed_with_kill_9_resumes_cleanly(corpus, tmp_path):
    try:
        slow = Nginx.start(tmp_path / "nginx", corpus.parent.parent, limit_rate="128k")
    except EngineUnavailable as e:
        engine_unavailable(str(e))
    with slow:
        url = slow.url + "/manifests/shards.json"
        cache = tmp_path / "cache"
        child = subprocess.Popen(
            [sys.executable, "-c", f"from h5corpus import open_corpus; open_corpus({url!r}, cache_dir={str(cache)!r}).tokens(0, 1)"],
            env=subprocess_env(), start_new_session=True,
        )  # fmt: skip
        e = read_manifest(corpus).shards_of("train")[0]
        part = next(iter(cache.rglob("*" + DOWNLOAD_SUFFIX)), None)
        while part is None and child.poll() is None:
            time.sleep(0.02)
            part = next(iter(cache.rglob("*" + DOWNLOAD_SUFFIX)), None)
        assert part is not None, "no download began"
        wait_for_file(part, 64 << 10)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        final = part.with_name(part.name[: -len(DOWNLOAD_SUFFIX)])
        assert not final.exists() and 0 < part.stat().st_size < e.bytes  # a partial, never under the shard's name
        c = open_corpus(url, cache_dir=cache)
        n = int(c.shard_token_starts[1])  # shard 0's tokens: the one resumed
        assert np.array_equal(c.tokens(0, n), open_corpus(corpus).tokens(0, n))
        assert final.exists() and not part.exists()
        log = slow.access.read_text()
        assert f'"GET /shards/train/{final.name} HTTP/1.1" 206' in log  # resumed with a range request


def _fails_in_time(code: str, env: dict[str, str], timeout_s: float = 120) -> str:
    """Run ``code`` in a child; it must fail (not hang) with one RemoteError line; returns it."""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 3, r.stderr[-2000:]
    return r.stdout.strip()


_OPEN = (
    "import sys\nfrom h5corpus import open_corpus\nfrom h5corpus.storage.remote import RemoteError, RemoteOptions\n"
    "try:\n    open_corpus({url!r}, cache_dir={cache!r}, remote=RemoteOptions(timeout_s=1, retries=1, backoff_s=0.1))\n"
    "except RemoteError as e:\n    print(e); sys.exit(3)\n"
)


def test_a_stalled_server_times_out_with_a_clear_error(tmp_path):
    with StallServer() as stall:
        env = subprocess_env()
        msg = _fails_in_time(_OPEN.format(url=stall.url + "/c/manifests/shards.json", cache=str(tmp_path)), env)
        assert msg.startswith(stall.url + "/c/manifests/shards.json: manifest: timed out")
        env.update({"AWS_ENDPOINT_URL_S3": stall.url, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": SECRET})
        msg = _fails_in_time(_OPEN.format(url="s3://corpora/c/manifests/shards.json", cache=str(tmp_path)), env)
        assert msg.startswith("s3://corpora/c/manifests/shards.json: manifest: timed out") and SECRET not in msg


def test_missing_bucket_and_object_are_one_line_naming_the_url(s3, nginx, tmp_path):
    for url in ("s3://no-such-bucket-x/c/manifests/shards.json", f"s3://{BUCKET}/absent/manifests/shards.json"):
        with pytest.raises(RemoteError) as err:
            open_corpus(url, cache_dir=tmp_path)
        assert str(err.value) == f"{url}: manifest: not found (no such bucket or object)"
    secret_url = nginx.url.replace("http://", f"http://user:{SECRET}@") + "/absent.json?X-Amz-Signature=abc"
    with pytest.raises(RemoteError) as err:
        open_corpus(secret_url, cache_dir=tmp_path)
    assert str(err.value) == f"{nginx.url}/absent.json: manifest: not found (no such bucket or object)"
    assert redact(secret_url) == nginx.url + "/absent.json"
    with pytest.raises(RemoteError) as err:  # nginx answers 403 under /denied/
        open_corpus(nginx.url + "/denied/manifests/shards.json", cache_dir=tmp_path)
    assert str(err.value) == (
        f"{nginx.url}/denied/manifests/shards.json: manifest: access denied "
        "(check the backend's credentials: environment or profile)"
    )


def test_a_shard_missing_on_the_server_is_named(corpus, s3, tmp_path):
    import s3fs

    url = put_corpus(corpus, "missing-shard")
    e = read_manifest(corpus).shards_of("train")[2]
    key = f"{BUCKET}/missing-shard/shards/train/{Path(e.path).name}"
    s3fs.S3FileSystem(skip_instance_cache=True).rm_file(key)
    c = open_corpus(url, cache_dir=tmp_path)
    with pytest.raises(RemoteError) as err:
        c.document(int(c.shard_doc_starts[2]))
    assert str(err.value) == f"s3://{key}: shard {e.path}: not found (no such bucket or object)"
    assert not list(tmp_path.rglob("*" + DOWNLOAD_SUFFIX))


def test_upload_publishes_shards_before_the_manifest_and_resumes(corpus, s3, tmp_path):
    import shutil

    import s3fs

    root = tmp_path / "corpus"
    shutil.copytree(corpus.parent.parent, root)
    manifest = root / "manifests" / "shards.json"
    m = read_manifest(manifest)
    bad = Path(m.shard_path_str(m.shards[5]))
    good = bad.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    cmd = [sys.executable, "-m", "h5corpus", "upload", str(manifest), f"s3://{BUCKET}/up", "--json"]
    r = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and str(bad) in r.stderr, r.stderr
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert not fs.exists(f"{BUCKET}/up/manifests/shards.json")  # never a manifest whose shards are missing
    assert len(fs.find(f"{BUCKET}/up/shards")) == 2 * 5  # five shards, each after its sidecar
    bad.write_bytes(good)
    r = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["skipped"], rep["uploaded"], rep["shards"]) == (5, len(m.shards) - 5, len(m.shards))
    url = rep["manifest_url"]
    assert url == f"s3://{BUCKET}/up/manifests/shards.json"
    assert epoch_digests(open_corpus(url, cache_dir=tmp_path / "cache")) == epoch_digests(open_corpus(corpus))
    puts = [
        line.split('"PUT /', 1)[1].split(" ", 1)[0]
        for line in s3.log.read_text(errors="replace").splitlines()
        if '"PUT /corpora/up/' in line
    ]
    assert puts[-1] == "corpora/up/manifests/shards.json" and puts.count("corpora/up/manifests/shards.json") == 1


def test_prefetch_fetches_shards_in_the_background_without_holding_them(corpus, s3, tmp_path):
    from testkit.clusters import wait_until

    url = put_corpus(corpus, "prefetch")
    c = open_corpus(url, cache_dir=tmp_path, cache_limit=4 * max(e.bytes for e in read_manifest(corpus).shards))
    assert cached_shards(tmp_path) == []  # opening fetched the manifest only
    c.prefetch(np.array([3, 1, 3, 99]))  # duplicates and out-of-range indices are ignored
    want = sorted(Path(c.paths[s]) for s in (1, 3))
    wait_until(lambda: True if cached_shards(tmp_path) == want else None, 60, "the prefetched shards")
    assert c._leases == {}  # prefetched, not held: eviction may still take them
    ShardCache(tmp_path, 0).make_room(1)
    assert cached_shards(tmp_path) == []


def test_urls_resolve_like_the_manifest_folder_and_hide_credentials():
    from h5corpus.storage.remote import fs_path, is_remote, join_url

    m = "hf://datasets/org/corpus@v1.0/manifests/shards.json"
    assert join_url(m, "../shards/train/train-00000.h5") == "hf://datasets/org/corpus@v1.0/shards/train/train-00000.h5"
    assert fs_path(join_url(m, "../shards/x.h5")) == "datasets/org/corpus@v1.0/shards/x.h5"
    assert fs_path("https://h/c/manifests/shards.json") == "https://h/c/manifests/shards.json"
    assert join_url("s3://b/c/manifests/shards.json", "../shards/a.h5") == "s3://b/c/shards/a.h5"
    assert [is_remote(u) for u in ("s3://b/k", "gs://b/k", "az://c/k", "manifests/shards.json", "ftp://h/k")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    text = "GET https://user:pw@host/c/x.h5?X-Amz-Signature=abc&X-Amz-Credential=AKIA failed"
    assert redact(text) == "GET https://host/c/x.h5 failed"


def test_a_missing_backend_names_the_extra_to_install(tmp_path):
    import importlib.util

    from h5corpus.storage.remote import SCHEMES

    absent = [(s, mod, extra) for s, (_, mod, extra) in SCHEMES.items() if importlib.util.find_spec(mod) is None]
    if not absent:
        pytest.skip("every object-storage backend is installed here (gcsfs, adlfs, ...): nothing is missing")
    scheme, mod, extra = absent[0]
    with pytest.raises(ImportError) as err:
        open_corpus(f"{scheme}://bucket/c/manifests/shards.json", cache_dir=tmp_path)
    assert str(err.value) == f"{scheme}:// corpora need the {mod} package: pip install 'h5corpus[{extra}]'"
