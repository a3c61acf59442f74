"""``latentspeed quantize``: run a recipe with llm-compressor, offline, and write a compressed-tensors
checkpoint plus ``latentspeed_report.json``.

Steps: check the inputs; dequantize a native FP8 (DeepSeek-V3) checkpoint to bf16 first (the
recipes start from full precision); load the model with transformers; tokenize the calibration
text when the recipe calibrates static scales; ``oneshot`` (every routed expert sees every
calibration token: ``moe_calibrate_all_experts``); for MLA models with an FP8 KV cache, replace
the per-head k/v scales by the latent cache's own; measure each layer's weight reconstruction
error; save.
"""

import json
import os
import shutil
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from . import DEFAULT_CALIBRATION, RECIPES
from .checkpoint import QuantizeError, checkpoint_bytes, is_native_fp8, read_calibration_texts, read_model_config

FP8_MAX = 448.0
REPORT_NAME = "latentspeed_report.json"


def quantize(model_dir, recipe_name: str, out_dir, calib=None, num_samples: int = 64, max_seq_len: int = 512,
             device: str = "cpu", overwrite: bool = False, log=print) -> dict:
    """Quantize ``model_dir`` with recipe ``recipe_name`` into ``out_dir``; returns the report."""
    if recipe_name not in RECIPES:
        raise QuantizeError(f"unknown recipe {recipe_name!r}: one of {', '.join(RECIPES)} (latentspeed quantize --list)")
    recipe = RECIPES[recipe_name]
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise QuantizeError(f"{out} exists: choose another --out or pass --overwrite")
    if num_samples < 1 or max_seq_len < 8:
        raise QuantizeError(f"--num-samples must be >= 1 and --max-seq-len >= 8, got {num_samples} and {max_seq_len}")
    config = read_model_config(model_dir)
    texts, digest = read_calibration_texts(calib or DEFAULT_CALIBRATION)
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # llm-compressor takes any accelerator it sees
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(model_dir)
        if is_native_fp8(config):
            log(f"[1/5] {source} is native FP8: dequantizing to bf16 first")
            source = _dequantize_fp8(source, Path(tmp) / "bf16")
        log(f"[2/5] loading {source}")
        tokenizer = _tokenizer(Path(model_dir), required=recipe.needs_data)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        dataset = _calibration_set(texts, tokenizer, num_samples, max_seq_len) if recipe.needs_data else None
        log(f"[3/5] oneshot {recipe.name} ({recipe.summary})"
            + (f" on {len(dataset)} calibration samples" if dataset is not None else ", data-free"))
        oneshot(model=model, recipe=str(recipe.path), dataset=dataset, processor=tokenizer,
                num_calibration_samples=num_samples, max_seq_length=max_seq_len, moe_calibrate_all_experts=True)
        kv_scales = None
        if recipe.name.endswith("-kv") and config.get("kv_lora_rank"):
            log("[4/5] MLA: k/v scales from the latent cache's range over the calibration set")
            kv_scales = _set_latent_cache_scales(model, dataset)
        layers, kept = _layer_report(model)
        log(f"[5/5] saving {out}")
        if out.exists():
            shutil.rmtree(out)
        model.save_pretrained(out, save_compressed=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        if (Path(model_dir) / "generation_config.json").exists():
            shutil.copy(Path(model_dir) / "generation_config.json", out / "generation_config.json")
    report = {
        "recipe": recipe.name,
        "recipe_file": recipe.path.name,
        "model": str(model_dir),
        "versions": {name: version(name) for name in ("latentspeed", "llmcompressor", "compressed-tensors",
                                                      "transformers", "torch")},
        "calibration": {"file": str(calib or DEFAULT_CALIBRATION), "sha256": digest,
                        "samples": len(dataset) if dataset is not None else 0, "max_seq_len": max_seq_len,
                        "used": dataset is not None},
        "layers": layers,
        "kept_bf16": kept,
        "latent_kv_scales": kv_scales,
        "bytes_before": checkpoint_bytes(model_dir),
        "bytes_after": checkpoint_bytes(out),
        "seconds": round(time.perf_counter() - started, 2),
    }
    (out / REPORT_NAME).write_text(json.dumps(report, indent=1))
    return report


def _dequantize_fp8(source: Path, target: Path) -> Path:
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer, convert_checkpoint

    convert_checkpoint(source, target, converter=FP8BlockDequantizer(targets=[r"re:.*proj.*"]), device="cpu")
    return target


def _tokenizer(model_dir: Path, required: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as err:
        if required:
            raise QuantizeError(f"{model_dir} has no usable tokenizer, which this recipe needs to tokenize the "
                                f"calibration text ({type(err).__name__}: {err})") from err
        return None


def _calibration_set(texts, tokenizer, num_samples: int, max_seq_len: int):
    from datasets import Dataset

    rows = []
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=max_seq_len)["input_ids"]
        if len(ids) >= 2:
            rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
        if len(rows) == num_samples:
            break
    if not rows:
        raise QuantizeError("the calibration text tokenizes to nothing usable")
    return Dataset.from_list(rows)


def _describe(args) -> str:
    """``'float8 block[128, 128]'``-style label of weight quantization args."""
    strategy, kind = (getattr(v, "value", v) for v in (args.strategy, args.type))
    detail = {"block": f"block{list(args.block_structure or [])}", "group": f"group{args.group_size}",
              "tensor_group": f"group{args.group_size}+global"}.get(strategy, strategy)
    return f"{kind}{args.num_bits} {detail}"


def _layer_report(model) -> tuple[dict, list[str]]:
    """Per quantized layer: its weight scheme and the relative error ``|W - Q(W)| / |W|``; and the
    linear layers and routers left in bf16."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    layers, kept = {}, []
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and scheme.weights is not None and hasattr(module, "weight"):
            weight = module.weight.detach().float()
            with torch.no_grad():
                quantized = forward_quantize(module, module.weight.detach(), "weight", scheme.weights).float()
            error = ((weight - quantized).norm() / weight.norm().clamp_min(1e-30)).item()
            layers[name] = {"scheme": _describe(scheme.weights), "rel_error": round(error, 6)}
        elif isinstance(module, torch.nn.Linear) or name.endswith("mlp.gate"):
            kept.append(name)
    return layers, kept


def _set_latent_cache_scales(model, dataset) -> dict:
    """MLA engines cache ``[kv_c_normed | k_pe]`` per token under one k/v scale per layer: set each
    layer's ``k_scale``/``v_scale`` to that cache's largest magnitude over the calibration set / 448.
    ``k_pe`` is bounded before its rotation by the norm of each rotated pair (both pairings)."""
    import torch

    amax: dict[str, float] = {}

    def track(name, value):
        amax[name] = max(amax.get(name, 0.0), float(value))

    hooks = []
    for name, module in model.named_modules():
        if name.endswith("self_attn.kv_a_layernorm"):
            layer = name.rsplit(".", 1)[0]
            hooks.append(module.register_forward_hook(lambda m, i, o, layer=layer: track(layer, o.float().abs().amax())))
        elif name.endswith("self_attn.kv_a_proj_with_mqa"):
            layer = name.rsplit(".", 1)[0]
            rope = model.config.qk_rope_head_dim

            def rope_bound(m, i, o, layer=layer, rope=rope):
                k_pe = o[..., -rope:].float()
                halves = torch.stack([k_pe[..., : rope // 2], k_pe[..., rope // 2:]]).norm(dim=0).amax()
                pairs = k_pe.view(*k_pe.shape[:-1], rope // 2, 2).norm(dim=-1).amax()
                track(layer, torch.maximum(halves, pairs))

            hooks.append(module.register_forward_hook(rope_bound))
    try:
        with torch.no_grad():
            for row in dataset:
                model(input_ids=torch.tensor([row["input_ids"]], device=model.device))
    finally:
        for hook in hooks:
            hook.remove()
    scales = {}
    for layer, value in amax.items():
        attention = model.get_submodule(layer)
        scale = max(value, 1e-12) / FP8_MAX
        for attr in ("k_scale", "v_scale"):
            getattr(attention, attr).data.fill_(scale)
        scales[layer] = scale
    return scales
