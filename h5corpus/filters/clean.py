"""Cleaning: HTML to main text, Unicode repair, whitespace normalization.

Each function takes a document's text and returns the cleaned text (``html_to_text`` may return
None: the page had no main text). Plain text is never touched by :func:`html_to_text` callers
because :func:`looks_like_html` is checked first; Unicode repair and whitespace normalization are
separate opt-in steps.

- HTML: only documents that *are* HTML (:func:`looks_like_html`: a doctype or ``<html`` first, or
  a known tag first and a closing tag last) are extracted, with trafilatura (main content without
  navigation, headers, footers, comments; tables kept), falling back for fragments its main
  extractor rejects to trafilatura's ``baseline``, then to the text content of the lxml tree
  (scripts and styles removed).
- Unicode: ftfy with a conservative configuration (:data:`FTFY_CONFIG`): mojibake, C1 controls,
  latin ligatures, surrogates, terminal escapes, control characters, NFC. It does not decode HTML
  entities, convert full-width characters or straighten quotes.
- Whitespace: CR/CRLF to LF, Unicode spaces and tabs to one space, no spaces at line ends or
  starts, at most one blank line in a row, no leading/trailing blank lines.
"""

from __future__ import annotations

import re

# ---------------------------------------------------------------------------------------------
# HTML

_HTML_PROBE_CHARS = 2048
_FULL_PAGE = re.compile(
    r"(?:<\?xml[^>]*>\s*)?(?:<!--.*?-->\s*)*(?:<!doctype\s+html|<html[\s>])", re.IGNORECASE | re.DOTALL
)
_HTML_TAG = re.compile(
    r"<(?:!--|(?:html|head|body|meta|title|link|script|style|div|span|p|a|article|section|main|"
    r"header|footer|nav|aside|table|ul|ol|li|h[1-6]|br|img|form)[\s/>])",
    re.IGNORECASE,
)


def looks_like_html(text: str) -> bool:
    """True when ``text`` is an HTML page or fragment: it starts (after blanks and a BOM) with a
    doctype or ``<html``, or with a known HTML tag and it ends with a closing tag. Plain text that
    merely contains tags ("use <b> for bold", a tutorial opening with "<table>: ...") is not HTML.
    Cost: a look at the first 2 KiB and the last 256 characters."""
    head = text[:_HTML_PROBE_CHARS].lstrip("\ufeff \t\r\n")
    if not head.startswith("<"):
        return False
    if _FULL_PAGE.match(head):
        return True
    if _HTML_TAG.match(head) is None:
        return False
    tail = text[-256:].rstrip()
    return tail.endswith(">") and "</" in tail


def html_to_text(html: str) -> str | None:
    """Main text of an HTML page (paragraphs separated by newlines), or None when the page has no
    main text. Navigation, headers/footers, comments and scripts are dropped by trafilatura."""
    try:
        import trafilatura
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("HTML cleaning needs trafilatura: pip install 'h5corpus[filters]'") from e
    text = trafilatura.extract(
        html,
        include_comments=False,
        include_tables=True,
        include_images=False,
        include_links=False,
        deduplicate=False,
        with_metadata=False,
        output_format="txt",
    )
    if not text or not text.strip():
        # Short fragments (a few <p>) are below trafilatura's main-content thresholds: take
        # its baseline (article/paragraph text), else the text content of the parsed markup.
        _tree, text, _n = trafilatura.baseline(html)
    if not text or not text.strip():
        text = _text_content(html)
    if not text or not text.strip():
        return None
    return normalize_whitespace(text)


def _text_content(html: str) -> str:
    import lxml.html

    try:
        root = lxml.html.fromstring(html)
    except (ValueError, lxml.etree.ParserError):
        return ""
    for bad in root.xpath("//script|//style|//noscript"):
        bad.drop_tree()
    return root.text_content()


# ---------------------------------------------------------------------------------------------
# Unicode repair


def _ftfy_config():
    try:
        import ftfy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Unicode repair needs ftfy: pip install 'h5corpus[filters]'") from e
    return ftfy.TextFixerConfig(
        unescape_html=False,  # HTML is the HTML step's business; "&amp;" in plain text stays
        fix_character_width=False,  # keep full-width CJK punctuation and half-width katakana
        uncurl_quotes=False,  # typographic quotes are correct text
        fix_line_breaks=False,  # line breaks belong to whitespace normalization
        explain=False,
    )


FTFY_CONFIG = None  # built lazily (ftfy is optional)


def fix_unicode(text: str) -> str:
    """Repair Unicode with ftfy under :data:`FTFY_CONFIG`; output equals
    ``ftfy.fix_text(text, FTFY_CONFIG)``.

    Fast paths (same result, tested on the dev corpus): ASCII text can only lose terminal escapes
    and control characters; text in which ftfy's mojibake detector finds nothing is fixed as one
    segment with the encoding step off instead of line by line."""
    global FTFY_CONFIG
    import ftfy
    from ftfy import fixes
    from ftfy.badness import is_bad

    if FTFY_CONFIG is None:
        FTFY_CONFIG = _ftfy_config()
    if text.isascii():
        if _ASCII_CONTROL.search(text) is None:
            return text
        return fixes.remove_control_chars(fixes.remove_terminal_escapes(text))
    if is_bad(text):
        return ftfy.fix_text(text, FTFY_CONFIG)
    fixed, _ = ftfy.fix_and_explain(text, FTFY_CONFIG._replace(fix_encoding=False))
    return fixed


_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f]")

# ---------------------------------------------------------------------------------------------
# Whitespace

# Only runs that change: 2+ horizontal whitespace, or one that is not a plain space (tab, NBSP, ...).
_HSPACE = re.compile(r"[^\S\n]{2,}|[^\S \n]")
_EDGE_SPACE = re.compile(r" \n ?|\n ")
_BLANK_LINES = re.compile(r"\n{3,}")


def normalize_whitespace(text: str) -> str:
    """CRLF/CR to LF; runs of spaces, tabs and Unicode spaces to one space; no space at the start
    or end of a line; at most one blank line in a row; stripped. Idempotent."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _HSPACE.sub(" ", text)
    text = _EDGE_SPACE.sub("\n", text)
    text = _BLANK_LINES.sub("\n\n", text)
    return text.strip()
