"""A compressed-tensors FP8-block checkpoint in stock vLLM on a GPU: latentspeed_fp8 against vLLM's
own compressed-tensors method.

The checkpoint is ``tests/tiny_checkpoints.py``'s tiny DeepSeek-V3 (16 heads, 4 routed experts and
a shared one, random weights at init scale), written as llm-compressor writes an FP8 block recipe.
Engines, one per process: ``vllm-ct`` (vLLM's method, FLASHMLA), ``ours`` (``--quantization
latentspeed_fp8``, CUSTOM attention and MLA prefill), each also with an fp8 KV cache (``-fp8kv``).
Each engine scores 8 random prompts of 200-1800 tokens (prompt log-probs: the prefill path) and
decodes 32 greedy tokens after each (the decode path), and reports the quantization methods its
layers hold. ``compare A B`` prints |Δ log-prob| over the prompts, and over each decode up to
the first token where the two differ.

    python3 tests/gpu/vllm_ct_e2e.py write
    python3 tests/gpu/vllm_ct_e2e.py engine ours          # also vllm-ct, ours-fp8kv, vllm-ct-fp8kv
    python3 tests/gpu/vllm_ct_e2e.py compare vllm-ct ours
    python3 tests/gpu/vllm_ct_e2e.py guard

``guard`` starts vLLM with FLASHMLA and ``--quantization latentspeed_fp8`` on a bf16 checkpoint with a
NaN in one norm weight, under ``LATENTSPEED_FP8_GUARD=raise`` and CUDA graphs, in a child process,
and decodes 320 tokens: the engine must stop with ``Fp8NumericsError`` (exit status 1 here
otherwise), read by the logits processor of ``vllm_plugin/guard.py`` since FLASHMLA does not.

Files go to ``$OUT`` (default ``./gpu-out``); the checkpoint to ``/tmp/ct-tiny``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = Path("/tmp/ct-tiny")
NAN_CHECKPOINT = Path("/tmp/nan-tiny")
GUARD_TOKENS = 320  # more forward passes than the guard's 256 between reads
OUT = Path(os.environ.get("OUT", "gpu-out"))
ENGINES = {  # name: (quantization, attention backend, MLA prefill backend, kv-cache dtype)
    "vllm-ct": (None, "FLASHMLA", None, "auto"),
    "vllm-ct-fp8kv": (None, "FLASHMLA", None, "fp8"),
    "ours": ("latentspeed_fp8", "CUSTOM", "CUSTOM", "auto"),
    "ours-fp8kv": ("latentspeed_fp8", "CUSTOM", "CUSTOM", "fp8"),
}


def quant_methods(model) -> list[str]:
    return sorted({type(m.quant_method).__name__ for m in model.modules() if getattr(m, "quant_method", None)})


def run_engine(name: str) -> None:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # for apply_model(quant_methods)
    sys.path.insert(0, str(REPO))
    from vllm import LLM, SamplingParams, TokensPrompt

    from tests.gpu.vllm_e2e import prompts

    quantization, backend, prefill, kv_dtype = ENGINES[name]
    llm = LLM(model=str(CHECKPOINT), quantization=quantization, skip_tokenizer_init=True, dtype="bfloat16",
              kv_cache_dtype=kv_dtype, block_size=64, max_model_len=2048, gpu_memory_utilization=0.3, seed=0,
              enforce_eager=True,
              attention_config={"backend": backend, **({"mla_prefill_backend": prefill} if prefill else {})})
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts(0, 8, 200, 1799, vocab=1024)]
    scored = llm.generate(token_prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    decoded = llm.generate(token_prompts, SamplingParams(temperature=0.0, max_tokens=32, logprobs=0, ignore_eos=True),
                           use_tqdm=False)
    result = {
        "prompt_logprobs": [[next(iter(step.values())).logprob for step in out.prompt_logprobs[1:]] for out in scored],
        "tokens": [list(out.outputs[0].token_ids) for out in decoded],
        "logprobs": [[step[token].logprob for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
                     for out in decoded],
        "methods": sorted(set(sum(llm.apply_model(quant_methods), []))),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"ct-{name}.json").write_text(json.dumps(result))
    print(name, result["methods"], flush=True)


def compare_results(path_a: Path, path_b: Path, a: str, b: str) -> dict:
    """|Δ log-prob| between two engines' result files (``run_engine``'s, or SGLang's twin's)."""
    first, second = (json.loads(path.read_text()) for path in (path_a, path_b))
    prompt_a, prompt_b = (np.concatenate([np.array(p, float) for p in r["prompt_logprobs"]]) for r in (first, second))
    prefill = np.abs(prompt_a - prompt_b)
    decode = []
    for tokens_a, tokens_b, logprobs_a, logprobs_b in zip(first["tokens"], second["tokens"], first["logprobs"],
                                                          second["logprobs"]):
        same = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), len(tokens_a))
        decode += [abs(x - y) for x, y in zip(logprobs_a[:same], logprobs_b[:same])]
    row = dict(a=a, b=b, prefill_tokens=int(prefill.size), prefill_mean=float(prefill.mean()),
               prefill_p99=float(np.quantile(prefill, 0.99)), prefill_max=float(prefill.max()),
               logprob_mean=float(prompt_a.mean()), logprob_std=float(prompt_a.std()),
               decode_tokens_compared=len(decode), decode_mean=float(np.mean(decode)) if decode else None,
               identical_greedy=sum(x == y for x, y in zip(first["tokens"], second["tokens"])),
               methods_a=first.get("methods"), methods_b=second.get("methods"))
    print(json.dumps(row), flush=True)
    return row


def expect_guard_stop(script: str, name: str, timeout: int = 400) -> int:
    """Run ``script guard-child`` under ``LATENTSPEED_FP8_GUARD=raise``; 0 if the engine stopped with
    ``Fp8NumericsError``, 1 if it finished or hung. Its log (written as it runs, so a hang or an
    outer timeout still leaves it) and a JSON row go to ``$OUT/name.*``.

    The checkpoint is written here, not in the child: a process that has run torch's CPU thread
    pool and then forks (as vLLM forks its engine core) leaves the child's first parallel CPU op
    waiting forever -- on the H200 the engine core hung in its first pinned allocation
    (``vllm-guard-spawn-2026-12-02.md``)."""
    sys.path.insert(0, str(REPO))
    from tests.tiny_checkpoints import bf16_tensors, write_checkpoint

    tensors = bf16_tensors()
    tensors["model.layers.1.input_layernorm.weight"][5] = float("nan")
    write_checkpoint(NAN_CHECKPOINT, "bf16", tensors)
    OUT.mkdir(parents=True, exist_ok=True)
    log_path = OUT / f"{name}.log"
    with open(log_path, "w") as log_file:
        try:
            returncode = subprocess.run([sys.executable, "-u", script, "guard-child"], check=False, stdout=log_file,
                                        stderr=subprocess.STDOUT, timeout=timeout,
                                        env=dict(os.environ, LATENTSPEED_FP8_GUARD="raise")).returncode
        except subprocess.TimeoutExpired:  # an engine that neither stops nor finishes fails too
            returncode = None
            print(f"[guard] timed out after {timeout} s", file=log_file, flush=True)
    log = log_path.read_text()
    lines = [line for line in log.splitlines() if "Fp8NumericsError" in line or "fp8 guard" in line]
    stopped = returncode not in (0, None) and bool(lines)
    row = {"returncode": returncode, "stopped_by_guard": stopped, "guard_lines": lines[:4]}
    (OUT / f"{name}.json").write_text(json.dumps(row))
    print(json.dumps(row), flush=True)
    return 0 if stopped else 1


def guard_child() -> None:
    """vLLM's own attention (FLASHMLA) with latentspeed_fp8's linears on the copy of the bf16
    checkpoint (written by ``expect_guard_stop``) whose layer-1 ``input_layernorm`` holds a NaN: the
    activations quantized after it are non-finite. Only the logits processor of
    ``vllm_plugin.guard`` reads the guard here."""
    sys.path.insert(0, str(REPO))
    from vllm import LLM, SamplingParams, TokensPrompt

    from tests.gpu.vllm_e2e import prompts

    # CUDA graphs for batches of 1-4 only: one request decodes here, and each captured size compiles
    # its own GEMM launches
    llm = LLM(model=str(NAN_CHECKPOINT), quantization="latentspeed_fp8", skip_tokenizer_init=True, dtype="bfloat16",
              block_size=64, max_model_len=2048, gpu_memory_utilization=0.3, seed=0, max_num_seqs=4,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4]}, attention_config={"backend": "FLASHMLA"})
    llm.generate([TokensPrompt(prompt_token_ids=prompts(1, 1, 64, 64, vocab=1024)[0])],
                 SamplingParams(temperature=0.0, max_tokens=GUARD_TOKENS, ignore_eos=True), use_tqdm=False)
    print("[guard] the engine decoded every token without stopping", flush=True)


def main() -> None:
    command = sys.argv[1]
    if command == "write":
        sys.path.insert(0, str(REPO))
        from tests.tiny_checkpoints import write_checkpoint

        write_checkpoint(CHECKPOINT, "compressed_tensors")
    elif command == "engine":
        run_engine(sys.argv[2])
    elif command == "guard":
        raise SystemExit(expect_guard_stop(__file__, "vllm-guard"))
    elif command == "guard-child":
        guard_child()
    elif command == "compare":
        with open(OUT / "ct-compare.jsonl", "a") as f:
            f.write(json.dumps(compare_results(OUT / f"ct-{sys.argv[2]}.json", OUT / f"ct-{sys.argv[3]}.json",
                                               sys.argv[2], sys.argv[3])) + "\n")
    else:
        raise SystemExit(f"unknown command {command!r}: write, engine NAME, compare A B or guard")


if __name__ == "__main__":
    main()
