"""The Gluon block-FP8 GEMMs for Hopper (``common_kernels/fp8/gemm_sm90.py`` and the warp-specialized
``gemm_sm90_ws.py``) on an sm_90 GPU, against the fp32 reference and the Triton kernel, at every
config the tuner may pick for them.
It cannot run in the interpreter; ``benchmarks/hopper_compile.py`` compiles it on any machine.

    pytest tests/gpu/test_gemm_sm90.py -q          (skipped without an sm_90 GPU)

Shapes: ragged M and N (a partial last weight block), K of one, two, three and five blocks (the
kernel takes K blocks in pairs: both parities), a partial last K block, and DeepSeek-V3's
``fused_qkv_a_proj`` at prefill size; the last two have more tiles than the H200 has
multiprocessors, so each persistent program of ``gemm_sm90_ws`` takes several (with an even and
an odd count of K blocks). Outputs start as NaN. The tolerance is the Triton GEMM's
at DeepSeek-V3's shapes on the GPU (``tests/gpu/test_fp8_full_size.py``): on Hopper both kernels
sum a K block's 128 products inside the wgmma, whose fp8 accumulator keeps fewer bits than fp32
(the DeepSeek-V3 report: about 14), so near-zero outputs may be off by about 1e-3 of the largest
output (on the H200, 2026-12-02: 0.04 % of the outputs beyond 1e-3 absolute at K = 7168, relative
RMS error 1.7e-3, as bf16 rounding alone gives).
"""

import pytest
import torch

from common_kernels.fp8 import block_scaled_gemm, gemm_sm90, gemm_sm90_ws
from common_kernels.fp8.reference import block_scaled_gemm_ref, quantize_per_token_group_ref, quantize_weight_blocks_ref
from tests.helpers import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU")
SM90_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1, GROUP_M=8, num_warps=warps, num_stages=stages, KERNEL="sm90")
                for bm, bn, warps in gemm_sm90.TILES for stages in (3, 4, 6)]
SM90_CONFIGS += [dict(BLOCK_M=128, BLOCK_N=bn, SPLIT_K=1, GROUP_M=8, num_warps=4, num_stages=stages, KERNEL="sm90_ws")
                 for bn in gemm_sm90_ws.BLOCK_NS for stages in (2, 4, 6)]


@pytest.mark.parametrize("config", SM90_CONFIGS,
                         ids=lambda c: f"{c['KERNEL']}-{c['BLOCK_M']}x{c['BLOCK_N']}-s{c['num_stages']}")
@pytest.mark.parametrize("m, n, k", [(1, 64, 128), (70, 200, 256), (300, 2112, 384), (129, 576, 640),
                                     (33, 256, 208), (4096, 2112, 7168), (2048, 2112, 640)])
def test_matches_reference_and_triton(config, m, n, k):
    x = torch.randn(m, k, device="cuda") * 3
    w = torch.randn(n, k, device="cuda") * 0.02
    a, a_scale = quantize_per_token_group_ref(x)
    b, b_scale = quantize_weight_blocks_ref(w)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    block_scaled_gemm(a, a_scale, b, b_scale, out=out, config=config)
    atol = assert_matches_reference(out, a, a_scale, b, b_scale, "sm90 gemm")
    triton_out = block_scaled_gemm(a, a_scale, b, b_scale)  # the tuned table's Triton config
    assert_close(out, triton_out, atol=atol, rtol=1e-2, name="sm90 gemm vs triton")


def assert_matches_reference(out, a, a_scale, b, b_scale, name) -> float:
    """``out`` against the fp32 reference (module docstring's tolerance); returns that tolerance."""
    ref = block_scaled_gemm_ref(a, a_scale, b, b_scale, torch.float32)
    atol = 2e-3 * ref.abs().max().item()
    assert_close(out, ref, atol=atol, rtol=1e-2, name=name)
    rel_rms = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel_rms < 3e-3, f"{name}: relative RMS error {rel_rms:.2e}, more than bf16 rounding (1.7e-3)"
    return atol


@pytest.mark.parametrize("kernel", ["sm90", "sm90_ws"])
def test_refuses_rows_it_cannot_copy(kernel):
    a, a_scale = quantize_per_token_group_ref(torch.randn(8, 200, device="cuda"))
    b, b_scale = quantize_weight_blocks_ref(torch.randn(64, 200, device="cuda"))
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        block_scaled_gemm(a, a_scale, b, b_scale, config=next(c for c in SM90_CONFIGS if c["KERNEL"] == kernel))


@pytest.mark.parametrize("config", [c for c in SM90_CONFIGS if c["KERNEL"] == "sm90_ws"],
                         ids=lambda c: f"{c['KERNEL']}-{c['BLOCK_M']}x{c['BLOCK_N']}-s{c['num_stages']}")
def test_ws_output_rows_bulk_stores_cannot_take(config):
    """C rows that are not 16-byte aligned (a view of a wider buffer) go out from registers, not by
    bulk stores: same values, and nothing written past the view's columns."""
    m, n, k = 300, 200, 384
    a, a_scale = quantize_per_token_group_ref(torch.randn(m, k, device="cuda") * 3)
    b, b_scale = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") * 0.02)
    buffer = torch.full((m, n + 3), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buffer[:, :n]
    assert gemm_sm90_ws.out_descriptor(out, config["BLOCK_N"]) is None
    block_scaled_gemm(a, a_scale, b, b_scale, out=out, config=config)
    ref = block_scaled_gemm_ref(a, a_scale, b, b_scale, torch.float32)
    assert_close(out, ref, atol=2e-3 * ref.abs().max().item(), rtol=1e-2, name="sm90_ws gemm, C from registers")
    assert buffer[:, n:].isnan().all(), "the kernel wrote past C's columns"


WS_SPLIT_CONFIGS = [dict(BLOCK_M=128, BLOCK_N=bn, SPLIT_K=split, GROUP_M=8, num_warps=4, num_stages=stages,
                         KERNEL="sm90_ws")
                    for bn in gemm_sm90_ws.BLOCK_NS for split, stages in ((2, 4), (3, 7), (4, 2), (16, 4))]


@pytest.mark.parametrize("config", WS_SPLIT_CONFIGS,
                         ids=lambda c: f"ws-128x{c['BLOCK_N']}-split{c['SPLIT_K']}-s{c['num_stages']}")
@pytest.mark.parametrize("m, n, k", [(1, 64, 384), (70, 200, 640), (300, 576, 1168), (129, 2112, 7168)])
def test_ws_k_splits(config, m, n, k):
    """K splits of the warp-specialized kernel: fp32 partials from registers, summed after. Splits of
    unequal length (three, five or ten K blocks, a partial last one), more work items than multiprocessors
    at (129, 2112, 7168) (each persistent program takes several, with their own K ranges through one
    ring), and a C view whose rows are not 16-byte aligned for the sum. A split without a K block is
    refused by name."""
    a, a_scale = quantize_per_token_group_ref(torch.randn(m, k, device="cuda") * 3)
    b, b_scale = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") * 0.02)
    buffer = torch.full((m, n + 3), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buffer[:, :n]
    if not gemm_sm90_ws.splits_fit(k, config["SPLIT_K"]):
        with pytest.raises(ValueError, match="without a 128-wide block"):
            block_scaled_gemm(a, a_scale, b, b_scale, out=out, config=config)
        return
    block_scaled_gemm(a, a_scale, b, b_scale, out=out, config=config)
    atol = assert_matches_reference(out, a, a_scale, b, b_scale, "sm90_ws gemm, K split")
    assert buffer[:, n:].isnan().all(), "the sum wrote past C's columns"
    whole = block_scaled_gemm(a, a_scale, b, b_scale, config=dict(config, SPLIT_K=1, num_stages=4))
    assert_close(out, whole, atol=atol, rtol=1e-2, name="K split vs one pass")
