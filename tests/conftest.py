"""Kernel tests run on the CPU through Triton's interpreter unless a GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before common_kernels (and its @triton.jit functions) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
