"""The fast encoders on tokenizer families trained here with `tokenizers` itself: fastokens where it
loads the JSON (byte-level BPE like GPT-2 and Llama-3, and the Llama-2 layout), kitoken where
fastokens refuses it (SentencePiece-style BPE, BERT WordPiece), the numba port of `tokenizers`'
Unigram algorithm for Metaspace Unigram,
the proof catching a fast encoder that differs, documents a fast encoder raises on, one thread per
worker, shard bytes that do not depend on the encoder (the synthetic families and the dev corpus
with GPT-2), every family on the dev corpus and hostile text, and every family from the CLI.

Every id is compared with `tokenizers` called directly (``tests.helpers.reference_ids``). No test
here encodes a text of more than 64 K characters with fastokens in the test process: a fastokens
thread pool started here would make the build's forked workers refuse fastokens (see
``h5corpus.build.tokenize.encoders``); long texts go through builds, whose workers encode them.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from h5corpus.build import BuildConfig, build_corpus, format_report
from h5corpus.build.tokenize.encoders import FastokensEncoder, HFEncoder, fast_encoder
from h5corpus.build.tokenize.kitoken_encoder import CHUNK_CHARS, KitokenEncoder, cut, cut_rule
from h5corpus.build.tokenize.proof import PROOF_TEXTS, prove_fast_path, prove_same_ids
from h5corpus.build.tokenize.tokenizer import Tokenizer, load_tokenizer
from h5corpus.build.tokenize.unigram_encoder import UnigramEncoder
from tests.helpers import (
    DEEP_PATTERN,
    TOKENIZER_FAMILIES,
    read_built,
    reference_ids,
    stdlib_texts,
    subprocess_env,
    train_tokenizer_family,
    tree,
    with_split_pattern,
    write_jsonl,
)

#: Byte-level BPE families: fastokens loads them and tiktoken mirrors them. fastokens also loads
#: the Llama-2 layout (:data:`FASTOKENS_LOADS`); the reason it gives for refusing the others.
LOADS = ("gpt2_bpe", "llama3_bpe")
FASTOKENS_LOADS = (*LOADS, "llama2_bpe")
REFUSES = {
    "sentencepiece_bpe": "unsupported normalizer type: NFKC",
    "bert_wordpiece": "unsupported normalizer type: BertNormalizer",
    "metaspace_unigram": "unsupported pre-tokenizer type: Metaspace",
}
SPECIAL_TEXT = "special tokens as text: <|endoftext|> <|end_of_text|> </s> [SEP] <unk> <0x41>"
#: The encoder a build of each family runs, and the one it falls back to when that one differs.
FIRST = {
    "gpt2_bpe": "fastokens",
    "llama3_bpe": "fastokens",
    "llama2_bpe": "fastokens",
    "sentencepiece_bpe": "kitoken",
    "bert_wordpiece": "kitoken",
    "metaspace_unigram": "unigram",
}
AFTER_FASTOKENS = {
    "gpt2_bpe": "tiktoken",
    "llama3_bpe": "tiktoken",
    **dict.fromkeys(("llama2_bpe", "sentencepiece_bpe", "bert_wordpiece"), "kitoken"),
    "metaspace_unigram": "unigram",
}


@pytest.fixture(scope="module")
def held_out() -> list[str]:
    """Text that ships with Python, not seen in training (odd files), plus the proof's edge cases."""
    texts = stdlib_texts(limit=1000)
    return [t[:20_000] for t in texts[1::2]] + list(PROOF_TEXTS) + [SPECIAL_TEXT]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    """family -> tokenizer.json trained by `tokenizers` on the standard library's even files."""
    root = tmp_path_factory.mktemp("families")
    train = stdlib_texts(limit=1000)[0::2]
    train_text, n = [], 0
    for t in train:
        train_text.append(t)
        n += len(t)
        if n > 600_000:
            break
    out = {}
    for fam in TOKENIZER_FAMILIES:
        p = root / fam / "tokenizer.json"
        p.parent.mkdir()
        p.write_text(train_tokenizer_family(fam, train_text), encoding="utf-8")
        out[fam] = p
    return out


def _cfg(root: Path, sources, tokenizer: Path, **kw) -> BuildConfig:
    kw.setdefault("workers", 2)
    kw.setdefault("task_bytes", 150_000)
    kw.setdefault("validation_fraction", 0.0)
    return BuildConfig(
        sources=[str(s) for s in sources],
        tokenizer=str(tokenizer),
        shards_dir=root / "shards",
        manifest=root / "manifests" / "shards.json",
        chunk_tokens=1 << 14,
        shard_tokens=200_000,
        **kw,
    )


def _check_stored(manifest: Path, texts: list[str], tokenizer_json: str, eos: int) -> None:
    """All documents in ``train``, in input order: ids = sha256 of the text (its first 128 bits, as
    format v3 stores them), tokens = the `tokenizers` ids + EOS (texts are distinct and non-empty)."""
    got = read_built(manifest)["train"]
    assert [d[0] for d in got] == [hashlib.sha256(t.encode()).digest()[:16] for t in texts]
    for (_, toks, flags), ref in zip(got, reference_ids(tokenizer_json, texts)):
        assert flags == 0 and np.array_equal(toks.astype(np.int64), np.append(ref, eos))


# -- fastokens where it loads ---------------------------------------------------------------------
@pytest.mark.parametrize("family", FASTOKENS_LOADS)
def test_fastokens_loads_byte_level_families_and_gives_the_tokenizers_ids(families, held_out, family):
    """Byte-level BPE (GPT-2 style, and Llama-3 style behind a `Split` regex): fastokens is the
    first fast encoder, and its ids equal `tokenizers`' on unseen text, edge cases and literal
    special-token text (encoded as text), through both the flat and the per-text results."""
    tok = load_tokenizer(str(families[family]))
    fast, why = fast_encoder(tok)
    assert isinstance(fast, FastokensEncoder) and why == "", why
    flat, offsets = fast.encode_flat(held_out)
    assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] == flat.size
    refs = reference_ids(tok.json_text, held_out)
    got = [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    assert [i for i, (a, b) in enumerate(zip(refs, got)) if not np.array_equal(a, b)] == []
    assert [a.tolist() for a in fast.encode_batch(held_out[:5])] == [r.tolist() for r in refs[:5]]
    assert tok.eos_id not in flat.tolist() and fast.fallbacks == 0
    assert prove_same_ids(HFEncoder(tok), fast, held_out[:20], cache=False) is None


@pytest.mark.parametrize("family", FASTOKENS_LOADS)
def test_fastokens_equals_tokenizers_on_unseen_dev_documents(families, dev_texts, family):
    """3,000 dev documents (news, books, web, many scripts) none of which the family was trained on."""
    texts = [t for t in dev_texts[::3] if len(t) < 60_000][:3000]
    tok = load_tokenizer(str(families[family]))
    fast, _ = fast_encoder(tok, ["fastokens"])
    got = fast.encode_batch(texts)
    refs = reference_ids(tok.json_text, texts)
    assert len(texts) == 3000
    assert [i for i, (a, b) in enumerate(zip(refs, got)) if not np.array_equal(a, b)] == []


# -- a clean fallback where it refuses ----------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(REFUSES))
def test_fastokens_refuses_the_other_families_and_the_build_falls_back(tmp_path, families, held_out, family):
    """SentencePiece BPE, WordPiece, Unigram: fastokens refuses the JSON at load (its reason is
    reported), tiktoken does not apply, and a build offered only those two runs on `tokenizers`
    with exact ids."""
    tok = load_tokenizer(str(families[family]))
    enc, why = FastokensEncoder.load(tok)
    assert enc is None and REFUSES[family] in why
    fast, why_all = fast_encoder(tok, ["fastokens", "tiktoken"])
    assert fast is None and why_all.startswith("fastokens: fastokens refused the tokenizer (")
    assert REFUSES[family] in why_all and "; tiktoken: " in why_all
    texts = list(dict.fromkeys(t for t in held_out[:40] if t))
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    rep = build_corpus(_cfg(tmp_path / "o", [src], families[family], fast_encoders=("fastokens", "tiktoken")))
    assert rep.encoder == "tokenizers" and REFUSES[family] in rep.encoder_note
    assert "note: fast path not applicable: fastokens: fastokens refused the tokenizer (" in format_report(rep)
    _check_stored(tmp_path / "o" / "manifests" / "shards.json", texts, tok.json_text, tok.eos_id)


# -- the proof catches a fast encoder that differs ------------------------------------------------
def _altered(tok: Tokenizer) -> Tokenizer:
    """The same identity with a JSON whose vocabulary swaps the ids of two frequent merges: a
    fastokens built from it loads fine and gives other ids."""
    d = json.loads(tok.json_text)
    vocab = d["model"]["vocab"]
    a, b = ("".join(m) if isinstance(m, list) else m.replace(" ", "", 1) for m in d["model"]["merges"][:2])
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return Tokenizer(tok.identity, json.dumps(d))


@pytest.mark.parametrize("family", TOKENIZER_FAMILIES)
def test_the_proof_catches_a_fastokens_that_differs(families, held_out, family):
    """A fastokens that gives other ids than the reference is caught on ordinary text, never
    taken from the proof cache, and the choice moves on: to tiktoken for byte-level BPE, to kitoken
    for SentencePiece-style BPE and WordPiece, to the unigram encoder for Unigram (each proves equal). For
    families fastokens refuses, the differing candidate is fastokens on the GPT-2-style family's
    JSON (a plausible wrong mirror)."""
    tok = load_tokenizer(str(families[family]))
    wrong_json = _altered(tok) if family in FASTOKENS_LOADS else load_tokenizer(str(families["gpt2_bpe"]))
    wrong, why = FastokensEncoder.load(wrong_json)
    assert wrong is not None, why
    for _ in range(2):  # a difference is found every time (never cached)
        diff = prove_same_ids(HFEncoder(tok), wrong, held_out[:30])
        assert diff is not None and "differs at token" in diff and "fastokens gives" in diff
    chosen, note = prove_fast_path(HFEncoder(tok), wrong, held_out[:30])
    assert "fast path (fastokens) disabled" in note
    assert chosen.name == AFTER_FASTOKENS[family], note
    assert [a.tolist() for a in chosen.encode_batch(held_out)] == [
        r.tolist() for r in reference_ids(tok.json_text, held_out)
    ]


# -- the shard bytes do not depend on the encoder ----------------------------------------------------
def _family_inputs(tmp_path: Path, held_out: list[str]) -> tuple[Path, list[str]]:
    # Without literal "</s>": a Unigram model holds its special tokens as ordinary pieces and
    # `tokenizers` itself then emits the EOS id for that text, which the shard writer refuses.
    texts = list(dict.fromkeys(t for t in held_out if t and "</s>" not in t))
    texts += [
        SPECIAL_TEXT.replace("</s>", "") + " again",
        "many words " * 9000,
    ]  # one > 64 K characters, encoded by a worker
    return write_jsonl(tmp_path / "in.jsonl", texts), texts


@pytest.mark.parametrize("family", TOKENIZER_FAMILIES)
def test_shard_bytes_are_identical_whichever_encoder_runs(tmp_path, families, held_out, family):
    """The same build with fastokens, with tiktoken, with kitoken, with the unigram encoder and on
    `tokenizers` (each family where each applies and proves equal; the others fall back to
    `tokenizers` cleanly): identical shard and manifest bytes, the reference ids in them, and the
    report naming the encoder that ran."""
    src, texts = _family_inputs(tmp_path, held_out)
    trees, encoders = [], []
    for name, kw in (
        ("fastokens", {"fast_encoders": ("fastokens",)}),
        ("tiktoken", {"fast_encoders": ("tiktoken",)}),
        ("kitoken", {"fast_encoders": ("kitoken",)}),
        ("unigram", {"fast_encoders": ("unigram",)}),
        ("tokenizers", {"fast_path": False}),
    ):
        rep = build_corpus(_cfg(tmp_path / name, [src], families[family], **kw))
        trees.append(tree(tmp_path / name))
        encoders.append(rep.encoder)
    assert trees[0] == trees[1] == trees[2] == trees[3] == trees[4]
    want = [
        "fastokens" if family in FASTOKENS_LOADS else "tokenizers",
        "tiktoken" if family in LOADS else "tokenizers",
        "tokenizers" if family == "metaspace_unigram" else "kitoken",
        "unigram" if family == "metaspace_unigram" else "tokenizers",
        "tokenizers",
    ]
    if family in LOADS:  # kitoken is offered for byte-level BPE, and the proof decides (it differs on rare text)
        want[2] = encoders[2] if encoders[2] in ("kitoken", "tokenizers") else "kitoken"
    assert encoders == want
    tok = load_tokenizer(str(families[family]))
    _check_stored(tmp_path / "tokenizers" / "manifests" / "shards.json", texts, tok.json_text, tok.eos_id)
    manifest = json.loads((tmp_path / "fastokens" / "manifests" / "shards.json").read_text())
    assert all(name not in json.dumps(manifest) for name in ("fastokens", "tiktoken", "kitoken", '"unigram"'))


def test_dev_corpus_gpt2_shards_are_identical_with_fastokens_tiktoken_and_tokenizers(tmp_path, dev_dir, gpt2_json):
    """The whole dev corpus (~10 M GPT-2 tokens, 2 workers) three times: the same bytes."""
    trees = {}
    for name, kw in (
        ("fastokens", {}),
        ("tiktoken", {"fast_encoders": ("tiktoken",)}),
        ("tokenizers", {"fast_path": False}),
    ):
        root = tmp_path / name
        rep = build_corpus(
            BuildConfig(
                sources=[str(dev_dir)],
                tokenizer=str(gpt2_json),
                workers=2,
                shards_dir=root / "shards",
                manifest=root / "manifests" / "shards.json",
                **kw,
            )
        )
        assert rep.encoder == name and rep.encoder_fallbacks == 0
        trees[name] = tree(root)
    assert trees["fastokens"] == trees["tiktoken"] == trees["tokenizers"]
    assert len(trees["fastokens"]) > 20


# -- documents fastokens raises on ---------------------------------------------------------------------
def test_documents_fastokens_raises_on_are_encoded_by_tokenizers_counted_and_reported(tmp_path, families, held_out):
    """A byte-level BPE behind a Split regex whose PCRE2 match overflows its JIT stack on long words:
    fastokens raises on those documents (and on any batch holding one). The build still runs on
    fastokens, encodes exactly those documents with `tokenizers`, counts them in the report (not
    in the manifest) and stores the reference ids; the bytes equal the `tokenizers` build's."""
    base = families["gpt2_bpe"].read_text(encoding="utf-8")
    p = tmp_path / "deep" / "tokenizer.json"
    p.parent.mkdir()
    p.write_text(with_split_pattern(base, DEEP_PATTERN), encoding="utf-8")
    tok = load_tokenizer(str(p))
    fast, _ = fast_encoder(tok)
    assert isinstance(fast, FastokensEncoder)
    native = fast.native
    pathological = [f"document {i}: " + "ab" * (1000 + i) + " end" for i in range(5)]
    for t in pathological:
        with pytest.raises(Exception, match="JIT stack limit"):
            native.encode_batch_flat([t], add_special_tokens=False, split_special_tokens=True)
    texts = list(dict.fromkeys(t for t in held_out[:60] if t))
    texts = texts[:20] + pathological[:2] + texts[20:] + pathological[2:]

    def raises(t: str) -> bool:
        try:
            native.encode_batch_flat([t], add_special_tokens=False, split_special_tokens=True)
        except Exception:
            return True
        return False

    n_raise = sum(map(raises, texts))
    assert n_raise >= len(pathological)
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    rep = build_corpus(_cfg(tmp_path / "fast", [src], p))
    assert rep.encoder == "fastokens" and rep.encoder_fallbacks == n_raise
    assert f"{n_raise} documents encoded by tokenizers (fastokens raised on them)" in format_report(rep)
    assert rep.to_json()["encoder_fallbacks"] == n_raise
    _check_stored(tmp_path / "fast" / "manifests" / "shards.json", texts, tok.json_text, tok.eos_id)
    build_corpus(_cfg(tmp_path / "ref", [src], p, fast_path=False))
    assert tree(tmp_path / "fast") == tree(tmp_path / "ref")
    assert "fallback" not in (tmp_path / "fast" / "manifests" / "shards.json").read_text()


# -- one thread, and no fork after fastokens started its pool -------------------------------------------
_THREADS_SCRIPT = r"""
import json, os, sys
from h5corpus.build.tokenize.encoders import fast_encoder
from h5corpus.build.tokenize.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1])
enc, _ = fast_encoder(tok)
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
ids = enc.encode(("Lorem ipsum dolor sit amet, 12345 " * 12000)[:400_000])  # long: split on the pool
after = threads()
again, why = fast_encoder(tok)
pid = os.fork()
if pid == 0:
    try:
        enc.encode("a forked copy")
        os._exit(3)
    except Exception as e:
        os._exit(7 if "forked" in str(e) else 5)
_, status = os.waitpid(pid, 0)
print(json.dumps({"name": enc.name, "env": [os.environ.get("RAYON_NUM_THREADS"), os.environ.get("FASTOKENS_BPE_THREADS")],
                  "added": after - before, "ids": int(ids.size), "again": None if again is None else again.name,
                  "why": why, "child": os.waitstatus_to_exitcode(status)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc (Linux)")
def test_fastokens_runs_on_one_thread_and_is_not_offered_to_forked_workers_once_its_pool_runs(tmp_path, families):
    """In a fresh interpreter: the encoder sizes fastokens' pools to one thread (at most one helper
    thread appears on a text long enough to be split in parallel). Once that pool runs, the
    process no longer offers fastokens to workers it would fork, and a forked copy that tries
    anyway gets an error instead of hanging on the pool's missing threads."""
    p = tmp_path / "deep.json"
    p.write_text(with_split_pattern(families["llama3_bpe"].read_text(encoding="utf-8"), DEEP_PATTERN))
    out = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT, str(p)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["name"] == "fastokens" and got["env"] == ["1", "1"] and got["ids"] > 0
    assert got["added"] <= 1
    if got["added"] == 1:  # the pool started: fastokens is withheld from forks, and refuses in one
        assert got["again"] == "tiktoken" and "thread pool already runs in this process" in got["why"]
        assert got["child"] == 7


# -- offline --------------------------------------------------------------------------------------
def test_gpt2_spec_without_network_fails_at_once_with_the_good_message(tmp_path, monkeypatch):
    """Not cached and the hub unreachable (here: HF_ENDPOINT on a closed local port, without
    HF_HUB_OFFLINE): the network probe answers before any hub retry, with the same advice."""
    from h5corpus.build.tokenize.tokenizer import TokenizerError, hub_unreachable

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert "127.0.0.1:9" in hub_unreachable()
    with pytest.raises(TokenizerError, match=r"hub could not be reached \(127\.0\.0\.1:9: .*--tokenizer"):
        load_tokenizer("gpt2", cache_dir=tmp_path)


# -- kitoken: SentencePiece-style BPE and WordPiece ----------------------------------------------
KITOKEN_FAMILIES = ("sentencepiece_bpe", "llama2_bpe", "bert_wordpiece")


@pytest.mark.parametrize("family", KITOKEN_FAMILIES)
def test_kitoken_gives_the_tokenizers_ids_on_unseen_text_and_special_token_text(families, held_out, family):
    """kitoken loads each BPE / WordPiece family and gives `tokenizers`' ids on unseen text, the
    proof's edge cases and literal special-token text (read as text, never cut around); the proof
    passes. For SentencePiece BPE and WordPiece it is the build's first fast encoder."""
    tok = load_tokenizer(str(families[family]))
    enc, why = KitokenEncoder.load(tok)
    assert enc is not None, why
    texts = [*held_out, "a</s>b <s>x</s>", "x [SEP] y[MASK]z", "<unk><0x41>"]
    got = enc.encode_batch(texts)
    refs = reference_ids(tok.json_text, texts)
    assert [i for i, (a, b) in enumerate(zip(refs, got)) if not np.array_equal(a, b)] == []
    assert enc.fallbacks == 0
    assert prove_same_ids(HFEncoder(tok), enc, held_out[:20], cache=False) is None
    first, _ = fast_encoder(tok)
    assert first is not None and first.name == FIRST[family]


def test_kitoken_is_not_offered_for_unigram(families):
    """Unigram: kitoken breaks ties between equal-score segmentations (``"...."``) the other way
    round from `tokenizers`, so it is refused with that reason; the unigram encoder is chosen."""
    tok = load_tokenizer(str(families["metaspace_unigram"]))
    enc, why = KitokenEncoder.load(tok)
    assert enc is None and "Unigram" in why
    fast, why_all = fast_encoder(tok)
    assert isinstance(fast, UnigramEncoder) and "kitoken: kitoken breaks ties" in why_all


def _swapped_vocab(tok: Tokenizer) -> tuple[str, str]:
    """The tokenizer's JSON with the ids of two vocabulary entries swapped (a kitoken loaded from
    it gives other ids wherever either appears), and a text holding both."""
    d = json.loads(tok.json_text)
    vocab = d["model"]["vocab"]
    ids = sorted(vocab.values())
    by_id = {v: k for k, v in vocab.items()}
    a, b = by_id[ids[-1]], by_id[ids[-2]]  # the last two pieces learned: real words
    vocab[a], vocab[b] = vocab[b], vocab[a]
    pieces = [a.lstrip("\u2581#"), b.lstrip("\u2581#")]
    return json.dumps(d), " ".join(pieces * 3)


@pytest.mark.parametrize("family", KITOKEN_FAMILIES)
def test_the_proof_refuses_a_kitoken_that_differs_and_the_build_input_decides(families, held_out, family):
    """A real kitoken loaded from a JSON whose vocabulary swaps two ids: the proof finds the
    difference on text holding them (every time: never cached) and the choice falls back to
    `tokenizers`; on text without them the proof has nothing to refuse."""
    tok = load_tokenizer(str(families[family]))
    wrong_json, text = _swapped_vocab(tok)
    wrong, why = KitokenEncoder.load(tok, wrong_json)
    assert wrong is not None, why
    sample = [*held_out[:10], text]
    for _ in range(2):
        diff = prove_same_ids(HFEncoder(tok), wrong, sample)
        assert diff is not None and "kitoken gives" in diff
    chosen, note = prove_fast_path(HFEncoder(tok), wrong, sample, names=["kitoken"])
    assert isinstance(chosen, HFEncoder) and "fast path (kitoken) disabled" in note


def test_documents_kitoken_raises_on_go_to_tokenizers_and_are_counted(families, held_out):
    """A real kitoken without an unknown token raises on text holding a character outside the
    WordPiece vocabulary: exactly those documents are encoded by the reference and counted."""
    tok = load_tokenizer(str(families["bert_wordpiece"]))
    enc, _ = KitokenEncoder.load(tok)
    d = enc.native.definition()
    d["specials"] = [s for s in d["specials"] if s["kind"] != "Unknown"]
    enc.native.set_definition(d)
    texts = [*held_out[:30], "emoji 👍🏽 here", "plain words", "\U0001f9ea test tube", "more plain words"]

    def raises(t: str) -> bool:
        try:
            enc.native.encode(t, False)
        except ValueError:
            return True
        return False

    n_raise = sum(map(raises, texts))
    assert n_raise >= 2
    got = enc.encode_batch(texts)
    assert enc.fallbacks == n_raise
    assert [a.tolist() for a in got] == [r.tolist() for r in reference_ids(tok.json_text, texts)]


def test_long_wordpiece_texts_are_cut_where_bert_splits_and_keep_their_ids(families):
    """BERT layout: a long text is cut before whitespace or a CJK ideograph (never before a
    control character BertNormalizer deletes); the pieces rejoin to the text and kitoken's ids of
    a 300,000-character mixed text equal `tokenizers`'. Other layouts are never cut."""
    tok = load_tokenizer(str(families["bert_wordpiece"]))
    rule = cut_rule(tok.json)
    assert rule is not None
    for fam in ("sentencepiece_bpe", "llama2_bpe", "gpt2_bpe"):
        assert cut_rule(load_tokenizer(str(families[fam])).json) is None
    unit = "吾輩は猫である。名前はまだ無い。ab\x1ccd e\u0301f \x1fgh\u3000ij Ünïcödé 👍🏽 [SEP] "
    text = unit * (300_000 // len(unit))
    pieces = cut(text, rule)
    assert "".join(pieces) == text and len(pieces) > 100
    assert all(len(p) >= CHUNK_CHARS for p in pieces[:-1])
    assert all(p[0].isspace() or "\u4e00" <= p[0] <= "\u9fff" for p in pieces[1:])
    assert not any(p[0] in "\x1c\x1f" for p in pieces)
    enc, _ = KitokenEncoder.load(tok)
    assert np.array_equal(enc.encode(text), reference_ids(tok.json_text, [text])[0])


# -- every family on the dev corpus and hostile text ---------------------------------------------
def hostile_texts() -> list[str]:
    """Text a build must survive: control characters, 1 MB lines (latin with emoji, and CJK without
    a space), CJK, emoji sequences, and literal special-token text of every family."""
    mixed = "Words, café naïve; 12,345 — emoji 👍🏽 👨‍👩‍👧 🇺🇸 and 日本語 text. "
    return [
        "".join(map(chr, range(1, 32))) + "\x7f\x85 control \x00 in text \u200b\ufeff\ufffd",
        (mixed * (1_000_000 // len(mixed) + 1))[:1_000_000],
        ("吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。" * 30_000)[:1_000_000],
        "中文文本，包含标点符号。한국어 텍스트입니다. Tiếng Việt có dấu. ภาษาไทย",
        "👍🏽👍🏽👍🏽 🧪🧬 ✨✨ 👩🏾‍🔬 🏳️‍🌈 #️⃣ " * 50,
        SPECIAL_TEXT + " <|begin_of_text|><|eot_id|> [CLS] [PAD] [MASK] <s> <pad> ▁x",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("family", TOKENIZER_FAMILIES)
def test_every_family_builds_the_tokenizers_ids_on_the_dev_corpus_and_hostile_text(
    tmp_path, families, dev_texts, family
):
    """A 2-worker build over a 15th of the dev corpus (every file) and the hostile texts runs on
    the family's fast encoder (fastokens, kitoken, unigram), proves it, falls back on nothing, and
    stores exactly `tokenizers`' ids."""
    texts = [t for t in dev_texts[::15] if t] + hostile_texts()
    if family == "metaspace_unigram":  # its "</s>" is an ordinary piece: `tokenizers` emits the EOS id
        texts = [t.replace("</s>", "") for t in texts]
    texts = list(dict.fromkeys(texts))
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    rep = build_corpus(_cfg(tmp_path / "o", [src], families[family], task_bytes=1 << 20))
    assert rep.encoder == FIRST[family] and rep.encoder_fallbacks == 0
    assert "disabled" not in rep.encoder_note
    tok = load_tokenizer(str(families[family]))
    _check_stored(tmp_path / "o" / "manifests" / "shards.json", texts, tok.json_text, tok.eos_id)


# -- every family from the command line ------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**subprocess_env(), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "h5corpus", *args], env=env, capture_output=True, text=True)


def test_wordpiece_and_unigram_build_from_the_cli_with_eos_token(tmp_path, families, held_out):
    """A BERT WordPiece tokenizer whose EOS the build cannot infer: without --eos-token the CLI
    exits 2 with one line listing its special tokens and naming the flag; with --eos-token [SEP]
    it builds on kitoken with [SEP] as EOS. A Unigram tokenizer builds (on the unigram encoder) with its ``</s>``. The
    report gives the rate with a unit that fits (never ``0.00 M``)."""
    d = json.loads(families["bert_wordpiece"].read_text(encoding="utf-8"))
    d["added_tokens"] = [t for t in d["added_tokens"] if t["content"] != "</s>"]
    del d["model"]["vocab"]["</s>"]
    bert = tmp_path / "bert" / "tokenizer.json"
    bert.parent.mkdir()
    bert.write_text(json.dumps(d), encoding="utf-8")
    src = write_jsonl(tmp_path / "in.jsonl", list(dict.fromkeys(t for t in held_out[:30] if t and "</s>" not in t)))
    common = ["--workers", "2", "--validation-fraction", "0"]
    out = _cli("build", str(src), "--tokenizer", str(bert), "--shards-dir", str(tmp_path / "s0"), *common)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "no end-of-document token" in out.stderr and "[SEP]" in out.stderr and "--eos-token" in out.stderr
    for name, tok, extra in (("bert", bert, ["--eos-token", "[SEP]"]), ("unigram", families["metaspace_unigram"], [])):
        m = tmp_path / name / "shards.json"
        out = _cli(
            "build",
            str(src),
            "--tokenizer",
            str(tok),
            "--shards-dir",
            str(tmp_path / name / "s"),
            "--manifest",
            str(m),
            *common,
            *extra,
        )
        assert out.returncode == 0, out.stderr
        assert "tokens/s" in out.stdout and "0.00 M tokens/s" not in out.stdout
        manifest = json.loads(m.read_text())
        want_eos = d["model"]["vocab"]["[SEP]"] if name == "bert" else load_tokenizer(str(tok)).eos_id
        assert manifest["tokenizer"]["eos_id"] == want_eos
    help_out = _cli("build", "--help")
    assert help_out.returncode == 0 and "--eos-token" in help_out.stdout and "<bool>" not in help_out.stdout


# -- unigram: tokenizers' Unigram algorithm, compiled ---------------------------------------------
#: Texts where Metaspace and the Unigram model have edge cases: leading/trailing/repeated spaces,
#: the replacement character typed in the text, unknown characters next to the unknown token's own
#: text (tokenizers fuses both into one unknown), empty and whitespace-only texts.
UNIGRAM_EDGES = [
    "",
    " ",
    "   ",
    "  a",
    "a  ",
    "\u2581",
    "\u2581a",
    " \u2581",
    "a \u2581 b",
    "\u2581\u2581x  y",
    "x\u2581\u2581 y",
    "<unk>",
    "a<unk>\u20ac\u20acb",
    "\u20ac<unk>",
    "\U0001d518\U0001d518 \u2603",
    "\x00\x01 abc\n\t",
]


def _unigram_variant(path: Path, **changes) -> str:
    """The trained Unigram JSON with ``changes``: ``bytes`` adds ``<0xXX>`` pieces (every byte, or
    those of ``range(bytes)``) with byte fallback on; ``prepend`` sets Metaspace's prepend_scheme;
    ``replacement`` its replacement character; ``duplicate`` repeats a piece at the end of the
    vocabulary with another score (tokenizers keeps the last id); ``normalizer`` sets one."""
    d = json.loads(path.read_text(encoding="utf-8"))
    vocab = d["model"]["vocab"]
    if "bytes" in changes:
        vocab += [[f"<0x{b:02X}>", -16.0] for b in range(changes["bytes"])]
        d["model"]["byte_fallback"] = True
    if "prepend" in changes:
        d["pre_tokenizer"]["prepend_scheme"] = changes["prepend"]
    if "replacement" in changes:
        d["pre_tokenizer"]["replacement"] = d["decoder"]["replacement"] = changes["replacement"]
    if changes.get("duplicate"):
        vocab.append([vocab[40][0], vocab[40][1] + 3.0])
    if "normalizer" in changes:
        d["normalizer"] = changes["normalizer"]
    return json.dumps(d, ensure_ascii=False)


@pytest.mark.slow
def test_unigram_gives_the_tokenizers_ids_on_the_whole_dev_corpus_and_hostile_text(families, dev_texts):
    """Every dev document (10,598: news, books, web, many scripts; float64 scores where SentencePiece
    and kitoken break near-ties otherwise), the hostile texts (control characters, 1 MB lines, CJK,
    emoji, special-token text), the proof's texts and Metaspace edge cases: the ids of `tokenizers`."""
    tok = load_tokenizer(str(families["metaspace_unigram"]))
    enc, why = UnigramEncoder.load(tok)
    assert enc is not None, why
    texts = [*dev_texts, *hostile_texts(), *PROOF_TEXTS, *UNIGRAM_EDGES]
    hf = HFEncoder(tok)
    bad = []
    for a in range(0, len(texts), 2048):
        flat, offsets = enc.encode_flat(texts[a : a + 2048])
        got = [flat[i:j] for i, j in zip(offsets[:-1], offsets[1:])]
        refs = hf.encode_batch(texts[a : a + 2048])
        bad += [a + i for i, (r, g) in enumerate(zip(refs, got)) if not np.array_equal(r, g)]
    assert bad == [] and enc.fallbacks == 0 and len(texts) > 10_600


@pytest.mark.parametrize(
    "changes",
    [
        {"bytes": 256},
        {"bytes": 150},
        {"prepend": "never"},
        {"prepend": "first"},
        {"replacement": "_"},
        {"duplicate": True},
        {"normalizer": {"type": "NFKC"}},
        {"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKD"}, {"type": "Lowercase"}]}},
        {"normalizer": {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}},
    ],
    ids=[
        "byte-fallback",
        "some-bytes",
        "prepend-never",
        "prepend-first",
        "replacement-underscore",
        "duplicate-piece",
        "nfkc",
        "nfkd-lowercase",
        "spaces-replace",
    ],
)
def test_unigram_follows_tokenizers_on_model_and_metaspace_variants(tmp_path, families, held_out, changes):
    """Byte fallback (all bytes, or some: then an unknown becomes the unknown id), the other
    prepend schemes, another replacement character, a repeated piece, normalizers (NFKC; NFKD then
    lowercase; runs of spaces made one, as T5's): the same ids as
    `tokenizers` on unseen text, the proof's texts and the edge cases, and the proof passes."""
    p = tmp_path / "tokenizer.json"
    p.write_text(_unigram_variant(families["metaspace_unigram"], **changes), encoding="utf-8")
    tok = load_tokenizer(str(p))
    enc, why = fast_encoder(tok)
    assert isinstance(enc, UnigramEncoder), why
    texts = [*held_out, *UNIGRAM_EDGES, "under_score_s __x", "emoji \U0001f44d\U0001f3fd \u65e5\u672c \u00e4\u00df"]
    refs = reference_ids(tok.json_text, texts)
    got = enc.encode_batch(texts)
    assert [i for i, (a, b) in enumerate(zip(refs, got)) if not np.array_equal(a, b)] == []
    assert prove_same_ids(HFEncoder(tok), enc, held_out[:20], cache=False) is None
    if changes.get("bytes") == 256:  # the fallback is used: an emoji's first byte as a byte piece
        assert tok.hf.token_to_id("<0xF0>") in np.concatenate(got)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (
            {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}]}},
            "'Sequence' is not Metaspace",
        ),
        (
            {
                "pre_tokenizer": {
                    "type": "Metaspace",
                    "replacement": "\u2581",
                    "prepend_scheme": "always",
                    "split": False,
                }
            },
            "split=false",
        ),
        ({"pre_tokenizer": {"type": "WhitespaceSplit"}}, "pre-tokenizer 'WhitespaceSplit' is not Metaspace"),
        ({"added_tokens": "non-special"}, "non-special added tokens"),
    ],
    ids=["pre-tokenizer-sequence", "no-split", "other-pre-tokenizer", "added-token"],
)
def test_unigram_is_refused_where_the_port_is_not_the_whole_pipeline(tmp_path, families, held_out, change, why):
    """Metaspace inside a Sequence, Metaspace without splitting, another pre-tokenizer, a non-special added token
    (cut out of the text by tokenizers): the unigram encoder is refused with the reason, no fast
    encoder applies, and a build runs on `tokenizers` with its ids."""
    d = json.loads(families["metaspace_unigram"].read_text(encoding="utf-8"))
    if change.get("added_tokens") == "non-special":
        piece = d["model"]["vocab"][40][0]  # an ordinary piece, made a non-special added token
        d["added_tokens"].append(dict(d["added_tokens"][0], id=40, content=piece, special=False))
    else:
        d.update(change)
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(d), encoding="utf-8")
    tok = load_tokenizer(str(p))
    enc, got_why = UnigramEncoder.load(tok)
    assert enc is None and why in got_why
    fast, why_all = fast_encoder(tok)
    assert fast is None and f"unigram: {got_why}" in why_all
    texts = list(dict.fromkeys(t for t in held_out[:30] if t and "</s>" not in t))
    rep = build_corpus(_cfg(tmp_path / "o", [write_jsonl(tmp_path / "in.jsonl", texts)], p))
    assert rep.encoder == "tokenizers"
    _check_stored(tmp_path / "o" / "manifests" / "shards.json", texts, tok.json_text, tok.eos_id)


def test_the_proof_refuses_a_unigram_that_differs(families, held_out):
    """A real unigram encoder on a JSON whose vocabulary swaps two pieces' scores: the proof finds
    the difference (every time: never cached) and the build's choice falls back to `tokenizers`."""
    tok = load_tokenizer(str(families["metaspace_unigram"]))
    d = json.loads(tok.json_text)
    vocab = d["model"]["vocab"]
    vocab[3][1], vocab[60][1] = vocab[60][1], vocab[3][1]
    wrong, why = UnigramEncoder.load(tok, json.dumps(d))
    assert wrong is not None, why
    for _ in range(2):
        diff = prove_same_ids(HFEncoder(tok), wrong, held_out[:10])
        assert diff is not None and "unigram gives" in diff
    chosen, note = prove_fast_path(HFEncoder(tok), wrong, held_out[:10], names=["unigram"])
    assert isinstance(chosen, HFEncoder) and "fast path (unigram) disabled" in note


def test_documents_the_unigram_kernel_raises_on_go_to_tokenizers_and_are_counted(families, held_out):
    """A text that is not valid UTF-8 (a lone surrogate) makes the kernel raise: the batch is
    encoded one text at a time, the others keep their ids, and that text goes to `tokenizers`,
    counted, which raises its own error (what a build would report). A real encoder whose compiled
    kernel cannot run at all (its trie arrays from an incompatible layout: numba refuses the call)
    hands every text to `tokenizers`, counted, with the reference ids."""
    tok = load_tokenizer(str(families["metaspace_unigram"]))
    enc, _ = UnigramEncoder.load(tok)
    texts = [t for t in held_out[:20] if t]
    with pytest.raises(TypeError):
        tok.encode("a\ud800b")
    with pytest.raises(TypeError):
        enc.encode_batch([*texts, "a\ud800b"])
    assert enc.fallbacks == 1
    broken, _ = UnigramEncoder.load(tok)
    broken.model.trie = broken.model.trie[:4]
    got = broken.encode_batch(texts)
    assert broken.fallbacks == len(texts)
    assert [a.tolist() for a in got] == [r.tolist() for r in reference_ids(tok.json_text, texts)]


def test_unigram_word_cache_gives_the_same_ids_on_repeat_and_after_it_empties(families, held_out):
    """Words are remembered per process: the same texts encoded again (every short word from the
    cache) give the same ids; a cache so small that it empties again and again gives them too."""
    from h5corpus.build.tokenize import unigram_kernel

    tok = load_tokenizer(str(families["metaspace_unigram"]))
    enc, _ = UnigramEncoder.load(tok)
    refs = [r.tolist() for r in reference_ids(tok.json_text, held_out)]
    for _ in range(2):
        assert [a.tolist() for a in enc.encode_batch(held_out)] == refs
    slots, hashes, meta, keys, ids, used = unigram_kernel.new_word_cache()
    enc.model.cache = (slots[:64], hashes[:32], meta[:32], keys[:256], ids[:128], used)
    for _ in range(2):
        assert [a.tolist() for a in enc.encode_batch(held_out)] == refs
    assert 0 < used[0] <= 32


def test_without_numba_a_unigram_build_runs_on_tokenizers_and_says_why(tmp_path, families, held_out, monkeypatch):
    """numba is the `unigram` extra, not a core dependency: where it cannot be imported, the
    unigram encoder is not offered, the build runs on `tokenizers` with exact ids, and its note
    names the extra to install."""
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    tok = load_tokenizer(str(families["metaspace_unigram"]))
    fast, why = fast_encoder(tok)
    assert fast is None and "unigram: numba is not installed (pip install 'h5corpus[unigram]')" in why
    texts = list(dict.fromkeys(t for t in held_out[:30] if t and "</s>" not in t))
    rep = build_corpus(_cfg(tmp_path / "o", [write_jsonl(tmp_path / "in.jsonl", texts)], families["metaspace_unigram"]))
    assert rep.encoder == "tokenizers" and "h5corpus[unigram]" in rep.encoder_note
    _check_stored(tmp_path / "o" / "manifests" / "shards.json", texts, tok.json_text, tok.eos_id)


def test_unigram_with_a_large_vocabulary_gives_the_tokenizers_ids(tmp_path, families, held_out, dev_texts):
    """The trained model plus 20,000 pieces cut from dev words (scores spread below the model's):
    a trie deeper than the kernel's dense table (the binary-search path), and the same ids as
    `tokenizers` on unseen text and 1,500 dev documents."""
    from h5corpus.build.tokenize import unigram_kernel

    d = json.loads(families["metaspace_unigram"].read_text(encoding="utf-8"))
    have = {p for p, _ in d["model"]["vocab"]}
    rng = np.random.default_rng(0)
    words = [w for t in dev_texts[::40] for w in t.split()[:300]]
    while len(have) < 20_600:
        w = words[rng.integers(len(words))]
        w = "\u2581" + w if rng.random() < 0.5 else w
        a = int(rng.integers(len(w)))
        piece = w[a : a + int(rng.integers(2, 11))]
        if len(piece) >= 2 and piece not in have:
            have.add(piece)
            d["model"]["vocab"].append([piece, -8.0 - 6.0 * float(rng.random())])
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
    tok = load_tokenizer(str(p))
    enc, why = fast_encoder(tok)
    assert isinstance(enc, UnigramEncoder), why
    assert enc.model.trie[0].size - 1 > 2 * unigram_kernel.DENSE_NODES
    texts = [*held_out, *UNIGRAM_EDGES, *[t for t in dev_texts[::7] if len(t) < 50_000][:1500]]
    refs = HFEncoder(tok).encode_batch(texts)
    got = enc.encode_batch(texts)
    assert [i for i, (a, b) in enumerate(zip(refs, got)) if not np.array_equal(a, b)] == []
