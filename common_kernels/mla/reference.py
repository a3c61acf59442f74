"""Plain-PyTorch references for the MLA kernels (fp32 math, loops over requests).

Every kernel test and benchmark in latentspeed compares against these. They favour
obviousness over speed: each request's latent cache is gathered token by token from the
block table, dequantized to fp32 and attended with ``torch.softmax``.
Notation: docs/notation.md.
"""

import torch

from ..fp8_format import FP8_DTYPES


def dequantize_cache(kv_cache: torch.Tensor, kv_scale: float | torch.Tensor) -> torch.Tensor:
    """The cache in fp32: fp8 entries times the per-tensor scale, others as they are."""
    if kv_cache.dtype in FP8_DTYPES:
        return kv_cache.float() * float(kv_scale)
    return kv_cache.float()


def write_latent_cache_ref(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float | torch.Tensor = 1.0,
) -> None:
    """Scatter ``[kv_c | k_pe]`` rows into the paged cache; slots < 0 are skipped.

    fp8 caches store ``clamp(x / kv_scale, -fp8_max, fp8_max)`` rounded to nearest even.
    """
    block_size = kv_cache.shape[1]
    rows = torch.cat([kv_c, k_pe], dim=-1).float()
    if kv_cache.dtype in FP8_DTYPES:
        fp8_max = torch.finfo(kv_cache.dtype).max
        rows = (rows / float(kv_scale)).clamp(-fp8_max, fp8_max)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_cache[slot // block_size, slot % block_size] = rows[t].to(kv_cache.dtype)


def gather_request_cache(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, kv_scale
) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of one request, ``[seq_len, D_latent + D_rope]`` fp32."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(seq_len, device=kv_cache.device)
    pages = block_table_row.long()[pos // block_size]
    return dequantize_cache(kv_cache[pages, pos % block_size], kv_scale)


def quantize_query_rows(q_nope: torch.Tensor, q_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each ``(token, head)`` row of ``[q_nope | q_pe]`` scaled by the power of two that brings
    its largest magnitude into ``[128, 256)``, rounded to E4M3 and scaled back, in fp32."""
    q_nope, q_pe = q_nope.float(), q_pe.float()
    q_max = torch.maximum(q_nope.abs().amax(-1), q_pe.abs().amax(-1)).clamp_min(1e-30)
    scale = torch.ldexp(torch.ones_like(q_max), 8 - torch.frexp(q_max).exponent)[..., None]

    def rounded(x):
        return (x * scale).to(torch.float8_e4m3fn).float() / scale

    return rounded(q_nope), rounded(q_pe)


# How far, relative, the kernel's fp8 numerators may lie from the reference's before they round: its
# scores come from fp8 wgmma, whose sums keep about 14 bits on Hopper (DeepSeek-V3 report, 3.3.2), so
# they can be off by about 1e-3 (natural-log units; the decode tests allow 2e-3 in the lse). 2^-14
# left one flipped key in 2 of 102 GPU test runs (2026-12-03).
FP8_PROBS_MARGIN = 2.0**-9


def _fp8_numerators(scores: torch.Tensor) -> torch.Tensor:
    scaled = scores * 1.4426950408889634  # log2(e)
    return torch.exp2(scaled - torch.ceil(scaled.amax(-1, keepdim=True)))


def _round_numerators(p: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype}")
    return (p * 256).to(fp8_dtype).float() / 256


def fp8_probs_weights(scores: torch.Tensor, exact: torch.Tensor | None = None,
                      fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Softmax weights over the last dimension of ``scores`` (natural-log units) with the
    numerators rounded as an fp8 ``P V`` rounds them (``DecodePlan.fp8_probs``): ``p = 2^(s log2(e)
    - ceil(max))`` times 256, rounded to ``fp8_dtype`` (the cache's format) and scaled back, over
    the sum of the unrounded ``p``. The shift is a whole power of two, so the rounding is the same
    for any whole shift at or above the maximum (the kernel's running one, a split's own).
    ``exact`` marks keys left unrounded."""
    p = _fp8_numerators(scores)
    rounded = _round_numerators(p, fp8_dtype)
    if exact is not None:
        rounded = torch.where(exact, p, rounded)
    return rounded / p.sum(-1, keepdim=True)


def fp8_probs_spread(scores: torch.Tensor, exact: torch.Tensor | None = None,
                     fp8_dtype: torch.dtype = torch.float8_e4m3fn, margin: float = FP8_PROBS_MARGIN) -> torch.Tensor:
    """Per key, how far ``fp8_probs_weights``' weight moves when its numerator, off by up to
    ``margin`` relative, rounds the other way: one fp8 step over the sum for keys that close to a
    rounding midpoint, else zero (and zero for ``exact`` keys)."""
    p = _fp8_numerators(scores)
    spread = _round_numerators(p * (1 + margin), fp8_dtype) - _round_numerators(p * (1 - margin), fp8_dtype)
    if exact is not None:
        spread = spread.masked_fill(exact, 0.0)
    return spread / p.sum(-1, keepdim=True)


def mla_decode_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_scale: float | torch.Tensor = 1.0,
    tree_mask: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    fp8_queries: bool = False,
    fresh_kv: torch.Tensor | None = None,
    fp8_probs: bool = False,
    flip_bound: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-absorbed MQA over the paged latent cache.

    Shapes as in ``common_kernels.mla.mla_decode``: ``q_nope [T, H, D_latent]``,
    ``q_pe [T, H, D_rope]``, ``T = B * S_q``; token ``j`` of request ``b`` sees cache
    positions ``< seq_lens[b] - S_q + j + 1``, or with ``tree_mask [B, S_q]`` (int64 bit
    words) the prefix ``< seq_lens[b] - S_q`` and the draft positions ``seq_lens[b] - S_q + k``
    whose bit ``k`` is set in ``tree_mask[b, j]``. With ``query_start_loc [B + 1]`` request
    ``b`` has ``query_start_loc[b + 1] - query_start_loc[b]`` query tokens instead. Returns ``out [T, H, D_latent]`` (fp32) and
    ``lse [T, H]`` (fp32, natural log; ``-inf`` and a zero output where nothing is visible).
    ``fp8_queries`` rounds each query row ``[q_nope | q_pe]`` to E4M3 first (with a power-of-two
    scale per row), as the kernel does when ``DecodePlan.fp8_queries`` holds. ``fresh_kv
    [T, D_latent + D_rope]`` replaces the cache rows of the query tokens' own positions; the
    queries are then rounded only for the prefix, the kernel's own-rows launch being exact.
    ``fp8_probs`` rounds the softmax numerators to the fp8 cache's format (``fp8_probs_weights``),
    the fresh rows' excepted, as the kernel does when ``DecodePlan.fp8_probs`` holds. With it,
    ``flip_bound`` (fp32, the shape of ``out``) receives per element how far the output may move
    when numerators within ``FP8_PROBS_MARGIN`` of a rounding midpoint round the other way
    (``fp8_probs_spread`` times the values' magnitudes): in a short context one such key may carry
    most of the weight.
    """
    if fp8_probs and kv_cache.dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_probs rounds P to an fp8 cache's format; this cache is {kv_cache.dtype}")
    if flip_bound is not None:
        if not fp8_probs or flip_bound.shape != q_nope.shape or flip_bound.dtype != torch.float32:
            raise ValueError(f"flip_bound must be fp32 {tuple(q_nope.shape)} and comes with fp8_probs")
        flip_bound.zero_()
    q_exact = (q_nope.float(), q_pe.float())
    if fp8_queries:
        q_nope, q_pe = quantize_query_rows(q_nope, q_pe)
    num_tokens, num_heads, d_latent = q_nope.shape
    batch = seq_lens.shape[0]
    if query_start_loc is None:
        query_start_loc = torch.arange(batch + 1) * (num_tokens // max(batch, 1))
    out = torch.zeros(num_tokens, num_heads, d_latent, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q_nope.device)
    for b in range(batch):
        seq_len = int(seq_lens[b])
        kv = gather_request_cache(kv_cache, block_table[b], seq_len, kv_scale)
        q_start = int(query_start_loc[b])
        q_len = int(query_start_loc[b + 1]) - q_start
        own = torch.arange(seq_len, device=kv.device) >= seq_len - q_len  # the query tokens' positions
        if fresh_kv is not None:
            kv[seq_len - q_len :] = fresh_kv[q_start : q_start + q_len].float()
        for j in range(q_len):
            t = q_start + j
            pos = torch.arange(seq_len, device=kv.device)
            if tree_mask is None:
                seen = pos < seq_len - q_len + j + 1
            else:
                draft = pos - (seq_len - q_len)
                bits = int(tree_mask[b, j])
                in_tree = [d >= 0 and (bits >> d) & 1 == 1 for d in draft.tolist()]
                seen = (draft < 0) | torch.tensor(in_tree, dtype=torch.bool, device=kv.device)
            if not seen.any():
                continue
            k = kv[seen]
            scores = q_nope[t].float() @ k[:, :d_latent].T + q_pe[t].float() @ k[:, d_latent:].T
            if fresh_kv is not None:
                exact = q_exact[0][t] @ k[:, :d_latent].T + q_exact[1][t] @ k[:, d_latent:].T
                scores = torch.where(own[seen], exact, scores)
            scores = scores * softmax_scale
            lse[t] = torch.logsumexp(scores, dim=-1)
            if fp8_probs:
                unrounded = own[seen] if fresh_kv is not None else None
                weights = fp8_probs_weights(scores, unrounded, kv_cache.dtype)
                if flip_bound is not None:
                    spread = fp8_probs_spread(scores, unrounded, kv_cache.dtype, FP8_PROBS_MARGIN)
                    flip_bound[t] = spread @ k[:, :d_latent].abs()
            else:
                weights = torch.softmax(scores, dim=-1)
            out[t] = weights @ k[:, :d_latent]
    return out, lse


def varlen_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length multi-head attention, ``q [T_q, H, D_qk]``, ``k [T_k, H, D_qk]``,
    ``v [T_k, H, D_v]``.

    With ``causal`` the mask is aligned to the bottom right: query ``i`` of a sequence sees
    keys ``j <= i + len_k - len_q``. Returns ``out [T_q, H, D_v]`` fp32 and ``lse [H, T_q]``
    fp32 (natural log, ``-inf`` for a query that sees no key, whose output is zero).
    """
    num_q, num_heads, _ = q.shape
    out = torch.zeros(num_q, num_heads, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((num_heads, num_q), float("-inf"), dtype=torch.float32, device=q.device)
    for s in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        k0, k1 = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
        if q1 == q0 or k1 == k0:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k[k0:k1].float()) * softmax_scale
        if causal:
            qi = torch.arange(q1 - q0, device=q.device)[:, None]
            kj = torch.arange(k1 - k0, device=q.device)[None, :]
            scores = scores.masked_fill(kj > qi + (k1 - k0) - (q1 - q0), float("-inf"))
        seq_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - seq_lse[..., None]).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v[k0:k1].float())
        lse[:, q0:q1] = seq_lse
    return out, lse
