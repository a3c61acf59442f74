"""Plain-PyTorch references for the fp8 kernels (fp32 math)."""

import torch

from ..fp8_format import fp8_finite_max


def quantize_per_token_group_ref(x: torch.Tensor, group_size: int = 128, fp8_dtype=torch.float8_e4m3fn,
                                 pow2_scale: bool = False, eps: float = 1e-10):
    """Same contract as ``quantize_per_token_group``."""
    fp8_max = fp8_finite_max(fp8_dtype)
    rows, cols = x.shape
    groups = -(-cols // group_size)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - cols)).view(rows, groups, group_size)
    amax = padded.abs().amax(-1).clamp_min(eps)
    scales = amax / torch.full_like(amax, fp8_max)  # a tensor divisor: CUDA divides a scalar by its reciprocal
    if pow2_scale:
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    q = (padded / scales[..., None]).clamp(-fp8_max, fp8_max).to(fp8_dtype).view(rows, -1)[:, :cols]
    return q, scales


def quantize_per_token_ref(x: torch.Tensor, fp8_dtype=torch.float8_e4m3fn, pow2_scale: bool = False,
                           eps: float = 1e-10):
    """Same contract as ``quantize_per_token``: the row is the group."""
    return quantize_per_token_group_ref(x, max(1, x.shape[1]), fp8_dtype, pow2_scale, eps)


def block_scaled_gemm_ref(a, a_scale, b, b_scale, out_dtype=torch.bfloat16, block: int = 128) -> torch.Tensor:
    """``(A * a_scale) @ (B * b_scale).T`` with per-block scales expanded, in fp32."""
    k = a.shape[1]
    a_full = a.float() * a_scale.repeat_interleave(block, dim=1)[:, :k]
    return (a_full @ dequantize_weight_blocks_ref(b, b_scale, block).T).to(out_dtype)


def dequantize_weight_blocks_ref(q: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp32 ``q * scale`` of each ``block x block`` tile: the inverse of ``quantize_weight_blocks_ref``."""
    n, k = q.shape
    return q.float() * scales.repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]


def quantize_weight_blocks_ref(w: torch.Tensor, fp8_dtype=torch.float8_e4m3fn, block: int = 128):
    """Same contract as ``quantize_weight_blocks``."""
    fp8_max = fp8_finite_max(fp8_dtype)
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    tiles = padded.view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-10)
    scales = amax / torch.full_like(amax, fp8_max)  # a tensor divisor (see quantize_per_token_group_ref)
    q = (tiles / scales[:, None, :, None]).clamp(-fp8_max, fp8_max).to(fp8_dtype).view(nb * block, kb * block)
    return q[:n, :k].contiguous(), scales


def align_by_expert_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Same contract as ``align_by_expert`` (``ExpertRuns``' fields as a tuple), in torch ops; within a
    run, pairs in ascending order."""
    pairs = topk_ids.numel()
    key = torch.where(topk_ids.flatten() < 0, num_experts, topk_ids.flatten()).long()
    counts = torch.bincount(key, minlength=num_experts + 1)
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    size = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), pairs, dtype=torch.int32, device=topk_ids.device)
    position = torch.full((pairs,), size, dtype=torch.int32, device=topk_ids.device)
    for e in range(num_experts):
        members = (key == e).nonzero().flatten()
        start = int(ends[e] - padded[e])
        sorted_ids[start : start + members.numel()] = members.to(torch.int32)
        position[members] = torch.arange(start, start + members.numel(), dtype=torch.int32, device=position.device)
    block_expert = torch.searchsorted(ends, torch.arange(0, size, block_m, device=ends.device), right=True)
    used_rows = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids, torch.where(block_expert >= num_experts, -1, block_expert).to(torch.int32), position, used_rows


def quantize_to_sorted_rows_ref(x: torch.Tensor, position: torch.Tensor, rows: int, top_k: int):
    """Same contract as ``quantize_to_sorted_rows`` for positions from ``align_by_expert``: ``(q, scales,
    written)``, the rows no pair writes zero in ``q`` and ``scales`` and False in ``written [rows]``."""
    q, scales = quantize_per_token_group_ref(x)
    taken = position.long() < rows
    dest, token = position.long()[taken], torch.arange(position.numel(), device=x.device)[taken] // top_k
    q_sorted = torch.zeros(rows, x.shape[1], dtype=q.dtype, device=x.device)
    scales_sorted = torch.zeros(rows, scales.shape[1], dtype=scales.dtype, device=x.device)
    q_sorted[dest], scales_sorted[dest] = q[token], scales[token]
    written = torch.zeros(rows, dtype=torch.bool, device=x.device)
    written[dest] = True
    return q_sorted, scales_sorted, written


def sum_slots_ref(rows: torch.Tensor, position: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Same contract as ``sum_slots``."""
    taken = position.long().view(tokens, top_k)
    valid = taken < rows.shape[0]
    slots = rows.float()[taken.clamp(max=rows.shape[0] - 1)] * valid[..., None]
    return slots.sum(1).to(rows.dtype)


def fused_moe_fp8_ref(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, expert_map=None,
                      separate_act=False) -> torch.Tensor:
    """Same contract as ``fused_moe_fp8``, one (token, slot) pair at a time; ``separate_act``: as a gate/up
    launch with ``SEPARATE_ACT`` rounds, gate and up in x's dtype, then vLLM's SiluAndMul."""
    tokens, top_k = topk_ids.shape
    out = torch.zeros(tokens, w13.shape[2], dtype=torch.float32, device=x.device)
    a, a_scale = quantize_per_token_group_ref(x)
    for t in range(tokens):
        for j in range(top_k):
            e = int(topk_ids[t, j]) if expert_map is None else int(expert_map[topk_ids[t, j]])
            if e < 0:
                continue
            gate_up = block_scaled_gemm_ref(a[t : t + 1], a_scale[t : t + 1], w13[e], w13_scale[e], torch.float32)
            if separate_act:
                activated = silu_mul_ref(gate_up.to(x.dtype))
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                activated = (torch.nn.functional.silu(gate) * up).to(x.dtype)
            h, h_scale = quantize_per_token_group_ref(activated)
            down = block_scaled_gemm_ref(h, h_scale, w2[e], w2_scale[e], torch.float32)
            out[t] += topk_weights[t, j].float() * down[0]
    return out.to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """vLLM's RMSNorm (``vllm.ir`` ops' formula and roundings): ``(y, new residual or None)``."""
    z = x.float() if residual is None else x.float() + residual.float()
    y = (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype) * weight
    return y.to(x.dtype), None if residual is None else z.to(x.dtype)


def rms_norm_group_quant_ref(x, weight, eps, residual=None, group_size=128, fp8_dtype=torch.float8_e4m3fn,
                             pow2_scale=False):
    """Same contract as ``rms_norm_group_quant``: the normalization, then
    ``quantize_per_token_group_ref``."""
    y, residual_out = rms_norm_ref(x, weight, eps, residual)
    return *quantize_per_token_group_ref(y, group_size, fp8_dtype, pow2_scale), residual_out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """vLLM's SiluAndMul (its native formula and roundings) of ``x [..., 2 * D]``."""
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]


def silu_mul_group_quant_ref(x, group_size=128, fp8_dtype=torch.float8_e4m3fn, pow2_scale=False, padding=None):
    """Same contract as ``silu_mul_group_quant``: the activation, then ``quantize_per_token_group_ref``;
    ``padding`` (bool ``[M]``) marks the rows quantized as zeros whatever ``x`` holds (``pair_ids``)."""
    y = silu_mul_ref(x)
    if padding is not None:
        y = torch.where(padding[:, None], 0.0, y).to(x.dtype)
    return quantize_per_token_group_ref(y, group_size, fp8_dtype, pow2_scale)
