"""Writing the tables ``common_kernels.fp8.gemm.tuned_table`` reads (the tuners share it)."""

import json
import os
import time
from pathlib import Path

import torch
import triton


def write_tuned_table(out: str, configs: dict, started: float) -> None:
    """``configs`` with the GPU, versions and seconds since ``started``, replacing ``out`` atomically:
    rewritten as entries come, a cut-short run keeps what it tuned and readers never see half a file."""
    partial = Path(f"{out}.partial")
    partial.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                   "triton": triton.__version__, "seconds": round(time.perf_counter() - started),
                                   "configs": configs}, indent=1))
    os.replace(partial, out)


def starting_configs(update: str | None) -> dict:
    """The configs a tuning run starts from: those of the table ``update`` names (its entries that the
    run does not tune are kept as they are), or none."""
    if update is None:
        return {}
    return json.loads(Path(update).read_text())["configs"]
