"""A bf16 checkpoint rewritten in DeepSeek-V3's own FP8 format, without calibration or llm-compressor.

``latentspeed quantize native-fp8 --model DIR --out DIR``: every 2-D projection weight (attention,
dense MLP, shared and routed experts) becomes E4M3 with one fp32 ``weight_scale_inv`` per 128 x 128
block (dequantized weight = fp8 value x scale, the edge blocks partial), and ``config.json`` gets
``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``, the layout
that vLLM's and SGLang's built-in ``fp8`` and latentspeed's ``latentspeed_fp8`` load. Embeddings,
norms, the router and ``lm_head`` stay as they are, as in DeepSeek-V3's release. The shards keep
their names; other files (tokenizer, generation config, held-out text) are copied.

The blocks are quantized by the PyTorch reference of ``common_kernels.fp8`` (the same contract as
its Triton kernel), on the CPU: a one-off conversion, sized for checkpoints that fit in memory shard
by shard.
"""

import json
import shutil
import time
from pathlib import Path

from .checkpoint import QuantizeError, checkpoint_bytes, read_model_config

BLOCK = 128
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}


def is_quantized(name: str, tensor) -> bool:
    """A projection's weight (``kv_a_proj_with_mqa`` included): what DeepSeek-V3's release stores in FP8."""
    return "_proj" in name and name.endswith(".weight") and tensor.dim() == 2


def write_native_fp8(model_dir: str | Path, out_dir: str | Path, overwrite: bool = False, log=print) -> dict:
    """Write ``out_dir``; return a summary (tensors quantized and kept, bytes before and after)."""
    import torch
    from safetensors.torch import load_file, save_file

    from common_kernels.fp8.reference import quantize_weight_blocks_ref

    source, out = Path(model_dir), Path(out_dir)
    config = read_model_config(source)
    if config.get("quantization_config"):
        raise QuantizeError(f"{source} is already quantized ({config['quantization_config'].get('quant_method')})")
    if out.exists() and not overwrite:
        raise QuantizeError(f"{out} exists: choose another --out or pass --overwrite")
    started = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    quantized, kept, weight_map, total_size = [], [], {}, 0
    for shard in sorted(source.glob("*.safetensors")):
        state = load_file(shard)
        fused = [n for n, t in state.items() if "_proj" in n and not n.endswith("bias") and t.dim() != 2]
        if fused:
            raise QuantizeError(f"{shard.name}: {fused[0]} is {state[fused[0]].dim()}-D; the native FP8 format "
                                "has one 2-D weight per projection (and per expert)")
        for name in [n for n, t in state.items() if is_quantized(n, t)]:
            weight = state[name].float()
            if not torch.isfinite(weight).all():
                raise QuantizeError(f"{shard.name}: {name} has non-finite values; an FP8 copy would be garbage")
            state[name], state[name.removesuffix("weight") + "weight_scale_inv"] = quantize_weight_blocks_ref(weight)
            quantized.append(name)
        kept += [n for n in state if n not in quantized and not n.endswith("weight_scale_inv")]
        weight_map.update(dict.fromkeys(state, shard.name))
        total_size += sum(t.numel() * t.element_size() for t in state.values())
        save_file(state, out / shard.name, metadata={"format": "pt"})
        log(f"{shard.name}: {len(state)} tensors written")
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, out / path.name)
    if (source / "model.safetensors.index.json").exists():
        index = json.loads((source / "model.safetensors.index.json").read_text())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {**index.get("metadata", {}), "total_size": total_size}, "weight_map": weight_map}, indent=1))
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return {"model": str(source), "out": str(out), "quantized": len(quantized), "kept": sorted(kept),
            "bytes_before": checkpoint_bytes(source), "bytes_after": checkpoint_bytes(out),
            "seconds": time.perf_counter() - started}
