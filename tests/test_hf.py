"""h5corpus batches in real Hugging Face transformers models (tiny configs, random init, CPU).

``model(**batch.hf_kwargs())`` must give every segment the logits it gets when run on its own, and
``hf_kwargs(labels=True)`` must make the model's loss equal :func:`h5corpus.packed_loss`, for Llama
and GPT-2 with every attention implementation that runs on the CPU, on real best-fit and
document-masked window batches. The oracle is always the model run once per document (segments
taken from the corpus, or found from EOS tokens), never the packed call itself. Findings and
measurements: docs/READING.md, "Hugging Face transformers".
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Trainer, TrainingArguments
from transformers.utils import is_flash_attn_2_available

from h5corpus import BestFitDataset, SlidingWindowDataset, concat_batches, open_corpus, packed_loss
from h5corpus.loaders.batch import IGNORE_INDEX, make_batch
from tests.helpers import (
    BYTE_IDENTITY,
    byte_encode,
    paragraph_texts,
    per_document_logits,
    readme_python_block,
    window_segments,
    write_corpus,
    write_jsonl,
)

ARCHS = ("llama", "gpt2")
CPU_IMPLS = ("eager", "sdpa")  # flex_attention: its own test (compiled on first use, Llama only)
MODES = ("eval", "train")
ATOL = 1e-5  # fp32 logits; measured differences are ~3e-7 (docs/READING.md)
CROSSING = 1e-2  # attention across documents moves logits by far more than this (measured 0.3-0.9)


def tiny_lm(arch: str, vocab: int, attn_implementation: str, seed: int = 0):
    """A 2-layer, hidden-64 causal LM from a config (no download), dropout off so train mode is
    deterministic; Llama with grouped-query attention (4 query heads, 2 key/value heads)."""
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
    else:
        cfg = GPT2Config(
            vocab_size=vocab,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=1024,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=vocab - 1,
            eos_token_id=vocab - 1,
        )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)


# -- corpora and batches ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def para_manifest(tmp_path_factory, stdlib_corpus_texts) -> Path:
    """Paragraphs of the standard library's sources as byte-id documents (2 to ~2,000 tokens):
    packs and windows hold several documents, long ones are chunked."""
    return write_corpus(
        tmp_path_factory.mktemp("hf-paragraphs"),
        paragraph_texts(stdlib_corpus_texts[:40], 800),
        byte_encode,
        BYTE_IDENTITY,
        chunk_tokens=4096,
        shard_tokens=100_000,
        validation_every=10,
    )


@pytest.fixture(scope="module", params=["stdlib", "dev"])
def corpus_case(request) -> tuple[str, Path, int, int]:
    """(name, manifest, vocabulary size, EOS id): stdlib paragraphs (bytes), the dev corpus (GPT-2)."""
    if request.param == "stdlib":
        return "stdlib", request.getfixturevalue("para_manifest"), 257, 256
    return "dev", request.getfixturevalue("dev_manifest"), 50257, 50256


def bestfit_case(manifest: Path):
    """A best-fit batch with several documents per pack and its segments' tokens read from the
    corpus (``batch.segments``: document, start, length), independent of the batch's ids."""
    corpus = open_corpus(manifest, "train")
    for b in BestFitDataset(corpus, max_seq_len=128, batch_size=3, seed=0, with_segments=True):
        if b.num_segments >= b.num_packs + 3:
            segs = [corpus.document(int(d))[s : s + n] for d, s, n in b.segments.tolist()]
            return b, segs
    pytest.fail("no best-fit batch with several documents per pack")


def window_case(manifest: Path, eos_id: int):
    """A document-masked window batch with ignored targets and several documents per window; its
    segments found from the EOS tokens (checked against ``cu_seqlens``)."""
    corpus = open_corpus(manifest, "train")
    for b in SlidingWindowDataset(corpus, seq_len=96, batch_size=3, seed=0, document_mask=True):
        if b.num_targets < b.num_tokens and b.num_segments >= 6:
            segs = window_segments(b.input_ids.numpy(), 96, eos_id)
            assert np.cumsum([0] + [len(s) for s in segs]).tolist() == b.cu_seqlens.tolist()
            return b, segs
    pytest.fail("no window batch with ignored targets and several documents")


@pytest.fixture(scope="module")
def cases(corpus_case):
    """kind ("bestfit" | "window") -> (batch, segments), per corpus."""
    _, manifest, _, eos = corpus_case
    return {"bestfit": bestfit_case(manifest), "window": window_case(manifest, eos)}


_REFERENCE: dict = {}


def reference_logits(corpus_name: str, kind: str, arch: str, vocab: int, segments) -> torch.Tensor:
    """Per-document logits of ``tiny_lm(arch, vocab, "sdpa")``; every implementation of a test builds
    the same weights (same seed), so one reference serves them all."""
    key = (corpus_name, kind, arch)
    if key not in _REFERENCE:
        _REFERENCE[key] = per_document_logits(tiny_lm(arch, vocab, "sdpa").eval(), segments)
    return _REFERENCE[key]


def run_packed(model, batch, mode: str) -> torch.Tensor:
    """(T, V) logits of one packed forward in ``mode``; train mode records the autograd graph."""
    model.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"):
        out = model(**batch.hf_kwargs())
    return out.logits[0].detach()


def one_segment_metadata(kw: dict) -> dict:
    """``kw`` with varlen metadata that claims the whole row is one document (positions kept)."""
    T = kw["input_ids"].shape[1]
    whole = torch.tensor([0, T], dtype=torch.int32)
    return {**kw, "cu_seq_lens_q": whole, "cu_seq_lens_k": whole, "max_length_q": T, "max_length_k": T}


# -- the contract ----------------------------------------------------------------------------------
def test_hf_kwargs_contract(para_manifest):
    """Exactly the keys, shapes and dtypes an HF causal LM reads, from eager and compact batches:
    (1, T) int64 ids and restarting positions, int32 ``cu_seq_lens``, int lengths, ``use_cache=False``;
    ``labels=True`` adds ``shift_labels`` = targets and ``labels`` = targets one place right."""
    seg_in = [np.array([5, 6, 7]), np.array([8]), np.array([9, 10])]
    seg_tg = [np.array([6, 7, IGNORE_INDEX]), np.array([IGNORE_INDEX]), np.array([10, 11])]
    eager = make_batch(seg_in, seg_tg, [4, 2])
    compact, _ = window_case(para_manifest, 256)
    for b in (eager, compact):
        kw = b.hf_kwargs()
        assert set(kw) == {
            "input_ids",
            "position_ids",
            "cu_seq_lens_q",
            "cu_seq_lens_k",
            "max_length_q",
            "max_length_k",
            "use_cache",
        }
        T = b.num_tokens
        for k in ("input_ids", "position_ids"):
            assert kw[k].shape == (1, T) and kw[k].dtype == torch.int64
        assert torch.equal(kw["input_ids"][0], b.input_ids) and torch.equal(kw["position_ids"][0], b.position_ids)
        for k in ("cu_seq_lens_q", "cu_seq_lens_k"):
            assert kw[k].dtype == torch.int32 and torch.equal(kw[k], b.cu_seqlens)
        assert kw["max_length_q"] == kw["max_length_k"] == b.max_seqlen and isinstance(kw["max_length_q"], int)
        assert kw["use_cache"] is False
        lab = b.hf_kwargs(labels=True)
        assert set(lab) == set(kw) | {"labels", "shift_labels"}
        want_shift = b.targets.numpy()
        want_labels = np.concatenate([[IGNORE_INDEX], want_shift[:-1]])
        assert lab["shift_labels"].shape == lab["labels"].shape == (1, T)
        assert np.array_equal(lab["shift_labels"][0].numpy(), want_shift)
        assert np.array_equal(lab["labels"][0].numpy(), want_labels)
    lab = eager.hf_kwargs(labels=True)  # the hand-made batch, spelled out
    assert lab["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert lab["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert lab["cu_seq_lens_q"].tolist() == [0, 3, 4, 6] and lab["max_length_q"] == 3
    assert lab["shift_labels"].tolist() == [[6, 7, IGNORE_INDEX, IGNORE_INDEX, 10, 11]]
    assert lab["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, IGNORE_INDEX, 10]]
    empty = make_batch([], [], [])
    assert empty.hf_kwargs(labels=True)["labels"].shape == (1, 0)


# -- isolation: packed logits = per-document logits ------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["bestfit", "window"])
def test_packed_logits_equal_per_document(corpus_case, cases, kind, arch, impl, mode):
    """``model(**batch.hf_kwargs())`` on a real packed batch gives each document's own logits."""
    name, _, vocab, _ = corpus_case
    batch, segs = cases[kind]
    want = reference_logits(name, kind, arch, vocab, segs)
    got = run_packed(tiny_lm(arch, vocab, impl), batch, mode)
    diff = (got - want).abs().max().item()
    print(f"{name} {kind} {arch} {impl} {mode}: max |packed - per-document| = {diff:.2e}")
    assert diff < ATOL, f"{arch}/{impl}/{mode}: packed logits differ from per-document ones by {diff}"


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")),
    reason="flex_attention on the CPU compiles C++ kernels (torch inductor); no C++ compiler on PATH",
)
def test_flex_attention_packed_logits_equal_per_document(para_manifest):
    """flex_attention (Llama; GPT-2 has none in transformers) isolates documents too, in eval and
    train mode. One call shape only: the first flex call compiles (tens of seconds on the CPU), so
    the batch is a best-fit batch and a window batch end to end, and train mode runs without
    gradients (torch has no flex_attention backward on the CPU)."""
    (bf, bf_segs), (win, win_segs) = bestfit_case(para_manifest), window_case(para_manifest, 256)
    batch, segs = concat_batches([bf, win]), bf_segs + win_segs
    model = tiny_lm("llama", 257, "flex_attention")
    ref = tiny_lm("llama", 257, "sdpa")
    ref.load_state_dict(model.state_dict())
    want = per_document_logits(ref.eval(), segs)
    for mode in MODES:
        model.train(mode == "train")
        with torch.no_grad():
            got = model(**batch.hf_kwargs()).logits[0]
        diff = (got - want).abs().max().item()
        print(f"stdlib bestfit+window llama flex_attention {mode}: max |packed - per-document| = {diff:.2e}")
        assert diff < ATOL, f"flex_attention/{mode}: packed logits differ from per-document ones by {diff}"
    with torch.no_grad():  # like eager and sdpa, flex finds the documents from position_ids alone
        got = model(**one_segment_metadata(batch.hf_kwargs())).logits[0]
    assert (got - want).abs().max().item() < ATOL


def test_gpt2_has_no_flex_attention():
    """Why flex_attention is tested on Llama only: transformers refuses it for GPT-2."""
    with pytest.raises(ValueError, match="flex_attention"):
        tiny_lm("gpt2", 257, "flex_attention")


@pytest.mark.cuda
@pytest.mark.skipif(not is_flash_attn_2_available(), reason="flash_attention_2 needs the flash-attn package")
@pytest.mark.parametrize("arch", ARCHS)
def test_flash_attention_2_packed_logits_equal_per_document(para_manifest, arch):
    """flash_attention_2 reads ``cu_seq_lens_q/k`` and ``max_length_q/k`` (one varlen call per
    layer), and isolates documents with them; fp16 on the GPU, against per-document flash calls."""
    batch, segs = bestfit_case(para_manifest)
    model = tiny_lm(arch, 257, "flash_attention_2").to("cuda", torch.float16).eval()
    with torch.no_grad():
        got = model(**batch.to("cuda").hf_kwargs()).logits[0].float()
    want = per_document_logits(model, segs).float()
    diff = (got - want).abs().max().item()
    print(f"stdlib bestfit {arch} flash_attention_2 eval: max |packed - per-document| = {diff:.2e}")
    assert diff < 2e-2, f"flash_attention_2: packed logits differ from per-document ones by {diff}"


def test_without_hf_kwargs_attention_crosses_documents(para_manifest):
    """The trap ``hf_kwargs()`` closes: the model's default ``use_cache=True`` (a KV cache is
    created) or any 2-D ``attention_mask`` makes eager and sdpa attend across documents, silently;
    ``hf_kwargs()`` isolates them although ``config.use_cache`` stays True."""
    batch, segs = bestfit_case(para_manifest)
    for arch in ARCHS:
        want = reference_logits("stdlib", "bestfit", arch, 257, segs)
        for impl in CPU_IMPLS:
            model = tiny_lm(arch, 257, impl).eval()
            assert model.config.use_cache is True
            kw = batch.hf_kwargs()
            with torch.no_grad():
                isolated = model(**kw).logits[0]
                cached = model(**{k: v for k, v in kw.items() if k != "use_cache"}).logits[0]
                masked = model(**kw, attention_mask=torch.ones_like(kw["input_ids"])).logits[0]
            assert (isolated - want).abs().max().item() < ATOL
            for what, logits in (("default use_cache", cached), ("attention_mask", masked)):
                diff = (logits - want).abs().max().item()
                print(f"{arch} {impl} with {what}: max |packed - per-document| = {diff:.2e}")
                assert diff > CROSSING, f"{arch}/{impl} with {what} unexpectedly isolated documents"


def test_eager_and_sdpa_isolate_by_position_ids_alone(para_manifest):
    """eager and sdpa never read ``cu_seq_lens``: without them, or with ones that claim a single
    document, the restarting ``position_ids`` alone still isolate every document."""
    batch, segs = bestfit_case(para_manifest)
    kw = batch.hf_kwargs()
    bare = {k: v for k, v in kw.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    for arch in ARCHS:
        want = reference_logits("stdlib", "bestfit", arch, 257, segs)
        for impl in CPU_IMPLS:
            model = tiny_lm(arch, 257, impl).eval()
            with torch.no_grad():
                for what, args in (("no cu_seq_lens", bare), ("one-document cu_seq_lens", one_segment_metadata(kw))):
                    diff = (model(**args).logits[0] - want).abs().max().item()
                    assert diff < ATOL, f"{arch}/{impl} with {what}: {diff}"


# -- the loss --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["bestfit", "window"])
def test_hf_loss_equals_packed_loss(corpus_case, cases, kind, arch):
    """HF's loss with ``hf_kwargs(labels=True)`` equals ``packed_loss`` of its logits (the window
    batch has ignored targets), with ``num_items_in_batch`` the ``num_targets`` one; for best-fit
    batches it equals the per-document cross-entropy against the corpus's next tokens; code that
    shifts ``labels`` itself loses only the batch's last target."""
    name, _, vocab, _ = corpus_case
    batch, segs = cases[kind]
    model = tiny_lm(arch, vocab, "sdpa").eval()
    kw = batch.hf_kwargs(labels=True)
    with torch.no_grad():
        out = model(**kw)
        n = batch.num_targets + 17
        out_n = model(**kw, num_items_in_batch=torch.tensor(n))
        shifted_here = model(**{k: v for k, v in kw.items() if k != "shift_labels"})
    logits = out.logits[0]
    want = packed_loss(logits, batch.targets)
    assert abs(out.loss.item() - want.item()) < 1e-6
    assert abs(out_n.loss.item() - packed_loss(logits, batch.targets, num_targets=n).item()) < 1e-6
    last_lost = batch.targets.clone()
    last_lost[-1] = IGNORE_INDEX
    assert abs(shifted_here.loss.item() - packed_loss(logits, last_lost).item()) < 1e-6
    if kind == "window":
        assert batch.num_targets < batch.num_tokens  # ignored targets are part of the case
    else:  # next token of each segment's every input, read from the corpus documents
        corpus = open_corpus(corpus_case[1], "train")
        nexts = [corpus.document(int(d))[a + 1 : a + m + 1] for d, a, m in batch.segments.tolist()]
        per_doc = reference_logits(name, kind, arch, vocab, segs)
        ce = F.cross_entropy(per_doc, torch.as_tensor(np.concatenate(nexts).astype(np.int64)), reduction="sum")
        assert abs(out.loss.item() - ce.item() / sum(map(len, nexts))) < 1e-5


# -- training --------------------------------------------------------------------------------------
def heldout_loss(model, batch) -> float:
    """``packed_loss`` of ``model`` on a fixed validation batch (eval mode, no grad)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        logits = model(**batch.to(model.device).hf_kwargs()).logits
    model.train(was)
    return packed_loss(logits, batch.targets.to(logits.device)).item()


@pytest.fixture(scope="module")
def heldout(para_manifest):
    return next(iter(BestFitDataset(open_corpus(para_manifest, "validation"), max_seq_len=128, batch_size=4, seed=0)))


def train_batches(manifest: Path):
    return BestFitDataset(open_corpus(manifest, "train"), max_seq_len=128, batch_size=2, seed=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_training_loop_loss_goes_down(para_manifest, heldout, arch):
    """Six AdamW steps of ``model(**batch.hf_kwargs(labels=True)).loss.backward()`` on best-fit
    batches lower the held-out loss."""
    model = tiny_lm(arch, 257, "sdpa").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = heldout_loss(model, heldout)
    for step, batch in enumerate(train_batches(para_manifest)):
        if step == 6:
            break
        model(**batch.hf_kwargs(labels=True)).loss.backward()
        opt.step()
        opt.zero_grad()
    after = heldout_loss(model, heldout)
    print(f"{arch} plain loop: held-out loss {before:.3f} -> {after:.3f}")
    assert after < before - 0.5


def test_accelerate_loop_loss_goes_down(para_manifest, heldout):
    """accelerate with gradient accumulation: the model and optimizer go through ``prepare``; the
    h5corpus loader is iterated as is (it partitions ranks itself) and batches move with ``.to``."""
    from accelerate import Accelerator

    model = tiny_lm("llama", 257, "sdpa").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = acc.prepare(model, opt)
    before = heldout_loss(model, heldout)
    for step, batch in enumerate(train_batches(para_manifest)):
        if step == 8:
            break
        with acc.accumulate(model):
            acc.backward(model(**batch.to(acc.device).hf_kwargs(labels=True)).loss)
            opt.step()
            opt.zero_grad()
    after = heldout_loss(acc.unwrap_model(model), heldout)
    print(f"accelerate: held-out loss {before:.3f} -> {after:.3f}")
    assert after < before - 0.5


def test_trainer_loss_is_packed_loss_of_the_accumulated_step(para_manifest, heldout, tmp_path):
    """``Trainer`` with a collator returning ``hf_kwargs(labels=True)`` and 2 accumulation steps:
    its first logged loss is the token-weighted loss of both microbatches under the initial
    weights (it counts targets from ``shift_labels``), and training lowers the held-out loss."""
    model = tiny_lm("llama", 257, "sdpa")
    first = [b for _, b in zip(range(2), train_batches(para_manifest))]
    init = copy.deepcopy(model).eval()
    with torch.no_grad():
        ce = [packed_loss(init(**b.hf_kwargs()).logits, b.targets, num_targets=1).item() for b in first]
    want_first = sum(ce) / sum(b.num_targets for b in first)
    before = heldout_loss(model, heldout)
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=4,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_batches(para_manifest),
        data_collator=lambda items: items[0].hf_kwargs(labels=True),
    )
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    after = heldout_loss(model, heldout)
    print(f"Trainer: first step loss {logged[0]:.6f} (oracle {want_first:.6f}); held-out {before:.3f} -> {after:.3f}")
    assert len(logged) == 4
    assert abs(logged[0] - want_first) < 1e-4
    assert after < before - 0.5


# -- the README --------------------------------------------------------------------------------------


def test_readme_hugging_face_snippet_runs(tmp_path, stdlib_corpus_texts, monkeypatch):
    """The README's "Use with Hugging Face transformers" block, run as written against a corpus
    built here (bytes tokenizer), with a tiny Llama as ``model``: it trains (weights change) and
    its loss is ``packed_loss`` of its logits."""
    import h5corpus

    block = readme_python_block("Use with Hugging Face transformers")
    assert len(block.strip().splitlines()) <= 6
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "docs.jsonl", paragraph_texts(stdlib_corpus_texts[:2], 20))  # ~2,800 tokens
    h5corpus.build_corpus(h5corpus.BuildConfig(sources=["docs.jsonl"], tokenizer="bytes", workers=1))
    model = tiny_lm("llama", 257, "sdpa").train()
    start = [p.detach().clone() for p in model.parameters()]
    env = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}
    exec(compile(block, "README.md", "exec"), env)
    out, batch = env["out"], env["batch"]
    assert abs(out.loss.item() - packed_loss(out.logits.detach(), batch.targets).item()) < 1e-6
    assert any(not torch.equal(a, p) for a, p in zip(start, model.parameters()))
