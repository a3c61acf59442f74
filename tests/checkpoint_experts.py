"""Layer 1's routed experts of a checkpoint, fed through an engine's MoE weight loader, and the
loaded layer's output against latentspeed's fused-MoE reference: shared by both engines'
recipe-checkpoint tests."""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from common_kernels.fp8.reference import fused_moe_fp8_ref
from tests.helpers import assert_close

PREFIX = "model.layers.1.mlp.experts"
SHARDS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_shape(checkpoint: Path) -> tuple[dict, int, int]:
    """The checkpoint's model config, its number of routed experts and its top-k."""
    model = json.loads((checkpoint / "config.json").read_text())
    experts = next(model[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in model)
    return model, experts, model["num_experts_per_tok"]


def load_experts(checkpoint: Path, experts: int, load: Callable[[str, torch.Tensor, str, int], None]) -> dict:
    """Call ``load(param_name, tensor, shard, expert)`` for every expert's gate (w1), up (w3) and
    down (w2) weight and ``weight_scale``; returns the tensors by (expert, shard, kind)."""
    stored = {}
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        for e in range(experts):
            for shard, proj in SHARDS.items():
                for kind in ("weight", "weight_scale"):
                    value = stored[e, shard, kind] = f.get_tensor(f"{PREFIX}.{e}.{proj}.{kind}")
                    load(f"{'w2' if shard == 'w2' else 'w13'}_{kind}", value, shard, e)
    return stored


def assert_experts_match_reference(run: Callable, stored: dict, hidden: int, experts: int, top_k: int) -> None:
    """``run(x, topk_weights, topk_ids)`` of the loaded layer against ``fused_moe_fp8_ref`` over the
    stored experts, on 7 random tokens."""
    x = torch.randn(7, hidden, dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(7, experts), -1).topk(top_k, dim=-1)
    out = run(x, weights, ids.to(torch.int32))

    def stacked(shards, kind):
        return torch.stack([torch.cat([stored[e, shard, kind] for shard in shards]) for e in range(experts)])

    expected = fused_moe_fp8_ref(x, stacked(("w1", "w3"), "weight"), stacked(("w1", "w3"), "weight_scale").float(),
                                 stacked(("w2",), "weight"), stacked(("w2",), "weight_scale").float(), weights, ids)
    assert_close(out, expected, atol=2e-2, rtol=2e-2, name="experts out")
