"""Fine-tuning corpora (issue 26): loss masks stored with the tokens, chat templates, BOS, and
packing that never loses a mask.

The oracle is independent of h5corpus's own rendering and masking: transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` on the test templates (whose
``{% generation %}`` blocks mark each assistant answer and its closing marker) gives the ids and
the trained tokens of every conversation; prompt/completion records use the reference
``tokenizers`` offsets directly. Loaders are then checked target by target against it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from h5corpus import BestFitDataset, SlidingWindowDataset, mix, open_corpus
from h5corpus.build.config import BuildConfig, BuildError
from h5corpus.build.input.chat import ChatTemplate
from h5corpus.build.run.runner import build_corpus
from h5corpus.loaders.batch import IGNORE_INDEX
from h5corpus.storage.format import FormatError
from h5corpus.storage.validate import validate_corpus
from testkit.corpora import write_corpus
from tests.helpers import subprocess_env, tree
from tests.sft_helpers import STYLES, conversations, hf_tokenizer, make_tokenizer, training_texts, write_jsonl

RECORDS = conversations(48)


def _build(root: Path, style: str, records=RECORDS, **kw) -> Path:
    tokdir = root / "tok"
    if not tokdir.exists():
        make_tokenizer(tokdir, style, training_texts(RECORDS))
    src = write_jsonl(root / "data.jsonl", records)
    kw.setdefault("loss_on", "assistant")
    kw.setdefault("workers", 1)
    cfg = BuildConfig(
        sources=[str(src)],
        shards_dir=root / "corpus" / "shards",
        manifest=root / "corpus" / "manifests" / "shards.json",
        tokenizer=str(tokdir / "tokenizer.json"),
        eos_token=STYLES[style]["config"]["eos_token"],
        shard_tokens=2500,
        chunk_tokens=512,
        overwrite=True,
        **kw,
    )
    build_corpus(cfg)
    return root / "corpus" / "manifests" / "shards.json"


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def chat(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"sft-{request.param}")
    return request.param, _build(root, request.param), root / "tok"


def oracle(records, tokdir: Path, bos: int | None = None) -> dict[bytes, tuple[np.ndarray, np.ndarray]]:
    """Per document id (first 16 bytes of the sha256 of its text): the stored tokens
    ``[BOS] + ids + [EOS]`` and the bool trained-on mask, from transformers and tokenizers alone."""
    hf = hf_tokenizer(tokdir)
    out = {}
    for r in records:
        if "messages" in r:
            text = hf.apply_chat_template(r["messages"], tokenize=False)
            enc = hf.apply_chat_template(
                r["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, trained = np.array(enc["input_ids"]), np.array(enc["assistant_masks"], bool)
        else:
            text = r["prompt"] + r["completion"]
            enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = np.array(enc["input_ids"])
            trained = np.array([b > len(r["prompt"]) for _, b in enc["offset_mapping"]], bool)
        head = [] if bos is None else [bos]
        tokens = np.concatenate([head, ids, [hf.eos_token_id]]).astype(np.int64)
        mask = np.concatenate([np.zeros(len(head), bool), trained, trained[-1:]])
        mask[0] = False
        out[hashlib.sha256(text.encode()).digest()[:16]] = (tokens, mask)
    return out


def stored(manifest: Path, split: str = "train"):
    """(corpus, per document (tokens, trained mask) from the corpus's own loss spans)."""
    c = open_corpus(manifest, split)
    offs = c.doc_offsets
    mask = np.zeros(c.num_tokens, bool)
    for a, b in c.loss_spans():
        mask[a:b] = True
    return c, offs, mask


def test_rendering_equals_apply_chat_template(chat):
    """The build's renderer gives transformers' text, with and without the generation prompt."""
    style, _, tokdir = chat
    hf = hf_tokenizer(tokdir)
    ours = ChatTemplate.from_config(tokdir)
    n = 0
    for r in RECORDS:
        if "messages" in r:
            for agp in (False, True):
                msgs = r["messages"][:-1] if agp else r["messages"]
                assert ours.render(msgs, add_generation_prompt=agp) == hf.apply_chat_template(
                    msgs, tokenize=False, add_generation_prompt=agp
                )
                n += 1
    assert n > 50


def test_stored_tokens_and_mask_equal_the_oracle(chat):
    """Every stored document's ids equal transformers' and its mask equals the template's own
    generation mask (answers + closing marker, never headers, system or user turns)."""
    style, manifest, tokdir = chat
    want = oracle(RECORDS, tokdir)
    seen = 0
    for split in ("train", "validation"):
        c, offs, mask = stored(manifest, split)
        ids = c.doc_ids
        for i in range(c.num_documents):
            tokens, m = want[ids[i].tobytes()]
            a, b = int(offs[i]), int(offs[i + 1])
            np.testing.assert_array_equal(c.tokens(a, b).astype(np.int64), tokens)
            np.testing.assert_array_equal(mask[a:b], m)
            seen += 1
    assert seen == len(RECORDS)
    hf = hf_tokenizer(tokdir)
    closer = hf.convert_tokens_to_ids("<|im_end|>" if style == "chatml" else "<|eot_id|>")
    c, offs, mask = stored(manifest)
    toks = c.tokens(0, c.num_tokens)
    header = hf.convert_tokens_to_ids("<|im_start|>" if style == "chatml" else "<|start_header_id|>")
    assert not mask[toks == header].any()  # turn headers never trained
    assert mask[toks == closer].sum() > 0  # the closing marker of assistant turns is


def _epoch_targets(make, world: int, epochs=(0, 1, 2)):
    """Per epoch: Counter of (document, position, target id) over every rank's batches of the
    epoch, microbatches wrapped by the remainder rule left out (each counted once)."""
    out = []
    for e in epochs:
        got: collections.Counter = collections.Counter()
        for r in range(world):
            ds = make(rank=r, world_size=world)
            ds.set_epoch(e)
            M = ds.num_microbatches()
            for j, b in enumerate(ds):
                if r + j * world >= M:
                    continue
                got.update(_batch_targets(b))
        out.append(got)
    return out


def _batch_targets(b):
    t = b.targets.numpy()
    out = []
    cu = b.cu_seqlens.numpy()
    for s, (doc, start, _n) in enumerate(b.segments.tolist()):
        seg = t[cu[s] : cu[s + 1]]
        for j in np.flatnonzero(seg != IGNORE_INDEX).tolist():
            out.append((doc, start + j + 1, int(seg[j])))
    return out


def _expected(manifest, split="train"):
    c, offs, mask = stored(manifest, split)
    toks = c.tokens(0, c.num_tokens)
    doc = np.searchsorted(offs, np.arange(c.num_tokens), side="right") - 1
    pos = np.flatnonzero(mask)
    return collections.Counter(zip(doc[pos].tolist(), (pos - offs[doc[pos]]).tolist(), toks[pos].tolist()))


def test_bestfit_two_ranks_every_answer_target_once_per_epoch(chat):
    """2 ranks, 3 epochs, max_seq_len 40 (long conversations chunked, chunk lookaheads cut inside
    answers): every trained target exactly once per epoch, nothing else ever a target."""
    _, manifest, _ = chat
    want = _expected(manifest)
    assert len(want) > 500

    def make(**kw):
        return BestFitDataset(manifest, max_seq_len=40, batch_size=3, seed=1, with_segments=True, **kw)

    assert make(rank=0, world_size=1).skipped_documents == 0
    for got in _epoch_targets(make, 2):
        assert got == want


def test_mask_survives_resume_on_another_world_size(chat):
    """A checkpoint taken on 2 ranks resumes on 3: the epoch's targets are still each trained
    target once."""
    _, manifest, _ = chat
    want = _expected(manifest)

    def make(**kw):
        return BestFitDataset(manifest, max_seq_len=40, batch_size=2, seed=3, with_segments=True, **kw)

    got: collections.Counter = collections.Counter()
    k = 2
    state = None
    for r in range(2):
        ds = make(rank=r, world_size=2)
        it = iter(ds)
        for _ in range(k):
            got.update(_batch_targets(next(it)))
        state = ds.state_dict() if r == 0 else state
    for r in range(3):
        ds = make(rank=r, world_size=3)
        ds.load_state_dict(state)
        M = ds.num_microbatches()
        for j, b in enumerate(ds):
            if 2 * k + r + 3 * j < M:
                got.update(_batch_targets(b))
    assert got == want


def _window_rows(ds, epoch: int):
    """(global start, targets row) of every window ``ds`` yields in ``epoch``, from its own plan."""
    ds.set_epoch(epoch)
    starts = ds.plan(epoch)
    rows = []
    for b in ds:
        rows += list(b.targets.numpy().reshape(-1, ds.seq_len))
    assert len(rows) == starts.size
    return list(zip(starts.tolist(), rows))


def _check_windows(rows, c, mask, L):
    """Every window's targets: kept iff the position is trained on, and then the stored token."""
    toks = c.tokens(0, c.num_tokens)
    kept_total = 0
    for s, t in rows:
        kept = t != IGNORE_INDEX
        np.testing.assert_array_equal(kept, mask[s + 1 : s + 1 + L])
        np.testing.assert_array_equal(t[kept], toks[s + 1 : s + 1 + L][kept])
        kept_total += int(kept.sum())
    return kept_total


def test_window_loader_two_ranks_targets_follow_the_mask(chat):
    """Sliding windows on 2 ranks over 3 epochs (document masking on and off): a target is kept
    iff its position is trained on (so never across a document start); the ranks together read
    every window of the epoch, and so every trained position the windows cover, once; a state
    taken on 2 ranks resumes on 3 with the same windows."""
    _, manifest, _ = chat
    c, offs, mask = stored(manifest)
    L = 24
    for dm in (True, False):
        for e in range(3):
            rows = []
            for r in range(2):
                rows += _window_rows(
                    SlidingWindowDataset(
                        manifest, seq_len=L, batch_size=3, seed=e, document_mask=dm, rank=r, world_size=2
                    ),
                    e,
                )
            _check_windows(rows, c, mask, L)
            unique = dict(rows)  # the remainder rule repeats at most one batch: same windows
            covered = np.zeros(c.num_tokens, bool)
            for s in unique:
                assert not covered[s + 1 : s + 1 + L].any()  # windows never overlap
                covered[s + 1 : s + 1 + L] = True
            n_windows = SlidingWindowDataset(manifest, seq_len=L, batch_size=3, rank=0, world_size=1).num_windows
            assert len(unique) == n_windows
            assert sum(int((t != IGNORE_INDEX).sum()) for t in unique.values()) == int((mask & covered).sum())
    # resume: 2 batches on each of 2 ranks, then rank 0's state on 3 ranks; global batch g holds
    # windows [g * B, (g + 1) * B) of the one-consumer plan, rank r of 3 resumes at g = 4 + r, +3, ...
    B = 3
    whole = SlidingWindowDataset(manifest, seq_len=L, batch_size=B, seed=5, rank=0, world_size=1)
    order, M = whole.plan(0), whole.num_microbatches()
    first = [SlidingWindowDataset(manifest, seq_len=L, batch_size=B, seed=5, rank=r, world_size=2) for r in range(2)]
    for ds in first:
        it = iter(ds)
        for _ in range(2):
            next(it)
    state = first[0].state_dict()
    read = set(order[: 4 * B].tolist())
    for r in range(3):
        ds = SlidingWindowDataset(manifest, seq_len=L, batch_size=B, seed=5, rank=r, world_size=3)
        ds.load_state_dict(state)
        rows = []
        for j, b in enumerate(ds):
            g = (4 + r + 3 * j) % M
            starts = order[g * B : (g + 1) * B].tolist()
            rows += list(zip(starts, b.targets.numpy().reshape(-1, L)))
        _check_windows(rows, c, mask, L)
        read |= {s for s, _ in rows}
    assert read == set(order.tolist())


def test_mixture_of_pretraining_and_chat(chat, tmp_path):
    """A chat corpus mixed with a pretraining corpus of the same tokenizer: pretraining targets
    all count, chat targets follow the mask, each once per epoch (a source without a mask is
    trained on whole)."""
    style, manifest, tokdir = chat
    hf = hf_tokenizer(tokdir)
    c_chat = open_corpus(manifest, "train")
    texts = [f"plain text number {i} about rivers and robots" for i in range(30)]
    pre = write_corpus(
        tmp_path / "pre", texts, lambda ts: [hf(t, add_special_tokens=False)["input_ids"] for t in ts], c_chat.tokenizer
    )
    m = mix([manifest, pre])  # in proportion to their tokens: each source read once per epoch
    ds = BestFitDataset(m, max_seq_len=40, batch_size=3, seed=0, with_segments=True, world_size=1, rank=0)
    got = collections.Counter(x for b in ds for x in _batch_targets(b))
    base = c_chat.num_documents
    chat_part = collections.Counter({k: v for k, v in got.items() if k[0] < base})
    p = open_corpus(pre, "train")
    pre_part = collections.Counter({(k[0] - base, k[1], k[2]): v for k, v in got.items() if k[0] >= base})
    want_pre = collections.Counter()
    for d in range(p.num_documents):
        doc = p.document(d)
        want_pre.update((d, j, int(doc[j])) for j in range(1, doc.size))
    # a mixture selects chunks by token weight (a chunk may wait for the next epoch): every target
    # it yields is a trained one, at most once, and nearly all are yielded
    for part, want in ((chat_part, _expected(manifest)), (pre_part, want_pre)):
        assert set(part) <= set(want) and max(part.values()) == 1
        assert len(part) >= 0.9 * len(want)


def test_trl_3728_completion_mask_survives_packing(tmp_path):
    """trl #3728: under packing the completion mask silently disappeared. Here prompt/completion
    records packed many to a row keep exactly their completion (and EOS) as targets."""
    recs = [
        {"prompt": f"Question {i}: why do rivers form?\nAnswer:", "completion": f" Because of rain {i}."}
        for i in range(40)
    ]
    manifest = _build(tmp_path, "chatml", records=recs)
    want = _expected(manifest)
    ds = BestFitDataset(manifest, max_seq_len=256, batch_size=2, seed=0, with_segments=True, rank=0, world_size=1)
    batches = list(ds)
    assert max(b.segments.shape[0] / b.num_packs for b in batches) > 3  # several records per pack
    got = collections.Counter(x for b in batches for x in _batch_targets(b))
    assert got == want
    hf = hf_tokenizer(tmp_path / "tok")
    c, offs, mask = stored(manifest)
    for d in range(c.num_documents):
        doc = c.document(d)
        text = hf.decode(doc[mask[offs[d] : offs[d + 1]]])
        assert text.startswith(" Because of rain") and text.endswith("." + hf.eos_token)


def test_pad_equals_eos_the_model_learns_to_stop(tmp_path):
    """Megatron-Bridge #4660: masking labels by the pad id when pad = EOS drops every EOS target.
    The mask here is positional: with pad = EOS, every prompt/completion document's EOS and every
    Llama-3 answer's <|eot_id|> is a target, in the packed batches and in hf_kwargs' labels."""
    recs = [r for r in RECORDS if "prompt" in r] + [r for r in RECORDS if "messages" in r][:10]
    manifest = _build(tmp_path, "llama3", records=recs)
    hf = hf_tokenizer(tmp_path / "tok")
    assert hf.pad_token_id == hf.eos_token_id
    eot = hf.convert_tokens_to_ids("<|eot_id|>")
    ds = BestFitDataset(manifest, max_seq_len=64, batch_size=2, seed=0, with_segments=True, rank=0, world_size=1)
    eos_targets = eot_targets = 0
    for b in ds:
        labels = b.hf_kwargs(labels=True)["shift_labels"][0]
        eos_targets += int((labels == hf.eos_token_id).sum())
        eot_targets += int((labels == eot).sum())
    c = open_corpus(manifest, "train")
    by_id = {
        hashlib.sha256(hf.apply_chat_template(r["messages"], tokenize=False).encode()).digest()[:16]: r
        for r in recs
        if "messages" in r
    }
    answers = sum(
        1 for i in c.doc_ids for m in by_id.get(i.tobytes(), {"messages": []})["messages"] if m["role"] == "assistant"
    )
    assert eos_targets == c.num_documents  # every document ends with its answer here: its EOS is trained
    assert eot_targets == answers > 0  # each answer's <|eot_id|>, none of the user/system turns' ones


def test_bos_convention_and_bos_equal_eos(tmp_path):
    """--bos: every document starts with BOS, never inside, never a target; BOS = EOS builds,
    validates deep, and the loaders still train every answer's EOS once."""
    recs = [r for r in RECORDS if "prompt" in r][:8]
    root = tmp_path / "bos"
    hf_dir = make_tokenizer(root / "tok", "chatml", training_texts(RECORDS))
    eos = hf_tokenizer(hf_dir).eos_token_id
    manifest = _build(root, "chatml", records=recs, bos=str(eos))
    c = open_corpus(manifest, "train")
    assert c.bos_id == eos and json.loads(manifest.read_text())["sft"]["bos_id"] == eos
    report = validate_corpus(manifest, deep=True)
    assert report.ok, report.findings
    offs = c.doc_offsets
    toks = c.tokens(0, c.num_tokens)
    assert (toks[offs[:-1]] == eos).all()
    assert _expected(manifest) == collections.Counter(
        x
        for b in BestFitDataset(manifest, max_seq_len=16, batch_size=2, with_segments=True, rank=0, world_size=1)
        for x in _batch_targets(b)
    )
    for b in BestFitDataset(manifest, max_seq_len=8, batch_size=2, with_segments=True, rank=0, world_size=1):
        firsts = b.input_ids[b.cu_seqlens[:-1].long()]
        cut = b.segments[:, 1] > 0  # chunks after a cut start inside the document: never with a BOS
        assert (firsts[~cut] == eos).all() and not (firsts[cut] == eos).any()
    got = oracle(recs, hf_dir, bos=eos)
    ids = c.doc_ids
    for i in range(c.num_documents):
        np.testing.assert_array_equal(c.document(i).astype(np.int64), got[ids[i].tobytes()][0])
    # Llama-3's template writes BOS itself: --bos on top would double it, and is refused
    with pytest.raises(BuildError, match="already writes the BOS"):
        _build(tmp_path / "l3", "llama3", records=[r for r in RECORDS if "messages" in r][:2], bos="tokenizer")


def test_corrupt_mask_refused_by_reader_and_validate(tmp_path):
    """/loss_spans is covered like the tokens: a changed range is refused by the reader (manifest
    hash) and reported by validate."""
    manifest = _build(tmp_path, "chatml", records=RECORDS[:12])
    assert validate_corpus(manifest).ok
    path = json.loads(manifest.read_text())["shards"][0]["path"]
    with h5py.File(manifest.parent / path, "r+") as f:
        ds = f["loss_spans"]
        ds[0, 1] = ds[0, 1] + 1
    with pytest.raises(FormatError, match="loss_sha256"):
        open_corpus(manifest, "train").loss_spans()
    codes = {f.code for f in validate_corpus(manifest).findings}
    assert "loss_sha256" in codes


def test_pretraining_corpus_has_no_mask_and_pays_nothing(tmp_path):
    """A corpus without the fine-tuning facts: no dataset, no manifest keys, loaders unchanged."""
    p = write_corpus(tmp_path / "pre", ["abc def", "ghi jkl mno"], lambda ts: [[1, 2, 3] for _ in ts], _identity())
    c = open_corpus(p, "train")
    assert c.loss_spans() is None and c.bos_id is None and not c.has_loss_mask
    d = json.loads(p.read_text())
    assert "sft" not in d and all("loss_sha256" not in s for s in d["shards"])


def _identity():
    from tests.helpers import BYTE_IDENTITY

    return BYTE_IDENTITY


def test_cli_build_loss_on_and_bad_record(tmp_path):
    """h5corpus build --loss-on: a fine-tuning corpus (manifest sft facts); a bad record is one line
    naming file, line and field, exit 1; --bos without --loss-on is a usage error, exit 2."""
    tok = make_tokenizer(tmp_path / "tok", "chatml", training_texts(RECORDS))
    src = write_jsonl(tmp_path / "d.jsonl", RECORDS[:6])
    out = ["--shards-dir", str(tmp_path / "c" / "shards"), "--manifest", str(tmp_path / "c" / "m.json")]
    cmd = [sys.executable, "-m", "h5corpus.cli", "build", str(src), "--loss-on", "assistant", *out]
    cmd += ["--tokenizer", str(tok / "tokenizer.json"), "--eos-token", "<|endoftext|>", "--workers", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "trained tokens" in r.stdout  # the report's column
    assert json.loads((tmp_path / "c" / "m.json").read_text())["sft"] == {
        "loss_mask": True,
        "bos_id": None,
        "loss_on": "assistant",
    }
    bad = write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], {"messages": [{"role": "user"}]}])
    r = subprocess.run(cmd[:4] + [str(bad)] + cmd[5:] + ["--overwrite"], capture_output=True, text=True)
    assert r.returncode == 1
    first = r.stderr.strip().splitlines()[0]
    assert f"{bad.name}:2" in first and "messages[0]" in first, r.stderr
    r = subprocess.run(
        [c for c in cmd if c not in ("--loss-on", "assistant")] + ["--bos", "1"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "loss_on" in r.stderr


def test_hf_kwargs_labels_follow_the_mask(chat):
    """hf_kwargs(labels=True): shift_labels are the masked targets; packed_loss agrees."""
    from h5corpus import packed_loss

    _, manifest, _ = chat
    b = next(iter(BestFitDataset(manifest, max_seq_len=40, batch_size=3, rank=0, world_size=1)))
    kw = b.hf_kwargs(labels=True)
    assert torch.equal(kw["shift_labels"][0], b.targets)
    assert int((b.targets != IGNORE_INDEX).sum()) == b.num_targets < b.num_tokens
    logits = torch.randn(b.num_tokens, 500)
    keep = b.targets != IGNORE_INDEX
    want = torch.nn.functional.cross_entropy(logits[keep], b.targets[keep])
    assert torch.allclose(packed_loss(logits, b.targets), want)


def _tiny_llama(vocab: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _padded_reference(batch, corpus, mask, offs, pad_id: int) -> dict:
    """The same conversations as ``batch``, one padded row each, labels -100 where not trained on
    (and on padding): the unpacked reference transformers computes its loss from."""
    rows = []
    for doc, start, n in batch.segments.tolist():
        assert start == 0 and n == int(offs[doc + 1] - offs[doc]) - 1  # whole documents
        a, b = int(offs[doc]), int(offs[doc + 1])
        toks = torch.from_numpy(corpus.tokens(a, b).astype(np.int64))
        labels = torch.where(torch.from_numpy(mask[a:b]), toks, torch.full_like(toks, IGNORE_INDEX))
        rows.append((toks, labels))
    L = max(t.numel() for t, _ in rows)
    ids = torch.full((len(rows), L), pad_id)
    labels = torch.full((len(rows), L), IGNORE_INDEX)
    att = torch.zeros((len(rows), L), dtype=torch.long)
    for i, (t, lab) in enumerate(rows):
        ids[i, : t.numel()], labels[i, : t.numel()], att[i, : t.numel()] = t, lab, 1
    return {"input_ids": ids, "labels": labels, "attention_mask": att}


def test_hf_trainer_packed_chat_loss_equals_unpacked_reference(chat, tmp_path):
    """A tiny Llama trained 3 steps with HF Trainer on packed chat batches (pad = EOS in Llama-3
    style) logs the same losses as the same Trainer on the same conversations unpacked (one padded
    row each, labels -100 on masked positions), and ends with the same weights."""
    from transformers import Trainer, TrainingArguments

    style, manifest, tokdir = chat
    c, offs, mask = stored(manifest)
    hf = hf_tokenizer(tokdir)
    ds = BestFitDataset(manifest, max_seq_len=1024, batch_size=1, seed=0, with_segments=True, rank=0, world_size=1)
    packed = [b for _, b in zip(range(3), ds)]
    padded = [_padded_reference(b, c, mask, offs, hf.pad_token_id) for b in packed]

    def train(items, collate):
        model = _tiny_llama(c.tokenizer.vocab_size)
        args = TrainingArguments(
            output_dir=str(tmp_path / "t"),
            max_steps=len(items),
            per_device_train_batch_size=1,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            remove_unused_columns=False,
            disable_tqdm=True,
        )
        tr = Trainer(model=model, args=args, train_dataset=items, data_collator=collate)
        tr.train()
        return [h["loss"] for h in tr.state.log_history if "loss" in h], model

    got, m1 = train(packed, lambda xs: xs[0].hf_kwargs(labels=True))
    want, m2 = train(padded, lambda xs: xs[0])
    print(f"{style}: packed losses {got}, unpacked {want}")
    assert len(got) == 3 and np.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert got[-1] < got[0]
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.allclose(p1, p2, atol=1e-4)


def test_inspect_reports_trained_tokens_and_checks_the_mask(tmp_path):
    """inspect: trained-on targets per split, the mask check and the BOS check pass on a real
    fine-tuning corpus (BOS = EOS too); the BOS check fails when the manifest claims a BOS its
    documents do not start with."""
    from h5corpus.inspection import format_report, inspect_corpus

    root = tmp_path / "c"
    make_tokenizer(root / "tok", "chatml", training_texts(RECORDS))
    eos = hf_tokenizer(root / "tok").eos_token_id
    manifest = _build(root, "chatml", bos=str(eos))
    rep = inspect_corpus(manifest, seq_len=40, batch_size=3)
    text = format_report(rep)
    assert rep.ok, text
    assert rep.splits["train"]["trained_tokens"] == sum(_expected(manifest).values())
    for split, st in json.loads(manifest.read_text())["splits"].items():  # the build's own figure agrees
        assert st["trained_tokens"] == rep.splits[split]["trained_tokens"] > 0
    assert "trained-on targets" in text and "no masked position is ever a target" in text
    assert "starts with BOS" in text
    d = json.loads(manifest.read_text())
    d["sft"]["bos_id"] = eos + 1
    manifest.write_text(json.dumps(d))
    bad = inspect_corpus(manifest, seq_len=40, batch_size=3)
    failed = [c for c in bad.checks if not c.passed]
    # the EOS each document really starts with is now an EOS inside it, and the claimed BOS is missing
    assert sorted(c.name.split("] ")[1][:14] for c in failed) == ["every document"] * 4, format_report(bad)
    assert sum("starts with BOS" in c.name for c in failed) == 2


def test_readme_sft_block_runs(tmp_path, monkeypatch):
    """The README's fine-tuning loop, as written, over a corpus built by its command line:
    every step's loss is finite and it trains (the last loss below the first)."""
    from tests.helpers import readme_block, readme_python_block

    monkeypatch.chdir(tmp_path)
    make_tokenizer(tmp_path / "tok", "chatml", training_texts(RECORDS))
    write_jsonl(tmp_path / "chat.jsonl", RECORDS)
    line = readme_block("Supervised fine-tuning", "bash").strip()
    assert line.startswith("h5corpus build ") and "\n" not in line
    cmd = [sys.executable, "-m", "h5corpus.cli", *shlex.split(line)[1:], "--eos-token", "<|endoftext|>"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    block = readme_python_block("Supervised fine-tuning").replace(
        "max_seq_len=4096, batch_size=8", "max_seq_len=256, batch_size=2"
    )
    model = _tiny_llama(open_corpus(tmp_path / "sft/manifests/shards.json").tokenizer.vocab_size)
    losses = []
    orig = model.forward

    def forward(*a, **kw):
        out = orig(*a, **kw)
        losses.append(out.loss.item())
        return out

    model.forward = forward
    env = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    exec(compile(block, "README.md", "exec"), env)
    assert len(losses) >= 4 and np.isfinite(losses).all()
    assert losses[-1] < losses[0]


def test_a_token_straddling_a_boundary_is_trained(tmp_path):
    """The documented rule: a token with any trained character is trained. A merge across the
    prompt/completion boundary ("...the ca" + "t sat") and across a no_loss range's end are both
    trained; the tokens wholly inside the prompt or the range are not."""
    tok = make_tokenizer(tmp_path / "tok", "chatml", training_texts(RECORDS))
    hf = hf_tokenizer(tok)
    prompt, completion = "Tell me: the ca", "t sat on a mat."
    enc = hf(prompt + completion, add_special_tokens=False, return_offsets_mapping=True)
    straddle = [k for k, (a, b) in enumerate(enc["offset_mapping"]) if a < len(prompt) < b]
    assert straddle, "the tokenizer merges across the boundary (the test's premise)"
    text = "the cat sat on the mat"
    recs = [{"prompt": prompt, "completion": completion}, {"text": text, "no_loss_ranges": [[0, 5]]}]
    manifest = _build(tmp_path, "chatml", records=recs, validation_fraction=0.0)
    c, offs, mask = stored(manifest, "train")
    assert c.num_documents == 2
    for d in range(2):
        doc_mask = mask[offs[d] : offs[d + 1]][:-1]  # the text tokens (no BOS), EOS left out
        t = hf.decode(c.document(d)[:-1])
        got = hf(t, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        cut = len(prompt) if t.startswith("Tell") else 5  # trained from this character on
        want = np.array([b > cut for _, b in got])
        want[0] = False
        np.testing.assert_array_equal(doc_mask, want)
        assert any(a < cut < b and m for (a, b), m in zip(got, doc_mask)), "a straddling token, trained"


@pytest.mark.parametrize("loss_on", ["completion", "all"])
def test_loss_on_completion_and_all(tmp_path, loss_on):
    """--loss-on completion: only each conversation's last answer (and its marker); all: every
    position but a document's first."""
    recs = [r for r in RECORDS if "messages" in r][:12]
    manifest = _build(tmp_path, "chatml", records=recs, loss_on=loss_on, validation_fraction=0.0)
    hf = hf_tokenizer(tmp_path / "tok")
    c, offs, mask = stored(manifest)
    full = oracle(recs, tmp_path / "tok")
    ids = c.doc_ids
    end = hf.convert_tokens_to_ids("<|im_end|>")
    for d in range(c.num_documents):
        m = mask[offs[d] : offs[d + 1]]
        if loss_on == "all":
            assert not m[0] and m[1:].all()
            continue
        toks = c.document(d)
        want = full[ids[d].tobytes()][1].copy()
        closers = np.flatnonzero(want & (toks == end))
        want[: closers[-2] + 1 if closers.size > 1 else 0] = False  # every answer before the last one
        np.testing.assert_array_equal(m, want)


def test_masked_targets_on_the_device_path_equal_the_host_path(chat, monkeypatch):
    """The torch path that materializes targets where a batch lives (CUDA; here on the CPU with
    numpy off) fills the same IGNORE_INDEX as the numpy path, for both loaders."""
    import h5corpus.loaders.batch as batch_mod

    _, manifest, _ = chat
    loaders = [
        BestFitDataset(manifest, max_seq_len=40, batch_size=3, rank=0, world_size=1),
        SlidingWindowDataset(manifest, seq_len=32, batch_size=4, document_mask=True),
    ]
    for ds in loaders:
        for b in [x for _, x in zip(range(3), ds)]:
            host = b.clone().targets
            monkeypatch.setattr(batch_mod, "_CPU_NUMPY", False)
            dev = b.clone().targets
            monkeypatch.setattr(batch_mod, "_CPU_NUMPY", True)
            assert torch.equal(host, dev) and (host == IGNORE_INDEX).any()


def test_bad_settings_keep_the_old_corpus(tmp_path):
    """Bad fine-tuning settings are usage errors raised before anything is written; a record the
    template cannot take with --bos stops the build naming file and line."""
    manifest = _build(tmp_path, "llama3", records=RECORDS[:10])
    before = manifest.read_bytes()
    with pytest.raises(BuildError, match="data.jsonl:1: the chat template already writes the BOS"):
        _build(tmp_path / "b", "llama3", records=[r for r in RECORDS if "messages" in r][:3], bos="tokenizer")
    for bad in ({"loss_on": "everything"}, {"bos": "abc"}, {"bos": "99999"}):
        with pytest.raises(ValueError):
            _build(tmp_path, "llama3", records=RECORDS[:2], **bad)
    assert manifest.read_bytes() == before


def test_target_kept_equals_a_per_position_oracle():
    """The interval arithmetic of target_kept against a boolean array per position, on random
    ranges and rows (rows crossing ranges, inside them, between them, of length 1)."""
    from h5corpus.loaders.lossmask import target_kept

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(30, 400))
        cuts = np.sort(rng.choice(np.arange(1, n), size=2 * int(rng.integers(0, 12)), replace=False))
        spans = cuts.reshape(-1, 2).astype(np.int64)
        spans = spans[spans[:, 1] > spans[:, 0]]
        trained = np.zeros(n + 1, bool)
        for a, b in spans:
            trained[a:b] = True
        R = int(rng.integers(1, 8))
        lens = rng.integers(1, 40, size=R)
        starts = np.array([rng.integers(0, n - L) if n - L > 0 else 0 for L in lens], np.int64)
        lens = np.minimum(lens, n - starts)
        want = np.concatenate([trained[s + 1 : s + 1 + L] for s, L in zip(starts, lens)])
        np.testing.assert_array_equal(target_kept(spans, starts, lens), want)


def test_dataloader_workers_read_and_apply_the_mask(chat):
    """Through torchdata's StatefulDataLoader with 2 worker processes (the corpus pickled into
    each, its loss ranges read and proven there), on 2 ranks: every trained target once."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    _, manifest, _ = chat
    got: collections.Counter = collections.Counter()
    for r in range(2):
        ds = BestFitDataset(manifest, max_seq_len=40, batch_size=3, seed=2, with_segments=True, rank=r, world_size=2)
        M = ds.num_microbatches()
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
        for j, b in enumerate(loader):
            if r + 2 * j < M:
                got.update(_batch_targets(b))
    assert got == _expected(manifest)


@pytest.mark.parametrize(
    "record, words",
    [
        ({"prompt": "a", "completion": 3}, "field 'completion' must be a string"),
        ({"text": "abc", "no_loss_ranges": [[2, 9]]}, "no_loss_ranges[0]"),
        ({"text": "abc", "no_loss_ranges": "all"}, "no_loss_ranges"),
        ({"messages": []}, "field 'messages'"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
        (["not", "an", "object"], "a JSON object"),
        ({"text": "x<|endoftext|>y"}, "EOS id"),
    ],
)
def test_bad_records_are_one_line_naming_file_line_and_field(tmp_path, record, words):
    """Each bad fine-tuning record stops the build with one line: file, line, field."""
    make_tokenizer(tmp_path / "tok", "chatml", training_texts(RECORDS))
    with pytest.raises(BuildError) as e:
        _build(tmp_path, "chatml", records=[RECORDS[0], record])
    msg = str(e.value)
    assert "\n" not in msg and "data.jsonl:2: " in msg and words in msg, msg


def test_hdf5_read_path_gives_the_same_masked_batches(chat):
    """Shards read through HDF5 (read_path="h5py": the path of compressed shards) give the
    memory-mapped path's targets, mask included."""
    _, manifest, _ = chat
    kw = dict(max_seq_len=40, batch_size=3, seed=4, rank=0, world_size=1)
    mapped = [b.targets for b in BestFitDataset(open_corpus(manifest, "train"), **kw)]
    h5 = [b.targets for b in BestFitDataset(open_corpus(manifest, "train", read_path="h5py"), **kw)]
    assert len(mapped) == len(h5) and all(torch.equal(a, b) for a, b in zip(mapped, h5))
    assert any((t == IGNORE_INDEX).any() for t in h5)


LAST_TURN_THINKING = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% if loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_template_that_rewrites_earlier_turns(tmp_path):
    """A template rendering a block only in the last assistant turn (Qwen3-style): with
    --loss-on assistant the record is refused naming the turn; with --loss-on completion the
    last turn (its block, answer and <|im_end|>) is trained, nothing else."""
    tok = make_tokenizer(tmp_path / "tok", "chatml", training_texts(RECORDS))
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg["chat_template"] = LAST_TURN_THINKING
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    rec = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}] * 2}
    with pytest.raises(BuildError, match=r"data.jsonl:1: messages\[1\]: the chat template does not render"):
        _build(tmp_path, "chatml", records=[rec])
    manifest = _build(tmp_path, "chatml", records=[rec], loss_on="completion", validation_fraction=0.0)
    c, offs, mask = stored(manifest)
    hf = hf_tokenizer(tok)
    assert hf.decode(c.document(0)[mask[: offs[1]]]) == "<think>\n\n</think>\n\nHello.<|im_end|>"


def test_checkpoint_of_another_mask_is_refused(tmp_path):
    """The same tokens with another loss mask (--loss-on all instead of assistant) are another
    corpus to a checkpoint: resuming on it is refused."""
    from h5corpus import LoaderStateError

    recs = RECORDS[:20]
    a = _build(tmp_path / "a", "chatml", records=recs)
    b = _build(tmp_path / "b", "chatml", records=recs, loss_on="all")
    ds = BestFitDataset(a, max_seq_len=40, batch_size=2, rank=0, world_size=1)
    next(iter(ds))
    state = ds.state_dict()
    assert open_corpus(a).num_tokens == open_corpus(b).num_tokens
    BestFitDataset(a, max_seq_len=40, batch_size=2, rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(LoaderStateError):
        BestFitDataset(b, max_seq_len=40, batch_size=2, rank=0, world_size=1).load_state_dict(state)


def test_bos_from_the_tokenizer_config(tmp_path):
    """--bos tokenizer takes the config's bos_token (Llama-3's <|begin_of_text|>) for records the
    template does not render (prompt/completion): every document starts with it, validate passes."""
    recs = [r for r in RECORDS if "prompt" in r]
    manifest = _build(tmp_path, "llama3", records=recs, bos="tokenizer")
    bos = hf_tokenizer(tmp_path / "tok").convert_tokens_to_ids("<|begin_of_text|>")
    c = open_corpus(manifest, "train")
    assert c.bos_id == bos
    assert (c.tokens(0, c.num_tokens)[c.doc_offsets[:-1]] == bos).all()
    assert validate_corpus(manifest, deep=True).ok


# -- the one build: workers, decide buckets, kill -9, stage processes from the plan alone ---------
MULTI = conversations(150, seed=3)
MULTI_DUPS = 12  # the last task repeats the first records: its finish stage copies the kept documents


def _multi_settings(root: Path, src: Path, tokdir: Path, **kw) -> dict:
    """JSON-able BuildConfig fields (a killed build gets them in a subprocess): several tasks."""
    d = {
        "sources": [str(src)],
        "tokenizer": str(tokdir / "tokenizer.json"),
        "eos_token": "<|endoftext|>",
        "loss_on": "assistant",
        "workers": 2,
        "task_bytes": 25_000,
        "shard_tokens": 4000,
        "chunk_tokens": 512,
        "shards_dir": str(root / "shards"),
        "manifest": str(root / "manifests" / "shards.json"),
    }
    d.update(kw)
    return d


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    """(source, tokenizer folder, a reference built on one worker) of a multi-task chat input."""
    root = tmp_path_factory.mktemp("sft-multi")
    tokdir = make_tokenizer(root / "tok", "chatml", training_texts(RECORDS))
    src = write_jsonl(root / "in" / "chat.jsonl", MULTI + MULTI[:MULTI_DUPS])
    rep = build_corpus(BuildConfig(**_multi_settings(root / "ref", src, tokdir, workers=1)))
    assert rep.tasks >= 4 and rep.dropped().get("exact_dup") == MULTI_DUPS, rep.to_json()
    return src, tokdir, root / "ref"


def test_same_bytes_for_any_worker_count_and_decide_form(multi, tmp_path):
    """Two workers (and the bucketed decide of Ray and Slurm) write the one-worker build's bytes;
    every stored document (copied ones included) has the oracle's tokens and mask."""
    src, tokdir, ref = multi
    for name, kw in (("w2", {}), ("b2", {"decide_buckets": 2})):
        build_corpus(BuildConfig(**_multi_settings(tmp_path / name, src, tokdir, **kw)))
        assert tree(tmp_path / name) == tree(ref), name
    want = oracle(MULTI, tokdir)
    n = 0
    for split in ("train", "validation"):
        c, offs, mask = stored(ref / "manifests" / "shards.json", split)
        for i, doc_id in enumerate(c.doc_ids):
            tokens, m = want[doc_id.tobytes()]
            np.testing.assert_array_equal(c.tokens(int(offs[i]), int(offs[i + 1])).astype(np.int64), tokens)
            np.testing.assert_array_equal(mask[offs[i] : offs[i + 1]], m)
            n += 1
    assert n == len(MULTI)


@pytest.mark.parametrize("point", ["read-record:2", "finish-copied:1"])
def test_killed_build_resumes_to_the_same_bytes(multi, tmp_path, point):
    """kill -9 of a fine-tuning build at a stage boundary; the re-run resumes (the plan's SFT
    settings match) and ends with the uninterrupted build's bytes, masks included."""
    from tests.test_build_faults import _killed_at

    src, tokdir, ref = multi
    settings = _multi_settings(tmp_path, src, tokdir)
    _killed_at(point, settings)
    assert build_corpus(BuildConfig(**settings)).resumed
    assert tree(tmp_path) == tree(ref)


def test_other_sft_settings_do_not_resume_an_interrupted_build(multi, tmp_path):
    """The fingerprint covers the fine-tuning settings: an interrupted build is not finished with
    another --loss-on (refused, naming the setting)."""
    from h5corpus.build import BuildConflict
    from tests.test_build_faults import _killed_at

    src, tokdir, _ = multi
    _killed_at("read-record:1", _multi_settings(tmp_path, src, tokdir))
    with pytest.raises(BuildConflict, match="sft"):
        build_corpus(BuildConfig(**_multi_settings(tmp_path, src, tokdir, loss_on="all")))


def test_stage_processes_rebuild_the_sft_settings_from_the_plan(multi, tmp_path):
    """Slurm's way (a dry run plans; every stage is a fresh `h5corpus build-stage` process): the
    chat template and BOS travel in the plan (the tokenizer config is gone before any stage runs)
    and the shards equal a local build's."""
    import shutil

    src, tokdir, _ = multi
    tok = tmp_path / "tok"
    shutil.copytree(tokdir, tok)
    eos = str(hf_tokenizer(tokdir).eos_token_id)
    dry = dict(executor="slurm", decide_buckets=1, slurm={"dry_run": True}, bos=eos)
    build_corpus(BuildConfig(**_multi_settings(tmp_path / "s", src, tok, **dry)))
    (tok / "tokenizer_config.json").unlink()
    state = str(tmp_path / "s" / "shards" / ".build")

    def stage(*args: str) -> None:
        r = subprocess.run(
            [sys.executable, "-m", "h5corpus", "build-stage", *args, "--state", state],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=300,
        )
        assert r.returncode == 0, r.stderr

    tasks = len(json.loads((tmp_path / "s" / "shards" / ".build" / "plan.json").read_text())["tasks"])
    for i in range(tasks):
        stage("read", "--task-index", str(i))
    stage("bucket", "--task-index", "0")
    stage("decide")
    for i in range(tasks):
        stage("finish", "--task-index", str(i))
    stage("commit")
    local = _multi_settings(tmp_path / "l", src, tok, bos=eos, chat_template=str(tokdir / "tokenizer_config.json"))
    build_corpus(BuildConfig(**local))
    assert tree(tmp_path / "s" / "shards") == tree(tmp_path / "l" / "shards")
    c = open_corpus(tmp_path / "s" / "manifests" / "shards.json")
    assert (
        c.bos_id == int(eos)
        and c.has_loss_mask
        and validate_corpus(tmp_path / "s" / "manifests" / "shards.json", deep=True).ok
    )


def test_loss_ranges_are_read_per_shard_on_first_touch(multi, monkeypatch):
    """The loaders' loss_spans_for reads only the shards a batch's rows touch (each proven against
    its loss_sha256 then), keeps at most MAX_OPEN_SHARDS of them, and gives the targets the
    whole split's ranges give, for random rows (crossing shard ends too)."""
    import h5corpus.storage.reader as reader_mod
    from h5corpus.loaders.lossmask import target_kept

    monkeypatch.setattr(reader_mod, "MAX_OPEN_SHARDS", 2)
    _, _, ref = multi
    manifest = ref / "manifests" / "shards.json"
    whole = open_corpus(manifest, "train").loss_spans()
    c = open_corpus(manifest, "train")
    sts = c.shard_token_starts
    assert c.num_shards >= 4
    row = np.array([int(sts[2]) + 3])
    got = c.loss_spans_for(row + 1, row + 9)
    assert set(c.__dict__["_loss_shards"]) == {2}  # one shard's ranges, not the split's
    inside = (whole[:, 0] >= sts[2]) & (whole[:, 1] <= sts[3])
    np.testing.assert_array_equal(got, whole[inside])
    rng = np.random.default_rng(1)
    for _ in range(30):
        starts = rng.integers(0, c.num_tokens - 60, size=int(rng.integers(1, 6)))
        lens = rng.integers(1, 60, size=starts.size)
        spans = c.loss_spans_for(starts + 1, starts + 1 + lens)
        np.testing.assert_array_equal(target_kept(spans, starts, lens), target_kept(whole, starts, lens))
        assert len(c.__dict__["_loss_shards"]) <= 2


def test_a_corrupt_mask_is_refused_when_its_shard_is_first_touched(tmp_path):
    """A changed range in one shard: batches that never touch it are served; the first one that
    does is refused naming loss_sha256."""
    manifest = _build(tmp_path, "chatml", records=RECORDS, validation_fraction=0.0)
    m = json.loads(manifest.read_text())
    assert len(m["shards"]) >= 2
    with h5py.File(manifest.parent / m["shards"][-1]["path"], "r+") as f:
        f["loss_spans"][0, 1] += 1
    c = open_corpus(manifest, "train")
    sts = c.shard_token_starts
    assert c.loss_spans_for(np.array([1]), np.array([5])).size
    with pytest.raises(FormatError, match="loss_sha256"):
        c.loss_spans_for(np.array([int(sts[-2]) + 1]), np.array([int(sts[-2]) + 5]))


def test_parquet_records_build_what_jsonl_records_build(tmp_path):
    """The same records as parquet rows (messages as a list of structs; a column a row does not
    use is null) give the JSONL build's documents and masks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = RECORDS[:20]
    jsonl = _build(tmp_path / "j", "chatml", records=recs, validation_fraction=0.0)
    cols = {k: [r.get(k) for r in recs] for k in ("messages", "prompt", "completion")}
    pq.write_table(pa.table(cols), tmp_path / "p.parquet")
    tokdir = tmp_path / "j" / "tok"
    settings = _multi_settings(tmp_path / "p", tmp_path / "p.parquet", tokdir, validation_fraction=0.0, workers=1)
    settings.update(shard_tokens=2500, chunk_tokens=512)
    build_corpus(BuildConfig(**settings))
    a, b = stored(jsonl), stored(tmp_path / "p" / "manifests" / "shards.json")
    assert a[0].num_documents == b[0].num_documents == len(recs)
    np.testing.assert_array_equal(a[0].doc_ids, b[0].doc_ids)
    np.testing.assert_array_equal(a[0].tokens(0, a[0].num_tokens), b[0].tokens(0, b[0].num_tokens))
    np.testing.assert_array_equal(a[2], b[2])


class _DropRobots:
    """A user's filter (the BuildFilters protocol): drops every document that mentions robots."""

    def process(self, text):
        return (None, "robots") if "robots" in text else (text, None)

    def counters(self):
        return {}


class _Shout(_DropRobots):
    def process(self, text):
        return text.upper(), None


def test_filters_keep_or_drop_fine_tuning_records(tmp_path):
    """Filters see the rendered document and keep or drop it: a user filter's drops are exactly the
    records whose transformers-rendered text it rejects, counted by reason; near dedup drops a
    conversation differing from an earlier one by one word; filters that change text are refused
    up front (--clean) or at the record (a user filter), naming it."""
    from h5corpus.filters import DocumentFilter, FilterConfig

    chats = [r for r in RECORDS if "messages" in r]
    near = json.loads(json.dumps(chats[0]))
    near["messages"][-1]["content"] = near["messages"][-1]["content"] + " Indeed"
    recs = chats[:20] + [near]
    make_tokenizer(tmp_path / "tok", "chatml", training_texts(RECORDS))
    hf = hf_tokenizer(tmp_path / "tok")
    texts = [hf.apply_chat_template(r["messages"], tokenize=False) for r in recs]
    want = {hashlib.sha256(t.encode()).digest()[:16] for t in texts if "robots" not in t}
    assert 0 < len(want) < len(recs)
    m = _build(tmp_path, "chatml", records=recs, filters=_DropRobots(), validation_fraction=0.0)
    c, offs, mask = stored(m)
    assert {i.tobytes() for i in c.doc_ids} == want
    assert json.loads(m.read_text())["splits"]["train"]["dropped"]["robots"] == len(recs) - len(want)
    full = oracle(recs, tmp_path / "tok")
    for d, i in enumerate(c.doc_ids):
        np.testing.assert_array_equal(mask[offs[d] : offs[d + 1]], full[i.tobytes()][1])

    m = _build(tmp_path, "chatml", records=recs, filters=DocumentFilter(FilterConfig(near_dedup=True)))
    got = json.loads(m.read_text())["splits"]
    assert sum(s["dropped"].get("near_dup", 0) for s in got.values()) == 1
    assert sum(s["documents"] for s in got.values()) == len(recs) - 1
    with pytest.raises(ValueError, match="change the text"):
        _build(tmp_path, "chatml", records=recs, filters=DocumentFilter(FilterConfig(clean=True)))
    with pytest.raises(BuildError, match=r"data.jsonl:1: the filters changed the text"):
        _build(tmp_path, "chatml", records=recs, filters=_Shout())


def test_cut_documents_skipped_records_and_text_sources(tmp_path):
    """--max-document-tokens cuts a fine-tuning document and its mask (no EOS, flagged, valid);
    --on-error skip counts a bad record (invalid_record) and builds the rest; a .txt source is
    refused up front, naming it."""
    recs = [r for r in RECORDS if "messages" in r][:10]
    m = _build(tmp_path, "chatml", records=recs, max_document_tokens=24, validation_fraction=0.0)
    c, offs, mask = stored(m)
    full = oracle(recs, tmp_path / "tok")
    for d, i in enumerate(c.doc_ids):
        tokens, want = full[i.tobytes()]
        np.testing.assert_array_equal(c.document(d).astype(np.int64), tokens[:24])
        np.testing.assert_array_equal(mask[offs[d] : offs[d + 1]], want[:24])
    assert (c.doc_flags & 1).all() and validate_corpus(m, deep=True).ok
    m = _build(tmp_path, "chatml", records=[recs[0], {"messages": "hi"}, recs[1]], on_error="skip")
    d = json.loads(m.read_text())
    assert d["build"]["skip_reasons"] == {"invalid_record": 1}
    assert sum(s["documents"] for s in d["splits"].values()) == 2
    (tmp_path / "a.txt").write_text("plain text")
    with pytest.raises(ValueError, match=r"a.txt: a fine-tuning build .* not text"):
        build_corpus(
            BuildConfig(sources=[str(tmp_path / "a.txt")], tokenizer="bytes", loss_on="all", shards_dir=tmp_path / "t")
        )
    assert not (tmp_path / "t").exists()  # refused before anything is written
