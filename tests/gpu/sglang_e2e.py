"""latentspeed inside stock SGLang on a GPU: log-prob agreement with SGLang's MLA backends, and throughput.

The SGLang twin of ``vllm_e2e.py`` (same tiny DeepSeek-V3, prompts, driver and bounds): each
backend decodes greedy continuations, another scores the same sequences as prompts (input
log-probs, ``max_new_tokens=0``), both ways; flashinfer against triton is the floor between two
correct built-ins. latentspeed runs with pages of 64 tokens and, in its own process, decodes
the prompts a second time so that the radix-cached prefix goes through its extend path.

    python tests/gpu/sglang_e2e.py --group bf16 --throughput --workdir /tmp/e2e-sglang --out e2e.json
"""

import json
import time
from pathlib import Path

from vllm_e2e import GEN_TOKENS, driver, parse_args, prompts, timed_passes

ENGINES = {
    # name: (attention backend, kv-cache dtype, page size (None keeps SGLang's default), quantization)
    "flashinfer-bf16": ("flashinfer", "auto", None, None),
    "triton-bf16": ("triton", "auto", None, None),
    "flashmla-bf16": ("flashmla", "auto", 64, None),
    "latentspeed-bf16": ("latentspeed", "auto", 64, None),
    # SGLang's flashinfer MLA upcasts a whole fp8 cache to bf16 per layer (64 GiB here, OOM): triton is the fp8 built-in.
    "triton-fp8_e4m3": ("triton", "fp8_e4m3", None, None),
    "latentspeed-fp8_e4m3": ("latentspeed", "fp8_e4m3", 64, None),
    "latentspeed-fp8_e5m2": ("latentspeed", "fp8_e5m2", 64, None),
    # FP8 weights quantized from the bf16 checkpoint: SGLang's fp8 (per-channel) against latentspeed_fp8 (blocks),
    # the latter under flashinfer's attention (the method alone) and under ours.
    "flashinfer-w8": ("flashinfer", "auto", None, "fp8"),
    "flashinfer-w8-latentspeed": ("flashinfer", "auto", None, "latentspeed_fp8"),
    "latentspeed-w8": ("latentspeed", "auto", 64, "latentspeed_fp8"),
    # The same with RMSNorm and SiLU-and-mul fused into the activation quantization (sglang_plugin/fusion.py).
    "latentspeed-w8-fused": ("latentspeed", "auto", 64, "latentspeed_fp8"),
    # Our decode, SGLang's FA3 for extends (PREFILL_BACKENDS), as vllm_e2e.py's latentspeed-decode-fp8 takes vLLM's.
    "latentspeed-decode-bf16": ("latentspeed", "auto", 64, None),
    "latentspeed-decode-fp8_e4m3": ("latentspeed", "fp8_e4m3", 64, None),
}
# --prefill-attention-backend: extends (MHA prefill, absorbed over short prefixes) go to SGLang's own backend. The
# GPU host's sgl-kernel 0.4.5 (CUDA 13 wheel) has no FA3 (`flash_ops`): there these two fail at start (2026-12-06).
PREFILL_BACKENDS = {"latentspeed-decode-bf16": "fa3", "latentspeed-decode-fp8_e4m3": "fa3"}
PAIRS = {
    "bf16": [
        ("flashinfer-bf16", "triton-bf16"),
        ("flashinfer-bf16", "latentspeed-bf16"),
        ("flashmla-bf16", "latentspeed-bf16"),
    ],
    "fp8": [
        ("triton-fp8_e4m3", "latentspeed-fp8_e4m3"),
        ("flashinfer-bf16", "latentspeed-fp8_e5m2"),
    ],
    "w8-fused": [
        ("latentspeed-w8", "latentspeed-w8-fused"),
    ],
    # Same weights, flashinfer's attention against ours. Against SGLang's per-channel fp8 the log-probs differ by
    # 0.11 mean |delta| whatever the attention (sglang-e2e-w8-diag-h100-2026-12-06-s45.json): two FP8 models, not a
    # bound. The block weights against SGLang's own block-FP8 loaders are sglang_ct_e2e.py's pairs.
    "w8": [
        ("flashinfer-w8-latentspeed", "latentspeed-w8"),
    ],
    "decode": [
        ("flashinfer-bf16", "latentspeed-decode-bf16"),
        ("triton-fp8_e4m3", "latentspeed-decode-fp8_e4m3"),
    ],
}


ENGINE_ENV = {"latentspeed-w8-fused": {"LATENTSPEED_FUSE_NORM_QUANT": "1", "LATENTSPEED_FUSE_SILU_QUANT": "1"}}


def is_floor(engine: str) -> bool:
    return engine == "triton-bf16"


def engine_kwargs(model: str, engine: str) -> dict:
    """``sgl.Engine``'s arguments for one of ``ENGINES`` (SGLang's server arguments)."""
    backend, kv_dtype, page_size, quantization = ENGINES[engine]
    return dict(
        model_path=model,
        quantization=quantization,
        skip_tokenizer_init=True,
        attention_backend=backend,
        prefill_attention_backend=PREFILL_BACKENDS.get(engine),
        kv_cache_dtype=kv_dtype,
        page_size=page_size,
        context_length=17_000,
        mem_fraction_static=0.7,
        random_seed=0,
        cuda_graph_max_bs_decode=64,
        log_level="info",  # sgl.Engine's default, "error", hides latentspeed's warm-up lines
    )


def make_engine(model: str, engine: str):
    import sglang as sgl

    return sgl.Engine(**engine_kwargs(model, engine))


def generate(engine, token_prompts, max_tokens=GEN_TOKENS):
    params = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
    outs = engine.generate(input_ids=token_prompts, sampling_params=params, return_logprob=True)
    return [
        {"prompt": prompt, "tokens": out["output_ids"], "logprobs": [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]}
        for prompt, out in zip(token_prompts, outs)
    ]


def score(engine, sequences):
    """Input log-probs of each sequence's generated tokens (the prefill path)."""
    full = [s["prompt"] + s["tokens"] for s in sequences]
    # Entry 0 of input_token_logprobs is the start token itself (no log-prob): start one early.
    starts = [len(s["prompt"]) - 1 for s in sequences]
    outs = engine.generate(input_ids=full, sampling_params={"temperature": 0.0, "max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=starts)
    scored = []
    for seq, out in zip(sequences, outs):
        entries = out["meta_info"]["input_token_logprobs"][1:]
        assert [tok for _, tok, _ in entries] == seq["tokens"], "scored tokens do not line up"
        scored.append([lp for lp, _, _ in entries])
    return scored


def throughput(engine, num_requests, prompt_len, out_len, seed):
    def batch(s):
        return prompts(s, num_requests, prompt_len, prompt_len)

    def run_pass(i):
        t0 = time.perf_counter()
        engine.generate(input_ids=batch(seed + 2 * i + 1), sampling_params={"max_new_tokens": 1, "ignore_eos": True})
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate(input_ids=batch(seed + 2 * i), sampling_params={"max_new_tokens": out_len, "ignore_eos": True})
        return prefill_s, time.perf_counter() - t0

    return timed_passes(run_pass, num_requests, prompt_len, out_len)


def worker(args):
    task = json.loads(Path(args.task).read_text())
    engine = make_engine(task["model"], task["engine"])
    result = {"engine": task["engine"], "scores": {}}
    try:
        if task.get("generate"):
            token_prompts = prompts(0, 8, 3000, 12000)
            result["generated"] = generate(engine, token_prompts)
            if ENGINES[task["engine"]][0] == "latentspeed":
                again = generate(engine, token_prompts)  # radix-cache hit on every prompt
                diffs = [abs(a - b) for s, t in zip(result["generated"], again) for a, b in zip(s["logprobs"], t["logprobs"])]
                same = all(s["tokens"] == t["tokens"] for s, t in zip(result["generated"], again))
                result["prefix_cache_rerun"] = {"same_tokens": same, "max_abs_logprob_diff": max(diffs)}
        for other in task.get("score", []):
            sequences = json.loads(Path(task["workdir"], f"{other}.json").read_text())["generated"]
            result["scores"][other] = score(engine, sequences)
        if task.get("throughput"):
            result["throughput"] = [throughput(engine, 64, 1024, 128, seed=10), throughput(engine, 16, 16_000, 128, seed=20)]
    finally:
        engine.shutdown()
    Path(task["workdir"], f"{task['engine']}{task.get('suffix', '')}.json").write_text(json.dumps(result))


def main():
    args = parse_args(__doc__, PAIRS, "/tmp/latentspeed-e2e-sglang", "e2e-sglang.json")
    if args.cmd == "worker":
        worker(args)
    else:
        driver(args, tuple(ENGINES), PAIRS, __file__, is_floor, ENGINE_ENV)


if __name__ == "__main__":
    main()
