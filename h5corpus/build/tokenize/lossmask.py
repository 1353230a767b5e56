"""Fine-tuning documents -> token ids and the token ranges trained on (docs/FORMAT.md, "Loss masks").

Encoding goes through the reference ``tokenizers`` encoder with character offsets (correctness
first: the fast encoders give no offsets), with the tokenizer's *added special tokens recognized*
(``<|im_end|>`` in a rendered chat is its id, as ``tokenizer(text, add_special_tokens=False)``
gives in transformers; the pretraining build encodes such text as plain text instead).

The rules, per document of ``n`` text tokens (stored as ``[BOS] + ids + [EOS]``):

* a token is trained on iff **any** of its characters lies in a trained-on character range (a
  token that straddles a prompt and its answer, or an answer and its closing marker, is trained
  on: the model must produce it to produce the answer); a token with an empty offset range is
  judged by the character at its start;
* the EOS the build appends is trained on iff the token before it is (an answer that runs to the
  document's end teaches the model to stop there; a chat template's closing marker is a token of
  its own and is trained by the first rule);
* a document's first stored token (BOS, or the first text token) is never trained on: nothing
  predicts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .tokenizer import Tokenizer


def char_mask_counts(n_chars: int, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """(n_chars + 1,) int64 prefix counts of trained-on characters: characters ``[a, b)`` hold
    ``c[b] - c[a]`` trained ones."""
    m = np.zeros(n_chars + 1, np.int64)
    for a, b in spans:
        m[a] += 1
        m[b] -= 1
    covered = np.cumsum(m[:-1]) > 0
    out = np.zeros(n_chars + 1, np.int64)
    np.cumsum(covered, out=out[1:])
    return out


def token_mask(offsets: np.ndarray, n_chars: int, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """bool per token: trained on (module docstring). ``offsets``: (n, 2) character ranges."""
    c = char_mask_counts(n_chars, spans)
    a = np.clip(offsets[:, 0], 0, n_chars)
    b = np.clip(np.maximum(offsets[:, 1], offsets[:, 0] + 1), 0, n_chars)
    return (c[b] - c[a]) > 0


def mask_ranges(mask: np.ndarray) -> np.ndarray:
    """(k, 2) int64 ``[start, end)`` runs of True in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return edges.reshape(-1, 2).astype(np.int64)


class SFTEncoder:
    """The reference encoder with offsets and special tokens recognized, for fine-tuning records."""

    name = "tokenizers+offsets"

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._hf: Any = None

    @property
    def hf(self) -> Any:
        if self._hf is None:
            from tokenizers import Tokenizer as HFTokenizer

            t = HFTokenizer.from_str(self.tok.json_text)
            t.encode_special_tokens = False
            t.no_truncation()
            t.no_padding()
            self._hf = t
        return self._hf

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids uint32, offsets (n, 2) int64) of ``text``, no special tokens added."""
        enc = self.hf.encode(text, add_special_tokens=False)
        offs = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(enc.ids, dtype=np.uint32), offs

    def documents(
        self, docs: Sequence[tuple[str, Sequence[tuple[int, int]]]], eos_id: int, bos_id: int | None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`document` of each ``(text, spans)``, encoded as one batch (``encode_batch``:
        the same ids and offsets as one by one, on the tokenizer's thread pool)."""
        encs = self.hf.encode_batch([t for t, _ in docs], add_special_tokens=False)
        out = []
        for (text, spans), enc in zip(docs, encs):
            offs = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            out.append(self._stored(np.asarray(enc.ids, dtype=np.uint32), offs, text, spans, eos_id, bos_id))
        return out

    def document(
        self, text: str, spans: Sequence[tuple[int, int]], eos_id: int, bos_id: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The stored document ``[BOS] + ids + [EOS]`` (uint32) and its trained-on token ranges
        (document positions, :func:`mask_ranges`)."""
        ids, offs = self.encode(text)
        return self._stored(ids, offs, text, spans, eos_id, bos_id)

    @staticmethod
    def _stored(
        ids: np.ndarray,
        offs: np.ndarray,
        text: str,
        spans: Sequence[tuple[int, int]],
        eos_id: int,
        bos_id: int | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        trained = token_mask(offs, len(text), spans)
        head = [] if bos_id is None else [bos_id]
        tokens = np.concatenate([np.asarray(head, np.uint32), ids, np.asarray([eos_id], np.uint32)])
        mask = np.zeros(tokens.size, bool)
        mask[len(head) : len(head) + ids.size] = trained
        mask[-1] = bool(ids.size) and bool(trained[-1])
        mask[0] = False
        return tokens, mask_ranges(mask)
