"""Test helpers: an independent way to write corpora (the writer API + a tokenizer), used as the
oracle that loaders, the build and validate are compared against."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import xxhash

from h5corpus.storage import format as fmt
from testkit.corpora import (  # noqa: F401  (re-exported: the tests import them from here)
    BYTE_IDENTITY,
    GPT2_PATTERN,
    REPO,
    byte_encode,
    doc_id,
    gpt2_tiktoken,
    naive_bfd_packs,
    naive_buffer_packs,
    read_jsonl_texts,
    shared_dir,
    stdlib_texts,
    subprocess_env,
    write_corpus,
    write_fineweb_parquet,
)
from testkit.tokenizers import (  # noqa: F401  (re-exported)
    DEEP_PATTERN,
    TOKENIZER_FAMILIES,
    bpe_tokenizer_json,
    train_tokenizer_family,
    with_split_pattern,
)


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


def task_records(task, text_field: str = "text") -> list:
    """A task's records, ``(text, utf8 bytes)`` or ``BadRecord``, from the per-record reader, after
    asserting that the read stage's run reader of its kind (``jsonl_chunks``, ``parquet_chunks``),
    flattened, gives exactly the same records."""
    from h5corpus.build.input.records import BadRecord, TaskReader

    recs = list(TaskReader(task, text_field))
    reader = TaskReader(task, text_field)
    runs = {"parquet": reader.parquet_chunks}.get(task.kind)
    if task.kind in ("jsonl", "jsonl.gz", "jsonl.zst"):
        runs = reader.jsonl_chunks
    if runs is not None:
        flat: list = []
        for c in runs():
            flat.extend([c] if isinstance(c, BadRecord) else zip(*c))
        plain = [r if isinstance(r, BadRecord) else (r[0], bytes(r[1])) for r in flat]
        assert plain == [r if isinstance(r, BadRecord) else (r[0], bytes(r[1])) for r in recs]
    return recs


def write_jsonl(path: Path, texts) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return path


def read_built(manifest: Path) -> dict[str, list[tuple[bytes, np.ndarray, int]]]:
    """Every stored document per split, in manifest order, read with h5py alone (independent of
    the reader): (stored doc id: the first 16 bytes of the sha256 from format v3, tokens, flags)."""
    m = json.loads(manifest.read_text())
    out: dict[str, list] = {s: [] for s in fmt.SPLITS}
    for s in m["shards"]:
        ids, flags = read_doc_meta(manifest.parent / s["path"])
        with h5py.File(manifest.parent / s["path"], "r") as f:
            toks = f["tokens"][:]
            offs = f["doc_offsets"][:]
        for i in range(offs.size - 1):
            out[s["split"]].append((ids[i].tobytes(), toks[offs[i] : offs[i + 1]], int(flags[i])))
    return out


def read_sidecar(shard: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """A format version 4 shard's sidecar (``<shard>.docs``) read with ``struct`` straight from
    docs/FORMAT.md (independent of h5corpus): ids (n, 16), flags (n,) and the header's fields."""
    data = Path(str(shard) + ".docs").read_bytes()
    magic, version, id_bytes, docs, tokens = struct.unpack_from("<8sIIQQ", data, 0)
    head = dict(magic=magic, version=version, id_bytes=id_bytes, documents=docs, tokens=tokens)
    head.update(tokens_sha256=data[32:64].hex(), index_sha256=data[64:96].hex(), size=len(data))
    head["sha256"] = hashlib.sha256(data).hexdigest()
    ids = np.frombuffer(data, np.uint8, docs * id_bytes, 96).reshape(docs, id_bytes)
    flags = np.frombuffer(data, np.uint8, docs, 96 + docs * id_bytes)
    assert 96 + docs * (id_bytes + 1) == len(data), shard
    return ids, flags, head


def rebind_sidecar(shard: Path, entry: dict) -> None:
    """What a writer that produced these (edited) shard bytes consistently would have written: the
    version 4 sidecar of ``shard`` rebound to the manifest ``entry``'s (a dict) ``sha256`` and
    ``index_sha256`` (header bytes 32-96, docs/FORMAT.md), and ``entry``'s ``docs_sha256`` updated.
    Nothing for a shard without a sidecar."""
    side = Path(str(shard) + ".docs")
    if not side.exists():
        return
    data = bytearray(side.read_bytes())
    data[32:96] = bytes.fromhex(entry["sha256"]) + bytes.fromhex(entry["index_sha256"])
    side.write_bytes(bytes(data))
    entry["docs_sha256"] = hashlib.sha256(bytes(data)).hexdigest()


def read_doc_meta(shard: Path) -> tuple[np.ndarray, np.ndarray]:
    """A shard's document ids and flags read with h5py/struct alone: from the shard (versions 1-3)
    or from its sidecar (version 4)."""
    with h5py.File(shard, "r") as f:
        if "doc_ids" in f:
            return f["doc_ids"][:], f["doc_flags"][:]
    ids, flags, _ = read_sidecar(shard)
    return ids, flags


def flip_bit(path: Path, at: int) -> None:
    """Flip one bit at byte ``at`` of ``path`` and give the file back its size and mtime (what a
    cache keyed on them cannot see)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root (relative paths), the build's run markers excluded (a killed
    build leaves its own, holding its pid): ``.build.lock`` of a shards folder and
    ``.<manifest>.lock`` beside a manifest; and the manifest's layout and table files
    (``<manifest>.layout``, ``<manifest>.table``: readers' caches, bound to the files' inodes and
    mtimes, not build output)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not (p.name.startswith(".") and p.name.endswith(".lock"))
        and not p.name.endswith((fmt.LAYOUT_SUFFIX, fmt.TABLE_SUFFIX))
    }


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


def reference_ids(tokenizer_json: str, texts: Sequence[str]) -> list[np.ndarray]:
    """Ids of ``texts`` by ``tokenizers`` itself (special-token text encoded as text, nothing
    added): the oracle every encoder is compared with."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True
    return [np.asarray(tok.encode(t, add_special_tokens=False).ids, dtype=np.int64) for t in texts]


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
    "from h5corpus.build.stages.buildplan import StageContext\n"
    "from h5corpus.build.stages.tasks import read_task\n"
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


# -- Hugging Face transformers oracles -----------------------------------------------------------
def paragraph_texts(texts: Sequence[str], limit: int) -> list[str]:
    """The non-empty paragraphs (blank-line separated, stripped) of ``texts`` in order, at most
    ``limit``: many documents shorter than a pack, so packs and windows hold several of them."""
    out = [p.strip() for t in texts for p in t.split("\n\n") if p.strip()]
    return out[:limit]


def window_segments(input_ids: np.ndarray, row_len: int, eos_id: int) -> list[np.ndarray]:
    """The documents' parts inside document-masked windows, found from the tokens alone: a segment
    starts at every window start and after every EOS (the last token of a document)."""
    starts = set(range(0, input_ids.size, row_len)) | {int(i) + 1 for i in np.flatnonzero(input_ids == eos_id)}
    bounds = sorted(s for s in starts if s < input_ids.size) + [input_ids.size]
    return [input_ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def per_document_logits(model, segments: Sequence[np.ndarray]):
    """Each segment through ``model`` on its own (a batch of one on the model's device, default
    positions, no packing, no grad), logits concatenated: (sum of lengths, vocab). The oracle for
    packed execution."""
    import torch

    with torch.no_grad():
        return torch.cat(
            [
                model(
                    input_ids=torch.as_tensor(np.asarray(s, dtype=np.int64), device=model.device)[None], use_cache=False
                ).logits[0]
                for s in segments
            ]
        )


# -- perplexity filter oracles ----------------------------------------------------------------------
_LM_UNICODE_SPACE = "[\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
_LM_OWN = "\u3000-\u9fff\uf000-\uffff\u00a1-\u00bf\u2000-\u2bff"  # characters that are units by themselves
_LM_SPACE = " \t\r\x0b\x0c\x1c-\x1f"
_LM_PUNCT = "\x00-\x08\x0e-\x1b\x21-\x2f\x3a-\x40\x5b-\x60\x7b-\x7f"


def reference_lm_units(text: str) -> list[str]:
    """The language model's units of ``text`` by a regex over the ``str`` (the definition in
    ``h5corpus.filters.lmunits``, written independently): own-unit characters, ASCII punctuation,
    runs of line breaks (``"\\n"``; none at either end), runs of the other characters."""
    import re

    t = re.sub(_LM_UNICODE_SPACE, " ", text)
    pattern = f"[{_LM_OWN}]|[{_LM_PUNCT}]|\n(?:[{_LM_SPACE}]*\n)*|[^{_LM_OWN}{_LM_PUNCT}\n{_LM_SPACE}]+"
    units = ["\n" if u.startswith("\n") else u for u in re.findall(pattern, t)]
    while units and units[0] == "\n":
        units.pop(0)
    while units and units[-1] == "\n":
        units.pop()
    return units


def fold_lm_unit(unit: str) -> str:
    """A unit as the model tells units apart: ASCII letters lowercased, ASCII digits -> ``0``."""
    return unit.translate({c: c + 32 for c in range(65, 91)} | {c: 48 for c in range(48, 58)})


def reference_lm_unit_hash(unit: str) -> int:
    """The unit hash of ``h5corpus.filters.lmunits`` in plain Python integers."""
    mask, p = (1 << 64) - 1, 0x100000001B3
    if unit == "\n":
        return 0x165667B19E3779F9
    values = bytes((c + 1) & 0xFF for c in fold_lm_unit(unit).encode("utf-8", "surrogatepass"))
    h = 0
    for j in range(0, min(len(values), 64), 8):
        h = (h * p + int.from_bytes(values[j : j + 8], "little")) & mask
    h ^= (len(values) * 0x9E3779B97F4A7C15) & mask
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & mask
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & mask
    return h ^ (h >> 33)


def naive_kn_discounts(values: Iterable[int]) -> list[float]:
    """Chen & Goodman's modified Kneser-Ney discounts from counts, with the fallbacks of
    docs/FILTERS.md (one discount Y = n1 / (n1 + 2 n2), else 0.5)."""
    vals = list(values)
    n1, n2, n3, n4 = (sum(1 for v in vals if v == r) for r in (1, 2, 3, 4))
    if n1 and n2:
        y = n1 / (n1 + 2 * n2)
        if n3 and n4:
            d = [1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2, 3 - 4 * y * n4 / n3]
            if 0 < d[0] < 1 and 0 < d[1] < 2 and 0 < d[2] < 3:
                return d
        return [y, y, y]
    return [0.5, 0.5, 0.5]


class NaiveKneserNey:
    """Interpolated modified Kneser-Ney from the formulas, with dicts and recursion (the oracle of
    the vectorized trainer and scorer). ``docs``: each document's units (strings)."""

    def __init__(self, docs: Sequence[Sequence[str]], order: int) -> None:
        from collections import Counter

        self.order = order
        seqs = [["<s>", *map(fold_lm_unit, d), "</s>"] for d in docs]
        counts = [Counter() for _ in range(order + 2)]
        for s in seqs:
            for k in range(1, order + 1):
                for i in range(k - 1, len(s)):
                    counts[k][tuple(s[i - k + 1 : i + 1])] += 1
        self.a: list[dict] = [{}]
        for k in range(1, order + 1):
            left = Counter(g[1:] for g in counts[k + 1]) if k < order else None
            self.a.append({g: (c if k == order or g[0] == "<s>" else left[g]) for g, c in counts[k].items()})
        self.d = [[]] + [
            naive_kn_discounts(v for g, v in self.a[k].items() if k > 1 or g != ("<s>",)) for k in range(1, order + 1)
        ]
        self.sums: list[dict] = [{} for _ in range(order + 1)]
        self.mass: list[dict] = [{} for _ in range(order + 1)]
        for k in range(2, order + 1):
            for g, v in self.a[k].items():
                self.sums[k][g[:-1]] = self.sums[k].get(g[:-1], 0) + v
                self.mass[k][g[:-1]] = self.mass[k].get(g[:-1], 0) + self.disc(k, v)
        self.vocab = sorted({g[0] for g in counts[1]} - {"<s>"})  # + <unk>
        uni = [v for g, v in self.a[1].items() if g != ("<s>",)]
        self.total = sum(uni)
        self.gamma0 = sum(self.disc(1, v) for v in uni) / self.total

    def disc(self, k: int, count: int) -> float:
        return 0.0 if count == 0 else self.d[k][min(count, 3) - 1]

    def prob(self, context: Sequence[str], unit: str) -> float:
        """p(unit | context); units as strings (folded here); an unseen unit is ``<unk>``."""
        h = tuple(map(fold_lm_unit, context))[max(0, len(context) - (self.order - 1)) :] if self.order > 1 else ()
        return self._p(h, fold_lm_unit(unit))

    def _p(self, h: tuple, w: str) -> float:
        if not h:
            a = self.a[1].get((w,), 0)
            return max(a - self.disc(1, a), 0) / self.total + self.gamma0 / (len(self.vocab) + 1)
        k = len(h) + 1
        s = self.sums[k].get(h, 0)
        if s == 0:
            return self._p(h[1:], w)
        a = self.a[k].get((*h, w), 0)
        return max(a - self.disc(k, a), 0) / s + self.mass[k][h] / s * self._p(h[1:], w)


def spam_texts(reference_words: Sequence[str], n: int = 80, seed: int = 0) -> list[str]:
    """Spam-like documents in four kinds, in turn: keyword lists, word salad (real reference words
    without syntax), navigation/footer boilerplate, machine noise (random tokens)."""
    import random

    rng = random.Random(seed)
    kw = "cheap buy online best price discount free shipping casino poker loans replica watches weight loss seo backlinks crypto bitcoin deal sale".split()
    menu = ["Home", "About Us", "Contact", "Privacy Policy", "Terms of Service", "Login", "Register", "Cart"]
    menu += ["FAQ", "Sitemap", "Blog", "Careers", "Support", "My Account", "Wishlist", "Subscribe"]
    cities = ["London", "Paris", "Berlin", "Madrid", "Rome", "Dallas", "Boston", "Chicago"]
    noise = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEF+/=_-"
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            t = ", ".join(" ".join(rng.sample(kw, rng.randint(1, 3))) for _ in range(rng.randint(40, 120)))
        elif kind == 1:
            t = " ".join(rng.choice(reference_words) for _ in range(rng.randint(80, 300)))
        elif kind == 2:
            lines = []
            for _ in range(rng.randint(8, 25)):
                lines.append(" | ".join(rng.sample(menu, rng.randint(3, 7))))
                if rng.random() < 0.3:
                    lines.append(f"Copyright © {rng.randint(2005, 2025)} All rights reserved. Click here to subscribe!")
                if rng.random() < 0.3:
                    lines.append(
                        f"Best {rng.choice(kw)} {rng.choice(kw)} in {rng.choice(cities)} - {rng.choice(kw)} now"
                    )
            t = "\n".join(lines)
        else:
            t = " ".join(
                "".join(rng.choice(noise) for _ in range(rng.randint(3, 14))) for _ in range(rng.randint(60, 200))
            )
        out.append(t)
    return out


def interleave_ranks(per_rank: Sequence[Sequence]) -> list:
    """The global sequence as DDP ranks consume it: step after step, rank 0 first (every rank
    holds the same count, which the caller asserts)."""
    return [per_rank[r][s] for s in range(len(per_rank[0])) for r in range(len(per_rank))]


def assert_two_ranks_of_two_workers_replay(make: Callable[..., Any]) -> list[str]:
    """``make(rank=, world_size=)`` (a dataset) read by 2 ranks of 2 DataLoader workers each, step
    after step, is the 1-rank sequence (the last step wrapping to its start); returns that
    sequence's batch digests."""
    from torch.utils.data import DataLoader

    want = [batch_digest(b) for b in make(rank=0, world_size=1)]
    per_rank = [
        [batch_digest(b) for b in DataLoader(make(rank=r, world_size=2), batch_size=None, num_workers=2)]
        for r in range(2)
    ]
    assert len(per_rank[0]) == len(per_rank[1])
    got = interleave_ranks(per_rank)
    assert got[: len(want)] == want and got[len(want) :] == want[: len(got) - len(want)]  # wrap-around
    return want


def majority_document_run(segment_tables: Iterable) -> tuple[int, float]:
    """(longest run of consecutive microbatches in which one document supplies more than half of
    the input tokens, largest share of one microbatch's tokens from one document). Each table is
    a batch's ``segments`` ((S, 3) ``document, start, length``)."""
    best, top, run = 0, 0.0, {}
    for seg in segment_tables:
        seg = np.asarray(seg)
        docs, inv = np.unique(seg[:, 0], return_inverse=True)
        per = np.bincount(inv, weights=seg[:, 2])
        total = float(per.sum())
        top = max(top, float(per.max()) / total)
        major = {int(d) for d, t in zip(docs.tolist(), per.tolist()) if 2 * t > total}
        run = {d: run.get(d, 0) + 1 for d in major}
        best = max([best, *run.values()])
    return best, top


def write_v1_corpus(
    root: Path, texts: Sequence[str], *, chunk_tokens: int = 4096, shard_tokens: int = 60_000, version: int = 1
) -> Path:
    """A format version 1 corpus of ``texts`` as byte ids (train split), written with h5py straight
    from the version 1 contract (docs/FORMAT.md's version table and v1 layout: four datasets,
    chunk-padded ``/tokens``, variable-length string attributes, ``index_sha256`` of the offsets,
    ids and flags only), not by this h5corpus's writer. Returns the manifest path. ``version=2``:
    the version 2 contract instead (also ``/chunk_xxh3``, the xxh3-64 of each chunk, ending the
    index hash; every chunk stored raw, the last one whole, which version 2 allows)."""
    root = Path(root)
    (root / "shards" / "train").mkdir(parents=True, exist_ok=True)
    (root / "manifests").mkdir(parents=True, exist_ok=True)
    ident = BYTE_IDENTITY
    docs = [np.append(a, ident.eos_id).astype("<u2") for a in byte_encode(list(texts)) if a.size]
    ids = [hashlib.sha256(t.encode("utf-8")).digest() for t, a in zip(texts, byte_encode(list(texts))) if a.size]
    shards, k, i = [], 0, 0
    while i < len(docs):
        j, n = i, 0
        while j < len(docs) and (n == 0 or n + docs[j].size <= shard_tokens):
            n += docs[j].size
            j += 1
        toks = np.concatenate(docs[i:j])
        offs = np.concatenate([[0], np.cumsum([d.size for d in docs[i:j]])]).astype("<i8")
        id_rows = np.frombuffer(b"".join(ids[i:j]), np.uint8).reshape(j - i, 32)
        flags = np.zeros(j - i, np.uint8)
        path = root / "shards" / "train" / f"train-{k:05d}.h5"
        with h5py.File(path, "w", libver=("v110", "v114")) as f:
            f.create_dataset("tokens", data=toks, maxshape=(None,), chunks=(chunk_tokens,), track_times=False)
            f.create_dataset("doc_offsets", data=offs, maxshape=(None,), chunks=(4096,), track_times=False)
            f.create_dataset("doc_ids", data=id_rows, maxshape=(None, 32), chunks=(4096, 32), track_times=False)
            f.create_dataset("doc_flags", data=flags, maxshape=(None,), chunks=(4096,), track_times=False)
            sums = np.array(
                [
                    xxhash.xxh3_64_intdigest(toks[a : a + chunk_tokens].tobytes())
                    for a in range(0, toks.size, chunk_tokens)
                ],
                "<u8",
            )
            if version == 2:
                f.create_dataset("chunk_xxh3", data=sums, maxshape=(None,), chunks=(32,), track_times=False)
            attrs = {"format": "h5corpus", "version": version, "split": "train", "dtype": "uint16"}
            attrs.update(eos_id=ident.eos_id, chunk_tokens=chunk_tokens, tokenizer_name=ident.name)
            attrs.update(tokenizer_revision=ident.revision, tokenizer_sha256=ident.sha256, vocab_size=ident.vocab_size)
            for key, v in attrs.items():
                f.attrs[key] = v
        index = hashlib.sha256(
            offs.tobytes() + id_rows.tobytes() + flags.tobytes() + (sums.tobytes() if version == 2 else b"")
        ).hexdigest()
        shards.append(
            {
                "path": f"../shards/train/train-{k:05d}.h5",
                "split": "train",
                "tokens": int(toks.size),
                "documents": j - i,
                "sha256": hashlib.sha256(toks.tobytes()).hexdigest(),
                "index_sha256": index,
                "bytes": path.stat().st_size,
            }
        )
        i, k = j, k + 1
    manifest = {
        "format": "h5corpus",
        "version": version,
        "manifest_version": 1,
        "tokenizer": ident.to_json(),
        "dtype": "uint16",
        "chunk_tokens": chunk_tokens,
        "shards_dir": "../shards",
        "shards": shards,
        "splits": {
            "train": {"documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards)}
        },
    }
    (root / "manifests" / "shards.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return root / "manifests" / "shards.json"


def reseal_chunk_checksums(shard: Path) -> None:
    """Rewrite a shard's ``/chunk_xxh3`` to match its current tokens (xxh3-64 of each chunk's real
    tokens as little-endian bytes, computed here with ``xxhash`` directly): what a writer that
    produced wrong tokens consistently would have stored. Tests that edit tokens in place to
    exercise a content check (EOS placement, ids) use it so the chunk checksums don't stop the read
    first. Format version 3: the manifest (``manifests/shards.json`` of the shard's corpus folder)
    gets the matching ``sums_sha256``, ``index_sha256`` and ``bytes`` too, as that writer's build
    would have recorded (version 4: the index hash without ids and flags, and the sidecar rebound
    to the shard, :func:`rebind_sidecar`). The token ``sha256`` is left stale (``validate`` still catches the edit)."""
    with h5py.File(shard, "r+") as f:
        t = f[fmt.TOKENS][:].astype(f[fmt.TOKENS].dtype.newbyteorder("<"))
        C = f[fmt.TOKENS].chunks[0]
        sums = np.array([xxhash.xxh3_64_intdigest(t[k : k + C].tobytes()) for k in range(0, t.size, C)], "<u8")
        f[fmt.CHUNK_CHECKSUMS][:] = sums
        osums = f[fmt.OFFSETS_CHECKSUMS][:].astype("<u8").tobytes() if fmt.OFFSETS_CHECKSUMS in f else None
        index = b"".join(f[k][:].tobytes() for k in (fmt.DOC_OFFSETS, fmt.DOC_IDS, fmt.DOC_FLAGS) if k in f)
    manifest = Path(shard).resolve().parents[2] / "manifests" / "shards.json"
    if osums is None or not manifest.is_file():
        return
    raw = json.loads(manifest.read_text())
    for e in raw["shards"]:
        if (manifest.parent / e["path"]).resolve() == Path(shard).resolve():
            e["sums_sha256"] = hashlib.sha256(sums.tobytes() + osums).hexdigest()
            e["index_sha256"] = hashlib.sha256(index + sums.tobytes() + osums).hexdigest()
            e["bytes"] = Path(shard).stat().st_size
            rebind_sidecar(Path(shard), e)
    manifest.write_text(json.dumps(raw))


#: A build (``python -c`` with its BuildConfig JSON as argv[1]) whose filter waits for the file
#: argv[2] before every document: a build held mid-read, to race another build against it.
WAITING_BUILD_SCRIPT = (
    "import json, os, sys, time\n"
    "from h5corpus.build import BuildConfig, build_corpus\n"
    "class WaitForGo:\n"
    "    def process(self, text):\n"
    "        while not os.path.exists(sys.argv[2]):\n"
    "            time.sleep(0.02)\n"
    "        return text, None\n"
    "    def counters(self):\n"
    "        return {}\n"
    "r = build_corpus(BuildConfig(**json.loads(sys.argv[1]), filters=WaitForGo()))\n"
    "print(json.dumps(r.to_json()))\n"
)


def readme_python_block(section: str) -> str:
    """The one python block of the README section titled ``section`` (``## <section>``)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert len(blocks) == 1, f"the README's {section!r} section holds one python block"
    return blocks[0]


def readme_block(section: str, lang: str) -> str:
    """The one ``lang`` code block of the README section titled ``section`` (``## <section>``)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{lang}\n(.*?)```", body, flags=re.S)
    assert len(blocks) == 1, f"the README's {section!r} section holds one {lang} block"
    return blocks[0]
