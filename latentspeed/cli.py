"""The ``latentspeed`` command.

    latentspeed info [--json]   versions, GPU, and which latentspeed components are usable here
    latentspeed eval ...        perplexity of a text through vLLM or SGLang with latentspeed's
                                options, and agreement with the engine's bf16 defaults
    latentspeed quantize ...    calibrated compressed-tensors checkpoints from llm-compressor
                                recipes (``--list``), and ``quantize verify`` against the original
    latentspeed demo            on a GPU with vLLM: the tiny DeepSeek-V3 through vLLM with
                                latentspeed and with FLASHMLA, side by side; without a GPU: one
                                decode step through the kernels (Triton interpreter) against
                                the PyTorch reference
"""

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from . import quantize_cli

DEEPSEEK_V3_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"available": False}
    major, minor = torch.cuda.get_device_capability(0)
    return {"available": True, "name": torch.cuda.get_device_name(0), "capability": f"{major}.{minor}"}


def _vllm_components(gpu: dict) -> list[dict]:
    """Whether each vLLM-facing component registers and, on this GPU, covers DeepSeek-V3."""
    import torch

    from common_kernels.mla import is_supported

    rows = []
    if _version("vllm") is None:
        reason = "vLLM is not installed (pip install vllm==0.26.0)"
        return [{"component": name, "usable": False, "why": reason} for name in ("vllm MLA decode", "vllm MLA prefill")]
    try:
        import vllm_plugin

        vllm_plugin.register()
        from vllm.v1.attention.backends.mla.prefill import MLAPrefillBackendEnum
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        registered = {
            "vllm MLA decode": AttentionBackendEnum.CUSTOM.get_path() == vllm_plugin.BACKEND_PATH,
            "vllm MLA prefill": MLAPrefillBackendEnum.CUSTOM.get_path() == vllm_plugin.PREFILL_PATH,
        }
    except Exception as err:  # report, never crash: this command diagnoses broken installs
        return [{"component": n, "usable": False, "why": f"{type(err).__name__}: {err}"} for n in ("vllm MLA decode", "vllm MLA prefill")]
    capability = tuple(int(x) for x in gpu["capability"].split(".")) if gpu["available"] else None
    for name, ok_registered in registered.items():
        if not ok_registered:
            rows.append({"component": name, "usable": False, "why": "another plugin took the CUSTOM slot"})
            continue
        for cache_name, cache_dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
            if name.endswith("prefill") and cache_name != "bf16":
                continue
            ok, why = is_supported(
                num_heads=128, dtype=torch.bfloat16, cache_dtype=cache_dtype, capability=capability, **DEEPSEEK_V3_MLA
            )
            if ok and capability is None:
                ok, why = False, "registered; no GPU here to run it"
            label = name if name.endswith("prefill") else f"{name} ({cache_name} cache)"
            rows.append({"component": label, "usable": ok, "why": why or "DeepSeek-V3 MLA shapes supported"})
    rows.append(_vllm_fp8_method(capability))
    return rows


def _vllm_fp8_method(capability) -> dict:
    from vllm.model_executor.layers.quantization import get_quantization_config

    from vllm_plugin.fp8 import NAME, LatentspeedFp8Config

    return _fp8_method_row(f"vllm --quantization {NAME}", get_quantization_config(NAME) is LatentspeedFp8Config,
                           capability)


def _fp8_method_row(component: str, registered: bool, capability) -> dict:
    from common_kernels.fp8 import SCALE_BLOCK
    from common_kernels.fp8 import is_supported as fp8_supported

    if not registered:
        return {"component": component, "usable": False, "why": "another plugin registered the name"}
    ok, why = fp8_supported(weight_block=(SCALE_BLOCK, SCALE_BLOCK), activation_group=SCALE_BLOCK, capability=capability)
    if ok and capability is None:
        ok, why = False, "registered; no GPU here to run it"
    return {"component": component, "usable": ok, "why": why or "block FP8 (128 x 128) linear layers"}


def _sglang_components(gpu: dict) -> list[dict]:
    """Whether ``--attention-backend latentspeed`` registers in SGLang and covers DeepSeek-V3 here."""
    import torch

    from common_kernels.mla import is_supported

    name = "sglang attention backend"
    if _version("sglang") is None:
        return [{"component": name, "usable": False, "why": "SGLang is not installed (pip install sglang==0.5.17)"}]
    try:
        import sglang_plugin

        sglang_plugin.register()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    except Exception as err:  # report, never crash: this command diagnoses broken installs
        return [{"component": name, "usable": False, "why": f"{type(err).__name__}: {err}"}]
    if ATTENTION_BACKENDS.get(sglang_plugin.BACKEND_NAME) is not sglang_plugin.create_backend:
        return [{"component": name, "usable": False, "why": "another plugin took the name latentspeed"}]
    capability = tuple(int(x) for x in gpu["capability"].split(".")) if gpu["available"] else None
    ok, why = is_supported(num_heads=128, dtype=torch.bfloat16, cache_dtype=torch.bfloat16, capability=capability,
                           block_size=64, **DEEPSEEK_V3_MLA)
    if ok and capability is None:
        ok, why = False, "registered; no GPU here to run it"
    rows = [{"component": name, "usable": ok, "why": why or "DeepSeek-V3 MLA shapes supported (--page-size 16/32/64)"}]
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    from sglang_plugin.fp8 import NAME, LatentspeedFp8Config

    rows.append(_fp8_method_row(f"sglang --quantization {NAME}", QUANTIZATION_METHODS.get(NAME) is LatentspeedFp8Config,
                                capability))
    return rows


def _decode_kernel(gpu: dict) -> str:
    """Which MLA decode kernel runs here, and why."""
    import torch

    from common_kernels.mla import decode_sm90_narrow, decode_sm90_seesaw, sm90_common
    from common_kernels.mla.decode import sm90_kernel_enabled

    if not gpu["available"]:
        return "Triton (no GPU: the interpreter, with TRITON_INTERPRET=1)"
    if sm90_kernel_enabled(torch.device("cuda", 0)):
        def pv(module) -> str:
            return ("P V in fp8 over E4M3" if module.fp8_pv(torch.float8_e4m3fn)
                    else f"P V in fp16, {sm90_common.FP8_PV_ENV}=0")

        tiles = ("fp8 tiles by TMA" if os.environ.get(decode_sm90_narrow.TMA_ENV, "1") != "0"
                 else f"cp.async tiles, {decode_sm90_narrow.TMA_ENV}=0")
        return (f"Gluon sm_90 kernels over paged caches with 64-token pages (decode_sm90_seesaw for 64-row groups: "
                f"{pv(decode_sm90_seesaw)}; decode_sm90_narrow for 16 and 32: {tiles}, {pv(decode_sm90_narrow)}), "
                "Triton for the rest")
    if gpu["capability"] == "9.0":
        return "Triton (LATENTSPEED_MLA_DECODE_SM90=0)"
    return f"Triton (the Gluon kernel needs sm_90; this GPU is sm_{gpu['capability'].replace('.', '')})"


def _fp8_tables(gpu: dict) -> dict:
    """For the FP8 GEMM and MoE, the tuned launch table read on this GPU, or why the defaults run."""
    from common_kernels.fp8.gemm import tuned_table, tuned_table_path

    if not gpu["available"]:
        return {kind: "no GPU: the interpreter's launches" for kind in ("gemm", "moe")}
    report = {}
    for kind in ("gemm", "moe"):
        path = tuned_table_path(kind, gpu["name"])
        if path.is_file():
            shapes = tuned_table(kind, gpu["name"])
            tuned = f"{len(shapes)} shape{'' if len(shapes) == 1 else 's'} tuned"
            report[kind] = f"{path} ({tuned}; others run the untuned defaults)"
        else:
            report[kind] = (f"no table for {gpu['name']} ({path.name}): untuned defaults; python -m "
                            f"benchmarks.tune_fp8_{kind} --out FILE, then LATENTSPEED_FP8_{kind.upper()}_CONFIGS=FILE")
    return report


def info(as_json: bool) -> int:
    import torch

    report = {
        "versions": {d: _version(d) for d in ("latentspeed", "vllm", "sglang", "torch", "triton")},
        "gpu": _gpu(),
        "fp8_guard": os.environ.get("LATENTSPEED_FP8_GUARD", "warn"),
    }
    report["mla_decode_kernel"] = _decode_kernel(report["gpu"])
    report["fp8_tables"] = _fp8_tables(report["gpu"])
    report["components"] = _vllm_components(report["gpu"]) + _sglang_components(report["gpu"])
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print("versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in report["versions"].items()))
    gpu = report["gpu"]
    print(f"gpu: {gpu['name']} (compute capability {gpu['capability']})" if gpu["available"] else "gpu: none")
    print(f"torch sees CUDA: {torch.cuda.is_available()}; fp8 guard: {report['fp8_guard']}")
    print(f"MLA decode kernel: {report['mla_decode_kernel']}")
    for kind, table in report["fp8_tables"].items():
        print(f"fp8 {kind} launch table: {table}")
    width = max(len(c["component"]) for c in report["components"])
    for c in report["components"]:
        print(f"  {c['component']:<{width}}  {'usable' if c['usable'] else 'NOT usable'}: {c['why']}")
    return 0


def demo() -> int:
    """The main job: see the module docstring."""
    import torch

    if torch.cuda.is_available() and _version("vllm"):
        script = Path.cwd() / "tests" / "gpu" / "vllm_e2e.py"
        if not script.exists():
            print("latentspeed demo: run it from a latentspeed checkout (tests/gpu/vllm_e2e.py is needed)")
            return 2
        return subprocess.call([sys.executable, str(script), "--group", "bf16", "--throughput", "--out", "latentspeed-demo.json"])
    print("No GPU with vLLM here: running one MLA decode step through the Triton kernels in interpreter mode")
    os.environ["TRITON_INTERPRET"] = "1"
    return subprocess.call([sys.executable, "-c", _INTERPRETED_DECODE_STEP])


# Runs in a fresh interpreter: TRITON_INTERPRET must be set before Triton kernels are defined.
_INTERPRETED_DECODE_STEP = r"""
import torch
from common_kernels.mla import mla_decode, plan_decode, write_latent_cache
from common_kernels.mla.reference import mla_decode_ref

torch.manual_seed(0)
heads, d_latent, d_rope, page, seq_lens = 16, 512, 64, 64, [300, 77]
scale = (128 + d_rope) ** -0.5
print(f"DeepSeek-V3 MLA sizes: {heads} heads, latent {d_latent} + rope {d_rope}, page {page}, contexts {seq_lens}")
for name, dtype in (("bf16", torch.bfloat16), ("fp8 E4M3", torch.float8_e4m3fn), ("fp8 E5M2", torch.float8_e5m2)):
    cache = torch.zeros(8, page, d_latent + d_rope).to(dtype)
    table = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 7, 7]], dtype=torch.int32)
    kv_scale = torch.tensor([0.05])
    for b, n in enumerate(seq_lens):
        slots = torch.stack([table[b, p // page] * page + p % page for p in range(n)])
        kv = torch.randn(n, d_latent + d_rope, dtype=torch.bfloat16)
        write_latent_cache(kv[:, :d_latent], kv[:, d_latent:], cache, slots, kv_scale=kv_scale)
    q_nope = torch.randn(2, heads, d_latent, dtype=torch.bfloat16) * 0.1
    q_pe = torch.randn(2, heads, d_rope, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    plan = plan_decode(2, heads, 1, max(seq_lens), num_sms=4)
    fp8 = dtype != torch.bfloat16
    out, lse = mla_decode(q_nope, q_pe, cache, table, lens, scale, plan, kv_scale=kv_scale if fp8 else None)
    ref, ref_lse = mla_decode_ref(q_nope, q_pe, cache, table, lens, scale, kv_scale if fp8 else 1.0,
                                  fp8_queries=plan.fp8_queries(dtype))
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"  {name:>8} cache: kernel vs reference: relative error {rel:.2e}, "
          f"max |lse diff| {(lse - ref_lse).abs().max().item():.2e} ({plan.num_splits} KV splits)")
    assert rel < 1e-2, "kernel and reference disagree"
print("ok")
"""


def main(argv: list[str] | None = None) -> int:
    # vLLM logs to stdout by default; keep stdout for this command's own report.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    parser = argparse.ArgumentParser(prog="latentspeed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    info_parser = sub.add_parser("info", help="versions, GPU and usable components")
    info_parser.add_argument("--json", action="store_true")
    sub.add_parser("demo", help="the main job (see above)")
    ev = sub.add_parser("eval", help="perplexity and agreement through a real engine")
    ev.add_argument("--model", required=True, help="HF model directory (config, weights, tokenizer)")
    ev.add_argument("--text", required=True, help="UTF-8 text file to score")
    ev.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    ev.add_argument("--attention-backend", default=None, help="e.g. CUSTOM (vLLM) or latentspeed (SGLang)")
    ev.add_argument("--kv-cache-dtype", default="auto")
    ev.add_argument("--quantization", default=None)
    ev.add_argument("--reference", action="store_true", help="also run the engine's bf16 defaults and compare")
    ev.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    ev.add_argument("--max-windows", type=int, default=64)
    ev.add_argument("--top-k", type=int, default=8, help="top log-probs per position (top-1 agreement, KL)")
    ev.add_argument("--eager", action="store_true", help="no CUDA graphs or compilation: faster start-up")
    ev.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill this many tokens at a time, so that later chunks read the KV cache")
    ev.add_argument("--json", action="store_true")
    quantize_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "info":
        return info(args.json)
    if args.command == "eval":
        return evaluate(args)
    if args.command == "quantize":
        return quantize_cli.run(args)
    return demo()


def evaluate(args) -> int:
    from .evaluate import format_table, run

    try:
        report = run(args)
    except (ValueError, RuntimeError) as err:
        print(f"latentspeed eval: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
