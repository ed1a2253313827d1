"""The reference decoder: Llama-style (RMSNorm, RoPE, GQA, SwiGLU) or MLA, attending over the L1 page pool.

Paged forward (what the serving node runs)::

    batch = make_batch(tokens, prefixes, pages, page_size, device)   # one Segment per sequence
    logits = model.forward_paged(batch, pool.kv, layer_ready)  # [num_segments, vocab] (last token of each)

Each segment's new tokens get their K/V (or MLA latent) written into the L1 pool at
``pages[pos // S], pos % S`` (``kv[layer][c]`` is ``[P, S, H, D]``), then attend over every token of the
sequence so far: the cached prefix pages (computed by an earlier request, possibly loaded back from L2/L3)
followed by themselves, causally. ``layer_ready(i)`` is called before layer ``i`` reads the pool (the
node passes ``load.wait_layer``), so loading later layers overlaps compute of earlier ones.

``forward_dense`` is the reference: the same weights over a whole sequence, K/V in contiguous tensors,
no pool. With fp32, the paged path on any mix of cached and new tokens equals it to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hicache.engine.attention import RaggedTables, ragged_attend, ragged_tables
from hicache.engine.shape import ModelShape
from hicache.engine.weights import Weights, random_weights


@dataclass
class Segment:
    """One sequence's chunk of new tokens in a forward batch."""

    length: int  # new tokens (their ids are consecutive in the batch's token tensor)
    prefix: int  # tokens of this sequence already in its pages (they are attended, not computed)
    pages: torch.Tensor  # int64 [n] L1 pages covering prefix + length tokens, in order (on the pool's device)
    pages_host: torch.Tensor | None = None  # the same pages on the CPU (tables are built there)


PADDED_MAX_SUFFIX = 1024  # batches whose suffixes are all at most this long attend in one padded call
PADDED_MAX_BIAS = 1 << 28  # ... if the additive mask stays below this many elements
RAGGED_MIN_SHARED = 256  # common cached tokens from which the ragged path attends to them once for all
ATTENTION_PATHS = ("ragged", "padded")


@dataclass
class _Padded:
    tables: torch.Tensor  # int64 [B, maxP]: each segment's pages, padded with page 0
    rows: torch.Tensor  # int64 [T]: row b * nmax + i of each new token in the padded layout
    bias: torch.Tensor  # [B, 1, rep * nmax, maxP * S] additive mask (0 / -inf), shared by all layers
    nmax: int
    rep: int


@dataclass
class Batch:
    tokens: torch.Tensor  # int64 [T]: new tokens of every segment, concatenated
    positions: torch.Tensor  # int64 [T]
    write_page: torch.Tensor  # int64 [T]: L1 page each new token's K/V goes to
    write_slot: torch.Tensor  # int64 [T]: slot within that page
    segments: list[Segment]
    decode: bool  # every segment has one new token: attention runs batched over padded page tables

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


def make_batch(tokens: Sequence[Sequence[int]], prefixes: Sequence[int],
               pages: Sequence[np.ndarray | torch.Tensor], page_size: int, device: torch.device) -> Batch:
    """Batch of new ``tokens[i]`` for sequence i, which already has ``prefixes[i]`` tokens in ``pages[i]``
    (``pages[i]`` covers at least ``prefixes[i] + len(tokens[i])`` tokens). Built on the host, moved to
    ``device`` in one copy."""
    if not (len(tokens) == len(prefixes) == len(pages)) or not tokens:
        raise ValueError("make_batch: tokens, prefixes and pages must be non-empty and of equal length")
    toks = [np.asarray(t, dtype=np.int64).reshape(-1) for t in tokens]
    tables = [np.asarray(pg.cpu() if isinstance(pg, torch.Tensor) else pg, dtype=np.int64).reshape(-1)
              for pg in pages]
    pos, wpage = [], []
    for t, p, pg in zip(toks, prefixes, tables, strict=True):
        if len(t) < 1:
            raise ValueError("make_batch: every segment needs at least one new token")
        if len(pg) * page_size < p + len(t):
            raise ValueError(f"make_batch: {len(pg)} pages of {page_size} cannot hold {p + len(t)} tokens")
        ps = np.arange(p, p + len(t), dtype=np.int64)
        pos.append(ps)
        wpage.append(pg[ps // page_size])
    positions = np.concatenate(pos)
    T = len(positions)
    host = torch.from_numpy(np.concatenate([*toks, positions, *wpage, positions % page_size, *tables]))
    dev = host.to(device)
    table_dev = torch.split(dev[4 * T:], [len(pg) for pg in tables])
    table_host = torch.split(host[4 * T:], [len(pg) for pg in tables])
    segs = [Segment(len(t), p, td, th) for t, p, td, th in zip(toks, prefixes, table_dev, table_host, strict=True)]
    return Batch(dev[:T], dev[T: 2 * T], dev[2 * T: 3 * T], dev[3 * T: 4 * T], segs, all(len(t) == 1 for t in toks))


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, H, d]; cos/sin: [T, 1, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Decoder:
    """Weights plus the forward passes. Inference only (runs under ``torch.inference_mode``)."""

    def __init__(self, shape: ModelShape, weights: Weights, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        # How prefill batches of several segments attend (MHA / GQA; MLA never takes "ragged": "padded"
        # where its tables fit, else one segment at a time): "ragged" packs the segments without padding
        # and attends to a prefix they all share once (attention.py); "padded" gathers every segment's
        # pages into one padded tensor and masks.
        self.attention_path = "ragged"
        self.w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        rd = shape.rope_dim if shape.attention == "mla" else shape.head_dim
        self._inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64, device=self.device)
                                                     / rd)).float()

    @classmethod
    def random(cls, shape: ModelShape, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> Decoder:
        return cls(shape, random_weights(shape, seed, dtype, device), dtype, device)

    # ------------------------------------------------------------------ pieces
    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.float()[:, None] * self._inv_freq[None, :]
        return ang.cos().to(self.dtype)[:, None, :], ang.sin().to(self.dtype)[:, None, :]

    def _project(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x: [T, hidden] (normed) -> q [T, Hq, qk] and what the cache stores: [k, v] ([T, Hk, D] each) or
        [latent] ([T, 1, kv_lora_rank + rope_dim])."""
        s, w, p = self.shape, self.w, f"model.layers.{layer}.self_attn."
        T = x.shape[0]
        if s.attention == "mla":
            q = F.linear(x, w[p + "q_proj.weight"]).view(T, s.num_q_heads, s.qk_dim)
            q = torch.cat((q[..., : s.head_dim], _rope(q[..., s.head_dim:], cos, sin)), dim=-1)
            ckv = F.linear(x, w[p + "kv_a_proj_with_mqa.weight"])
            c = _rms_norm(ckv[:, : s.kv_lora_rank], w[p + "kv_a_layernorm.weight"], s.norm_eps)
            kr = _rope(ckv[:, None, s.kv_lora_rank:], cos, sin)
            return q, [torch.cat((c[:, None, :], kr), dim=-1)]
        q = F.linear(x, w[p + "q_proj.weight"]).view(T, s.num_q_heads, s.head_dim)
        k = F.linear(x, w[p + "k_proj.weight"]).view(T, s.num_kv_heads, s.head_dim)
        v = F.linear(x, w[p + "v_proj.weight"]).view(T, s.num_kv_heads, s.head_dim)
        return _rope(q, cos, sin), [_rope(k, cos, sin), v]

    def _expand(self, layer: int, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached pieces [..., N, Hs, Ds] -> K [..., Hq, N, qk], V [..., Hq, N, dv] (head-major, as SDPA wants)."""
        s = self.shape
        if s.attention == "mla":
            lat = pieces[0][..., 0, :]  # [..., N, r + rd]
            c, kr = lat[..., : s.kv_lora_rank], lat[..., s.kv_lora_rank:]
            p = f"model.layers.{layer}.self_attn."
            lead = c.shape[:-1]
            kn = F.linear(c, self.w[p + "w_uk"]).view(*lead, s.num_q_heads, s.head_dim)
            v = F.linear(c, self.w[p + "w_uv"]).view(*lead, s.num_q_heads, s.head_dim)
            k = torch.cat((kn, kr.unsqueeze(-2).expand(*lead, s.num_q_heads, s.rope_dim)), dim=-1)
            return k.transpose(-3, -2), v.transpose(-3, -2)
        k, v = pieces[0].transpose(-3, -2), pieces[1].transpose(-3, -2)
        rep = s.num_q_heads // s.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        return k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, Hq, qk] (the last n positions of the sequence), k/v [Hq, N, *] -> [n, Hq * dv]; causal,
        aligned bottom-right (query i sits at position N - n + i)."""
        n, N = q.shape[0], k.shape[-2]
        qh = q.transpose(0, 1).unsqueeze(0)
        kh, vh = k.unsqueeze(0), v.unsqueeze(0)
        if n == N:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        elif self.device.type == "cuda":
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, N))
        else:
            mask = torch.ones(n, N, dtype=torch.bool, device=q.device).tril(N - n)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return o[0].transpose(0, 1).reshape(n, -1)

    def _mlp_block(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        p, w = f"model.layers.{layer}.", self.w
        x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], self.shape.norm_eps)
        gated = F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"])
        return h + F.linear(gated, w[p + "mlp.down_proj.weight"])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(h, self.w["model.norm.weight"], self.shape.norm_eps)
        return F.linear(x, self.w["lm_head.weight"]).float()

    # ------------------------------------------------------------------ forward passes
    @torch.inference_mode()
    def forward_dense(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Reference: logits [T, vocab] (fp32) of a whole sequence, K/V contiguous, nothing cached."""
        ids = torch.as_tensor(tokens, dtype=torch.int64, device=self.device)
        cos, sin = self._rope_tables(torch.arange(ids.numel(), device=self.device))
        h = self.w["model.embed_tokens.weight"][ids]
        for layer in range(self.shape.num_layers):
            x = _rms_norm(h, self.w[f"model.layers.{layer}.input_layernorm.weight"], self.shape.norm_eps)
            q, pieces = self._project(layer, x, cos, sin)
            k, v = self._expand(layer, pieces)
            o = self._attend(q, k, v)
            h = h + F.linear(o, self.w[f"model.layers.{layer}.self_attn.o_proj.weight"])
            h = self._mlp_block(layer, h)
        return self._logits(h)

    @torch.inference_mode()
    def forward_paged(self, batch: Batch, kv: list[list[torch.Tensor]],
                      layer_ready: Callable[[int], None] | None = None, all_logits: bool = False) -> torch.Tensor:
        """Compute the batch's new tokens over the L1 pool ``kv`` (``kv[layer][c]``: [P, S, H, D]).

        Writes their K/V into the pool. Returns fp32 logits: ``[num_segments, vocab]`` for the last new
        token of each segment, or ``[T, vocab]`` for every new token with ``all_logits``.
        """
        s = self.shape
        if len(kv) != s.num_layers or kv[0][0].dtype != self.dtype:
            raise ValueError("forward_paged: the pool's layers/dtype do not match the model")
        S = kv[0][0].shape[1]
        cos, sin = self._rope_tables(batch.positions)
        h = self.w["model.embed_tokens.weight"][batch.tokens]
        lengths = [g.length for g in batch.segments]
        ragged = self._ragged_tables(batch, S)
        if batch.decode:
            dec_pages, dec_mask = self._decode_tables(batch, S)
        padded = None if batch.decode or ragged is not None else self._padded_tables(batch, S)
        for layer in range(s.num_layers):
            x = _rms_norm(h, self.w[f"model.layers.{layer}.input_layernorm.weight"], s.norm_eps)
            q, pieces = self._project(layer, x, cos, sin)
            if layer_ready is not None:
                layer_ready(layer)
            pool = kv[layer]
            for c, piece in enumerate(pieces):
                pool[c][batch.write_page, batch.write_slot] = piece
            if ragged is not None:
                o = ragged_attend(q, pool[0], pool[1], ragged, s.head_dim ** -0.5).flatten(1)
            elif batch.decode:
                gathered = [pool[c][dec_pages].flatten(1, 2) for c in range(len(pieces))]  # [B, N, Hs, Ds]
                o = self._decode_attend(layer, q, gathered, dec_mask)
            elif padded is not None:
                o = self._padded_attend(layer, q, pool, len(pieces), padded)
            else:
                outs = []
                off = 0
                for seg, qs in zip(batch.segments, torch.split(q, lengths), strict=True):
                    N = seg.prefix + seg.length
                    if seg.prefix == 0:  # nothing cached: attend over the pieces just computed
                        g = [x[off: off + N] for x in pieces]
                    else:
                        g = [pool[c][seg.pages[: (N + S - 1) // S]].flatten(0, 1)[:N] for c in range(len(pieces))]
                    off += seg.length
                    k, v = self._expand(layer, g)
                    outs.append(self._attend(qs, k, v))
                o = torch.cat(outs) if len(outs) > 1 else outs[0]
            h = h + F.linear(o, self.w[f"model.layers.{layer}.self_attn.o_proj.weight"])
            h = self._mlp_block(layer, h)
        if not all_logits:
            last = torch.tensor(lengths, device=h.device).cumsum(0) - 1
            h = h[last]
        return self._logits(h)

    def _ragged_tables(self, batch: Batch, S: int) -> RaggedTables | None:
        """Tables of the ragged path, or None where another path serves: MLA, ``attention_path`` not
        "ragged", a single segment (one call over its gathered keys needs no packing), or a decode step
        (few queries over long keys: the fused kernels' varlen forms do not split the keys, and on an H200
        the padded path measured twice as fast for 31 sequences over a 4k-token document)."""
        segs = batch.segments
        if self.attention_path not in ATTENTION_PATHS:
            raise ValueError(f"Decoder.attention_path: {self.attention_path!r} is not one of {ATTENTION_PATHS}")
        if self.shape.attention == "mla" or self.attention_path != "ragged" or len(segs) == 1 or batch.decode:
            return None
        host = [g.pages_host if g.pages_host is not None else g.pages.cpu() for g in segs]
        return ragged_tables(host, [g.prefix for g in segs], [g.length for g in segs], S, RAGGED_MIN_SHARED,
                             self.device)

    def _padded_tables(self, batch: Batch, S: int) -> _Padded | None:
        """Tables for one attention call over many short suffixes (prefill of cached prompts), or None when
        the per-segment loop is the better fit (one segment, long suffixes, or a too large bias)."""
        segs = batch.segments
        nmax = max(g.length for g in segs)
        if len(segs) < 2 or nmax > PADDED_MAX_SUFFIX:
            return None
        lens = [g.prefix + g.length for g in segs]
        max_pages = max(-(-n // S) for n in lens)
        rep = 1 if self.shape.attention == "mla" else self.shape.num_q_heads // self.shape.num_kv_heads
        if len(segs) * rep * nmax * max_pages * S > PADDED_MAX_BIAS:
            return None
        dev = self.device
        tables_h = torch.zeros(len(segs), max_pages, dtype=torch.int64)
        rows = torch.empty(batch.num_tokens, dtype=torch.int64)
        off = 0
        for b, g in enumerate(segs):  # built on the CPU, then moved in one copy each
            n = -(-lens[b] // S)
            tables_h[b, :n] = (g.pages_host if g.pages_host is not None else g.pages.cpu())[:n]
            rows[off: off + g.length] = torch.arange(b * nmax, b * nmax + g.length)
            off += g.length
        tables = tables_h.to(dev)
        # query i of segment b sits at position prefix_b + i and sees keys 0..prefix_b + i (padding rows
        # see a harmless non-empty range; their outputs are dropped)
        prefix = torch.tensor([g.prefix for g in segs], device=dev)
        qpos = prefix[:, None] + torch.arange(nmax, device=dev)[None, :]  # [B, nmax]
        allowed = torch.arange(max_pages * S, device=dev)[None, None, :] <= qpos[:, :, None]  # [B, nmax, N]
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=dev).masked_fill_(~allowed, float("-inf"))
        bias = bias[:, None].repeat(1, 1, rep, 1) if rep > 1 else bias[:, None]  # [B, 1, rep * nmax, N]
        return _Padded(tables, rows.to(dev), bias, nmax, rep)

    def _padded_attend(self, layer: int, q: torch.Tensor, pool: list[torch.Tensor], n_pieces: int,
                       p: _Padded) -> torch.Tensor:
        """All segments' suffixes in one SDPA call: q [T, Hq, qk] -> [T, Hq * dv]. GQA without copying
        K/V per query head: the rep query heads of a KV head are stacked as rep * nmax query rows."""
        B, nmax, rep = p.tables.shape[0], p.nmax, p.rep
        _, Hq, qk = q.shape
        gathered = [pool[c][p.tables].flatten(1, 2) for c in range(n_pieces)]  # [B, N, Hs, Ds]
        qp = q.new_zeros(B * nmax, Hq, qk)
        qp[p.rows] = q
        if self.shape.attention == "mla":
            k, v = self._expand(layer, gathered)  # [B, Hq, N, *]
            o = F.scaled_dot_product_attention(qp.view(B, nmax, Hq, qk).transpose(1, 2), k, v, attn_mask=p.bias)
            o = o.transpose(1, 2)  # [B, nmax, Hq, dv]
        else:
            hk = Hq // rep
            qg = qp.view(B, nmax, hk, rep, qk).permute(0, 2, 3, 1, 4).reshape(B, hk, rep * nmax, qk)
            k, v = gathered[0].transpose(1, 2), gathered[1].transpose(1, 2)  # [B, Hk, N, D]
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=p.bias)  # [B, Hk, rep * nmax, D]
            o = o.view(B, hk, rep, nmax, -1).permute(0, 3, 1, 2, 4)  # [B, nmax, Hk, rep, D]
        return o.reshape(B * nmax, -1)[p.rows]

    def _decode_attend(self, layer: int, q: torch.Tensor, gathered: list[torch.Tensor], mask: torch.Tensor
                       ) -> torch.Tensor:
        """One new token per sequence: q [B, Hq, qk] over gathered pieces [B, N, Hs, Ds] -> [B, Hq * dv].

        GQA without copying K/V per query head: the ``rep`` query heads sharing a KV head are laid out as
        ``rep`` query rows of that head (nothing is causal within one step; the mask hides padding)."""
        B = q.shape[0]
        if self.shape.attention == "mla":
            k, v = self._expand(layer, gathered)
            return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask).reshape(B, -1)
        hk = self.shape.num_kv_heads
        qg = q.view(B, hk, q.shape[1] // hk, q.shape[2])  # [B, Hk, rep, D]; head h = kv * rep + r
        k, v = gathered[0].transpose(1, 2), gathered[1].transpose(1, 2)  # [B, Hk, N, D]
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(B, -1)

    def _decode_tables(self, batch: Batch, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded page tables [B, maxP] and key masks [B, 1, 1, maxP * S] for batched one-token attention."""
        lens = [g.prefix + 1 for g in batch.segments]
        max_pages = max((n + S - 1) // S for n in lens)
        tables_h = torch.zeros(len(lens), max_pages, dtype=torch.int64)
        for i, g in enumerate(batch.segments):
            n = (lens[i] + S - 1) // S
            tables_h[i, :n] = (g.pages_host if g.pages_host is not None else g.pages.cpu())[:n]
        tables = tables_h.to(self.device)
        ln = torch.tensor(lens, device=self.device)
        mask = torch.arange(max_pages * S, device=self.device)[None, :] < ln[:, None]
        return tables, mask[:, None, None, :]
