"""Shared test helpers: one assert_close for every kernel test, the check of a fused producer's
quantized output, and the named batch scenarios used by kernel and adapter tests alike."""

from dataclasses import dataclass

import torch

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_ULP = {"e4m3": 2.0**-3, "e5m2": 2.0**-2}  # relative spacing of the fp8 grid


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def fp8_flip_bound(q_nope: torch.Tensor, fp8_probs: bool) -> torch.Tensor | None:
    """``mla_decode_ref``'s ``flip_bound`` buffer for decode outputs of an fp8 ``P V``
    (``DecodePlan.fp8_probs``), to pass on as ``assert_close``'s ``slack``; None without it."""
    return torch.zeros(q_nope.shape, dtype=torch.float32, device=q_nope.device) if fp8_probs else None


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, name: str = "",
                 outliers: float = 0.0, outlier_tol: float = 0.0, slack: torch.Tensor | None = None) -> None:
    """Elementwise ``|a - e| <= atol + rtol * |e| (+ slack)`` with equal NaN/Inf placement; ``slack``
    (the shape of ``expected``) adds deviations the reference explains, such as
    ``mla_decode_ref``'s ``flip_bound``. With ``outliers``,
    that fraction of the elements (rounded down) may exceed the tolerance, but none beyond
    ``outlier_tol`` (absolute and relative, required then), and NaN/Inf placement never.

    On failure the message gives the max abs error and where, the relative RMS error and where
    non-finite values disagree, so a failure says what went wrong without a debugger.
    """
    actual = actual.detach().float().cpu()
    expected = expected.detach().float().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    inf_a, inf_e = torch.isinf(actual), torch.isinf(expected)
    bad_place = (nan_a != nan_e) | (inf_a != inf_e) | (inf_a & inf_e & (actual.sign() != expected.sign()))
    finite = torch.isfinite(actual) & torch.isfinite(expected)
    diff = (actual - expected).abs().where(finite, actual.new_zeros(()))
    limit = atol + rtol * expected.abs().where(finite, actual.new_zeros(()))
    if slack is not None:
        limit = limit + slack.detach().float().cpu()
    over = diff > limit
    if outliers:
        assert outlier_tol > 0, "outliers need an outlier_tol that bounds them"
        far = diff > outlier_tol * (1 + expected.abs().where(finite, actual.new_zeros(())))
        assert not far.any(), (f"{name}: {int(far.sum())} elements beyond the outliers' bound {outlier_tol}; "
                               f"max abs err {diff.max().item():.3e}")
    if bad_place.any() or int(over.sum()) > int(outliers * over.numel()):
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
        ref_rms = expected.where(finite, actual.new_zeros(())).pow(2).mean().sqrt()
        rel_rms = (diff.pow(2).mean().sqrt() / ref_rms.clamp_min(1e-30)).item()
        first_bad = bad_place.nonzero()[:5].tolist()
        raise AssertionError(
            f"{name}: {int(over.sum())} of {over.numel()} elements beyond atol={atol}, rtol={rtol}"
            f"{' + slack' if slack is not None else ''} "
            f"({int(outliers * over.numel())} allowed); "
            f"max abs err {diff.max().item():.3e} at {idx} (actual {actual[idx].item():.4g}, "
            f"expected {expected[idx].item():.4g}); rel RMS err {rel_rms:.3e}; "
            f"NaN/Inf placement differs at {int(bad_place.sum())} elements, first {first_bad}"
        )


@dataclass(frozen=True)
class BatchSpec:
    """One batch of requests: cache lengths (query tokens included) and query tokens per request."""

    name: str
    seq_lens: tuple[int, ...]
    q_len: int = 1


BATCH_SPECS = {
    spec.name: spec
    for spec in (
        BatchSpec("pure_decode", (33, 7, 64, 129)),
        BatchSpec("single_long", (517,)),
        BatchSpec("ragged_with_empty", (0, 45, 1, 96, 0)),
        BatchSpec("last_page_half_full", (24, 56)),
        BatchSpec("spec_decode_2", (40, 3, 77), q_len=2),
        BatchSpec("spec_decode_4", (66, 4), q_len=4),
    )
}


def assert_quantized_close(got, expected, fp8_name, group_size=128):
    """Fused producer + group quantization ``(q, scales)`` against its reference: scales within one
    bf16 step, values within one fp8 step, and almost all codes the same (the kernel's fp32
    arithmetic may round differently from torch's and move a value across a boundary)."""
    (q, scales), (q_ref, scales_ref) = got, expected
    assert_close(scales, scales_ref, atol=0, rtol=2.0**-7, name="scales")
    cols = q.shape[1]
    dequant = q.float() * scales.repeat_interleave(group_size, 1)[:, :cols]
    dequant_ref = q_ref.float() * scales_ref.repeat_interleave(group_size, 1)[:, :cols]
    assert_close(dequant, dequant_ref, atol=1e-6, rtol=FP8_ULP[fp8_name] * 1.01, name="dequantized values")
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.99, f"only {same:.3f} of the fp8 codes match the reference"
