"""RMSNorm fused with the fp8 group quantization, against the references (CPU: Triton
interpreter; small, ragged rows): vLLM's RMSNorm formula, then the group quantizer."""

import pytest
import torch

from common_kernels.fp8 import quantize_per_token_group, rms_norm_group_quant
from common_kernels.fp8.reference import rms_norm_group_quant_ref, rms_norm_ref
from tests.helpers import FP8, assert_quantized_close, device


def inputs(rows, cols, dtype, seed):
    gen = torch.Generator(device=device()).manual_seed(seed)
    x = (torch.randn(rows, cols, generator=gen, device=device()) * 3).to(dtype)
    residual = torch.randn(rows, cols, generator=gen, device=device()).to(dtype)
    weight = (torch.rand(cols, generator=gen, device=device()) * 2).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("fp8_name", FP8.keys())
@pytest.mark.parametrize("shape", [(3, 300), (1, 128), (5, 1536), (2, 7168)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rms_norm_group_quant_matches_reference(fp8_name, shape, dtype):
    x, _, weight = inputs(*shape, dtype, seed=shape[1])
    q, scales, residual_out = rms_norm_group_quant(x, weight, 1e-6, fp8_dtype=FP8[fp8_name])
    q_ref, scales_ref, _ = rms_norm_group_quant_ref(x, weight, 1e-6, fp8_dtype=FP8[fp8_name])
    assert residual_out is None
    assert_quantized_close((q, scales), (q_ref, scales_ref), fp8_name)


@pytest.mark.parametrize("shape", [(3, 300), (4, 7168)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_with_residual_matches_reference(shape):
    x, residual, weight = inputs(*shape, torch.bfloat16, seed=7)
    x_before, residual_before = x.clone(), residual.clone()
    q, scales, residual_out = rms_norm_group_quant(x, weight, 1e-5, residual)
    q_ref, scales_ref, residual_ref = rms_norm_group_quant_ref(x, weight, 1e-5, residual)
    assert torch.equal(residual_out, residual_ref), "the new residual is x + residual rounded once"
    assert_quantized_close((q, scales), (q_ref, scales_ref), "e4m3")
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs were modified"


def test_fused_equals_the_separate_path_on_the_same_normalized_row():
    """Where the kernel's normalization equals the reference's (checked), its quantization is bit for
    bit the group quantizer's: the fused kernel changes where values go, not what they are."""
    x, _, weight = inputs(6, 640, torch.bfloat16, seed=3)
    y, _ = rms_norm_ref(x, weight, 1e-6)
    q, scales, _ = rms_norm_group_quant(x, weight, 1e-6)
    q_sep, scales_sep = quantize_per_token_group(y, 128)
    rows_same = (scales == scales_sep).all(1)
    assert rows_same.sum() >= 4, "the normalization differs from the reference on most rows"
    assert torch.equal(q[rows_same].view(torch.uint8), q_sep[rows_same].view(torch.uint8))


def test_outputs_are_written_everywhere(monkeypatch):
    """Outputs allocated poisoned (NaN codes, NaN scales and residual): every one is written, the
    ragged last group's included."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(tensor):
        return tensor.view(torch.uint8).fill_(0x7F).view(tensor.dtype) if tensor.element_size() == 1 \
            else tensor.fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))
    x, residual, weight = inputs(3, 200, torch.bfloat16, seed=11)
    q, scales, residual_out = rms_norm_group_quant(x, weight, 1e-6, residual)
    monkeypatch.undo()
    assert scales.shape == (3, 2) and q.shape == (3, 200)
    assert torch.isfinite(scales).all() and torch.isfinite(q.float()).all() and torch.isfinite(residual_out).all()


def test_counts_nonfinite_values():
    x, residual, weight = inputs(3, 256, torch.bfloat16, seed=5)
    x[1, 7] = float("nan")  # the whole row normalizes to NaN
    stats = torch.zeros(2, dtype=torch.int32, device=device())
    _, scales, _ = rms_norm_group_quant(x, weight, 1e-6, stats=stats)
    assert stats.tolist() == [0, 256]
    assert not torch.isfinite(scales[1]).any() and torch.isfinite(scales[[0, 2]]).all()
    residual[2, 0] = float("inf")  # rsqrt(inf) = 0: that value becomes NaN, the rest of its row 0
    stats.zero_()
    rms_norm_group_quant(x, weight, 1e-6, residual, stats=stats)
    assert stats.tolist() == [0, 257]


@pytest.mark.parametrize("bad, message", [
    (lambda x, r, w: (x[:, ::2], r[:, ::2], w[::2]), "contiguous last dim"),
    (lambda x, r, w: (x, r[:1], w), "residual must match x"),
    (lambda x, r, w: (x, r, w.float()), r"weight must be \[256\] in torch.bfloat16"),
    (lambda x, r, w: (x.new_zeros(2, 20000), r.new_zeros(2, 20000), w.new_zeros(20000)), "at most 16384"),
])
def test_refuses_bad_input(bad, message):
    x, residual, weight = bad(*inputs(2, 256, torch.bfloat16, seed=1))
    with pytest.raises(ValueError, match=message):
        rms_norm_group_quant(x, weight, 1e-6, residual)
