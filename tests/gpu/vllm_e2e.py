"""latentspeed inside stock vLLM on a GPU: log-prob agreement with FLASHMLA, and throughput.

Needs a GPU host with vLLM 0.26.0 and latentspeed installed (the entry point registers the
backend). Builds the tiny DeepSeek-V3 of ``examples/tiny_deepseek_v3.py`` (real MLA sizes,
random weights at init scale, saved as safetensors; ``--widths deepseek-v3``: every other width
of DeepSeek-V3 too, so the GEMMs, norms and activations run at the real model's shapes), then,
one engine per process:

- agreement: each backend decodes greedy continuations of long prompts (3k-12k tokens);
  the other backend scores the same sequences as prompts (prefill path), and the
  differences of the generated tokens' log-probs are summarised, both ways. FLASHMLA vs
  TRITON_MLA in bf16 gives the floor between two correct built-ins, measured in the same
  run. latentspeed must stay within twice that floor; a group without that pair is held to
  ``--floor`` (the report of a bf16 run at the same widths) or, on the tiny model, to the floor
  stated below; at other widths without ``--floor`` its agreement is reported, not judged.
- prefix caching: the latentspeed engine decodes the same prompts twice; the second pass
  reads the cached prefix, through the chunked-context prefill path.
- throughput: 64 requests x 1024 prompt tokens x 128 output tokens, and 16 requests x 16k
  prompt tokens x 128 output tokens, with full CUDA graphs for decode; the median of five
  passes on fresh prompts, each pass kept in the report.

    python tests/gpu/vllm_e2e.py --group bf16 --workdir /tmp/e2e --out results.json
    python tests/gpu/vllm_e2e.py --throughput-only FLASHMLA-fp8 latentspeed-fp8 --out throughput.json
    python tests/gpu/vllm_e2e.py --throughput-only FLASHMLA-w8 FLASHMLA-w8-latentspeed \
        FLASHMLA-w8-latentspeed FLASHMLA-w8 --out throughput.json    # each twice, passes pooled per engine

Exits non-zero when an agreement bound is exceeded or an engine fails. A failed engine's pairs are skipped, the
others still compared; its output's last lines go into the report (each engine's output: WORKDIR/ENGINE.log).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from tiny_deepseek_v3 import WIDTHS, make_tiny_deepseek_v3  # noqa: E402
GEN_TOKENS = 64
ENGINES = {
    # name: (attention backend, MLA prefill backend, kv-cache dtype, quantization)
    "FLASHMLA-bf16": ("FLASHMLA", None, "auto", None),
    "TRITON_MLA-bf16": ("TRITON_MLA", None, "auto", None),
    "latentspeed-bf16": ("CUSTOM", "CUSTOM", "auto", None),
    "FLASHMLA-fp8": ("FLASHMLA", None, "fp8", None),
    "latentspeed-fp8": ("CUSTOM", "CUSTOM", "fp8", None),
    "latentspeed-fp8_e5m2": ("CUSTOM", "CUSTOM", "fp8_e5m2", None),
    # Our decode with vLLM's own prefill, as FLASHMLA has it: `--attention-backend CUSTOM` without our prefill,
    # the default, and the decode's share of throughput alone.
    "latentspeed-decode-bf16": ("CUSTOM", None, "auto", None),
    "latentspeed-decode-fp8": ("CUSTOM", None, "fp8", None),
    # Block-FP8 weights quantized while loading the bf16 checkpoint: vLLM's own online block
    # method (its kernels) against latentspeed_fp8 (ours), each with its engine's attention.
    "FLASHMLA-w8": ("FLASHMLA", None, "auto", "fp8_per_block"),
    "latentspeed-w8": ("CUSTOM", "CUSTOM", "auto", "latentspeed_fp8"),
    # Our quantization method under FLASHMLA and vLLM's prefill, as FLASHMLA-w8 has them: the method's share alone.
    "FLASHMLA-w8-latentspeed": ("FLASHMLA", None, "auto", "latentspeed_fp8"),
    # The same without any producer fused into its linear layer's quantization (vllm_plugin/fusion.py).
    "latentspeed-w8-unfused": ("CUSTOM", "CUSTOM", "auto", "latentspeed_fp8"),
    # The same with the RMSNorms fused but not SiLU-and-mul (LATENTSPEED_FUSE_SILU_QUANT=0).
    "latentspeed-w8-nosilu": ("CUSTOM", "CUSTOM", "auto", "latentspeed_fp8"),
}
# Environment of an engine's process beyond the driver's: the fusion switches.
ENGINE_ENV = {
    "latentspeed-w8-unfused": {"LATENTSPEED_FUSE_NORM_QUANT": "0", "LATENTSPEED_FUSE_SILU_QUANT": "0"},
    "latentspeed-w8-nosilu": {"LATENTSPEED_FUSE_SILU_QUANT": "0"},
}
# (engine that decodes, engine that scores) pairs per group; the first is the floor.
PAIRS = {
    "bf16": [
        ("FLASHMLA-bf16", "TRITON_MLA-bf16"),
        ("FLASHMLA-bf16", "latentspeed-bf16"),
        ("FLASHMLA-bf16", "latentspeed-decode-bf16"),
    ],
    "fp8": [
        ("FLASHMLA-fp8", "latentspeed-fp8"),
        ("FLASHMLA-bf16", "latentspeed-fp8_e5m2"),
        ("FLASHMLA-fp8", "latentspeed-decode-fp8"),
    ],
    "w8": [
        ("FLASHMLA-w8", "latentspeed-w8"),
        ("FLASHMLA-w8", "FLASHMLA-w8-latentspeed"),
    ],
    "w8-fused": [
        ("latentspeed-w8-unfused", "latentspeed-w8"),
    ],
    "w8-silu": [
        ("latentspeed-w8-nosilu", "latentspeed-w8"),
    ],
}
# Floor measured between TRITON_MLA and FLASHMLA (issue #2): mean 0.010, p99 0.21, max 0.53.
STATED_FLOOR = {"mean": 0.010, "p99": 0.21, "max": 0.53}


def prompts(seed: int, count: int, low: int, high: int, vocab: int = 4096) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, size=int(n)).tolist() for n in rng.integers(low, high + 1, size=count)]


def llm_kwargs(model: str, engine: str, max_model_len: int) -> dict:
    """``vllm.LLM``'s arguments for one of ``ENGINES`` (vLLM's engine arguments)."""
    backend, prefill, kv_dtype, quantization = ENGINES[engine]
    return dict(
        model=model,
        quantization=quantization,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        kv_cache_dtype=kv_dtype,
        block_size=64,
        max_model_len=max_model_len,
        max_num_batched_tokens=8192,
        # At most 64 sequences run at once here. vLLM's default (1024 on cards of 70 GB and more) sizes TRITON_MLA's
        # worst-case decode workspace at 17.2 GB (1024 x 128 heads x 64 splits x 513 fp32), the suspect of its
        # failure on an H100 in the forty-third session; 128 makes it 2.1 GB.
        max_num_seqs=128,
        gpu_memory_utilization=0.8,
        seed=0,
        attention_config={"backend": backend, **({"mla_prefill_backend": prefill} if prefill else {})},
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]},
    )


def make_llm(model: str, engine: str, max_model_len: int):
    from vllm import LLM

    return LLM(**llm_kwargs(model, engine, max_model_len))


def generate(llm, token_prompts, max_tokens=GEN_TOKENS):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], params, use_tqdm=False)
    result = []
    for prompt, out in zip(token_prompts, outs):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, tokens)]
        result.append({"prompt": prompt, "tokens": tokens, "logprobs": logprobs})
    return result


def score(llm, sequences):
    """Prompt log-probs of each sequence's generated tokens (the prefill path)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    full = [s["prompt"] + s["tokens"] for s in sequences]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in full], params, use_tqdm=False)
    scored = []
    for seq, ids, out in zip(sequences, full, outs):
        start = len(seq["prompt"])
        scored.append([out.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))])
    return scored


PASSES = 5  # timed passes per throughput case: single passes stalled now and then (2026-11-30), three spread 1.5x (2026-12-02)


def timed_passes(run_pass, num_requests, prompt_len, out_len) -> dict:
    """The median of ``PASSES`` passes of ``run_pass(i) -> (prefill_s, total_s)``, each pass on
    fresh prompts (no prefix-cache hits), with every pass kept. An untimed pass of the same shapes
    (``run_pass(-1)``) goes first: kernels the engine's own warm-up did not compile for these batches
    compile there, where they used to stall timed passes for 5-50 s (2026-12-06)."""
    run_pass(-1)
    passes = []
    for i in range(PASSES):
        prefill_s, total_s = run_pass(i)
        passes.append({"total_s": total_s, "prefill_s": prefill_s, "output_tok_s": num_requests * out_len / total_s,
                       "decode_tok_s_est": num_requests * (out_len - 1) / max(total_s - prefill_s, 1e-9)})
    return median_case({"requests": num_requests, "prompt_len": prompt_len, "output_len": out_len}, passes)


def median_case(case: dict, passes: list[dict]) -> dict:
    """``case`` (requests, prompt and output lengths) with the figures of its median pass by total time, and
    every pass."""
    median = sorted(passes, key=lambda p: p["total_s"])[len(passes) // 2]
    return {**case, **{k: v for k, v in median.items() if k != "run"}, "passes": passes}


def pooled_throughput(runs: list[dict]) -> list[dict]:
    """One engine's throughput cases over several runs (processes) of it: each case's passes pooled, each
    marked with its run's index, and the median taken over them all."""
    pooled = []
    for cases in zip(*(run["throughput"] for run in runs)):
        passes = [dict(p, run=r) for r, case in enumerate(cases) for p in case["passes"]]
        pooled.append(median_case({k: cases[0][k] for k in ("requests", "prompt_len", "output_len")}, passes))
    return pooled


def throughput(llm, num_requests, prompt_len, out_len, seed):
    from vllm import SamplingParams, TokensPrompt

    def batch(s):
        return [TokensPrompt(prompt_token_ids=p) for p in prompts(s, num_requests, prompt_len, prompt_len)]

    def run_pass(i):
        t0 = time.perf_counter()
        llm.generate(batch(seed + 2 * i + 1), SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(batch(seed + 2 * i), SamplingParams(max_tokens=out_len, ignore_eos=True), use_tqdm=False)
        return prefill_s, time.perf_counter() - t0

    return timed_passes(run_pass, num_requests, prompt_len, out_len)


def worker(args):
    """One engine: decode the shared prompts, score other engines' sequences, time it."""
    task = json.loads(Path(args.task).read_text())
    reads_matches = ENGINES[task["engine"]][3] == "latentspeed_fp8"
    if reads_matches:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends a function to the worker
    llm = make_llm(task["model"], task["engine"], max_model_len=17_000)
    result = {"engine": task["engine"], "model": task["model"]}
    if reads_matches:
        from vllm.compilation.passes.vllm_inductor_pass import get_match_table

        result["fusion_matches"] = llm.apply_model(lambda model: get_match_table())
    if task.get("generate"):
        token_prompts = prompts(0, 8, 3000, 12000)
        result["generated"] = generate(llm, token_prompts)
        if ENGINES[task["engine"]][0] == "CUSTOM":
            again = generate(llm, token_prompts)  # prefix cache hit on every prompt
            diffs = [abs(a - b) for s, t in zip(result["generated"], again) for a, b in zip(s["logprobs"], t["logprobs"])]
            same = all(s["tokens"] == t["tokens"] for s, t in zip(result["generated"], again))
            result["prefix_cache_rerun"] = {"same_tokens": same, "max_abs_logprob_diff": max(diffs)}
    result["scores"] = {}
    for other in task.get("score", []):
        sequences = json.loads(Path(task["workdir"], f"{other}.json").read_text())["generated"]
        result["scores"][other] = score(llm, sequences)
    if task.get("throughput"):
        result["throughput"] = [throughput(llm, 64, 1024, 128, seed=10), throughput(llm, 16, 16_000, 128, seed=20)]
    Path(task["workdir"], f"{task['engine']}{task.get('suffix', '')}.json").write_text(json.dumps(result))


LOG_TAIL_LINES = 60  # of a failed engine's output, kept in the report


def run_engine(script: str, workdir: Path, model: str, engine: str, engine_env: dict = ENGINE_ENV, **task) -> dict:
    """Run ``script worker`` for one engine in its own process; return what it wrote, or, if it failed,
    ``{"failed": rc, "log_tail": [its output's last lines]}``. Its output goes to ``WORKDIR/ENGINE[SUFFIX].log``
    and is printed when it ends."""
    name = f"{engine}{task.get('suffix', '')}"
    task_path = workdir / f"task-{name}.json"
    task_path.write_text(json.dumps({"model": model, "engine": engine, "workdir": str(workdir), **task}))
    log = workdir / f"{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, script, "worker", "--task", str(task_path)], cwd=REPO, check=False,
                              env=dict(os.environ, **engine_env.get(engine, {})), stdout=out, stderr=subprocess.STDOUT)
    output = log.read_text(errors="replace")
    print(output, end="", flush=True)
    print(f"[e2e] {engine} {task} finished rc={proc.returncode} in {time.perf_counter() - t0:.0f}s", flush=True)
    if proc.returncode:
        tail = output.splitlines()[-LOG_TAIL_LINES:]
        print(f"[e2e] {engine} FAILED (rc={proc.returncode}); its last lines:", *tail, sep="\n[e2e]   ", flush=True)
        return {"failed": proc.returncode, "log_tail": tail}
    return json.loads((workdir / f"{name}.json").read_text())


def summarize(decode_lps, score_lps):
    diffs = np.abs(np.concatenate([np.array(a) - np.array(b) for a, b in zip(decode_lps, score_lps)]))
    return {"mean": float(diffs.mean()), "p99": float(np.quantile(diffs, 0.99)), "max": float(diffs.max()), "n": int(diffs.size)}


def driver(args, engine_names=tuple(ENGINES), pair_groups=PAIRS, script=__file__, is_floor=lambda name: "TRITON_MLA" in name,
           engine_env=ENGINE_ENV):
    """Decode with every engine of ``args.group``, score each partner's decodes, compare.

    ``is_floor`` names the built-in whose pairs measure the floor between two correct built-ins.
    """
    if args.throughput_only:
        return throughput_only(args, engine_names, script, engine_env)
    workdir, model = tiny_model(args)
    pairs = pair_groups[args.group]
    engines = sorted({e for pair in pairs for e in pair}, key=list(engine_names).index)
    runs, failures = {}, {}
    for engine in engines:  # everyone decodes; each scores what its partner decoded, if ready
        previous = workdir / f"{engine}.json"
        if args.reuse and previous.exists() and json.loads(previous.read_text()).get("model") == model:
            runs[engine] = json.loads(previous.read_text())
            continue
        partners = [a if b == engine else b for a, b in pairs if engine in (a, b)]
        ready = [p for p in partners if p in runs]
        run = run_engine(script, workdir, model, engine, engine_env, generate=True, score=ready,
                         throughput=args.throughput and not is_floor(engine))
        if "failed" in run:
            failures[engine] = run
        else:
            runs[engine] = run
    for engine in runs:  # scores that were not ready on the first pass
        partners = [a if b == engine else b for a, b in pairs if engine in (a, b)]
        missing = [p for p in partners if p in runs and p not in runs[engine]["scores"]]
        if missing:
            run = run_engine(script, workdir, model, engine, engine_env, score=missing, suffix="-score")
            if "failed" in run:
                failures[f"{engine}-score"] = run
            else:
                runs[engine]["scores"].update(run["scores"])
    report = {"group": args.group, "widths": args.widths, "pairs": [], "engines": {}, "failed_engines": failures}
    failed = []
    floor, stated = None, stated_floor(args)
    for decoder, scorer in pairs:
        for a, b in ((decoder, scorer), (scorer, decoder)):
            if a not in runs or a not in runs.get(b, {}).get("scores", {}):
                report["pairs"].append({"decoded_by": a, "scored_by": b, "skipped": "an engine failed"})
                print(f"[e2e] decode {a:>22} / prefill {b:>22}: skipped, an engine failed", flush=True)
                continue
            gen = runs[a]["generated"]
            stats = summarize([g["logprobs"] for g in gen], runs[b]["scores"][a])
            entry = {"decoded_by": a, "scored_by": b, **stats}
            report["pairs"].append(entry)
            print(f"[e2e] decode {a:>22} / prefill {b:>22}: mean {stats['mean']:.4f} p99 {stats['p99']:.3f} "
                  f"max {stats['max']:.3f} over {stats['n']} tokens", flush=True)
            if is_floor(a) or is_floor(b):
                floor = stats if floor is None else {k: max(floor[k], stats[k]) for k in ("mean", "p99", "max")}
            elif "e5m2" not in a + b and (floor or stated):
                bound = floor or stated
                if any(stats[k] > 2 * bound[k] for k in ("mean", "p99", "max")):
                    failed.append(entry)
    report["floor"] = floor or stated
    if report["floor"] is None:
        print(f"[e2e] no floor at widths {args.widths}: agreement reported, not judged (--floor names a bf16 "
              "run at these widths)", flush=True)
    for engine, run in runs.items():
        report["engines"][engine] = {k: run[k] for k in ("throughput", "prefix_cache_rerun", "fusion_matches")
                                     if k in run}
    write_report(report, args.out)
    if failed or failures:
        raise SystemExit(f"agreement beyond twice the floor: {failed}; engines that failed: {sorted(failures)}")


def tiny_model(args) -> tuple[Path, str]:
    """The work folder and the tiny DeepSeek-V3 at ``args.widths`` inside it, built if missing."""
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = str(workdir / ("tiny-dsv3" if args.widths == "tiny" else f"tiny-dsv3-{args.widths}-widths"))
    if not (Path(model) / "config.json").exists():
        make_tiny_deepseek_v3(model, widths=args.widths)
    return workdir, model


def throughput_only(args, engine_names, script, engine_env):
    """Time the engines named by ``--throughput-only`` and nothing else (no agreement)."""
    unknown = [e for e in args.throughput_only if e not in engine_names]
    if unknown:
        raise SystemExit(f"--throughput-only: unknown engines {unknown}; known: {list(engine_names)}")
    workdir, model = tiny_model(args)
    report = {"throughput_only": True, "widths": args.widths, "engines": {}, "failed_engines": {}}
    runs = {}
    for i, engine in enumerate(args.throughput_only):
        nth = args.throughput_only[:i].count(engine)
        run = run_engine(script, workdir, model, engine, engine_env, throughput=True,
                         suffix="-throughput" + (f"-{nth + 1}" if nth else ""))
        if "failed" in run:
            report["failed_engines"][engine] = run
        else:
            runs.setdefault(engine, []).append(run)
    for engine, engine_runs in runs.items():
        entry = report["engines"][engine] = {"throughput": pooled_throughput(engine_runs), "runs": len(engine_runs)}
        if "fusion_matches" in engine_runs[0]:
            entry["fusion_matches"] = engine_runs[0]["fusion_matches"]
    write_report(report, args.out)
    if report["failed_engines"]:
        raise SystemExit(f"engines that failed: {sorted(report['failed_engines'])}")


def write_report(report: dict, out: str):
    """Write the report and print each engine's throughput, fusion matches and prefix-cache rerun."""
    Path(out).write_text(json.dumps(report, indent=1))
    for engine, info in report["engines"].items():
        for t in info.get("throughput", []):
            print(f"[e2e] {engine:>22}: {t['requests']}x{t['prompt_len']}+{t['output_len']}: "
                  f"{t['output_tok_s']:.0f} out tok/s, prefill {t['prefill_s']:.2f}s, total {t['total_s']:.2f}s")
        if "fusion_matches" in info:
            print(f"[e2e] {engine:>22}: fusion pass matches {info['fusion_matches']}")
        if "prefix_cache_rerun" in info:
            print(f"[e2e] {engine:>22}: prefix-cache rerun {info['prefix_cache_rerun']}")


def stated_floor(args) -> dict | None:
    """The floor a group without its own floor pair is held to: ``--floor``'s report (same widths),
    else ``STATED_FLOOR`` on the tiny model, else none."""
    if args.floor:
        report = json.loads(Path(args.floor).read_text())
        if report.get("widths", "tiny") != args.widths or not report.get("floor"):
            raise SystemExit(f"--floor {args.floor}: no floor measured at widths {args.widths} in that report")
        return report["floor"]
    return STATED_FLOOR if args.widths == "tiny" else None


def parse_args(description: str, pair_groups: dict, workdir: str, out: str) -> argparse.Namespace:
    """The command line shared by the engines' e2e scripts: a driver, or ``worker --task``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    sub.add_parser("worker").add_argument("--task", required=True)
    parser.add_argument("--group", choices=sorted(pair_groups), default="bf16")
    parser.add_argument("--workdir", default=workdir)
    parser.add_argument("--out", default=out)
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--throughput-only", nargs="+", metavar="ENGINE",
                        help="time these engines' throughput alone, one process each: no agreement, no --group; "
                             "an engine named again runs again and its passes are pooled (A B B A: the host's "
                             "drift between processes falls on both)")
    parser.add_argument("--reuse", action="store_true", help="reuse decodes an earlier run left in --workdir")
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="tiny",
                        help="the model's widths (examples/tiny_deepseek_v3.py): tiny, or DeepSeek-V3's own")
    parser.add_argument("--floor", help="a report of this script's bf16 group at the same widths: its floor bounds "
                                        "groups that measure none")
    return parser.parse_args()


def main():
    args = parse_args(__doc__, PAIRS, "/tmp/latentspeed-e2e", "e2e.json")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    worker(args) if args.cmd == "worker" else driver(args)


if __name__ == "__main__":
    main()
