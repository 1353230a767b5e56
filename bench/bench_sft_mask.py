"""Bytes per token of the fine-tuning loss mask (``/loss_spans``) on a chat corpus, against the
alternatives a format could store (a bit per token, a byte per token).

Conversations are made from the dev corpus (``$H5CORPUS_SHARED/corpora/dev``): a system line, then
1-4 turns of a user question (a paragraph's first ~300 characters) and an assistant answer (the next
paragraph, up to 2,000 characters), rendered with a ChatML template; the GPT-2 tokenizer with
``<|im_start|>`` and ``<|im_end|>`` added as special tokens. The mask is measured as stored: the
HDF5 storage of ``/loss_spans`` (allocated chunks) per token, and its ranges per document.

    python bench/bench_sft_mask.py [--conversations 3000] [--out bench/results/sft-mask.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import h5py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._report import emit  # noqa: E402
from h5corpus.build.config import BuildConfig  # noqa: E402
from h5corpus.build.run.runner import build_corpus  # noqa: E402
from h5corpus.storage.manifest import read_manifest  # noqa: E402

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def paragraphs(shared: Path, limit: int) -> list[str]:
    out: list[str] = []
    for f in sorted((shared / "corpora" / "dev").glob("*.jsonl")):
        for line in f.open(encoding="utf-8"):
            for p in json.loads(line)["text"].split("\n\n"):
                if len(p.strip()) > 80:
                    out.append(p.strip())
            if len(out) > limit:
                return out
    return out


def conversations(paras: list[str], n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "You are a helpful assistant."}]
        for _ in range(rng.randint(1, 4)):
            k = rng.randrange(len(paras) - 1)
            msgs.append({"role": "user", "content": paras[k][:300]})
            msgs.append({"role": "assistant", "content": paras[k + 1][:2000]})
        out.append({"messages": msgs})
    return out


def tokenizer_folder(shared: Path, folder: Path) -> Path:
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(shared / "tokenizers" / "gpt2" / "tokenizer.json"))
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    return folder


def loader_cost(manifest: Path) -> dict:
    """One epoch of BestFitDataset (4,096 x 8) over the train split: seconds in all, and the
    seconds ``mask_batch`` takes again on the same batches (the mask's share of the loader)."""
    from h5corpus import BestFitDataset, open_corpus
    from h5corpus.loaders.lossmask import apply_loss_mask, mask_batch

    c = open_corpus(manifest, "train")
    ds = BestFitDataset(c, max_seq_len=4096, batch_size=8, with_segments=True, rank=0, world_size=1)
    t0 = time.perf_counter()
    batches = list(ds)
    epoch = time.perf_counter() - t0
    offs = c.doc_offsets
    starts = [offs[b.segments.numpy()[:, 0]] + b.segments.numpy()[:, 1] for b in batches]
    whole = c.loss_spans()
    mask = whole_mask = float("inf")
    for _ in range(3):  # best of 3, the two ways interleaved under the same load
        t0 = time.perf_counter()
        for b, st in zip(batches, starts):
            mask_batch(b, c, st)  # the ranges of the shards the rows touch (what the loaders do)
        mask = min(mask, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b, st in zip(batches, starts):
            apply_loss_mask(b, whole, st)  # the whole split's ranges held in memory
        whole_mask = min(whole_mask, time.perf_counter() - t0)
    tokens = sum(b.num_tokens for b in batches)
    return {
        "microbatches": len(batches),
        "tokens": tokens,
        "epoch_seconds": round(epoch, 4),
        "mask_seconds": round(mask, 4),
        "mask_share": round(mask / epoch, 3),
        "mask_ns_per_token": round(mask / tokens * 1e9, 1),
        "mask_whole_split_ns_per_token": round(whole_mask / tokens * 1e9, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=3000)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    shared = Path(os.environ.get("H5CORPUS_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        tok = tokenizer_folder(shared, t / "tok")
        src = t / "chat.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in conversations(paragraphs(shared, 20000), a.conversations)))

        steps: dict = {}

        def run(out: Path, **kw) -> float:
            t0 = time.perf_counter()
            rep = build_corpus(
                BuildConfig(
                    sources=[str(src)],
                    loss_on="assistant",
                    shards_dir=out / "shards",
                    manifest=out / "manifests" / "shards.json",
                    tokenizer=str(tok / "tokenizer.json"),
                    eos_token="<|endoftext|>",
                    **kw,
                )
            )
            steps[str(out.name)] = {k: round(v, 2) for k, v in (rep.to_json().get("seconds") or {}).items()}
            return round(time.perf_counter() - t0, 2)

        run(t / "c", workers=1)  # default task size: one task, one shard per split (the stored mask)
        build = {}
        for workers in (1, 2):  # 1 MiB tasks, side by side under the same load
            build[f"workers_{workers}_seconds"] = run(t / f"w{workers}", workers=workers, task_bytes=1 << 20)
        build["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        build["worker_cpu_seconds_1_worker"] = steps["w1"]
        m = read_manifest(t / "c" / "manifests" / "shards.json")
        tokens = sum(s.tokens for s in m.shards)
        docs = sum(s.documents for s in m.shards)
        spans = sum(s.loss_spans for s in m.shards)
        stored = trained = 0
        for s in m.shards:
            with h5py.File(m.shard_path(s), "r") as f:
                stored += f["loss_spans"].id.get_storage_size()
                ranges = f["loss_spans"][()]
                trained += int((ranges[:, 1] - ranges[:, 0]).sum())
        loader = loader_cost(t / "c" / "manifests" / "shards.json")
    per_token = stored / tokens
    report = {
        "conversations": a.conversations,
        "documents": docs,
        "tokens": tokens,
        "trained_tokens": trained,
        "loss_ranges": spans,
        "ranges_per_document": round(spans / docs, 3),
        "tokens_per_range": round(tokens / spans, 1),
        "loss_spans_stored_bytes": stored,
        "loss_spans_bytes_per_token": round(per_token, 5),
        "bit_per_token_bytes_per_token": 0.125,
        "byte_per_token_bytes_per_token": 1.0,
        "shard_bytes_per_token": round(sum(s.bytes for s in m.shards) / tokens, 4),
        "loader": loader,
        "build": {**build, "tokens_per_s_1_worker": round(tokens / build["workers_1_seconds"])},
    }
    figures = {
        "loss mask, chat corpus": f"{per_token:.4f} B/token ({spans / docs:.2f} ranges/conversation, "
        f"{tokens / spans:.0f} tokens/range); a bit per token: 0.125",
        "loss mask in the best-fit loader": f"{loader['mask_ns_per_token']} ns/token, "
        f"{loader['mask_share']:.0%} of an epoch's batches (4,096 x 8); "
        f"{loader['mask_whole_split_ns_per_token']} ns/token with the whole split's ranges in memory",
        "fine-tuning build (h5corpus build --loss-on), chat corpus": f"{tokens / build['workers_1_seconds'] / 1e3:.0f} k "
        f"tokens/s on 1 worker; {build['workers_1_seconds']} s vs {build['workers_2_seconds']} s on 2 (shared 2 cores)",
    }
    emit(report, a.out, figures=figures)


if __name__ == "__main__":
    main()
