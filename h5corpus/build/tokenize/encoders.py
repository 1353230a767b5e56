"""Encoders: text -> token ids. The reference (``tokenizers``) and the fast paths.

* :class:`HFEncoder` -- the reference, Hugging Face ``tokenizers``;
* :class:`FastokensEncoder` -- ``fastokens`` (Rust, PCRE2 JIT) on the same ``tokenizer.json``: the
  first fast path for every tokenizer it loads (byte-level BPE: GPT-2, Llama-3, Qwen style);
* :class:`TiktokenEncoder` -- a ``tiktoken`` encoding converted from a byte-level BPE
  ``tokenizer.json`` (:mod:`h5corpus.build.tokenize.tiktoken_bpe`);
* :class:`BytesEncoder` -- the ``bytes`` tokenizer, whose ids are the UTF-8 bytes;
* :class:`~h5corpus.build.tokenize.kitoken_encoder.KitokenEncoder` -- ``kitoken`` on the same
  ``tokenizer.json``: SentencePiece-style BPE and WordPiece, which fastokens refuses;
* :class:`~h5corpus.build.tokenize.unigram_encoder.UnigramEncoder` -- ``tokenizers``' own Unigram
  algorithm compiled with numba, for Unigram models behind ``Metaspace``.

:func:`fast_encoder` picks the first fast encoder that applies to a tokenizer, in the order of
:data:`FAST_ENCODERS`; none is used before :mod:`h5corpus.build.tokenize.proof` proved it emits the
reference's ids on the build's own input. :func:`encoder_named` rebuilds an encoder from its name
(the persisted plan records the name). docs/BUILD.md has the measured speeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any, Protocol

import numpy as np

from .kitoken_encoder import KitokenEncoder
from .tiktoken_bpe import cached_tiktoken, is_bytes_model, tiktoken_encoding, tiktoken_plan
from .tokenizer import Tokenizer, TokenizerError, load_facts, store_facts
from .unigram_encoder import UnigramEncoder

#: The fast encoders, in the order they are tried (each only where it applies: ``bytes`` for the
#: ``bytes`` tokenizer, ``fastokens`` where it loads the JSON, ``tiktoken`` for byte-level BPE,
#: ``kitoken`` for BPE and WordPiece models it loads, ``unigram`` for Unigram models behind Metaspace).
FAST_ENCODERS: tuple[str, ...] = ("bytes", "fastokens", "tiktoken", "kitoken", "unigram")


class Encoder(Protocol):
    """Turns texts into token ids (no EOS, no BOS, special-token text encoded as text)."""

    name: str
    fallbacks: int
    """Documents this object handed to the reference encoder because its own path raised (grows)."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One 1-D unsigned id array per text."""
        ...

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All ids in one 1-D unsigned array, and int64 offsets (``len(texts) + 1``): text ``i``'s
        ids are ``flat[offsets[i]:offsets[i + 1]]``."""
        ...


def flat_of(arrays: Sequence[np.ndarray], dtype: Any = np.uint32) -> tuple[np.ndarray, np.ndarray]:
    """``(flat, offsets)`` of per-text id arrays (the :meth:`Encoder.encode_flat` layout)."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays)), out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return flat, offsets


def split_flat(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Per-text views of an :meth:`Encoder.encode_flat` result."""
    return np.split(flat, offsets[1:-1]) if offsets.size > 1 else []


# -- the reference --------------------------------------------------------------------------------
class HFEncoder:
    """The reference: ``tokenizers`` with special-token matching off and no added special tokens.

    ``encode_batch`` uses ``encode_batch_fast``; set ``TOKENIZERS_PARALLELISM=false`` to keep it on
    one thread (the build does, in every worker).
    """

    name = "tokenizers"
    fallbacks = 0

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self.tok.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encs = self.tok.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        ids = [e.ids for e in encs]
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)), out=offsets[1:])
        return np.fromiter(chain.from_iterable(ids), dtype=np.uint32, count=int(offsets[-1])), offsets

    def encode_each(self, texts: Iterable[str]) -> list[np.ndarray]:
        """Like :meth:`encode_batch`, one text at a time (never starts the Rayon thread pool)."""
        hf = self.tok.hf
        return [np.asarray(hf.encode(t, add_special_tokens=False).ids, dtype=np.uint32) for t in texts]


# -- fastokens ------------------------------------------------------------------------------------
#: The pid of the process in which a fastokens thread pool was seen starting (None: never).
#: Module state on purpose: it is a fact about this process's copy of the native library. A
#: forked child inherits the pool without its threads, and fastokens then waits forever on work
#: handed to them; so a child must not use fastokens, and :func:`fast_encoder` does not offer
#: fastokens in a process that would fork workers after its pool started.
_POOL_STARTED_IN: int | None = None
#: Texts at least this long may make fastokens split them on its thread pool (it does from a few
#: hundred thousand characters on, with a PCRE2 split regex); only such batches are watched.
_WATCH_CHARS = 1 << 16
#: What fastokens' failures never include: these propagate.
_INTERRUPTS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - not Linux: workers are spawned, never forked
        return 0


def fastokens_on_one_thread() -> None:
    """Size fastokens' pools to one thread. The variables are read when a pool starts (the first
    encode that needs it) and the build parallelizes by processes: a pool of its own per worker
    would compete with the other workers for the same cores."""
    os.environ["FASTOKENS_BPE_THREADS"] = "1"
    os.environ["RAYON_NUM_THREADS"] = "1"


class FastokensEncoder:
    """``fastokens`` on the tokenizer's own JSON: ``encode_batch_flat(texts, add_special_tokens=False,
    split_special_tokens=True)``, so special-token text is encoded as text (like the reference).

    A batch it raises on (PCRE2 match or JIT-stack limits on pathological text) is encoded one
    text at a time; a text it raises on is encoded by the reference and counted in
    :attr:`fallbacks`. It runs on one thread (:func:`fastokens_on_one_thread`). Pickles as the
    tokenizer; the native object is rebuilt lazily.
    """

    name = "fastokens"

    def __init__(self, tok: Tokenizer, native: Any = None) -> None:
        self.tok = tok
        self._native = native
        self.fallbacks = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"tok": self.tok}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["tok"])

    @classmethod
    def load(cls, tok: Tokenizer) -> tuple[FastokensEncoder | None, str]:
        """(encoder, "") or (None, why fastokens cannot encode with this tokenizer)."""
        try:
            import fastokens
        except ImportError:
            return None, "fastokens is not installed"
        if _POOL_STARTED_IN == os.getpid():
            return None, "its thread pool already runs in this process, and workers forked from it could not use it"
        fastokens_on_one_thread()
        try:
            native = fastokens.Tokenizer.from_json_str(tok.json_text)
            native.no_truncation()
            native.no_padding()
        except Exception as e:  # unsupported normalizer / pre-tokenizer / model, bad regex, ...
            return None, f"fastokens refused the tokenizer ({_first_line(e)})"
        return cls(tok, native), ""

    @property
    def native(self) -> Any:
        if _POOL_STARTED_IN is not None and _POOL_STARTED_IN != os.getpid():
            raise TokenizerError(
                "fastokens started its thread pool in the process this one was forked from; a forked copy "
                "cannot use it (encode with fastokens only after forking, or pass fast_encoders=('tiktoken',))"
            )
        if self._native is None:
            enc, why = self.load(self.tok)
            if enc is None:
                raise TokenizerError(f"fastokens encoder unavailable for {self.tok.identity.name!r}: {why}")
            self._native = enc._native
        return self._native

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        global _POOL_STARTED_IN
        native = self.native
        texts = texts if isinstance(texts, list) else list(texts)
        watch = sys.platform.startswith("linux") and max(map(len, texts), default=0) >= _WATCH_CHARS
        before = _thread_count() if watch else 0
        try:
            ids, offs = native.encode_batch_flat(texts, add_special_tokens=False, split_special_tokens=True)
            flat, offsets = np.frombuffer(ids, dtype="<u4"), np.frombuffer(offs, dtype="<u8").astype(np.int64)
        except _INTERRUPTS:
            raise
        except BaseException:  # also a Rust panic (pyo3's PanicException is a BaseException)
            flat, offsets = self._one_by_one(native, texts)
        if watch and _POOL_STARTED_IN is None and _thread_count() > before:
            _POOL_STARTED_IN = os.getpid()
        return flat, offsets

    def _one_by_one(self, native: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        parts = []
        for t in texts:
            try:
                ids, _ = native.encode_batch_flat([t], add_special_tokens=False, split_special_tokens=True)
                parts.append(np.frombuffer(ids, dtype="<u4"))
            except _INTERRUPTS:
                raise
            except BaseException:
                parts.append(self.tok.encode(t))  # the reference; what it raises, the build reports
                self.fallbacks += 1
        return flat_of(parts)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return split_flat(*self.encode_flat(texts))

    def encode(self, text: str) -> np.ndarray:
        return self.encode_flat([text])[0]


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


# -- tiktoken, bytes ------------------------------------------------------------------------------
class TiktokenEncoder:
    """A ``tiktoken`` encoding built from a byte-level BPE ``tokenizer.json`` (ordinary encoding:
    special-token text is plain text). Pickles as the JSON; rebuilt lazily."""

    name = "tiktoken"
    fallbacks = 0

    def __init__(self, json_text: str) -> None:
        self.json_text = json_text
        self._enc: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"json_text": self.json_text}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["json_text"])

    @property
    def encoding(self):
        if self._enc is None:
            enc, why = _tiktoken_encoding_of(self.json_text)
            if enc is None:
                raise TokenizerError(f"tiktoken fast path unavailable: {why}")
            self._enc = enc
        return self._enc

    def encode(self, text: str) -> np.ndarray:
        return self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        enc = self.encoding
        none: set[str] = set()
        return [enc.encode_to_numpy(t, allowed_special=none, disallowed_special=()) for t in texts]

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return flat_of(self.encode_batch(texts))


class BytesEncoder:
    """Ids = the UTF-8 bytes (the ``bytes`` tokenizer's model, without the BPE machinery)."""

    name = "bytes"
    fallbacks = 0

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        datas = [t.encode("utf-8") for t in texts]
        offsets = np.zeros(len(datas) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, datas), dtype=np.int64, count=len(datas)), out=offsets[1:])
        return np.frombuffer(b"".join(datas), dtype=np.uint8), offsets


# -- choosing ---------------------------------------------------------------------------------------
def _structure(tok: Tokenizer) -> tuple[str | None, Any, str]:
    """The structural verdict on the bytes and tiktoken paths: (``"bytes"`` | ``"tiktoken"`` | None,
    the tiktoken encoding when it applies, why neither applies). Cached by the JSON's sha256 with the
    converted vocabulary, so a later build with the same tokenizer neither parses nor converts it."""
    sha = tok.identity.sha256
    verdict = load_facts(sha, "fast path")
    if verdict is not None:
        kind = verdict.get("kind")
        if kind == "bytes":
            return "bytes", None, ""
        if kind is None and isinstance(verdict.get("why"), str):
            return None, None, verdict["why"]
        cached = cached_tiktoken(sha, verdict)
        if cached is not None:
            return ("tiktoken", cached[0], "") if cached[0] is not None else (None, None, cached[1])
    if is_bytes_model(tok.json):
        store_facts(sha, "fast path", {"kind": "bytes"})
        return "bytes", None, ""
    enc, why = _tiktoken_encoding_of(tok.json_text, tok.json)
    return ("tiktoken", enc, "") if enc is not None else (None, None, why)


def _is_bytes(tok: Tokenizer) -> bool:
    """True for the ``bytes`` tokenizer's model (from the cached verdict when there is one)."""
    verdict = load_facts(tok.identity.sha256, "fast path")
    if verdict is not None and (verdict.get("kind") in ("bytes", "tiktoken") or isinstance(verdict.get("why"), str)):
        return verdict.get("kind") == "bytes"
    return _structure(tok)[0] == "bytes"


def _tiktoken_encoding_of(json_text: str, parsed: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The tiktoken encoding of a tokenizer JSON, or (None, why not); the verdict is cached."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:  # pragma: no cover - tiktoken is a dependency
        return None, "tiktoken is not installed"
    sha = hashlib.sha256(json_text.encode("utf-8")).hexdigest()
    cached = cached_tiktoken(sha, load_facts(sha, "fast path"))
    if cached is not None:
        return cached
    plan, ranks, why = tiktoken_plan(json.loads(json_text) if parsed is None else parsed, sha)
    if plan is None or ranks is None:
        store_facts(sha, "fast path", {"kind": None, "why": why})
        return None, why
    enc, why = tiktoken_encoding(plan, ranks)
    if enc is not None:
        store_facts(sha, "fast path", {"kind": "tiktoken", **plan})
    return enc, why


def _candidate(tok: Tokenizer, name: str) -> tuple[Encoder | None, str]:
    """The fast encoder ``name`` for ``tok``, or (None, why not; "" when not worth reporting)."""
    if name == "fastokens":
        return FastokensEncoder.load(tok)
    if name == "kitoken":
        return KitokenEncoder.load(tok)
    if name == "unigram":
        return UnigramEncoder.load(tok)
    if name not in ("bytes", "tiktoken"):
        raise ValueError(f"unknown fast encoder {name!r} (known: {', '.join(FAST_ENCODERS)})")
    if name == "bytes":
        return (BytesEncoder(), "") if _is_bytes(tok) else (None, "")
    kind, enc, why = _structure(tok)
    if enc is None:
        return None, "" if kind == "bytes" else why
    e = TiktokenEncoder(tok.json_text)
    e._enc = enc
    return e, ""


def fast_encoder(tok: Tokenizer, names: Sequence[str] | None = None) -> tuple[Encoder | None, str]:
    """The first of the fast encoders ``names`` (default :data:`FAST_ENCODERS`) that applies to
    ``tok`` (not yet proven), and why the ones before it do not (``"name: reason; ..."``)."""
    skipped = []
    for name in FAST_ENCODERS if names is None else names:
        enc, why = _candidate(tok, name)
        if enc is not None:
            return enc, "; ".join(skipped)
        if why:
            skipped.append(f"{name}: {why}")
    return None, "; ".join(skipped)


def encoder_named(tok: Tokenizer, name: str) -> Encoder:
    """The encoder called ``name`` (``tokenizers`` or one of :data:`FAST_ENCODERS`) for
    ``tok``; raises :class:`~h5corpus.build.tokenize.tokenizer.TokenizerError` when that fast path does not
    apply to it."""
    if name == HFEncoder.name:
        return HFEncoder(tok)
    fast, why = fast_encoder(tok, [name]) if name in FAST_ENCODERS else (None, f"unknown encoder {name!r}")
    if fast is None:
        raise TokenizerError(f"encoder {name!r} is not available for tokenizer {tok.identity.name!r}: {why}")
    return fast
