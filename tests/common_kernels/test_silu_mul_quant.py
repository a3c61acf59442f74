"""SiLU-and-mul fused with the fp8 group quantization, against the references (CPU: Triton
interpreter; small, ragged widths): vLLM's SiluAndMul formula, then the group quantizer."""

import pytest
import torch

from common_kernels.fp8 import quantize_per_token_group, silu_mul_group_quant
from common_kernels.fp8.reference import silu_mul_group_quant_ref, silu_mul_ref
from tests.helpers import FP8, assert_close, assert_quantized_close, device


def gate_up(rows, half, dtype, seed):
    gen = torch.Generator(device=device()).manual_seed(seed)
    return (torch.randn(rows, 2 * half, generator=gen, device=device()) * 4).to(dtype)


@pytest.mark.parametrize("fp8_name", FP8.keys())
@pytest.mark.parametrize("shape", [(3, 300), (1, 128), (17, 256), (2, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pow2_scale", [False, True], ids=["scale", "pow2_scale"])
def test_silu_mul_group_quant_matches_reference(fp8_name, shape, dtype, pow2_scale):
    """Widths of a ragged last group (300), one group, two row blocks (17 rows), a shared expert's."""
    x = gate_up(*shape, dtype, seed=shape[1])
    x_before = x.clone()
    got = silu_mul_group_quant(x, fp8_dtype=FP8[fp8_name], pow2_scale=pow2_scale)
    expected = silu_mul_group_quant_ref(x, fp8_dtype=FP8[fp8_name], pow2_scale=pow2_scale)
    assert got[0].shape == (shape[0], shape[1]) and got[1].shape == (shape[0], -(-shape[1] // 128))
    assert_quantized_close(got, expected, fp8_name)
    assert torch.equal(x, x_before), "the input was modified"


def test_fused_equals_the_separate_path_on_the_same_activation():
    """Where the kernel's activation equals the reference's (checked), its quantization is bit for
    bit the group quantizer's."""
    x = gate_up(6, 640, torch.bfloat16, seed=3)
    q, scales = silu_mul_group_quant(x)
    q_sep, scales_sep = quantize_per_token_group(silu_mul_ref(x), 128)
    rows_same = (scales == scales_sep).all(1)
    assert rows_same.sum() >= 4, "the activation differs from the reference on most rows"
    assert torch.equal(q[rows_same].view(torch.uint8), q_sep[rows_same].view(torch.uint8))


def test_outputs_are_written_everywhere(monkeypatch):
    """Outputs allocated poisoned (NaN codes and scales): every one is written, the ragged last
    group's and the last row block's included."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.view(torch.uint8).fill_(0x7F).view(tensor.dtype) if tensor.element_size() == 1 \
            else tensor.fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned)
    q, scales = silu_mul_group_quant(gate_up(19, 200, torch.bfloat16, seed=11))
    monkeypatch.undo()
    assert scales.shape == (19, 2) and q.shape == (19, 200)
    assert torch.isfinite(scales).all() and torch.isfinite(q.float()).all()


def test_counts_nonfinite_values():
    """A NaN gate makes its value and group scale NaN; an infinite up value times a positive silu
    stays infinite. Other groups are untouched."""
    x = gate_up(3, 256, torch.bfloat16, seed=5)
    x[0, 5] = float("nan")
    x[2, 256 + 130] = float("inf")
    x[2, 130] = 1.0
    stats = torch.zeros(2, dtype=torch.int32, device=device())
    _, scales = silu_mul_group_quant(x, stats=stats)
    assert stats.tolist() == [0, 2]
    assert torch.isnan(scales[0, 0]) and torch.isinf(scales[2, 1])
    assert torch.isfinite(scales[[0, 2], [1, 0]]).all() and torch.isfinite(scales[1]).all()


@pytest.mark.parametrize("fp8_name", FP8.keys())
def test_sorted_moe_rows_padding_and_row_limit(fp8_name, monkeypatch):
    """Over the fused MoE's sorted rows: rows from ``rows_limit[0]`` on are neither read nor written
    (they keep the poisoned outputs), padding rows holding NaN and infinities give zeros and are not
    counted, and the real rows match the reference; a NaN in a real row is counted."""
    rows, limit, num_pairs = 37, 29, 40
    x = gate_up(rows, 192, torch.bfloat16, seed=7)
    ids = torch.arange(rows, dtype=torch.int32, device=device())
    padding = torch.zeros(rows, dtype=torch.bool, device=device())
    padding[[0, 5, 6, 17, 28]] = True  # one in the first, second and last row block
    ids[padding] = num_pairs
    x[padding] = float("nan")
    x[17, 3], x[28, 200] = float("inf"), float("-inf")
    x[limit:] = float("nan")  # past the rows in use: never read
    x[11, 300] = float("nan")  # an up value of a real row
    empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.view(torch.uint8).fill_(0x7F).view(tensor.dtype) if tensor.element_size() == 1 \
            else tensor.fill_(-1.0)

    stats = torch.zeros(2, dtype=torch.int32, device=device())
    monkeypatch.setattr(torch, "empty", poisoned)
    q, scales = silu_mul_group_quant(x, fp8_dtype=FP8[fp8_name], stats=stats,
                                     rows_limit=torch.tensor([limit], dtype=torch.int32, device=device()),
                                     pair_ids=(ids, num_pairs))
    monkeypatch.undo()
    assert stats.tolist() == [0, 1]
    assert (q[limit:].view(torch.uint8) == 0x7F).all() and (scales[limit:] == -1.0).all()
    assert (q[:limit][padding[:limit]].view(torch.uint8) == 0).all()
    real = ~padding[:limit]
    real[11] = False  # its NaN group: checked below
    expected = silu_mul_group_quant_ref(x[:limit], fp8_dtype=FP8[fp8_name], padding=padding[:limit])
    assert_quantized_close((q[:limit][real], scales[:limit][real]), (expected[0][real], expected[1][real]), fp8_name)
    assert_close(scales[:limit][padding[:limit]], expected[1][padding[:limit]], atol=0, rtol=0, name="padding scales")
    assert torch.isnan(scales[11, 0]) and torch.isfinite(scales[11, 1])


@pytest.mark.parametrize("bad, message", [
    (dict(rows_limit=torch.tensor([3])), "rows_limit must be an int32 tensor of one element"),
    (dict(pair_ids=(torch.zeros(4, dtype=torch.int32), 2)), r"pair_ids\[0\] must be int32 \[2\]"),
    (dict(pair_ids=(torch.zeros(2, dtype=torch.int64), 2)), r"pair_ids\[0\] must be int32"),
])
def test_refuses_bad_row_selections(bad, message):
    bad = {k: (v.to(device()) if isinstance(v, torch.Tensor) else (v[0].to(device()), v[1])) for k, v in bad.items()}
    with pytest.raises(ValueError, match=message):
        silu_mul_group_quant(gate_up(2, 128, torch.bfloat16, seed=1), **bad)


@pytest.mark.parametrize("bad, message", [
    (lambda x: x[:, ::2], "contiguous last dim"),
    (lambda x: x[:, :255], "equal width, got 255 columns"),
    (lambda x: x.float(), "bf16 or fp16"),
    (lambda x: x[0], r"\[M, 2 \* D\] tensor"),
])
def test_refuses_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        silu_mul_group_quant(bad(gate_up(2, 128, torch.bfloat16, seed=1)))


def test_refuses_bad_formats():
    x = gate_up(2, 128, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="group_size=100"):
        silu_mul_group_quant(x, group_size=100)
    with pytest.raises(ValueError, match="fp8_dtype torch.int8"):
        silu_mul_group_quant(x, fp8_dtype=torch.int8)
