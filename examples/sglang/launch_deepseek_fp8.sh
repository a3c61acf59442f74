#!/usr/bin/env bash
# Launch SGLang 0.5.17 on a DeepSeek-V3-architecture model with block-FP8 weights on latentspeed's
# GEMM (--quantization latentspeed_fp8) and latentspeed's MLA backend over an fp8 KV cache.
#   bash examples/sglang/launch_deepseek_fp8.sh MODEL_DIR [extra launch_server arguments]
# MODEL_DIR: DeepSeek-V3's own FP8 checkpoint, an llm-compressor FP8 block checkpoint
# (latentspeed quantize --recipe fp8-block), or a bf16 checkpoint (quantized after loading).
set -euo pipefail
model=${1:?usage: launch_deepseek_fp8.sh MODEL_DIR [launch_server args]}
shift
exec python -m sglang.launch_server --model-path "$model" \
  --quantization latentspeed_fp8 \
  --attention-backend latentspeed \
  --kv-cache-dtype fp8_e4m3 \
  --page-size 64 \
  "$@"
