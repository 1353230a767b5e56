"""The tiktoken fast path's construction: a ``tiktoken.Encoding`` from a byte-level BPE
``tokenizer.json`` (vocabulary -> mergeable ranks, the pre-tokenizer's split regex), its structural
checks, and the cache of converted vocabularies. :class:`h5corpus.build.tokenize.encoders.TiktokenEncoder`
uses it; the proof that it gives the reference ids is in :mod:`h5corpus.build.tokenize.encoders`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .tokenizer import byte_level_alphabet, cache_dir, source_sha256, write_cache_file

#: The GPT-2 pre-tokenizer split (the ``ByteLevel(use_regex=True)`` pattern; tiktoken's r50k/gpt2).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


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


def load_ranks(json_sha256: str) -> dict[bytes, int] | None:
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


def tiktoken_plan(
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
    ranks = load_ranks(json_sha256) if json_sha256 else None
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


def tiktoken_encoding(plan: Mapping[str, Any], ranks: dict[bytes, int]):
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
    (:func:`~h5corpus.build.tokenize.tokenizer.cache_dir`): the vocabulary conversion and its checks, a pure
    function of the JSON and of the source, are then loaded instead of redone (docs/BUILD.md).
    """
    try:
        import tiktoken  # noqa: F401
    except ImportError:  # pragma: no cover - tiktoken is a dependency
        return None, "tiktoken is not installed"
    plan, ranks, why = tiktoken_plan(d, json_sha256)
    if plan is None or ranks is None:
        return None, why
    return tiktoken_encoding(plan, ranks)


def is_bytes_model(d: dict[str, Any]) -> bool:
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


def cached_tiktoken(json_sha256: str, verdict: Mapping[str, Any] | None) -> tuple[Any, str] | None:
    """(encoding or None, why) from a cached tiktoken verdict and cached ranks; None when either
    is not cached (the JSON must then be parsed and converted)."""
    if verdict is None or verdict.get("kind") != "tiktoken":
        return None
    ranks = load_ranks(json_sha256)
    return None if ranks is None else tiktoken_encoding(verdict, ranks)
