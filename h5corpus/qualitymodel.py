"""Quality models from build sources: train an n-gram language model on reference documents and
score documents by perplexity (the library behind ``h5corpus quality-model train|score``).

Documents are read as the build reads them (:mod:`h5corpus.build.input.sources`: files, folders,
globs, ``hf://`` datasets, ``stdlib``); the model itself is :mod:`h5corpus.filters.perplexity`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .build.input.records import BadRecord, TaskReader
from .build.input.sources import Input, plan_tasks, resolve_sources
from .filters.ngramtrain import train_ngram_model
from .filters.perplexity import NgramModel, load_model

#: Documents scored at once by :func:`score_sources`.
SCORE_BATCH = 256
QUANTILES = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.8, 0.9, 0.95, 0.99)


class BadReference(ValueError):
    """A source record that is not a usable document (names file and line/row)."""


def iter_documents(specs: Sequence[str], text_field: str = "text") -> Iterator[tuple[str, str]]:
    """``(where, text)`` of every document of build SOURCE specs, in input order; ``where`` is
    the file name for a ``.txt`` document, else ``file#n`` (the n-th document of the file,
    1-based). Raises :class:`h5corpus.build.input.sources.SourceError` for a spec that resolves to
    nothing and :class:`BadReference` for a bad record."""
    return _documents(resolve_sources(specs), text_field)


def _documents(inputs: Sequence[Input], text_field: str) -> Iterator[tuple[str, str]]:
    for task in plan_tasks(inputs, task_bytes=1 << 62):  # one task per file
        records = TaskReader(task, text_field)
        if task.kind == "text":  # a run of .txt files, one document each
            named = ((f.name, rec) for f, rec in zip(task.files, records))
        else:
            named = ((f"{task.files[0].name}#{n}", rec) for n, rec in enumerate(records, start=1))
        for where, rec in named:
            if isinstance(rec, BadRecord):
                raise BadReference(str(rec))
            yield where, rec[0]


@dataclass
class TrainReport:
    """What :func:`train_from_sources` wrote."""

    path: Path
    file_bytes: int
    header: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"model": str(self.path), "file_bytes": self.file_bytes, "header": self.header}


def train_from_sources(
    specs: Sequence[str],
    output: str | os.PathLike[str],
    *,
    order: int = 3,
    text_field: str = "text",
    max_documents: int | None = None,
    progress: bool = False,
) -> TrainReport:
    """Train an order-``order`` model on the documents of ``specs`` and write it to ``output``
    (the header records the sources as the build describes them). Raises SourceError,
    BadReference, or ValueError (bad order, no text)."""
    inputs = resolve_sources(specs)
    texts = (text for _where, text in _documents(inputs, text_field))
    model = train_ngram_model(
        texts,
        order=order,
        max_documents=max_documents,
        sources=[{**inp.describe(), "text_field": text_field} for inp in inputs],
        progress=progress,
    )
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return TrainReport(path, path.stat().st_size, model.header)


@dataclass
class ScoreReport:
    """Perplexities of documents under a model (:func:`score_sources`)."""

    model: str
    model_sha256: str
    where: list[str] = field(default_factory=list)
    perplexity: list[float] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    preview: list[str] = field(default_factory=list)

    def quantiles(self) -> dict[str, float]:
        """Perplexity at :data:`QUANTILES` (``"p50"``: the median, ``"p80"``: the threshold that
        drops the worst 20%); empty without documents."""
        if not self.perplexity:
            return {}
        values = np.quantile(np.asarray(self.perplexity), QUANTILES)
        return {f"p{round(q * 100)}": round(float(v), 3) for q, v in zip(QUANTILES, values)}

    def to_json(self, documents: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "model_sha256": self.model_sha256,
            "documents": len(self.perplexity),
            "quantiles": self.quantiles(),
        }
        if documents:
            out["scores"] = [
                {"where": w, "perplexity": round(p, 4), "units": u}
                for w, p, u in zip(self.where, self.perplexity, self.units)
            ]
        return out


def score_sources(
    model: str | os.PathLike[str] | NgramModel,
    specs: Sequence[str],
    *,
    text_field: str = "text",
    max_documents: int | None = None,
    max_chars: int | None = None,
    progress: bool = False,
) -> ScoreReport:
    """Perplexity of every document of ``specs`` (the first ``max_chars`` characters of each
    when given, as the filter's ``perplexity_max_chars``). Raises ModelFileError, SourceError,
    BadReference."""
    lm = model if isinstance(model, NgramModel) else load_model(model)
    report = ScoreReport(str(model) if not isinstance(model, NgramModel) else "<in memory>", lm.sha256)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=max_documents, unit="doc", desc="quality-model score", leave=False)
    batch: list[str] = []

    def flush() -> None:
        total, n = lm.score(batch)
        report.perplexity.extend(np.exp(-total / n).tolist())
        report.units.extend((n - 1).tolist())
        if bar is not None:
            bar.update(len(batch))
        batch.clear()

    try:
        for where, text in iter_documents(specs, text_field):
            if max_documents is not None and len(report.where) >= max_documents:
                break
            text = text if max_chars is None else text[:max_chars]
            report.where.append(where)
            report.preview.append(text[:60].replace("\n", " "))
            batch.append(text)
            if len(batch) >= SCORE_BATCH:
                flush()
        if batch:
            flush()
    finally:
        if bar is not None:
            bar.close()
    return report
