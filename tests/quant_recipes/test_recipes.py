"""Every recipe on tiny random DeepSeek-V3 and Qwen3-MoE checkpoints, run by llm-compressor on the
CPU, checked for the tensors and config the engines read; the known llm-compressor traps; input
errors. Runs in the ``quantize`` environment (llm-compressor 0.14).

With ``LATENTSPEED_QUANT_CHECKPOINTS`` set, the checkpoints are also written there for the engine
environment's tests (compressed-tensors 0.17 must read them: tests/vllm_plugin/test_recipe_checkpoints.py).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("llmcompressor")

from compressed_tensors.utils.match import match_name  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from quant_recipes import RECIPES  # noqa: E402
from quant_recipes.checkpoint import QuantizeError  # noqa: E402
from quant_recipes.native_fp8 import write_native_fp8  # noqa: E402
from quant_recipes.quantize import REPORT_NAME, quantize  # noqa: E402
from quant_recipes.verify import verify  # noqa: E402
from tests.quant_recipes.tiny_models import tiny_deepseek_v3, tiny_qwen3_moe  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

FP4_RECIPES = ("nvfp4", "nvfp4a16", "mxfp4")
MODELS = {"deepseek_v3": tiny_deepseek_v3, "qwen3_moe": tiny_qwen3_moe}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make(root / name) for name, make in MODELS.items()}


@pytest.fixture(scope="module")
def quantized(models, tmp_path_factory):
    """Each (model, recipe) quantized once, on demand."""
    root = tmp_path_factory.mktemp("quantized")
    done = {}

    def get(model: str, recipe: str) -> Path:
        if (model, recipe) not in done:
            out = root / f"{model}-{recipe}"
            quantize(models[model], recipe, out, num_samples=8, max_seq_len=64, log=lambda message: None)
            if shared := os.environ.get("LATENTSPEED_QUANT_CHECKPOINTS"):
                shutil.copytree(out, Path(shared) / out.name, dirs_exist_ok=True)
                shutil.copytree(models[model], Path(shared) / f"{model}-original", dirs_exist_ok=True)
            done[(model, recipe)] = out
        return done[(model, recipe)]

    return get


def tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                out[key] = (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape())
    return out


def scheme_of(names: dict, module: str) -> str:
    """How a module's weight is stored: 'bf16', 'fp8_block', 'nvfp4' or 'mxfp4'."""
    if f"{module}.weight_packed" in names:
        if f"{module}.weight_global_scale" in names:
            return "nvfp4"
        assert names[f"{module}.weight_scale"][0] == "U8", f"{module}: MXFP4 scales must be E8M0 bytes"
        return "mxfp4"
    dtype, _ = names[f"{module}.weight"]
    return {"F8_E4M3": "fp8_block", "BF16": "bf16"}[dtype]


EXPECTED = {  # recipe -> (attention, dense/shared MLP, routed experts)
    "fp8-block": ("fp8_block", "fp8_block", "fp8_block"),
    "fp8-block-kv": ("fp8_block", "fp8_block", "fp8_block"),
    "nvfp4": ("nvfp4", "nvfp4", "nvfp4"),
    "nvfp4a16": ("nvfp4", "nvfp4", "nvfp4"),
    "mxfp4": ("mxfp4", "mxfp4", "mxfp4"),
    "mixed": ("fp8_block", "fp8_block", "nvfp4"),
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", MODELS)
def test_recipe_writes_what_the_engines_read(quantized, model, recipe):
    out = quantized(model, recipe)
    names = tensors(out)
    attention, mlp, experts = EXPECTED[recipe]
    if model == "deepseek_v3":
        attention_layers = ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj"]
        dense_mlp = ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.down_proj"]
    else:
        attention_layers = ["q_proj", "k_proj", "v_proj", "o_proj"]
        dense_mlp = []
    for layer in attention_layers:
        assert scheme_of(names, f"model.layers.1.self_attn.{layer}") == attention, layer
    for module in dense_mlp:
        assert scheme_of(names, module) == mlp, module
    for expert in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert scheme_of(names, f"model.layers.1.mlp.experts.{expert}.{proj}") == experts
    assert names["lm_head.weight"][0] == "BF16" and names["model.layers.1.mlp.gate.weight"][0] == "BF16"
    if attention == "fp8_block":
        dtype, shape = names["model.layers.1.self_attn.o_proj.weight_scale"]
        assert shape == [2, 2], "one scale per 128 x 128 block of the 256 x 256 o_proj"

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["quantization_status"] == "compressed"
    assert "lm_head" in config["ignore"] and "model.layers.1.mlp.gate" in config["ignore"]
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["recipe"] == recipe and report["bytes_after"] < report["bytes_before"]
    assert report["layers"] and all(0 < layer["rel_error"] < 0.2 for layer in report["layers"].values())
    assert report["calibration"]["used"] == RECIPES[recipe].needs_data and len(report["calibration"]["sha256"]) == 64


@pytest.mark.parametrize("recipe", RECIPES)
def test_fused_qkv_a_pair_shares_a_scheme(quantized, recipe):
    """Trap: the usual regex ``re:.*self_attn\\..*_proj$`` does not match ``kv_a_proj_with_mqa`` (its
    name ends in ``_mqa``), llm-compressor leaves it bf16 without a word, and vLLM then refuses the
    fused ``q_a_proj`` + ``kv_a_proj_with_mqa`` layer for mixing schemes."""
    assert not match_name("model.layers.0.self_attn.kv_a_proj_with_mqa", r"re:.*self_attn\..*_proj$")
    names = tensors(quantized("deepseek_v3", recipe))
    for layer in (0, 1):
        q_a, kv_a = (scheme_of(names, f"model.layers.{layer}.self_attn.{p}") for p in ("q_a_proj", "kv_a_proj_with_mqa"))
        assert q_a == kv_a != "bf16"


@pytest.mark.parametrize("recipe", ["nvfp4", "mixed"])
def test_fused_pairs_share_their_global_scale(quantized, recipe):
    """gate/up (and q_a/kv_a) are one GEMM in the engines: NVFP4 needs one global scale for both."""
    path = quantized("deepseek_v3", recipe)
    with safe_open(next(path.glob("*.safetensors")), "pt") as f:
        def global_scale(module):
            return f.get_tensor(f"{module}.weight_global_scale")

        for expert in range(4):
            prefix = f"model.layers.1.mlp.experts.{expert}"
            assert torch.equal(global_scale(f"{prefix}.gate_proj"), global_scale(f"{prefix}.up_proj"))
        if recipe == "nvfp4":
            assert torch.equal(global_scale("model.layers.1.self_attn.q_a_proj"),
                               global_scale("model.layers.1.self_attn.kv_a_proj_with_mqa"))


@pytest.mark.parametrize("recipe", FP4_RECIPES)
def test_fp4_recipes_keep_kv_b_proj_for_mla_absorption(quantized, recipe):
    """Trap: the engines dequantize kv_b_proj by multiplying an identity through the layer; with
    4-bit activations that identity is rounded. The FP4 recipes keep kv_b_proj in bf16."""
    names = tensors(quantized("deepseek_v3", recipe))
    assert scheme_of(names, "model.layers.1.self_attn.kv_b_proj") == "bf16"


@pytest.mark.parametrize("recipe", RECIPES)
def test_4bit_weights_are_packed(quantized, recipe):
    """Trap: W4AFP8-style schemes save unpacked int8 weights (``int-quantized``) that vLLM cannot
    read; every 4-bit weight of ours is a packed ``weight_packed`` of two values per byte."""
    path = quantized("qwen3_moe", recipe)
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["format"] != "int-quantized"
    for name, (dtype, shape) in tensors(path).items():
        if name.endswith(".weight_packed"):
            assert dtype == "U8", name
        if name.endswith(".weight") and dtype in ("I8", "U8"):
            pytest.fail(f"{name} is stored unpacked as {dtype}")


def test_mla_kv_cache_scales_cover_the_latent_cache(quantized, models):
    """fp8-block-kv on an MLA model: k_scale/v_scale describe the latent cache (amax / 448)."""
    out = quantized("deepseek_v3", "fp8-block-kv")
    report = json.loads((out / REPORT_NAME).read_text())
    with safe_open(next(out.glob("*.safetensors")), "pt") as f:
        for layer, scale in report["latent_kv_scales"].items():
            assert f.get_tensor(f"{layer}.k_scale").float().item() == pytest.approx(scale, rel=1e-2)
            assert f.get_tensor(f"{layer}.v_scale").float().item() == pytest.approx(scale, rel=1e-2)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["num_bits"] == 8 and config["kv_cache_scheme"]["strategy"] == "tensor"


@pytest.fixture(scope="module")
def native(models, tmp_path_factory):
    """The tiny DeepSeek-V3 in DeepSeek-V3's own FP8 format (``latentspeed quantize native-fp8``)."""
    out = tmp_path_factory.mktemp("native") / "native-fp8"
    write_native_fp8(models["deepseek_v3"], out, log=lambda message: None)
    return out


def test_native_fp8_decodes_with_compressed_tensors(models, native, tmp_path):
    """compressed-tensors' own block-FP8 dequantizer reads the writer's layout back to the weights."""
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer, convert_checkpoint
    from safetensors.torch import load_file

    config = json.loads((native / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    names = tensors(native)
    assert names["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"][0] == "F8_E4M3"
    assert names["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == ("F32", [2, 2])  # 160 rows
    assert names["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"] == ("F32", [2, 2])
    for kept in ("model.layers.1.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert names[kept][0] == "BF16", kept
    decoded = tmp_path / "decoded"
    convert_checkpoint(native, decoded, converter=FP8BlockDequantizer(targets=[r"re:.*proj.*"]), device="cpu")
    original, back = load_file(models["deepseek_v3"] / "model.safetensors"), load_file(decoded / "model.safetensors")
    assert original.keys() == back.keys()
    for name, weight in original.items():
        if "_proj" in name:
            rel = ((back[name].float() - weight.float()).norm() / weight.float().norm()).item()
            assert rel < 0.04, f"{name}: {rel:.4f}"  # E4M3 keeps 3 mantissa bits: about 2% RMS
        else:
            assert torch.equal(back[name], weight), name


def test_native_fp8_checkpoint_is_dequantized_first(native, tmp_path):
    out = tmp_path / "requantized"
    quantize(native, "fp8-block", out, log=lambda message: None)
    names = tensors(out)
    assert scheme_of(names, "model.layers.1.self_attn.q_a_proj") == "fp8_block"
    assert not any(name.endswith("weight_scale_inv") for name in names)


def test_native_fp8_refuses_what_it_cannot_write(models, native, tmp_path):
    with pytest.raises(QuantizeError, match="already quantized"):
        write_native_fp8(native, tmp_path / "twice")
    with pytest.raises(QuantizeError, match="exists"):
        write_native_fp8(models["deepseek_v3"], native)
    broken = tmp_path / "broken"
    shutil.copytree(models["deepseek_v3"], broken)
    state = load_file(broken / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"][3, 5] = float("inf")
    save_file(state, broken / "model.safetensors")
    with pytest.raises(QuantizeError, match="model.layers.0.mlp.up_proj.weight has non-finite values"):
        write_native_fp8(broken, tmp_path / "out")


def test_verify_reports_layer_errors_and_kl(quantized, models):
    report = verify(quantized("deepseek_v3", "fp8-block"), models["deepseek_v3"], num_samples=2, max_seq_len=32,
                    log=lambda message: None)
    errors = report["layer_output_rel_error"]
    assert "model.layers.1.mlp.experts" in errors and "model.layers.0.self_attn.kv_a_proj_with_mqa" in errors
    assert all(0 < e < 0.1 for e in errors.values()), errors
    assert 0 <= report["kl_mean"] <= report["kl_max"] < 0.5 and report["tokens"] > 0


def test_verify_reads_native_fp8(native, models):
    report = verify(native, models["deepseek_v3"], num_samples=2, max_seq_len=32, log=lambda message: None)
    errors = report["layer_output_rel_error"]
    assert "model.layers.1.mlp.experts" in errors and "model.layers.0.self_attn.kv_a_proj_with_mqa" in errors
    assert all(0 < e < 0.1 for e in errors.values()), errors
    assert 0 <= report["kl_mean"] <= report["kl_max"] < 0.5 and report["tokens"] > 0
    with pytest.raises(QuantizeError, match="neither a compressed-tensors checkpoint nor DeepSeek-V3's native FP8"):
        verify(models["deepseek_v3"], models["deepseek_v3"], num_samples=1, log=lambda message: None)


def test_bad_inputs_are_named(models, tmp_path):
    model = models["deepseek_v3"]
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "exists").mkdir()
    llama = tmp_path / "llama"
    shutil.copytree(model, llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    cases = [
        (dict(model_dir=tmp_path, recipe_name="fp8-block"), "is not a checkpoint"),
        (dict(model_dir=model, recipe_name="int3"), "unknown recipe 'int3'"),
        (dict(model_dir=model, recipe_name="nvfp4", calib=tmp_path / "empty.jsonl"), "holds no text"),
        (dict(model_dir=model, recipe_name="nvfp4", calib=tmp_path / "latin1.txt"), "is not UTF-8"),
        (dict(model_dir=llama, recipe_name="fp8-block"), r"architecture \['LlamaForCausalLM'\] is not supported"),
    ]
    for kwargs, reason in cases:
        with pytest.raises(QuantizeError, match=reason):
            quantize(out_dir=tmp_path / "out", log=lambda message: None, **kwargs)
    with pytest.raises(QuantizeError, match="exists: choose another --out or pass --overwrite"):
        quantize(model, "fp8-block", tmp_path / "exists", log=lambda message: None)


def test_command_line(models, tmp_path, capsys):
    from latentspeed.cli import main

    assert main(["quantize", "--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in RECIPES)
    assert main(["quantize", "--model", str(models["qwen3_moe"]), "--recipe", "fp8-block"]) == 2
    assert "missing --out" in capsys.readouterr().err
    out = tmp_path / "cli"
    assert main(["quantize", "--model", str(models["qwen3_moe"]), "--recipe", "mxfp4", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "x float4 group32" in summary and "kept in bf16: 3 (" in summary  # two routers and lm_head
    # A separate process: llm-compressor's logger holds the stdout it found at import, which inside
    # pytest is pytest's; in a real run its lines must not reach the JSON on stdout.
    verify_run = subprocess.run(
        [sys.executable, "-m", "latentspeed", "quantize", "verify", "--model", str(out), "--reference",
         str(models["qwen3_moe"]), "--num-samples", "1", "--json"], capture_output=True, text=True, check=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))))
    assert json.loads(verify_run.stdout)["tokens"] > 0
    assert main(["quantize", "native-fp8", "--model", str(models["qwen3_moe"])]) == 2
    assert "native-fp8: missing --out" in capsys.readouterr().err
    assert main(["quantize", "native-fp8", "--model", str(models["qwen3_moe"]), "--out", str(tmp_path / "n")]) == 0
    assert "weights quantized" in capsys.readouterr().out
    assert tensors(tmp_path / "n")["model.layers.1.mlp.experts.0.up_proj.weight"][0] == "F8_E4M3"
