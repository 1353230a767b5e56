"""The compiled half of :mod:`h5corpus.build.tokenize.unigram_encoder`: ``tokenizers``' Unigram
``encode_optimized`` and ``tokenize``, ported line for line to numba (no Python runs per token).

Everything that decides an id is done as ``tokenizers`` (0.19 to 0.23) does it, in the same order
and the same float64 arithmetic:

* the best path ending at each UTF-8 position, filled from the starts in increasing order, each
  start's trie matches in increasing length; a candidate replaces the node's best only when it is
  strictly greater (the earliest start wins a tie), and a start with no one-character piece adds an
  unknown node of score ``min_score - 10`` over that character;
* the path read back from the end; consecutive nodes whose id is the unknown id (an unknown
  character, or the unknown token's own text) fused into one string, which is looked up in the
  vocabulary, else (byte fallback) spelled as ``<0xXX>`` pieces when all exist, else the unknown id.

The trie is a CSR array of children sorted by byte (:func:`build_trie`); a node's id is the last
vocabulary entry with its bytes, as ``tokenizers``' token-to-id map keeps the last one.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: ``tokenizers``' K_UNK_PENALTY.
UNK_PENALTY = 10.0
#: Trie nodes (the shallowest, numbered first) whose children are also in a dense 256-wide table
#: (4 MiB): one load per byte where most lookups happen, a binary search below.
DENSE_NODES = 4096
#: Words of at most this many bytes are remembered (:func:`new_word_cache`): a word's ids depend on
#: its bytes alone, and most words of a corpus repeat.
CACHE_WORD_BYTES = 48
#: Slots of the word cache's hash table (a power of two; at most half of them are filled).
CACHE_SLOTS = 1 << 18


def build_trie(pieces: list[bytes]) -> tuple[np.ndarray, ...]:
    """The trie of ``pieces``: (child_start, child_byte, child_node, term_id, dense). Node 0 is the
    root, nodes are numbered level by level; node ``n``'s children are
    ``child_node[child_start[n]:child_start[n + 1]]``, sorted by ``child_byte``, and for the first
    :data:`DENSE_NODES` nodes also ``dense[n * 256 + byte]`` (-1: none); ``term_id[n]`` is the last
    piece index spelled by the path to ``n`` (-1: none). Built with numpy, one ``np.unique`` per
    byte position."""
    n = len(pieces)
    lens = np.fromiter(map(len, pieces), dtype=np.int64, count=n)
    width = int(lens.max()) if n else 0
    grid = np.zeros((n, max(width, 1)), dtype=np.uint8)
    flat = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    rows = np.repeat(np.arange(n), lens)
    cols = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)
    grid[rows, cols] = flat
    node = np.zeros(n, dtype=np.int64)  # each piece's node at the current depth
    parents, bytes_, count = [], [], 1
    term = np.full(1, -1, dtype=np.int64)
    for depth in range(width):
        live = np.flatnonzero(lens > depth)
        keys = node[live] * 256 + grid[live, depth]
        uniq, inverse = np.unique(keys, return_inverse=True)
        node[live] = count + inverse
        parents.append(uniq // 256)
        bytes_.append(uniq % 256)
        count += uniq.size
    parent = np.concatenate([np.zeros(0, dtype=np.int64), *parents])
    byte = np.concatenate([np.zeros(0, dtype=np.int64), *bytes_])
    term = np.full(count, -1, dtype=np.int64)
    ends = node[lens > 0]
    ids = np.flatnonzero(lens > 0)
    term[ends] = ids  # fancy assignment keeps the last write: the last piece with these bytes
    order = np.lexsort((byte, parent))  # children grouped by parent, sorted by byte
    child_start = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(np.bincount(parent, minlength=count), out=child_start[1:])
    shallow = parent < DENSE_NODES
    dense = np.full(min(count, DENSE_NODES) * 256, -1, dtype=np.int64)
    dense[parent[shallow] * 256 + byte[shallow]] = np.flatnonzero(shallow) + 1
    return child_start, byte[order].astype(np.uint8), (order + 1).astype(np.int64), term, dense


@njit(cache=True, nogil=True)
def _child(child_start, child_byte, child_node, dense, node, b):
    """The child of ``node`` by byte ``b`` (-1: none): from the dense table, else by binary search."""
    if node < DENSE_NODES:
        return dense[node * 256 + b]
    lo, hi = child_start[node], child_start[node + 1]
    while lo < hi:
        mid = (lo + hi) // 2
        if child_byte[mid] < b:
            lo = mid + 1
        else:
            hi = mid
    if lo < child_start[node + 1] and child_byte[lo] == b:
        return child_node[lo]
    return -1


@njit(cache=True, nogil=True)
def _char_len(lead):
    if lead < 0x80:
        return 1
    if lead < 0xE0:
        return 2
    if lead < 0xF0:
        return 3
    return 4


@njit(cache=True, nogil=True)
def _best_paths(buf, a, b, trie, term_score, unk_id, unk_score, score, start, ids):
    """``encode_optimized``'s table for the word ``buf[a:b]``: position ``i`` (relative) gets the
    best score, start and id of a path ending there (start -1: none yet)."""
    child_start, child_byte, child_node, term_id, dense = trie
    size = b - a
    for i in range(size + 1):
        score[i] = 0.0
        start[i] = -1
        ids[i] = 0
    s = 0
    while s < size:
        here = score[s]
        single = False
        mblen = min(_char_len(buf[a + s]), size - s)
        node = 0
        k = s
        while k < size:
            node = _child(child_start, child_byte, child_node, dense, node, buf[a + k])
            if node < 0:
                break
            k += 1
            tid = term_id[node]
            if tid >= 0:
                cand = term_score[node] + here
                if start[k] == -1 or cand > score[k]:
                    score[k] = cand
                    start[k] = s
                    ids[k] = tid
                if k - s == mblen:
                    single = True
        if not single:
            cand = unk_score + here
            if start[s + mblen] == -1 or cand > score[s + mblen]:
                score[s + mblen] = cand
                start[s + mblen] = s
                ids[s + mblen] = unk_id
        s += mblen
    return size


@njit(cache=True, nogil=True)
def _lookup(buf, a, b, trie):
    """The id of the vocabulary entry spelled by ``buf[a:b]`` (-1: none)."""
    child_start, child_byte, child_node, term_id, dense = trie
    node = 0
    for k in range(a, b):
        node = _child(child_start, child_byte, child_node, dense, node, buf[k])
        if node < 0:
            return -1
    return term_id[node]


@njit(cache=True, nogil=True)
def _emit_unknown(buf, a, b, trie, unk_id, byte_ids, out, n):
    """``tokenize`` on a fused run of unknown-id nodes ``buf[a:b]``: its vocabulary id, else its
    bytes' ``<0xXX>`` ids when all exist (``byte_ids`` is None without byte fallback), else the
    unknown id. Returns the new output length."""
    tid = _lookup(buf, a, b, trie)
    if tid >= 0:
        out[n] = tid
        return n + 1
    if byte_ids.size == 256:
        ok = True
        for k in range(a, b):
            if byte_ids[buf[k]] < 0:
                ok = False
        if ok:
            for k in range(a, b):
                out[n] = byte_ids[buf[k]]
                n += 1
            return n
    out[n] = unk_id
    return n + 1


@njit(cache=True, nogil=True)
def _emit_word(buf, a, size, trie, unk_id, byte_ids, start, ids, path, out, n):
    """The ids of the word ``buf[a:a + size]`` from its best-path table, appended at ``out[n]``."""
    m = 0
    e = size
    while e > 0:  # back from the end: path[m] = the end of the m-th node from the right
        path[m] = e
        m += 1
        e = start[e]
    j = m - 1
    while j >= 0:  # forward; a run of unknown-id nodes is fused
        e = path[j]
        if ids[e] != unk_id:
            out[n] = ids[e]
            n += 1
            j -= 1
            continue
        s = start[e]
        while j > 0 and ids[path[j - 1]] == unk_id:
            j -= 1
        n = _emit_unknown(buf, a + s, a + path[j], trie, unk_id, byte_ids, out, n)
        j -= 1
    return n


def new_word_cache() -> tuple[np.ndarray, ...]:
    """An empty word cache (13 MiB): the ids of words already encoded, by their bytes. A hash
    table of :data:`CACHE_SLOTS` slots (an entry number + 1; 0: empty), per entry its 64-bit hash,
    key offset and length in a byte arena, ids offset and length in an id arena, and the counters
    (entries, key bytes, ids used). When an arena or half the slots are full, it is emptied."""
    entries = CACHE_SLOTS // 2
    return (
        np.zeros(CACHE_SLOTS, dtype=np.int64),
        np.zeros(entries, dtype=np.uint64),
        np.zeros((entries, 4), dtype=np.int64),
        np.zeros(entries * 16, dtype=np.uint8),
        np.zeros(entries * 8, dtype=np.uint32),
        np.zeros(3, dtype=np.int64),
    )


@njit(cache=True, nogil=True)
def _hash(buf, a, b):
    """FNV-1a (64-bit) of ``buf[a:b]``."""
    h = np.uint64(14695981039346656037)
    for k in range(a, b):
        h = (h ^ np.uint64(buf[k])) * np.uint64(1099511628211)
    return h


@njit(cache=True, nogil=True)
def _cached(buf, a, size, h, cache):
    """The cache entry of the word ``buf[a:a + size]`` with hash ``h`` (-1: none), and the free slot
    where it would go."""
    slots, hashes, meta, keys = cache[0], cache[1], cache[2], cache[3]
    mask = slots.size - 1
    i = np.int64(h & np.uint64(mask))
    while slots[i] != 0:
        e = slots[i] - 1
        if hashes[e] == h and meta[e, 1] == size:
            ko = meta[e, 0]
            same = True
            for k in range(size):
                if keys[ko + k] != buf[a + k]:
                    same = False
                    break
            if same:
                return e, i
        i = (i + 1) & mask
    return -1, i


@njit(cache=True, nogil=True)
def _remember(buf, a, size, h, slot, out, n0, n1, cache):
    """Add the word ``buf[a:a + size]`` with ids ``out[n0:n1]`` at the free ``slot``; when the
    cache is full, it is emptied first (so it follows the words of the text at hand)."""
    slots, hashes, meta, keys, idbuf, used = cache
    if n1 - n0 > idbuf.size:
        return
    e, ko, io = used[0], used[1], used[2]
    if e >= hashes.size or ko + size > keys.size or io + n1 - n0 > idbuf.size:  # full: start again
        slots[:] = 0
        used[:] = 0
        e, ko, io = 0, 0, 0
        slot = np.int64(h & np.uint64(slots.size - 1))
    keys[ko : ko + size] = buf[a : a + size]
    idbuf[io : io + n1 - n0] = out[n0:n1]
    hashes[e] = h
    meta[e, 0], meta[e, 1], meta[e, 2], meta[e, 3] = ko, size, io, n1 - n0
    slots[slot] = e + 1
    used[0], used[1], used[2] = e + 1, ko + size, io + n1 - n0


@njit(cache=True, nogil=True)
def encode_docs(buf, doc_off, sep, trie, term_score, unk_id, unk_score, byte_ids, cache, out, out_off):
    """Encode every document ``buf[doc_off[i]:doc_off[i + 1]]`` (already Metaspace-replaced and
    prefixed), split into words before each occurrence of the bytes ``sep`` (``MergedWithNext``),
    each word on its own as ``tokenizers`` does (a word in ``cache``: its remembered ids; a new word
    of at most :data:`CACHE_WORD_BYTES`: remembered). Ids go to ``out`` (at least ``len(buf)``
    long), document ``i``'s at ``out[out_off[i]:out_off[i + 1]]``."""
    longest = 1
    for i in range(doc_off.size - 1):
        longest = max(longest, doc_off[i + 1] - doc_off[i])
    score = np.empty(longest + 1, dtype=np.float64)
    start = np.empty(longest + 1, dtype=np.int64)
    ids = np.empty(longest + 1, dtype=np.int64)
    path = np.empty(longest + 1, dtype=np.int64)
    n = 0
    w = sep.size
    out_off[0] = 0
    for i in range(doc_off.size - 1):
        a, end = doc_off[i], doc_off[i + 1]
        while a < end:
            b = a + 1
            while b < end and not (buf[b] == sep[0] and b + w <= end and _at(buf, b, sep)):
                b += 1
            size = b - a
            small = size <= CACHE_WORD_BYTES
            if small:
                h = _hash(buf, a, b)
                e, slot = _cached(buf, a, size, h, cache)
                if e >= 0:
                    io, m = cache[2][e, 2], cache[2][e, 3]
                    out[n : n + m] = cache[4][io : io + m]
                    n += m
                    a = b
                    continue
            n0 = n
            _best_paths(buf, a, b, trie, term_score, unk_id, unk_score, score, start, ids)
            n = _emit_word(buf, a, size, trie, unk_id, byte_ids, start, ids, path, out, n)
            if small:
                _remember(buf, a, size, h, slot, out, n0, n, cache)
            a = b
        out_off[i + 1] = n
    return n


@njit(cache=True, nogil=True)
def _at(buf, k, sep):
    for j in range(sep.size):
        if buf[k + j] != sep[j]:
            return False
    return True
