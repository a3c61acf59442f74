"""The reference model through one engine: perplexity and agreement of every latentspeed option
and of the engine's own built-ins, in one table (issues #5 and #7).

    python -m benchmarks.reference_model.engine_eval --engine vllm --model /tmp/refmodel \
        [--checkpoint fp8-block=/tmp/ckpt/fp8-block ...] --out eval-vllm.json

Every row scores the same held-out windows (``heldout.txt`` beside the model unless ``--text``)
with ``latentspeed eval``'s machinery, one engine process per row (``--parallel`` of them at
once), no CUDA graphs, prefilling ``--prefill-chunk`` tokens at a time so that later chunks read
the KV cache in its own dtype.
The first row, a built-in backend in bf16, is the reference of every other row: |Δ log-prob|,
top-1 agreement and top-k KL. Built-in rows beside ours give the spread between two correct
implementations. A row whose engine fails is recorded with its error; the others still run.
The JSON is rewritten after every row, so a run cut short keeps what it measured.
"""

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from latentspeed.evaluate import load_windows, score_in_subprocess
from latentspeed.metrics import agreement, perplexity

# label: (attention backend, kv-cache dtype, quantization)
RUNS = {
    "vllm": {
        "FLASHMLA, bf16": ("FLASHMLA", "auto", None),
        "TRITON_MLA, bf16": ("TRITON_MLA", "auto", None),
        "latentspeed (CUSTOM), bf16": ("CUSTOM", "auto", None),
        "FLASHMLA, fp8 e4m3 cache": ("FLASHMLA", "fp8", None),
        "latentspeed, fp8 e4m3 cache": ("CUSTOM", "fp8", None),
        "vLLM fp8_per_block weights (at load)": ("FLASHMLA", "auto", "fp8_per_block"),
        "latentspeed_fp8 weights (at load), CUSTOM": ("CUSTOM", "auto", "latentspeed_fp8"),
    },
    "sglang": {  # its default on Hopper, fa3, is not in the GPU host's SGLang bundle
        "triton, bf16": ("triton", "auto", None),
        "flashinfer, bf16": ("flashinfer", "auto", None),
        "latentspeed, bf16": ("latentspeed", "auto", None),
        "triton, fp8 e4m3 cache": ("triton", "fp8_e4m3", None),
        "latentspeed, fp8 e4m3 cache": ("latentspeed", "fp8_e4m3", None),
        "latentspeed_fp8 weights (at load), latentspeed": ("latentspeed", "auto", "latentspeed_fp8"),
    },
}
OUR_BACKEND = {"vllm": "CUSTOM", "sglang": "latentspeed"}
BUILTIN_BACKEND = {engine: next(iter(runs.values()))[0] for engine, runs in RUNS.items()}  # the reference's


def checkpoint_runs(engine: str, name: str, path: str) -> dict:
    """Rows for a quantized checkpoint: the stock engine (its scheme from the checkpoint's config,
    the reference row's backend) and, for FP8 block weights (compressed-tensors or DeepSeek-V3's
    native format), latentspeed's method and backend; a calibrated KV scheme brings an fp8 cache."""
    config = json.loads(Path(path, "config.json").read_text())
    quant = config.get("quantization_config") or {}
    kv = ("fp8" if engine == "vllm" else "fp8_e4m3") if quant.get("kv_cache_scheme") else "auto"
    runs = {f"{name}: stock {engine}": (BUILTIN_BACKEND[engine], kv, None, path)}
    weights = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    native_fp8 = quant.get("quant_method") == "fp8" and quant.get("weight_block_size") == [128, 128]
    ct_fp8_block = bool(weights) and all(w.get("type") == "float" and w.get("num_bits") == 8
                                         and w.get("strategy") == "block" for w in weights)
    if native_fp8 or ct_fp8_block:
        runs[f"{name}: latentspeed_fp8, {OUR_BACKEND[engine]}"] = (OUR_BACKEND[engine], kv, "latentspeed_fp8", path)
    return runs


def evaluate_all(args) -> dict:
    text = args.text or str(Path(args.model, "heldout.txt"))
    windows = load_windows(args.model, text, args.window, args.max_windows)
    runs = {label: (*run, args.model) for label, run in RUNS[args.engine].items()}
    if args.checkpoints_only:
        runs = dict(list(runs.items())[:1])
    for item in args.checkpoint:
        name, _, path = item.partition("=")
        runs.update(checkpoint_runs(args.engine, name, path))
    report = {"engine": args.engine, "model": args.model, "text": text, "windows": len(windows),
              "window": args.window, "prefill_chunk": args.prefill_chunk, "rows": []}

    def score(backend, kv, quantization, model):
        spec = dict(engine=args.engine, model=model, attention_backend=backend, kv_cache_dtype=kv,
                    quantization=quantization, top_k=args.top_k, windows=windows, eager=True,
                    prefill_chunk=args.prefill_chunk, gpu_share=args.parallel)
        started = time.perf_counter()
        try:
            return score_in_subprocess(spec), None, time.perf_counter() - started
        except RuntimeError as err:
            return None, str(err), time.perf_counter() - started

    reference = None
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = {label: pool.submit(score, *run) for label, run in runs.items()}
        for label, (backend, kv, quantization, model) in runs.items():  # in table order, each as it finishes
            positions, error, seconds = futures[label].result()
            row = {"label": label, "attention_backend": backend, "kv_cache_dtype": kv, "quantization": quantization,
                   "model": model, "seconds": round(seconds, 1)}
            if error:
                row["error"] = error
            else:
                row["perplexity"] = perplexity(positions)
                if reference is None:
                    reference = positions
                else:
                    row["agreement"] = agreement(reference, positions)
            report["rows"].append(row)
            print(format_row(row), flush=True)
            Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def format_row(row: dict) -> str:
    if "error" in row:
        return f"| {row['label']} | failed: {row['error']} | | | | |"
    a = row.get("agreement")
    if a is None:
        return f"| {row['label']} | {row['perplexity']:.4f} | reference | | | |"
    top1 = "n/a" if a["top1_agreement"] is None else f"{a['top1_agreement']:.4f}"
    kl = "n/a" if a["kl_topk"] is None else f"{a['kl_topk']:.2e}"
    return (f"| {row['label']} | {row['perplexity']:.4f} | {a['mean_abs_dlogprob']:.4f} | "
            f"{a['max_abs_dlogprob']:.3f} | {top1} | {kl} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=sorted(RUNS), required=True)
    parser.add_argument("--model", required=True, help="the bf16 reference model directory")
    parser.add_argument("--text", default=None, help="default: heldout.txt in --model")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="a quantized checkpoint of the same model (repeatable)")
    parser.add_argument("--checkpoints-only", action="store_true", help="the reference row and the checkpoints' rows")
    parser.add_argument("--window", type=int, default=512, help="the training sequence length")
    parser.add_argument("--max-windows", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=1,
                        help="rows run at once, sharing the GPU (each engine's cache then sized for the windows)")
    parser.add_argument("--out", required=True)
    print("| run | perplexity | mean abs Δ log-prob | max | top-1 agreement | top-k KL |\n|---|---|---|---|---|---|",
          flush=True)
    return evaluate_all(parser.parse_args(argv))


if __name__ == "__main__":
    main()
