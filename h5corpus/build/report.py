"""What a build did: :class:`BuildReport` (returned by :func:`~h5corpus.build.build_corpus`, the
CLI's ``--json``), its human summary :func:`format_report`, and the per-split figures' keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..storage.format import FormatError
from ..storage.manifest import Manifest

SPLIT_KEYS = (
    "documents",
    "tokens",
    "pairs",
    "characters",
    "duplicates",
    "near_duplicates",
    "over_budget",
    "truncated",
    "skipped",
    "shards",
)
#: Drop reasons of the build's own dedup stages (the rest of ``splits.<split>.dropped`` are the filters').
DEDUP_REASONS = ("exact_dup", "near_dup")


def empty_split() -> dict[str, Any]:
    """Zeroed per-split figures (the manifest's ``splits.<split>``)."""
    d: dict[str, Any] = {k: 0 for k in SPLIT_KEYS}
    d["dropped"] = {}
    return d


def filtered_total(split: Mapping[str, Any]) -> int:
    """Documents of a split that the filter stages dropped (``dropped`` without the dedup stages)."""
    d = split.get("dropped")
    if isinstance(d, int):  # a manifest written before per-rule counts
        return d
    return sum(int(v) for k, v in (split.get("dropped") or {}).items() if k not in DEDUP_REASONS)


@dataclass
class BuildReport:
    """What a build did. ``splits`` holds the manifest's per-split figures."""

    manifest: str
    shards_dir: str
    tokenizer: dict[str, Any]
    splits: dict[str, dict[str, Any]]
    tasks: int = 0
    tasks_read: int = 0
    """Tasks that are part of the corpus (all, unless budgets stopped reading early)."""
    tasks_reused: int = 0
    """Tasks whose completed work from an interrupted run was checked and reused."""
    shards_written: int = 0
    shards_reused: int = 0
    encoder: str = ""
    """Encoder that tokenized this run: fastokens, tiktoken, kitoken, unigram, bytes or tokenizers."""
    encoder_note: str = ""
    """Why a fast encoder was not used (not applicable, or disabled by its proof), when one was not."""
    encoder_fallbacks: int = 0
    """Documents the fast encoder raised on (e.g. PCRE2 limits on pathological text), encoded by
    the reference encoder instead. Not in the manifest."""
    skipped_total: int = 0
    skipped_records: list[str] = field(default_factory=list)
    """``file:line: reason`` of skipped records (the first :data:`~h5corpus.build.config.MAX_LISTED`)."""
    filter_counters: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    """Worker CPU seconds per read-stage step, summed over the tasks read: ``read`` (parse, hash,
    split, dedup), ``filter`` (all filter stages; ``filter:<stage>`` each), ``encode``
    (tokenization), ``write`` (shards and tables), ``total``. This run's tasks only (tasks reused
    from an interrupted run are not counted). Not in the manifest."""
    explain_drops: str | None = None
    """Path of the ``--explain-drops`` file written, if any."""
    explained: int = 0
    """Lines written to it."""
    tokens_encoded: int = 0
    """Tokens this run tokenized (EOS included; duplicates within a task are not tokenized)."""
    elapsed_s: float = 0.0
    up_to_date: bool = False
    """The manifest already described this exact build; nothing was done."""
    resumed: bool = False
    executor: str = "local"
    """Where the stages ran: ``local``, ``ray`` or ``slurm``."""
    decide_buckets: int = 0
    """Buckets of the decide stage (0: decided in memory by the driver)."""
    jobs: dict[str, list[str]] = field(default_factory=dict)
    """Slurm: the job ids submitted per stage (``read``, ``bucket``, ``decide``, ``finish``, ``commit``)."""
    slurm: dict[str, Any] = field(default_factory=dict)
    """Slurm: ``scripts`` (stage -> sbatch script path), ``logs`` (their folder), and for a dry run the
    ``commands`` that would submit them."""
    submitted: bool = False
    """Slurm without ``wait``: the jobs were submitted (or, with ``dry_run``, written) and the build
    goes on without this process; ``splits`` is empty."""

    @property
    def tokens(self) -> int:
        return sum(int(s["tokens"]) for s in self.splits.values())

    @property
    def documents(self) -> int:
        return sum(int(s["documents"]) for s in self.splits.values())

    @property
    def tokens_per_s(self) -> float:
        """Corpus tokens per second of this run's wall time."""
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def dropped(self) -> dict[str, int]:
        """Per-rule drops over all splits (``splits.<split>.dropped`` added up), sorted by rule."""
        out: dict[str, int] = {}
        for st in self.splits.values():
            d = st.get("dropped")
            for k, v in d.items() if isinstance(d, Mapping) else ():
                out[k] = out.get(k, 0) + int(v)
        return dict(sorted(out.items()))

    def filter_summary(self) -> dict[str, Any]:
        """What each stage removed or changed: ``dropped`` per rule (dedup included), ``changed``
        (documents extracted from HTML, repaired by ftfy, whitespace-normalized, PII-scrubbed),
        ``pii`` replacements per kind, ``languages`` of the stored documents, and the seconds the
        filters and the tokenizer took in the workers (``x_tokenize`` = filter / encode time)."""
        c = self.filter_counters
        out: dict[str, Any] = {"dropped": self.dropped()}
        changed = {
            name: int(c[key])
            for name, key in (
                ("html_extracted", "clean:html"),
                ("unicode_repaired", "clean:unicode"),
                ("whitespace_normalized", "clean:whitespace"),
                ("pii_scrubbed", "pii:docs"),
            )
            if c.get(key)
        }
        if changed:
            out["changed"] = changed
        pii = {k[4:]: int(v) for k, v in c.items() if k.startswith("pii:") and k != "pii:docs" and v}
        if pii:
            out["pii"] = pii
        langs: dict[str, int] = {}
        for st in self.splits.values():
            for k, v in (st.get("languages") or {}).items():
                langs[k] = langs.get(k, 0) + int(v)
        if langs:
            out["languages"] = dict(sorted(langs.items(), key=lambda kv: (-kv[1], kv[0])))
        sec = self.seconds
        if sec.get("filter") and sec.get("encode"):
            out["seconds"] = {
                k: round(v, 3) for k, v in sec.items() if k == "filter" or k.startswith("filter:") or k == "encode"
            }
            out["x_tokenize"] = round(sec["filter"] / sec["encode"], 3)
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["seconds"] = {k: round(v, 3) for k, v in self.seconds.items()}
        d["filters"] = self.filter_summary()
        d["tokens_per_s"] = round(self.tokens_per_s, 1)
        d["elapsed_s"] = round(self.elapsed_s, 3)
        d["tokens"] = self.tokens
        d["documents"] = self.documents
        return d


_COUNT = {"type": "integer", "minimum": 0}
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer"}}

#: JSON Schema of the parts of a manifest only the build writes and reads back (``build``,
#: ``filters``, the build's figures in ``splits``); storage's schema checks the rest.
BUILD_SECTIONS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "build": {
            "type": "object",
            "properties": {
                "fingerprint": {"type": "string"},
                "settings": {"type": "object"},
                "tasks": _COUNT,
                "tasks_read": _COUNT,
                "skip_reasons": _COUNTS,
                "skipped_records": {"type": "array", "items": {"type": "string"}},
                "skipped_records_total": _COUNT,
            },
        },
        "filters": {"type": "object", "properties": {"counters": _COUNTS}},
        "splits": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {**{k: _COUNT for k in SPLIT_KEYS}, "trained_tokens": _COUNT, "dropped": _COUNTS},
            },
        },
    },
}


def check_build_sections(m: Manifest) -> dict[str, Any]:
    """The manifest's ``build`` section (``{}`` when absent), after checking the build's sections
    against :data:`BUILD_SECTIONS_SCHEMA`; :class:`FormatError` naming the manifest and the field."""
    import jsonschema

    cls = jsonschema.Draft202012Validator
    strict_int = cls.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    validator = jsonschema.validators.extend(cls, type_checker=strict_int)(BUILD_SECTIONS_SCHEMA)
    doc = {"build": m.extra.get("build", {}), "filters": m.extra.get("filters", {}), "splits": m.splits}
    err = next(iter(sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))), None)
    if err is not None:
        name = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in err.absolute_path).lstrip(".")
        raise FormatError(f"{m.path}: manifest field {name}: {err.message}")
    return m.extra.get("build") or {}


def report_from_manifest(m: Manifest, shards_dir: str, elapsed: float) -> BuildReport:
    b = check_build_sections(m)
    return BuildReport(
        manifest=str(m.path),
        shards_dir=str(shards_dir),
        tokenizer=m.tokenizer.to_json(),
        splits=m.splits,
        tasks=int(b.get("tasks", 0)),
        tasks_read=int(b.get("tasks_read", 0)),
        skipped_total=int(b.get("skipped_records_total", 0)),
        skipped_records=list(b.get("skipped_records", [])),
        filter_counters=dict((m.extra.get("filters") or {}).get("counters", {})),
        elapsed_s=elapsed,
        up_to_date=True,
    )


def format_rate(tokens_per_s: float) -> str:
    """A token rate with a unit that keeps three significant figures: ``1.23 M tokens/s``,
    ``45.6 k tokens/s``, ``789 tokens/s`` (never ``0.00 M`` for a small build)."""
    for scale, unit in ((1e6, "M "), (1e3, "k ")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.3g} {unit}tokens/s"
    return f"{tokens_per_s:.0f} tokens/s"


def format_report(report: BuildReport) -> str:
    """The human summary the CLI prints: one row per split, then totals, speed, what each filter
    stage removed or changed, and skipped records. The ``dropped`` column counts the filter
    stages' drops; exact and near duplicates have their own columns."""
    cols = ["documents", "tokens", "pairs", "duplicates", "dropped", "truncated", "skipped"]
    for extra in ("near_duplicates", "over_budget"):
        if any(int(s.get(extra, 0)) for s in report.splits.values()):
            cols.insert(-1, extra)
    if any("trained_tokens" in s for s in report.splits.values()):  # a fine-tuning build
        cols.insert(2, "trained_tokens")
    head = "up to date" if report.up_to_date else ("resumed and built" if report.resumed else "built")
    tok = report.tokenizer
    lines = [
        f"{head} {report.manifest} (tokenizer {tok.get('name')}"
        + (f", encoder {report.encoder}" if report.encoder else "")
        + ")"
    ]
    if report.encoder_note:
        lines.append(f"  note: {report.encoder_note}")
    if report.encoder_fallbacks:
        lines.append(
            f"  note: {report.encoder_fallbacks:,} documents encoded by tokenizers ({report.encoder} raised on them)"
        )
    width = {c: max(len(c), 12) for c in cols}

    def cell(st: Mapping[str, Any], c: str) -> int:
        return filtered_total(st) if c == "dropped" else int(st.get(c, 0))

    lines.append("  " + "split".ljust(12) + "".join(c.replace("_", " ").rjust(width[c] + 2) for c in cols))
    for name, st in report.splits.items():
        lines.append("  " + name.ljust(12) + "".join(f"{cell(st, c):,}".rjust(width[c] + 2) for c in cols))
    shards = sum(int(s.get("shards", 0)) for s in report.splits.values())
    lines.append(
        f"  {report.tokens:,} tokens in {shards} shards from {report.tasks_read}/{report.tasks} tasks"
        + (f" ({report.tasks_reused} reused after hash checks)" if report.tasks_reused else "")
        + f"; elapsed {report.elapsed_s:.2f} s, {format_rate(report.tokens_per_s)}"
    )
    if report.filter_counters:
        lines.extend(_filter_lines(report))
    if report.explain_drops:
        lines.append(f"  explained {report.explained:,} dropped documents in {report.explain_drops}")
    if report.skipped_total:
        lines.append(
            f"  skipped {report.skipped_total:,} bad records"
            + (
                f" (first {len(report.skipped_records)} listed)"
                if len(report.skipped_records) < report.skipped_total
                else ""
            )
            + ":"
        )
        lines.extend(f"    {r}" for r in report.skipped_records)
    return "\n".join(lines)


def _filter_lines(report: BuildReport) -> list[str]:
    """The summary's lines about the filter stages: drops per rule, changes, languages, time."""
    lines: list[str] = []
    fs = report.filter_summary()
    dropped = {k: v for k, v in fs["dropped"].items() if k not in DEDUP_REASONS}
    lang = {k[5:]: v for k, v in dropped.items() if k.startswith("lang:")}
    parts = [f"{k} {v:,}" for k, v in dropped.items() if not k.startswith("lang:")]
    if lang:
        top = sorted(lang.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = ", ".join(f"{k} {v:,}" for k, v in top[:6]) + (f", {len(top) - 6} more" if len(top) > 6 else "")
        parts.append(f"lang {sum(lang.values()):,} ({shown})")
    c = report.filter_counters
    lines.append(
        f"  filters: {int(c.get('docs', 0)):,} documents in, {int(c.get('kept', 0)):,} out; "
        f"dropped: {', '.join(parts) or 'none'}"
    )
    changed = fs.get("changed", {})
    if changed:
        txt = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in changed.items())
        pii = fs.get("pii")
        if pii:
            txt += " (" + ", ".join(f"{k} {v:,}" for k, v in pii.items()) + " replaced)"
        lines.append(f"  filters changed documents: {txt}")
    if fs.get("languages"):
        top = list(fs["languages"].items())
        lines.append(
            "  languages stored: "
            + ", ".join(f"{k} {v:,}" for k, v in top[:8])
            + (f", {len(top) - 8} more" if len(top) > 8 else "")
        )
    if "x_tokenize" in fs:
        sec = fs["seconds"]
        stages = ", ".join(f"{k[7:]} {v:.2f}" for k, v in sec.items() if k.startswith("filter:"))
        lines.append(
            f"  filter time {sec['filter']:.2f} s ({stages}) = {fs['x_tokenize']:.2f}x "
            f"tokenization {sec['encode']:.2f} s (worker CPU seconds)"
        )
    return lines
