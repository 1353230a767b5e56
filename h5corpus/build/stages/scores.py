"""``--perplexity-scores FILE``: each scored document's perplexity, as a tab-separated file.

Written by the commit stage, before the manifest, from what the read stage recorded (every table
row's perplexity, in the task's meta file) and what the decide stage decided. One header line,
then one line per document that passed the read stage's filters (and its in-task exact dedup), in
input order::

    id<TAB>split<TAB>perplexity<TAB>stored

``id``: sha256 hex of the stored text (the shards' document id); ``split``: ``train`` or
``validation``; ``perplexity``: the score, as Python's shortest round-trip repr of the float;
``stored``: 1 when the corpus holds the document, else 0 (a cross-task duplicate, the
worst-fraction rule, a budget). Documents the read stage dropped are in ``--explain-drops``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ...storage import format as fmt
from .decide import DecideInput, task_scores
from .state import ReadRecord, StateDir, TaskDecision

HEADER = "id\tsplit\tperplexity\tstored\n"


def write_scores(
    path: str | os.PathLike[str],
    state: StateDir,
    reads: Sequence[ReadRecord],
    decisions: Mapping[int, TaskDecision],
) -> int:
    """Write the file (atomically: a temporary file renamed into place); returns its documents."""
    out = Path(path).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(HEADER)
            for rec in reads:
                inp = DecideInput(rec, *state.load_read_outputs(rec))
                scores = task_scores(inp).tolist()
                ids = [bytes(i).hex() for i in inp.docs["id"]]
                splits = inp.docs["split"].tolist()
                stored = (np.asarray(decisions[rec.index].keep) != 0).astype(np.uint8).tolist()
                fh.writelines(f"{i}\t{fmt.SPLITS[s]}\t{p!r}\t{k}\n" for i, s, p, k in zip(ids, splits, scores, stored))
                n += len(ids)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n
