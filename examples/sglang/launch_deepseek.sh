#!/usr/bin/env bash
# Serve a DeepSeek-V3-architecture model through SGLang 0.5.17 with latentspeed's MLA backend
# and an fp8 E5M2 KV cache (OpenAI-compatible server on :30000).
#   bash examples/sglang/launch_deepseek.sh MODEL_DIR [extra sglang.launch_server arguments]
# latentspeed registers itself through SGLang's `sglang.srt.plugins` entry point once installed
# (pip install '.[sglang]' from a checkout). Pages of 64 tokens: the backend takes 16, 32 or 64.
# For EAGLE, keep --speculative-eagle-topk 1 (SGLang refuses topk > 1 with pages > 1 for any
# backend but flashinfer/fa3/triton) and give the draft model its own backend:
#   --speculative-algorithm EAGLE --speculative-draft-attention-backend triton ...
set -euo pipefail
model=${1:?usage: launch_deepseek.sh MODEL_DIR [sglang args]}
shift
exec python -m sglang.launch_server \
  --model-path "$model" \
  --attention-backend latentspeed \
  --kv-cache-dtype fp8_e5m2 \
  --page-size 64 \
  "$@"
