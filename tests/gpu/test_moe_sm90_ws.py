"""The fused MoE's warp-specialized Hopper GEMMs on an sm_90 GPU: gate/up on ``moe_sm90_ws`` (x quantized
into the sorted rows, the intermediate quantized in the epilogue) and down on ``gemm_sm90_ws`` grouped by
expert, each selected by ``"KERNEL": "sm90_ws"``; and gate/up with ``SEPARATE_ACT`` on ``gemm_sm90_ws``
grouped by expert without routing weights (bf16 products, then ``silu_mul_group_quant``): against the
reference (rounding as the launch does), and against the same runs with the Triton kernels (gate/up with
its quantizing epilogue, or its bf16 products under ``SEPARATE_ACT``).

    pytest tests/gpu/test_moe_sm90_ws.py -q          (skipped without an sm_90 GPU)

Shapes: ragged token counts (runs of one to several row blocks, experts with no token), H = 192
(a 128-row box of one expert's down weights reaches into the next expert's: its columns past H must
not be stored), I = 192 for the down GEMM alone (a partial last K block; the gate/up kernel needs
I % 128 == 0), H = 196 (C rows not 16-byte aligned: down stores from registers; the gate/up kernel's
A rows need H % 16 == 0), a rank of expert parallelism, and DeepSeek-V3's expert sizes with more
tiles than the H200 has multiprocessors.

Tolerances. Against the Triton kernels, the block GEMM's (``test_gemm_sm90.py``: 2e-3 of the
largest output, from the wgmma's fp8 accumulator; on the H200 the two gave equal bytes in every
case of ``benchmarks/results/moe-ws-vs-triton-fixed-seeds-2026-12-05.log``). Against the reference,
per token: a relative RMS error within 5e-2 and no element beyond 0.1 (abs and rel). Not the CPU
tests' elementwise 2e-2: the intermediate is rounded to bf16 and quantized again per 128 columns,
so when an accumulation in another order moves a group's largest value across a rounding boundary,
the group's scale changes and all its values may round the other way. With the gate/up sums moved
by 1e-3 (relative), 4.7 % of one-token cases broke the elementwise bound, the worst by 3.3e-2
relative RMS (``benchmarks/fp8_moe_sensitivity.py``, ``fp8-moe-requant-sensitivity-2026-12-05.md``);
on the H200 4 of 160 cases did (one token by 2.7e-2), while with fixed seeds the warp-specialized
and Triton kernels gave equal bytes in all 90 cases tried. A wrong row, tile, expert or weight moves
a token by far more.
"""

import pytest
import torch

from common_kernels.fp8 import moe, silu_mul_group_quant
from common_kernels.fp8.moe import append_shared_experts, fused_moe_fp8
from common_kernels.fp8.reference import fused_moe_fp8_ref, quantize_weight_blocks_ref
from tests.helpers import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU")
WS = {"KERNEL": "sm90_ws", "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}
WS_DOWNS = [{"KERNEL": "sm90_ws", "BLOCK_N": bn, "num_warps": 4, "num_stages": stages}
            for bn in (128, 64) for stages in (2, 6)]
TRITON = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
WS_SEPARATE = dict(WS_DOWNS[1], SEPARATE_ACT=True)  # gate/up products on the down GEMM's kernel
# (BLOCK_M, gate/up, down) with at least one warp-specialized GEMM; the first is DeepSeek-V3's candidate
PAIRS = {"both": (128, WS, WS_DOWNS[1]), "gate_up_64_rows": (64, WS, TRITON),
         "gate_up_2_stages": (128, dict(WS, num_stages=2), TRITON),
         "gate_up_5_stages": (128, dict(WS, num_stages=5), WS_DOWNS[0]),
         "separate_act": (128, WS_SEPARATE, WS_DOWNS[1]),
         "separate_act_64_wide_2_stages": (128, dict(WS_DOWNS[2], SEPARATE_ACT=True), TRITON)}
PAIRS |= {f"down_{d['BLOCK_N']}_s{d['num_stages']}": (128, TRITON, d) for d in WS_DOWNS}


def expert_weights(experts, rows, cols, std=0.05):
    pairs = [quantize_weight_blocks_ref(torch.randn(rows, cols, device="cuda") * std) for _ in range(experts)]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def moe_inputs(tokens, experts, hidden, inter, top_k, std=0.05):
    w13, s13 = expert_weights(experts, 2 * inter, hidden, std)
    w2, s2 = expert_weights(experts, hidden, inter, std)
    logits = torch.randn(tokens, experts, device="cuda")
    logits[:, 1] = -1e9  # expert 1 receives no token
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16), w13, s13, w2, s2, weights, ids


def separate(pair) -> bool:
    return bool(PAIRS[pair][1].get("SEPARATE_ACT"))


def against_triton(pair, *inputs, **kwargs):
    """The MoE with ``PAIRS[pair]`` and with the Triton kernels at the same runs (rounding alike)."""
    block_m, gate_up, down = PAIRS[pair]
    configs = ({"BLOCK_M": block_m, "gate_up": gate_up, "down": down},
               {"BLOCK_M": block_m, "gate_up": dict(TRITON, SEPARATE_ACT=separate(pair)), "down": TRITON})
    return [fused_moe_fp8(*inputs, config=config, **kwargs) for config in configs]


def assert_matches(ours, triton_out, expected, name):
    """Ours against the Triton kernels' run, then its first rows against the reference (module docstring)."""
    assert_close(ours, triton_out, atol=2e-3 * triton_out.abs().max().item(), rtol=1e-2, name=f"{name} vs triton",
                 outliers=1e-3, outlier_tol=0.1)
    actual, expected = ours[: expected.shape[0]].float().cpu(), expected.float().cpu()
    assert_close(actual, expected, atol=0.1, rtol=0.1, name=name)
    rel_rms = (actual - expected).pow(2).mean(1).sqrt() / expected.pow(2).mean(1).sqrt().clamp_min(1e-6)
    worst = int(rel_rms.argmax())
    assert rel_rms[worst] <= 5e-2, f"{name}: token {worst}'s relative RMS error {rel_rms[worst]:.3e} is above 5e-2"


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("tokens, experts, hidden, inter, top_k",
                         [(1, 8, 256, 256, 2), (37, 8, 192, 256, 2), (300, 8, 256, 128, 3), (700, 5, 256, 384, 2)])
def test_matches_reference_and_triton(pair, tokens, experts, hidden, inter, top_k):
    x, w13, s13, w2, s2, weights, ids = moe_inputs(tokens, experts, hidden, inter, top_k)
    ids, weights = append_shared_experts(ids, weights, first_shared=experts - 1, num_shared=1)
    ours, triton_out = against_triton(pair, x, w13, s13, w2, s2, weights, ids)
    rows = min(tokens, 40)  # the reference loops in Python
    expected = fused_moe_fp8_ref(x[:rows], w13, s13, w2, s2, weights[:rows], ids[:rows], separate_act=separate(pair))
    assert_matches(ours, triton_out, expected, pair)


@pytest.mark.parametrize("hidden, inter", [(192, 192), (196, 128)])
def test_ws_down_partial_blocks_and_unaligned_rows(hidden, inter):
    x, w13, s13, w2, s2, weights, ids = moe_inputs(300, 6, hidden, inter, 2)
    ours, triton_out = against_triton("down_128_s6", x, w13, s13, w2, s2, weights, ids)
    assert_matches(ours, triton_out, fused_moe_fp8_ref(x[:30], w13, s13, w2, s2, weights[:30], ids[:30]), "down")


@pytest.mark.parametrize("hidden", [256, 196])
def test_ws_down_stores_the_pairs_rows_only(hidden):
    """The second GEMM leaves its output's padding rows as they were (only ``sum_slots`` reads it, at the
    pairs' rows): runs of 100 pairs in 128 rows, so bulk stores of 64 rows of pairs and stores from
    registers of 36; H = 196 stores every row from registers. The pairs' rows match the Triton kernel's."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs(300, 6, hidden, 256, 2)
    runs = moe.align_by_expert(ids.to(torch.int32), 6, 128)
    pair_weights = weights.flatten().float().contiguous()
    h, h_scale = moe._gated_intermediate(x, w13, s13, runs, 2, pair_weights, TRITON, None)
    outs = []
    for down in (TRITON, WS_DOWNS[1]):
        out = torch.full((runs.sorted_ids.shape[0], hidden), float("nan"), dtype=x.dtype, device="cuda")
        moe._moe_gemm(h, h_scale, w2, s2, out, runs, ids.numel(), pair_weights, None, False, True, down)
        outs.append(out)
    paired = runs.sorted_ids < ids.numel()
    assert outs[1][~paired].isnan().all()
    expected = outs[0][paired]
    assert_close(outs[1][paired], expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2, name="down rows")


@pytest.mark.parametrize("pair", ["both", "gate_up_64_rows", "separate_act"])
def test_on_an_expert_parallel_rank(pair):
    """Pairs routed to other ranks leave their rows out; the rows of runs are the device's count only."""
    hidden, inter, top_k, tokens = 256, 256, 3, 90
    w13, s13 = expert_weights(3, 2 * inter, hidden)
    w2, s2 = expert_weights(3, hidden, inter)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1], dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(tokens, 6, device="cuda"), -1).topk(top_k, dim=-1)
    ours, triton_out = against_triton(pair, x, w13, s13, w2, s2, weights, ids, expert_map=expert_map)
    expected = fused_moe_fp8_ref(x[:30], w13, s13, w2, s2, weights[:30], ids[:30], expert_map=expert_map,
                                 separate_act=separate(pair))
    assert_matches(ours, triton_out, expected, f"ep, {pair}")


def test_padding_rows_holding_nan_stay_out():
    """The sorted A rows of padding are never written: with NaN bytes left there by an earlier tensor,
    the intermediate's padding rows are still zeros, the outputs right and the guard silent; an
    infinite weight scale in one expert is counted."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs(50, 8, 256, 256, 2)
    rows = -(-(100 + 8 * 127) // 128) * 128  # the sorted rows' bound (align_by_expert), 128-row runs
    # freed NaN bytes (E4M3 and fp32) of the sorted A's sizes, for the caching allocator to hand out again
    stale = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in (rows * 256, rows * 8) * 16]
    del stale
    stats = torch.zeros(2, dtype=torch.int32, device="cuda")
    ours, triton_out = against_triton("both", x, w13, s13, w2, s2, weights, ids, stats=stats)
    assert stats.tolist() == [0, 0]
    assert_matches(ours, triton_out, fused_moe_fp8_ref(x[:20], w13, s13, w2, s2, weights[:20], ids[:20]), "padding")
    s13[ids[0, 0], 0, 0] = float("inf")
    fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, stats=stats, config=dict(zip(("BLOCK_M", "gate_up", "down"),
                                                                                  PAIRS["both"])))
    assert stats[1] > 0


def test_quantizing_gate_ups_count_each_nonfinite_value_once():
    """An infinite weight scale in one expert's first gate block: the quantizing epilogues (Triton's and
    the warp-specialized kernel's) count the non-finite intermediate values of real rows once each, as
    many as torch finds in ``silu(gate) * up`` of the products, and as the separate SiLU quantizer."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs(50, 8, 256, 256, 2)
    s13[ids[0, 0], 0, 0] = float("inf")
    runs = moe.align_by_expert(ids.to(torch.int32), 8, 128)
    a, a_scale = moe.quantize_to_sorted_rows(x, runs, 2)
    real = (runs.sorted_ids < ids.numel())[:a.shape[0]]
    products = x.new_empty(a.shape[0], 512)
    moe._moe_gemm(a, a_scale, w13, s13, products, runs, ids.numel(), None, None, False, False, WS_SEPARATE)
    gate, up = products[real].float().split(256, 1)
    expected = int((~(torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype).isfinite()).sum())
    assert expected > 0
    counts = []
    for path in ("separate", "triton", "ws"):
        stats = torch.zeros(2, dtype=torch.int32, device="cuda")
        h, h_scale = moe._empty_intermediate(a.shape[0], 256, x.device)
        if path == "separate":
            silu_mul_group_quant(products, stats=stats, rows_limit=runs.used_rows,
                                 pair_ids=(runs.sorted_ids, ids.numel()))
        elif path == "triton":
            moe._moe_gemm(a, a_scale, w13, s13, h, runs, ids.numel(), None, None, True, False, TRITON,
                          out_scale=h_scale, mid_dtype=x.dtype, stats=stats)
        else:
            moe._moe_gate_up_sm90_ws(a, a_scale, w13, s13, h, h_scale, runs, ids.numel(), WS, x.dtype, stats)
        counts.append(stats.tolist())
    assert counts == [[0, expected]] * 3


@pytest.mark.parametrize("block_m, gate_up", [(64, WS), (128, WS), (128, WS_SEPARATE)])
def test_gate_up_ignores_what_the_padding_rows_hold(block_m, gate_up):
    """Deterministic (the test above relies on the caching allocator): the sorted A's padding rows
    (values and scales) set to NaN bytes give the same intermediate, byte for byte, as set to zeros,
    with its padding rows zero and the guard silent. ``SEPARATE_ACT``: the products' padding rows then
    hold NaN, which the activation's quantizer must not read as values."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs(50, 8, 256, 256, 2)
    runs = moe.align_by_expert(ids.to(torch.int32), 8, block_m)
    a, a_scale = moe.quantize_to_sorted_rows(x, runs, 2)
    padding, used = runs.sorted_ids >= ids.numel(), int(runs.used_rows)
    assert padding[:used].any()
    results = []
    for fill in (0x00, 0xFF):  # 0xFF: NaN in E4M3 and in fp32
        a.view(torch.uint8)[padding], a_scale.view(torch.uint8).view(-1, 4 * a_scale.shape[1])[padding] = fill, fill
        stats = torch.zeros(2, dtype=torch.int32, device="cuda")
        if gate_up.get("SEPARATE_ACT"):
            products = x.new_empty(a.shape[0], 512)
            moe._moe_gemm(a, a_scale, w13, s13, products, runs, ids.numel(), None, None, False, False, gate_up)
            h, h_scale = silu_mul_group_quant(products, stats=stats, rows_limit=runs.used_rows,
                                              pair_ids=(runs.sorted_ids, ids.numel()))
        else:
            h, h_scale = moe._empty_intermediate(a.shape[0], 256, x.device)
            moe._moe_gate_up_sm90_ws(a, a_scale, w13, s13, h, h_scale, runs, ids.numel(), gate_up, x.dtype, stats)
        results.append((h[:used].view(torch.uint8).clone(), h_scale[:used].clone(), stats.tolist()))
    (h0, s0, stats0), (h1, s1, stats1) = results
    assert torch.equal(h0, h1) and torch.equal(s0, s1) and stats0 == stats1 == [0, 0]
    assert (h1[padding[:used]] == 0).all()


@pytest.mark.parametrize("pair", ["both", "separate_act"])
@pytest.mark.parametrize("tokens", [64, 4096])
def test_deepseek_experts(tokens, pair):
    """32 of DeepSeek-V3's experts (hidden 7168, intermediate 2048), top 8: at 4096 tokens hundreds of
    row blocks times 16 (gate/up; 32 under SEPARATE_ACT) and 56 (down) column tiles, several tiles a
    persistent program."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs(tokens, 32, 7168, 2048, 8, std=0.02)
    ours, triton_out = against_triton(pair, x, w13, s13, w2, s2, weights, ids)
    expected = fused_moe_fp8_ref(x[:8], w13, s13, w2, s2, weights[:8], ids[:8], separate_act=separate(pair))
    assert_matches(ours, triton_out, expected, f"deepseek moe, {pair}")
