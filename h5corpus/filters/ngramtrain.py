"""Training an n-gram language model (:class:`h5corpus.filters.perplexity.NgramModel`) on
reference texts: counting n-grams of units, interpolated modified Kneser-Ney estimation, and the
conversion to the backoff form the scorer reads. Vectorized: n-grams are counted with
``np.unique`` over their 64-bit keys, batch by batch, and merged.

Estimation (Chen & Goodman 1998, "An empirical study of smoothing techniques", section 3; as
KenLM's ``lmplz`` does it), for an order-N model over the vocabulary V (the units seen, ``</s>``
and ``<unk>``; ``<s>`` is context only):

- counts ``a(g)``: for the highest order and for n-grams starting with ``<s>``, the number of
  times ``g`` occurs; for the other n-grams of lower orders, the number of distinct units seen
  before ``g`` (its continuation count: Kneser-Ney's "in how many contexts does it appear");
- discounts per order from the counts of counts ``n_r`` (n-grams with ``a == r``):
  ``Y = n1 / (n1 + 2 n2)``, ``D_r = r - (r + 1) Y n_{r+1} / n_r`` for r = 1, 2, 3 (``D_3`` applies
  to every ``a >= 3``). When some ``n_r`` (r <= 4) is 0 or a ``D_r`` falls outside (0, r) -- tiny
  or odd corpora -- the order uses one discount ``D = Y`` (Ney's absolute discount) for every
  count, and 0.5 when even ``Y`` is undefined or 1; the header records which (``discount_rule``);
- ``p(w | h) = (a(hw) - D(a(hw))) / a(h.) + gamma(h) p(w | h')`` for a seen context ``h``
  (``a(h.)`` = sum of the counts of the n-grams continuing ``h``, ``h'`` = ``h`` without its first
  unit), with ``gamma(h) = (D_1 N_1(h) + D_2 N_2(h) + D_3 N_3+(h)) / a(h.)`` where ``N_r(h)`` counts
  the continuations of ``h`` with ``a == r`` (so every ``p(. | h)`` sums to 1 over V); an unseen
  context backs off with weight 1;
- unigrams: ``p(w) = (a(w) - D(a(w))) / sum_w a(w) + gamma / |V|`` (interpolated with the uniform
  distribution over V; ``<unk>`` gets ``gamma / |V|``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from .lmunits import units_batch
from .perplexity import MAX_ORDER, SMOOTHING, Level, NgramModel, key_of, layout, model_header, next_raw

#: Characters of text tokenized and counted at once (bounds the memory of one counting step).
BATCH_CHARS = 1 << 21
#: Unique n-grams kept in pending per-batch tables before they are merged.
_MERGE_ENTRIES = 1 << 23


@dataclass
class _Counts:
    """Unique n-grams of one order: sorted keys, occurrence counts, the keys of their prefix and
    suffix (order - 1; 0 for unigrams), and whether they start with ``<s>``."""

    keys: np.ndarray
    counts: np.ndarray
    prefix: np.ndarray
    suffix: np.ndarray
    bos: np.ndarray

    @staticmethod
    def merge(parts: Sequence[_Counts]) -> _Counts:
        if len(parts) == 1:
            return parts[0]
        keys = np.concatenate([p.keys for p in parts])
        u, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        counts = np.bincount(inv.ravel(), weights=np.concatenate([p.counts for p in parts]), minlength=u.size)

        def pick(name: str) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts])[first]

        return _Counts(u, counts.astype(np.int64), pick("prefix"), pick("suffix"), pick("bos"))


def count_batch(texts: Sequence[str], order: int) -> tuple[list[_Counts], int]:
    """Unique n-grams of orders 1..``order`` of ``texts`` (``<s>`` / ``</s>`` around each) and the
    number of units."""
    units = units_batch(texts)
    lay = layout(units)
    raw = lay.hashes.copy()
    keys_prev = key_of(raw)
    out = []
    for k in range(1, order + 1):
        if k == 1:
            keys, idx = keys_prev, np.arange(raw.size)
            prefix = suffix = np.zeros(raw.size, dtype=np.uint64)
        else:
            raw = next_raw(raw, lay.hashes)
            idx = np.flatnonzero(lay.pos >= k - 1)
            keys_all = key_of(raw)
            keys = keys_all[idx]
            prefix, suffix = keys_prev[idx - 1], keys_prev[idx]
            keys_prev = keys_all
        u, first, counts = np.unique(keys, return_index=True, return_counts=True)
        bos = lay.pos[idx[first]] == k - 1
        out.append(_Counts(u, counts.astype(np.int64), prefix[first], suffix[first], bos))
    return out, int(units.hashes.size)


def kn_discounts(a: np.ndarray) -> tuple[list[float], str]:
    """``([D_1, D_2, D_3], rule)`` for counts ``a`` (module docstring): rule ``modified``
    (Chen & Goodman), ``ney`` (one discount ``Y``) or ``fixed`` (0.5)."""
    n = [int(np.count_nonzero(a == r)) for r in range(1, 5)]
    if n[0] > 0 and n[1] > 0:
        y = n[0] / (n[0] + 2 * n[1])
        if all(n):
            d = [r - (r + 1) * y * n[r] / n[r - 1] for r in range(1, 4)]
            if all(0 < d[r - 1] < r for r in range(1, 4)):
                return d, "modified"
        return [y, y, y], "ney"
    return [0.5, 0.5, 0.5], "fixed"


def _discount_of(a: np.ndarray, d: Sequence[float]) -> np.ndarray:
    return np.asarray([0.0, *d], dtype=np.float64)[np.minimum(a, 3)]


def _index_of(keys: np.ndarray, q: np.ndarray, what: str) -> np.ndarray:
    i = np.searchsorted(keys, q)
    i = np.minimum(i, keys.size - 1)
    if not np.array_equal(keys[i], q):  # every prefix/suffix of a counted n-gram was counted
        raise RuntimeError(f"inconsistent n-gram counts: a {what} was not counted (64-bit key collision?)")
    return i


def estimate(levels: Sequence[_Counts]) -> tuple[list[Level], float, dict[str, Any]]:
    """Interpolated modified Kneser-Ney (module docstring) in backoff form: the model's levels,
    ``ln p(<unk>)`` and the smoothing parameters for the header."""
    order = len(levels)
    adjusted = []
    for k, c in enumerate(levels, start=1):
        if k == order:
            a = c.counts.copy()
        else:
            nxt = levels[k]
            a = np.bincount(_index_of(c.keys, nxt.suffix, "suffix"), minlength=c.keys.size).astype(np.int64)
            a[c.bos] = c.counts[c.bos]
        adjusted.append(a)
    discounts, rules = [], []
    # unigrams (without <s>)
    c1, a1 = levels[0], adjusted[0]
    vocab = ~(c1.bos)
    d, rule = kn_discounts(a1[vocab])
    discounts.append(d)
    rules.append(rule)
    total = float(a1[vocab].sum())
    disc = _discount_of(a1, d)
    gamma0 = float(disc[vocab].sum()) / total
    v_size = int(vocab.sum()) + 1  # + <unk>
    p_prev = np.where(vocab, (a1 - disc) / total + gamma0 / v_size, 0.0)
    unk = gamma0 / v_size
    probs = [p_prev]
    backoffs: list[np.ndarray] = []
    contexts: list[np.ndarray] = []
    for k in range(2, order + 1):
        c, a, low = levels[k - 1], adjusted[k - 1], levels[k - 2]
        d, rule = kn_discounts(a)
        discounts.append(d)
        rules.append(rule)
        disc = _discount_of(a, d)
        ctx = _index_of(low.keys, c.prefix, "prefix")
        suf = _index_of(low.keys, c.suffix, "suffix")
        denom = np.bincount(ctx, weights=a, minlength=low.keys.size)
        mass = np.bincount(ctx, weights=disc, minlength=low.keys.size)
        is_ctx = denom > 0
        gamma = np.divide(mass, denom, out=np.ones_like(mass), where=is_ctx)
        p = (a - disc) / denom[ctx] + gamma[ctx] * probs[-1][suf]
        probs.append(p)
        backoffs.append(np.log(gamma))
        contexts.append(is_ctx)
    out = []
    for k, c in enumerate(levels, start=1):
        with np.errstate(divide="ignore"):
            logp = np.log(probs[k - 1]).astype(np.float32)  # -inf for <s>
        bow = backoffs[k - 1].astype(np.float32) if k < order else None
        out.append(Level(c.keys, logp, bow, contexts[k - 1] if k < order else None))
    params = {
        "method": SMOOTHING,
        "discounts": [[float(x) for x in dd] for dd in discounts],
        "discount_rule": rules,
        "vocabulary": v_size,
        "unigrams": "interpolated with the uniform distribution over the vocabulary (seen units, </s>, <unk>)",
    }
    return out, float(np.log(unk)), params


def _batches(
    texts: Iterable[str], max_documents: int | None, batch_chars: int, stats: dict[str, Any], digest
) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for text in texts:
        if max_documents is not None and stats["documents"] >= max_documents:
            break
        data = text.encode("utf-8", errors="surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
        stats["documents"] += 1
        stats["characters"] += len(text)
        if not text.strip():
            stats["empty_documents"] += 1
            continue
        batch.append(text)
        chars += len(text)
        if chars >= batch_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def train_ngram_model(
    texts: Iterable[str],
    *,
    order: int = 3,
    max_documents: int | None = None,
    sources: Sequence[dict[str, Any]] | None = None,
    progress: bool = False,
    batch_chars: int = BATCH_CHARS,
) -> NgramModel:
    """Train an order-``order`` model on ``texts`` (streamed; empty or whitespace-only texts are
    skipped but counted). ``sources`` (JSON-able descriptions of where the texts came from) goes
    to the header with the documents, characters and units counted and ``texts_sha256``: the
    sha256 of every text's UTF-8, each preceded by its byte length (8 bytes, little-endian). Deterministic: the same texts and order give the same model, bytes
    included, whatever ``batch_chars`` (characters counted at once: memory only). Raises
    ValueError for a bad order or when no text holds a unit."""
    if not isinstance(order, int) or not 1 <= order <= MAX_ORDER:
        raise ValueError(f"order must be an integer in 1..{MAX_ORDER}, got {order!r}")
    if max_documents is not None and max_documents < 1:
        raise ValueError(f"max_documents must be >= 1, got {max_documents}")
    stats: dict[str, Any] = {"documents": 0, "characters": 0, "empty_documents": 0, "units": 0}
    digest = hashlib.sha256()  # of each text's UTF-8, preceded by its byte length (8 bytes, little-endian)
    pending: list[list[_Counts]] = [[] for _ in range(order)]
    bar = None
    if progress:
        bar = tqdm(total=max_documents, unit="doc", desc="quality-model train", leave=False)
    try:
        for batch in _batches(texts, max_documents, batch_chars, stats, digest):
            counted, n_units = count_batch(batch, order)
            stats["units"] += n_units
            for k in range(order):
                pending[k].append(counted[k])
                if sum(p.keys.size for p in pending[k]) > _MERGE_ENTRIES:
                    pending[k] = [_Counts.merge(pending[k])]
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
    if stats["units"] == 0:
        raise ValueError(f"no units to train on ({stats['documents']} documents, all empty)")
    levels, unk, params = estimate([_Counts.merge(p) for p in pending])
    training = {**stats, "texts_sha256": digest.hexdigest(), "max_documents": max_documents}
    training["sources"] = list(sources or [])
    header = model_header(levels, unk, smoothing=params, training=training)
    return NgramModel(levels, unk, header)
