"""Attention and loss over padding-free varlen batches: what makes the batches mean what they claim.

Segments of a :class:`~h5corpus.loaders.batch.VarlenBatch` lie end to end in one flat token axis; only
``cu_seqlens`` says where one document (or chunk) ends and the next begins. Isolation therefore
lives in attention: every token attends causally to earlier tokens of its own segment and to
nothing else. No ``T x T`` mask and no padding row is ever built.

Backends of :func:`causal_attention`, chosen per call:

* CUDA, fp16/bf16: ``torch.nn.attention.varlen.varlen_attn`` (PyTorch >= 2.10) with
  ``window_size=(-1, 0)`` (causal); releases whose signature has ``is_causal`` instead get
  ``is_causal=True``. Otherwise ``flash_attn.flash_attn_varlen_func(..., causal=True)`` when the
  ``flash-attn`` package is installed.
* Anywhere else (CPU, fp32, no kernel): the reference, causal
  ``torch.nn.functional.scaled_dot_product_attention`` run separately on each segment.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from .batch import IGNORE_INDEX

BACKENDS = ("auto", "reference", "varlen_attn", "flash_attn")


@cache
def _varlen_attn() -> tuple[Callable | None, dict]:
    """(torch's varlen_attn or None, the keyword arguments that make it causal)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        return varlen_attn, {"window_size": (-1, 0)}
    if "is_causal" in params:
        return varlen_attn, {"is_causal": True}
    return None, {}


@cache
def _flash_attn() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def available_backends(device: torch.device | str = "cuda") -> list[str]:
    """Backends :func:`causal_attention` can use on ``device`` (``"reference"`` always)."""
    out = ["reference"]
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        if _varlen_attn()[0] is not None:
            out.append("varlen_attn")
        if _flash_attn() is not None:
            out.append("flash_attn")
    return out


def reference_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Per-segment causal SDPA: the definition the fused kernels are checked against.

    ``q``: (T, H, D); ``k``, ``v``: (T, H_kv, D) with ``H`` a multiple of ``H_kv``; ``cu_seqlens``:
    (S + 1,) int32 segment starts plus T. Returns (T, H, D).
    """
    bounds = cu_seqlens.detach().to("cpu", torch.int64).tolist()
    gqa = k.shape[1] != q.shape[1]
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        # (L, H, D) -> (1, H, L, D)
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(o.squeeze(0).transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=0)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention inside each segment of a flat THD batch; no attention across segments.

    Args:
        q: (T, H, D) queries, T = real tokens of the batch (no padding).
        k, v: (T, H_kv, D) keys and values; ``H % H_kv == 0`` (grouped-query attention).
        cu_seqlens: (S + 1,) int32 cumulative segment lengths with a leading 0, ending at T
            (``VarlenBatch.cu_seqlens``, on q's device for the CUDA kernels).
        max_seqlen: longest segment, in tokens (``VarlenBatch.max_seqlen``).
        scale: softmax scale; default ``1 / sqrt(D)``.
        backend: ``"auto"`` (the first of varlen_attn, flash_attn that runs on q's device and
            dtype, else the reference), or one of :data:`BACKENDS` to force it.

    Returns (T, H, D) in q's dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be (tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v token counts differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    fused_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if backend in ("auto", "varlen_attn"):
        fn, causal = _varlen_attn()
        if fn is not None and fused_ok:
            cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
            kw = dict(causal, scale=scale)
            if k.shape[1] != q.shape[1]:
                kw["enable_gqa"] = True
            return fn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), **kw)
        if backend == "varlen_attn":
            raise RuntimeError(
                "varlen_attn needs torch >= 2.10 with CUDA and fp16/bf16 q, k, v "
                f"(got device {q.device}, dtype {q.dtype})"
            )
    if backend in ("auto", "flash_attn"):
        fn = _flash_attn()
        if fn is not None and fused_ok:
            cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
            return fn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), causal=True, softmax_scale=scale)
        if backend == "flash_attn":
            raise RuntimeError("flash_attn needs the flash-attn package, CUDA and fp16/bf16 q, k, v")
    return reference_causal_attention(q, k, v, cu_seqlens, scale=scale)


def packed_loss(
    logits: torch.Tensor, targets: torch.Tensor, num_targets: int | torch.Tensor | None = None
) -> torch.Tensor:
    """Token-weighted mean cross-entropy: sum of CE over real targets / number of real targets.

    ``logits``: (T, V) (any leading shape flattened), ``targets``: (T,) with
    :data:`~h5corpus.loaders.batch.IGNORE_INDEX` where no target counts. ``num_targets`` overrides the
    denominator, e.g. the whole optimizer step's target count under gradient accumulation, so that
    every token weighs the same however the step is split. Computed in at least fp32. Every document weighs
    by its number of targets (not one document = one vote).
    """
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    total = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    if num_targets is None:
        num_targets = (targets != IGNORE_INDEX).sum()
    if isinstance(num_targets, torch.Tensor):
        return total / num_targets.clamp(min=1).to(total.dtype)
    return total / max(int(num_targets), 1)
