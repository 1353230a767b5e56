"""GPU: batches from the loaders reach a CUDA device through pinned memory and a non-blocking copy,
with contents intact. Marked ``cuda``: skipped (with the reason) on machines without a CUDA device."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from h5corpus.batch import IGNORE_INDEX, VarlenBatch, collate_varlen
from h5corpus.reader import open_corpus
from h5corpus.window import SlidingWindowDataset

FIELDS = ("input_ids", "targets", "position_ids", "cu_seqlens", "pack_lengths")


def window_keys(b: VarlenBatch, seq_len: int) -> list[str]:
    """sha1 of each window's (inputs, targets, positions), read back to the host."""
    parts = [getattr(b, f).cpu().numpy().reshape(-1, seq_len) for f in ("input_ids", "targets", "position_ids")]
    return [hashlib.sha1(b"".join(p[j].tobytes() for p in parts)).hexdigest() for j in range(parts[0].shape[0])]


def assert_same_on_device(host: VarlenBatch, dev: VarlenBatch) -> None:
    for f in FIELDS:
        t = getattr(dev, f)
        assert t.is_cuda, f
        assert t.dtype == getattr(host, f).dtype, f
        assert torch.equal(t.cpu(), getattr(host, f)), f
    assert dev.max_seqlen == host.max_seqlen
    assert dev.cu_seqlens.dtype == torch.int32


@pytest.mark.cuda
@pytest.mark.parametrize("document_mask", [False, True])
def test_window_batches_pinned_by_dataloader_and_copied_non_blocking(stdlib_manifest, document_mask):
    """DataLoader(pin_memory=True, 2 workers) hands over pinned VarlenBatches; .to("cuda",
    non_blocking=True) then a sync gives the same contents on the device as the in-process batches."""
    c = open_corpus(stdlib_manifest, "train")
    L = 1024
    ds = SlidingWindowDataset(c, L, batch_size=8, seed=1, document_mask=document_mask)
    want = Counter(w for b in ds for w in window_keys(b, L))  # in-process, no pinning
    loader = DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True, collate_fn=collate_varlen)
    got: Counter = Counter()
    for b in loader:
        assert all(getattr(b, f).is_pinned() for f in FIELDS)
        d = b.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        d.check()
        assert_same_on_device(b, d)
        got.update(window_keys(d, L))
    assert got == want


@pytest.mark.cuda
def test_device_batch_trains_a_step_with_ignored_targets(stdlib_manifest):
    """On the device, the padding-free batch drives a next-token loss where IGNORE_INDEX targets
    are excluded (loss over num_targets positions) and the HF keyword names are all there."""
    c = open_corpus(stdlib_manifest, "train")
    b = next(iter(SlidingWindowDataset(c, 512, batch_size=4, seed=0, document_mask=True))).to("cuda")
    emb = torch.nn.Embedding(257, 32, device="cuda")
    head = torch.nn.Linear(32, 257, device="cuda")
    logits = head(emb(b.input_ids))
    loss = torch.nn.functional.cross_entropy(logits, b.targets, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    assert torch.isfinite(loss) and emb.weight.grad is not None
    keep = b.targets != IGNORE_INDEX
    assert int(keep.sum()) == b.num_targets
    manual = torch.nn.functional.cross_entropy(logits[keep], b.targets[keep], reduction="sum")
    torch.testing.assert_close(loss, manual)
    kw = b.hf_kwargs()
    assert kw["input_ids"].shape == (1, b.num_tokens) and kw["cu_seq_lens_q"].is_cuda
    assert kw["max_length_q"] == b.max_seqlen


@pytest.mark.cuda
def test_gpt2_dev_batches_on_device_equal_stream(dev_manifest):
    """Real GPT-2 shards: device inputs equal the corpus tokens at the planned window starts."""
    c = open_corpus(dev_manifest, "train")
    ds = SlidingWindowDataset(c, 4096, batch_size=4, seed=3)
    plan = ds.plan()
    for i, b in zip(range(5), ds):
        d = b.pin_memory().to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        want = c.gather(plan[4 * i : 4 * i + 4], 4097).astype(np.int64)
        assert torch.equal(d.input_ids.cpu().reshape(4, 4096), torch.from_numpy(want[:, :-1].copy()))
        assert torch.equal(d.targets.cpu().reshape(4, 4096), torch.from_numpy(want[:, 1:].copy()))


# -- best-fit packing: varlen attention on CUDA (issue 5; h5corpus/attention.py) ------------------
def _varlen_case(dtype, seed=0, lens=(1, 7, 300, 64, 1000, 2, 129), heads=4, kv_heads=4, dim=64):
    import itertools

    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    q = torch.randn(T, heads, dim, generator=g).to("cuda", dtype)
    k = torch.randn(T, kv_heads, dim, generator=g).to("cuda", dtype)
    v = torch.randn(T, kv_heads, dim, generator=g).to("cuda", dtype)
    return q, k, v, cu, max(lens)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_attn_matches_the_per_segment_reference(dtype_name, kv_heads):
    """torch's varlen_attn (window_size=(-1, 0)) equals the CPU per-segment causal SDPA reference in
    outputs and in q/k/v gradients, within half-precision tolerance, GQA included."""
    import torch

    from h5corpus.attention import available_backends, causal_attention, reference_causal_attention

    if "varlen_attn" not in available_backends("cuda"):
        pytest.skip("this torch has no torch.nn.attention.varlen.varlen_attn")
    dtype = getattr(torch, dtype_name)
    q, k, v, cu, mx = _varlen_case(dtype, kv_heads=kv_heads)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = causal_attention(qs, ks, vs, cu.cuda(), mx, backend="varlen_attn")
    qr, kr, vr = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = reference_causal_attention(qr, kr, vr, cu)
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), **tol)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, dtype)
    out.backward(grad)
    ref.backward(grad.double().cpu())
    for name, a, b in (("q", qs, qr), ("k", ks, kr), ("v", vs, vr)):
        torch.testing.assert_close(a.grad.double().cpu(), b.grad, rtol=5e-2, atol=5e-2, msg=f"grad of {name}")


@pytest.mark.cuda
def test_varlen_attn_isolates_segments_on_cuda():
    """On the GPU, new values in one segment's q/k/v change only that segment's outputs."""
    import torch

    from h5corpus.attention import available_backends, causal_attention

    if "varlen_attn" not in available_backends("cuda"):
        pytest.skip("this torch has no torch.nn.attention.varlen.varlen_attn")
    q, k, v, cu, mx = _varlen_case(torch.bfloat16, seed=2)
    a, z = int(cu[3]), int(cu[4])
    k2, v2 = k.clone(), v.clone()
    k2[a:z] = torch.randn_like(k2[a:z])
    v2[a:z] = torch.randn_like(v2[a:z])
    y1 = causal_attention(q, k, v, cu.cuda(), mx, backend="varlen_attn")
    y2 = causal_attention(q, k2, v2, cu.cuda(), mx, backend="varlen_attn")
    others = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    others[a:z] = False
    assert (y1[a:z] - y2[a:z]).abs().max().item() > 0.1
    torch.testing.assert_close(y1[others], y2[others], rtol=0, atol=1e-3)
