"""Fine-tuning records -> one text per document and the character ranges trained on.

Three record shapes (JSON objects, one per line of a ``.jsonl`` file; docs/BUILD.md, "Fine-tuning"):

* ``{"prompt": str, "completion": str}``: the text is ``prompt + completion``; trained on: the
  completion (``loss_on="all"``: everything).
* ``{"messages": [{"role": str, "content": str}, ...]}``: the text is the conversation rendered
  with the tokenizer's own chat template (``tokenizer_config.json``'s Jinja ``chat_template``,
  rendered exactly as transformers' ``apply_chat_template`` does: :class:`ChatTemplate`); trained
  on (``loss_on="assistant"``): every assistant turn's content **and the marker that closes it**
  (ChatML ``<|im_end|>``, Llama-3 ``<|eot_id|>``), never the header that opens it (the
  generation prompt, ``<|im_start|>assistant\\n``); ``"completion"``: the last assistant turn only;
  ``"all"``: everything.
* ``{"text": str, "no_loss_ranges": [[start, end], ...]}``: character ranges *not* trained on
  (datatrove's convention); the rest is. A plain ``{"text": ...}`` record is trained on whole.

An assistant turn's range is found by rendering prefixes: ``P`` = the messages before it with the
generation prompt, ``Q`` = the messages up to it; the turn adds ``Q[len(P):]``, whose trailing
whitespace is dropped (the newline a template writes after the closing marker). ``P`` must be a
prefix of ``Q`` and ``Q`` of the whole conversation, else the record is refused (a template that
rewrites earlier turns cannot be masked by prefixes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ..config import LOSS_ON

__all__ = ["LOSS_ON", "ChatTemplate", "RecordError", "SFTText", "sft_text"]


class RecordError(ValueError):
    """A fine-tuning record that cannot be turned into a document (the message names the field)."""


@dataclass(frozen=True)
class SFTText:
    """One document's text and its trained-on character ranges (sorted, disjoint, ``[a, b)``)."""

    text: str
    spans: tuple[tuple[int, int], ...]


def _compile(template: str) -> Any:
    """The template compiled as transformers compiles chat templates
    (``transformers/utils/chat_template_utils.py``): an ``ImmutableSandboxedEnvironment`` with
    ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``{% generation %}`` tag (rendered as
    its body), the ``tojson`` filter without HTML escaping, ``raise_exception`` and
    ``strftime_now``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


#: The named special tokens transformers passes to a template (``special_tokens_map``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplate:
    """A tokenizer's chat template with the special-token strings it may use (``bos_token``, ...)."""

    def __init__(self, template: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = template
        self.special_tokens = dict(special_tokens or {})
        self._compiled: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "special_tokens": self.special_tokens, "_compiled": None}

    @classmethod
    def from_config(cls, path: str | Path) -> ChatTemplate:
        """From a ``tokenizer_config.json`` (or the folder holding it): ``chat_template`` (a string,
        or a list of ``{"name", "template"}`` whose ``default`` entry is used) and the named special
        tokens (strings or ``{"content": ...}`` objects)."""
        p = Path(path)
        p = p / "tokenizer_config.json" if p.is_dir() else p
        try:
            cfg = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise RecordError(f"{p}: cannot read the tokenizer config ({e})") from None
        t = cfg.get("chat_template") if isinstance(cfg, dict) else None
        if isinstance(t, list):
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        if not isinstance(t, str):
            raise RecordError(f"{p}: no chat_template (a Jinja string) in the tokenizer config")
        special = {}
        for k in SPECIAL_TOKEN_NAMES:
            v = cfg.get(k)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                special[k] = v
        return cls(t, special)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation as ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``."""
        if self._compiled is None:
            self._compiled = _compile(self.source)
        return self._compiled.render(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )


def _str_field(rec: Mapping[str, Any], key: str) -> str:
    v = rec.get(key)
    if not isinstance(v, str):
        raise RecordError(f"field {key!r} must be a string, got {type(v).__name__}")
    return v


def _messages(rec: Mapping[str, Any]) -> list[dict[str, Any]]:
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RecordError("field 'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RecordError(f"messages[{i}] must be an object with string 'role' and 'content'")
    return msgs


def assistant_spans(template: ChatTemplate, msgs: list[dict[str, Any]], last_only: bool) -> SFTText:
    """The rendered conversation and each assistant turn's range (content + closing marker,
    trailing whitespace dropped; module docstring)."""
    import jinja2

    try:
        full = template.render(msgs)
        spans = []
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        for i in turns[-1:] if last_only else turns:
            p = template.render(msgs[:i], add_generation_prompt=True)
            q = template.render(msgs[: i + 1])
            if not (q.startswith(p) and full.startswith(q)):
                raise RecordError(
                    f"messages[{i}]: the chat template does not render the conversation's prefixes as prefixes "
                    "(it rewrites earlier turns); assistant ranges cannot be found"
                )
            end = len(q.rstrip())
            if end > len(p):
                spans.append((len(p), end))
    except jinja2.TemplateError as e:
        raise RecordError(f"the chat template fails on this conversation ({e})") from None
    return SFTText(full, tuple(spans))


def complement(n: int, ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``[0, n)`` minus ``ranges`` (any order, may overlap), as sorted disjoint ranges."""
    out, at = [], 0
    for a, b in sorted(ranges):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < n:
        out.append((at, n))
    return tuple(out)


def _no_loss(rec: Mapping[str, Any], text: str) -> tuple[tuple[int, int], ...]:
    ranges = rec.get("no_loss_ranges")
    if not isinstance(ranges, list):
        raise RecordError("field 'no_loss_ranges' must be a list of [start, end] character ranges")
    out = []
    for k, r in enumerate(ranges):
        ok = isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
        if not ok or not 0 <= r[0] <= r[1] <= len(text):
            raise RecordError(f"no_loss_ranges[{k}] must be [start, end] with 0 <= start <= end <= {len(text)}")
        out.append((r[0], r[1]))
    return complement(len(text), out)


def sft_text(rec: Any, template: ChatTemplate | None, loss_on: str) -> SFTText:
    """One record (a parsed JSON value) as a document text and its trained-on character ranges
    (module docstring). Raises :class:`RecordError` naming the field."""
    if not isinstance(rec, dict):
        raise RecordError(f"a fine-tuning record is a JSON object, got {type(rec).__name__}")
    if "messages" in rec:
        if template is None:
            raise RecordError("a 'messages' record needs a chat template (--chat-template, or the tokenizer's config)")
        got = assistant_spans(template, _messages(rec), last_only=loss_on == "completion")
        return SFTText(got.text, ((0, len(got.text)),)) if loss_on == "all" else got
    if "prompt" in rec or "completion" in rec:
        prompt, completion = _str_field(rec, "prompt"), _str_field(rec, "completion")
        text = prompt + completion
        return SFTText(text, ((0 if loss_on == "all" else len(prompt), len(text)),))
    text = _str_field(rec, "text")
    if "no_loss_ranges" in rec and loss_on != "all":
        return SFTText(text, _no_loss(rec, text))
    return SFTText(text, ((0, len(text)),))
