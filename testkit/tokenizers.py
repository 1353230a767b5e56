"""Tokenizer families trained by ``tokenizers`` (BPE byte-level, SentencePiece-style, Llama-2 layout,
Unigram, WordPiece): shared by the encoder tests and ``bench/bench_build.py --families``."""

from __future__ import annotations

import json
from collections.abc import Sequence


def bpe_tokenizer_json(merges: list[tuple[str, str]], *, normalizer=None, pre_tokenizer=None) -> dict:
    """A byte-level BPE tokenizer.json: the 256 byte symbols, then one id per merge, then EOS."""
    from h5corpus.build.tokenize.tokenizer import byte_level_alphabet

    alpha = byte_level_alphabet()
    vocab = {alpha[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    eos = len(vocab)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": eos,
                "content": "<|endoftext|>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer
        or {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }


# -- tokenizer families ----------------------------------------------------------------------------
#: Llama-3's pre-tokenizer split regex (a ``Split`` before a regex-free ``ByteLevel``).
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
#: A ``Split`` regex PCRE2 cannot match on long words (its JIT stack overflows on ~2,000 letters:
#: fastokens raises), while ``tokenizers`` and tiktoken match it.
DEEP_PATTERN = r"(?:\p{L}|\p{N})+|\s+|[^\s\p{L}\p{N}]+"
#: The families :func:`train_tokenizer_family` builds: byte-level BPE like GPT-2 and like
#: Llama-3 (``Split`` regex), SentencePiece-style BPE (NFKC, Metaspace, byte fallback), the same
#: kind of model in Llama-2's layout (Prepend + Replace normalizers, no pre-tokenizer), BERT
#: WordPiece, and a Metaspace Unigram.
TOKENIZER_FAMILIES = (
    "gpt2_bpe",
    "llama3_bpe",
    "sentencepiece_bpe",
    "llama2_bpe",
    "bert_wordpiece",
    "metaspace_unigram",
)
#: Llama-2's normalizer and decoder in ``tokenizer.json`` (its pre-tokenizer is null).
LLAMA2_NORMALIZER = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ],
}
LLAMA2_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}


def _chars_prefix(texts: Sequence[str], chars: int) -> list[str]:
    out, n = [], 0
    for t in texts:
        out.append(t)
        n += len(t)
        if n >= chars:
            break
    return out


def train_tokenizer_family(family: str, texts: Sequence[str]) -> str:
    """A ``tokenizer.json`` of ``family`` (:data:`TOKENIZER_FAMILIES`), trained by ``tokenizers``
    itself on ``texts`` (a small vocabulary, so it trains in seconds). Each has an EOS token of
    :data:`h5corpus.build.tokenize.tokenizer.EOS_CANDIDATES`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if family == "gpt2_bpe":
        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=2000, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
        )
    elif family == "llama3_bpe":
        t = Tokenizer(models.BPE(ignore_merges=True))
        t.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        t.decoder = decoders.ByteLevel()
        special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
        trainer = trainers.BpeTrainer(
            vocab_size=2000, special_tokens=special, initial_alphabet=alphabet, show_progress=False
        )
    elif family in ("sentencepiece_bpe", "llama2_bpe"):
        t = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
        if family == "sentencepiece_bpe":
            t.normalizer = normalizers.NFKC()
        t.pre_tokenizer = pre_tokenizers.Metaspace()
        t.decoder = decoders.Metaspace()
        special = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=special, show_progress=False)
    elif family == "bert_wordpiece":
        t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        t.normalizer = normalizers.BertNormalizer(lowercase=True)
        t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        t.decoder = decoders.WordPiece()
        special = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "</s>"]
        trainer = trainers.WordPieceTrainer(vocab_size=1500, special_tokens=special, show_progress=False)
    elif family == "metaspace_unigram":
        t = Tokenizer(models.Unigram())
        t.pre_tokenizer = pre_tokenizers.Metaspace()
        t.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=600,
            special_tokens=["<unk>", "</s>"],
            unk_token="<unk>",
            max_piece_length=12,
            show_progress=False,
        )
        texts = _chars_prefix(texts, 150_000)  # Unigram training is the slow one
    else:
        raise ValueError(f"unknown tokenizer family {family!r}")
    t.train_from_iterator(list(texts), trainer)
    return _as_released(family, t.to_str())


def _as_released(family: str, tokenizer_json: str) -> str:
    """A trained SentencePiece-style JSON laid out like released ones: the byte pieces
    ``<0x00>``..``<0xFF>`` in the vocabulary only (the trainer also lists them as added special
    tokens), and for ``llama2_bpe`` Llama-2's normalizer, null pre-tokenizer and decoder."""
    if family not in ("sentencepiece_bpe", "llama2_bpe"):
        return tokenizer_json
    d = json.loads(tokenizer_json)
    d["added_tokens"] = [t for t in d["added_tokens"] if not t["content"].startswith("<0x")]
    if family == "llama2_bpe":
        d["normalizer"], d["pre_tokenizer"], d["decoder"] = LLAMA2_NORMALIZER, None, LLAMA2_DECODER
    return json.dumps(d, ensure_ascii=False)


def with_split_pattern(tokenizer_json: str, pattern: str) -> str:
    """A byte-level BPE ``tokenizer.json`` (a Split + ByteLevel sequence, or a plain ByteLevel)
    with its split regex replaced by ``pattern``."""
    d = json.loads(tokenizer_json)
    d["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    return json.dumps(d, ensure_ascii=False)
