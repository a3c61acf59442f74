#!/usr/bin/env bash
# Serve a DeepSeek-V3-architecture model through vLLM 0.26 with latentspeed's MLA backend
# (decode; prefill stays with vLLM's, faster on Hopper) and an fp8 E5M2 KV cache, which no built-in vLLM
# MLA backend takes. Add -ac '{"mla_prefill_backend": "CUSTOM"}' for latentspeed's Triton prefill too.
#   bash examples/vllm/serve_deepseek.sh MODEL_DIR [extra vllm serve arguments]
# latentspeed registers itself through vLLM's plugin entry point once installed
# (pip install '.[vllm]' from a checkout); `latentspeed info` shows what is usable on this GPU.
set -euo pipefail
model=${1:?usage: serve_deepseek.sh MODEL_DIR [vllm serve args]}
shift
exec vllm serve "$model" \
  --attention-backend CUSTOM \
  --kv-cache-dtype fp8_e5m2 \
  --block-size 64 \
  "$@"
