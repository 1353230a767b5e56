"""``h5corpus inspect``: the seed's counts, statistics and data checks over a built corpus.

:func:`inspect_corpus` streams each split shard by shard (memory: the per-document index plus one
``vocab_size`` histogram), computes the figures of seed 002's table (documents, raw tokens,
prediction pairs) and seed 001's statistics, simulates the best-fit loader's packing, and runs
the seed's checks, each reported pass/fail with the figure behind it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .storage import format as fmt
from .storage.manifest import Manifest, read_manifest

#: Tokens read per block while streaming a shard.
BLOCK_TOKENS = 1 << 22


@dataclass
class Check:
    """One of the seed's checks: ``passed`` and the figure that decided it."""

    name: str
    passed: bool
    figure: str

    def __str__(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.figure}"


@dataclass
class InspectReport:
    manifest: str
    settings: dict[str, Any]
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        splits = {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in self.splits.items()}
        return {
            "manifest": self.manifest,
            "settings": self.settings,
            "ok": self.ok,
            "splits": splits,
            "checks": [asdict(c) for c in self.checks],
        }


def _quantiles(lengths: np.ndarray) -> dict[str, int]:
    if lengths.size == 0:
        return {"min": 0, "median": 0, "p90": 0, "p99": 0, "max": 0}
    q = np.percentile(lengths, [50, 90, 99], method="nearest")
    return {
        "min": int(lengths.min()),
        "median": int(q[0]),
        "p90": int(q[1]),
        "p99": int(q[2]),
        "max": int(lengths.max()),
    }


def _stream_split(corpus, progress) -> dict[str, Any]:
    """One pass over a split's tokens: vocabulary histogram and EOS placement."""
    eos = corpus.eos_id
    vocab = corpus.manifest.tokenizer.vocab_size
    hist = np.zeros(vocab, dtype=np.int64)
    whole = (corpus.doc_flags & fmt.FLAG_TRUNCATED) == 0
    ends = corpus.doc_offsets[1:][whole] - 1  # global positions that must hold EOS
    ends = ends[ends >= 0]
    bad_ends = 0
    eos_total = 0
    n = corpus.num_tokens
    buf = np.empty(min(BLOCK_TOKENS, max(n, 1)), dtype=corpus.dtype)
    for a in range(0, n, BLOCK_TOKENS):
        b = min(a + BLOCK_TOKENS, n)
        view = corpus.tokens(a, b, out=buf[: b - a])
        hist += np.bincount(view, minlength=vocab)[:vocab]
        eos_total += int(np.count_nonzero(view == eos))
        lo, hi = np.searchsorted(ends, [a, b])
        bad_ends += int(np.count_nonzero(view[ends[lo:hi] - a] != eos))
        if progress:
            progress(b - a)
    return {
        "hist": hist,
        "bad_ends": bad_ends,
        "eos_inside": eos_total - (ends.size - bad_ends),
        "whole_docs": int(ends.size),
    }


def _check_chunking(corpus, seq_len: int, bad_ends: int, sample: int = 8) -> tuple[bool, str]:
    """Chunking covers every next-token pair of every document exactly once, and each whole
    document's final chunk ends on its real EOS.

    Checked on the chunk index for every document (memory O(chunks), no per-token arrays): inside
    each document, chunks start at 0 and each starts where the previous ended, lengths lie in
    [1, seq_len], and the last chunk's last target is the document's last token (which the token
    stream showed to be EOS, ``bad_ends`` = whole documents whose last token is not EOS). A sample
    of the longest real documents is also split with :func:`split_tokens` and compared token by
    token: inputs == doc[:-1], targets == doc[1:].
    """
    from .loaders.chunking import chunk_layout, split_tokens

    lengths = corpus.doc_lengths
    pairs = np.maximum(lengths - 1, 0)
    doc, start, length = chunk_layout(lengths, seq_len)
    per_doc = (
        np.bincount(doc, weights=length, minlength=lengths.size).astype(np.int64) if doc.size else np.zeros_like(pairs)
    )
    first = np.r_[True, doc[1:] != doc[:-1]] if doc.size else np.zeros(0, bool)
    ends = start + length
    gaps = int(np.count_nonzero(start[first] != 0)) + int(
        np.count_nonzero(start[~first] != np.r_[0, ends[:-1]][~first])
    )
    bad_len = int(np.count_nonzero((length < 1) | (length > seq_len)))
    lost = int(np.clip(pairs - per_doc, 0, None).sum())
    dup = int(np.clip(per_doc - pairs, 0, None).sum())
    last = np.r_[doc[1:] != doc[:-1], True] if doc.size else np.zeros(0, bool)
    # the last target of a document's last chunk sits at offset start + length: the document's last token
    not_at_end = int(np.count_nonzero(ends[last] != lengths[doc[last]] - 1))
    longest = np.argsort(-lengths, kind="stable")[:sample]
    sample_bad = 0
    for i in longest.tolist():
        toks = corpus.document(i)
        chunks = split_tokens(toks, max_seq_len=seq_len)
        ins = np.concatenate([c.inputs for c in chunks]) if chunks else toks[:0]
        tgs = np.concatenate([c.targets for c in chunks]) if chunks else toks[:0]
        if not (np.array_equal(ins, toks[:-1]) and np.array_equal(tgs, toks[1:])):
            sample_bad += 1
    chunk_pairs = int(length.sum())
    ok = lost == 0 and dup == 0 and gaps == 0 and bad_len == 0 and not_at_end == 0 and bad_ends == 0 and sample_bad == 0
    fig = (
        f"{chunk_pairs:,} chunked pairs vs {int(pairs.sum()):,} document pairs: {lost:,} lost, {dup:,} duplicated, "
        f"{gaps:,} gaps/overlaps; {not_at_end + bad_ends:,} documents whose last target is not their real EOS; "
        f"{sample_bad}/{len(longest)} longest documents differ from split_tokens"
    )
    return ok, fig


def _check_batches(
    corpus, seq_len, batch_size, packing_buffer, seed, mode, n_batches: int = 3
) -> tuple[tuple[bool, str], tuple[bool, str]]:
    """(model input length == real inputs and positions restart per segment; restoring the
    sampler state continues with the same next batch)."""
    from .loaders.batch import BatchError
    from .loaders.bestfit import BestFitDataset

    ds = BestFitDataset(
        corpus, max_seq_len=seq_len, batch_size=batch_size, packing_buffer=packing_buffer, seed=seed, mode=mode
    )
    it = iter(ds)
    bad_len = bad_pos = seen = 0
    real = 0
    batches = []
    for _ in range(n_batches):
        try:
            b = next(it)
        except StopIteration:
            break
        batches.append(b)
        seen += 1
        cu = b.cu_seqlens.long()
        seg_lens = cu[1:] - cu[:-1]
        real += int(seg_lens.sum())
        if b.input_ids.numel() != int(seg_lens.sum()) or b.input_ids.numel() != int(b.pack_lengths.sum()):
            bad_len += 1
        try:
            b.check()
        except BatchError:
            bad_pos += 1
    length_ok = seen > 0 and bad_len == 0 and bad_pos == 0
    length_fig = (
        f"{seen} microbatches, {real:,} real inputs = model input rows; "
        f"{bad_len} with a length mismatch, {bad_pos} with positions not restarting per segment"
    )
    # restore: state after one batch -> a fresh dataset continues with the same next batch
    ds2 = BestFitDataset(
        corpus, max_seq_len=seq_len, batch_size=batch_size, packing_buffer=packing_buffer, seed=seed, mode=mode
    )
    it2 = iter(ds2)
    first = next(it2, None)
    state = ds2.state_dict()
    expected = next(it2, None)
    ds3 = BestFitDataset(
        corpus, max_seq_len=seq_len, batch_size=batch_size, packing_buffer=packing_buffer, seed=seed, mode=mode
    )
    ds3.load_state_dict(state)
    got = next(iter(ds3), None)
    if first is None or expected is None:
        restore_ok, fig = True, "split holds fewer than 2 microbatches: nothing to resume"
    else:
        same = (
            got is not None
            and all(
                bool((getattr(got, f) == getattr(expected, f)).all())
                if hasattr(getattr(got, f), "shape")
                else getattr(got, f) == getattr(expected, f)
                for f in ("input_ids", "targets", "position_ids", "cu_seqlens", "max_seqlen", "pack_lengths")
            )
            and got.input_ids.shape == expected.input_ids.shape
        )
        restore_ok = bool(same)
        fig = (
            f"batch 2 after restoring the state taken after batch 1: "
            f"{'identical' if same else 'DIFFERENT'} ({expected.num_tokens:,} tokens, {expected.num_segments} segments)"
        )
    return (length_ok, length_fig), (restore_ok, fig)


def _decode_top(manifest: Manifest, ids: Sequence[int]) -> list[str] | None:
    """Texts of ``ids`` when the manifest's tokenizer can be loaded offline and is the same one
    (sha256 of its JSON); None otherwise (the table then shows ids)."""
    try:
        from .build.tokenize.tokenizer import load_tokenizer

        tok = load_tokenizer(manifest.tokenizer.name)
        if tok.identity.sha256 != manifest.tokenizer.sha256:
            return None
        return [tok.hf.decode([int(i)]) for i in ids]
    except Exception:  # tokenizer not available here: figures stay numeric
        return None


def inspect_corpus(
    manifest: str | os.PathLike[str],
    *,
    splits: Sequence[str] | None = None,
    seq_len: int = 4096,
    batch_size: int = 35,
    packing_buffer: int | None = None,
    mode: str = "buffer",
    seed: int = 0,
    top_k: int = 20,
    progress: bool = False,
) -> InspectReport:
    """Statistics and checks of ``splits`` (default: every split present) of a built corpus."""
    from .loaders.chunking import chunk_layout
    from .loaders.plan import default_packing_buffer, pack_fill
    from .storage.reader import open_corpus

    packing_buffer = default_packing_buffer(mode, packing_buffer)
    m = read_manifest(manifest)
    present = [s for s in fmt.SPLITS if m.shards_of(s)]
    splits = list(splits) if splits else present
    for s in splits:
        if s not in present:
            raise ValueError(f"{m.path}: split {s!r} has no shards (present: {present})")
    rep = InspectReport(
        manifest=str(m.path),
        settings={
            "seq_len": seq_len,
            "batch_size": batch_size,
            "packing_buffer": packing_buffer,
            "mode": mode,
            "seed": seed,
        },
    )
    total = sum(s.tokens for s in m.shards if s.split in splits)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="inspect", leave=False)
    corpora = {}
    try:
        for split in splits:
            c = open_corpus(m, split)
            corpora[split] = c
            lengths = c.doc_lengths
            built = m.splits.get(split, {}) if isinstance(m.splits.get(split), dict) else {}
            st = _stream_split(c, bar.update if bar else None)
            pairs = int(np.maximum(lengths - 1, 0).sum())
            doc, start, clen = chunk_layout(lengths, seq_len)
            long_idx = np.flatnonzero(lengths - 1 > seq_len)
            examples = []
            for i in long_idx[np.argsort(-lengths[long_idx], kind="stable")][:5].tolist():
                examples.append(
                    {"document": int(i), "tokens": int(lengths[i]), "chunk_lengths": clen[doc == i].tolist()}
                )
            hist = st["hist"]
            top = np.argsort(-hist, kind="stable")[:top_k]
            top = top[hist[top] > 0]
            decoded = _decode_top(m, top.tolist())
            pf = pack_fill(
                lengths, max_seq_len=seq_len, batch_size=batch_size, packing_buffer=packing_buffer, seed=seed, mode=mode
            )
            n_chunks = int(clen.size)
            padded_rows = n_chunks * seq_len
            # dynamic padding: segments in shuffled order, batch_size rows per microbatch, each row
            # padded to the microbatch's longest segment
            cl = clen[np.random.default_rng(seed).permutation(n_chunks)]
            rows_ = np.zeros(-(-cl.size // batch_size) * batch_size, dtype=np.int64)
            rows_[: cl.size] = cl
            rows_ = rows_.reshape(-1, batch_size)
            dyn = int((rows_.max(axis=1) * np.count_nonzero(rows_, axis=1)).sum())
            chars = built.get("characters")
            rep.splits[split] = {
                "documents": c.num_documents,
                "raw_tokens": c.num_tokens,
                "prediction_pairs": pairs,
                "bytes_on_disk": sum(s.bytes for s in m.shards_of(split)),
                "shards": len(m.shards_of(split)),
                "format_version": m.version,
                "verified_reads": c.verified,
                "integrity_note": c.integrity_note,
                "duplicates_dropped": built.get("duplicates"),
                "skipped": built.get("skipped"),
                "truncated": int(np.count_nonzero(c.doc_flags & fmt.FLAG_TRUNCATED)),
                "dropped": built.get("dropped"),
                "perplexity": built.get("perplexity"),
                "length_tokens": _quantiles(lengths),
                "documents_longer_than_seq_len": int(long_idx.size),
                "long_document_examples": examples,
                "chunks": n_chunks,
                "characters_per_token": (round(chars / c.num_tokens, 3) if chars and c.num_tokens else None),
                "vocabulary_used": int(np.count_nonzero(hist)),
                "vocabulary_size": m.tokenizer.vocab_size,
                "top_tokens": [
                    {"id": int(t), "count": int(hist[t]), **({"text": decoded[k]} if decoded else {})}
                    for k, t in enumerate(top.tolist())
                ],
                "packing": {
                    "fill": round(pf.fill, 6),
                    "fill_full_microbatches": round(pf.fill_full_microbatches, 6),
                    "packs": pf.packs,
                    "microbatches": pf.microbatches,
                    "real_tokens": pf.real_tokens,
                    "capacity": pf.capacity,
                },
                "padding": {
                    "pad_each_segment_to_seq_len_waste": round(1 - pairs / padded_rows, 6) if padded_rows else 0.0,
                    "pad_to_longest_in_microbatch_waste": round(1 - pairs / dyn, 6) if dyn else 0.0,
                },
                "eos": {
                    "bad_ends": st["bad_ends"],
                    "eos_inside": st["eos_inside"],
                    "whole_documents": st["whole_docs"],
                },
                "_lengths": lengths,
                "_pack_fill": pf.pack_fill,
            }
    finally:
        if bar:
            bar.close()

    # -- the seed's checks --------------------------------------------------------------------
    if "train" in corpora and "validation" in corpora:
        a = corpora["train"].doc_ids.view("V32").ravel()
        b = corpora["validation"].doc_ids.view("V32").ravel()
        both = int(np.intersect1d(a, b).size)
        rep.checks.append(
            Check(
                "no source document id in both splits",
                both == 0,
                f"{both:,} ids shared by {a.size:,} train and {b.size:,} validation documents",
            )
        )
    else:
        rep.checks.append(
            Check("no source document id in both splits", True, f"only {splits} inspected: nothing to compare")
        )
    for split, c in corpora.items():
        ok, fig = _check_chunking(c, seq_len, rep.splits[split]["eos"]["bad_ends"])
        rep.checks.append(
            Check(f"[{split}] chunking neither drops nor duplicates a pair and keeps the real EOS", ok, fig)
        )
    for split, c in corpora.items():
        (lok, lfig), (rok, rfig) = _check_batches(c, seq_len, batch_size, packing_buffer, seed, mode)
        rep.checks.append(
            Check(f"[{split}] model input length = real input count; positions restart per segment", lok, lfig)
        )
        rep.checks.append(Check(f"[{split}] restoring the sampler state continues with the same next batch", rok, rfig))
    for split in corpora:
        e = rep.splits[split]["eos"]
        ok = e["bad_ends"] == 0 and e["eos_inside"] == 0
        rep.checks.append(
            Check(
                f"[{split}] every document ends with EOS and no EOS elsewhere",
                ok,
                f"{e['bad_ends']:,} of {e['whole_documents']:,} documents lack the final EOS; "
                f"{e['eos_inside']:,} EOS inside documents",
            )
        )
    for c in corpora.values():
        c.close()
    return rep


def _runs(xs: Sequence[int]) -> str:
    """``[4096, 4096, 798]`` -> ``"2 x 4,096, 798"``."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j < len(xs) and xs[j] == xs[i]:
            j += 1
        out.append(f"{xs[i]:,}" if j - i == 1 else f"{j - i} x {xs[i]:,}")
        i = j
    return ", ".join(out)


def format_report(rep: InspectReport) -> str:
    """Human-readable table of an :class:`InspectReport`."""
    lines = [f"corpus {rep.manifest}", ""]
    names = list(rep.splits)
    rows: list[tuple[str, Callable[[dict], str]]] = [
        ("documents", lambda s: f"{s['documents']:,}"),
        ("raw tokens (EOS incl.)", lambda s: f"{s['raw_tokens']:,}"),
        ("prediction pairs", lambda s: f"{s['prediction_pairs']:,}"),
        ("bytes on disk", lambda s: f"{s['bytes_on_disk']:,}"),
        ("bytes on disk / token", lambda s: f"{s['bytes_on_disk'] / max(s['raw_tokens'], 1):.4f}"),
        (
            "format, reads",
            lambda s: f"v{s['format_version']}, " + ("verified" if s["verified_reads"] else "UNVERIFIED"),
        ),
        ("duplicates dropped", lambda s: "-" if s["duplicates_dropped"] is None else f"{s['duplicates_dropped']:,}"),
        ("records skipped", lambda s: "-" if s["skipped"] is None else f"{s['skipped']:,}"),
        ("truncated", lambda s: f"{s['truncated']:,}"),
        ("length min/median/p90/p99/max", lambda s: "/".join(f"{v:,}" for v in s["length_tokens"].values())),
        (f"docs > seq_len {rep.settings['seq_len']:,}", lambda s: f"{s['documents_longer_than_seq_len']:,}"),
        ("segments after chunking", lambda s: f"{s['chunks']:,}"),
        ("chars / token", lambda s: "-" if s["characters_per_token"] is None else f"{s['characters_per_token']}"),
        ("vocabulary used", lambda s: f"{s['vocabulary_used']:,} / {s['vocabulary_size']:,}"),
        ("pack fill (best-fit)", lambda s: f"{s['packing']['fill']:.4f}"),
        ("packs / microbatches", lambda s: f"{s['packing']['packs']:,} / {s['packing']['microbatches']:,}"),
        ("padded-batch waste (rows of seq_len)", lambda s: f"{s['padding']['pad_each_segment_to_seq_len_waste']:.1%}"),
        ("padded-batch waste (pad to longest)", lambda s: f"{s['padding']['pad_to_longest_in_microbatch_waste']:.1%}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    cols = [[fn(rep.splits[n]) for n in names] for _, fn in rows]
    widths = [max(len(n), *(len(c[i]) for c in cols)) for i, n in enumerate(names)]
    lines.append(" " * w0 + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths)))
    for (label, _), vals in zip(rows, cols):
        lines.append(label.ljust(w0) + "  " + "  ".join(v.rjust(w) for v, w in zip(vals, widths)))
    for n in names:
        ex = rep.splits[n]["long_document_examples"]
        if ex:
            lines.append("")
            lines.append(f"[{n}] longest documents -> chunk lengths:")
            for e in ex[:3]:
                lines.append(f"  document {e['document']:,}: {e['tokens']:,} tokens -> {_runs(e['chunk_lengths'])}")
        top = rep.splits[n]["top_tokens"][:10]
        if top:
            lines.append(
                f"[{n}] most frequent tokens: " + ", ".join(f"{t.get('text', t['id'])!r}:{t['count']:,}" for t in top)
            )
    lines += _perplexity_lines(rep)
    notes = sorted({s["integrity_note"] for s in rep.splits.values() if s.get("integrity_note")})
    for note in notes:
        lines.append("")
        lines.append(f"note: {note}")
    lines.append("")
    lines.append("checks:")
    lines.extend(f"  {c}" for c in rep.checks)
    lines.append("")
    lines.append("ALL CHECKS PASSED" if rep.ok else f"{sum(not c.passed for c in rep.checks)} CHECK(S) FAILED")
    return "\n".join(lines)


def _perplexity_lines(rep: InspectReport) -> list[str]:
    """The recorded score distribution per split (builds with a perplexity model), else nothing."""
    out = []
    for n, st in rep.splits.items():
        ppl = st.get("perplexity")
        if not ppl or not ppl.get("quantiles"):
            continue
        q = ppl["quantiles"]
        shown = ", ".join(
            f"{k} {q[k]:,.1f}" for k in ("p0", "p10", "p25", "p50", "p75", "p80", "p90", "p99", "p100") if k in q
        )
        out.append(f"[{n}] perplexity of {ppl['documents']:,} scored documents (after filters and dedup): {shown}")
    return [""] + out if out else []


def _perplexity_bins(ppl: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(left edges, widths, counts) of a recorded perplexity histogram (bins equal on a log axis)."""
    per = int(ppl["histogram"]["bins_per_decade"])
    idx = np.array([int(k) for k in ppl["histogram"]["counts"]], dtype=np.int64)
    counts = np.array(list(ppl["histogram"]["counts"].values()), dtype=np.int64)
    left = 10.0 ** (idx / per)
    return left, 10.0 ** ((idx + 1) / per) - left, counts


def plot_report(rep: InspectReport, path: str | os.PathLike[str]) -> Path:
    """Write a PNG: document length histogram (log axis), pack fill histogram, tokens per split,
    and, when the build recorded scores, the perplexity histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = {n: s["perplexity"] for n, s in rep.splits.items() if (s.get("perplexity") or {}).get("histogram")}
    fig, ax = plt.subplots(1, 4 if scored else 3, figsize=(20 if scored else 15, 4.2))
    for name, ppl in scored.items():
        left, width, counts = _perplexity_bins(ppl)
        ax[3].bar(left, counts, width=width, align="edge", alpha=0.6, label=f"{name} ({ppl['documents']:,} docs)")
    if scored:
        ax[3].set_xscale("log")
        ax[3].set_xlabel("perplexity (n-gram model)")
        ax[3].set_ylabel("documents")
        ax[3].set_title("perplexity after filters and dedup")
        ax[3].legend(fontsize=8)
    for name, s in rep.splits.items():
        L = s["_lengths"]
        if L.size:
            bins = np.logspace(0, np.log10(max(L.max(), 2)), 50)
            ax[0].hist(L, bins=bins, alpha=0.6, label=f"{name} ({s['documents']:,} docs)")
    ax[0].set_xscale("log")
    ax[0].axvline(
        rep.settings["seq_len"] + 1, color="k", ls="--", lw=1, label=f"seq_len + 1 = {rep.settings['seq_len'] + 1:,}"
    )
    ax[0].set_xlabel("document length (tokens, EOS included)")
    ax[0].set_ylabel("documents")
    ax[0].set_title("document lengths")
    ax[0].legend(fontsize=8)
    for name, s in rep.splits.items():
        pf = s["_pack_fill"]
        if pf.size:
            ax[1].hist(
                pf,
                bins=np.linspace(0, 1, 41),
                alpha=0.6,
                label=f"{name}: fill {s['packing']['fill']:.4f}, {s['packing']['packs']:,} packs",
            )
    ax[1].set_yscale("log")
    ax[1].set_xlabel("pack fill (real tokens / capacity)")
    ax[1].set_ylabel("packs")
    ax[1].set_title(f"best-fit pack fill (mode {rep.settings['mode']}, buffer {rep.settings['packing_buffer']})")
    ax[1].legend(fontsize=8)
    names = list(rep.splits)
    toks = [rep.splits[n]["raw_tokens"] for n in names]
    bars = ax[2].bar(names, toks, color=["tab:blue", "tab:orange"][: len(names)])
    for b, t in zip(bars, toks):
        ax[2].text(b.get_x() + b.get_width() / 2, b.get_height(), f"{t:,}", ha="center", va="bottom", fontsize=9)
    ax[2].set_ylabel("tokens (EOS included)")
    ax[2].set_title("tokens per split")
    fig.suptitle(Path(rep.manifest).name + (" - all checks passed" if rep.ok else " - CHECKS FAILED"))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
