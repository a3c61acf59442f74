"""llm-compressor recipes that produce calibrated compressed-tensors checkpoints which vLLM and
SGLang load (with their own methods or with latentspeed's), and the code that runs and checks
them offline: ``latentspeed quantize`` (``quantize.py``) and ``latentspeed quantize verify``
(``verify.py``). They run in their own environment (``pip install 'latentspeed[quantize]'``):
llm-compressor pins a newer compressed-tensors than vLLM does.
"""

from dataclasses import dataclass
from pathlib import Path

RECIPE_DIR = Path(__file__).parent / "recipes"
DEFAULT_CALIBRATION = Path(__file__).parent / "data" / "calibration.jsonl"


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    summary: str
    needs_data: bool  # static activation or KV-cache scales are calibrated


RECIPES = {
    r.name: r
    for r in (
        Recipe("fp8-block", RECIPE_DIR / "fp8-block.yaml", "W8A8 FP8, 128 x 128 weight blocks, dynamic 1 x 128 activations", False),
        Recipe("fp8-block-kv", RECIPE_DIR / "fp8-block-kv.yaml", "fp8-block plus a calibrated FP8 KV cache (per-tensor k/v scales)", True),
        Recipe("nvfp4", RECIPE_DIR / "nvfp4.yaml", "W4A4 NVFP4: E2M1, groups of 16, E4M3 scales and a global scale", True),
        Recipe("nvfp4a16", RECIPE_DIR / "nvfp4a16.yaml", "weight-only NVFP4, bf16 activations", False),
        Recipe("mxfp4", RECIPE_DIR / "mxfp4.yaml", "weight-only MXFP4: E2M1, groups of 32, E8M0 scales", False),
        Recipe("mixed", RECIPE_DIR / "mixed.yaml", "attention and shared MLPs in block FP8, routed experts in NVFP4", True),
    )
}
