"""FP8 kernels against the PyTorch references (CPU: Triton interpreter; small, ragged shapes)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common_kernels.fp8 import (
    block_scaled_gemm,
    quantize_expert_weights,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_blocks,
)
from common_kernels.fp8 import gemm_sm90, gemm_sm90_ws, moe
from common_kernels.fp8.gemm import tuned_table
from common_kernels.fp8.reference import (
    block_scaled_gemm_ref,
    quantize_per_token_group_ref,
    quantize_per_token_ref,
    quantize_weight_blocks_ref,
)
from tests.helpers import assert_close, device

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("fp8_name", FP8.keys())
@pytest.mark.parametrize("shape", [(5, 300), (1, 128), (9, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pow2_scale", [False, True], ids=["scale", "pow2_scale"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16_in", "fp32_in"])
def test_group_quant_matches_reference(fp8_name, shape, pow2_scale, in_dtype):
    x = (torch.randn(shape, device=device()) * torch.logspace(-3, 3, shape[1], device=device())).to(in_dtype)
    q, scales = quantize_per_token_group(x, 128, FP8[fp8_name], pow2_scale)
    q_ref, scales_ref = quantize_per_token_group_ref(x, 128, FP8[fp8_name], pow2_scale)
    assert_close(scales, scales_ref, atol=0, rtol=0, name="scales")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "fp8 codes differ from the reference"
    if pow2_scale:
        assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))


def test_group_quant_rounds_exact_ties_to_even():
    """Quotients exactly halfway between two E4M3 values round to the even one, as torch's cast does,
    under scales chosen so that the shortcuts miss: with ``a``, x times the reciprocal falls short of
    the ties 19 and 9.5 (so one division a scale needs its correction); with ``b``, the correction
    done with two roundings instead of a fused one overshoots the tie 15.5 (so the interpreter's fma
    must be fused, as the GPU's is). 17 sits between 16 and 18; 7.97 carries into the next binade."""
    a, b = torch.tensor(1 + 2949 * 2.0**-12), torch.tensor(1 + 693 * 2.0**-14)
    assert (19 * a) * (1 / a) < 19 and (9.5 * a) * (1 / a) < 9.5
    q0 = (15.5 * b) * (1 / b)
    assert q0 + (15.5 * b - q0 * b) * (1 / b) < 15.5
    x = torch.zeros(2, 128, device=device())
    x[:, 0] = 448 * torch.stack([a, b])  # the group maxima: the scales are a and b exactly
    x[0, 1:7] = torch.tensor([19.0, -19.0, 9.5, 17.0, 7.97, -7.97]) * a
    x[1, 1:3] = torch.tensor([15.5, -15.5]) * b
    q, scales = quantize_per_token_group(x, 128)
    assert scales[:, 0].tolist() == [a.item(), b.item()]
    assert q[0, 1:7].float().tolist() == [20.0, -20.0, 10.0, 16.0, 8.0, -8.0]
    assert q[1, 1:3].float().tolist() == [16.0, -16.0]
    assert torch.equal(q.view(torch.uint8), quantize_per_token_group_ref(x, 128)[0].view(torch.uint8))


@pytest.mark.parametrize("pow2_scale", [False, True], ids=["scale", "pow2_scale"])
def test_group_quant_counts_nonfinite_inputs(pow2_scale):
    """A NaN reaches its group's scale (a GPU's max drops NaN operands), an infinity makes it infinite."""
    x = torch.randn(3, 256, device=device())
    x[0, 5], x[2, 200] = float("nan"), float("-inf")
    stats = torch.zeros(2, dtype=torch.int32, device=device())
    _, scales = quantize_per_token_group(x, 128, pow2_scale=pow2_scale, stats=stats)
    assert stats.tolist() == [0, 2]
    assert torch.isnan(scales[0, 0]) and torch.isinf(scales[2, 1])
    assert torch.isfinite(scales[[0, 2], [1, 0]]).all() and torch.isfinite(scales[1]).all()


@pytest.mark.parametrize("limit", [0, 7, 19, 40])
def test_group_quant_stops_at_a_device_row_limit(limit):
    """Rows from ``rows_limit[0]`` on are neither quantized nor counted (NaN there leaves the guard at
    zero); the rows before it are the reference's. 19 rows: the last program's 16 rows straddle it."""
    x = torch.randn(33, 256, device=device())
    x[limit:] = float("nan")
    stats = torch.zeros(2, dtype=torch.int32, device=device())
    rows_limit = torch.tensor([limit], dtype=torch.int32, device=device())
    q, scales = quantize_per_token_group(x, 128, stats=stats, rows_limit=rows_limit)
    assert stats.tolist() == [0, 0]
    if limit:
        q_ref, scales_ref = quantize_per_token_group_ref(x[:limit], 128)
        assert torch.equal(scales[:limit], scales_ref)
        assert torch.equal(q[:limit].view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("limit", [7, torch.tensor([7]), torch.tensor([7, 8], dtype=torch.int32)])
def test_group_quant_row_limit_must_be_one_device_int32(limit):
    with pytest.raises(ValueError, match="rows_limit must be an int32 tensor of one element"):
        quantize_per_token_group(torch.randn(9, 128, device=device()), 128, rows_limit=limit)


@pytest.mark.parametrize("fp8_name", FP8.keys())
@pytest.mark.parametrize("shape", [(5, 3000), (1, 7), (4, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pow2_scale", [False, True], ids=["scale", "pow2_scale"])
def test_token_quant_matches_reference(fp8_name, shape, pow2_scale):
    """Rows longer than one 1024-wide chunk (3000), shorter than a tile (7), exactly one (1024)."""
    x = torch.randn(shape, device=device()) * torch.logspace(-2, 2, shape[0], device=device())[:, None]
    q, scales = quantize_per_token(x.bfloat16(), FP8[fp8_name], pow2_scale)
    q_ref, scales_ref = quantize_per_token_ref(x.bfloat16(), FP8[fp8_name], pow2_scale)
    assert scales.shape == (shape[0], 1)
    assert_close(scales, scales_ref, atol=0, rtol=0, name="scales")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "fp8 codes differ from the reference"


@pytest.mark.parametrize("pow2_scale", [False, True], ids=["scale", "pow2_scale"])
def test_token_quant_counts_nonfinite_inputs(pow2_scale):
    x = torch.randn(3, 2500, device=device())
    x[0, 5], x[2, 2200] = float("nan"), float("inf")
    stats = torch.zeros(2, dtype=torch.int32, device=device())
    _, scales = quantize_per_token(x, pow2_scale=pow2_scale, stats=stats)
    assert stats.tolist() == [0, 2] and torch.isfinite(scales[1]).all()
    assert torch.isnan(scales[0, 0]) and torch.isinf(scales[2, 0])


@pytest.mark.parametrize("fp8_name", FP8.keys())
@pytest.mark.parametrize("shape", [(256, 256), (300, 200), (64, 130)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_weight_block_quant_matches_reference(fp8_name, shape):
    """Ragged shapes: the last row and column tiles are partial."""
    w = (torch.randn(shape, device=device()) * torch.logspace(-2, 2, shape[1], device=device())).bfloat16()
    q, scales = quantize_weight_blocks(w, FP8[fp8_name])
    q_ref, scales_ref = quantize_weight_blocks_ref(w, FP8[fp8_name])
    assert_close(scales, scales_ref, atol=0, rtol=0, name="block scales")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "fp8 codes differ from the reference"


def test_weight_block_quant_counts_nonfinite_weights():
    """An infinity makes its tile's scale infinite, a NaN makes it NaN (a GPU's max drops NaN)."""
    w = torch.randn(256, 256, device=device())
    w[3, 200], w[130, 5] = float("inf"), float("nan")
    stats = torch.zeros(2, dtype=torch.int32, device=device())
    _, scales = quantize_weight_blocks(w, stats=stats)
    assert stats.tolist() == [0, 2] and torch.isinf(scales[0, 1]) and torch.isnan(scales[1, 0])
    assert torch.isfinite(scales[0, 0]) and torch.isfinite(scales[1, 1])


def test_expert_weights_are_quantized_expert_by_expert_as_the_reference():
    """A ragged stack of three experts: each expert's codes and scales are the reference's for that expert alone."""
    w = (torch.randn(3, 200, 300, device=device()) * torch.logspace(-2, 2, 300, device=device())).bfloat16()
    q, scales = quantize_expert_weights("layer.experts w13", w)
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn and scales.shape == (3, 2, 3)
    for e in range(3):
        q_ref, scales_ref = quantize_weight_blocks_ref(w[e])
        assert_close(scales[e], scales_ref, atol=0, rtol=0, name=f"expert {e} block scales")
        assert torch.equal(q[e].view(torch.uint8), q_ref.view(torch.uint8)), f"expert {e}: fp8 codes differ"


def test_expert_weights_with_nonfinite_values_are_refused_naming_the_experts():
    w = torch.randn(4, 128, 256, device=device()).bfloat16()
    w[1, 5, 7], w[3, 0, 0], w[3, 9, 200] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(ValueError, match=r"layer.experts w2: the checkpoint holds 3 non-finite weights, in experts "
                                         r"\[1, 3\]"):
        quantize_expert_weights("layer.experts w2", w)


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("n,k", [(64, 128), (200, 320), (256, 512)], ids=["n64_k128", "n200_k320", "n256_k512"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_block_scaled_gemm_matches_reference(m, n, k, out_dtype):
    x = torch.randn(m, k, device=device()) * 3
    w = torch.randn(n, k, device=device()) * 0.02
    a, a_scale = quantize_per_token_group_ref(x)
    b, b_scale = quantize_weight_blocks_ref(w)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=device())

    block_scaled_gemm(a, a_scale, b, b_scale, out_dtype, out=out)

    ref = block_scaled_gemm_ref(a, a_scale, b, b_scale, torch.float32)
    assert_close(out, ref, atol=1e-3, rtol=1e-2, name="gemm")
    # And the whole pipeline stays near the unquantized product (E4M3: ~2^-4 per factor).
    assert ((out.float() - x @ w.T).norm() / (x @ w.T).norm()).item() < 0.08


@pytest.mark.parametrize(
    "config",
    [dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=1, GROUP_M=1), dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=3, GROUP_M=2),
     dict(BLOCK_M=32, BLOCK_N=32, SPLIT_K=8, GROUP_M=4), dict(BLOCK_M=16, BLOCK_N=128, SPLIT_K=2, GROUP_M=1, maxnreg=168),
     dict(BLOCK_M=16, BLOCK_N=256, SPLIT_K=1, GROUP_M=1),
     dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=3, GROUP_M=2, SWAP_AB=True),
     dict(BLOCK_M=32, BLOCK_N=128, SPLIT_K=1, GROUP_M=1, SWAP_AB=True)],
    ids=["one_split", "three_uneven_splits", "more_splits_than_k_blocks", "one_weight_block_wide",
         "two_weight_blocks_wide", "swapped_three_splits", "swapped_one_weight_block_wide"],
)
def test_block_scaled_gemm_configs_agree(config):
    """Every launch shape (K splits, grouped tile order, products as B A^T, a strided output) gives the
    reference's result."""
    m, n, k = 37, 200, 5 * 128 - 64  # 3 row tiles of 16, 5 K blocks (the last one half)
    a, a_scale = quantize_per_token_group_ref(torch.randn(m, k, device=device()))
    b, b_scale = quantize_weight_blocks_ref(torch.randn(n, k, device=device()) * 0.05)
    wide = torch.full((m, n + 24), float("nan"), dtype=torch.bfloat16, device=device())
    out = wide[:, :n]

    block_scaled_gemm(a, a_scale, b, b_scale, out=out, config=dict(config, num_warps=4, num_stages=1))

    assert_close(out, block_scaled_gemm_ref(a, a_scale, b, b_scale, torch.float32), atol=1e-3, rtol=1e-2, name="gemm")
    assert torch.isnan(wide[:, n:]).all()


@pytest.mark.parametrize("swap_ab", [False, True], ids=["ab", "swapped"])
def test_split_k_summed_in_the_launch_gives_the_second_kernels_bits(monkeypatch, swap_ab):
    """K splits summed by each tile's last split, inside the GEMM's launch, give the bits the separate sum kernel
    gives (both add the splits in order), leave the stream's tile counters at zero, and agree again at a second
    launch on the same counters."""
    from common_kernels.fp8 import gemm

    m, n, k = 37, 200, 5 * 128 - 64  # 3 x 4 tiles of 16 x 64, 5 K blocks in 3 splits
    a, a_scale = quantize_per_token_group_ref(torch.randn(m, k, device=device()))
    b, b_scale = quantize_weight_blocks_ref(torch.randn(n, k, device=device()) * 0.05)
    config = dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=3, GROUP_M=2, SWAP_AB=swap_ab, num_warps=4, num_stages=1)

    def run():
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device())
        return block_scaled_gemm(a, a_scale, b, b_scale, out=out, config=config)

    assert gemm.sums_in_launch(m, n, config)
    in_launch = [run(), run()]
    assert not gemm.tile_counters(a.device).any(), "a tile's counter was left set"
    config["SUM_IN_LAUNCH"] = False  # the config opts out: the second kernel sums
    second_kernel = run()
    assert not torch.isnan(second_kernel).any()
    assert torch.equal(in_launch[0], second_kernel) and torch.equal(in_launch[1], second_kernel)
    del config["SUM_IN_LAUNCH"]
    monkeypatch.setattr(gemm, "TILE_COUNTERS", 11)  # one fewer than the 12 tiles: the second kernel sums
    assert not gemm.sums_in_launch(m, n, config) and torch.equal(run(), second_kernel)
    assert_close(second_kernel, block_scaled_gemm_ref(a, a_scale, b, b_scale, torch.float32), atol=1e-3, rtol=1e-2,
                 name="gemm")


def test_only_split_triton_launches_sum_in_the_launch():
    from common_kernels.fp8.gemm import TILE_COUNTERS, sums_in_launch

    split = dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=2)
    assert sums_in_launch(16, 64 * TILE_COUNTERS, split)
    assert not sums_in_launch(17, 64 * TILE_COUNTERS, split)  # one tile too many
    assert not sums_in_launch(16, 64, dict(split, SPLIT_K=1))
    assert not sums_in_launch(16, 64, dict(split, SUM_IN_LAUNCH=False))
    assert not sums_in_launch(16, 64, dict(split, KERNEL="sm90_ws"))  # its partials are summed after it


def test_gemm_config_choice():
    from common_kernels.fp8.gemm import default_config, nearest_tuned

    small, large = default_config(1, 2112, 7168, sms=132), default_config(4096, 2112, 7168, sms=132)
    assert small["BLOCK_M"] == 16 and small["SPLIT_K"] == 8  # 33 tiles x 8 splits >= 2 x 132, 7 K blocks each
    assert large["BLOCK_M"] == 128 and large["SPLIT_K"] == 1
    assert default_config(1, 2112, 512, sms=132)["SPLIT_K"] == 1  # 4 K blocks: too few to split
    assert "KERNEL" not in large  # off Hopper (or for operands its kernels cannot take): Triton's
    table = {"1": "one", "64": "sixty-four", "4096": "big"}
    assert [nearest_tuned(table, m) for m in (1, 5, 16, 200, 1000, 9000)] == ["one", "one", "sixty-four",
                                                                                "sixty-four", "big", "big"]


@pytest.mark.parametrize("m, n, kernel, block_n", [
    (128, 7168, None, None),  # M < 256: Triton's
    (256, 2112, None, None),  # 2 x 33 tiles of 128 x 64: half of 132 SMs, not more
    (256, 4096, "sm90_ws", 64),  # 2 x 64 tiles: more than half; 2 x 32 of 128 x 128: under three quarters
    (256, 7168, "sm90_ws", 128),  # 2 x 56 of 128 x 128: three quarters and more
    (4096, 512, "sm90_ws", 128),
])
def test_untuned_hopper_default_takes_the_warp_specialized_kernel(m, n, kernel, block_n):
    """Without a tuned entry, Hopper runs the warp-specialized kernel from M = 256 where its tiles fill
    more than half the GPU (``default_config``), with a launch the kernel fits."""
    from common_kernels.fp8.gemm import default_config

    config = default_config(m, n, 7168, sms=132, hopper=True)
    assert config.get("KERNEL") == kernel
    if kernel:
        assert config["BLOCK_N"] == block_n and gemm_sm90_ws.fits(config)
    else:
        assert config == default_config(m, n, 7168, sms=132)


def test_sm90_gemm_refuses_other_devices_and_configs():
    """The Gluon kernel (``gemm_sm90``, GPU-tested in ``tests/gpu/test_gemm_sm90.py``) is only
    launched where it runs, with configs it takes."""
    a, a_scale = quantize_per_token_group_ref(torch.randn(4, 256))
    b, b_scale = quantize_weight_blocks_ref(torch.randn(128, 256))
    config = dict(BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, GROUP_M=8, num_warps=8, num_stages=4, KERNEL="sm90")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="Hopper GPUs only"):
            block_scaled_gemm(a, a_scale, b, b_scale, config=config)
    for bad in (dict(BLOCK_N=256), dict(SPLIT_K=2), dict(BLOCK_M=64), dict(num_stages=2)):
        with pytest.raises(ValueError, match="does not fit the sm_90 GEMM kernel"):
            block_scaled_gemm(a, a_scale, b, b_scale, config=dict(config, **bad))
    ws = dict(config, num_warps=4, num_stages=6, KERNEL="sm90_ws")  # the warp-specialized kernel (gemm_sm90_ws)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="Hopper GPUs only"):
            block_scaled_gemm(a, a_scale, b, b_scale, config=ws)
    # seven stages of 128 x 128 boxes and the C buffers pass the 227 KiB of shared memory a block has
    for bad in (dict(BLOCK_N=256), dict(SPLIT_K=5), dict(BLOCK_M=64), dict(num_warps=8), dict(num_stages=1),
                dict(num_stages=7)):
        with pytest.raises(ValueError, match=r"does not fit the sm_90 GEMM kernel \(.*gemm_sm90_ws.fits\)"):
            block_scaled_gemm(a, a_scale, b, b_scale, config=dict(ws, **bad))
    assert gemm_sm90_ws.fits(dict(ws, BLOCK_N=64, num_stages=8))  # narrower boxes leave room for more
    # K splits: fp32 partials leave from registers (no C buffers: room for a seventh stage); each split
    # needs a K block of its own (K = 256 has two)
    assert gemm_sm90_ws.fits(dict(ws, SPLIT_K=2, num_stages=7))
    with pytest.raises(ValueError, match=r"SPLIT_K=3 leaves a split of K = 256 without a 128-wide block"):
        block_scaled_gemm(a, a_scale, b, b_scale, config=dict(ws, SPLIT_K=3))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="Hopper GPUs only"):
            block_scaled_gemm(a, a_scale, b, b_scale, config=dict(ws, SPLIT_K=2))
    e5m2 = b.float().to(torch.float8_e5m2)
    for launch in (config, ws):
        with pytest.raises(ValueError, match="take E4M3 operands, got torch.float8_e4m3fn and torch.float8_e5m2"):
            block_scaled_gemm(a, a_scale, e5m2, b_scale, config=launch)


def test_tuned_hopper_launches_give_way_for_operands_they_cannot_take(monkeypatch):
    """A tuned table naming the warp-specialized kernel is not followed for E5M2 weights or for
    activations whose rows are not 16-byte aligned: the heuristic's Triton launch runs instead, with
    its result; aligned E4M3 operands do take the Hopper launch (refused here: no Hopper GPU)."""
    from common_kernels.fp8 import gemm

    a, a_scale = quantize_per_token_group_ref(torch.randn(20, 256))
    b, b_scale = quantize_weight_blocks_ref(torch.randn(128, 256))
    ws = {"KERNEL": "sm90_ws", "BLOCK_M": 128, "BLOCK_N": 128, "SPLIT_K": 1, "GROUP_M": 8, "num_warps": 4,
          "num_stages": 4}
    monkeypatch.setattr(gemm, "gemm_config", lambda *args: ws)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=4))
    with pytest.raises(ValueError, match="Hopper GPUs only"):
        block_scaled_gemm(a, a_scale, b, b_scale)
    shifted = torch.empty(a.numel() + 1, dtype=torch.uint8)[1:].view(a.dtype).view(a.shape)  # starts at byte 1
    shifted.copy_(a)
    e5m2 = b.float().to(torch.float8_e5m2)
    for a_op, b_op in ((shifted, b), (a, e5m2)):
        expected = block_scaled_gemm(a_op, a_scale, b_op, b_scale, config=gemm.default_config(20, 128, 256, 4))
        assert torch.equal(block_scaled_gemm(a_op, a_scale, b_op, b_scale), expected)


def test_block_scaled_gemm_rejects_malformed_scales():
    a, a_scale = quantize_per_token_group_ref(torch.randn(4, 256))
    b, b_scale = quantize_weight_blocks_ref(torch.randn(128, 256))
    with pytest.raises(ValueError, match=r"b_scale must be fp32 \[1, 2\] \(128 x 128 blocks\)"):
        block_scaled_gemm(a, a_scale, b, b_scale.T.contiguous())
    with pytest.raises(ValueError, match=r"a_scale must be fp32 \[4, 2\]"):
        block_scaled_gemm(a, a_scale[:, :1].contiguous(), b, b_scale)
    with pytest.raises(ValueError, match="must be fp8"):
        block_scaled_gemm(a.float(), a_scale, b, b_scale)
    with pytest.raises(ValueError, match="must share K"):
        block_scaled_gemm(a[:, :128].contiguous(), a_scale, b, b_scale)


def test_support_names_the_limit():
    from common_kernels.fp8 import is_supported

    assert is_supported(weight_block=(128, 128), activation_group=128, capability=(9, 0)) == (True, "")
    ok, reason = is_supported(weight_block=(64, 128), activation_group=128)
    assert not ok and "weight block [64, 128]" in reason
    ok, reason = is_supported(weight_block=(128, 128), activation_group=128, capability=(8, 0))
    assert not ok and "8.9 or newer" in reason


def test_tuned_table_reads_the_file_its_variable_names(tmp_path, monkeypatch):

    table = {"256,7168,2048,8": {"1": {"BLOCK_M": 16}}}
    (tmp_path / "moe.json").write_text(json.dumps({"device": "X", "configs": table}))
    monkeypatch.setenv("LATENTSPEED_FP8_MOE_CONFIGS", str(tmp_path / "moe.json"))
    monkeypatch.setenv("LATENTSPEED_FP8_GEMM_CONFIGS", str(tmp_path / "absent.json"))
    tuned_table.cache_clear()
    try:
        assert tuned_table("moe", "Some GPU") == table
        assert tuned_table("gemm", "Some GPU") == {}  # no file: heuristics
    finally:
        tuned_table.cache_clear()


def test_shipped_tables_name_launches_their_kernels_take():
    """Every entry of the shipped tables that names a Hopper kernel is a launch that kernel takes
    (its ``fits``, at the entry's rows: the MoE's runs of ``BLOCK_M``); the others are Triton launches."""
    kernels = {"sm90": gemm_sm90, "sm90_ws": gemm_sm90_ws}
    hopper_entries = 0
    for path in (Path(gemm_sm90.__file__).parent / "configs").glob("*.json"):
        for by_size in json.loads(path.read_text())["configs"].values():
            for entry in by_size.values():
                if path.name.startswith("gemm_"):
                    launches = [(kernels.get(entry.get("KERNEL")), entry)]
                else:  # the MoE's gate/up and down GEMMs over runs of BLOCK_M rows
                    launches = [(moe.hopper_kernel(stage, entry[stage]), entry[stage]) for stage in ("gate_up", "down")]
                    launches = [(module, dict(launch, BLOCK_M=entry["BLOCK_M"])) for module, launch in launches]
                for module, launch in launches:
                    assert module is not None or "KERNEL" not in launch, f"{path.name}: unknown kernel in {launch}"
                    if module is not None:
                        hopper_entries += 1
                        assert module.fits(launch), f"{path.name}: {launch} does not fit {module.__name__}"
    assert hopper_entries > 0
