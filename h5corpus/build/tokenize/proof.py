"""The proof that a fast encoder gives the reference's ids, and the choice among fast encoders.

:func:`prove_same_ids` compares a fast encoder with the reference (``tokenizers``) on
:data:`PROOF_TEXTS` and a sample of the build's own input. :func:`prove_fast_path` proves the build's
first fast encoder and, when it differs, the next ones in :data:`~h5corpus.build.tokenize.encoders.FAST_ENCODERS`
order, down to the reference. A *passed* proof is cached
(:func:`h5corpus.build.tokenize.tokenizer.cache_dir`) by everything its answer depends on, so re-running a
build on the same input does not load ``tokenizers`` and prove again; a failed proof is never cached.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .encoders import FAST_ENCODERS, BytesEncoder, Encoder, FastokensEncoder, HFEncoder, TiktokenEncoder, fast_encoder
from .kitoken_encoder import KitokenEncoder
from .tokenizer import cache_dir, library_versions, source_sha256, write_cache_file
from .unigram_encoder import UnigramEncoder

#: Strings every fast-path proof includes besides the build's own sample: whitespace runs,
#: contractions, digits, scripts, emoji, control characters, literal special-token text (GPT-2,
#: Llama-3, BERT, SentencePiece styles) and compatibility characters a normalizer would change.
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
    "'s 't 're 've 'm 'll 'd 'S 'T DON'T We'LL",
    "<|begin_of_text|><|end_of_text|><|eot_id|> [UNK] [SEP] [MASK] <unk> <0x41> ▁x",
    "ﬁ ﬂ ｆｕｌｌｗｉｄｔｈ ① Ⅻ ㎏ ǅ \u212a \u212b e\u0301",
    "12345678901234567890 1.2.3.4 0x1F -42",
    "\r\n\r\n  \t \n x\u00a0y\u2028z\u3000w",
    "runs.... ---- ==== !!!! ____ hahaha ababab ………",
    # longer than the pieces a WordPiece text is cut into for kitoken (kitoken_encoder.CHUNK_CHARS)
    "混合 text\x1c with\u3000ideographic 日本語の文 e\u0301 \u0301x \x1fcontrol\x1f \u0085next " * 40,
)

#: Format of the proof cache files (bump to invalidate every entry).
_PROOF_CACHE_FORMAT = "h5corpus-proof-1"


def _proof_key(reference: HFEncoder, candidate: Encoder, texts: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
    """(key, the fields it hashes) for a proof, or None when the inputs cannot be identified."""
    tok = getattr(reference, "tok", None)
    ident = getattr(tok, "identity", None)
    if ident is None or not getattr(ident, "sha256", None):
        return None
    cand_json = getattr(candidate, "json_text", None)
    if isinstance(candidate, FastokensEncoder):
        cand_json = candidate.tok.json_text
    if isinstance(candidate, (TiktokenEncoder, FastokensEncoder, KitokenEncoder, UnigramEncoder)):
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


def prove_fast_path(
    reference: HFEncoder,
    first: Encoder,
    texts: Iterable[str],
    *,
    names: Sequence[str] | None = None,
    cache: bool = True,
) -> tuple[Encoder, str]:
    """The encoder a build uses: ``first`` when :func:`prove_same_ids` finds it equal to the
    reference on ``texts``; else the next fast encoder after it in ``names`` (default
    :data:`~h5corpus.build.tokenize.encoders.FAST_ENCODERS`) that applies and proves equal; else the reference.
    Also returns a note naming each fast encoder that was disabled and why ("" when ``first`` won)."""
    texts = list(texts)
    order = list(FAST_ENCODERS if names is None else names)
    notes: list[str] = []
    cand: Encoder | None = first
    while cand is not None:
        diff = prove_same_ids(reference, cand, texts, cache=cache)
        if diff is None:
            return cand, "; ".join(notes)
        notes.append(f"fast path ({cand.name}) disabled: {diff}")
        rest = order[order.index(cand.name) + 1 :] if cand.name in order else []
        cand, why = fast_encoder(reference.tok, rest)
        if why:
            notes.append(f"not applicable: {why}")
    return reference, "; ".join(notes)
