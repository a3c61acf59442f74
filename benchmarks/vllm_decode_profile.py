"""Where a vLLM decode step's time goes, per engine of ``tests/gpu/vllm_e2e.py``: the GPU time of each
kernel over ``STEPS`` pure decode steps of 64 x 1024 + 128 (vLLM's torch profiler, started
``DELAY`` engine steps in, after the prefills), how busy the GPU was over them, and how many CUDA graphs
were launched a step. A step the GPU is busy for most of is bound by its kernels; one with long idle
gaps, by the host. Each engine runs in its own process; one JSON object per engine goes to ``--out``.

    python3 -m benchmarks.vllm_decode_profile --workdir /tmp/e2e --out profile.json FLASHMLA-bf16 latentspeed-bf16
"""

import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tests.gpu.vllm_e2e import ENGINES, llm_kwargs, prompts, tiny_model

DELAY, STEPS = 24, 64  # engine steps: 64 x 1024 at 8192 batched tokens prefill in the first 8
BATCH, PROMPT_LEN, OUT_LEN = 64, 1024, 128


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize_trace(path: Path) -> dict:
    """Kernel time by name, GPU busy time and span, and graph launches in one worker trace."""
    events = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
    events = events["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    by_name = defaultdict(float)
    for e in kernels:
        by_name[e["name"]] += e["dur"]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    launches = sum(1 for e in events if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch")
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    return {"steps": STEPS, "span_us_per_step": span / STEPS, "gpu_busy_us_per_step": busy_us(intervals) / STEPS,
            "kernel_us_per_step": sum(by_name.values()) / STEPS, "graph_launches_per_step": launches / STEPS,
            "top_kernels_us_per_step": {name: us / STEPS for name, us in top}}


def self_cpu_us_per_step(table: str) -> float | None:
    """The host's self time per step from vLLM's profiler table (its ``Self CPU time total`` line): with the
    same host ops in two engines, a higher value means a slower host during that run, or more host work."""
    match = re.search(r"Self CPU time total: ([\d.]+)(us|ms|s)\b", table)
    if match is None:
        return None
    return float(match.group(1)) * {"us": 1, "ms": 1e3, "s": 1e6}[match.group(2)] / STEPS


def profile_engine(workdir: str, engine: str) -> dict:
    """One engine, in this process: an unprofiled pass (warm-up and wall time), then a profiled one."""
    from vllm import LLM, SamplingParams, TokensPrompt

    _, model = tiny_model(argparse.Namespace(workdir=workdir, widths="tiny"))
    trace_dir = Path(tempfile.mkdtemp(prefix=f"profile-{engine}-"))
    llm = LLM(**llm_kwargs(model, engine, max_model_len=17_000),
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(trace_dir),
                               "torch_profiler_with_stack": False, "delay_iterations": DELAY,
                               "max_iterations": STEPS})
    params = SamplingParams(max_tokens=OUT_LEN, ignore_eos=True)

    def run(seed):
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(seed, BATCH, PROMPT_LEN, PROMPT_LEN)]
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t0

    run(1)
    wall_s = [run(2), run(3)]
    llm.start_profile()
    run(4)
    llm.stop_profile()
    summaries = [summarize_trace(p) for p in trace_dir.rglob("*.pt.trace.json*")]
    worker = max(summaries, key=lambda s: s["kernel_us_per_step"])  # the frontend's trace, if any, has no kernels
    table_file = next(trace_dir.rglob("profiler_out_0.txt"), None)
    table = table_file.read_text() if table_file else None
    worker["host_self_cpu_us_per_step"] = self_cpu_us_per_step(table) if table else None
    return {"engine": engine, "unprofiled_pass_s": wall_s, "profile": worker, "trace_dir": str(trace_dir),
            "table": table}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="+", choices=sorted(ENGINES))
    parser.add_argument("--workdir", default="/tmp/latentspeed-e2e")
    parser.add_argument("--out", required=True)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child: one engine, JSON to stdout
    args = parser.parse_args()
    if args.one:
        print("PROFILE " + json.dumps(profile_engine(args.workdir, args.engines[0])), flush=True)
        return
    results = {}
    for engine in args.engines:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm_decode_profile", "--one", "--workdir",
                               args.workdir, "--out", args.out, engine], capture_output=True, text=True, check=False)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("PROFILE ")]
        results[engine] = (json.loads(lines[-1][len("PROFILE "):]) if lines else
                           {"failed": proc.returncode, "log_tail": (proc.stdout + proc.stderr).splitlines()[-60:]})
        Path(args.out).write_text(json.dumps(results, indent=1))
        summary = results[engine].get("profile", results[engine])
        print(engine, json.dumps({k: v for k, v in summary.items() if k != "top_kernels_us_per_step"}), flush=True)


if __name__ == "__main__":
    main()
