"""The ``unigram`` fast encoder: Unigram ``tokenizer.json`` files behind a ``Metaspace`` pre-tokenizer
(the layout ``tokenizers`` trains and converts SentencePiece Unigram models to), which fastokens
refuses and kitoken encodes with other ids.

No library gives ``tokenizers``' Unigram ids exactly: kitoken and SentencePiece keep scores as
float32, and SentencePiece sums a whole text's path where ``tokenizers`` starts every word at 0.0, so
where two segmentations have (nearly) equal scores they pick another one (SentencePiece differed on
8 of 10,598 dev documents encoding whole texts, 1 encoding word by word; kitoken on 22). So this
encoder runs ``tokenizers``' own algorithm (``encode_optimized`` and ``tokenize``), ported line for
line to numba (:mod:`h5corpus.build.tokenize.unigram_kernel`): float64 scores read back from
``tokenizers`` itself (its serialization round-trips them exactly), the same trie order, the same
strict comparison, unknown-node fusion and byte fallback. What ``Metaspace`` does before the model is
done here per document: the tokenizer's own normalizer (``normalize_str``, when it has one), then
with ``str`` methods every ``" "`` becomes the replacement character, which is prepended
(``prepend_scheme`` ``always`` / ``first``) when the text does not start with it; the kernel splits
the UTF-8 bytes before each replacement character (``split=True``, ``MergedWithNext``) and encodes
each word from a zero score, as ``tokenizers`` does.

It is offered only where that is the whole pipeline (:func:`refusal`): a ``Unigram`` model with an
unknown token, a ``Metaspace`` pre-tokenizer that splits, and special added tokens only (the build
encodes special-token text as text, so ``tokenizers`` cuts none out and normalizes the whole
text). Like every fast encoder it is used only after :mod:`h5corpus.build.tokenize.proof` proved it equal to ``tokenizers`` on the
build's own input; a document it raises on (text that is not valid UTF-8, such as a lone
surrogate) goes to the reference and is counted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from .tokenizer import PicklesAsJson, Tokenizer, TokenizerError

#: What fails inside the kernel's call and is not a reason to stop the build.
_INTERRUPTS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def refusal(d: dict[str, Any]) -> str:
    """Why the ``unigram`` encoder is not offered for this tokenizer JSON ("" when it is)."""
    model = d.get("model") or {}
    if model.get("type") != "Unigram":
        return "not a Unigram model" if model.get("type") else "no model type"
    if model.get("unk_id") is None:
        return "the Unigram model has no unknown token"
    pre = d.get("pre_tokenizer") or {}
    if pre.get("type") != "Metaspace":
        return f"pre-tokenizer {pre.get('type')!r} is not Metaspace"
    if not pre.get("split", True):
        return "Metaspace with split=false"
    if _prepend(pre) is None:
        return f"Metaspace prepend_scheme {pre.get('prepend_scheme')!r}"
    if any(not t.get("special", False) for t in d.get("added_tokens") or ()):
        return "it has non-special added tokens (tokenizers cuts them out of the text)"
    return ""


def _prepend(pre: dict[str, Any]) -> bool | None:
    """Whether Metaspace prepends its replacement to a text (None: a scheme not ported). For a
    whole document ``first`` is ``always``: the text is one split, whose original offset is 0."""
    scheme = pre.get("prepend_scheme")
    if scheme is None:  # tokenizers < 0.19 wrote add_prefix_space
        return bool(pre.get("add_prefix_space", True))
    return {"always": True, "first": True, "never": False}.get(scheme)


class UnigramModel:
    """The arrays the kernel reads, from ``tokenizers``' own serialization of the model."""

    def __init__(self, tok: Tokenizer) -> None:
        from .unigram_kernel import UNK_PENALTY, build_trie, new_word_cache

        d = json.loads(tok.hf.to_str())  # scores as tokenizers holds them (serde writes them round-trip)
        model, pre = d["model"], d["pre_tokenizer"]
        vocab = model["vocab"]
        pieces = [p.encode("utf-8") for p, _ in vocab]
        scores = np.array([s for _, s in vocab], dtype=np.float64)
        self.trie = build_trie(pieces)
        term = self.trie[3]
        self.term_score = np.where(term >= 0, scores[np.maximum(term, 0)], 0.0)
        self.unk_id = int(model["unk_id"])
        self.unk_score = float(scores.min()) - UNK_PENALTY
        self.replacement = pre.get("replacement", "\u2581")
        self.sep = np.frombuffer(self.replacement.encode("utf-8"), dtype=np.uint8)
        self.prepend = bool(_prepend(pre))
        self.normalizer = tok.hf.normalizer  # None without one
        self.cache = new_word_cache()  # this process's (a forked worker gets a copy)
        ids = {p: i for i, (p, _) in enumerate(vocab)}  # the last id of a repeated piece, like tokenizers
        byte_ids = np.array([ids.get(f"<0x{b:02X}>", -1) for b in range(256)], dtype=np.int64)
        self.byte_ids = byte_ids if model.get("byte_fallback") else np.zeros(0, dtype=np.int64)

    def prepare(self, text: str) -> bytes:
        """``text`` as the kernel reads it: normalized, Metaspace's replacement and prefix, in UTF-8."""
        r = self.replacement
        t = text if self.normalizer is None else self.normalizer.normalize_str(text)
        t = t.replace(" ", r)
        if self.prepend and t and not t.startswith(r):
            t = r + t
        return t.encode("utf-8")

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        from .unigram_kernel import encode_docs

        datas = [self.prepare(t) for t in texts]
        doc_off = np.zeros(len(datas) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, datas), dtype=np.int64, count=len(datas)), out=doc_off[1:])
        buf = np.frombuffer(b"".join(datas), dtype=np.uint8)
        out = np.empty(max(buf.size, 1), dtype=np.uint32)
        offsets = np.zeros(len(datas) + 1, dtype=np.int64)
        args = (self.trie, self.term_score, self.unk_id, self.unk_score, self.byte_ids, self.cache)
        n = encode_docs(buf, doc_off, self.sep, *args, out, offsets)
        return out[:n].copy() if n < out.size // 2 else out[:n], offsets


class UnigramEncoder(PicklesAsJson):
    """The ``unigram`` fast encoder (the module docstring). A batch the kernel raises on is encoded
    one text at a time; a text it raises on is encoded by the reference and counted in
    :attr:`fallbacks`. Runs on the calling thread. Pickles as the tokenizer; the arrays are rebuilt
    lazily (in each worker)."""

    name = "unigram"

    def __init__(self, tok: Tokenizer, model: UnigramModel | None = None, json_text: str | None = None) -> None:
        self.tok = tok
        self.json_text = tok.json_text if json_text is None else json_text
        """The ``tokenizer.json`` the model is read from (the tokenizer's own unless a test gave another)."""
        self._model = model
        self.fallbacks = 0

    @classmethod
    def load(cls, tok: Tokenizer, json_text: str | None = None) -> tuple[UnigramEncoder | None, str]:
        """(encoder, "") or (None, why it does not encode with this Unigram tokenizer; "" for other
        models). ``json_text``
        (default: the tokenizer's own) is the model it runs; tests give another to make it differ."""
        source = tok if json_text is None or json_text == tok.json_text else Tokenizer(tok.identity, json_text)
        if (source.json.get("model") or {}).get("type") != "Unigram":
            return None, ""  # not worth reporting: the other encoders' models
        why = refusal(source.json)
        if why:
            return None, why
        try:
            import numba  # noqa: F401
        except ImportError:
            return None, "numba is not installed (pip install 'h5corpus[unigram]')"
        try:
            model = UnigramModel(source)
        except (ValueError, KeyError, TypeError) as e:
            return None, f"its model could not be read ({e})"
        # Compile (or load from numba's cache, ~0.5 s) here: the build loads the fast encoder
        # before it forks its workers, which then inherit the machine code.
        model.encode_flat(["warm up"])
        return cls(tok, model, json_text), ""

    @property
    def model(self) -> UnigramModel:
        if self._model is None:
            enc, why = self.load(self.tok, self.json_text)
            if enc is None:
                raise TokenizerError(f"unigram encoder unavailable for {self.tok.identity.name!r}: {why}")
            self._model = enc._model
        return self._model  # type: ignore[return-value]

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        texts = texts if isinstance(texts, list) else list(texts)
        model = self.model
        try:
            return model.encode_flat(texts)
        except _INTERRUPTS:
            raise
        except Exception:  # a text that is not valid UTF-8 (a lone surrogate)
            return self._one_by_one(model, texts)

    def _one_by_one(self, model: UnigramModel, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        parts = []
        for t in texts:
            try:
                parts.append(model.encode_flat([t])[0])
            except _INTERRUPTS:
                raise
            except Exception:
                self.fallbacks += 1
                parts.append(self.tok.encode(t))  # the reference; what it raises, the build reports
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)), out=offsets[1:])
        flat = np.concatenate(parts).astype(np.uint32, copy=False) if parts else np.zeros(0, dtype=np.uint32)
        return flat, offsets

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        flat, offsets = self.encode_flat(texts)
        return np.split(flat, offsets[1:-1]) if offsets.size > 1 else []

    def encode(self, text: str) -> np.ndarray:
        return self.encode_flat([text])[0]
