"""Format v3's and v4's index at scale: open cost, anonymous memory and bytes on disk per token, against
the same documents written by a version 2 writer (docs/FORMAT.md, "Why version 3"), by the version 3
layout (``--version 3``) and beside the peers' files (``--peers``).

Three steps, each its own process so that every figure is one fresh process's:

* ``write DIR --documents N --mean-tokens M --shards S``: synthetic documents (lengths lognormal
  around ``M`` tokens, ids uniform below GPT-2's vocabulary, EOS 50256 at each end) through
  whichever ``h5corpus`` is importable: run it with ``PYTHONPATH`` at an older checkout to write
  the same documents as version 2 (same ``--seed``, same bytes of tokens); ``--version 3`` writes
  the version 3 layout with this checkout (ids and flags inside the shard); ``--peers`` also
  writes the same tokens as a nanoGPT ``.bin`` (the uint16 tokens, nothing else) and in
  datatrove's tokenized layout (a ``.ds`` file of uint16 tokens and a ``.ds.index`` of one uint64
  end offset per document), under ``DIR/peers``.
* ``measure MANIFEST``: ``open_corpus`` seconds, ``RssAnon`` (``/proc/self/status``: shared page
  cache does not count) after open and after a first token read, document lookup and offsets
  range, and bytes per token: the shard files (what readers read) and, version 4, with the
  sidecars (``*.h5.docs``, ids and flags: the total), and the peers' files when written.
* ``report A.json B.json --out OUT``: the two measurements side by side (``bench/_report.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from bench._report import emit

GPT2_EOS = 50256
GPT2_VOCAB = 50257


def rss_anon_mb() -> float:
    """This process's anonymous resident memory (``RssAnon``), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write(root: Path, documents: int, mean_tokens: float, shards: int, seed: int, version: int, peers: bool) -> None:
    """Write ``documents`` synthetic documents into ``shards`` train shards under ``root`` (format
    ``version``: 0 for the writer's default), and with ``peers`` the peers' files of the same tokens."""
    from h5corpus.storage.format import TokenizerIdentity
    from h5corpus.storage.manifest import Manifest, write_manifest
    from h5corpus.storage.writer import ShardWriter

    ident = TokenizerIdentity(name="gpt2", revision="bench", sha256="0" * 64, vocab_size=GPT2_VOCAB, eos_id=GPT2_EOS)
    rng = np.random.default_rng(seed)
    sigma = 0.6
    lengths = np.maximum(rng.lognormal(np.log(mean_tokens) - sigma**2 / 2, sigma, documents).astype(np.int64), 2)
    kw = {"version": version} if version else {}
    m = Manifest(tokenizer=ident, dtype="uint16", chunk_tokens=1 << 18, shards_dir="../shards", **kw)
    mpath = root / "manifests" / "shards.json"
    if peers:
        (root / "peers").mkdir(parents=True, exist_ok=True)
        for name in ("train.bin", "000_train.ds", "000_train.ds.index"):
            (root / "peers" / name).unlink(missing_ok=True)
    for s, part in enumerate(np.array_split(np.arange(documents), shards)):
        n = lengths[part]
        flat = rng.integers(0, GPT2_EOS, int(n.sum()), dtype=np.uint16)
        flat[np.cumsum(n) - 1] = GPT2_EOS
        ids = np.frombuffer(b"".join(hashlib.sha256(int(i).to_bytes(8, "little")).digest() for i in part), np.uint8)
        path = root / "shards" / "train" / f"train-{s:05d}.h5"
        with ShardWriter(path, split="train", tokenizer=ident, fsync=False, **kw) as w:
            w.add_documents(flat, n, ids.reshape(-1, 32))
        m.shards.append(w.info.relative_to(mpath.parent))
        if peers:  # the same tokens as the peers store them
            with open(root / "peers" / "train.bin", "ab") as fh:  # nanoGPT: np.memmap of uint16 tokens
                fh.write(flat.astype("<u2").tobytes())
            with open(root / "peers" / "000_train.ds", "ab") as fh:  # datatrove: tokens ...
                fh.write(flat.astype("<u2").tobytes())
            ends = (np.cumsum(n) + sum(int(x.tokens) for x in m.shards[:-1])).astype("<u8")
            with open(root / "peers" / "000_train.ds.index", "ab") as fh:  # ... and one uint64 end per document
                fh.write(ends.tobytes())
    write_manifest(mpath, m)


def measure(manifest: Path) -> dict:
    """One fresh process's open cost, memory and disk figures for ``manifest``'s train split."""
    rss0 = rss_anon_mb()
    from h5corpus.storage.reader import open_corpus

    rss_import = rss_anon_mb()
    t0 = time.perf_counter()
    c = open_corpus(manifest, "train")
    t_open = time.perf_counter() - t0
    rss_open = rss_anon_mb()
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    pos = rng.integers(0, c.num_tokens, 1000)
    docs = c.doc_index_at(pos) if hasattr(c, "doc_index_at") else np.searchsorted(c.doc_offsets, pos, "right") - 1
    i = int(docs[0])
    first = c.document(i)
    t_first = time.perf_counter() - t0
    root = manifest.parent.parent
    shard_bytes = sum(p.stat().st_size for p in (root / "shards").rglob("*.h5"))
    docs_bytes = sum(p.stat().st_size for p in (root / "shards").rglob("*.h5.docs"))
    peers = {}
    for name, files in (("nanogpt_bin", ["train.bin"]), ("datatrove", ["000_train.ds", "000_train.ds.index"])):
        if all((root / "peers" / f).is_file() for f in files):
            peers[name] = round(sum((root / "peers" / f).stat().st_size for f in files) / c.num_tokens, 5)
    return {
        "manifest": str(manifest),
        "version": int(c.version),
        "documents": c.num_documents,
        "tokens": c.num_tokens,
        "shards": c.num_shards,
        "open_s": round(t_open, 4),
        "first_lookup_and_document_s": round(t_first, 4),
        "rss_anon_mb_import": round(rss_import - rss0, 1),
        "rss_anon_mb_after_open": round(rss_open, 1),
        "rss_anon_mb_after_first_read": round(rss_anon_mb(), 1),
        "shard_bytes": shard_bytes,
        "bytes_per_token": round(shard_bytes / c.num_tokens, 5),
        "sidecar_bytes": docs_bytes,
        "bytes_per_token_with_sidecars": round((shard_bytes + docs_bytes) / c.num_tokens, 5),
        "peers_bytes_per_token": peers,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "first_document_tokens": int(first.size),
    }


def _figures(runs: list[dict]) -> dict[str, str]:
    """The headline figures of docs/BENCHMARKS.md: open cost and bytes per token per corpus."""
    figs = {}
    for r in runs:
        k = f"format v{r['version']}, {r['documents']:,} documents in {r['shards']} shards"
        figs[k + ": open"] = f"{r['open_s']} s, RssAnon after open {r['rss_anon_mb_after_open']} MB"
        figs[k + ": bytes per token"] = f"{r['bytes_per_token']}"
        if r.get("sidecar_bytes"):  # version 4: what readers read, and the total with the sidecars
            figs[k + ": bytes per token"] += f" (shard files; with sidecars {r['bytes_per_token_with_sidecars']})"
        for peer, v in r.get("peers_bytes_per_token", {}).items():
            figs[f"{peer}, same {r['tokens']:,} tokens / {r['documents']:,} documents: bytes per token"] = f"{v}"
    return figs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("root", type=Path)
    w.add_argument("--documents", type=int, required=True)
    w.add_argument("--mean-tokens", type=float, required=True)
    w.add_argument("--shards", type=int, default=1)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--version", type=int, default=0, help="format version to write (0: the writer's default)")
    w.add_argument("--peers", action="store_true", help="also write the nanoGPT .bin and datatrove files")
    ms = sub.add_parser("measure")
    ms.add_argument("manifest", type=Path)
    r = sub.add_parser("report")
    r.add_argument("inputs", type=Path, nargs="+")
    r.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.cmd == "write":
        write(a.root, a.documents, a.mean_tokens, a.shards, a.seed, a.version, a.peers)
    elif a.cmd == "measure":
        print(json.dumps(measure(a.manifest)))
    else:
        runs = [json.loads(p.read_text()) for p in a.inputs]
        emit({"bench": "bench_index_v3", "runs": runs}, a.out, figures=_figures(runs))


if __name__ == "__main__":
    main()
