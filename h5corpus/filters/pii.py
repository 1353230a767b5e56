"""PII scrubbing: e-mail addresses, phone numbers and IP addresses replaced with placeholders.

:func:`scrub_pii` returns the scrubbed text and the number of replacements per kind (counters
``pii:email``, ``pii:phone``, ``pii:ip``). Structured PII only (regular expressions validated in
code); names and street addresses need a NER model and are out of scope.

What is replaced, and what is deliberately left alone:

- **E-mail** -> ``<EMAIL>``: ``local@domain.tld`` with a dotted domain and an alphabetic TLD.
  ``user@localhost`` and ``@handles`` are not addresses.
- **IPv4** -> ``<IP>``: four dot-separated numbers 0-255 not glued to other digits, dots or letters.
  Kept: version strings (``v1.2.3.4``, "version 10.0.0.1", "release ...", "build ..."), numbers with
  a fifth part (``1.2.3.4.5``), out-of-range parts (``300.1.1.1``, dates like ``2023.10.12.1``) and
  the non-identifying addresses ``0.0.0.0``, ``127.0.0.1``, ``255.255.255.255``.
- **IPv6** -> ``<IP>``: candidates of hex groups and colons validated by :mod:`ipaddress` (needs a
  ``::`` or all 8 groups, so clock times ``12:30:45`` never match) with at least one digit and four
  hex digits (so code paths like ``a::b`` or ``dead::beef`` stay). Kept: ``::``, ``::1``.
- **Phone** -> ``<PHONE>``: (a) international numbers starting with ``+`` and a country code, 8-15
  digits in groups separated by spaces, dots, dashes or a parenthesized area code; (b) North
  American numbers ``(555) 123-4567``, ``555-123-4567``, ``555.123.4567`` (one separator style);
  (c) after a keyword (tel, phone, fax, mobile, call, ...): 7-15 digits in groups. Kept: dates
  (``2023-10-12``, ``12/10/2023``), years and ranges (``1990-1995``), plain numbers and amounts
  (``1,234,567``, ``5551234567`` without a keyword), ISBN-like or 4-4-4 groupings, times.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

import numpy as np

EMAIL = "<EMAIL>"
PHONE = "<PHONE>"
IP = "<IP>"

KINDS: tuple[str, ...] = ("email", "phone", "ip")
"""Counter suffixes: ``pii:email``, ``pii:phone``, ``pii:ip`` (number of replacements)."""

_EMAIL_RE = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
    r"[A-Za-z]{2,24}(?![\w-])"
)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4_RE = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d)")
_VERSION_CONTEXT = re.compile(r"(?:\bv|\bversion|\bver\.?|\brelease|\bbuild|\brev\.?|\bfirmware)\s*$", re.IGNORECASE)
_KEEP_IPS = frozenset({"0.0.0.0", "127.0.0.1", "255.255.255.255", "::", "::1"})
# Candidates only (hex groups and colons, optionally an IPv4 tail); ipaddress decides.
_IPV6_RE = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{0,4})(?![\w:])")
_PHONE_INTL_RE = re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}){1,6}(?![\w])")
_PHONE_NANP_RE = re.compile(r"(?<![\w.+/-])(?:\(\d{3}\)[ ]?\d{3}-\d{4}|\d{3}([-.])\d{3}\1\d{4})(?![\w]|[-.]\d)")
_PHONE_KEYWORD_RE = re.compile(
    r"(?:\b(?:tel|telephone|phone|ph|fax|mobile|mob|cell|call|whatsapp|t[eé]l[eé]fono|telefon|tél)\b\.?\s*(?:[^\W\d_]+\s*)?:?\s*)"
    r"(\(?\d{2,5}\)?(?:[ ./-]?\d{2,5}){1,5})(?![\w]|[-./]\d)",
    re.IGNORECASE,
)


# Cheap gates (literal-prefixed, so `re` skips ahead fast) and the candidate regions for phones.
_IPV4_GATE = re.compile(r"\.\d{1,3}\.\d")
_IPV6_GATE = re.compile(r":[0-9A-Fa-f]{0,4}:")
_NUMBERISH = re.compile(r"\d[\d .()/-]{5,}\d")
_PLACEHOLDER = {"email": EMAIL, "phone": PHONE, "ip": IP}


# ASCII text: the same spans as _NUMBERISH from a bytes regex over a class map (digit -> "0",
# separator -> ".", other -> "x"), ~4x faster; for ASCII, \d is [0-9] and byte = character offsets.
_NUMBERISH_CLASS = bytes(
    ord("0") if 48 <= c <= 57 else ord(".") if chr(c) in " .()/-" else ord("x") for c in range(256)
)
_NUMBERISH_BYTES = re.compile(rb"0[0.]{5,}0")


_DIGIT_PREFIXES: re.Pattern[bytes] | None = None


def digit_prefix_pattern() -> re.Pattern[bytes]:
    """A bytes regex matching the first two UTF-8 bytes of every non-ASCII decimal digit (what
    ``\\d`` matches besides 0-9: ``str.isdecimal``, Unicode category Nd), e.g. ``b"\\xd9\\xa0"``
    for U+0660. Built once per process from the running Python's Unicode tables (~0.05 s)."""
    global _DIGIT_PREFIXES
    if _DIGIT_PREFIXES is None:
        global _NUMBERISH_CLASS_U
        prefixes = sorted({chr(c).encode("utf-8")[:2] for c in range(0x80, 0x110000) if chr(c).isdecimal()})
        _DIGIT_PREFIXES = re.compile(b"|".join(re.escape(p) for p in prefixes))
        # the class map, with the lead bytes of those digits as "d" (a non-digit, like "x")
        table = bytearray(_NUMBERISH_CLASS)
        for p in prefixes:
            table[p[0]] = ord("d")
        _NUMBERISH_CLASS_U = bytes(table)
    return _DIGIT_PREFIXES


_NUMBERISH_CLASS_U = b""


def _numberish_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the :data:`_NUMBERISH` matches of ``text`` (the candidate phone regions).

    Fast path, exact: when the text holds no non-ASCII decimal digit, ``\\d`` can only match 0-9,
    so the spans are those of a bytes regex over a class map of the UTF-8 bytes (every non-ASCII
    byte maps to "x", like any other non-digit, non-separator character), converted from byte to
    character offsets."""
    if text.isascii():
        return [m.span() for m in _NUMBERISH_BYTES.finditer(text.encode("ascii").translate(_NUMBERISH_CLASS))]
    data = text.encode("utf-8", errors="surrogatepass")
    digits = digit_prefix_pattern()
    classes = data.translate(_NUMBERISH_CLASS_U)
    if b"d" in classes and digits.search(data) is not None:
        return [m.span() for m in _NUMBERISH.finditer(text)]
    spans = [m.span() for m in _NUMBERISH_BYTES.finditer(classes)]
    if not spans:
        return spans
    # characters before byte offset b = bytes before b that start a character (not 10xxxxxx)
    starts = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum((np.frombuffer(data, dtype=np.uint8) & 0xC0) != 0x80, out=starts[1:])
    flat = starts[np.asarray(spans, dtype=np.int64).ravel()].tolist()
    return list(zip(flat[::2], flat[1::2]))


def _digits(s: str) -> int:
    return sum(c.isdigit() for c in s)


def pii_spans(text: str) -> list[tuple[int, int, str]]:
    """Non-overlapping ``(start, end, kind)`` character spans of the PII in ``text``, sorted.
    The e-mail and IP regexes search only around their anchors (:func:`_anchored`)."""
    found: list[tuple[int, int, str]] = []
    if "@" in text:
        found.extend((m.start(), m.end(), "email") for m in _anchored(text, _EMAIL_RE, _EMAIL_AT, _EMAIL_RUN, 64))
    if _IPV6_GATE.search(text) is not None:
        for m in _anchored(text, _IPV6_RE, _IPV6_GATE, _IPV6_RUN, 4):
            if _is_ipv6(m.group(0)):
                found.append((m.start(), m.end(), "ip"))
    if _IPV4_GATE.search(text) is not None:
        for m in _anchored(text, _IPV4_RE, _IPV4_GATE, _IPV4_RUN, 3):
            s = m.group(0)
            if s not in _KEEP_IPS and _VERSION_CONTEXT.search(text, max(0, m.start() - 16), m.start()) is None:
                found.append((m.start(), m.end(), "ip"))
    n = len(text)
    for a, b in _numberish_spans(text):
        if b - a < 7 or _digits(text[a:b]) < 7:  # every phone pattern has 7+ digits
            continue
        lo, hi = max(0, a - 48), min(n, b + 3)  # room for "+", "(", a keyword, and lookaheads
        if "+" in text[lo:a]:
            for m in _PHONE_INTL_RE.finditer(text, lo, hi):
                if m.end() > a and 8 <= _digits(m.group(0)) <= 15:
                    found.append((m.start(), m.end(), "phone"))
        for m in _PHONE_NANP_RE.finditer(text, lo, hi):
            if m.end() > a:
                found.append((m.start(), m.end(), "phone"))
        for m in _PHONE_KEYWORD_RE.finditer(text, lo, hi):
            if m.end(1) > a and 7 <= _digits(m.group(1)) <= 15:
                found.append((m.start(1), m.end(1), "phone"))
    if not found:
        return found
    found.sort(key=lambda s: (s[0], -s[1]))
    out = []
    end = -1
    for s in found:
        if s[0] >= end:
            out.append(s)
            end = s[1]
    return out


_EMAIL_AT = re.compile(r"@")
_EMAIL_RUN = re.compile(r"@[A-Za-z0-9.-]*")  # the "@" and the domain characters after it
_IPV4_RUN = re.compile(r"[\d.]*")
_IPV6_RUN = re.compile(r"[0-9A-Fa-f:.\d]*")


def _anchored(
    text: str, regex: re.Pattern[str], gate: re.Pattern[str], run: re.Pattern[str], back: int
) -> list[re.Match[str]]:
    """The matches of ``regex.finditer(text)``, searching only around the anchors (``gate``
    matches, overlapping, in order).

    For e-mails the anchor is the "@", for IPv4 addresses the first ".", for IPv6 addresses the
    first ":" (a gate match starts there in every match); a match starts at most ``back``
    characters before its anchor (local part 64, octet 3, hex group 4) and, from the anchor on,
    holds only characters of ``run``. Every character the regex looks at for such a start lies
    between the character before the start and the first character after that run, so a search
    from ``anchor - back`` (no earlier than the end of the last match) to there sees what a scan
    of the whole text sees; a match found starting at or before the anchor is the next match
    (a match starting later has a later anchor)."""
    out = []
    pos = 0
    g = gate.search(text)
    while g is not None:
        a = g.start()
        m = regex.search(text, max(pos, a - back), run.match(text, a).end() + 1)
        if m is not None and m.start() <= a:
            out.append(m)
            pos = m.end()
            g = gate.search(text, pos)
        else:
            g = gate.search(text, a + 1)
    return out


def _is_ipv6(s: str) -> bool:
    try:
        ipaddress.IPv6Address(s)
    except ValueError:
        return False
    # "a::b", "dead::beef" are C++/Rust paths more often than addresses: need a digit and at
    # least 4 hex digits.
    hexdigits = sum(c in "0123456789abcdefABCDEF" for c in s)
    return s not in _KEEP_IPS and _digits(s) > 0 and hexdigits >= 4


def scrub_pii(text: str) -> tuple[str, dict[str, int]]:
    """``(scrubbed text, {kind: replacements})`` with only kinds that occurred. Placeholders:
    ``<EMAIL>``, ``<PHONE>``, ``<IP>``. Text without PII is returned as is (the same object)."""
    spans = pii_spans(text)
    if not spans:
        return text, {}
    counts: Counter[str] = Counter()
    parts = []
    pos = 0
    for a, b, kind in spans:
        parts.append(text[pos:a])
        parts.append(_PLACEHOLDER[kind])
        counts[kind] += 1
        pos = b
    parts.append(text[pos:])
    return "".join(parts), dict(counts)
