"""``latentspeed quantize``: the command line of ``quant_recipes``.

    latentspeed quantize --list
    latentspeed quantize --model DIR --recipe NAME [--calib FILE] --out DIR [--num-samples N]
                         [--max-seq-len N] [--device cpu|cuda] [--overwrite]
    latentspeed quantize verify --model OUT --reference DIR [--calib FILE] [--json]
    latentspeed quantize native-fp8 --model DIR --out DIR [--overwrite]
"""

import contextlib
import json
import os
import sys
from collections import Counter


def add_parser(sub) -> None:
    q = sub.add_parser("quantize", help="calibrated compressed-tensors checkpoints (llm-compressor recipes)")
    q.add_argument("action", nargs="?", choices=["verify", "native-fp8"],
                   help="verify: compare a quantized checkpoint with its reference; native-fp8: write a bf16 "
                        "checkpoint in DeepSeek-V3's own block-FP8 format (no calibration, no llm-compressor)")
    q.add_argument("--list", action="store_true", help="list the recipes")
    q.add_argument("--model", help="checkpoint directory to quantize (verify: the quantized one)")
    q.add_argument("--recipe", help="recipe name (--list)")
    q.add_argument("--calib", help="calibration text: .jsonl with a \"text\" per line, or plain text (default: shipped)")
    q.add_argument("--out", help="output directory")
    q.add_argument("--reference", help="verify: the bf16 checkpoint the model was quantized from")
    q.add_argument("--num-samples", type=int, default=None, help="calibration samples (quantize 64, verify 8)")
    q.add_argument("--max-seq-len", type=int, default=512)
    q.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    q.add_argument("--overwrite", action="store_true")
    q.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    try:
        from quant_recipes import RECIPES
        from quant_recipes.checkpoint import QuantizeError
    except ImportError as err:  # pragma: no cover - packaging
        print(f"latentspeed quantize: {err}", file=sys.stderr)
        return 2
    if args.list:
        for recipe in RECIPES.values():
            print(f"{recipe.name:<14} {recipe.summary}{'  (calibrates: needs data)' if recipe.needs_data else ''}")
        return 0
    needed = {"verify": ("model", "reference"), "native-fp8": ("model", "out")}.get(args.action, ("model", "recipe", "out"))
    missing = [f"--{name}" for name in needed if getattr(args, name) is None]
    if missing:
        print(f"latentspeed quantize{' ' + args.action if args.action else ''}: missing {', '.join(missing)}",
              file=sys.stderr)
        return 2
    if args.action == "native-fp8":
        return _native_fp8(args)
    with _stdout_to_stderr():
        try:
            import llmcompressor  # noqa: F401
        except ImportError:
            print("latentspeed quantize: llm-compressor is not installed here; it runs in its own environment: "
                  "pip install 'latentspeed[quantize]'", file=sys.stderr)
            return 2
        try:
            report = _run(args)
        except QuantizeError as err:
            print(f"latentspeed quantize: {err}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(report, indent=1))
    elif args.action == "verify":
        print(format_verify(report))
    else:
        print(format_summary(report))
    return 0


def _run(args) -> dict:
    if args.action == "verify":
        from quant_recipes.verify import verify

        return verify(args.model, args.reference, args.calib, args.num_samples or 8, args.max_seq_len, log=_log)
    from quant_recipes.quantize import quantize

    return quantize(args.model, args.recipe, args.out, args.calib, args.num_samples or 64, args.max_seq_len,
                    args.device, args.overwrite, log=_log)


@contextlib.contextmanager
def _stdout_to_stderr():
    """What is written to file descriptor 1 meanwhile goes to stderr: llm-compressor logs to the
    stdout it found at import, and stdout is the report's (``--json``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _native_fp8(args) -> int:
    from quant_recipes.checkpoint import QuantizeError
    from quant_recipes.native_fp8 import write_native_fp8

    try:
        report = write_native_fp8(args.model, args.out, args.overwrite, log=_log)
    except QuantizeError as err:
        print(f"latentspeed quantize: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        before, after = report["bytes_before"], report["bytes_after"]
        print(f"native FP8 (128 x 128 blocks): {report['quantized']} weights quantized, {len(report['kept'])} tensors "
              f"kept in {report['seconds']:.1f} s; {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB -> {args.out}")
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def format_summary(report: dict) -> str:
    schemes = Counter(layer["scheme"] for layer in report["layers"].values())
    worst = max(report["layers"].items(), key=lambda item: item[1]["rel_error"], default=(None, None))
    lines = [f"recipe {report['recipe']}: {len(report['layers'])} layers quantized in {report['seconds']:.1f} s"]
    lines += [f"  {count:5d} x {scheme}" for scheme, count in schemes.most_common()]
    lines.append(f"  kept in bf16: {len(report['kept_bf16'])} ({', '.join(report['kept_bf16'][:6])}"
                 f"{', ...' if len(report['kept_bf16']) > 6 else ''})")
    if worst[0] is not None:
        lines.append(f"  largest weight reconstruction error: {worst[1]['rel_error']:.4f} ({worst[0]})")
    before, after = report["bytes_before"], report["bytes_after"]
    lines.append(f"  checkpoint {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({after / max(before, 1):.2f}x)")
    calibration = report["calibration"]
    lines.append(f"  calibration: {calibration['samples']} samples from {calibration['file']}" if calibration["used"]
                 else "  calibration: not needed by this recipe")
    lines.append("  report: latentspeed_report.json")
    return "\n".join(lines)


def format_verify(report: dict) -> str:
    layers = sorted(report["layer_output_rel_error"].items(), key=lambda item: -item[1])
    lines = [f"{report['model']} vs {report['reference']} over {report['tokens']} tokens:",
             f"  next-token KL(reference || quantized): mean {report['kl_mean']:.5f}, max {report['kl_max']:.5f}",
             "  largest layer output errors (on the reference's inputs):"]
    lines += [f"    {error:.4f}  {name}" for name, error in layers[:10]]
    return "\n".join(lines)
