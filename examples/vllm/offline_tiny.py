"""Offline generation with latentspeed's MLA backend on the tiny DeepSeek-V3 checkpoint.

    python examples/tiny_deepseek_v3.py /tmp/tiny-dsv3
    python examples/vllm/offline_tiny.py /tmp/tiny-dsv3 --kv-cache-dtype fp8_e5m2
"""

import argparse

from vllm import LLM, SamplingParams, TokensPrompt


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    args = parser.parse_args()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,  # the tiny checkpoint ships no tokenizer
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=64,
        attention_config={"backend": "CUSTOM", "mla_prefill_backend": "CUSTOM"},
    )
    prompts = [TokensPrompt(prompt_token_ids=list(range(100 + i, 1100 + i))) for i in range(4)]
    for out in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)):
        print(out.outputs[0].token_ids)


if __name__ == "__main__":
    main()
