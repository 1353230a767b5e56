"""Tiny real chat tokenizers and conversations for the fine-tuning tests (no downloads).

A byte-level BPE trained here with ``tokenizers`` on the test conversations (so merges straddle
word and turn boundaries), with ChatML or Llama-3 special tokens, saved as ``tokenizer.json`` plus
a ``tokenizer_config.json`` holding the chat template; :func:`hf_tokenizer` wraps the same files
in transformers' ``PreTrainedTokenizerFast`` for the oracle (``apply_chat_template``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# ChatML (Qwen-style): the assistant's content and <|im_end|> are the generation; the header and
# the newline after <|im_end|> are not. {% generation %} lets transformers compute its own mask.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3 style: BOS written by the template, headers, <|eot_id|> closes every turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
STYLES = {
    "chatml": {
        "template": CHATML_TEMPLATE,
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "config": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None},
    },
    "llama3": {
        "template": LLAMA3_TEMPLATE,
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|end_of_text|>"},
    },
}

WORDS = (
    "the cat sat on a mat while two dogs ran far away from home and people asked why answers came slowly "
    "please explain how rivers form tell me a story about seven small robots compute twelve plus nine"
).split()


def conversations(n: int, seed: int = 0, long_every: int = 7) -> list[dict]:
    """``n`` records: multi-turn chats with a system prompt (every ``long_every``-th one long,
    so chunking cuts it), some prompt/completion pairs and some text with no_loss_ranges."""
    rng = random.Random(seed)

    def sent(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + rng.choice([".", "?", "!"])

    out: list[dict] = []
    for i in range(n):
        if i % 5 == 3:
            out.append({"prompt": f"Q{i}: {sent(6)}\nA:", "completion": f" {sent(8)}"})
            continue
        turns = rng.randint(1, 3) * (6 if i % long_every == 0 else 1)
        msgs = [{"role": "system", "content": f"You are helper {i}."}]
        for _ in range(turns):
            msgs.append({"role": "user", "content": sent(rng.randint(3, 10))})
            msgs.append({"role": "assistant", "content": sent(rng.randint(2, 12))})
        out.append({"messages": msgs})
    return out


def make_tokenizer(folder: Path, style: str, texts: list[str], vocab_size: int = 420) -> Path:
    """Train a byte-level BPE on ``texts`` with ``style``'s special tokens; write tokenizer.json and
    tokenizer_config.json (with the chat template) into ``folder``; return the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = STYLES[style]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=spec["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    cfg = {k: v for k, v in spec["config"].items() if v is not None}
    cfg.update({"chat_template": spec["template"], "tokenizer_class": "PreTrainedTokenizerFast"})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return folder


def hf_tokenizer(folder: Path):
    """The same tokenizer as transformers' ``PreTrainedTokenizerFast`` (the oracle's)."""
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    kw = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token") if k in cfg}
    return PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), chat_template=cfg["chat_template"], **kw
    )


def training_texts(records: list[dict]) -> list[str]:
    """Plain texts to train the BPE on (contents only: special tokens are added, never merged)."""
    out = []
    for r in records:
        if "messages" in r:
            out += [m["content"] for m in r["messages"]] + [m["role"] for m in r["messages"]]
        elif "prompt" in r:
            out.append(r["prompt"] + r["completion"])
        else:
            out.append(r["text"])
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
