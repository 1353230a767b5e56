"""Document filters for the build: cleaning, language ID, quality, PII scrubbing, near-dedup.

:class:`FilterConfig` says which stages run (all off by default); :class:`DocumentFilter` runs
them in the build's worker processes, on the batches the build groups (:meth:`DocumentFilter.process_batch`,
each stage vectorized over the batch; :meth:`DocumentFilter.process` is one document), in this order:

1. ``clean``: HTML documents -> main text (:mod:`h5corpus.clean`); then, if asked, Unicode repair
   (``fix_unicode``) and whitespace normalization (``normalize_whitespace``).
2. ``lang``: keep documents whose language (py3langid, :mod:`h5corpus.langid`) is in ``lang``
   with probability >= ``lang_threshold``.
3. ``quality``: heuristic rules (:mod:`h5corpus.quality`).
3b. ``perplexity_model``: each document's perplexity under an n-gram language model trained on
   reference text (:mod:`h5corpus.filters.perplexity`), in ``FilterResult.info["perplexity"]``;
   documents above ``max_perplexity`` (when set) are dropped.
4. ``scrub_pii``: e-mails, phone numbers, IP addresses -> placeholders (:mod:`h5corpus.pii`).

:meth:`DocumentFilter.process` returns ``(text, None)`` for a kept document (the text to hash into
the document id and tokenize) or ``(None, reason)``. Near-dedup runs afterwards: ``process_batch(...,
signatures=True)`` gives the MinHash of every kept text (parallel), and the build feeds them in
global input order, after exact dedup, to :meth:`DocumentFilter.near_duplicate_index` ``.add``
(sequential; None when near-dedup is off).

Drop reasons (``--explain-drops``): ``clean:no_main_text``, ``clean:empty``, ``lang:<code>``
(detected language not wanted), ``lang:low_confidence`` (wanted language below the threshold),
``quality:<rule>``, ``perplexity``; the build adds ``exact_dup`` and ``near_dup``.

Counters (:meth:`DocumentFilter.stats`, a ``dict[str, int]``; add them up across workers with
:func:`merge_stats`): ``docs``, ``kept``, ``drop:<rule>`` (``drop:clean:no_main_text``,
``drop:clean:empty``, ``drop:lang``, ``drop:quality:<rule>``, ``drop:perplexity``), ``clean:html`` (documents extracted
from HTML), ``clean:unicode`` / ``clean:whitespace`` (documents changed), ``lang:<code>`` (documents
detected per language), ``pii:docs`` (documents changed), ``pii:email`` / ``pii:phone`` /
``pii:ip`` (replacements). The build's manifest has the drops per exact reason under
``splits.<split>.dropped`` (with ``exact_dup`` and ``near_dup``); :func:`dropped_counts` gives the
compact per-rule form (all ``lang:*`` as ``lang``).

Every stage's dependency (trafilatura, ftfy, py3langid, rensa) is imported only when the stage is
on, so ``import h5corpus`` works without the ``filters`` extra.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np

from . import clean
from .langid import check_languages, detect_languages
from .neardedup import MinHasher, NearDedupIndex, optimal_bands
from .perplexity import ModelFileError, load_model, read_model_header
from .pii import digit_prefix_pattern, scrub_pii
from .quality import QualityThresholds, quality_batch
from .words import SEGMENT_BYTES, hash_powers, split_words, split_words_batch

FILTERS_VERSION = 2
"""Version of the filter semantics; bump when a stage changes what it keeps or emits.
2: language ID scores through one sparse product per batch (float32 sums in another order:
probabilities may differ by ~1e-6, so a document exactly at a threshold could flip)."""


@dataclass(kw_only=True)
class FilterConfig:
    """Which filter stages run and with which parameters. All stages are off by default."""

    clean: bool = False
    """Extract the main text of documents that are HTML (trafilatura); plain text is untouched."""
    fix_unicode: bool = False
    """Repair mojibake and strip control characters with ftfy (conservative settings)."""
    normalize_whitespace: bool = False
    """Unify line breaks, collapse spaces, at most one blank line in a row, strip."""
    quality: bool = False
    """Apply the heuristic quality rules with :attr:`quality_thresholds`."""
    quality_thresholds: QualityThresholds = field(default_factory=QualityThresholds)
    """Limits of the quality rules."""
    lang: tuple[str, ...] = ()
    """ISO 639-1 codes to keep (e.g. ``("en",)``); empty = no language filter."""
    lang_threshold: float = 0.5
    """Smallest py3langid probability (normalized, in [0, 1]) of a kept language."""
    lang_max_chars: int = 500
    """Characters from the start of each document that language ID looks at (cost is
    proportional; on the dev corpus 500 and 1,000 agree on every English/major-language
    document and differ on 16 of 129 UDHR translations in small languages)."""
    scrub_pii: bool = False
    """Replace e-mail addresses, phone numbers and IP addresses with placeholders."""
    near_dedup: bool = False
    """Drop documents whose MinHash-estimated Jaccard similarity to an earlier kept document is
    at least :attr:`near_dedup_threshold` (the build runs the index)."""
    near_dedup_threshold: float = 0.8
    """Jaccard similarity, in (0, 1), from which two documents are near duplicates."""
    shingle_size: int = 5
    """Words per shingle."""
    num_perm: int = 128
    """MinHash permutations (signature length, uint32 values)."""
    bands: int | None = None
    """LSH bands; None = derived from the threshold and ``num_perm`` with ``rows``."""
    rows: int | None = None
    """LSH rows per band; None = derived (datasketch's rule: 9 x 13 for 0.8 and 128)."""
    verify: bool = True
    """Confirm LSH candidates by signature agreement >= threshold (else any band collision)."""
    seed: int = 1
    """MinHash seed."""
    perplexity_model: str | None = None
    """Path of an n-gram language model file (``h5corpus quality-model train``): every document
    reaching this stage gets its perplexity under it (``FilterResult.info["perplexity"]``)."""
    max_perplexity: float | None = None
    """Drop documents whose perplexity is above this (>= 1; needs ``perplexity_model``); None =
    score only (e.g. for a decision over all documents' scores made later)."""
    perplexity_max_chars: int | None = None
    """Score only the first this many characters of each document; None = the whole document."""

    @property
    def enabled(self) -> bool:
        """True when any stage is on."""
        return bool(
            self.clean
            or self.fix_unicode
            or self.normalize_whitespace
            or self.quality
            or self.lang
            or self.scrub_pii
            or self.near_dedup
            or self.perplexity_model is not None
        )

    def lsh_params(self) -> tuple[int, int]:
        """``(bands, rows)``: as configured, or derived (:func:`h5corpus.neardedup.optimal_bands`)."""
        if self.bands is not None and self.rows is not None:
            return self.bands, self.rows
        b, r = optimal_bands(self.near_dedup_threshold, self.num_perm)
        if self.bands is not None:
            return self.bands, max(1, self.num_perm // self.bands)
        if self.rows is not None:
            return max(1, self.num_perm // self.rows), self.rows
        return b, r

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not 0.0 <= self.lang_threshold <= 1.0:
            raise ValueError(f"FilterConfig.lang_threshold = {self.lang_threshold}: must be in [0, 1]")
        if self.lang_max_chars < 1:
            raise ValueError(f"FilterConfig.lang_max_chars = {self.lang_max_chars}: must be >= 1")
        if not 0.0 < self.near_dedup_threshold < 1.0:
            raise ValueError(f"FilterConfig.near_dedup_threshold = {self.near_dedup_threshold}: must be in (0, 1)")
        if self.shingle_size < 1:
            raise ValueError(f"FilterConfig.shingle_size = {self.shingle_size}: must be >= 1")
        if self.num_perm < 1:
            raise ValueError(f"FilterConfig.num_perm = {self.num_perm}: must be >= 1")
        for name in ("bands", "rows"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"FilterConfig.{name} = {v}: must be >= 1")
        b, r = self.lsh_params()
        if b * r > self.num_perm:
            raise ValueError(f"FilterConfig: bands x rows = {b} x {r} = {b * r} exceeds num_perm = {self.num_perm}")
        self.quality_thresholds.validate()
        self._validate_perplexity()
        if self.lang:
            self.lang = check_languages(self.lang)

    def _validate_perplexity(self) -> None:
        if self.perplexity_model is None:
            for name in _PERPLEXITY_FIELDS[1:]:
                if getattr(self, name) is not None:
                    raise ValueError(f"FilterConfig.{name} needs perplexity_model")
            return
        if self.max_perplexity is not None and not self.max_perplexity >= 1.0:
            raise ValueError(f"FilterConfig.max_perplexity = {self.max_perplexity}: must be >= 1 (a perplexity)")
        if self.perplexity_max_chars is not None and self.perplexity_max_chars < 1:
            raise ValueError(f"FilterConfig.perplexity_max_chars = {self.perplexity_max_chars}: must be >= 1")
        self.perplexity_model = os.fspath(self.perplexity_model)
        read_model_header(self.perplexity_model)  # ModelFileError (a ValueError) naming the file

    def to_json(self) -> dict[str, Any]:
        """The config as written to the manifest's top-level ``filters`` key (derived LSH
        parameters and the versions of the models/backends of enabled stages included). The
        perplexity fields appear only when the stage is on, with the model's sha256
        (``perplexity_model_sha256``, what decides the scores)."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.perplexity_model is None:
            for name in _PERPLEXITY_FIELDS:
                del d[name]
        else:
            d["perplexity_model_sha256"] = read_model_header(self.perplexity_model)["sha256"]
        d["quality_thresholds"] = self.quality_thresholds.to_json()
        d["lang"] = list(self.lang)
        d["filters_version"] = FILTERS_VERSION
        if self.near_dedup:
            d["bands"], d["rows"] = self.lsh_params()
        d["backends"] = backend_versions(self)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FilterConfig:
        """Inverse of :meth:`to_json` (ignores the informational keys)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "quality_thresholds" in kw:
            kw["quality_thresholds"] = QualityThresholds.from_json(kw["quality_thresholds"])
        if "lang" in kw:
            kw["lang"] = tuple(kw["lang"])
        return cls(**kw)


_PERPLEXITY_FIELDS = ("perplexity_model", "max_perplexity", "perplexity_max_chars")


def backend_versions(config: FilterConfig) -> dict[str, str]:
    """Versions of the third-party pieces that decide what enabled stages keep."""
    out: dict[str, str] = {}

    def ver(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "not installed"

    if config.clean:
        out["trafilatura"] = ver("trafilatura")
    if config.fix_unicode:
        out["ftfy"] = ver("ftfy")
    if config.lang:
        out["py3langid"] = ver("py3langid")
    if config.near_dedup:
        out["rensa"] = ver("rensa")
    return out


def parse_lang_codes(codes: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"en,de"`` / ``["en", "de"]`` -> ``("en", "de")`` (lowercased, deduplicated, validated
    against the model); raises ValueError naming unknown codes."""
    if codes is None:
        return ()
    if isinstance(codes, str):
        codes = codes.split(",")
    out = tuple(dict.fromkeys(c.strip().lower() for c in codes if c.strip()))
    if out:
        check_languages(out)
    return out


def merge_stats(*stats: Mapping[str, int]) -> dict[str, int]:
    """Sum counter dicts (e.g. from every worker's :meth:`DocumentFilter.stats`); sorted keys."""
    total: Counter[str] = Counter()
    for s in stats:
        total.update(s)
    return dict(sorted(total.items()))


def dropped_counts(stats: Mapping[str, int]) -> dict[str, int]:
    """``{"drop:quality:min_words": 12, "drop:lang": 40, ...}`` -> ``{"quality:min_words": 12,
    "lang": 40}``: the compact per-rule drops (the manifest's ``splits.<split>.dropped`` keeps each
    exact reason, e.g. ``lang:de``, and adds the build's ``exact_dup`` and ``near_dup``)."""
    return {k[5:]: int(v) for k, v in sorted(stats.items()) if k.startswith("drop:") and v}


#: Text the warm-up runs through the enabled stages (non-ASCII, lines, numbers, repeats).
_WARM_UP_TEXT = "\n".join(
    f"Line {i}: the caf\u00e9 on 5th Street opened at 9:30, call 555-123-{1000 + i} or mail a{i}@example.com."
    for i in range(12)
)


@dataclass
class FilterResult:
    """Outcome of :meth:`DocumentFilter.process_batch` for one document."""

    text: str | None
    """The text to keep (what is hashed and tokenized), or None when dropped."""
    reason: str | None
    """Why it was dropped (e.g. ``"quality:min_words"``, ``"lang:de"``), None when kept."""
    info: dict[str, Any]
    """Per-document facts: ``lang``/``lang_prob`` (when language ID ran), ``html`` (True when
    extracted from HTML), ``pii`` ({kind: replacements}) when any, ``perplexity`` (float >= 1,
    when the perplexity stage ran on it), ``reason`` when dropped."""
    signature: np.ndarray | None = None
    """uint32[num_perm] MinHash of the kept text when near-dedup is on and signatures were asked
    for (:meth:`DocumentFilter.process_batch` ``signatures=True``)."""


class _BatchRun:
    """One :meth:`DocumentFilter.process_batch` call's documents as they pass the stages: the
    current texts, each one's info and result (None while it is still in), the quality stage's
    word hashes (reused for signatures) and the signatures."""

    def __init__(self, texts: Sequence[str], stats: Counter[str]) -> None:
        self.n = len(texts)
        self.cur: list[str] = list(texts)
        self.out: list[FilterResult | None] = [None] * self.n
        self.infos: list[dict[str, Any]] = [{} for _ in range(self.n)]
        self.word_hashes: dict[int, np.ndarray] = {}
        self.sigs: dict[int, np.ndarray] = {}
        self.stats = stats

    def live(self) -> list[int]:
        """The documents still in, in order."""
        return [i for i in range(self.n) if self.out[i] is None]

    def drop(self, i: int, reason: str, counter: str | None = None) -> None:
        self.stats[f"drop:{counter or reason}"] += 1
        self.infos[i]["reason"] = reason
        self.out[i] = FilterResult(None, reason, self.infos[i])


class DocumentFilter:
    """Runs the enabled stages of a :class:`FilterConfig` on documents; keeps per-rule counters.

    :meth:`process_batch` is the fast path (each stage vectorized over the batch; results do not
    depend on how documents are batched); :meth:`process` is one document. Pickles as its config
    and counters (models load lazily in each process)."""

    def __init__(self, config: FilterConfig) -> None:
        config.validate()
        self.config = config
        self._stats: Counter[str] = Counter()
        self._minhasher = None
        self._language_model = None
        self._model_sha256: str | None = None  # of the model the settings name (checked when loaded)
        if config.perplexity_model is not None:
            self._model_sha256 = read_model_header(config.perplexity_model)["sha256"]
        self._cache: tuple[str, np.ndarray] | None = None  # (last kept text, its word hashes)
        self.last_info: dict[str, Any] = {}
        """Facts about the last document of the last call (see :attr:`FilterResult.info`)."""
        self.seconds: Counter[str] = Counter()
        """CPU seconds of this process spent per stage (clean, lang, quality, perplexity, pii, signature),
        for build summaries and benchmarks (CPU time: robust to other jobs on the machine)."""

    @classmethod
    def from_description(cls, description: Mapping[str, Any]) -> DocumentFilter:
        """The filter :meth:`describe` described (how a process that has only a build's plan gets
        the build's filters back)."""
        return cls(FilterConfig.from_json(description))

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "stats": dict(self._stats), "model_sha256": self._model_sha256}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = state["config"]
        self._stats = Counter(state["stats"])
        self._minhasher = None
        self._language_model = None
        self._model_sha256 = state.get("model_sha256")
        self._cache = None
        self.last_info = {}
        self.seconds = Counter()

    # -- documents ---------------------------------------------------------------------------
    def process(self, text: str) -> tuple[str | None, str | None]:
        """``(text to keep, None)`` or ``(None, drop reason)``; see the module docstring. The
        per-document facts are left in :attr:`last_info`."""
        r = self.process_batch([text])[0]
        return r.text, r.reason

    def process_with_info(self, text: str) -> FilterResult:
        """One document, with its facts."""
        return self.process_batch([text])[0]

    def process_batch(self, texts: Sequence[str], *, signatures: bool = False) -> list[FilterResult]:
        """Filter many documents at once (in order; each result as :meth:`process` would give).
        With ``signatures=True`` and near-dedup on, kept results carry their MinHash signature
        (cheaper than :meth:`signature` afterwards: the quality stage's words are reused)."""
        c = self.config
        b = _BatchRun(texts, self._stats)
        self._stats["docs"] += b.n
        stages = (
            ("clean", c.clean or c.fix_unicode or c.normalize_whitespace, self._clean_stage),
            ("lang", bool(c.lang), self._lang_stage),
            ("quality", c.quality, self._quality_stage),
            ("perplexity", c.perplexity_model is not None, self._perplexity_stage),
            ("pii", c.scrub_pii, self._pii_stage),
            ("signature", signatures and c.near_dedup, self._signature_stage),
        )
        for name, on, stage in stages:
            if not on or (not b.live() and name != "pii"):
                continue
            t0 = time.process_time()
            stage(b)
            self.seconds[name] += time.process_time() - t0
        live = b.live()
        for i in live:
            self._stats["kept"] += 1
            b.out[i] = FilterResult(b.cur[i], None, b.infos[i], b.sigs.get(i))
        n = b.n
        self._cache = None
        if live and live[-1] == n - 1 and (n - 1) in b.word_hashes:
            self._cache = (b.cur[n - 1], b.word_hashes[n - 1])
        self.last_info = b.infos[-1] if n else {}
        return b.out  # type: ignore[return-value]

    def _clean_stage(self, b: _BatchRun) -> None:
        c = self.config
        for i in range(b.n):
            text = b.cur[i]
            if c.clean and clean.looks_like_html(text):
                b.infos[i]["html"] = True
                b.stats["clean:html"] += 1
                extracted = clean.html_to_text(text)
                if extracted is None:
                    b.drop(i, "clean:no_main_text")
                    continue
                text = extracted
            if c.fix_unicode:
                fixed = clean.fix_unicode(text)
                if fixed != text:
                    b.stats["clean:unicode"] += 1
                    text = fixed
            if c.normalize_whitespace:
                norm = clean.normalize_whitespace(text)
                if norm != text:
                    b.stats["clean:whitespace"] += 1
                    text = norm
            if not text.strip():
                b.drop(i, "clean:empty")
                continue
            b.cur[i] = text

    def _lang_stage(self, b: _BatchRun) -> None:
        c, live = self.config, b.live()
        for i, (code, prob) in zip(live, detect_languages([b.cur[i] for i in live], c.lang_max_chars)):
            b.infos[i]["lang"] = code
            b.infos[i]["lang_prob"] = prob
            b.stats[f"lang:{code}"] += 1
            if code not in c.lang:
                b.drop(i, f"lang:{code}", counter="lang")
            elif prob < c.lang_threshold:
                b.drop(i, "lang:low_confidence", counter="lang")

    def _quality_stage(self, b: _BatchRun) -> None:
        c, live = self.config, b.live()
        reasons, hashes = quality_batch([b.cur[i] for i in live], c.quality_thresholds)
        for i, reason, h in zip(live, reasons, hashes):
            if reason is not None:
                b.drop(i, f"quality:{reason}")
            elif c.near_dedup and h is not None:
                b.word_hashes[i] = h

    def _perplexity_stage(self, b: _BatchRun) -> None:
        c, live = self.config, b.live()
        for i, ppl in zip(live, self._perplexities([b.cur[i] for i in live])):
            b.infos[i]["perplexity"] = ppl
            if c.max_perplexity is not None and ppl > c.max_perplexity:
                b.drop(i, "perplexity")

    def _pii_stage(self, b: _BatchRun) -> None:
        for i in b.live():
            scrubbed, counts = scrub_pii(b.cur[i])
            if counts:
                b.infos[i]["pii"] = counts
                b.stats["pii:docs"] += 1
                for kind, k in counts.items():
                    b.stats[f"pii:{kind}"] += k
                b.cur[i] = scrubbed
                b.word_hashes.pop(i, None)  # the words changed

    def _signature_stage(self, b: _BatchRun) -> None:
        live = b.live()
        hasher = self._hasher()
        need = [i for i in live if i not in b.word_hashes]
        if need:
            wb2 = split_words_batch([b.cur[i] for i in need])
            for j, i in enumerate(need):
                b.word_hashes[i] = wb2.hashes[int(wb2.offsets[j]) : int(wb2.offsets[j + 1])]
        for i, sig in zip(live, hasher.signatures_of_word_hashes([b.word_hashes[i] for i in live])):
            b.sigs[i] = sig

    # -- perplexity -------------------------------------------------------------------------
    def language_model(self):
        """The :class:`h5corpus.filters.perplexity.NgramModel` of ``perplexity_model``, loaded once
        per process (:meth:`warm_up` loads it before the build forks its workers)."""
        if self._language_model is None:
            model = load_model(self.config.perplexity_model)
            if model.sha256 != self._model_sha256:  # replaced since the settings were made
                raise ModelFileError(
                    f"{self.config.perplexity_model}: the model changed (sha256 {model.sha256}, "
                    f"settings name {self._model_sha256})"
                )
            self._language_model = model
        return self._language_model

    def _perplexities(self, texts: list[str]) -> list[float]:
        limit = self.config.perplexity_max_chars
        if limit is not None:
            texts = [t[:limit] for t in texts]
        return self.language_model().perplexities(texts).tolist()

    # -- near-dedup -------------------------------------------------------------------------
    def _hasher(self):
        if self._minhasher is None:
            c = self.config
            self._minhasher = MinHasher(num_perm=c.num_perm, shingle_size=c.shingle_size, seed=c.seed)
        return self._minhasher

    def signature(self, text: str) -> np.ndarray:
        """uint32[num_perm] MinHash signature of a kept ``text`` (reuses the quality stage's word
        hashes when ``text`` is what :meth:`process` just returned)."""
        cache = self._cache
        if cache is not None and (cache[0] is text or cache[0] == text):
            return self._hasher().signature_of_word_hashes(cache[1])
        return self._hasher().signature(text)

    def new_near_dedup_index(self):
        """A fresh :class:`h5corpus.neardedup.NearDedupIndex` for this config (one per build,
        fed in global input order)."""
        c = self.config
        bands, rows = c.lsh_params()
        return NearDedupIndex(
            num_perm=c.num_perm, bands=bands, rows=rows, threshold=c.near_dedup_threshold, verify=c.verify
        )

    def near_duplicate_index(self):
        """The build's seam: a fresh :meth:`new_near_dedup_index` when ``near_dedup`` is on, else
        None (the build then computes no signatures and runs no index)."""
        return self.new_near_dedup_index() if self.config.near_dedup else None

    # -- counters, settings, warm-up ---------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters since construction (or the last :meth:`reset_stats`), sorted keys. They only
        grow, so differences across a task give that task's counts."""
        return dict(sorted(self._stats.items()))

    def counters(self) -> dict[str, int]:
        """Alias of :meth:`stats` (the name h5corpus.build's seam looks for)."""
        return self.stats()

    def timings(self) -> dict[str, float]:
        """CPU seconds spent per stage in this process so far (``clean``, ``lang``, ``quality``,
        ``perplexity``, ``pii``, ``signature``; only growing, like :meth:`stats`). Not part of any output file."""
        return dict(sorted(self.seconds.items()))

    def describe(self) -> dict[str, Any]:
        """JSON-able settings (:meth:`FilterConfig.to_json`): the manifest's ``filters`` key."""
        return self.config.to_json()

    def warm_up(self) -> None:
        """Load the models and modules of the enabled stages and build their lookup tables now
        (e.g. in the parent process before forking workers, which then share them) instead of on
        the first documents, where they would count as filter time in every worker (~0.2 s per
        process with every stage on). Counters and timings are left untouched."""
        c = self.config
        sample = _WARM_UP_TEXT
        if c.clean:
            import trafilatura  # noqa: F401  (a ~0.5 s import)
        if c.fix_unicode:
            clean.fix_unicode("warm-up \x03")
        if c.lang:
            detect_languages([sample], c.lang_max_chars)  # the model, scipy.sparse
        if c.quality or c.near_dedup:
            hash_powers(SEGMENT_BYTES + 64)  # hash power tables for whole pieces
        if c.quality:
            quality_batch([sample, sample * 3], c.quality_thresholds)
        if c.perplexity_model is not None:
            self._perplexities([sample])  # loads the model and builds its lookup directories
        if c.scrub_pii:
            digit_prefix_pattern()  # the non-ASCII digit table (~0.1 s)
            scrub_pii(sample)
        if c.near_dedup:
            self._hasher().signature("warm up")
            self._hasher().signatures_of_word_hashes([split_words(sample).hashes])

    def reset_stats(self) -> None:
        self._stats.clear()

    merge_stats = staticmethod(merge_stats)
