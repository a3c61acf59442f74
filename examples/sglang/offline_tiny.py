"""Offline generation with latentspeed's MLA backend in SGLang on the tiny DeepSeek-V3 checkpoint.

    python examples/tiny_deepseek_v3.py /tmp/tiny-dsv3
    python examples/sglang/offline_tiny.py /tmp/tiny-dsv3 --kv-cache-dtype fp8_e5m2
"""

import argparse

import sglang as sgl


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    args = parser.parse_args()
    engine = sgl.Engine(
        model_path=args.model,
        skip_tokenizer_init=True,  # the tiny checkpoint ships no tokenizer
        attention_backend="latentspeed",
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=64,
    )
    prompts = [list(range(100 + i, 1100 + i)) for i in range(4)]
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    for out in engine.generate(input_ids=prompts, sampling_params=params):
        print(out["output_ids"])
    engine.shutdown()


if __name__ == "__main__":
    main()
