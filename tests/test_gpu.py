"""GPU: batches from the loaders reach a CUDA device through pinned memory and a non-blocking copy,
with contents intact. Loader batches are compact (2-byte token rows in one buffer): the buffer is what
gets pinned and copied, and the int64 fields materialize on the device, without a host sync. Marked
``cuda``: skipped (with the reason) on machines without a CUDA device."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from h5corpus.loaders.batch import IGNORE_INDEX, VarlenBatch, collate_varlen
from h5corpus.loaders.bestfit import BestFitDataset
from h5corpus.loaders.window import SlidingWindowDataset
from h5corpus.storage.reader import open_corpus
from tests.helpers import BATCH_TENSORS


def window_keys(b: VarlenBatch, seq_len: int) -> list[str]:
    """sha1 of each window's (inputs, targets, positions), read back to the host."""
    parts = [getattr(b, f).cpu().numpy().reshape(-1, seq_len) for f in ("input_ids", "targets", "position_ids")]
    return [hashlib.sha1(b"".join(p[j].tobytes() for p in parts)).hexdigest() for j in range(parts[0].shape[0])]


def materialize_without_sync(d: VarlenBatch) -> None:
    """Build the int64 fields of a device batch with CUDA sync debugging set to raise: every size
    they need is known on the host, so no operation may wait for the device."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        d.input_ids, d.targets, d.position_ids  # noqa: B018 (materializes)
        d.num_tokens, d.num_targets, d.num_segments, d.max_seqlen  # noqa: B018 (host counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def assert_same_on_device(host: VarlenBatch, dev: VarlenBatch) -> None:
    """Fields materialized on the device equal the host's (CPU materialization), dtype included."""
    for f in BATCH_TENSORS:
        t = getattr(dev, f)
        assert t.is_cuda, f
        assert t.dtype == getattr(host, f).dtype, f
        assert torch.equal(t.cpu(), getattr(host, f)), f
    assert dev.max_seqlen == host.max_seqlen
    assert dev.cu_seqlens.dtype == torch.int32 and dev.input_ids.dtype == torch.int64


@pytest.mark.cuda
@pytest.mark.parametrize("document_mask", [False, True])
def test_window_batches_pinned_by_dataloader_and_copied_non_blocking(stdlib_manifest, document_mask):
    """DataLoader(pin_memory=True, 2 workers) hands over compact batches whose one buffer is pinned;
    .to("cuda", non_blocking=True) copies that buffer only (2 bytes per token + a few ints), the
    fields materialize on the device without a sync and equal the in-process batches."""
    c = open_corpus(stdlib_manifest, "train")
    L = 1024
    ds = SlidingWindowDataset(c, L, batch_size=8, seed=1, document_mask=document_mask)
    want = Counter(w for b in ds for w in window_keys(b, L))  # in-process, CPU materialization
    loader = DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True, collate_fn=collate_varlen)
    got: Counter = Counter()
    for b in loader:
        assert b.is_compact and b.tokens.is_pinned() and b.row_cu.is_pinned() and b.cu_seqlens.is_pinned()
        d = b.to("cuda", non_blocking=True)
        assert d.is_compact and d.tokens.is_cuda and d.tokens.dtype == torch.int16
        assert d.tokens.untyped_storage().nbytes() < 2.1 * d.num_tokens + 1024  # ~2 bytes per token moved
        materialize_without_sync(d)
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
    assert b.is_compact and b.ignore.numel() > 0
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
    assert kw["position_ids"].is_cuda and kw["max_length_q"] == b.max_seqlen


@pytest.mark.cuda
def test_gpt2_dev_batches_on_device_equal_stream(dev_manifest):
    """Real GPT-2 shards (ids above 32,767 stored as negative int16): device inputs/targets widened
    on the GPU equal the corpus tokens at the planned window starts."""
    c = open_corpus(dev_manifest, "train")
    ds = SlidingWindowDataset(c, 4096, batch_size=4, seed=3)
    plan = ds.plan()
    for i, b in zip(range(5), ds):
        d = b.pin_memory().to("cuda", non_blocking=True)
        materialize_without_sync(d)
        torch.cuda.synchronize()
        want = c.gather(plan[4 * i : 4 * i + 4], 4097).astype(np.int64)
        assert torch.equal(d.input_ids.cpu().reshape(4, 4096), torch.from_numpy(want[:, :-1].copy()))
        assert torch.equal(d.targets.cpu().reshape(4, 4096), torch.from_numpy(want[:, 1:].copy()))


@pytest.mark.cuda
def test_best_fit_packs_materialize_on_device_like_on_host(dev_manifest):
    """Best-fit microbatches (rows of different lengths: index path with repeat_interleave) moved
    to the GPU give the same fields as on the host, without a sync; their segment table stays on
    the host."""
    c = open_corpus(dev_manifest, "train")
    for _, b in zip(range(3), BestFitDataset(c, max_seq_len=4096, batch_size=8, with_segments=True)):
        d = b.pin_memory().to("cuda", non_blocking=True)
        materialize_without_sync(d)
        torch.cuda.synchronize()
        d.check()
        assert_same_on_device(b, d)
        assert d.segments is b.segments and d.segments.device.type == "cpu"


@pytest.mark.cuda
def test_uint32_ids_widen_on_device():
    """int32 bit patterns of uint32 ids (up to 2**32 - 1) widen to the ids on the GPU, and the
    ignored target reads IGNORE_INDEX."""
    ids = np.array([2**32 - 1, 5, 2**31, 70_000, 0, 2**31 - 1, 9], dtype=np.uint32)  # rows of 3 and 2 inputs
    d = VarlenBatch.from_compact(ids, [0, 3, 5], ignore=[1]).to("cuda")
    assert d.tokens.dtype == torch.int32 and d.tokens.is_cuda
    materialize_without_sync(d)
    assert d.input_ids.cpu().tolist() == [2**32 - 1, 5, 2**31, 0, 2**31 - 1]
    assert d.targets.cpu().tolist() == [5, IGNORE_INDEX, 70_000, 2**31 - 1, 9]
    assert d.position_ids.cpu().tolist() == [0, 1, 2, 0, 1]


# -- varlen attention on CUDA (h5corpus/loaders/attention.py) --------------------------------------
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

    from h5corpus.loaders.attention import available_backends, causal_attention, reference_causal_attention

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

    from h5corpus.loaders.attention import available_backends, causal_attention

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
