"""Whether a ``.zst`` file ends where its last zstd frame does (RFC 8878): the zstd stream reader
delivers the data of every complete block and then ends silently, so a file cut at a block
boundary would otherwise read as complete. Used by the JSONL reader (:mod:`~h5corpus.build.input.records`)."""

from __future__ import annotations

import os
from typing import Any


class Truncated(Exception):
    """A compressed stream ended before its end marker (``str``: what is missing, or empty)."""


class StreamError(Exception):
    """A compressed file holds something that is not part of its stream."""


#: zstd frame magic numbers (RFC 8878): a frame, and the 16 skippable-frame magics (low 4 bits free).
_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE = 0x184D2A50


def zstd_end_problem(path: str) -> None:
    """Walk the frames of a ``.zst`` file by their headers (RFC 8878: frame header, then blocks
    with 3-byte headers up to the one flagged last, then the optional 4-byte checksum; skippable
    frames by their size). Raises :class:`Truncated` when the file ends inside a frame and
    :class:`StreamError` when bytes after a frame are not one. The decompressor has checked
    every block's content (and the checksum); what it cannot tell is whether the data stopped at a
    block boundary. Cost: one 3-byte read per block (a block holds up to 128 KiB)."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        pos = 0
        while pos < size:
            fh.seek(pos)
            head = fh.read(4)
            if len(head) < 4:
                raise Truncated(f"the frame at byte {pos:,} has no complete header")
            magic = int.from_bytes(head, "little")
            if magic & 0xFFFFFFF0 == _ZSTD_SKIPPABLE:
                n = fh.read(4)
                end = pos + 8 + int.from_bytes(n, "little")
                if len(n) < 4 or end > size:
                    raise Truncated(f"the skippable frame at byte {pos:,} is cut short")
                pos = end
                continue
            if magic != _ZSTD_MAGIC:
                raise StreamError(f"the bytes at offset {pos:,} are not a zstd frame")
            pos = _zstd_frame_end(fh, pos, size)


def _zstd_frame_end(fh: Any, start: int, size: int) -> int:
    """Offset after the zstd frame at ``start`` (its magic just read); raises :class:`Truncated`."""
    d = fh.read(1)
    if not d:
        raise Truncated(f"the frame at byte {start:,} has no complete header")
    fhd = d[0]
    single = (fhd >> 5) & 1
    header = 1 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + (single, 2, 4, 8)[fhd >> 6]
    pos = start + 4 + header
    while True:
        fh.seek(pos)
        bh = fh.read(3)
        if len(bh) < 3:
            raise Truncated(f"the frame at byte {start:,} has no last block")
        v = int.from_bytes(bh, "little")
        pos += 3 + (1 if (v >> 1) & 3 == 1 else v >> 3)  # an RLE block stores one byte
        if pos > size:
            raise Truncated(f"a block of the frame at byte {start:,} is cut short")
        if v & 1:
            break
    if (fhd >> 2) & 1:  # content checksum
        pos += 4
        if pos > size:
            raise Truncated(f"the frame at byte {start:,} has no complete checksum")
    return pos
