"""FP8-block checkpoints in stock SGLang on a GPU: latentspeed_fp8 against SGLang's own methods, and
the fp8 guard failing fast inside the engine.

The SGLang twin of ``vllm_ct_e2e.py``. ``write`` puts ``tests/tiny_checkpoints.py``'s tiny
DeepSeek-V3 (16 heads, 4 routed experts and a shared one, random weights at init scale) in three
folders: as llm-compressor writes an FP8 block recipe (``/tmp/sgl-ct``), the same quantized weights
in DeepSeek-V3's own FP8 format (``/tmp/sgl-ds``), and the compressed-tensors one again with every
``kv_a_layernorm`` weight at 4000, so that the latent cache overflows E4M3 (``/tmp/sgl-overflow``).

Engines, one per process (``sgl.Engine``, eager; they fit side by side on one GPU):
- ``sglang-ct``: SGLang's compressed-tensors method, triton attention;
- ``sglang-fp8``: SGLang's ``fp8`` method on the DeepSeek-format copy, triton attention;
- ``ours``: ``--quantization latentspeed_fp8`` and ``--attention-backend latentspeed`` on the
  compressed-tensors checkpoint (our linear layers, and its experts on our fused MoE);
- ``sglang-ct-fp8kv`` and ``ours-fp8kv``: the same with an E4M3 cache.

Each scores 8 random prompts of 200-1800 tokens (prompt log-probs: the prefill path) and decodes
32 greedy tokens after each (the decode path). ``compare A B`` prints |Δ log-prob| over the
prompts, and over each decode up to the first token where the two differ.

``guard`` starts ``ours-fp8kv`` on the overflowing checkpoint with ``LATENTSPEED_FP8_GUARD=raise``
and CUDA graphs, in a child process, and decodes 320 tokens: the guard is read every 256 forward
passes from SGLang's ``ModelRunner.forward`` hook, so the engine must stop with
``Fp8NumericsError`` (exit status 1 here otherwise).

    python3 tests/gpu/sglang_ct_e2e.py write
    python3 tests/gpu/sglang_ct_e2e.py engine ours
    python3 tests/gpu/sglang_ct_e2e.py compare sglang-ct ours
    python3 tests/gpu/sglang_ct_e2e.py guard

Files go to ``$OUT`` (default ``./gpu-out``).
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.gpu.vllm_ct_e2e import compare_results, expect_guard_stop  # noqa: E402
from tests.gpu.vllm_e2e import prompts  # noqa: E402

OUT = Path(os.environ.get("OUT", "gpu-out"))
CHECKPOINTS = {"ct": Path("/tmp/sgl-ct"), "ds": Path("/tmp/sgl-ds"), "overflow": Path("/tmp/sgl-overflow")}
ENGINES = {  # name: (checkpoint, quantization, attention backend, kv-cache dtype, page size)
    "sglang-ct": ("ct", None, "triton", "auto", None),
    "sglang-fp8": ("ds", "fp8", "triton", "auto", None),
    "sglang-ct-fp8kv": ("ct", None, "triton", "fp8_e4m3", None),
    "ours": ("ct", "latentspeed_fp8", "latentspeed", "auto", 64),
    "ours-fp8kv": ("ct", "latentspeed_fp8", "latentspeed", "fp8_e4m3", 64),
}
GUARD_TOKENS = 320


def make_engine(name: str, checkpoint: Path | None = None, eager: bool = True):
    import sglang as sgl

    ckpt, quantization, backend, kv_dtype, page_size = ENGINES[name]
    return sgl.Engine(model_path=str(checkpoint or CHECKPOINTS[ckpt]), quantization=quantization,
                      skip_tokenizer_init=True, attention_backend=backend, kv_cache_dtype=kv_dtype,
                      page_size=page_size, context_length=4096, mem_fraction_static=0.12, random_seed=0,
                      disable_cuda_graph=eager, cuda_graph_max_bs_decode=4)


def run_engine(name: str) -> None:
    engine = make_engine(name)
    try:
        token_prompts = prompts(0, 8, 200, 1799, vocab=1024)
        scored = engine.generate(input_ids=token_prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 1},
                                 return_logprob=True, logprob_start_len=0)
        decoded = engine.generate(input_ids=token_prompts, return_logprob=True,
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True})
    finally:
        engine.shutdown()
    result = {
        # entry 0 is the first prompt token itself (no log-prob)
        "prompt_logprobs": [[lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]] for out in scored],
        "tokens": [out["output_ids"] for out in decoded],
        "logprobs": [[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] for out in decoded],
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"sgl-ct-{name}.json").write_text(json.dumps(result))
    print(name, "done", flush=True)


def write() -> None:
    from tests.tiny_checkpoints import bf16_tensors, write_checkpoint

    tensors = bf16_tensors()
    write_checkpoint(CHECKPOINTS["ct"], "compressed_tensors", tensors)
    write_checkpoint(CHECKPOINTS["ds"], "deepseek_fp8", tensors)
    overflow = {k: w * 4000 if k.endswith("kv_a_layernorm.weight") else w for k, w in tensors.items()}
    write_checkpoint(CHECKPOINTS["overflow"], "compressed_tensors", overflow)


def guard_child() -> None:
    engine = make_engine("ours-fp8kv", CHECKPOINTS["overflow"], eager=False)
    engine.generate(input_ids=prompts(1, 1, 64, 64, vocab=1024),
                    sampling_params={"temperature": 0.0, "max_new_tokens": GUARD_TOKENS, "ignore_eos": True})
    engine.shutdown()
    print("[guard] the engine decoded every token without stopping", flush=True)


def main() -> None:
    command = sys.argv[1]
    if command == "write":
        write()
    elif command == "engine":
        run_engine(sys.argv[2])
    elif command == "compare":
        row = compare_results(OUT / f"sgl-ct-{sys.argv[2]}.json", OUT / f"sgl-ct-{sys.argv[3]}.json",
                              sys.argv[2], sys.argv[3])
        with open(OUT / "sgl-ct-compare.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    elif command == "guard":
        raise SystemExit(expect_guard_stop(__file__, "sgl-guard"))
    elif command == "guard-child":
        guard_child()
    else:
        raise SystemExit(f"unknown command {command!r}: write, engine NAME, compare A B or guard")


if __name__ == "__main__":
    main()
