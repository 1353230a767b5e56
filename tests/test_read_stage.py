"""The read stage's parquet path: row batches without per-row Python, every string layout a text
column can have (string, large_string, string_view, dictionary-encoded), bad rows in place, and
the same documents, batches and shards as the JSONL path for the same texts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from h5corpus.build import BuildConfig, build_corpus
from h5corpus.build.input.records import BadRecord, TaskReader
from h5corpus.build.input.sources import plan_tasks, resolve_sources
from tests.helpers import read_built, stdlib_texts, write_jsonl


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real text with multi-byte characters, one empty document and one repeated one."""
    base = [t[:6000] + ("\n# ünïcödé — 日本語 👍" if i % 3 == 0 else "") for i, t in enumerate(stdlib_texts(limit=120))]
    return base[:50] + [""] + base[50:] + [base[3]]


def _records(path: Path, text_field: str = "text") -> list:
    tasks = plan_tasks(resolve_sources([str(path)]), task_bytes=40_000)
    assert len(tasks) > 1
    return [r for t in tasks for r in TaskReader(t, text_field)]


def _chunk_records(path: Path) -> list:
    out: list = []
    for t in plan_tasks(resolve_sources([str(path)]), task_bytes=40_000):
        for c in TaskReader(t, "text").parquet_chunks():
            out.extend([c] if isinstance(c, BadRecord) else zip(*c))
    return out


@pytest.mark.parametrize(
    "layout", ["string", "large_string", "string_view", "dictionary<string>", "dictionary<large_string>"]
)
def test_every_string_layout_of_the_text_column_gives_the_same_records(tmp_path, texts, layout):
    """Each layout (dictionary-encoded ones included, which were refused before) reads as the same
    documents in row order, a null as a bad record at its row; the per-record reader and the row
    batches agree, and each document's bytes are its text's UTF-8."""
    values = texts[:20] + [None] + texts[20:]
    typ = {"string": pa.string(), "large_string": pa.large_string(), "string_view": pa.string_view()}
    if layout.startswith("dictionary"):
        inner = pa.large_string() if "large" in layout else pa.string()
        col = pa.array(values, inner).dictionary_encode()
    else:
        col = pa.array(values, typ[layout])
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": col, "n": list(range(len(values)))}), p, row_group_size=9)
    if layout.startswith("dictionary"):
        assert pa.types.is_dictionary(pq.ParquetFile(p).schema_arrow.field("text").type)
    recs = _records(p)
    assert _chunk_records(p) == recs
    docs = [r for r in recs if not isinstance(r, BadRecord)]
    assert [d[0] for d in docs] == texts
    assert all(bytes(d[1]) == d[0].encode("utf-8") for d in docs)
    [bad] = [r for r in recs if isinstance(r, BadRecord)]
    assert (bad.where, bad.code) == (f"{p} row 20", "not_string") and "null" in bad.reason


def test_invalid_utf8_rows_are_bad_records_in_place(tmp_path):
    raw = pa.array([b"first", b"bad \xff\xfe bytes", b"", b"last"], pa.binary()).view(pa.string())
    p = tmp_path / "u.parquet"
    pq.write_table(pa.table({"text": raw}), p)
    recs = [r for t in plan_tasks(resolve_sources([str(p)]), task_bytes=1 << 20) for r in TaskReader(t, "text")]
    assert [r[0] if isinstance(r, tuple) else r.code for r in recs] == ["first", "invalid_utf8", "", "last"]
    assert recs[1].where == f"{p} row 1"


def test_a_dictionary_of_numbers_is_not_a_text_column(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": pa.array([1, 2, 1]).dictionary_encode()}), p)
    recs = _records_one(p)
    assert [r.code for r in recs] == ["not_string"] * 3 and "not a string" in recs[0].reason


def _records_one(p: Path) -> list:
    return [r for t in plan_tasks(resolve_sources([str(p)]), task_bytes=1 << 20) for r in TaskReader(t, "text")]


class BatchShape:
    """A filter that keeps every text and counts, per batch it is given, the documents and the
    squares of the batch sizes: equal counters mean the same batches."""

    def __init__(self) -> None:
        self.c = {"batches": 0, "documents": 0, "squares": 0, "chars": 0}

    def process(self, text):
        return text, None

    def process_batch(self, texts, *, signatures: bool):
        n = len(texts)
        self.c["batches"] += 1
        self.c["documents"] += n
        self.c["squares"] += n * n
        self.c["chars"] += sum(map(len, texts))
        return [type("R", (), {"text": t, "reason": None})() for t in texts]

    def counters(self):
        return dict(self.c)

    def describe(self):
        return {"name": "batch-shape"}


def test_parquet_and_jsonl_of_the_same_texts_store_the_same_documents_in_the_same_batches(tmp_path, texts):
    """FineWeb-schema parquet and JSONL holding the same texts (one task each): the filters see the
    same record batches, and the stored documents (ids, tokens, flags) are identical."""
    # short documents (a batch fills at 256 documents) and long ones (it fills at 1 M characters)
    many = [f"short document {i}" for i in range(600)] + [
        f"{t}\n# copy {k}" if t else t for k in range(4) for t in texts
    ]
    j = write_jsonl(tmp_path / "in.jsonl", many)
    p = tmp_path / "in.parquet"
    n = len(many)
    pq.write_table(
        pa.table(
            {
                "text": many,
                "id": [f"<urn:uuid:{i:08d}>" for i in range(n)],
                "url": [f"https://example.org/{i}" for i in range(n)],
                "language_score": [0.9] * n,
            }
        ),
        p,
        row_group_size=1000,
    )
    reps, built = [], []
    for name, src in (("j", j), ("p", p)):
        root = tmp_path / name
        reps.append(
            build_corpus(
                BuildConfig(
                    sources=[str(src)],
                    tokenizer="bytes",
                    workers=1,
                    filters=BatchShape(),
                    shards_dir=root / "shards",
                    manifest=root / "manifests" / "shards.json",
                )
            )
        )
        built.append(read_built(root / "manifests" / "shards.json"))
    assert reps[0].tasks == reps[1].tasks == 1
    assert reps[0].filter_counters == reps[1].filter_counters
    assert reps[0].filter_counters["batches"] > 3 and reps[0].filter_counters["documents"] == len(many)
    for split in built[0]:
        a, b = built[0][split], built[1][split]
        assert [d[0] for d in a] == [d[0] for d in b] and all((x[1] == y[1]).all() for x, y in zip(a, b))
    stored = {d[0] for s in built[0].values() for d in s}
    assert stored == {hashlib.sha256(t.encode()).digest()[:16] for t in many if t}  # 128 bits stored (format v3)
