"""Fine-tuning builds in the one build (``BuildConfig.loss_on``; docs/BUILD.md, "Fine-tuning
corpora"): the settings the plan carries (:class:`SFTSpec`) and the read stage's path for them
(:func:`read_sft_records`).

A fine-tuning task's records (:class:`~h5corpus.build.input.sftrecords.SFTRecordReader`) are
rendered documents with trained-on character ranges; here they get the pretraining build's id
(sha256 of the rendered text), split and in-task dedup, then are encoded in batches by the
reference encoder with offsets (:class:`~h5corpus.build.tokenize.lossmask.SFTEncoder`: ``[BOS] +
ids + [EOS]`` and the trained-on token ranges) and written to the task's candidate shards with
their ``/loss_spans``. Everything after (decide, finish, commit) is the pretraining build's.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...storage import format as fmt
from ...storage.format import ShardRecord
from ..config import BuildConfig, BuildError
from ..input.chat import ChatTemplate, RecordError
from ..input.inputs import Input, Task
from ..input.sftrecords import SFT_KINDS, SFTRecordReader
from ..tokenize.encoders import HFEncoder
from ..tokenize.lossmask import SFTEncoder
from ..tokenize.tokenizer import Tokenizer

#: Records accepted (id, split, dedup) at a time, and rendered documents encoded at a time.
ACCEPT_BATCH_DOCS = 256
ENCODE_BATCH_DOCS = 256


@dataclass(frozen=True)
class SFTSpec:
    """A fine-tuning build's settings as the plan carries them (``plan.json``'s ``sft``): enough
    for a stage in any process to render, mask and prefix every record the same way."""

    loss_on: str
    bos_id: int | None = None
    template: str | None = None
    """The chat template's Jinja source (None: no template; ``messages`` records are refused)."""
    special_tokens: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "loss_on": self.loss_on,
            "bos_id": self.bos_id,
            "template": self.template,
            "special_tokens": dict(self.special_tokens),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SFTSpec:
        bos = d.get("bos_id")
        return cls(str(d["loss_on"]), None if bos is None else int(bos), d.get("template"), dict(d["special_tokens"]))

    def settings(self) -> dict[str, Any]:
        """What decides the output bytes (the build's settings, hence its fingerprint and resume)."""
        blob = json.dumps([self.template, self.special_tokens], sort_keys=True).encode("utf-8")
        sha = None if self.template is None else hashlib.sha256(blob).hexdigest()
        return {"loss_on": self.loss_on, "bos_id": self.bos_id, "chat_template_sha256": sha}

    def manifest_facts(self) -> dict[str, Any]:
        """The manifest's ``sft`` section (docs/FORMAT.md)."""
        return {"loss_mask": True, "bos_id": self.bos_id, "loss_on": self.loss_on}

    def chat_template(self) -> ChatTemplate | None:
        return None if self.template is None else ChatTemplate(self.template, self.special_tokens)

    def bos_text(self) -> str | None:
        """The template's BOS text when a BOS is prepended (a rendered text starting with it is refused)."""
        return None if self.bos_id is None else self.special_tokens.get("bos_token")


def _template(cfg: BuildConfig) -> ChatTemplate | None:
    """``cfg.chat_template``, else the ``tokenizer_config.json`` beside the tokenizer file, else None."""
    try:
        if cfg.chat_template is not None:
            return ChatTemplate.from_config(cfg.chat_template)
        beside = Path(cfg.tokenizer)
        beside = (beside if beside.is_dir() else beside.parent) / "tokenizer_config.json"
        return ChatTemplate.from_config(beside) if beside.is_file() else None
    except RecordError as e:
        raise ValueError(f"--chat-template: {e}") from None


def resolve_bos(spec: str | None, tok: Tokenizer, template: ChatTemplate | None) -> int | None:
    """The BOS id of ``--bos``: None, the tokenizer config's ``bos_token`` (``"tokenizer"``), or an
    explicit id below the vocabulary size (BOS = EOS allowed)."""
    if spec is None:
        return None
    if spec == "tokenizer":
        name = None if template is None else template.special_tokens.get("bos_token")
        tid = None if name is None else tok.hf.token_to_id(name)
        if tid is None:
            raise ValueError("--bos tokenizer: the tokenizer config names no bos_token with an id (give --bos <id>)")
        return int(tid)
    try:
        v = int(spec)
    except ValueError:
        raise ValueError(f"--bos must be 'tokenizer' or a token id, got {spec!r}") from None
    if not 0 <= v < tok.vocab_size:
        raise ValueError(f"--bos {v}: not an id of the tokenizer (vocabulary size {tok.vocab_size})")
    return v


def sft_spec(cfg: BuildConfig, tok: Tokenizer) -> SFTSpec | None:
    """The fine-tuning settings of ``cfg`` resolved against ``tok`` (template read, BOS id found);
    None for a pretraining build. Raises ValueError naming the bad setting."""
    if cfg.loss_on is None:
        return None
    template = _template(cfg)
    bos = resolve_bos(cfg.bos, tok, template)
    if template is None:
        return SFTSpec(cfg.loss_on, bos)
    return SFTSpec(cfg.loss_on, bos, template.source, dict(template.special_tokens))


def refuse_non_record_sources(inputs: Sequence[Input]) -> None:
    """A fine-tuning build reads JSON objects: refuse ``.txt`` files and ``datasets`` sources
    before anything is written, naming the first."""
    for i in inputs:
        bad = [f.name for f in i.files if f.kind not in SFT_KINDS] or ([i.spec] if i.kind == "datasets" else [])
        if bad:
            kind = "datasets" if i.kind == "datasets" else "text"
            raise ValueError(
                f"{bad[0]}: a fine-tuning build (--loss-on) reads .jsonl(.gz/.zst) and .parquet records, not {kind}"
            )


# -- the read stage ------------------------------------------------------------------------------
def read_sft_records(run: Any, task: Task, plan: Any) -> None:
    """The read stage's loop for a fine-tuning task: ``run`` is the task's ``_TaskRead`` (bad
    records, split rule, in-task ids, tallies, timings, outputs)."""
    spec = SFTSpec.from_json(plan.sft)
    reader = SFTRecordReader(task, spec.chat_template(), spec.loss_on, spec.bos_text(), int(plan.max_record_bytes))
    queue = _SFTQueue(run, spec, plan)
    batch: list[Any] = []
    for rec in reader:
        if type(rec) is not tuple:
            run.bad(rec)
            continue
        batch.append(rec)
        if len(batch) >= ACCEPT_BATCH_DOCS:
            _accept(run, queue, _filtered(run, batch))
            batch = []
    _accept(run, queue, _filtered(run, batch))
    queue.flush()


def _filtered(run: Any, batch: list[Any]) -> list[tuple[Any, Any, Any]]:
    """``(record, signature, info)`` of the records the build's filters keep (all of them without
    filters). Filters here keep or drop a rendered document, never change it: a changed text
    would move the trained-on ranges, and stops the build naming the record. Drops are counted
    per reason in the record's split, as in the pretraining build."""
    if run.filters is None or not batch:
        return [(rec, None, None) for rec in batch]
    c0 = time.process_time()
    texts = [rec[0] for rec in batch]
    if run.process_batch is not None:
        got = run.process_batch(texts, signatures=run.signature is not None)
        res = [(r.text, r.reason, getattr(r, "signature", None), getattr(r, "info", None)) for r in got]
    else:
        res = [(*run.filters.process(t), None, None) for t in texts]
    run.seconds["filter"] += time.process_time() - c0
    kept, drops = [], []
    for rec, (new, reason, sig, info) in zip(batch, res):
        if new is None:
            drops.append((rec, str(reason or "filtered")))
        elif new != rec[0]:
            raise BuildError(f"{rec[3]}: the filters changed the text of a fine-tuning record (use filters that drop)")
        else:
            kept.append((rec, sig, info))
    ids = [hashlib.sha256(rec[1]).digest() for rec, _ in drops]
    for (_, reason), s in zip(drops, run.rule.indices(ids).tolist() if ids else []):
        run.filtered[s][reason] = run.filtered[s].get(reason, 0) + 1
    return kept


def _accept(run: Any, queue: _SFTQueue, batch: list[tuple[Any, Any, Any]]) -> None:
    """The pretraining build's accept rules: id = sha256 of the text, split by id, empty texts
    skipped, duplicates within the task dropped (across tasks: the decide stage); a kept
    document's extras (near-dedup signature, language, perplexity) recorded in table order."""
    if not batch:
        return
    ids = [hashlib.sha256(rec[1]).digest() for rec, _, _ in batch]
    for (rec, sig, info), doc_id, s in zip(batch, ids, run.rule.indices(ids).tolist()):
        if not rec[0]:
            run.skipped[s] += 1
            run.skip_codes["empty"] = run.skip_codes.get("empty", 0) + 1
        elif doc_id in run.seen:
            run.duplicates[s] += 1
        else:
            run.seen.add(doc_id)
            kept_extras(run.out, run.label, run.signature, rec[0], sig, info)
            queue.add(rec, doc_id, s)


def kept_extras(out: Any, label: str, signature: Any, text: str, sig: Any, info: Any) -> None:
    """What the decide stage needs of one kept document besides its row, appended to ``out`` (a
    read's outputs): its near-dedup signature (``sig``, else computed from ``text``), its language
    and its perplexity (from the filters' ``info``). Shared by the pretraining and fine-tuning reads."""
    if out.sigs is not None and signature is not None:
        out.sigs.append(sig if sig is not None else signature(text))
    if out.langs is not None:
        out.langs.append(info.get("lang") if info else None)
    if out.perplexities is not None:
        if not info or "perplexity" not in info:
            raise BuildError(f"{label}: the filters gave no perplexity for a kept document")
        out.perplexities.append(float(info["perplexity"]))


class _SFTQueue:
    """Accepted fine-tuning documents waiting to be encoded (batches of :data:`ENCODE_BATCH_DOCS`)
    and written with their trained-on ranges."""

    def __init__(self, run: Any, spec: SFTSpec, plan: Any) -> None:
        enc = run.ctx.encoder
        if not isinstance(enc, HFEncoder):  # the plan of a fine-tuning build names tokenizers
            raise BuildError(f"{run.label}: a fine-tuning build encodes with tokenizers, the plan names {enc.name}")
        self.enc = SFTEncoder(enc.tok)
        self.run, self.out, self.seconds = run, run.out, run.seconds
        self.eos, self.bos = int(plan.tokenizer.eos_id), spec.bos_id
        self.max_tokens = plan.max_document_tokens
        self.pending: list[tuple[Any, bytes, int]] = []

    def add(self, rec: Any, doc_id: bytes, split: int) -> None:
        self.pending.append((rec, doc_id, split))
        if len(self.pending) >= ENCODE_BATCH_DOCS:
            self.flush()

    def _stored(self, where: str, tokens: np.ndarray, spans: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """A document as stored: refused with an EOS inside it; cut at ``max_document_tokens``
        (ranges clipped, no EOS, flagged)."""
        inner = int(np.count_nonzero(tokens[:-1] == self.eos))
        if inner > int(self.bos == self.eos and tokens[0] == self.eos):
            raise BuildError(
                f"{where}: the text holds the EOS id {self.eos} inside the document (choose another --eos-token)"
            )
        m = self.max_tokens
        if m is None or tokens.size <= m:
            return tokens, spans, 0
        spans = spans[spans[:, 0] < m].copy()
        spans[:, 1] = np.minimum(spans[:, 1], m)
        return tokens[:m], spans, fmt.FLAG_TRUNCATED

    def flush(self) -> None:
        if not self.pending:
            return
        c0 = time.process_time()
        encoded = self.enc.documents([(r[0], r[2]) for r, _, _ in self.pending], self.eos, self.bos)
        c1 = time.process_time()
        self.seconds["encode"] += c1 - c0
        docs = [self._stored(r[3], t, sp) for (r, _, _), (t, sp) in zip(self.pending, encoded)]
        splits = np.array([s for _, _, s in self.pending], np.uint8)
        lengths = np.array([t.size for t, _, _ in docs], np.int64)
        flags = np.array([f for _, _, f in docs], np.uint8)
        ids = b"".join(i for _, i, _ in self.pending)
        id_rows = np.frombuffer(ids, np.uint8).reshape(-1, fmt.DOC_ID_BYTES)
        for s in (0, 1):
            sel = np.flatnonzero(splits == s)
            if sel.size:
                lens = lengths[sel]
                starts = np.cumsum(lens) - lens
                flat = np.concatenate([docs[k][0] for k in sel.tolist()])
                loss = np.concatenate([docs[k][1] + a for k, a in zip(sel.tolist(), starts.tolist())]).reshape(-1, 2)
                self.out.add_split(s, flat, lens, id_rows[sel], flags[sel], loss)
        self.out.add_rows(ids, lengths, [len(r[0]) for r, _, _ in self.pending], splits, flags)
        self.pending = []
        self.seconds["write"] += time.process_time() - c1


def sft_bos_id(plan: Any) -> int | None:
    """The BOS id a plan's shards are written with (None: a pretraining build, or no BOS)."""
    return None if plan.sft is None else SFTSpec.from_json(plan.sft).bos_id


def add_trained_tokens(splits: dict[str, dict[str, Any]], shards_dir: Path, shards: Sequence[ShardRecord]) -> None:
    """Each split's ``trained_tokens`` (positions trained on, summed over its shards' ``/loss_spans``,
    16 bytes per range read): the figure the build reports and the manifest records."""
    for st in splits.values():
        st["trained_tokens"] = 0
    for s in shards:
        with h5py.File(shards_dir / s.path, "r") as f:
            spans = np.asarray(f[fmt.LOSS_SPANS][()], dtype=np.int64).reshape(-1, 2)
        if s.split in splits:
            splits[s.split]["trained_tokens"] += int((spans[:, 1] - spans[:, 0]).sum())
