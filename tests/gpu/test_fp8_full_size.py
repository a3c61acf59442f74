"""FP8 kernels against the references at DeepSeek-V3 GEMM shapes, on a GPU."""

import pytest
import torch

from benchmarks.fp8_gemm import TP8_SHAPES
from benchmarks.fp8_moe import expert_weights
from common_kernels.fp8 import (
    block_scaled_gemm,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_blocks,
    rms_norm_group_quant,
    silu_mul_group_quant,
)
from common_kernels.fp8.reference import (
    block_scaled_gemm_ref,
    quantize_per_token_group_ref,
    quantize_per_token_ref,
    quantize_weight_blocks_ref,
)
from tests.helpers import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"n{n}_k{k}" for n, k in SHAPES])
@pytest.mark.parametrize("m", [1, 64, 512])
def test_block_scaled_gemm_deepseek_shapes(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, a_scale = quantize_per_token_group(x)
    a_ref, a_scale_ref = quantize_per_token_group_ref(x)
    assert torch.equal(a.view(torch.uint8), a_ref.view(torch.uint8)) and torch.equal(a_scale, a_scale_ref)
    b, b_scale = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") * 0.02)
    out = block_scaled_gemm(a, a_scale, b, b_scale)
    expected = block_scaled_gemm_ref(a, a_scale, b, b_scale, torch.float32)
    # bf16 output rounding (half an ulp: 2^-9 relative) plus fp32 sums over K <= 16384 in another
    # order: near-zero outputs may differ by ~1e-3 of the largest output.
    assert_close(out, expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2, name="gemm")


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"n{n}_k{k}" for n, k in SHAPES])
@pytest.mark.parametrize("m, block_m, block_n, split", [(1, 16, 64, 4), (16, 16, 128, 1), (40, 32, 128, 2)])
def test_swapped_products_deepseek_shapes(m, block_m, block_n, split, n, k):
    """``SWAP_AB`` launches (products as B A^T: wgmma for tiles under 64 rows on Hopper) at decode sizes."""
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split, GROUP_M=8, num_warps=4, num_stages=4, SWAP_AB=True)
    a, a_scale = quantize_per_token_group(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    b, b_scale = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") * 0.02)
    out = block_scaled_gemm(a, a_scale, b, b_scale, config=config)
    expected = block_scaled_gemm_ref(a, a_scale, b, b_scale, torch.float32)
    assert_close(out, expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2, name=f"gemm {config}")


@pytest.mark.parametrize("n,k", [(7168, 16384), (2112, 7168)], ids=["n7168_k16384", "n2112_k7168"])
def test_split_k_summed_in_the_launch_across_sms_streams_and_graph_replays(n, k):
    """The K splits summed inside the GEMM's launch, where a tile's splits run on different SMs at once and the last
    one (by the tile's atomic counter) adds the partials: the bits of the second-kernel sum at every launch, from two
    streams at once (each has its counters), and in CUDA graph replays (a graph captured on a stream without
    counters sums in a second kernel)."""
    from common_kernels.fp8 import gemm

    m, config = 64, dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=8, GROUP_M=8, num_warps=4, num_stages=4)
    a, a_scale = quantize_per_token_group(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    b, b_scale = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") * 0.02)
    assert gemm.sums_in_launch(m, n, config)
    expected = block_scaled_gemm(a, a_scale, b, b_scale, config=dict(config, SUM_IN_LAUNCH=False))  # a second kernel
    assert not torch.isnan(expected).any()
    for i in range(20):
        assert torch.equal(block_scaled_gemm(a, a_scale, b, b_scale, config=config), expected), f"launch {i}"
    streams, outs = (torch.cuda.Stream(), torch.cuda.Stream()), []
    torch.cuda.synchronize()
    for _ in range(10):
        for stream in streams:
            with torch.cuda.stream(stream):
                outs.append(block_scaled_gemm(a, a_scale, b, b_scale, config=config))
    torch.cuda.synchronize()
    assert all(torch.equal(out, expected) for out in outs), "two streams at once"
    for stream in streams:  # graphs captured on a stream whose eager launches made its counters (as the engines'
        # warm-up runs make them before their captures) sum in the launch; on a new one, in a second kernel
        out, graph = torch.empty_like(expected), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            block_scaled_gemm(a, a_scale, b, b_scale, out=out, config=config)
        assert (a.device, stream.cuda_stream) in gemm._counters
        fresh, fresh_graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(fresh_graph, stream=fresh):
            fresh_out = block_scaled_gemm(a, a_scale, b, b_scale, config=config)
        assert (a.device, fresh.cuda_stream) not in gemm._counters
        for i in range(10):
            out.fill_(float("nan"))
            fresh_out.fill_(float("nan"))
            graph.replay()
            fresh_graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected) and torch.equal(fresh_out, expected), f"graph replay {i}"
    assert not gemm.tile_counters(a.device).any()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9, reason="Hopper")
@pytest.mark.parametrize("n,k", TP8_SHAPES, ids=[f"n{n}_k{k}" for n, k in TP8_SHAPES])
@pytest.mark.parametrize("m", [256, 300, 4096])
def test_untuned_hopper_default_tp8_shapes(m, n, k):
    """DeepSeek-V3's linear layers as one of eight tensor-parallel ranks holds them, which the shipped
    tables do not hold, under the untuned Hopper default."""
    from common_kernels.fp8.gemm import default_config

    config = default_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count, hopper=True)
    a, a_scale = quantize_per_token_group(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    b, b_scale = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") * 0.02)
    out = block_scaled_gemm(a, a_scale, b, b_scale, config=config)
    expected = block_scaled_gemm_ref(a, a_scale, b, b_scale, torch.float32)
    assert_close(out, expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2, name=f"gemm {config}")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2_scale", [False, True], ids=["scale", "pow2_scale"])
def test_group_quant_bit_equal_over_many_values(fp8, pow2_scale):
    """The hardware's fp8 cast (nearest even, subnormals) after one division a scale, on 29 M values
    over twelve decades: every code and scale as torch's division and cast give them."""
    x = torch.randn(4096, 7168, device="cuda") * torch.logspace(-6, 6, 4096, device="cuda")[:, None]
    q, scales = quantize_per_token_group(x, 128, fp8, pow2_scale)
    q_ref, scales_ref = quantize_per_token_group_ref(x, 128, fp8, pow2_scale)
    assert torch.equal(scales, scales_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_weight_block_quant_bit_equal():
    w = torch.randn(24576, 1536, device="cuda") * 0.02
    q, scales = quantize_weight_blocks(w)
    q_ref, scales_ref = quantize_weight_blocks_ref(w)
    assert torch.equal(scales, scales_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def _plant_nonfinite(x: torch.Tensor, count: int, values=(float("nan"), float("inf"), -float("inf"))) -> torch.Tensor:
    flat = x.view(-1)
    flat[torch.randperm(flat.numel(), device=x.device)[:count]] = torch.tensor(values, device=x.device, dtype=x.dtype)[
        torch.arange(count, device=x.device) % len(values)]
    return x


@pytest.mark.parametrize("rows,cols,count", [(1, 16, 3), (3, 200, 7), (37, 7168, 101), (4099, 1536, 999)])
def test_guard_counts_each_nonfinite_value_once(rows, cols, count):
    """The quantizers count a row's non-finite values within its warp and add them with one atomic for
    each row that holds any: on a GPU a row's count sits in several lanes, and each must add it once
    (the interpreter has no lanes). Tiles smaller than a program's threads replicate values too."""
    def counted(fn, *args):
        stats = torch.zeros(2, dtype=torch.int32, device="cuda")
        fn(*args, stats=stats)
        return stats.tolist()

    x = _plant_nonfinite(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16), count)
    assert counted(quantize_per_token_group, x, 128) == [0, count]
    up = _plant_nonfinite(torch.randn(rows, cols // 2, device="cuda", dtype=torch.bfloat16), count)
    assert counted(silu_mul_group_quant, torch.cat([torch.randn_like(up), up], 1)) == [0, count]
    # a NaN makes its row's RMS NaN, and so every value of that row
    x = _plant_nonfinite(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16), rows, (float("nan"),))
    nan_rows = int(x.isnan().any(1).sum())
    assert counted(rms_norm_group_quant, x, torch.ones(cols, device="cuda", dtype=torch.bfloat16), 1e-6) == [
        0, nan_rows * cols]


@pytest.mark.parametrize("k", [7168, 18432, 2112])
def test_token_quant_deepseek_widths(k):
    x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16) * torch.logspace(-2, 2, 512, device="cuda")[:, None]
    q, scales = quantize_per_token(x)
    q_ref, scales_ref = quantize_per_token_ref(x)
    assert torch.equal(scales, scales_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


SWAPPED_MOE = {"BLOCK_M": 16, "gate_up": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "SWAP_AB": True},
               "down": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4, "SWAP_AB": True}}


@pytest.mark.parametrize("config", [None, SWAPPED_MOE], ids=["tuned", "swapped"])
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_fused_moe_deepseek_experts(tokens, config):
    """32 of DeepSeek-V3's experts (hidden 7168, intermediate 2048), top 8, random routing; the tuned
    launch, and 16-row runs with both GEMMs' products as B A^T (``SWAP_AB``)."""
    from common_kernels.fp8 import fused_moe_fp8
    from common_kernels.fp8.reference import fused_moe_fp8_ref

    experts, top_k, hidden, inter = 32, 8, 7168, 2048
    pairs13 = [quantize_weight_blocks_ref(torch.randn(2 * inter, hidden, device="cuda") * 0.02) for _ in range(experts)]
    pairs2 = [quantize_weight_blocks_ref(torch.randn(hidden, inter, device="cuda") * 0.02) for _ in range(experts)]
    w13, s13 = torch.stack([q for q, _ in pairs13]), torch.stack([s for _, s in pairs13])
    w2, s2 = torch.stack([q for q, _ in pairs2]), torch.stack([s for _, s in pairs2])
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, dim=-1)
    out = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, config=config)
    rows = min(tokens, 8)  # the reference loops in Python
    expected = fused_moe_fp8_ref(x[:rows], w13, s13, w2, s2, weights[:rows], ids[:rows])
    assert_close(out[:rows], expected, atol=2e-2, rtol=2e-2, name="moe")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9, reason="Hopper")
@pytest.mark.parametrize("tokens", [4096, 5000])
def test_fused_moe_untuned_hopper_tp8_experts(tokens):
    """DeepSeek-V3's 256 experts as one of eight tensor-parallel ranks holds them (intermediate 256), top 8,
    under the untuned Hopper launch (both GEMMs warp-specialized from 128 rows an expert; 5000 tokens:
    runs of ragged lengths)."""
    from common_kernels.fp8 import fused_moe_fp8
    from common_kernels.fp8.moe import untuned_config
    from common_kernels.fp8.reference import fused_moe_fp8_ref

    experts, top_k, hidden, inter = 256, 8, 7168, 256
    w13, s13 = expert_weights(experts, 2 * inter, hidden)
    w2, s2 = expert_weights(experts, hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, dim=-1)
    config = untuned_config(tokens * top_k / experts, hopper=True)
    out = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, config=config)
    rows = 8  # the reference loops in Python
    expected = fused_moe_fp8_ref(x[:rows], w13, s13, w2, s2, weights[:rows], ids[:rows])
    assert_close(out[:rows], expected, atol=2e-2, rtol=2e-2, name=f"moe {config}")


@pytest.mark.parametrize("tokens", [1, 56, 57, 114, 4096, 20000])
def test_expert_sort_deepseek_sizes(tokens):
    """DeepSeek-V3's 256 routed experts + 1 shared, top 8 + 1: up to 32 programs of pairs; up to 56
    tokens (504 pairs) all three phases in one launch, from 57 (513) three launches, from 114 (1026)
    of two programs and more."""
    from common_kernels.fp8.moe import align_by_expert
    from common_kernels.fp8.reference import align_by_expert_ref
    from tests.common_kernels.test_fp8_moe import assert_positions_invert, assert_same_runs

    ids = torch.cat([torch.rand(tokens, 256, device="cuda").topk(8, dim=1).indices,
                     torch.full((tokens, 1), 256, device="cuda")], dim=1).to(torch.int32)
    runs = align_by_expert(ids, 257, 64)
    ref_sorted, ref_block_expert, _, ref_used_rows = align_by_expert_ref(ids, 257, 64)
    assert torch.equal(runs.block_expert, ref_block_expert) and torch.equal(runs.used_rows, ref_used_rows)
    assert_same_runs(runs.sorted_ids, ref_sorted, runs.block_expert, 64, ids.numel())
    assert_positions_invert(runs, ids)
