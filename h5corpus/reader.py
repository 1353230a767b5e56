"""Read one split of a built corpus as one global token stream and a list of documents.

``open_corpus`` reads the manifest and every shard's small index once (offsets, ids, flags);
token reads open shard files lazily, per process, in SWMR mode. A :class:`Corpus` pickles as its
manifest path, split and index arrays, so DataLoader workers (fork or spawn) reopen files themselves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from . import format as fmt
from .format import FormatError, TokenizerIdentity
from .manifest import Manifest, read_manifest


class Corpus:
    """One split of a corpus: global token positions ``[0, num_tokens)`` across its shards in
    manifest order, and documents ``[0, num_documents)``.

    All ranges are half-open and 0-based, in tokens.
    """

    def __init__(self, manifest: Manifest, split: str, *, tokenizer: TokenizerIdentity | None = None) -> None:
        if split not in fmt.SPLITS:
            raise ValueError(f"split must be one of {fmt.SPLITS}, got {split!r}")
        if tokenizer is not None and not tokenizer.same_ids(manifest.tokenizer):
            raise FormatError(
                f"{manifest.path}: corpus was built with tokenizer {manifest.tokenizer.name!r} "
                f"(sha256 {manifest.tokenizer.sha256[:12]}), not {tokenizer.name!r} (sha256 {tokenizer.sha256[:12]})"
            )
        self.manifest = manifest
        self.split = split
        self.entries = manifest.shards_of(split)
        self.paths = [str(manifest.shard_path(e)) for e in self.entries]
        self.dtype = np.dtype(manifest.dtype)
        self.eos_id = manifest.tokenizer.eos_id
        self.chunk_tokens = manifest.chunk_tokens
        #: (shards + 1,) global token offset where each shard starts.
        self.shard_token_starts = np.zeros(len(self.entries) + 1, dtype=np.int64)
        #: (shards + 1,) global document index where each shard starts.
        self.shard_doc_starts = np.zeros(len(self.entries) + 1, dtype=np.int64)
        offs, ids, flags = [np.zeros(1, np.int64)], [], []
        for i, path in enumerate(self.paths):
            o, d, fl = self._read_index(path, self.entries[i].tokens, self.entries[i].documents)
            offs.append(o[1:] + self.shard_token_starts[i])
            ids.append(d)
            flags.append(fl)
            self.shard_token_starts[i + 1] = self.shard_token_starts[i] + self.entries[i].tokens
            self.shard_doc_starts[i + 1] = self.shard_doc_starts[i] + self.entries[i].documents
        #: (documents + 1,) global token offset of each document; last = num_tokens.
        self.doc_offsets = np.concatenate(offs)
        #: (documents, 32) uint8 sha256 of each document's source text.
        self.doc_ids = np.concatenate(ids) if ids else np.zeros((0, fmt.DOC_ID_BYTES), np.uint8)
        #: (documents,) uint8 FLAG_* bits.
        self.doc_flags = np.concatenate(flags) if flags else np.zeros(0, np.uint8)
        self._files: dict[int, h5py.File] = {}
        self._pid = os.getpid()

    def _read_index(self, path: str, n_tokens: int, n_docs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        try:
            f = h5py.File(path, "r", libver="latest", swmr=True)
        except (OSError, FileNotFoundError) as e:
            raise FormatError(f"{path}: cannot open shard ({e}); run h5corpus validate") from None
        with f:
            a = fmt.check_attrs(f.attrs, path)
            if a["split"] != self.split or a["dtype"] != self.manifest.dtype:
                raise FormatError(f"{path}: shard is {a['split']}/{a['dtype']}, manifest says {self.split}/{self.manifest.dtype}")
            o = f[fmt.DOC_OFFSETS][:]
            if o.size != n_docs + 1 or o[-1] != n_tokens:
                raise FormatError(f"{path}: index lists {o.size - 1} documents / {int(o[-1])} tokens, manifest "
                                  f"says {n_docs} / {n_tokens}; run h5corpus validate")
            return o, f[fmt.DOC_IDS][:], f[fmt.DOC_FLAGS][:]

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens in the split, EOS ids included."""
        return int(self.doc_offsets[-1])

    @property
    def num_documents(self) -> int:
        return int(self.doc_offsets.size - 1)

    @property
    def doc_lengths(self) -> np.ndarray:
        """(documents,) int64 tokens per document, EOS included."""
        return np.diff(self.doc_offsets)

    def __len__(self) -> int:
        return self.num_documents

    # -- handles (lazy, per process, never pickled) ----------------------------------------------
    def _file(self, shard: int) -> h5py.File:
        if self._pid != os.getpid():  # forked: never reuse the parent's handles
            self._files = {}
            self._pid = os.getpid()
        f = self._files.get(shard)
        if f is None:
            f = h5py.File(self.paths[shard], "r", libver="latest", swmr=True)
            self._files[shard] = f
        return f

    def close(self) -> None:
        """Close every open shard handle in this process."""
        for f in self._files.values():
            try:
                f.close()
            except Exception:
                pass
        self._files = {}

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_files"] = {}
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._pid = os.getpid()

    # -- reads ------------------------------------------------------------------------------------
    def tokens(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split's global stream, crossing shard boundaries."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start:,}, {stop:,}) outside [0, {self.num_tokens:,})")
        if out is None:
            out = np.empty(stop - start, dtype=self.dtype)
        s = int(np.searchsorted(self.shard_token_starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            base = int(self.shard_token_starts[s])
            end = min(stop, int(self.shard_token_starts[s + 1]))
            if end > pos:
                ds = self._file(s)[fmt.TOKENS]
                ds.read_direct(out, source_sel=np.s_[pos - base : end - base], dest_sel=np.s_[pos - start : end - start])
            pos = end
            s += 1
        return out

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (EOS included unless it was truncated at build time)."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i:,} outside [0, {self.num_documents:,})")
        return self.tokens(int(self.doc_offsets[i]), int(self.doc_offsets[i + 1]))

    def doc_id(self, i: int) -> str:
        """Hex sha256 of document ``i``'s source text."""
        return self.doc_ids[i].tobytes().hex()

    def __repr__(self) -> str:
        return (f"Corpus(split={self.split!r}, shards={len(self.paths)}, documents={self.num_documents:,}, "
                f"tokens={self.num_tokens:,})")


def open_corpus(manifest: str | os.PathLike[str] | Manifest, split: str = "train", *,
                tokenizer: TokenizerIdentity | None = None) -> Corpus:
    """Open ``split`` of the corpus described by ``manifest`` (a path or a parsed Manifest).

    Checks format and version of the manifest and every shard, and, if ``tokenizer`` is given,
    that the corpus was built with the same ids.
    """
    m = manifest if isinstance(manifest, Manifest) else read_manifest(Path(manifest))
    return Corpus(m, split, tokenizer=tokenizer)
