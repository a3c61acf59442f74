"""``latentspeed quantize verify``: a quantized checkpoint against its bf16 reference, on the CPU.

compressed-tensors dequantizes the checkpoint (its own format or DeepSeek-V3's native FP8) back to bf16 tensors (transformers cannot load
per-expert quantized tensors into its fused expert modules); both models then run the same
calibration text in transformers. Reported: each linear layer's (and each expert block's)
output error ``|y_q - y_ref| / |y_ref|`` on the reference's inputs to that layer, and the KL
divergence of the next-token distributions, ``KL(reference || quantized)`` per token.
"""

import tempfile
from pathlib import Path

from . import DEFAULT_CALIBRATION
from .checkpoint import QuantizeError, read_calibration_texts, read_config, read_model_config


def verify(model_dir, reference_dir, calib=None, num_samples: int = 8, max_seq_len: int = 256, log=print) -> dict:
    import torch
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converter = _dequantizer(model_dir, read_config(model_dir).get("quantization_config") or {})
    read_model_config(reference_dir)
    texts, _ = read_calibration_texts(calib or DEFAULT_CALIBRATION)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError):
        tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    with tempfile.TemporaryDirectory() as tmp:
        log(f"dequantizing {model_dir} with compressed-tensors")
        convert_checkpoint(model_dir, tmp, converter=converter, device="cpu")
        quantized = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).eval()
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.bfloat16).eval()
    errors: dict[str, list[float]] = {}
    kls = []
    quantized_modules = dict(quantized.named_modules())

    def compare(name):
        def hook(module, args, kwargs, output):
            with torch.no_grad():
                other = quantized_modules[name](*args, **kwargs).float()
            errors.setdefault(name, []).append(((other - output.float()).norm() / output.float().norm().clamp_min(1e-30)).item())
        return hook

    hooks = [module.register_forward_hook(compare(name), with_kwargs=True)
             for name, module in reference.named_modules() if _tracked(name, module)]
    try:
        for text in texts[:num_samples]:
            ids = tokenizer(text, truncation=True, max_length=max_seq_len, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                ref_logp = torch.log_softmax(reference(input_ids=ids).logits.float(), -1)
                q_logp = torch.log_softmax(quantized(input_ids=ids).logits.float(), -1)
            kls.append((ref_logp.exp() * (ref_logp - q_logp)).sum(-1).flatten())
    finally:
        for hook in hooks:
            hook.remove()
    kl = torch.cat(kls)
    layers = {name: round(sum(v) / len(v), 6) for name, v in errors.items()}
    return {"model": str(model_dir), "reference": str(reference_dir), "tokens": int(kl.numel()),
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item(), "layer_output_rel_error": layers}


def _dequantizer(model_dir, quant_config: dict):
    """compressed-tensors' converter back to bf16 for this checkpoint's format: its own
    (``quant_method: compressed-tensors``) or DeepSeek-V3's native block FP8 (``quant_method: fp8``,
    as ``latentspeed quantize native-fp8`` writes it)."""
    method = quant_config.get("quant_method")
    if method == "compressed-tensors":
        return _weight_dequantizer(model_dir)
    if method == "fp8" and quant_config.get("weight_block_size") == [128, 128]:
        from compressed_tensors.entrypoints.convert import FP8BlockDequantizer

        return FP8BlockDequantizer(targets=[r"re:.*_proj.*"])
    raise QuantizeError(f"{model_dir} is neither a compressed-tensors checkpoint nor DeepSeek-V3's native FP8 "
                        f"with 128 x 128 blocks (quantization_config: {quant_config or 'none'})")


def _weight_dequantizer(model_dir):
    """compressed-tensors' dequantizer with two corrections. Activation scales (``input_global_scale``
    and the like) describe no weight, and it would report them as orphans: they are dropped. A group
    that targets the class ``Linear`` names no tensor, and the converter, which sees names only,
    would take every ``.weight`` (embeddings too) for a quantized one: only weights stored with a
    ``weight_scale`` are dequantized, the others pass through."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors import safe_open

    stored = set()
    for shard in Path(model_dir).glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            stored.update(f.keys())

    class WeightDequantizer(CompressedTensorsDequantizer):
        def get_dependencies(self, weight_name):
            dependencies = super().get_dependencies(weight_name)
            return dependencies if dependencies <= stored else set()

        def process(self, tensors):
            plain = {name: tensors.pop(name) for name in list(tensors)
                     if name.endswith(".weight") and f"{name}_scale" not in stored}
            tensors = {**super().process(tensors), **plain}
            return {name: t for name, t in tensors.items() if not name.rpartition(".")[-1].startswith("input_")}

    return WeightDequantizer(model_dir)


def _tracked(name: str, module) -> bool:
    import torch

    return (isinstance(module, torch.nn.Linear) and name != "lm_head") or name.endswith("mlp.experts")
