"""The two OCP fp8 formats the kernels write.

Kernels clamp fp32 values to the format's range and cast: Hopper's cast (``cvt.rn.satfinite``)
rounds to the nearest fp8 value, ties to even, subnormals included, as torch's does. Triton's CPU
interpreter is patched to round the same way (``common_kernels._interpreter``).
"""

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_finite_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an fp8 dtype: float8_e4m3fn or float8_e5m2 is")
    return torch.finfo(dtype).max

