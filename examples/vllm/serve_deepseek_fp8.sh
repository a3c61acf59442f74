#!/usr/bin/env bash
# Serve a DeepSeek-V3-architecture model through vLLM 0.26 with block-FP8 weights on latentspeed's
# GEMM (--quantization latentspeed_fp8) and latentspeed's MLA decode over an fp8 KV cache; prefill stays
# with vLLM's, faster on Hopper (-ac '{"mla_prefill_backend": "CUSTOM"}' selects latentspeed's).
#   bash examples/vllm/serve_deepseek_fp8.sh MODEL_DIR [extra vllm serve arguments]
# MODEL_DIR: DeepSeek-V3's own FP8 checkpoint, an llm-compressor FP8 block checkpoint
# (latentspeed quantize --recipe fp8-block), or a bf16 checkpoint (quantized while loading).
set -euo pipefail
model=${1:?usage: serve_deepseek_fp8.sh MODEL_DIR [vllm serve args]}
shift
exec vllm serve "$model" \
  --quantization latentspeed_fp8 \
  --attention-backend CUSTOM \
  --kv-cache-dtype fp8_e4m3 \
  --block-size 64 \
  "$@"
