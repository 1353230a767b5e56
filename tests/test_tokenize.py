"""Tokenizer specs, identity, and the fast encoders' equality with ``tokenizers``."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from h5corpus.build.tokenize.encoders import BytesEncoder, TiktokenEncoder, fast_encoder
from h5corpus.build.tokenize.proof import prove_same_ids
from h5corpus.build.tokenize.tokenizer import (
    BYTES_REVISION,
    GPT2_REPO,
    GPT2_REVISION,
    TokenizerError,
    bytes_tokenizer_json,
    load_tokenizer,
)
from tests.helpers import bpe_tokenizer_json


def test_bytes_tokenizer_ids_are_utf8_bytes_with_eos_256():
    """`bytes`: id = UTF-8 byte, EOS = 256, vocab 257; identity = sha256 of its canonical JSON."""
    tok = load_tokenizer("bytes")
    text = "héllo <|endoftext|> 世界\x00 \r\n"
    assert tok.encode(text).tolist() == list(text.encode("utf-8"))
    ident = tok.identity
    assert (ident.name, ident.revision, ident.vocab_size, ident.eos_id) == ("bytes", BYTES_REVISION, 257, 256)
    assert ident.sha256 == hashlib.sha256(bytes_tokenizer_json().encode("utf-8")).hexdigest()
    assert load_tokenizer("bytes").identity == ident  # deterministic construction


def test_bytes_fast_path_equals_tokenizers_on_stdlib_text(stdlib_corpus_texts):
    """The raw-bytes fast path emits exactly the `tokenizers` ids on real text."""
    tok = load_tokenizer("bytes")
    fast, why = fast_encoder(tok)
    assert isinstance(fast, BytesEncoder), why
    assert prove_same_ids(tok.reference_encoder(), fast, stdlib_corpus_texts[:60]) is None


def test_special_token_text_is_encoded_as_plain_text(gpt2_json):
    """Literal `<|endoftext|>` in a document never becomes the EOS id, on either encoder."""
    tok = load_tokenizer(str(gpt2_json))
    text = "before<|endoftext|>after <|endoftext|>"
    ref = tok.encode(text)
    assert tok.eos_id == 50256 and 50256 not in ref.tolist()
    fast, _ = fast_encoder(tok, ["tiktoken"])
    assert isinstance(fast, TiktokenEncoder)
    assert fast.encode(text).tolist() == ref.tolist()
    assert tok.hf.decode(ref.tolist()) == text


def test_tokenizer_json_path_and_folder_give_one_identity(gpt2_json):
    """A path spec records the path, revision `local`, the file's sha256, vocab and EOS."""
    a = load_tokenizer(str(gpt2_json)).identity
    b = load_tokenizer(str(gpt2_json.parent)).identity
    assert a.sha256 == b.sha256 == hashlib.sha256(gpt2_json.read_bytes()).hexdigest()
    assert (a.revision, a.vocab_size, a.eos_id) == ("local", 50257, 50256)
    assert a.same_ids(b)


def test_gpt2_spec_loads_the_pinned_revision_from_the_hf_cache(tmp_path, gpt2_json):
    """`gpt2` = openai-community/gpt2 at the pinned revision, found in a local HF cache offline."""
    snap = tmp_path / "models--openai-community--gpt2" / "snapshots" / GPT2_REVISION
    snap.mkdir(parents=True)
    shutil.copy(gpt2_json, snap / "tokenizer.json")
    ident = load_tokenizer("gpt2", cache_dir=tmp_path).identity
    assert (ident.name, ident.revision) == (GPT2_REPO, GPT2_REVISION)
    assert ident.sha256 == hashlib.sha256(gpt2_json.read_bytes()).hexdigest()
    assert (ident.vocab_size, ident.eos_id) == (50257, 50256)


def test_gpt2_spec_not_cached_offline_is_a_clear_error(tmp_path, monkeypatch):
    """No silent fallback: an uncached `gpt2` offline names the revision and how to pass a path."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        TokenizerError, match=r"openai-community/gpt2@607a30d783df.*not in the Hugging Face cache.*--tokenizer"
    ):
        load_tokenizer("gpt2", cache_dir=tmp_path)


def test_bad_specs_name_the_problem(tmp_path):
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(str(bad))
    d = bpe_tokenizer_json([])
    d["added_tokens"] = []
    bad.write_text(json.dumps(d))
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        load_tokenizer(str(bad))


def test_tiktoken_fast_path_equals_tokenizers_on_the_whole_dev_corpus(gpt2_json, dev_texts, dev_gpt2_ids):
    """The proof the build's fast path rests on: tiktoken built from GPT-2's tokenizer.json gives
    the `tokenizers` ids on every one of the 10.6k dev documents (~10M tokens)."""
    tok = load_tokenizer(str(gpt2_json))
    fast, why = fast_encoder(tok, ["tiktoken"])
    assert isinstance(fast, TiktokenEncoder), why
    bad = [i for i, (t, ref) in enumerate(zip(dev_texts, dev_gpt2_ids)) if not np.array_equal(fast.encode(t), ref)]
    assert bad == [], f"{len(bad)} documents differ, first {bad[:5]}"
    assert sum(r.size for r in dev_gpt2_ids) > 9_000_000


def test_fast_path_refused_for_tokenizers_it_cannot_mirror(tmp_path):
    """Normalizers, prefix spaces and non-byte-level models have no fast path (tokenizers is used)."""
    for d, why in (
        (bpe_tokenizer_json([("a", "b")], normalizer={"type": "Lowercase"}), "normalizer"),
        (
            bpe_tokenizer_json(
                [("a", "b")],
                pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            ),
            "prefix space",
        ),
        (bpe_tokenizer_json([("b", "c"), ("a", "b")]), None),  # fine: merge order = id order
    ):
        p = tmp_path / "tokenizer.json"
        p.write_text(json.dumps(d))
        fast, reason = fast_encoder(load_tokenizer(str(p)), ["tiktoken"])
        if why is None:
            assert isinstance(fast, TiktokenEncoder)
        else:
            assert fast is None and why in reason


def test_proof_catches_a_plausible_fast_path_that_differs(tmp_path):
    """Merges a+b, b+c, a+bc: tokenizers gives [ab, c] for "abc", tiktoken's rank merging [abc].
    The structure looks eligible; only the proof on sample text can tell, and it does."""
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(bpe_tokenizer_json([("a", "b"), ("b", "c"), ("a", "bc")])))
    tok = load_tokenizer(str(p))
    fast, why = fast_encoder(tok, ["tiktoken"])
    assert isinstance(fast, TiktokenEncoder), why
    assert tok.encode("abc").tolist() == [256, ord("c")]
    assert fast.encode("abc").tolist() == [258]
    assert prove_same_ids(tok.reference_encoder(), fast, ["plain text"]) is None
    diff = prove_same_ids(tok.reference_encoder(), fast, ["the abc song"])
    assert diff is not None and "differs at token" in diff


def _abc_tokenizer(tmp_path):
    p = tmp_path / "abc" / "tokenizer.json"
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(bpe_tokenizer_json([("a", "b"), ("b", "c"), ("a", "bc")])))
    return p


def test_a_passed_proof_is_cached_and_a_failed_one_never(tmp_path, monkeypatch):
    """Re-proving the same texts with the same tokenizer is answered from the cache without loading
    `tokenizers`; other texts, a difference, a damaged cache entry or H5CORPUS_NO_CACHE prove again."""
    monkeypatch.setenv("H5CORPUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("H5CORPUS_NO_CACHE", raising=False)
    p = _abc_tokenizer(tmp_path)

    def prove(texts, **kw):
        tok = load_tokenizer(str(p))  # a fresh Tokenizer: `tokenizers` not loaded yet
        fast, why = fast_encoder(tok, ["tiktoken"])
        assert isinstance(fast, TiktokenEncoder), why
        return prove_same_ids(tok.reference_encoder(), fast, texts, **kw), tok._hf is not None

    assert prove(["plain text"]) == (None, True)  # first time: proven with tokenizers
    assert prove(["plain text"]) == (None, False)  # from the cache
    assert prove(["plain text", "more"]) == (None, True)  # another sample proves again
    assert prove(["plain text"], cache=False) == (None, True)
    for _ in range(2):  # a difference is found every time, never remembered
        diff, loaded = prove(["the abc song"])
        assert diff is not None and "differs at token" in diff and loaded
    entries = list((tmp_path / "cache" / "proofs").glob("*.json"))
    assert len(entries) == 2
    for e in entries:  # damaged entries are ignored, and rewritten by the proof that follows
        e.write_text(e.read_text().replace("same ids", "same idz"))
    assert prove(["plain text"]) == (None, True)
    assert prove(["plain text"]) == (None, False)
    monkeypatch.setenv("H5CORPUS_NO_CACHE", "1")
    assert prove(["plain text"]) == (None, True)


def test_the_proof_cache_key_covers_tokenizer_and_encoder(tmp_path, monkeypatch):
    """A verdict for one tokenizer is not reused for another one (here merges the fast path gets
    wrong), nor for a fast encoder built from another JSON than the reference."""
    monkeypatch.setenv("H5CORPUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("H5CORPUS_NO_CACHE", raising=False)
    good = tmp_path / "good" / "tokenizer.json"
    good.parent.mkdir()
    good.write_text(json.dumps(bpe_tokenizer_json([("b", "c"), ("a", "b")])))  # "abc" -> [a, bc] in both encoders
    bad = _abc_tokenizer(tmp_path)
    texts = ["the abc song"]
    tg, tb = load_tokenizer(str(good)), load_tokenizer(str(bad))
    assert prove_same_ids(tg.reference_encoder(), fast_encoder(tg, ["tiktoken"])[0], texts) is None
    assert prove_same_ids(tb.reference_encoder(), fast_encoder(tb, ["tiktoken"])[0], texts) is not None
    # reference = the bad tokenizer, candidate = the good tokenizer's (proven) encoder: not reused
    assert prove_same_ids(tb.reference_encoder(), fast_encoder(tg, ["tiktoken"])[0], texts) is not None


def test_cached_tiktoken_ranks_build_the_same_encoding(tmp_path, monkeypatch, stdlib_corpus_texts):
    """The ranks cache (keyed by the JSON's sha256 and this module's source, payload hashed) gives
    the ranks the conversion gives; a damaged file is ignored and rewritten."""
    from h5corpus.build.tokenize import tiktoken_bpe as tk

    monkeypatch.setenv("H5CORPUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("H5CORPUS_NO_CACHE", raising=False)
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(bpe_tokenizer_json([("a", "b"), ("b", "c"), ("Ġ", "t"), ("Ġt", "h"), ("e", "r")])))
    tok = load_tokenizer(str(p))
    sha = hashlib.sha256(p.read_bytes()).hexdigest()
    assert tk.load_ranks(sha) is None
    reference, _ = tk.tiktoken_from_json(tok.json)  # no sha: no ranks cache
    assert not (tmp_path / "cache" / "tiktoken").exists()
    first, _ = tk.tiktoken_from_json(tok.json, json_sha256=sha)  # converts and stores
    (f,) = (tmp_path / "cache" / "tiktoken").glob("*.ranks")
    cached = tk.load_ranks(sha)
    assert cached == reference._mergeable_ranks == first._mergeable_ranks
    second, _ = tk.tiktoken_from_json(tok.json, json_sha256=sha)
    assert second._mergeable_ranks == reference._mergeable_ranks
    text = "\n".join(stdlib_corpus_texts[:20]) + " the ab abc bc er"
    assert second.encode_ordinary(text) == reference.encode_ordinary(text)
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1  # flip a bit of the last token's bytes
    f.write_bytes(bytes(raw))
    assert tk.load_ranks(sha) is None
    third, _ = tk.tiktoken_from_json(tok.json, json_sha256=sha)
    assert third._mergeable_ranks == reference._mergeable_ranks and tk.load_ranks(sha) == cached


def test_cached_tokenizer_facts_give_the_same_identity_and_encoder(tmp_path, monkeypatch, stdlib_corpus_texts):
    """A second load of the same tokenizer JSON takes its identity (EOS id, vocabulary size) and the
    fast path's verdict from the facts cache without parsing the JSON, and gets the same identity
    and the same ids; a damaged or foreign facts file is ignored (the JSON is parsed again)."""

    monkeypatch.setenv("H5CORPUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("H5CORPUS_NO_CACHE", raising=False)
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(bpe_tokenizer_json([("a", "b"), ("b", "c"), ("Ġ", "t"), ("Ġt", "h"), ("e", "r")])))
    first = load_tokenizer(str(p))
    assert first._json is not None  # parsed
    fast1, why = fast_encoder(first, ["tiktoken"])
    assert fast1 is not None, why
    second = load_tokenizer(str(p))
    assert second._json is None and second.identity == first.identity  # from the cache, unparsed
    fast2, why = fast_encoder(second, ["tiktoken"])
    assert fast2 is not None and second._json is None, why
    text = "\n".join(stdlib_corpus_texts[:20]) + " the ab abc bc er <|endoftext|>"
    assert np.array_equal(fast2.encode(text), fast1.encode(text))
    assert np.array_equal(fast2.encode(text), second.encode(text))  # the reference agrees
    # another EOS choice is another key
    assert load_tokenizer(str(p), eos_token="<|endoftext|>")._json is not None
    for f in (tmp_path / "cache" / "facts").glob("*.json"):
        d = json.loads(f.read_text())
        d["fields"]["tokenizer_sha256"] = "0" * 64  # a file that is not this key's
        f.write_text(json.dumps(d))
    third = load_tokenizer(str(p))
    assert third._json is not None and third.identity == first.identity


def test_cached_ranks_equal_the_conversion_for_gpt2(tmp_path, monkeypatch, gpt2_json):
    """GPT-2's 50,257-entry vocabulary round-trips through the ranks cache exactly."""
    from h5corpus.build.tokenize import tiktoken_bpe as tk

    monkeypatch.setenv("H5CORPUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("H5CORPUS_NO_CACHE", raising=False)
    tok = load_tokenizer(str(gpt2_json))
    fresh, _ = tk.tiktoken_from_json(tok.json)
    fast_encoder(tok, ["tiktoken"])  # stores
    assert tk.load_ranks(tok.identity.sha256) == fresh._mergeable_ranks
    assert len(fresh._mergeable_ranks) == 50_256
