"""The ``kitoken`` fast encoder: SentencePiece-style BPE (Metaspace or the Llama-2 layout, byte
fallback) and BERT WordPiece ``tokenizer.json`` files, which fastokens refuses.

``kitoken`` (BSD-2-Clause, Rust) loads a ``tokenizer.json`` with ``Kitoken.from_tokenizers``. Like
every fast encoder it is used only after :mod:`h5corpus.build.tokenize.proof` proved it gives the
reference's ids on the build's own input. Two facts decide where it is offered:

* Unigram models are refused: where two segmentations of a text have equal scores (a run such as
  ``"...."`` split as ``"..." + "."`` or ``"." + "..."``), kitoken breaks the tie the other way
  round from ``tokenizers``. That is systematic, not rare input, so no sample proof is trusted with it.
* WordPiece behind ``BertNormalizer`` takes time quadratic in the CJK text of one call (about 50 ms
  for 8,000 ideographs, 80 s for a 377,000-character novel). Long texts are therefore encoded in
  pieces of about :data:`CHUNK_CHARS` characters cut just before a whitespace character or a CJK
  ideograph: ``BertPreTokenizer`` splits there anyway (whitespace separates words, and
  ``handle_chinese_chars`` isolates each ideograph), so the ids of the pieces, concatenated, are
  the ids of the whole text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from .tokenizer import PicklesAsJson, Tokenizer, TokenizerError

#: Target piece length, in characters, of a long text cut for a BERT-layout WordPiece tokenizer.
CHUNK_CHARS = 1024
#: What fails inside kitoken's call and is not a reason to stop the build.
_INTERRUPTS = (KeyboardInterrupt, SystemExit, GeneratorExit)
#: Rust's ``char::is_whitespace`` (Unicode White_Space), what ``BertPreTokenizer`` splits on. Not
#: Python's ``\s``, which also matches U+001C..U+001F, control characters BertNormalizer deletes.
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
#: The code points BertNormalizer's ``handle_chinese_chars`` surrounds with spaces (its exact ranges).
_CJK = (
    "\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f"
    "\U0002b920-\U0002ceaf\uf900-\ufaff\U0002f800-\U0002fa1f"
)
_CUT_WS = re.compile(f"[{_WHITESPACE}]")
_CUT_WS_CJK = re.compile(f"[{_WHITESPACE}{_CJK}]")


def cut_rule(d: dict[str, Any]) -> re.Pattern[str] | None:
    """The pattern of characters a long text may be cut before for kitoken (None: never cut).

    Only for WordPiece behind ``BertPreTokenizer`` with no normalizer or a ``BertNormalizer``
    (whitespace always; CJK ideographs too when ``handle_chinese_chars`` is on)."""
    model = (d.get("model") or {}).get("type")
    pre = (d.get("pre_tokenizer") or {}).get("type")
    norm = d.get("normalizer")
    if model != "WordPiece" or pre != "BertPreTokenizer":
        return None
    if norm is None:
        return _CUT_WS
    if norm.get("type") != "BertNormalizer":
        return None
    return _CUT_WS_CJK if norm.get("handle_chinese_chars", True) else _CUT_WS


def cut(text: str, rule: re.Pattern[str], chars: int = CHUNK_CHARS) -> list[str]:
    """``text`` in pieces of at least ``chars`` characters (the last may be shorter), each cut
    just before a match of ``rule``; one search per piece, never one per character."""
    pieces, a = [], 0
    while len(text) - a > chars:
        m = rule.search(text, a + chars)
        if m is None:
            break
        pieces.append(text[a : m.start()])
        a = m.start()
    pieces.append(text[a:])
    return pieces


def plain_specials(native: Any) -> None:
    """Make kitoken read special-token text as text, like the reference. With ``encode_specials``
    off it still cuts the text around each special token (``extract``) and encodes the parts apart,
    so ``"a</s>b"`` gave ``▁a ▁< / s > ▁b`` where ``tokenizers`` gives ``▁a < / s > b``."""
    d = native.definition()
    for special in d["specials"]:
        special["extract"] = False
    native.set_definition(d)


def _refusal(d: dict[str, Any]) -> str:
    """Why kitoken is not offered for this tokenizer JSON ("" when it is)."""
    model = (d.get("model") or {}).get("type")
    if model == "Unigram":
        return "kitoken breaks ties between equal-score Unigram segmentations unlike tokenizers"
    if model not in ("BPE", "WordPiece"):
        return f"model type {model!r} is not one kitoken is proven on"
    return ""


class KitokenEncoder(PicklesAsJson):
    """``kitoken`` on the tokenizer's own JSON, special-token text encoded as text
    (``encode_specials=False`` and :func:`plain_specials`), like the reference.

    A batch it raises on is encoded one text at a time; a text it raises on is encoded by the
    reference and counted in :attr:`fallbacks`. It runs on the calling thread (no pool, so forked
    workers may use it). Pickles as the tokenizer; the native object is rebuilt lazily.
    """

    name = "kitoken"

    def __init__(self, tok: Tokenizer, native: Any = None, json_text: str | None = None) -> None:
        self.tok = tok
        self.json_text = tok.json_text if json_text is None else json_text
        """The ``tokenizer.json`` kitoken loaded (the tokenizer's own unless a test gave another)."""
        self._native = native
        self._rule = cut_rule(tok.json)
        self.fallbacks = 0

    @classmethod
    def load(cls, tok: Tokenizer, json_text: str | None = None) -> tuple[KitokenEncoder | None, str]:
        """(encoder, "") or (None, why kitoken does not encode with this tokenizer). ``json_text``
        (default: the tokenizer's own) is what kitoken loads; tests give another to make it differ."""
        why = _refusal(tok.json)
        if why:
            return None, why
        try:
            import kitoken
        except ImportError:
            return None, "kitoken is not installed"
        try:
            native = kitoken.Kitoken.from_tokenizers((json_text or tok.json_text).encode("utf-8"))
            plain_specials(native)
        except _INTERRUPTS:
            raise
        except BaseException as e:  # unsupported normalizer / pre-tokenizer / model; a Rust panic
            return None, f"kitoken refused the tokenizer ({_first_line(e)})"
        return cls(tok, native, json_text), ""

    @property
    def native(self) -> Any:
        if self._native is None:
            enc, why = self.load(self.tok, self.json_text)
            if enc is None:
                raise TokenizerError(f"kitoken encoder unavailable for {self.tok.identity.name!r}: {why}")
            self._native = enc._native
        return self._native

    def _pieces(self, texts: list[str]) -> tuple[list[str], np.ndarray]:
        """The texts cut for kitoken, and int64 piece offsets (``len(texts) + 1``)."""
        counts = np.ones(len(texts), dtype=np.int64)
        if self._rule is None or max(map(len, texts), default=0) <= CHUNK_CHARS:
            return texts, np.arange(len(texts) + 1, dtype=np.int64)
        pieces: list[str] = []
        for i, t in enumerate(texts):
            cuts = cut(t, self._rule) if len(t) > CHUNK_CHARS else [t]
            counts[i] = len(cuts)
            pieces.extend(cuts)
        offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return pieces, offsets

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """kitoken's ids of whole texts (each cut and rejoined where the cut rule applies)."""
        pieces, at = self._pieces(texts)
        ids = self.native.encode_all(pieces, False)
        if len(pieces) == len(texts):
            return ids
        return [list(chain.from_iterable(ids[a:b])) for a, b in zip(at[:-1], at[1:])]

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        texts = texts if isinstance(texts, list) else list(texts)
        try:
            ids = self._encode_texts(texts)
        except _INTERRUPTS:
            raise
        except BaseException:  # also a Rust panic (pyo3's PanicException is a BaseException)
            ids = [self._one(t) for t in texts]
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)), out=offsets[1:])
        return np.fromiter(chain.from_iterable(ids), dtype=np.uint32, count=int(offsets[-1])), offsets

    def _one(self, text: str) -> Any:
        """One text's ids by kitoken, or by the reference (counted) when kitoken raises on it."""
        try:
            return self._encode_texts([text])[0]
        except _INTERRUPTS:
            raise
        except BaseException:
            self.fallbacks += 1
            return self.tok.encode(text)  # the reference; what it raises, the build reports

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        flat, offsets = self.encode_flat(texts)
        return np.split(flat, offsets[1:-1]) if offsets.size > 1 else []

    def encode(self, text: str) -> np.ndarray:
        return self.encode_flat([text])[0]


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
