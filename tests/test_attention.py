"""Packed batches mean what they claim: a tiny causal transformer over a packed VarlenBatch gives
the outputs and gradients of running each segment alone, documents cannot see each other, only
real tokens enter the model, and the loss is the token-weighted mean over real targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from h5corpus import BestFitDataset, causal_attention, open_corpus, packed_loss
from h5corpus.loaders.attention import available_backends, reference_causal_attention
from h5corpus.loaders.batch import IGNORE_INDEX, VarlenBatch, make_batch


class TinyBlock(nn.Module):
    """Embedding (+ learned positions read from ``position_ids``), one causal attention layer
    through :func:`causal_attention`, an MLP and an LM head; every op is per token except attention."""

    def __init__(self, vocab: int, max_pos: int, d: int = 32, heads: int = 4, *, leaky: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.leaky = leaky  # negative control: attend across the whole flat batch, ignoring boundaries
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_pos, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen):
        T = input_ids.numel()
        x = self.tok(input_ids) + self.pos(position_ids)  # (T, d): real tokens only
        q, k, v = self.qkv(self.ln1(x)).view(T, 3, self.heads, -1).unbind(1)  # THD each
        if self.leaky:
            cu_seqlens, max_seqlen = torch.tensor([0, T], dtype=torch.int32), T
        x = x + self.proj(causal_attention(q, k, v, cu_seqlens, max_seqlen).reshape(T, -1))
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


def run(model: TinyBlock, b: VarlenBatch) -> torch.Tensor:
    return model(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)


def segments(b: VarlenBatch) -> list[tuple[int, int]]:
    cu = b.cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def alone(b: VarlenBatch, a: int, z: int) -> VarlenBatch:
    """Segment [a, z) of ``b`` as a batch of its own."""
    return make_batch([b.input_ids[a:z].numpy()], [b.targets[a:z].numpy()], [z - a])


def pick_batch(ds: BestFitDataset) -> VarlenBatch:
    """The first batch whose packs hold several segments each (so isolation is actually tested)."""
    for b in ds:
        if b.num_segments >= b.num_packs + 3:
            return b
    pytest.fail("no batch with several segments per pack")


@pytest.fixture(scope="module")
def stdlib_batch(tmp_path_factory, stdlib_corpus_texts) -> VarlenBatch:
    from tests.helpers import BYTE_IDENTITY, byte_encode, write_corpus

    m = write_corpus(
        tmp_path_factory.mktemp("attn-stdlib"),
        stdlib_corpus_texts[:60],
        byte_encode,
        BYTE_IDENTITY,
        chunk_tokens=4096,
        shard_tokens=400_000,
    )
    return pick_batch(BestFitDataset(open_corpus(m, "train"), max_seq_len=700, batch_size=3, seed=1))


@pytest.fixture(scope="module")
def dev_batch(dev_manifest) -> tuple[VarlenBatch, int]:
    """A real GPT-2 batch of the dev corpus with its ids renumbered densely (equal ids stay equal),
    so the tiny model's vocabulary is the batch's few hundred ids rather than 50,257."""
    b = pick_batch(BestFitDataset(open_corpus(dev_manifest, "train"), max_seq_len=512, batch_size=2, seed=0))
    real = b.targets != IGNORE_INDEX
    ids, inv = torch.unique(torch.cat([b.input_ids, b.targets[real]]), return_inverse=True)
    targets = torch.full_like(b.targets, IGNORE_INDEX)
    targets[real] = inv[b.num_tokens :]
    return VarlenBatch(
        inv[: b.num_tokens], targets, b.position_ids, b.cu_seqlens, b.max_seqlen, b.pack_lengths
    ), ids.numel()


@pytest.fixture(params=["stdlib", "dev"])
def batch_and_vocab(request) -> tuple[VarlenBatch, int]:
    if request.param == "stdlib":
        return request.getfixturevalue("stdlib_batch"), 257
    return request.getfixturevalue("dev_batch")


def make_model(vocab: int, **kw) -> TinyBlock:
    torch.manual_seed(0)
    return TinyBlock(vocab, max_pos=1024, **kw).double()


# --------------------------------------------------------------------------------------------
def test_reference_attention_equals_a_dense_block_diagonal_causal_mask():
    """The per-segment SDPA reference equals attention with an explicit T x T block-diagonal causal
    mask (built here only as the oracle), including grouped-query heads."""
    torch.manual_seed(0)
    lens = [5, 1, 9, 3]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    T = int(cu[-1])
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mask = (seg[:, None] == seg[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    for hk in (4, 2):
        q = torch.randn(T, 4, 8, dtype=torch.float64)
        k, v = torch.randn(T, hk, 8, dtype=torch.float64), torch.randn(T, hk, 8, dtype=torch.float64)
        kk, vv = (t.repeat_interleave(4 // hk, dim=1) for t in (k, v))
        dense = F.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask
        )
        got = causal_attention(q, k, v, cu, max(lens))
        torch.testing.assert_close(got, dense.transpose(0, 1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(reference_causal_attention(q, k, v, cu), got, rtol=0, atol=0)


def test_packed_and_separate_execution_agree(batch_and_vocab):
    """Running the packed batch once equals running every segment alone: same logits, same loss,
    same parameter gradients (float64, tolerance 1e-9)."""
    b, vocab = batch_and_vocab
    model = make_model(vocab)
    logits = run(model, b)
    loss = packed_loss(logits, b.targets)
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    outs = []
    for a, z in segments(b):
        s = alone(b, a, z)
        out = run(model, s)
        outs.append(out.detach())
        total = total + F.cross_entropy(out, s.targets, ignore_index=IGNORE_INDEX, reduction="sum")
    (total / b.num_targets).backward()
    torch.testing.assert_close(logits.detach(), torch.cat(outs), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(loss.detach(), (total / b.num_targets).detach(), rtol=1e-9, atol=1e-9)
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-8, atol=1e-10, msg=f"gradient of {n}")


def test_changing_one_document_changes_no_other_document(batch_and_vocab):
    """New tokens in one segment change that segment's outputs and leave every other segment's
    outputs unchanged; the same perturbation does leak without boundaries (the test can fail)."""
    b, vocab = batch_and_vocab
    segs = segments(b)
    j = max(range(len(segs)), key=lambda i: segs[i][1] - segs[i][0]) if len(segs) < 3 else len(segs) // 2
    a, z = segs[j]
    changed = b.input_ids.clone()
    changed[a:z] = torch.randint(0, vocab, (z - a,), generator=torch.Generator().manual_seed(5))
    b2 = VarlenBatch(changed, b.targets, b.position_ids, b.cu_seqlens, b.max_seqlen, b.pack_lengths)
    others = torch.ones(b.num_tokens, dtype=torch.bool)
    others[a:z] = False
    with torch.no_grad():
        model = make_model(vocab)
        y1, y2 = run(model, b), run(model, b2)
        assert not torch.allclose(y1[a:z], y2[a:z]), "the perturbed document's outputs should change"
        torch.testing.assert_close(y1[others], y2[others], rtol=0, atol=1e-12)
        leaky = make_model(vocab, leaky=True)
        later = others.clone()
        later[:z] = False
        if later.any():
            assert not torch.allclose(run(leaky, b)[later], run(leaky, b2)[later]), "negative control did not leak"


def test_model_input_length_equals_the_real_input_count(batch_and_vocab):
    """The model's embedding sees exactly the real inputs (= sum of pack lengths = cu_seqlens[-1]),
    never the packs' unused capacity, and positions restart at 0 in every segment."""
    b, vocab = batch_and_vocab
    model = make_model(vocab)
    seen = []
    model.tok.register_forward_hook(lambda m, inp, out: seen.append(inp[0].numel()))
    with torch.no_grad():
        out = run(model, b)
    b.check()
    assert seen == [b.num_tokens] and out.shape[0] == b.num_tokens
    assert b.num_tokens == int(b.pack_lengths.sum()) == int(b.cu_seqlens[-1])
    starts = b.cu_seqlens[:-1].long()
    assert bool((b.position_ids[starts] == 0).all())


def test_every_dev_batch_feeds_only_real_tokens(dev_manifest):
    """Across the first dev microbatches at 4,096 x 35: inputs = real tokens < packs x capacity
    whenever a pack is not full (unused capacity is not materialized)."""
    ds = BestFitDataset(open_corpus(dev_manifest, "train"), seed=3)
    for _, b in zip(range(3), ds):
        b.check()
        assert b.num_tokens == int(b.pack_lengths.sum())
        assert b.num_tokens <= b.num_packs * 4096
        assert (b.num_tokens < b.num_packs * 4096) == bool((b.pack_lengths < 4096).any())


def test_packed_loss_is_token_weighted_and_accumulates_exactly():
    """Loss = sum of CE over real targets / their count (IGNORE_INDEX excluded), not a mean of
    per-document means; with the step's total count as denominator, microbatch losses add up to
    the loss of the whole step."""
    torch.manual_seed(0)
    logits = torch.randn(10, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (10,))
    targets[3] = IGNORE_INDEX
    ce = F.cross_entropy(logits, targets.clamp(min=0), reduction="none")
    real = targets != IGNORE_INDEX
    expected = ce[real].sum() / real.sum()
    torch.testing.assert_close(packed_loss(logits, targets), expected)
    doc_means = torch.stack([ce[:2].mean(), ce[2:10][real[2:10]].mean()]).mean()  # 2 docs of unequal length
    assert not torch.allclose(packed_loss(logits, targets), doc_means)
    n = int(real.sum())
    parts = packed_loss(logits[:4], targets[:4], num_targets=n) + packed_loss(logits[4:], targets[4:], num_targets=n)
    torch.testing.assert_close(parts, expected)


def test_backend_choice_on_cpu():
    """On CPU only the reference runs; forcing a fused kernel there is an error, not a silent fallback."""
    assert available_backends("cpu") == ["reference"]
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="varlen_attn needs"):
        causal_attention(q, q, q, cu, 4, backend="varlen_attn")
    with pytest.raises(ValueError, match="backend must be"):
        causal_attention(q, q, q, cu, 4, backend="magic")
