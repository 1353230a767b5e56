"""Tokenizer specs, their identity, and the encoders the build runs.

A *spec* names a tokenizer (:func:`load_tokenizer`):

* ``gpt2`` -- ``openai-community/gpt2`` at revision :data:`GPT2_REVISION`, from the local Hugging Face
  cache (or the hub when reachable). There is no silent fallback: when it is not cached and the hub
  cannot be reached, :class:`TokenizerError` says so and suggests passing a path.
* a path to a ``tokenizer.json`` (or to a folder holding one).
* ``bytes`` -- an offline byte-level tokenizer built with ``tokenizers``: ids 0-255 are the UTF-8
  bytes, 256 is ``<|endoftext|>``. Runs anywhere, needs no download.

Encoding rules (the corpus contract): ids of the text only, no BOS, and special-token text inside a
document (``"<|endoftext|>"`` typed literally) is encoded as ordinary text, so the EOS id appears only
where the build appends it, once, at each real document end.

The reference encoder is Hugging Face ``tokenizers``. For byte-level BPE tokenizers of the GPT-2
family :func:`fast_encoder` builds a ``tiktoken`` encoding from the same ``tokenizer.json`` (vocab ->
mergeable ranks, GPT-2 split regex), ~3-5x faster per core; for the ``bytes`` tokenizer ids are the
UTF-8 bytes themselves. A fast encoder is only used after :func:`prove_same_ids` found it emits
exactly the reference ids on a sample (the build does this at start, on its own input).

Caching (:func:`cache_dir`: ``$H5CORPUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/h5corpus``, else
``~/.cache/h5corpus``; ``H5CORPUS_NO_CACHE=1`` turns it off): a *passed* proof is remembered under a
key made of everything its answer depends on -- the tokenizer JSON's sha256, the sha256 of every
text compared, the encoder's name, the tiktoken and tokenizers versions and the sha256 of this
module's source -- so re-running a build on the same input does not load ``tokenizers`` and prove
again. A failed proof is never cached, and a different sample, tokenizer or library version proves
again. Cache files are written atomically and a file whose content does not match its key is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..storage.format import TokenizerIdentity

GPT2_REPO = "openai-community/gpt2"
#: The pinned revision of :data:`GPT2_REPO` that the ``gpt2`` spec loads.
GPT2_REVISION = "607a30d783dfa663caf39e06633721c8d4cfcd7e"
#: The GPT-2 pre-tokenizer split (the ``ByteLevel(use_regex=True)`` pattern; tiktoken's r50k/gpt2).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Special tokens tried, in order, as the end-of-document id.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BYTES_SPEC = "bytes"
#: Version of the construction of the ``bytes`` tokenizer (part of its identity's revision).
BYTES_REVISION = "h5corpus-bytes-1"

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


class TokenizerError(ValueError):
    """A tokenizer spec cannot be resolved or loaded (a usage/environment error)."""


class Encoder(Protocol):
    """Turns texts into token ids (no EOS, no BOS, special-token text encoded as text)."""

    name: str

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One 1-D unsigned id array per text."""
        ...


# -- byte-level alphabet (GPT-2's bytes_to_unicode) ------------------------------------------------
def byte_level_alphabet() -> dict[int, str]:
    """Byte value -> the printable character byte-level BPE uses for it (GPT-2's mapping)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def bytes_tokenizer_json() -> str:
    """The ``bytes`` tokenizer as canonical ``tokenizer.json`` text: a BPE model without merges
    over the 256 byte-level symbols (id = byte value) plus ``<|endoftext|>`` = 256."""
    alphabet = byte_level_alphabet()
    d = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": 256,
                "content": "<|endoftext|>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {alphabet[b]: b for b in range(256)},
            "merges": [],
        },
    }
    return json.dumps(d, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


# -- loading --------------------------------------------------------------------------------------
def hf_cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The Hugging Face hub cache: ``explicit``, else ``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
    ``~/.cache/huggingface/hub`` (read at call time, so tests and callers can redirect it)."""
    if explicit is not None:
        return Path(explicit)
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _fetch_gpt2_json(cache_dir: Path) -> Path:
    from huggingface_hub import hf_hub_download

    where = f"{GPT2_REPO}@{GPT2_REVISION[:12]}"
    try:
        return Path(
            hf_hub_download(
                GPT2_REPO, "tokenizer.json", revision=GPT2_REVISION, cache_dir=cache_dir, local_files_only=True
            )
        )
    except Exception:  # not cached: try the hub unless told to stay offline
        pass
    hint = (
        f"pass a local file instead, e.g. --tokenizer /path/to/gpt2/tokenizer.json, or pre-fetch it with "
        f"`huggingface-cli download {GPT2_REPO} tokenizer.json --revision {GPT2_REVISION}`"
    )
    if hub_offline():
        raise TokenizerError(
            f"tokenizer 'gpt2' ({where}) is not in the Hugging Face cache at {cache_dir} and HF_HUB_OFFLINE is set; {hint}"
        )
    try:
        return Path(
            hf_hub_download(GPT2_REPO, "tokenizer.json", revision=GPT2_REVISION, cache_dir=cache_dir, etag_timeout=10)
        )
    except Exception as e:
        raise TokenizerError(
            f"tokenizer 'gpt2' ({where}) is not in the Hugging Face cache at {cache_dir} and the hub could not be "
            f"reached ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {hint}"
        ) from None


def _find_eos(d: dict[str, Any], where: str, eos_token: str | None) -> int:
    added = {t["content"]: int(t["id"]) for t in d.get("added_tokens") or []}
    vocab = (d.get("model") or {}).get("vocab")
    vocab = vocab if isinstance(vocab, dict) else {}
    names = (eos_token,) if eos_token else EOS_CANDIDATES
    for name in names:
        if name in added:
            return added[name]
        if name in vocab:
            return int(vocab[name])
    specials = sorted(t["content"] for t in d.get("added_tokens") or [] if t.get("special"))
    raise TokenizerError(
        f"{where}: no end-of-document token {list(names)} in this tokenizer (its special tokens: {specials[:12]})"
    )


def _vocab_size(d: dict[str, Any]) -> int:
    """Number of ids: one past the largest id of the model vocabulary and the added tokens."""
    ids = [int(t["id"]) for t in d.get("added_tokens") or []]
    vocab = (d.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and vocab:
        ids.append(max(int(v) for v in vocab.values()))
    elif isinstance(vocab, list) and vocab:  # Unigram: [[piece, score], ...]
        ids.append(len(vocab) - 1)
    return max(ids) + 1 if ids else 0


class Tokenizer:
    """A loaded tokenizer: its identity, the reference (``tokenizers``) encoder, and its JSON.

    Pickles as its JSON text and identity, so worker processes rebuild it themselves.
    """

    def __init__(self, identity: TokenizerIdentity, json_text: str) -> None:
        self.identity = identity
        self.json_text = json_text
        self._hf: Any = None
        self._json: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"identity": self.identity, "json_text": self.json_text}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.identity = state["identity"]
        self.json_text = state["json_text"]
        self._hf = None
        self._json = None

    @property
    def json(self) -> dict[str, Any]:
        """The parsed tokenizer.json."""
        if self._json is None:
            self._json = json.loads(self.json_text)
        return self._json

    @property
    def eos_id(self) -> int:
        return self.identity.eos_id

    @property
    def vocab_size(self) -> int:
        return self.identity.vocab_size

    @property
    def hf(self):
        """The ``tokenizers.Tokenizer`` with ``encode_special_tokens`` on (special-token text in a
        document is encoded as text)."""
        if self._hf is None:
            from tokenizers import Tokenizer as HFTokenizer

            try:
                t = HFTokenizer.from_str(self.json_text)
            except Exception as e:
                raise TokenizerError(f"tokenizer {self.identity.name!r}: tokenizers cannot load it ({e})") from None
            t.encode_special_tokens = True
            t.no_truncation()
            t.no_padding()
            self._hf = t
        return self._hf

    def encode(self, text: str) -> np.ndarray:
        """Reference ids of ``text`` (uint32; no EOS, no BOS)."""
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def reference_encoder(self) -> HFEncoder:
        return HFEncoder(self)


def load_tokenizer(
    spec: str,
    *,
    eos_token: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """Resolve a tokenizer spec (``gpt2``, ``bytes``, or a path to ``tokenizer.json`` / its folder).

    The identity records ``name`` (``openai-community/gpt2``, ``bytes``, or the path as given),
    ``revision`` (the hub commit, the ``bytes`` construction version, or ``local``), ``sha256`` of the
    JSON bytes, ``vocab_size`` (ids incl. special tokens) and ``eos_id``.

    Raises :class:`TokenizerError` naming the spec when it cannot be resolved.
    """
    if spec == BYTES_SPEC:
        text = bytes_tokenizer_json()
        raw = text.encode("utf-8")
        name, revision = BYTES_SPEC, BYTES_REVISION
    else:
        if spec == "gpt2":
            path = _fetch_gpt2_json(hf_cache_dir(cache_dir))
            name, revision = GPT2_REPO, GPT2_REVISION
        else:
            path = Path(spec)
            if path.is_dir():
                path = path / "tokenizer.json"
            if not path.is_file():
                raise TokenizerError(
                    f"tokenizer {spec!r}: no such file {path} (a spec is 'gpt2', 'bytes', or a path to a tokenizer.json or its folder)"
                )
            name, revision = spec, "local"
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"tokenizer {spec!r}: cannot read {path} ({e})") from None
    sha = hashlib.sha256(raw).hexdigest()
    facts = _load_facts(sha, f"identity eos={eos_token!r}")
    if facts is not None:  # derived before from these exact bytes: no need to parse 1+ MB of JSON
        return Tokenizer(
            TokenizerIdentity(
                name=name,
                revision=revision,
                sha256=sha,
                vocab_size=int(facts["vocab_size"]),
                eos_id=int(facts["eos_id"]),
            ),
            text,
        )
    try:
        d = json.loads(text)
    except ValueError as e:
        raise TokenizerError(f"tokenizer {spec!r}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("model"), dict):
        raise TokenizerError(f"tokenizer {spec!r}: not a tokenizer.json (no 'model' object)")
    eos = _find_eos(d, f"tokenizer {spec!r}", eos_token)
    ident = TokenizerIdentity(name=name, revision=revision, sha256=sha, vocab_size=_vocab_size(d), eos_id=eos)
    _store_facts(sha, f"identity eos={eos_token!r}", {"eos_id": eos, "vocab_size": ident.vocab_size})
    tok = Tokenizer(ident, text)
    tok._json = d
    return tok


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
            cached = _cached_tiktoken(sha, _load_facts(sha, "fast path"))
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


# -- cache ----------------------------------------------------------------------------------------
#: Format of the proof cache files (bump to invalidate every entry).
_PROOF_CACHE_FORMAT = "h5corpus-proof-1"


def cache_dir() -> Path | None:
    """Where h5corpus caches proofs: ``$H5CORPUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/h5corpus``, else
    ``~/.cache/h5corpus`` (read at call time). None when ``H5CORPUS_NO_CACHE`` is set (1/true/yes/on)."""
    if os.environ.get("H5CORPUS_NO_CACHE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    if os.environ.get("H5CORPUS_CACHE_DIR"):
        return Path(os.environ["H5CORPUS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "h5corpus"


_MODULE_SHA256: str | None = None
_VERSIONS: dict[str, str] | None = None


def _module_sha256() -> str:
    global _MODULE_SHA256
    if _MODULE_SHA256 is None:
        try:
            _MODULE_SHA256 = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
        except OSError:  # pragma: no cover - no source file (frozen): never reuse a cached proof
            _MODULE_SHA256 = os.urandom(16).hex()
    return _MODULE_SHA256


def _versions() -> dict[str, str]:
    global _VERSIONS
    if _VERSIONS is None:
        import importlib.metadata as md

        out = {}
        for dist in ("tiktoken", "tokenizers"):
            try:
                out[dist] = md.version(dist)
            except md.PackageNotFoundError:
                out[dist] = "none"
        _VERSIONS = out
    return dict(_VERSIONS)


#: Format of the tokenizer-facts cache files (bump to invalidate every entry).
_FACTS_CACHE_FORMAT = "h5corpus-facts-1"


def _facts_path(json_sha256: str, what: str) -> tuple[Path, dict[str, Any]] | None:
    d = cache_dir()
    if d is None:
        return None
    fields = {
        "format": _FACTS_CACHE_FORMAT,
        "tokenizer_sha256": json_sha256,
        "what": what,
        "module_sha256": _module_sha256(),
    }
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return d / "facts" / f"{key}.json", fields


def _load_facts(json_sha256: str, what: str) -> dict[str, Any] | None:
    """What this module derived before from the tokenizer JSON with this sha256 (``what``: the
    identity for an EOS choice, or the fast path's verdict), or None. A pure function of the JSON
    bytes, ``what`` and this module's source, all of which are in the key and checked in the file."""
    where = _facts_path(json_sha256, what)
    if where is None:
        return None
    path, fields = where
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict) or got.get("fields") != fields or not isinstance(got.get("facts"), dict):
        return None
    return got["facts"]


def _store_facts(json_sha256: str, what: str, facts: Mapping[str, Any]) -> None:
    where = _facts_path(json_sha256, what)
    if where is None:
        return
    path, fields = where
    _write_cache_file(path, json.dumps({"fields": fields, "facts": dict(facts)}, sort_keys=True).encode("utf-8"))


def _write_cache_file(path: Path, data: bytes) -> None:
    """Write one cache file atomically (temp file + rename). A cache that cannot be written is not
    an error: it only costs the next run the work the file would have saved."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


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
    fields = {"format": _RANKS_CACHE_FORMAT, "tokenizer_sha256": json_sha256, "module_sha256": _module_sha256()}
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
    _write_cache_file(path, head + b"\n" + payload)


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
    # special-token scan uses an empty pattern and runs about 2x slower.
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
    (:func:`cache_dir`): the vocabulary conversion and its checks, a pure function of the JSON and
    of this module's source, are then loaded instead of redone (GPT-2: ~15 ms instead of ~60 ms).
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
    verdict = _load_facts(sha, "fast path")
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
        _store_facts(sha, "fast path", {"kind": "bytes"})
        return BytesEncoder(), ""
    try:
        import tiktoken  # noqa: F401
    except ImportError:  # pragma: no cover - tiktoken is a dependency
        return None, "tiktoken is not installed"
    plan, ranks, why = _tiktoken_plan(d, sha)
    if plan is None or ranks is None:
        _store_facts(sha, "fast path", {"kind": None, "why": why})
        return None, why
    enc, why = _tiktoken_encoding(plan, ranks)
    if enc is None:
        return None, why
    _store_facts(sha, "fast path", {"kind": "tiktoken", **plan})
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
        "module_sha256": _module_sha256(),
        **_versions(),
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
    _write_cache_file(
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
