"""``h5corpus build-sft``: fine-tuning records -> a verified corpus with a loss mask (and a BOS).

One process reads the ``.jsonl`` sources in order (records: :mod:`~h5corpus.build.input.chat`),
renders and encodes each (:class:`~h5corpus.build.tokenize.lossmask.SFTEncoder`: the reference
``tokenizers`` encoder with offsets), drops exact duplicates (the id is the sha256 of the rendered
text), splits train/validation by id (:class:`~h5corpus.build.config.SplitRule`, the pretraining
build's rule) and writes each split's documents into shards with ``/loss_spans``
(:class:`~h5corpus.storage.writer.ShardWriter` ``loss_mask=True``), then the manifest with its
``sft`` facts. Deterministic: the same sources and settings give the same bytes. What it does not
do (the pretraining build does): workers, filters, resume after a kill, Slurm or Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...storage import format as fmt
from ...storage.format import ShardRecord
from ...storage.manifest import DEFAULT_MANIFEST, DEFAULT_SHARDS_DIR, Manifest, write_manifest
from ...storage.writer import ShardWriter, fsync_dir
from ..config import DEFAULT_SPLIT_SEED, DEFAULT_VALIDATION_FRACTION, BuildError, SplitRule
from ..input.chat import LOSS_ON, ChatTemplate, RecordError, SFTText, sft_text
from ..stages.shards import final_shard_name
from ..tokenize.lossmask import SFTEncoder
from ..tokenize.tokenizer import Tokenizer, load_tokenizer

#: Documents written per ``add_documents`` call.
WRITE_BATCH_DOCS = 1024


@dataclass
class SFTBuildConfig:
    """Settings of :func:`build_sft` (the CLI's flags)."""

    sources: list[Path]
    out: Path
    tokenizer: str = "gpt2"
    eos_token: str | None = None
    chat_template: Path | None = None
    """A ``tokenizer_config.json`` (or its folder); default: the one beside the tokenizer file."""
    loss_on: str = "assistant"
    bos: str | None = None
    """None: no BOS; ``"tokenizer"``: the config's ``bos_token``; else an id (``"50256"``)."""
    shard_tokens: int = 1 << 27
    chunk_tokens: int = fmt.DEFAULT_CHUNK_TOKENS
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION
    split_seed: int = DEFAULT_SPLIT_SEED
    overwrite: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _template(cfg: SFTBuildConfig) -> ChatTemplate | None:
    if cfg.chat_template is not None:
        return ChatTemplate.from_config(cfg.chat_template)
    beside = Path(cfg.tokenizer)
    beside = (beside if beside.is_dir() else beside.parent) / "tokenizer_config.json"
    return ChatTemplate.from_config(beside) if beside.is_file() else None


def resolve_bos(spec: str | None, tok: Tokenizer, template: ChatTemplate | None) -> int | None:
    """The BOS id of ``--bos``: None, the tokenizer config's ``bos_token`` (``"tokenizer"``), or an
    explicit id below the vocabulary size (BOS = EOS allowed)."""
    if spec is None:
        return None
    if spec == "tokenizer":
        name = None if template is None else template.special_tokens.get("bos_token")
        tid = None if name is None else SFTEncoder(tok).hf.token_to_id(name)
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


class _SplitShards:
    """One split's shards: documents batched into :class:`ShardWriter` calls, a new shard once
    ``shard_tokens`` is reached (documents whole)."""

    def __init__(self, cfg: SFTBuildConfig, split: str, tok: Tokenizer, bos_id: int | None) -> None:
        self.cfg, self.split, self.tok, self.bos_id = cfg, split, tok, bos_id
        self.w: ShardWriter | None = None
        self.infos: list[ShardRecord] = []
        self.pending: list[tuple[np.ndarray, np.ndarray, bytes]] = []
        self.pending_tokens = 0

    def add(self, tokens: np.ndarray, spans: np.ndarray, doc_id: bytes) -> None:
        held = (0 if self.w is None else self.w.tokens) + self.pending_tokens
        if held and held + tokens.size > self.cfg.shard_tokens:
            self.flush()
            self._close()
        self.pending.append((tokens, spans, doc_id))
        self.pending_tokens += tokens.size
        if len(self.pending) >= WRITE_BATCH_DOCS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        if self.w is None:
            path = _staging(self.cfg) / DEFAULT_SHARDS_DIR / final_shard_name(self.split, 0, len(self.infos))
            self.w = ShardWriter(
                path,
                split=self.split,
                tokenizer=self.tok.identity,
                chunk_tokens=self.cfg.chunk_tokens,
                loss_mask=True,
                bos_id=self.bos_id,
            )
        lengths = np.array([t.size for t, _, _ in self.pending], np.int64)
        starts = np.cumsum(lengths) - lengths
        spans = np.concatenate([s + a for (_, s, _), a in zip(self.pending, starts.tolist())]).reshape(-1, 2)
        flat = np.concatenate([t for t, _, _ in self.pending])
        ids = np.frombuffer(b"".join(i for _, _, i in self.pending), np.uint8).reshape(-1, fmt.DOC_ID_BYTES)
        self.w.add_documents(flat, lengths, ids, loss_spans=spans)
        self.pending, self.pending_tokens = [], 0
        if self.w.tokens >= self.cfg.shard_tokens:
            self._close()

    def _close(self) -> None:
        if self.w is not None:
            self.infos.append(self.w.close())
            self.w = None

    def close(self) -> list[ShardRecord]:
        self.flush()
        self._close()
        return self.infos

    def abort(self) -> None:
        if self.w is not None:
            self.w.abort()
            self.w = None


def _records(path: Path):
    """(line number, parsed JSON or the error) per non-empty line of a ``.jsonl`` source."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise BuildError(f"{path}: cannot read ({e.strerror or e})") from None
    with fh:
        for k, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield k, json.loads(line)
                except ValueError as e:
                    yield k, RecordError(f"not valid JSON ({e})")


def _staging(cfg: SFTBuildConfig) -> Path:
    """Where the shards are written until the build succeeds (a corpus already in ``out`` stays
    whole until then)."""
    return cfg.out / ".build-sft"


def _prepare_out(cfg: SFTBuildConfig) -> Path:
    manifest = cfg.out / DEFAULT_MANIFEST
    shards = cfg.out / DEFAULT_SHARDS_DIR
    if (manifest.exists() or shards.exists()) and not cfg.overwrite:
        raise ValueError(f"{cfg.out}: already holds a corpus (pass --overwrite to replace it)")
    shutil.rmtree(_staging(cfg), ignore_errors=True)
    return manifest


def _publish(cfg: SFTBuildConfig, manifest: Path, infos: list[ShardRecord]) -> list[ShardRecord]:
    """Put the staged shards in place of any old corpus: the old manifest goes first (a crash
    then leaves no manifest, never one naming missing shards), then the shards folder is
    replaced. Returns the records with their final paths, relative to the manifest's folder."""
    staged, final = _staging(cfg) / DEFAULT_SHARDS_DIR, cfg.out / DEFAULT_SHARDS_DIR
    manifest.unlink(missing_ok=True)
    shutil.rmtree(final, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    if staged.exists():
        os.replace(staged, final)
        fsync_dir(final.parent)
    shutil.rmtree(_staging(cfg), ignore_errors=True)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    moved = [i.with_path(final / Path(i.path).relative_to(staged.absolute())) for i in infos]
    return [i.relative_to(manifest.parent) for i in moved]


def build_sft(cfg: SFTBuildConfig) -> Manifest:
    """Build the corpus of ``cfg`` (module docstring); returns the manifest written to
    ``<out>/manifests/shards.json``. Raises :class:`BuildError` naming the file and line of a bad
    record or the bad setting."""
    if cfg.loss_on not in LOSS_ON:
        raise ValueError(f"--loss-on must be one of {', '.join(LOSS_ON)}, got {cfg.loss_on!r}")
    tok = load_tokenizer(cfg.tokenizer, eos_token=cfg.eos_token)
    try:
        template = _template(cfg)
    except RecordError as e:
        raise BuildError(str(e)) from None
    bos_id = resolve_bos(cfg.bos, tok, template)
    manifest_path = _prepare_out(cfg)
    enc, rule = SFTEncoder(tok), SplitRule(cfg.split_seed, cfg.validation_fraction)
    outs = {s: _SplitShards(cfg, s, tok, bos_id) for s in fmt.SPLITS}
    figures = {s: {"documents": 0, "tokens": 0, "trained_tokens": 0, "duplicates": 0} for s in fmt.SPLITS}
    try:
        _read_all(cfg, template, enc, rule, outs, figures, bos_id)
        infos = [i for s in fmt.SPLITS for i in outs[s].close()]
    except BaseException:
        for o in outs.values():
            o.abort()
        shutil.rmtree(_staging(cfg), ignore_errors=True)
        raise
    return _write_manifest(cfg, manifest_path, tok, _publish(cfg, manifest_path, infos), figures, bos_id)


#: Records rendered, then encoded as one batch.
ENCODE_BATCH_DOCS = 256


def _render(rec: Any, template: ChatTemplate | None, cfg: SFTBuildConfig, bos_id: int | None) -> SFTText:
    """One parsed record as its text and trained-on characters (RecordError names the field)."""
    if isinstance(rec, RecordError):
        raise rec
    doc = sft_text(rec, template, cfg.loss_on)
    bos_text = None if template is None else template.special_tokens.get("bos_token")
    if bos_id is not None and bos_text and doc.text.startswith(bos_text):
        raise RecordError("the chat template already writes the BOS token; drop --bos")
    return doc


class _Reader:
    """Records in input order: rendered one by one, exact duplicates dropped, encoded in batches
    of :data:`ENCODE_BATCH_DOCS`, written to their split."""

    def __init__(self, cfg: SFTBuildConfig, enc: SFTEncoder, rule: SplitRule, outs, figures, bos_id) -> None:
        self.cfg, self.enc, self.rule, self.outs, self.figures, self.bos_id = cfg, enc, rule, outs, figures, bos_id
        self.seen: set[bytes] = set()
        self.pending: list[tuple[str, SFTText, bytes, str]] = []  # where, document, id, split

    def add(self, where: str, doc: SFTText) -> None:
        doc_id = hashlib.sha256(doc.text.encode("utf-8")).digest()
        split = fmt.SPLITS[int(self.rule.indices([doc_id])[0])]
        if doc_id in self.seen:
            self.figures[split]["duplicates"] += 1
            return
        self.seen.add(doc_id)
        self.pending.append((where, doc, doc_id, split))
        if len(self.pending) >= ENCODE_BATCH_DOCS:
            self.flush()

    def flush(self) -> None:
        eos, bos = self.enc.tok.eos_id, self.bos_id
        encoded = self.enc.documents([(d.text, d.spans) for _, d, _, _ in self.pending], eos, bos)
        for (where, _, doc_id, split), (tokens, spans) in zip(self.pending, encoded):
            if int(np.count_nonzero(tokens[:-1] == eos)) > int(bos == eos and tokens[0] == eos):
                raise BuildError(
                    f"{where}: the text holds the EOS id {eos} inside the document (choose another --eos-token)"
                )
            self.outs[split].add(tokens, spans, doc_id)
            f = self.figures[split]
            f["documents"] += 1
            f["tokens"] += int(tokens.size)
            f["trained_tokens"] += int((spans[:, 1] - spans[:, 0]).sum())
        self.pending = []


def _read_all(
    cfg: SFTBuildConfig,
    template: ChatTemplate | None,
    enc: SFTEncoder,
    rule: SplitRule,
    outs: dict[str, _SplitShards],
    figures: dict[str, dict[str, int]],
    bos_id: int | None,
) -> None:
    """Every record of every source, in order, into the split writers."""
    reader = _Reader(cfg, enc, rule, outs, figures, bos_id)
    for src in cfg.sources:
        for line, rec in _records(src):
            try:
                doc = _render(rec, template, cfg, bos_id)
            except RecordError as e:
                raise BuildError(f"{src}:{line}: {e}") from None
            reader.add(f"{src}:{line}", doc)
    reader.flush()


def _write_manifest(
    cfg: SFTBuildConfig,
    manifest_path: Path,
    tok: Tokenizer,
    entries: list[ShardRecord],
    figures: dict[str, dict[str, int]],
    bos_id: int | None,
) -> Manifest:
    shards_dir = cfg.out / DEFAULT_SHARDS_DIR
    splits = {s: {**f, "shards": sum(1 for e in entries if e.split == s)} for s, f in figures.items() if f["documents"]}
    extra = dict(cfg.extra)
    extra[fmt.SFT_KEY] = {"loss_mask": True, "bos_id": bos_id, "loss_on": cfg.loss_on}
    extra["source"] = [os.fspath(p) for p in cfg.sources]
    m = Manifest(
        tokenizer=tok.identity,
        dtype=fmt.dtype_name(fmt.token_dtype(tok.vocab_size)),
        chunk_tokens=cfg.chunk_tokens,
        shards=entries,
        splits=splits,
        extra=extra,
        shards_dir=Path(os.path.relpath(shards_dir, manifest_path.parent)).as_posix(),
    )
    write_manifest(manifest_path, m)
    return m
