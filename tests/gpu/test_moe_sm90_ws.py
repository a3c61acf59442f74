"""The fused MoE's down GEMM on the warp-specialized Hopper kernel (``gemm_sm90_ws`` grouped by expert,
``"down": {"KERNEL": "sm90_ws", ...}``) on an sm_90 GPU: against the reference, and against the same
launch with the Triton down GEMM (the same intermediate, so only the second GEMM differs).

    pytest tests/gpu/test_moe_sm90_ws.py -q          (skipped without an sm_90 GPU)

Shapes: ragged token counts (runs of 1 to several 128-row blocks, experts with no token), H = 192
(a 128-row box of one expert's weights reaches into the next expert's: its columns past H must not
be stored), I = 192 (a partial last K block), H = 196 (C rows not 16-byte aligned: stores from
registers), a rank of expert parallelism, and DeepSeek-V3's expert sizes with more tiles than the
H200 has multiprocessors. Tolerances: the CPU tests' against the reference
(``tests/common_kernels/test_fp8_moe.py``), and the block GEMM's against the Triton launch
(``test_gemm_sm90.py``: about 1e-3 of the largest output, from the wgmma's fp8 accumulator).
"""

import pytest
import torch

from common_kernels.fp8.moe import append_shared_experts, fused_moe_fp8
from common_kernels.fp8.reference import fused_moe_fp8_ref, quantize_weight_blocks_ref
from tests.helpers import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU")
GATE_UP = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
WS_DOWNS = [{"KERNEL": "sm90_ws", "BLOCK_N": bn, "num_warps": 4, "num_stages": stages}
            for bn in (128, 64) for stages in (2, 6)]


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


def both_downs(down, *inputs, **kwargs):
    """The MoE with ``down`` and with the Triton down GEMM at the same 128-row runs and gate/up launch."""
    ws = {"BLOCK_M": 128, "gate_up": GATE_UP, "down": down}
    triton_down = dict(ws, down={"BLOCK_N": 128, "num_warps": 4, "num_stages": 3})
    return [fused_moe_fp8(*inputs, config=config, **kwargs) for config in (ws, triton_down)]


@pytest.mark.parametrize("down", WS_DOWNS, ids=lambda d: f"{d['BLOCK_N']}-s{d['num_stages']}")
@pytest.mark.parametrize("tokens, experts, hidden, inter, top_k",
                         [(1, 8, 256, 256, 2), (37, 8, 192, 192, 2), (300, 8, 256, 256, 3), (700, 5, 196, 128, 2)])
def test_ws_down_matches_reference_and_triton(down, tokens, experts, hidden, inter, top_k):
    x, w13, s13, w2, s2, weights, ids = moe_inputs(tokens, experts, hidden, inter, top_k)
    ids, weights = append_shared_experts(ids, weights, first_shared=experts - 1, num_shared=1)
    ours, triton_down = both_downs(down, x, w13, s13, w2, s2, weights, ids)
    rows = min(tokens, 40)  # the reference loops in Python
    expected = fused_moe_fp8_ref(x[:rows], w13, s13, w2, s2, weights[:rows], ids[:rows])
    assert_close(ours[:rows], expected, atol=2e-2, rtol=2e-2, name="moe, ws down", outliers=1e-3, outlier_tol=0.1)
    atol = 2e-3 * triton_down.abs().max().item()
    assert_close(ours, triton_down, atol=atol, rtol=1e-2, name="ws down vs triton down")


def test_ws_down_on_an_expert_parallel_rank():
    """Pairs routed to other ranks leave their rows out; the rows of runs are the device's count only."""
    hidden, inter, top_k, tokens = 256, 256, 3, 90
    w13, s13 = expert_weights(3, 2 * inter, hidden)
    w2, s2 = expert_weights(3, hidden, inter)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1], dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(tokens, 6, device="cuda"), -1).topk(top_k, dim=-1)
    ours, triton_down = both_downs(WS_DOWNS[0], x, w13, s13, w2, s2, weights, ids, expert_map=expert_map)
    expected = fused_moe_fp8_ref(x[:30], w13, s13, w2, s2, weights[:30], ids[:30], expert_map=expert_map)
    assert_close(ours[:30], expected, atol=2e-2, rtol=2e-2, name="ep, ws down", outliers=1e-3, outlier_tol=0.1)
    assert_close(ours, triton_down, atol=2e-3 * triton_down.abs().max().item(), rtol=1e-2, name="ep ws vs triton")


@pytest.mark.parametrize("tokens", [64, 4096])
def test_ws_down_deepseek_experts(tokens):
    """32 of DeepSeek-V3's experts (hidden 7168, intermediate 2048), top 8: at 4096 tokens about 300
    row blocks of 128 times 56 column tiles, several tiles a persistent program."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs(tokens, 32, 7168, 2048, 8, std=0.02)
    ours, triton_down = both_downs(WS_DOWNS[1], x, w13, s13, w2, s2, weights, ids)
    expected = fused_moe_fp8_ref(x[:8], w13, s13, w2, s2, weights[:8], ids[:8])
    assert_close(ours[:8], expected, atol=2e-2, rtol=2e-2, name="deepseek moe, ws down")
    assert_close(ours, triton_down, atol=2e-3 * triton_down.abs().max().item(), rtol=1e-2, name="ws vs triton")


def test_ws_gate_up_is_refused():
    x, w13, s13, w2, s2, weights, ids = moe_inputs(4, 4, 256, 256, 2)
    config = {"BLOCK_M": 128, "gate_up": WS_DOWNS[0], "down": WS_DOWNS[0]}
    with pytest.raises(ValueError, match="second \\(down\\) GEMM's only"):
        fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, config=config)
