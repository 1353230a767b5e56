"""Tokenizer specs and their identity (:func:`load_tokenizer`), and the cache of facts derived from
a tokenizer's JSON. The encoders that turn text into ids are in :mod:`h5corpus.build.tokenize.encoders`.

A *spec* names a tokenizer:

* ``gpt2`` -- ``openai-community/gpt2`` at revision :data:`GPT2_REVISION`, from the local Hugging Face
  cache (or the hub when reachable). There is no silent fallback: when it is not cached and the hub
  cannot be reached, :class:`TokenizerError` says so and suggests passing a path.
* a path to a ``tokenizer.json`` (or to a folder holding one).
* ``bytes`` -- an offline byte-level tokenizer built with ``tokenizers``: ids 0-255 are the UTF-8
  bytes, 256 is ``<|endoftext|>``. Runs anywhere, needs no download.

Encoding rules (the corpus contract): ids of the text only, no BOS, and special-token text inside a
document (``"<|endoftext|>"`` typed literally) is encoded as ordinary text, so the EOS id appears only
where the build appends it, once, at each real document end.

Caching (:func:`cache_dir`: ``$H5CORPUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/h5corpus``, else
``~/.cache/h5corpus``; ``H5CORPUS_NO_CACHE=1`` turns it off): facts derived from a tokenizer JSON
(its EOS id and vocabulary size, the fast path's verdict, the converted vocabulary, a passed proof)
are remembered under a key made of everything they depend on -- the JSON's sha256, the sha256 of
the source of this module and of the encoder modules, and for proofs the compared
texts and library versions. Cache files are written atomically and a file whose content does not
match its key is ignored.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...storage.format import TokenizerIdentity
from ..hub import hf_cache_dir, hub_offline, hub_unreachable

GPT2_REPO = "openai-community/gpt2"
#: The pinned revision of :data:`GPT2_REPO` that the ``gpt2`` spec loads.
GPT2_REVISION = "607a30d783dfa663caf39e06633721c8d4cfcd7e"
#: Special tokens tried, in order, as the end-of-document id.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BYTES_SPEC = "bytes"
#: Version of the construction of the ``bytes`` tokenizer (part of its identity's revision).
BYTES_REVISION = "h5corpus-bytes-1"


class TokenizerError(ValueError):
    """A tokenizer spec cannot be resolved or loaded (a usage/environment error)."""


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
    unreachable = hub_unreachable()
    if unreachable:  # fail now: huggingface_hub would retry for ~25 s before giving up
        raise TokenizerError(
            f"tokenizer 'gpt2' ({where}) is not in the Hugging Face cache at {cache_dir} and the hub could not be "
            f"reached ({unreachable}); {hint}"
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
        f"{where}: no end-of-document token {list(names)} in this tokenizer (its special tokens: {specials[:12]}); "
        "name one with --eos-token TOKEN (BuildConfig.eos_token)"
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


def _tokenizer_source(spec: str, cache_dir: str | os.PathLike[str] | None) -> tuple[bytes, str, str, str]:
    """The tokenizer.json a spec names: its bytes, text, identity name and revision."""
    if spec == BYTES_SPEC:
        text = bytes_tokenizer_json()
        return text.encode("utf-8"), text, BYTES_SPEC, BYTES_REVISION
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
        return raw, raw.decode("utf-8"), name, revision
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"tokenizer {spec!r}: cannot read {path} ({e})") from None


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
    raw, text, name, revision = _tokenizer_source(spec, cache_dir)
    sha = hashlib.sha256(raw).hexdigest()
    facts = load_facts(sha, f"identity eos={eos_token!r}")
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
    store_facts(sha, f"identity eos={eos_token!r}", {"eos_id": eos, "vocab_size": ident.vocab_size})
    tok = Tokenizer(ident, text)
    tok._json = d
    return tok


# -- cache ----------------------------------------------------------------------------------------
def cache_dir() -> Path | None:
    """Where h5corpus caches proofs: ``$H5CORPUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/h5corpus``, else
    ``~/.cache/h5corpus`` (read at call time). None when ``H5CORPUS_NO_CACHE`` is set (1/true/yes/on)."""
    if os.environ.get("H5CORPUS_NO_CACHE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    if os.environ.get("H5CORPUS_CACHE_DIR"):
        return Path(os.environ["H5CORPUS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "h5corpus"


_SOURCE_SHA256: str | None = None
_VERSIONS: dict[str, str] | None = None


def source_sha256() -> str:
    """sha256 of the source of this module and of :mod:`~h5corpus.build.tokenize.encoders`,
    :mod:`~h5corpus.build.tokenize.tiktoken_bpe` and :mod:`~h5corpus.build.tokenize.proof`: part of every cache key, so
    a change to how facts are derived never reuses an old answer."""
    global _SOURCE_SHA256
    if _SOURCE_SHA256 is None:
        h = hashlib.sha256()
        try:
            for name in (
                "tokenizer.py",
                "encoders.py",
                "tiktoken_bpe.py",
                "proof.py",
                "kitoken_encoder.py",
                "unigram_encoder.py",
                "unigram_kernel.py",
            ):
                h.update((Path(__file__).parent / name).read_bytes())
            _SOURCE_SHA256 = h.hexdigest()
        except OSError:  # pragma: no cover - no source file (frozen): never reuse a cached proof
            _SOURCE_SHA256 = os.urandom(16).hex()
    return _SOURCE_SHA256


def library_versions() -> dict[str, str]:
    """Installed versions of fastokens, tiktoken, kitoken, numba and tokenizers (part of a proof's cache key)."""
    global _VERSIONS
    if _VERSIONS is None:
        out = {}
        for dist in ("fastokens", "tiktoken", "kitoken", "numba", "tokenizers"):
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
        "module_sha256": source_sha256(),
    }
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return d / "facts" / f"{key}.json", fields


def load_facts(json_sha256: str, what: str) -> dict[str, Any] | None:
    """What was derived before from the tokenizer JSON with this sha256 (``what``: the identity for
    an EOS choice, or the fast path's verdict), or None. A pure function of the JSON bytes, ``what``
    and the source (:func:`source_sha256`), all of which are in the key and checked in the file."""
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


def store_facts(json_sha256: str, what: str, facts: Mapping[str, Any]) -> None:
    """Remember ``facts`` for :func:`load_facts`."""
    where = _facts_path(json_sha256, what)
    if where is None:
        return
    path, fields = where
    write_cache_file(path, json.dumps({"fields": fields, "facts": dict(facts)}, sort_keys=True).encode("utf-8"))


def write_cache_file(path: Path, data: bytes) -> None:
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


class PicklesAsJson:
    """For an encoder built from a tokenizer and the ``tokenizer.json`` it runs (``tok``,
    ``json_text``; constructor ``(tok, json_text=...)``): it pickles as those two only and is
    rebuilt from them in each process, its native state made again lazily."""

    tok: Tokenizer
    json_text: str

    def __getstate__(self) -> dict[str, Any]:
        return {"tok": self.tok, "json_text": self.json_text}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["tok"], json_text=state["json_text"])  # type: ignore[misc]
