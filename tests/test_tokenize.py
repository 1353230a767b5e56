"""Tokenizer specs, identity, and the fast encoders' equality with ``tokenizers``."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from h5corpus.tokenize import (
    BYTES_REVISION, GPT2_REPO, GPT2_REVISION, BytesEncoder, TiktokenEncoder, TokenizerError,
    byte_level_alphabet, bytes_tokenizer_json, fast_encoder, load_tokenizer, prove_same_ids,
)


def _bpe_json(merges: list[tuple[str, str]], *, normalizer=None, pre_tokenizer=None) -> dict:
    """A byte-level BPE tokenizer.json: the 256 byte symbols, then one id per merge, then EOS."""
    alpha = byte_level_alphabet()
    vocab = {alpha[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    eos = len(vocab)
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": eos, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer or {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


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
    fast, _ = fast_encoder(tok)
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
    with pytest.raises(TokenizerError, match=r"openai-community/gpt2@607a30d783df.*not in the Hugging Face cache.*--tokenizer"):
        load_tokenizer("gpt2", cache_dir=tmp_path)


def test_bad_specs_name_the_problem(tmp_path):
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(str(bad))
    d = _bpe_json([])
    d["added_tokens"] = []
    bad.write_text(json.dumps(d))
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        load_tokenizer(str(bad))


def test_tiktoken_fast_path_equals_tokenizers_on_the_whole_dev_corpus(gpt2_json, dev_texts, dev_gpt2_ids):
    """The proof the build's fast path rests on: tiktoken built from GPT-2's tokenizer.json gives
    the `tokenizers` ids on every one of the 10.6k dev documents (~10M tokens)."""
    tok = load_tokenizer(str(gpt2_json))
    fast, why = fast_encoder(tok)
    assert isinstance(fast, TiktokenEncoder), why
    bad = [i for i, (t, ref) in enumerate(zip(dev_texts, dev_gpt2_ids)) if not np.array_equal(fast.encode(t), ref)]
    assert bad == [], f"{len(bad)} documents differ, first {bad[:5]}"
    assert sum(r.size for r in dev_gpt2_ids) > 9_000_000


def test_fast_path_refused_for_tokenizers_it_cannot_mirror(tmp_path):
    """Normalizers, prefix spaces and non-byte-level models have no fast path (tokenizers is used)."""
    for d, why in (
        (_bpe_json([("a", "b")], normalizer={"type": "Lowercase"}), "normalizer"),
        (_bpe_json([("a", "b")], pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}), "prefix space"),
        (_bpe_json([("b", "c"), ("a", "b")]), None),  # fine: merge order = id order
    ):
        p = tmp_path / "tokenizer.json"
        p.write_text(json.dumps(d))
        fast, reason = fast_encoder(load_tokenizer(str(p)))
        if why is None:
            assert isinstance(fast, TiktokenEncoder)
        else:
            assert fast is None and why in reason


def test_proof_catches_a_plausible_fast_path_that_differs(tmp_path):
    """Merges a+b, b+c, a+bc: tokenizers gives [ab, c] for "abc", tiktoken's rank merging [abc].
    The structure looks eligible; only the proof on sample text can tell, and it does."""
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(_bpe_json([("a", "b"), ("b", "c"), ("a", "bc")])))
    tok = load_tokenizer(str(p))
    fast, why = fast_encoder(tok)
    assert isinstance(fast, TiktokenEncoder), why
    assert tok.encode("abc").tolist() == [256, ord("c")]
    assert fast.encode("abc").tolist() == [258]
    assert prove_same_ids(tok.reference_encoder(), fast, ["plain text"]) is None
    diff = prove_same_ids(tok.reference_encoder(), fast, ["the abc song"])
    assert diff is not None and "differs at token" in diff
