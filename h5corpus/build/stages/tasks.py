"""The read and finish stages: plain functions of a :class:`~h5corpus.build.stages.buildplan.StageContext` and a
task index, run by any executor, in any process.

:func:`read_task` streams one task's records, applies the filters, hashes each document's UTF-8 text
(document id = sha256), assigns its split, drops duplicates inside the task, tokenizes (appending
EOS, or cutting at ``max_document_tokens``) and writes the kept documents into the task's
*candidate* shards plus a per-document table; its :class:`~h5corpus.build.stages.statedir.ReadRecord`,
written last, carries their hashes.

:func:`finish_task` carries out the decide stage's :class:`~h5corpus.build.stages.statedir.TaskDecision`: a
task that keeps every candidate document has its candidate shards renamed into place; otherwise
its kept documents are copied into new shards (at most ``shard_tokens`` tokens each, documents
whole). Both report named steps through ``ctx.step`` (the executor's crash points in tests).

The module runs past 600 lines because the read stage's hot path (record batches, the accept
path, the encode queue and its flat-id assembly) is meant to be read in one place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import operator
import os
import shutil
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...storage import format as fmt
from ...storage.format import ShardRecord
from ..config import (
    MAX_LISTED,
    BatchFilters,
    BuildError,
    BuildFilters,
    InfoFilters,
    OnError,
    SigningFilters,
    TimedFilters,
)
from ..input.records import BadRecord, DocChunk, LocatingReader, TaskReader
from .buildplan import StageContext
from .explain import explain_line
from .sftread import kept_extras, read_sft_records, sft_bos_id
from .shards import (
    ShardSequence,
    Syncer,
    candidate_number,
    candidate_shard_name,
    final_shard_name,
    shards_intact,
    task_shard_files,
)
from .statedir import (
    DOC_DTYPE,
    FinishRecord,
    KeepCode,
    ReadPaths,
    ReadRecord,
    SplitTally,
    TaskDecision,
    signatures_array,
    write_state_file,
)

#: Documents are encoded (and written) in batches of this many documents / characters: large
#: batches keep the tokenizer's tables in cache between calls (docs/BUILD.md).
ENCODE_BATCH_DOCS = 2048
ENCODE_BATCH_CHARS = 8 << 20
#: Records are read, filtered and accepted in batches of this many documents / characters (the
#: filters' ``process_batch`` sees these batches).
RECORD_BATCH_DOCS = 256
RECORD_BATCH_CHARS = 1 << 20
#: Tokens gathered per block when copying kept documents out of a candidate shard.
COPY_BLOCK_TOKENS = 8 << 20


#: ``h.digest()`` of a hash object, called from C (``map``).
_DIGEST = operator.methodcaller("digest")


# -- the read stage -----------------------------------------------------------------------------
@dataclass
class _Batch:
    """Records of one task waiting to be filtered and accepted, in input order. The explain lists
    (ordinal, location, id as read) and the filter lists (info, signature) are filled only when
    those features are on."""

    texts: list[str] = field(default_factory=list)
    datas: list[bytes] = field(default_factory=list)
    """UTF-8 bytes of each text (what the id hashes)."""
    ordinals: list[int] = field(default_factory=list)
    """Record number within the task (bad records included)."""
    locs: list[tuple[str, str | None, int | None]] = field(default_factory=list)
    read_ids: list[bytes | None] = field(default_factory=list)
    """Id of the text as read, when the filters changed it."""
    infos: list[Mapping[str, Any] | None] = field(default_factory=list)
    sigs: list[Any] = field(default_factory=list)


class _ReadOutputs:
    """The files one read task writes: candidate shards, the table, signatures and meta."""

    def __init__(self, ctx: StageContext, label: str, paths: ReadPaths) -> None:
        plan = ctx.plan
        self.ctx, self.label, self.paths = ctx, label, paths
        shutil.rmtree(paths.candidates, ignore_errors=True)  # leftovers of a killed attempt
        paths.candidates.mkdir(parents=True)
        self.syncer = Syncer()
        self.seqs = [
            ShardSequence(
                paths.candidates,
                (lambda n, s=split: candidate_shard_name(s, n)),
                split,
                plan.tokenizer,
                plan.chunk_tokens,
                plan.shard_tokens,
                self.syncer,
                loss_mask=plan.sft is not None,
                bos_id=sft_bos_id(plan),
            )
            for split in fmt.SPLITS
        ]
        self.docs_tmp = paths.docs.with_name(f".{paths.docs.name}.tmp{os.getpid()}")
        self.docs_fh = open(self.docs_tmp, "wb")
        self.docs_hash = hashlib.sha256()
        self.documents = self.tokens = 0
        self.sigs: list[Any] | None = [] if plan.want_signatures else None
        self.langs: list[str | None] | None = [] if plan.record_lang else None
        self.perplexities: list[float] | None = [] if plan.record_perplexity else None
        self.ex_drops: list[tuple[int, dict[str, Any]]] = []  # (record ordinal, explain line) of drops
        self.ex_rows: list[list[Any]] = []  # per table row: [ordinal, id as read, source, "line"/"row", n, lang, prob]

    def add_split(
        self,
        s: int,
        flat: np.ndarray,
        lengths: np.ndarray,
        ids: np.ndarray,
        flags: np.ndarray,
        loss_spans: np.ndarray | None = None,
    ) -> None:
        try:
            self.seqs[s].add(flat, lengths, ids, flags, loss_spans)
        except ValueError as e:  # the writer refused the ids (out of range, EOS inside a document)
            raise BuildError(f"{self.label}: tokenizer output cannot be stored: {e}") from None

    def add_rows(
        self, ids: bytes, stored: np.ndarray, chars: Sequence[int], split: np.ndarray, flags: np.ndarray
    ) -> None:
        n = stored.size
        rows = np.empty(n, dtype=DOC_DTYPE)
        rows["id"] = np.frombuffer(ids, dtype="V32")
        rows["tokens"] = stored
        rows["chars"] = chars
        rows["split"] = split
        rows["flags"] = flags
        rb = rows.tobytes()
        self.docs_fh.write(rb)
        self.docs_hash.update(rb)
        tokens = int(stored.sum())
        self.documents += n
        self.tokens += tokens
        self.ctx.events.progress(n, tokens)

    def close(self) -> list[ShardRecord]:
        """Close the candidate shards; returns them (paths relative to their folder) once durable."""
        cands = [info.with_path(Path(info.path).name) for seq in self.seqs for info in seq.close()]
        self.syncer.wait()
        return cands

    def publish(self) -> tuple[str, str | None, str | None]:
        """Put the table, signatures and meta in place; returns their sha256s."""
        p = self.paths
        self.docs_fh.close()
        os.replace(self.docs_tmp, p.docs)
        sig_sha = meta_sha = None
        if self.sigs is not None:
            buf = io.BytesIO()
            np.save(buf, signatures_array(self.sigs, self.label), allow_pickle=False)
            write_state_file(p.signatures, buf.getvalue())
            sig_sha = hashlib.sha256(buf.getvalue()).hexdigest()
        explain = self.ctx.plan.explain
        if self.langs is not None or explain or self.perplexities is not None:
            meta: dict[str, Any] = {
                "lang": self.langs,
                "explain": {"drops": self.ex_drops, "rows": self.ex_rows} if explain else None,
            }
            if self.perplexities is not None:
                meta["perplexity"] = self.perplexities  # JSON floats read back bit-exact
            blob = json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            write_state_file(p.meta, blob)
            meta_sha = hashlib.sha256(blob).hexdigest()
        return self.docs_hash.hexdigest(), sig_sha, meta_sha

    def abort(self) -> None:
        self.syncer.abandon()
        for seq in self.seqs:
            seq.abort()
        self.docs_fh.close()
        self.docs_tmp.unlink(missing_ok=True)


class _EncodeQueue:
    """Kept documents waiting to be encoded and written, flushed in batches of
    :data:`ENCODE_BATCH_DOCS` documents / :data:`ENCODE_BATCH_CHARS` characters."""

    def __init__(self, ctx: StageContext, out: _ReadOutputs, seconds: dict[str, float]) -> None:
        self.encoder = ctx.encoder
        self.vocab_size = ctx.plan.tokenizer.vocab_size
        self.dtype = fmt.token_dtype(self.vocab_size)
        self.eos = ctx.plan.tokenizer.eos_id
        self.fallbacks = 0
        """Documents of this task the encoder handed to the reference encoder."""
        self.max_tokens = ctx.plan.max_document_tokens
        self.out, self.seconds = out, seconds
        self.texts: list[str] = []
        self.ids: list[bytes] = []
        self.chars: list[int] = []
        self.splits: list[int] = []
        self.size = 0

    def extend(self, texts: list[str], ids: list[bytes], chars: list[int], splits: list[int]) -> None:
        self.texts += texts
        self.ids += ids
        self.chars += chars
        self.splits += splits
        self.size += sum(chars)
        while len(self.texts) >= ENCODE_BATCH_DOCS or self.size >= ENCODE_BATCH_CHARS:
            # the batch ends at the first document that reaches either limit
            full_at = int(np.searchsorted(np.cumsum(self.chars), ENCODE_BATCH_CHARS, side="left")) + 1
            self.flush(min(ENCODE_BATCH_DOCS, full_at, len(self.texts)))

    def flush(self, k: int | None = None) -> None:
        """Encode and write the first ``k`` queued documents (all by default)."""
        k = len(self.texts) if k is None else k
        if not k:
            return
        clock = time.process_time
        c0 = clock()
        fallbacks = self.encoder.fallbacks
        flat, offsets = self.encoder.encode_flat(self.texts[:k])
        c1 = clock()
        self.seconds["encode"] += c1 - c0
        self.fallbacks += self.encoder.fallbacks - fallbacks
        full = np.diff(offsets) + 1
        stored = np.minimum(full, self.max_tokens) if self.max_tokens else full
        flags = (stored < full).astype(np.uint8) * fmt.FLAG_TRUNCATED
        tokens = self._stored_tokens(flat, offsets, stored)
        split = np.asarray(self.splits[:k], dtype=np.uint8)
        ids = b"".join(self.ids[:k])
        id_rows = np.frombuffer(ids, dtype=np.uint8).reshape(k, fmt.DOC_ID_BYTES)
        starts = np.zeros(k + 1, dtype=np.int64)
        np.cumsum(stored, out=starts[1:])
        for s in (0, 1):
            sel = split == s
            if sel.all():
                self.out.add_split(s, tokens, stored, id_rows, flags)
            elif sel.any():
                self.out.add_split(s, _gather(tokens, starts, sel), stored[sel], id_rows[sel], flags[sel])
        self.out.add_rows(ids, stored, self.chars[:k], split, flags)
        self.size -= sum(self.chars[:k])
        for lst in (self.texts, self.ids, self.chars, self.splits):
            del lst[:k]
        self.seconds["write"] += clock() - c1

    def _stored_tokens(self, flat: np.ndarray, offsets: np.ndarray, stored: np.ndarray) -> np.ndarray:
        """The stored tokens of the batch, one flat array: each document's ids then EOS, or, when
        cut at ``max_document_tokens``, its first ``stored`` ids without EOS."""
        k = offsets.size - 1
        if flat.size and int(flat.max()) >= self.vocab_size:  # before the cast to the stored dtype
            raise BuildError(
                f"{self.out.label}: tokenizer output cannot be stored: id {int(flat.max())} >= vocabulary size "
                f"{self.vocab_size}"
            )
        out = np.empty(flat.size + k, dtype=self.dtype)
        eos_at = offsets[1:] + np.arange(k)
        keep = np.ones(out.size, dtype=bool)
        keep[eos_at] = False
        out[keep] = flat
        out[eos_at] = self.eos
        full = np.diff(offsets) + 1
        if bool((stored < full).any()):
            starts = offsets[:-1] + np.arange(k)
            out = np.concatenate([out[a : a + m] for a, m in zip(starts.tolist(), stored.tolist())])
        return out


def _gather(tokens: np.ndarray, starts: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """The tokens of the documents ``sel`` (bool per document; document ``i`` holds
    ``tokens[starts[i]:starts[i + 1]]``), in order: one slice per run of selected documents."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], sel, [False])).astype(np.int8)))
    runs = starts[edges].reshape(-1, 2).tolist()
    return np.concatenate([tokens[a:b] for a, b in runs]) if len(runs) > 1 else tokens[runs[0][0] : runs[0][1]]


class _TaskRead:
    """The state of one task's read stage between its record batches: counts, the ids seen in the
    task (exact dedup within the task), the filters, the encode queue."""

    def __init__(self, ctx: StageContext, label: str, out: _ReadOutputs) -> None:
        plan = ctx.plan
        self.ctx, self.label, self.out = ctx, label, out
        self.rule = plan.split
        self.explain = plan.explain
        self.seconds = {"filter": 0.0, "encode": 0.0, "write": 0.0}
        self.queue = _EncodeQueue(ctx, out, self.seconds)
        self.duplicates = [0, 0]  # per split index
        self.skipped = [0, 0]
        self.filtered: list[dict[str, int]] = [{}, {}]
        self.skip_codes: dict[str, int] = {}
        self.listed: list[str] = []
        self.skipped_total = 0
        self.seen: set[bytes] = set()
        f = ctx.filters
        self.filters = f
        self.process_batch = f.process_batch if isinstance(f, BatchFilters) else None
        # Signatures are only computed when the decide stage has a near-duplicate index to feed.
        self.signature = f.signature if plan.want_signatures and isinstance(f, SigningFilters) else None

    def bad(self, rec: BadRecord) -> None:
        """A record that is not a document: stop the build, or count and list it (``skip``)."""
        if rec.code == "changed":  # not a bad record: the input is not the one planned
            raise BuildError(str(rec))
        if self.ctx.plan.on_error == OnError.FAIL:
            raise BuildError(f"{rec} (pass --on-error skip to skip and count bad records)")
        self.skipped[int(self.rule.indices([hashlib.sha256(rec.where.encode()).digest()])[0])] += 1
        self.skip_codes[rec.code] = self.skip_codes.get(rec.code, 0) + 1
        self.skipped_total += 1
        if len(self.listed) < MAX_LISTED:
            self.listed.append(str(rec))

    def tallies(self) -> dict[str, SplitTally]:
        return {
            split: SplitTally(duplicates=self.duplicates[i], skipped=self.skipped[i], filtered=self.filtered[i])
            for i, split in enumerate(fmt.SPLITS)
        }

    def documents(self, b: _Batch) -> None:
        """Filter (when filters are set) and accept one batch of records."""
        if not b.texts:
            return
        if self.filters is not None:
            b = self._filter(b)
        self.accept(b)

    def _filter(self, b: _Batch) -> _Batch:
        """The batch's documents that the filters keep (their possibly changed text); drops counted
        per reason in the split of the text as read."""
        c0 = time.process_time()
        if self.process_batch is not None:
            want = self.signature is not None
            res = [
                (r.text, r.reason, getattr(r, "signature", None), getattr(r, "info", None))
                for r in self.process_batch(b.texts, signatures=want)
            ]
        else:
            res = []
            for text in b.texts:
                new, reason = self.filters.process(text)
                res.append(
                    (new, reason, None, self.filters.last_info if isinstance(self.filters, InfoFilters) else None)
                )
        self.seconds["filter"] += time.process_time() - c0
        out = _Batch()
        dropped: list[tuple[int, str]] = []
        sha256 = hashlib.sha256
        for i, (new, reason, sig, info) in enumerate(res):
            if new is None:
                dropped.append((i, str(reason or "filtered")))
                continue
            text, data = b.texts[i], b.datas[i]
            out.texts.append(new)
            out.datas.append(data if new is text else new.encode("utf-8"))
            out.infos.append(info)
            out.sigs.append(sig)
            if self.explain:
                out.ordinals.append(b.ordinals[i])
                out.locs.append(b.locs[i])
                out.read_ids.append(None if new is text else sha256(data).digest())
        if dropped:
            read_ids = [sha256(b.datas[i]).digest() for i, _ in dropped]
            for (i, reason), s, read_id in zip(dropped, self.rule.indices(read_ids).tolist(), read_ids):
                filtered = self.filtered[s]
                filtered[reason] = filtered.get(reason, 0) + 1
                if self.explain:
                    self.out.ex_drops.append((b.ordinals[i], explain_line(read_id.hex(), b.locs[i], reason, res[i][3])))
        return out

    def accept(self, b: _Batch) -> None:
        """The one accept path of every document past the filters: id, split, empty and duplicate
        checks, then the encode queue."""
        ids = list(map(_DIGEST, map(hashlib.sha256, b.datas)))  # document ids; no bytecode per document
        splits = self.rule.indices(ids)
        texts, seen = b.texts, self.seen
        fresh = set(ids)
        if len(fresh) == len(ids) and seen.isdisjoint(fresh) and all(texts):  # the common case, in C
            seen |= fresh
            if self._wants_extras():
                self._kept_extras(b, range(len(ids)), ids)
            self.queue.extend(texts, ids, list(map(len, texts)), splits.tolist())
            return
        kept: list[int] = []
        dropped: list[tuple[int, str]] = []
        for i, doc_id in enumerate(ids):
            if not texts[i]:
                dropped.append((i, "empty"))
            elif doc_id in seen:
                dropped.append((i, "exact_dup"))
            else:
                seen.add(doc_id)
                kept.append(i)
        if dropped:
            self._dropped(b, ids, splits, dropped)
        if len(kept) < len(ids):
            texts, ids, splits = [texts[i] for i in kept], [ids[i] for i in kept], splits[kept]
        if self._wants_extras():
            self._kept_extras(b, kept, ids)
        self.queue.extend(texts, ids, [len(t) for t in texts], splits.tolist())

    def _wants_extras(self) -> bool:
        """True when kept documents carry per-document extras (signature, language, score, explain row)."""
        out = self.out
        return out.sigs is not None or out.langs is not None or out.perplexities is not None or bool(self.explain)

    def _dropped(self, b: _Batch, ids: list[bytes], splits: np.ndarray, dropped: list[tuple[int, str]]) -> None:
        for i, why in dropped:
            s = int(splits[i])
            if why == "empty":
                self.skipped[s] += 1
                self.skip_codes["empty"] = self.skip_codes.get("empty", 0) + 1
            else:
                self.duplicates[s] += 1
            if self.explain:
                read_id = b.read_ids[i] or ids[i]
                info = b.infos[i] if b.infos else None
                dup_of = ids[i].hex() if why == "exact_dup" else None
                self.out.ex_drops.append((b.ordinals[i], explain_line(read_id.hex(), b.locs[i], why, info, dup_of)))

    def _kept_extras(self, b: _Batch, kept: Sequence[int], kept_ids: list[bytes]) -> None:
        """Per kept document: its signature, its language, its explain row (table order)."""
        out = self.out
        for j, i in enumerate(kept):
            info = b.infos[i] if b.infos else None
            kept_extras(out, self.label, self.signature, b.texts[i], b.sigs[i] if b.sigs else None, info)
            if self.explain:
                lang = info.get("lang") if info else None
                prob = None if lang is None else round(float(info["lang_prob"]), 4)  # type: ignore[index]
                loc = b.locs[i]
                out.ex_rows.append([b.ordinals[i], (b.read_ids[i] or kept_ids[j]).hex(), *loc, lang, prob])


def _read_records(run: _TaskRead, reader: TaskReader, locate: Callable[[int], Any] | None) -> None:
    """The read stage's hot loop: stream the task's records into batches; bad records aside."""
    if locate is None and reader.task.kind == "parquet":
        _read_chunks(run, reader.parquet_chunks())
        return
    if locate is None and reader.task.kind in ("jsonl", "jsonl.gz", "jsonl.zst"):
        _read_chunks(run, reader.jsonl_chunks())
        return
    batch = _Batch()
    size = 0
    for k, rec in enumerate(reader):
        if type(rec) is not tuple:
            run.bad(rec)  # type: ignore[arg-type]
            continue
        text = rec[0]
        batch.texts.append(text)
        batch.datas.append(rec[1])
        if locate is not None:
            batch.ordinals.append(k)
            batch.locs.append(locate(k))
            batch.read_ids.append(None)
        size += len(text)
        if len(batch.texts) >= RECORD_BATCH_DOCS or size >= RECORD_BATCH_CHARS:
            run.documents(batch)
            batch, size = _Batch(), 0
    run.documents(batch)
    run.queue.flush()


def _read_chunks(run: _TaskRead, chunks: Iterable[DocChunk | BadRecord]) -> None:
    """:func:`_read_records` for a reader that gives runs of documents: the same batches (a batch
    ends at the document that reaches :data:`RECORD_BATCH_DOCS` or :data:`RECORD_BATCH_CHARS`),
    cut out of each run without a Python step per record."""
    batch = _Batch()
    size = 0
    for chunk in chunks:
        if isinstance(chunk, BadRecord):
            run.bad(chunk)
            continue
        texts, datas = chunk
        i, n = 0, len(texts)
        while i < n:
            room = RECORD_BATCH_DOCS - len(batch.texts)
            ends = list(accumulate(map(len, texts[i : i + room]), initial=size))
            j = bisect_left(ends, RECORD_BATCH_CHARS, lo=1)  # documents up to the one that fills it
            take = min(j, len(ends) - 1)
            batch.texts += texts[i : i + take]
            batch.datas += datas[i : i + take]
            size = ends[take]
            i += take
            if len(batch.texts) >= RECORD_BATCH_DOCS or size >= RECORD_BATCH_CHARS:
                run.documents(batch)
                batch, size = _Batch(), 0
    run.documents(batch)
    run.queue.flush()


def read_task(ctx: StageContext, index: int) -> ReadRecord:
    """The read stage of task ``index``: its candidate shards, table and record in the state folder.
    Returns the record (also written, last)."""
    c_start = time.process_time()  # per-step timings are CPU seconds of this (single-threaded) process
    plan = ctx.plan
    task = plan.tasks[index]
    f = ctx.filters
    counters0 = dict(f.counters()) if isinstance(f, BuildFilters) else None
    timings0 = dict(f.timings()) if isinstance(f, TimedFilters) else None
    paths = ctx.state.read_paths(index)
    out = _ReadOutputs(ctx, task.label, paths)
    run = _TaskRead(ctx, task.label, out)
    try:
        if plan.sft is not None:
            read_sft_records(run, task, plan)
        elif plan.explain:
            reader: TaskReader = LocatingReader(
                task, plan.text_field, plan.newlines_before.get(index, 0), plan.max_record_bytes
            )
            _read_records(run, reader, reader.location)  # type: ignore[attr-defined]
        else:
            _read_records(run, TaskReader(task, plan.text_field, max_record_bytes=plan.max_record_bytes), None)
        cands = out.close()  # every candidate durable before the record that lists it
        ctx.step("read-candidates")
        docs_sha, sig_sha, meta_sha = out.publish()
    except BaseException:
        out.abort()
        raise
    total = time.process_time() - c_start
    seconds = {"total": total, "read": total - sum(run.seconds.values()), **run.seconds}
    if timings0 is not None:
        for k, v in f.timings().items():
            seconds[f"filter:{k}"] = float(v) - float(timings0.get(k, 0.0))
    record = ReadRecord(
        index=index,
        task=task.key,
        encoder=ctx.encoder.name,
        explain=plan.explain,
        documents=out.documents,
        tokens=out.tokens,
        docs_sha256=docs_sha,
        signatures_sha256=sig_sha,
        meta_sha256=meta_sha,
        candidates=tuple(cands),
        counts=run.tallies(),
        skipped_total=run.skipped_total,
        skip_codes=run.skip_codes,
        skipped_records=run.listed,
        filter_counters=_counter_delta(counters0, f),
        seconds={k: round(v, 4) for k, v in seconds.items()},
        encoder_fallbacks=run.queue.fallbacks,
    )
    write_state_file(paths.record, json.dumps(record.to_json(), sort_keys=True).encode("utf-8"))
    ctx.step("read-record")
    return record


def _counter_delta(before: Mapping[str, int] | None, filters: Any) -> dict[str, int]:
    if before is None:
        return {}
    return {k: int(v) - int(before.get(k, 0)) for k, v in dict(filters.counters()).items()}


# -- the finish stage ---------------------------------------------------------------------------
def finish_task(ctx: StageContext, index: int, decision: TaskDecision) -> FinishRecord | None:
    """The finish stage of task ``index``: its final shards, as ``decision`` says. Reuses a finish
    record of the same decision whose shards verify; else renames the candidates into place when
    every candidate document is kept, or copies the kept ones. Returns the record, or None when the
    candidates are gone or damaged (the task must then be read again)."""
    plan, shards_dir = ctx.plan, ctx.shards_dir
    old = ctx.state.load_finish_record(index, decision.task)
    if old is not None and old.decision_sha256 == decision.sha256:
        if shards_intact(shards_dir, old.shards, plan.tokenizer, plan.chunk_tokens):
            return dataclasses.replace(old, reused=True)
    for p in task_shard_files(shards_dir, index):
        p.unlink(missing_ok=True)
    cand_dir = ctx.state.read_paths(index).candidates
    cands = decision.candidates
    present = all(_candidate_present(cand_dir, c) for c in cands)
    if not present or (
        decision.verify_candidates and not shards_intact(cand_dir, cands, plan.tokenizer, plan.chunk_tokens)
    ):
        return None
    keep = decision.keep != KeepCode.DROPPED
    shards: list[ShardRecord] = []
    if bool(keep.all()):
        for c in cands:
            rel = final_shard_name(c.split, index, candidate_number(c.path))
            (shards_dir / c.split).mkdir(parents=True, exist_ok=True)
            if c.docs_sha256 is not None:  # the sidecar first: a final shard always has its own
                os.replace(fmt.docs_path(cand_dir / c.path), fmt.docs_path(shards_dir / rel))
            os.replace(cand_dir / c.path, shards_dir / rel)
            shards.append(c.with_path(rel))
            ctx.step("finish-renamed")
    elif bool(keep.any()):
        docs = np.fromfile(ctx.state.read_paths(index).docs, dtype=DOC_DTYPE)
        for s, split in enumerate(fmt.SPLITS):
            split_keep = keep[docs["split"] == s]
            if split_keep.any():
                shards += _copy_kept(ctx, index, split, [c for c in cands if c.split == split], split_keep)
    record = FinishRecord(index=index, task=decision.task, decision_sha256=decision.sha256, shards=tuple(shards))
    ctx.state.write_finish_record(record)
    ctx.step("finish-record")
    shutil.rmtree(cand_dir, ignore_errors=True)
    return record


def _candidate_present(cand_dir: Path, c: ShardRecord) -> bool:
    """A candidate shard (and, version 4, its sidecar) is on disk at its recorded size."""
    files = [(cand_dir / c.path, c.bytes)]
    if c.docs_sha256 is not None:
        files.append((fmt.docs_path(cand_dir / c.path), c.docs_bytes))
    return all(p.is_file() and p.stat().st_size == n for p, n in files)


def _copy_kept(
    ctx: StageContext, index: int, split: str, cands: list[ShardRecord], keep: np.ndarray
) -> list[ShardRecord]:
    """Copy the kept documents (``keep``: one bool per document of ``split``, in order) of a task's
    candidate shards into its final shards of ``split``."""
    plan, shards_dir = ctx.plan, ctx.shards_dir
    cand_dir = ctx.state.read_paths(index).candidates
    seq = ShardSequence(
        shards_dir,
        (lambda n: final_shard_name(split, index, n)),
        split,
        plan.tokenizer,
        plan.chunk_tokens,
        plan.shard_tokens,
        loss_mask=plan.sft is not None,
        bos_id=sft_bos_id(plan),
    )
    out: list[ShardRecord] = []
    at = 0  # position of the current candidate shard's first document among this split's documents
    try:
        for c in cands:
            k = keep[at : at + c.documents]
            at += c.documents
            if k.any():
                _copy_documents(cand_dir / c.path, np.flatnonzero(k), seq, c)
        for info in seq.close():
            out.append(info.relative_to(shards_dir))
            ctx.step("finish-copied")
    except BaseException:
        seq.abort()
        raise
    return out


def _copy_documents(path: Path, sel: np.ndarray, seq: ShardSequence, record: ShardRecord) -> None:
    """Append documents ``sel`` of the shard at ``path`` (recorded as ``record``) to ``seq``,
    reading ~8 M tokens at a time; a version 4 shard's ids and flags from its sidecar, proven first."""
    with h5py.File(path, "r") as f:
        offs = f[fmt.DOC_OFFSETS][:]
        if record.docs_sha256 is not None:
            ids, flags = fmt.read_docs(fmt.docs_path(path), record, str(path))
        else:
            ids, flags = f[fmt.DOC_IDS][:], f[fmt.DOC_FLAGS][:]
        tokens = f[fmt.TOKENS]
        loss = np.asarray(f[fmt.LOSS_SPANS][()], np.int64) if seq.loss_mask else None
        lens = (offs[1:] - offs[:-1])[sel]
        i = 0
        while i < sel.size:
            j = i + max(1, int(np.searchsorted(np.cumsum(lens[i:]), COPY_BLOCK_TOKENS, side="right")))
            lo, hi = int(offs[sel[i]]), int(offs[sel[j - 1] + 1])
            block = tokens[lo:hi]
            part = lens[i:j]
            rel = np.repeat(offs[sel[i:j]] - lo - (np.cumsum(part) - part), part)
            kept = None if loss is None else _kept_spans(loss, offs, sel[i:j], part)
            seq.add(block[rel + np.arange(int(part.sum()), dtype=np.int64)], part, ids[sel[i:j]], flags[sel[i:j]], kept)
            i = j


def _kept_spans(loss: np.ndarray, offs: np.ndarray, docs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The trained-on ranges of documents ``docs`` (sorted; ``lens`` tokens each) of a shard with
    ``/loss_spans`` ``loss`` and ``doc_offsets`` ``offs``, moved to where the documents lie once
    copied end to end."""
    new_start = np.full(offs.size - 1, -1, np.int64)
    new_start[docs] = np.cumsum(lens) - lens
    doc = np.searchsorted(offs, loss[:, 0], side="right") - 1
    keep = new_start[doc] >= 0
    return loss[keep] + (new_start[doc[keep]] - offs[doc[keep]])[:, None]
