"""Ragged attention over the L1 page pool: packed sequences of different lengths, no padding, no mask.

A batch of segments (new tokens of several sequences) attends in at most two calls per layer:

* the **shared part**: the cached pages every segment starts with (a RAG document, a few-shot block, a
  system prompt) are gathered once and every query of the batch attends to them, unmasked;
* the **own part**: each segment's remaining keys (its own cached tokens, then its new tokens), packed
  one after another, attended causally per segment (query ``i`` of a segment of ``n`` queries over
  ``m`` keys sees keys ``0 .. m - n + i``: the new tokens are the last of their sequence).

The two partial softmaxes merge exactly through their log-sum-exps. On a GPU in 16-bit floats both
calls run fused kernels that handle grouped-query heads themselves (cuDNN for the shared part, the
variable-length flash kernel for the own part); elsewhere (the CPU, fp32) a per-segment fp32
computation with the same contract stands in, so the CPU tests check the plumbing the GPU runs.

Contract of :func:`varlen_attention`: ``q`` ``[Tq, Hq, D]``, ``k``/``v`` ``[Tk, Hk, D]`` with ``Hq`` a
multiple of ``Hk`` (query head ``h`` uses KV head ``h // (Hq // Hk)``); ``cu_q``/``cu_k`` int32
``[B + 1]`` cumulative lengths; every segment has at least one query and one key. Returns
``(out [Tq, Hq, D] in q's dtype, lse fp32 [Hq, Tq])``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from itertools import pairwise

import torch

_FLASH_BROKEN = False  # set after the flash kernel failed once on this process (then: the exact path)
_CUDNN_BROKEN = False  # ... the cuDNN kernel (then: flash)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
           max_q: int, max_k: int, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    global _FLASH_BROKEN
    if _FLASH_BROKEN or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    try:
        res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                      scale=scale)
    except (RuntimeError, NotImplementedError, AttributeError) as e:  # no varlen flash kernel in this build
        res = None
        why = str(e)
    if res is not None and res[1].shape != (q.shape[1], q.shape[0]):  # older kernels pad the lse per segment
        why = f"log-sum-exp of shape {tuple(res[1].shape)}"
        res = None
    if res is None:
        _FLASH_BROKEN = True
        warnings.warn(f"varlen flash attention unusable ({why}); using the exact (slow) path", stacklevel=3)
        return None
    return res[0], res[1].float()


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]: cu_q[b + 1]].float().transpose(0, 1)  # [Hq, n, D]
        ks = k[cu_k[b]: cu_k[b + 1]].float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, m, D]
        vs = v[cu_k[b]: cu_k[b + 1]].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale  # [Hq, n, m]
        if causal:
            n, m = scores.shape[-2:]
            seen = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
            scores = scores.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
        outs.append(torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, causal: bool, scale: float,
                     cu_host: tuple[list[int], list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed variable-length attention with its log-sum-exp (see the module docstring for the contract).

    ``cu_host`` (the same cumulative lengths as Python lists) spares the exact path a device read."""
    got = _flash(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    if got is not None:
        return got
    hq, hk = (cu_q.tolist(), cu_k.tolist()) if cu_host is None else cu_host
    return _exact(q, k, v, hq, hk, causal, scale)


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    global _CUDNN_BROKEN
    if _CUDNN_BROKEN or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    T, hq, _ = q.shape
    try:
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), None,
            True, 0.0, False, False, scale=scale)
    except (RuntimeError, NotImplementedError, AttributeError) as e:  # no cuDNN attention for this here
        _CUDNN_BROKEN = True
        warnings.warn(f"cuDNN attention unavailable ({e}); using flash", stacklevel=3)
        return None
    return res[0][0].transpose(0, 1), res[1].reshape(hq, T).float()


def attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               cu: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query attends to every key (no mask): ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[N, Hk, D]`` ->
    ``(out [T, Hq, D], lse fp32 [Hq, T])``. On a GPU in 16-bit floats the cuDNN kernel (grouped-query
    heads natively; it measured 1.9x the varlen flash kernel for a RAG batch on an H200), else as
    :func:`varlen_attention` with one segment (``cu``: its ``[0, T]`` / ``[0, N]`` on the device)."""
    got = _cudnn(q, k, v, scale)
    if got is not None:
        return got
    T, N = q.shape[0], k.shape[0]
    if cu is None:
        cu = (torch.tensor([0, T], dtype=torch.int32, device=q.device),
              torch.tensor([0, N], dtype=torch.int32, device=q.device))
    return varlen_attention(q, k, v, cu[0], cu[1], T, N, False, scale, ([0, T], [0, N]))


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> torch.Tensor:
    """Softmax over the union of two disjoint key sets from the two partial results: ``o_*`` ``[T, H, D]``,
    ``lse_*`` fp32 ``[H, T]`` -> ``[T, H, D]`` in ``o_a``'s dtype. Exact up to rounding: the share of
    part a is ``e^la / (e^la + e^lb) = sigmoid(la - lb)``, so the merge is two or three kernels."""
    w = torch.sigmoid(lse_a - lse_b).transpose(0, 1).unsqueeze(-1)  # [T, H, 1]
    if o_a.dtype in (torch.bfloat16, torch.float16):  # one kernel (fp32 inside); only w is rounded
        return torch.lerp(o_b.to(o_a.dtype), o_a, w.to(o_a.dtype))
    return torch.lerp(o_b.float(), o_a.float(), w).to(o_a.dtype)


@dataclass
class RaggedTables:
    """Where a batch's keys are, as token slots of the pool (``page * S + slot``), built once per forward.

    ``shared`` (or None): slots of the common cached prefix, ``n_shared`` tokens; ``own``: every segment's
    keys after it, packed; ``cu_q``/``cu_k``: int32 cumulative query / own-key lengths per segment."""

    shared: torch.Tensor | None
    own: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    cu_host: tuple[list[int], list[int]]
    cu_whole: tuple[torch.Tensor, torch.Tensor] | None  # [0, Tq] and [0, n_shared] for the shared call

    @property
    def n_shared(self) -> int:
        return 0 if self.shared is None else int(self.shared.numel())


def shared_pages(tables: list[torch.Tensor], prefixes: list[int], page_size: int) -> int:
    """Leading pages that every segment holds cached and identical (0 for a single segment)."""
    if len(tables) < 2:
        return 0
    n = min(p // page_size for p in prefixes)
    first = tables[0][:n]
    for t in tables[1:]:
        diff = torch.nonzero(t[:n] != first[:n])
        if len(diff):
            n = int(diff[0, 0])
    return n


def ragged_tables(tables: list[torch.Tensor], prefixes: list[int], lengths: list[int], page_size: int,
                  min_shared: int, device: torch.device) -> RaggedTables:
    """Tables for a batch whose segment ``b`` has ``lengths[b]`` new tokens after ``prefixes[b]`` cached
    ones, its pages (CPU int64) in ``tables[b]``. A common prefix of at least ``min_shared`` tokens is
    attended once as the shared part."""
    S = page_size
    n_sh = shared_pages(tables, prefixes, S)
    if n_sh * S < min_shared:
        n_sh = 0
    slots = torch.arange(S, dtype=torch.int64)
    own, cu_q, cu_k = [], [0], [0]
    for t, p, n in zip(tables, prefixes, lengths, strict=True):
        end = p + n
        pages = t[n_sh: -(-end // S)]
        own.append((pages[:, None] * S + slots[None, :]).flatten()[: end - n_sh * S])
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + end - n_sh * S)
    shared, whole = None, None
    if n_sh:
        shared = (tables[0][:n_sh, None] * S + slots[None, :]).flatten().to(device)
        cu = torch.tensor([0, cu_q[-1], 0, n_sh * S], dtype=torch.int32).to(device)
        whole = (cu[:2], cu[2:])
    cu_all = torch.tensor(cu_q + cu_k, dtype=torch.int32).to(device)  # one copy to the device
    max_q = max(lengths)
    max_k = max(b - a for a, b in pairwise(cu_k))
    return RaggedTables(shared, torch.cat(own).to(device), cu_all[: len(cu_q)], cu_all[len(cu_q):], max_q, max_k,
                        (cu_q, cu_k), whole)


def ragged_attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, t: RaggedTables, scale: float
                  ) -> torch.Tensor:
    """q ``[T, Hq, D]`` (the batch's new tokens, packed) over the pool's K/V (``[P, S, Hk, D]`` each, the
    batch's own new K/V already written) -> ``[T, Hq, D]``."""
    kf, vf = k_pool.flatten(0, 1), v_pool.flatten(0, 1)  # [P * S, Hk, D] views
    o, lse = varlen_attention(q, kf.index_select(0, t.own), vf.index_select(0, t.own), t.cu_q, t.cu_k,
                              t.max_q, t.max_k, True, scale, t.cu_host)
    if t.shared is None:
        return o
    o_s, lse_s = attend_all(q, kf.index_select(0, t.shared), vf.index_select(0, t.shared), scale, t.cu_whole)
    return merge_attention(o, lse, o_s, lse_s)
