"""The fast encoders on tokenizer families trained here with `tokenizers` itself: fastokens where it
loads the JSON (byte-level BPE like GPT-2 and Llama-3), a clean fallback where it refuses it
(SentencePiece-style BPE, BERT WordPiece, Metaspace Unigram), the proof catching a fast encoder
that differs, documents fastokens raises on, one thread per worker, and shard bytes that do not
depend on the encoder (the synthetic families and the dev corpus with GPT-2).

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
from h5corpus.build.tokenize.encoders import FastokensEncoder, HFEncoder, TiktokenEncoder, fast_encoder
from h5corpus.build.tokenize.proof import PROOF_TEXTS, prove_fast_path, prove_same_ids
from h5corpus.build.tokenize.tokenizer import Tokenizer, load_tokenizer
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

#: Families fastokens loads (and, being byte-level BPE, tiktoken mirrors), and the reason it gives
#: for refusing each of the others.
LOADS = ("gpt2_bpe", "llama3_bpe")
REFUSES = {
    "sentencepiece_bpe": "unsupported normalizer type: NFKC",
    "bert_wordpiece": "unsupported normalizer type: BertNormalizer",
    "metaspace_unigram": "unsupported pre-tokenizer type: Metaspace",
}
SPECIAL_TEXT = "special tokens as text: <|endoftext|> <|end_of_text|> </s> [SEP] <unk> <0x41>"


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
    """All documents in ``train``, in input order: ids = sha256 of the text, tokens = the
    `tokenizers` ids + EOS (texts are distinct and non-empty)."""
    got = read_built(manifest)["train"]
    assert [d[0] for d in got] == [hashlib.sha256(t.encode()).digest() for t in texts]
    for (_, toks, flags), ref in zip(got, reference_ids(tokenizer_json, texts)):
        assert flags == 0 and np.array_equal(toks.astype(np.int64), np.append(ref, eos))


# -- fastokens where it loads ---------------------------------------------------------------------
@pytest.mark.parametrize("family", LOADS)
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
    assert prove_same_ids(tok.reference_encoder(), fast, held_out[:20], cache=False) is None


@pytest.mark.parametrize("family", LOADS)
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
    reported), tiktoken does not apply, and the build runs on `tokenizers` with exact ids."""
    tok = load_tokenizer(str(families[family]))
    enc, why = FastokensEncoder.load(tok)
    assert enc is None and REFUSES[family] in why
    fast, why_all = fast_encoder(tok)
    assert fast is None and why_all.startswith("fastokens: fastokens refused the tokenizer (")
    assert REFUSES[family] in why_all and "; tiktoken: " in why_all
    texts = list(dict.fromkeys(t for t in held_out[:40] if t))
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    rep = build_corpus(_cfg(tmp_path / "o", [src], families[family]))
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
    taken from the proof cache, and the choice moves on: to tiktoken for byte-level BPE (which
    proves equal), to `tokenizers` for the others. For families fastokens refuses, the differing
    candidate is fastokens on the GPT-2-style family's JSON (a plausible wrong mirror)."""
    tok = load_tokenizer(str(families[family]))
    wrong_json = _altered(tok) if family in LOADS else load_tokenizer(str(families["gpt2_bpe"]))
    wrong, why = FastokensEncoder.load(wrong_json)
    assert wrong is not None, why
    for _ in range(2):  # a difference is found every time (never cached)
        diff = prove_same_ids(HFEncoder(tok), wrong, held_out[:30])
        assert diff is not None and "differs at token" in diff and "fastokens gives" in diff
    chosen, note = prove_fast_path(HFEncoder(tok), wrong, held_out[:30])
    assert "fast path (fastokens) disabled" in note
    if family in LOADS:
        assert isinstance(chosen, TiktokenEncoder)
        assert [a.tolist() for a in chosen.encode_batch(held_out)] == [
            r.tolist() for r in reference_ids(tok.json_text, held_out)
        ]
    else:
        assert isinstance(chosen, HFEncoder) and "not applicable: tiktoken: " in note


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
    """The same build with fastokens, with tiktoken and on `tokenizers` (each family where each
    applies; the others fall back to `tokenizers` cleanly): identical shard and manifest bytes,
    the reference ids in them, and the report naming the encoder that ran."""
    src, texts = _family_inputs(tmp_path, held_out)
    trees, encoders = [], []
    for name, kw in (
        ("fastokens", {"fast_encoders": ("fastokens",)}),
        ("tiktoken", {"fast_encoders": ("tiktoken",)}),
        ("tokenizers", {"fast_path": False}),
    ):
        rep = build_corpus(_cfg(tmp_path / name, [src], families[family], **kw))
        trees.append(tree(tmp_path / name))
        encoders.append(rep.encoder)
    assert trees[0] == trees[1] == trees[2]
    want = ["fastokens", "tiktoken", "tokenizers"] if family in LOADS else ["tokenizers"] * 3
    assert encoders == want
    tok = load_tokenizer(str(families[family]))
    _check_stored(tmp_path / "tokenizers" / "manifests" / "shards.json", texts, tok.json_text, tok.eos_id)
    manifest = json.loads((tmp_path / "fastokens" / "manifests" / "shards.json").read_text())
    assert "fastokens" not in json.dumps(manifest) and "tiktoken" not in json.dumps(manifest)


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
