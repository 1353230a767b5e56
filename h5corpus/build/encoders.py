"""Encoders: text -> token ids. The reference (``tokenizers``), the fast paths, and the proof that a
fast path gives the reference's ids.

For byte-level BPE tokenizers of the GPT-2 family :func:`fast_encoder` builds a ``tiktoken`` encoding
from the same ``tokenizer.json`` (vocab -> mergeable ranks, GPT-2 split regex); for the ``bytes``
tokenizer ids are the UTF-8 bytes themselves (docs/BUILD.md has the measured speeds). A fast encoder
is only used after :func:`prove_same_ids` found it emits exactly the reference ids on a sample (the
build does this at start, on its own input). A *passed* proof is cached
(:func:`h5corpus.build.tokenizer.cache_dir`) by everything its answer depends on, so re-running a
build on the same input does not load ``tokenizers`` and prove again; a failed proof is never cached.

:func:`encoder_named` rebuilds an encoder from its name (the persisted plan records the name).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .tokenizer import (
    Tokenizer,
    TokenizerError,
    byte_level_alphabet,
    cache_dir,
    library_versions,
    load_facts,
    source_sha256,
    store_facts,
    write_cache_file,
)

#: The GPT-2 pre-tokenizer split (the ``ByteLevel(use_regex=True)`` pattern; tiktoken's r50k/gpt2).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Strings every fast-path proof includes besides the build's own sample: whitespace runs,
#: contractions, digits, scripts, emoji, control characters and literal special-token text.
PROOF_TEXTS: tuple[str, ...] = (
    "Hello, world! It's 2026; we'd've said 'no'. I'LL GO.",
    "  leading and trailing spaces  \n\n\ttabs\t\r\nwindows\r\n   \n",
    "<|endoftext|>",
    "text <|endoftext|> inside<|endoftext|>text",
    "</s><s><pad>[CLS]",
    "numbers 1234567890 3.14159 1,000,000 ٣٤٥ ५६७",
    "Ünïcödé naïve café — “quotes” ‘single’ … ½ ² ™",
    "日本語のテキスト、吾輩は猫である。名前はまだ無い。",
    "한국어 텍스트입니다.",
    "Tiếng Việt có dấu.",
    "Ελληνικά κείμενα",
    "русский текст",
    "עברית",
    "العربية",
    "हिन्दी",
    "ภาษาไทย",
    "emoji 👍🏽 👨‍👩‍👧 🇺🇸 ✨",
    "\x00nul\x00 \x03etx \x1b[0m \u200b\ufeff\ufffd",
    "a" * 300 + " " + "ab" * 200,
    "\n" * 50,
    " " * 70 + "x",
    "'s 't 're 've 'm 'll 'd 'S 'T",
)

#: Format of the proof cache files (bump to invalidate every entry).
_PROOF_CACHE_FORMAT = "h5corpus-proof-1"


class Encoder(Protocol):
    """Turns texts into token ids (no EOS, no BOS, special-token text encoded as text)."""

    name: str

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One 1-D unsigned id array per text."""
        ...


# -- encoders -------------------------------------------------------------------------------------
class HFEncoder:
    """The reference: ``tokenizers`` with special-token matching off and no added special tokens.

    ``encode_batch`` uses ``encode_batch_fast``; set ``TOKENIZERS_PARALLELISM=false`` to keep it on
    one thread (the build does, in every worker).
    """

    name = "tokenizers"

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self.tok.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def encode_each(self, texts: Iterable[str]) -> list[np.ndarray]:
        """Like :meth:`encode_batch`, one text at a time (never starts the Rayon thread pool)."""
        hf = self.tok.hf
        return [np.asarray(hf.encode(t, add_special_tokens=False).ids, dtype=np.uint32) for t in texts]


class TiktokenEncoder:
    """A ``tiktoken`` encoding built from a byte-level BPE ``tokenizer.json`` (ordinary encoding:
    special-token text is plain text). Pickles as the JSON; rebuilt lazily."""

    name = "tiktoken"

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
            sha = hashlib.sha256(self.json_text.encode("utf-8")).hexdigest()
            cached = _cached_tiktoken(sha, load_facts(sha, "fast path"))
            enc, reason = cached or tiktoken_from_json(json.loads(self.json_text), json_sha256=sha)
            if enc is None:
                raise TokenizerError(f"tiktoken fast path unavailable: {reason}")
            self._enc = enc
        return self._enc

    def encode(self, text: str) -> np.ndarray:
        return self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        enc = self.encoding
        none: set[str] = set()
        return [enc.encode_to_numpy(t, allowed_special=none, disallowed_special=()) for t in texts]


class BytesEncoder:
    """Ids = the UTF-8 bytes (the ``bytes`` tokenizer's model, without the BPE machinery)."""

    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


def _split_pattern(pre: Any) -> tuple[str | None, str]:
    """The regex a byte-level pre-tokenizer splits with, or (None, why not)."""
    if not isinstance(pre, dict):
        return None, "no pre-tokenizer"
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space"):
            return None, "ByteLevel pre-tokenizer adds a prefix space"
        if pre.get("use_regex", True):
            return GPT2_PATTERN, ""
        return None, "ByteLevel pre-tokenizer without a split regex"
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        if (
            len(steps) == 2
            and steps[0].get("type") == "Split"
            and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True)
            and not steps[1].get("add_prefix_space")
            and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert")
            and "Regex" in (steps[0].get("pattern") or {})
        ):
            return steps[0]["pattern"]["Regex"], ""
        return None, "pre-tokenizer sequence is not Split(regex, Isolated) + ByteLevel"
    return None, f"pre-tokenizer {pre.get('type')!r} is not byte-level"


def _byte_level_ranks(model: Mapping[str, Any], added_contents: set[str]) -> tuple[dict[bytes, int] | None, str]:
    """tiktoken's mergeable ranks (token bytes -> id) of a byte-level BPE model, or (None, why not)."""
    # Byte-level symbol -> byte, as a str.translate table to latin-1 code points.
    table = {ord(c): b for b, c in byte_level_alphabet().items()}
    vocab = model.get("vocab") or {}
    outside = re.compile("[^" + re.escape("".join(byte_level_alphabet().values())) + "]")
    stray = outside.search("".join(t for t in vocab if t not in added_contents))
    if stray:
        return None, f"vocabulary has characters outside the byte-level alphabet (e.g. {stray.group()!r})"
    ranks: dict[bytes, int] = {}
    for tok, i in vocab.items():
        if tok in added_contents:
            continue
        try:
            ranks[tok.translate(table).encode("latin-1")] = int(i)
        except UnicodeEncodeError:
            return None, f"vocabulary entry {tok!r} is not byte-level"
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "vocabulary lacks some of the 256 byte symbols"
    if len(set(ranks.values())) != len(ranks):
        return None, "two vocabulary entries share an id"
    merges = model.get("merges") or []
    made = np.array(
        [vocab.get(m.replace(" ", "", 1) if isinstance(m, str) else m[0] + m[1], -1) for m in merges], dtype=np.int64
    ).reshape(-1)
    bad = np.flatnonzero((made < 0) | (np.diff(made, prepend=-1) <= 0))
    if bad.size:
        return None, f"merge {merges[int(bad[0])]!r} does not produce ids in merge order"
    return ranks, ""


#: Format of the mergeable-ranks cache files (bump to invalidate every entry).
_RANKS_CACHE_FORMAT = "h5corpus-ranks-1"


def _ranks_cache_path(json_sha256: str) -> tuple[Path, dict[str, str]] | None:
    d = cache_dir()
    if d is None:
        return None
    fields = {"format": _RANKS_CACHE_FORMAT, "tokenizer_sha256": json_sha256, "module_sha256": source_sha256()}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return d / "tiktoken" / f"{key}.ranks", fields


def _load_ranks(json_sha256: str) -> dict[bytes, int] | None:
    """Ranks cached for this tokenizer JSON and this module's source, or None (absent, unreadable,
    or not matching its key and payload hash: then it is rebuilt from the JSON)."""
    where = _ranks_cache_path(json_sha256)
    if where is None:
        return None
    path, fields = where
    try:
        raw = path.read_bytes()
        head, payload = raw.split(b"\n", 1)
        h = json.loads(head)
        n, nblob = int(h["n"]), int(h["blob"])
        if (
            h.get("fields") != fields
            or len(payload) != 8 * n + nblob
            or hashlib.sha256(payload).hexdigest() != h["sha256"]
        ):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ids = np.frombuffer(payload, dtype="<u4", count=n)
    ends = np.cumsum(np.frombuffer(payload, dtype="<u4", count=n, offset=4 * n), dtype=np.int64).tolist()
    blob = payload[8 * n :]
    return dict(zip([blob[a:b] for a, b in zip([0] + ends[:-1], ends)], ids.tolist()))


def _store_ranks(json_sha256: str, ranks: Mapping[bytes, int]) -> None:
    where = _ranks_cache_path(json_sha256)
    if where is None:
        return
    path, fields = where
    toks = list(ranks)
    payload = (
        np.fromiter(ranks.values(), dtype="<u4", count=len(toks)).tobytes()
        + np.fromiter(map(len, toks), dtype="<u4", count=len(toks)).tobytes()
        + b"".join(toks)
    )
    head = json.dumps(
        {
            "fields": fields,
            "n": len(toks),
            "blob": len(payload) - 8 * len(toks),
            "sha256": hashlib.sha256(payload).hexdigest(),
        },
        sort_keys=True,
    ).encode()
    write_cache_file(path, head + b"\n" + payload)


def _tiktoken_plan(
    d: dict[str, Any], json_sha256: str | None
) -> tuple[dict[str, Any] | None, dict[bytes, int] | None, str]:
    """The structural checks of :func:`tiktoken_from_json`: (plan, ranks, "") or (None, None, reason).
    A plan holds the split ``pattern`` and the ``special`` tokens (content -> id) to register."""
    model = d.get("model") or {}
    if model.get("type") != "BPE":
        return None, None, f"model is {model.get('type')!r}, not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return None, None, f"BPE option {key}={model.get(key)!r}"
    if model.get("byte_fallback"):
        return None, None, "BPE byte_fallback"
    if d.get("normalizer"):
        return None, None, f"normalizer {d['normalizer'].get('type')!r}"
    pattern, why = _split_pattern(d.get("pre_tokenizer"))
    if pattern is None:
        return None, None, why
    added = d.get("added_tokens") or []
    if any(not t.get("special") for t in added):
        return None, None, "non-special added tokens (matched inside text by tokenizers)"
    ranks = _load_ranks(json_sha256) if json_sha256 else None
    if ranks is None:
        ranks, why = _byte_level_ranks(model, {t["content"] for t in added})
        if ranks is None:
            return None, None, why
        if json_sha256:
            _store_ranks(json_sha256, ranks)
    # Special tokens are registered but never allowed, so their text is encoded as plain text
    # (encode_to_numpy with allowed_special=set()). At least one must exist: with none, tiktoken's
    # special-token scan uses an empty pattern and runs much slower (docs/BUILD.md, "Performance").
    used = set(ranks.values())
    special = {t["content"]: int(t["id"]) for t in added if int(t["id"]) not in used}
    if not special:
        special = {"<|h5corpus-unused-special|>": max(ranks.values()) + 1}
    return {"pattern": pattern, "special": special}, ranks, ""


def _tiktoken_encoding(plan: Mapping[str, Any], ranks: dict[bytes, int]):
    import tiktoken

    try:
        return tiktoken.Encoding(
            "h5corpus-bpe", pat_str=plan["pattern"], mergeable_ranks=ranks, special_tokens=dict(plan["special"])
        ), ""
    except Exception as e:  # e.g. a regex tiktoken's engine rejects
        return None, f"tiktoken rejected the encoding ({e})"


def tiktoken_from_json(d: dict[str, Any], *, json_sha256: str | None = None):
    """Build a ``tiktoken.Encoding`` equivalent in structure to a byte-level BPE tokenizer.json.

    Returns (encoding, "") or (None, reason). Structural requirements: BPE model without dropout,
    subword prefixes/suffixes or byte fallback; no normalizer; a GPT-2-style byte-level
    pre-tokenizer; every one of the 256 byte symbols in the vocabulary; each merge's result has a
    larger id than the previous merge's (tiktoken merges by rank = id); no non-special added tokens.
    Equality of ids is then proven empirically (:func:`prove_same_ids`), never assumed.

    ``json_sha256`` (the sha256 of the JSON text ``d`` was parsed from) enables the ranks cache
    (:func:`~h5corpus.build.tokenizer.cache_dir`): the vocabulary conversion and its checks, a pure
    function of the JSON and of the source, are then loaded instead of redone (docs/BUILD.md).
    """
    try:
        import tiktoken  # noqa: F401
    except ImportError:  # pragma: no cover - tiktoken is a dependency
        return None, "tiktoken is not installed"
    plan, ranks, why = _tiktoken_plan(d, json_sha256)
    if plan is None or ranks is None:
        return None, why
    return _tiktoken_encoding(plan, ranks)


def _bytes_model(d: dict[str, Any]) -> bool:
    """True when ``d`` is the ``bytes`` tokenizer's model: ids are the UTF-8 bytes themselves."""
    model = d.get("model") or {}
    vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else {}
    if model.get("type") == "BPE" and not model.get("merges") and not d.get("normalizer"):
        pre = d.get("pre_tokenizer") or {}
        alphabet = byte_level_alphabet()
        return bool(
            pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space")
            and all(vocab.get(alphabet[b]) == b for b in range(256))
            and not any(not t.get("special") for t in d.get("added_tokens") or [])
        )
    return False


def _cached_tiktoken(json_sha256: str, verdict: Mapping[str, Any] | None) -> tuple[Any, str] | None:
    """(encoding or None, why) from a cached tiktoken verdict and cached ranks; None when either
    is not cached (the JSON must then be parsed and converted)."""
    if verdict is None or verdict.get("kind") != "tiktoken":
        return None
    ranks = _load_ranks(json_sha256)
    return None if ranks is None else _tiktoken_encoding(verdict, ranks)


def fast_encoder(tok: Tokenizer) -> tuple[Encoder | None, str]:
    """A faster encoder structurally equivalent to ``tok`` (not yet proven), or (None, why not).

    The structural verdict is cached (:func:`cache_dir`) by the JSON's sha256 with the converted
    vocabulary, so a later build with the same tokenizer neither parses its JSON nor converts it."""
    sha = tok.identity.sha256
    verdict = load_facts(sha, "fast path")
    cached = _cached_tiktoken(sha, verdict)
    if cached is not None:
        enc, why = cached
        if enc is None:
            return None, why
        e = TiktokenEncoder(tok.json_text)
        e._enc = enc
        return e, ""
    if verdict is not None and verdict.get("kind") == "bytes":
        return BytesEncoder(), ""
    elif verdict is not None and verdict.get("kind") is None and isinstance(verdict.get("why"), str):
        return None, verdict["why"]
    d = tok.json
    if _bytes_model(d):
        store_facts(sha, "fast path", {"kind": "bytes"})
        return BytesEncoder(), ""
    try:
        import tiktoken  # noqa: F401
    except ImportError:  # pragma: no cover - tiktoken is a dependency
        return None, "tiktoken is not installed"
    plan, ranks, why = _tiktoken_plan(d, sha)
    if plan is None or ranks is None:
        store_facts(sha, "fast path", {"kind": None, "why": why})
        return None, why
    enc, why = _tiktoken_encoding(plan, ranks)
    if enc is None:
        return None, why
    store_facts(sha, "fast path", {"kind": "tiktoken", **plan})
    e = TiktokenEncoder(tok.json_text)
    e._enc = enc
    return e, ""


def _proof_key(reference: HFEncoder, candidate: Encoder, texts: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
    """(key, the fields it hashes) for a proof, or None when the inputs cannot be identified."""
    tok = getattr(reference, "tok", None)
    ident = getattr(tok, "identity", None)
    if ident is None or not getattr(ident, "sha256", None):
        return None
    cand_json = getattr(candidate, "json_text", None)
    if isinstance(candidate, TiktokenEncoder):
        if cand_json is None or hashlib.sha256(cand_json.encode("utf-8")).hexdigest() != ident.sha256:
            return None  # built from another JSON than the reference: do not guess
    elif not isinstance(candidate, BytesEncoder):
        return None  # an encoder this module does not know: always prove
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    fields = {
        "format": _PROOF_CACHE_FORMAT,
        "tokenizer_sha256": ident.sha256,
        "candidate": candidate.name,
        "texts": len(texts),
        "texts_sha256": h.hexdigest(),
        "module_sha256": source_sha256(),
        **library_versions(),
    }
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return key, fields


def _proof_cached(key: str, fields: Mapping[str, Any]) -> bool:
    d = cache_dir()
    if d is None:
        return False
    try:
        got = json.loads((d / "proofs" / f"{key}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(got, dict) and got.get("fields") == dict(fields) and got.get("verdict") == "same ids"


def _remember_proof(key: str, fields: Mapping[str, Any]) -> None:
    d = cache_dir()
    if d is None:
        return
    write_cache_file(
        d / "proofs" / f"{key}.json",
        json.dumps({"fields": dict(fields), "verdict": "same ids"}, sort_keys=True).encode("utf-8"),
    )


def prove_same_ids(reference: HFEncoder, candidate: Encoder, texts: Iterable[str], *, cache: bool = True) -> str | None:
    """Compare ``candidate`` with the reference on every text (and :data:`PROOF_TEXTS`).

    Returns None when all ids are equal, else a description of the first difference.

    With ``cache`` (default), a proof that passed before on exactly these texts, with the same
    tokenizer, encoder, library versions and module source, is not run again (see
    :func:`cache_dir`); ``tokenizers`` is then not even loaded. A difference is never cached.
    """
    texts = list(PROOF_TEXTS) + list(texts)
    keyed = _proof_key(reference, candidate, texts) if cache else None
    if keyed is not None and _proof_cached(*keyed):
        return None
    ref = reference.encode_each(texts)
    got = candidate.encode_batch(texts)
    for i, (a, b) in enumerate(zip(ref, got)):
        if a.shape != b.shape or not np.array_equal(a, b.astype(np.uint32, copy=False)):
            n = min(a.size, b.size)
            k = int(np.argmax(a[:n] != b[:n])) if n and (a[:n] != b[:n]).any() else n
            return (
                f"sample text {i} ({texts[i][:40]!r}...) differs at token {k}: tokenizers gives "
                f"{a[k : k + 4].tolist()}, {candidate.name} gives {b[k : k + 4].tolist()}"
            )
    if keyed is not None:
        _remember_proof(*keyed)
    return None


def encoder_named(tok: Tokenizer, name: str) -> Encoder:
    """The encoder called ``name`` (``tokenizers``, ``tiktoken``, ``bytes``) for ``tok``; raises
    :class:`~h5corpus.build.tokenizer.TokenizerError` when that fast path does not apply to it."""
    if name == HFEncoder.name:
        return HFEncoder(tok)
    fast, why = fast_encoder(tok)
    if fast is None or fast.name != name:
        raise TokenizerError(f"encoder {name!r} is not available for tokenizer {tok.identity.name!r}: {why or fast}")
    return fast
