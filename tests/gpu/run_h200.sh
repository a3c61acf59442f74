#!/usr/bin/env bash
# Everything latentspeed measures on the GPU host, in one go (see README, "GPU host").
#   bash tests/gpu/run_h200.sh STEP...    steps: smoke clocks kernels ncu bench bench-small paired-check fp8pv-check fp8pv-rule tune-gemm tune-moe tune-tp8 tune-small untuned-ab fp8-bench fp8-bench-graph moe-bench moe-ws moe-gemms producers-bench vllm-guard e2e-bf16 e2e-fp8 e2e-w8 e2e-w8-ab e2e-decode-ab e2e-w8-fused e2e-w8-silu e2e-wide-floor e2e-wide (vLLM
#                                         bundle on PYTHONPATH), fp8-bench-sglang moe-bench-sglang sglang-e2e-bf16 sglang-e2e-fp8 sglang-e2e-w8 sglang-e2e-w8-fused
#                                         sglang-ct-e2e sglang-serve (SGLang bundle), wait-checkpoints (until $CHECKPOINTS/.complete),
#                                         wait-engine (until a staging call has touched /tmp/gpu-site-*/.ready),
#                                         refmodel (train the reference model; no engine needed),
#                                         refmodel-eval-vllm refmodel-eval-sglang (its perplexity table, that engine staged)
# REFMODEL (default /tmp/refmodel): the reference model's directory; CHECKPOINTS: a folder of its
# quantized checkpoints (latentspeed quantize), added to the refmodel-eval tables; EVAL_ARGS: more
# engine_eval.py options (e.g. --checkpoints-only --parallel 4). tune-gemm and tune-moe write the fp8
# GEMM's and fused MoE's tuned tables to $out and have the later steps use them
# (LATENTSPEED_FP8_GEMM_CONFIGS, LATENTSPEED_FP8_MOE_CONFIGS).
# Logs and JSON land in $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
refmodel=${REFMODEL:-/tmp/refmodel}
status=0
# tune-tp8 and tune-small tune into $out/{gemm,moe}_configs.json: the tables an earlier step wrote there, else
# copies of this card's shipped ones (else empty); the later steps use them
start_tables() {
  local card kind shipped
  card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
  for kind in gemm moe; do
    shipped=common_kernels/fp8/configs/${kind}_$card.json
    if [ ! -f "$out/${kind}_configs.json" ]; then
      if [ -f "$shipped" ]; then cp "$shipped" "$out/${kind}_configs.json"
      else echo '{"configs": {}}' > "$out/${kind}_configs.json"; fi
    fi
  done
  export LATENTSPEED_FP8_GEMM_CONFIGS=$(realpath "$out")/gemm_configs.json \
    LATENTSPEED_FP8_MOE_CONFIGS=$(realpath "$out")/moe_configs.json
}
for step in "$@"; do
  case $step in
    smoke)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/card.txt"
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/card.txt"
      python3 -c "import importlib.metadata as m; print({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name'] in ('vllm', 'sglang', 'latentspeed')})" | tee -a "$out/card.txt"
      git rev-parse HEAD 2>/dev/null | tee -a "$out/card.txt" ;;
    kernels)
      python3 -m pytest -q -x tests/gpu -p no:warnings --durations=5 2>&1 | tail -n 30 | tee "$out/kernels.log" ;;
    ncu)  # Nsight Compute over the decode and GEMM kernels (no engine needed): per-kernel details, raw
      # metrics and per-SASS-instruction stall samples, packed into ncu.tgz (NCU_CASES overrides the cases,
      # NCU_SET sets decode constants for them: ncu_cases --set; NCU_CACHE_CONTROL=none: ncu flushes no cache
      # before a replay pass, where its default, all, flushes them all)
      cases=${NCU_CASES:-decode:e4m3:16:1:32768 decode:bf16:16:1:32768 decode:e4m3:16:2:32768 decode:e4m3:128:1:4096 decode:bf16:128:1:4096 gemm:4096:7168:2048}
      ncu --profile-from-start off --clock-control none --cache-control ${NCU_CACHE_CONTROL:-all} \
        --set full --import-source no \
        -k 'regex:mla_decode_split_kernel|gemm_kernel|gemm_sm90|silu_mul_group_quant' -f -o /tmp/ncu-prof \
        python3 -m benchmarks.ncu_cases $cases ${NCU_SET:+--set $NCU_SET} 2>&1 | tail -n 20 | tee "$out/ncu.log"
      mkdir -p /tmp/ncu-out/src && echo "$cases" > /tmp/ncu-out/cases.txt
      ncu --import /tmp/ncu-prof.ncu-rep --page details > /tmp/ncu-out/details.txt 2>&1
      ncu --import /tmp/ncu-prof.ncu-rep --page raw --csv > /tmp/ncu-out/raw.csv 2>&1
      i=0; for case in $cases; do
        ncu --import /tmp/ncu-prof.ncu-rep --page source --csv --print-source sass --launch-skip $i --launch-count 1 \
          > /tmp/ncu-out/src/src_$i.csv 2>&1; i=$((i + 1))
      done
      tar czf "$out/ncu.tgz" -C /tmp/ncu-out . ;;
    bench)
      python3 benchmarks/mla_decode.py --out "$out/mla_decode.json" 2>&1 | tee "$out/bench.log" | tail -n 80 ;;
    bench-small)  # issue #6's small batches (1 and 8, context 512-4k), as CUDA-graph replays; one process per
      # provider, and FLASHMLA in bf16 only: its fp8 kernel aborts the process at these batch sizes
      # (actual_num_splits <= kMaxSplits, results/mla_decode-splits-2026-12-01.md); FLASH_ATTN_MLA one process
      # per context: at batch 1 its 2048-token replays end in an illegal address (mla_decode-small-batch-2026-12-04.md)
      for batch in 1 8; do for provider in latentspeed FLASHMLA FLASH_ATTN_MLA TRITON_MLA; do
        caches="bf16 e4m3"; [ $provider = FLASHMLA ] && caches=bf16
        runs=512,1024,2048,4096; [ $provider = FLASH_ATTN_MLA ] && runs="512 1024 2048 4096"
        for run in $runs; do
          python3 benchmarks/mla_decode.py --cuda-graph --batch $batch --providers $provider --heads 16 128 --q-len 1 \
            --ctx ${run//,/ } --cache $caches --out "$out/mla_decode_batch${batch}_${provider}_${run//,/_}.json" 2>&1 \
            | tee -a "$out/bench-small.log" | grep -E '^\{|Error' | tail -n 20
        done
      done; done ;;
    clocks)  # SM clock, power and throttle reasons every 500 ms, in the background until the call ends: the power
      # cap (0x4) slows the issue-bound fp8 decode and not bf16 (results/mla_decode-16-heads-2026-12-04.md)
      (nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 500 > "$out/clocks.csv" 2>&1 &) ;;
    paired-check)  # the narrow kernel's paired programs (on by default where splits read 256 tokens or more):
      # the 16-head fp8 decode tests three times (the first paired build raced in its PTX), then A/Bs
      # from the working tree: batch 128 against never pairing, batches 1 and 8
      # against always pairing (results/mla_decode-sm90-narrow-paired-default-2026-12-03.md)
      for i in 1 2 3; do
        python3 -m pytest -q -p no:warnings -rf --tb=short tests/gpu/test_decode_sm90.py \
          -k "(H16 and (e4m3 or e5m2)) or paired_or_not or narrow_tree" 2>&1 | tail -n 12 \
          | tee -a "$out/paired-check.log"
      done
      python3 -m benchmarks.mla_decode_ab --base common_kernels/mla --base-set decode_sm90_narrow.PAIRED_FP8=0 \
        --heads 16 --q-len 1 2 --cache e4m3 e5m2 --both-orders --out "$out/paired-ab.jsonl" 2>&1 | tail -n 3
      for batch in 1 8; do
        python3 -m benchmarks.mla_decode_ab --base common_kernels/mla \
          --base-set decode_sm90_narrow.MIN_TOKENS_PER_PAIRED_SPLIT=0 --batch $batch --heads 16 --q-len 1 2 \
          --ctx 512 1024 2048 4096 --cache e4m3 --both-orders \
          --out "$out/paired-ab-batch$batch.jsonl" 2>&1 | tail -n 2
      done ;;
    fp8pv-check)  # the 64-row kernel's fp8 P V: its 128-head fp8 GPU tests, then A/Bs from the working tree against
      # the widened fp16 P V (USE_FP8_PV=0) and against one pair of tile buffers (FP8_PV_RING_PAIRS=1), both orders
      python3 -m pytest -q -p no:warnings -rf --tb=short tests/gpu/test_decode_sm90.py -k "H128 and (e4m3 or e5m2)" \
        2>&1 | tail -n 12 | tee "$out/fp8pv-check.log"
      python3 -m pytest -q -p no:warnings -rf --tb=short tests/gpu/test_kernels_full_size.py -k "H128 or tree or ragged" \
        2>&1 | tail -n 12 | tee -a "$out/fp8pv-check.log"
      python3 -m benchmarks.mla_decode_ab --base common_kernels/mla --base-set decode_sm90_seesaw.USE_FP8_PV=0 \
        --heads 128 --q-len 1 2 --cache e4m3 e5m2 --both-orders --out "$out/fp8pv-ab.jsonl" 2>&1 | tail -n 3
      python3 -m benchmarks.mla_decode_ab --base common_kernels/mla --base-set decode_sm90_seesaw.FP8_PV_RING_PAIRS=1 \
        --heads 128 --q-len 1 2 --cache e4m3 --both-orders --out "$out/fp8pv-ring-ab.jsonl" 2>&1 | tail -n 3 ;;
    fp8pv-rule)  # the 64-row kernel's plan rule (decode_sm90_seesaw.fp8_pv_pays): fp8 P V everywhere against the
      # widened fp16 P V everywhere, same kernels, batches 1-16 at 128 and 64 heads, both orders
      # (results/mla_decode-fp8-pv-rule-sweep-h100-2026-12-07-s53.md; E5M2 and 64 heads: ...-h200-2026-12-07-s54.md)
      for heads in 128 64; do for batch in 1 2 4 8 16; do
        python3 -m benchmarks.mla_decode_ab --base common_kernels/mla \
          --ours-set decode_sm90_seesaw.MIN_TOKENS_PER_FP8_PV_SPLIT=0 --base-set decode_sm90_seesaw.USE_FP8_PV=0 \
          --batch $batch --heads $heads --q-len 1 2 --ctx 512 1024 2048 4096 6144 8192 16384 --cache e4m3 e5m2 \
          --both-orders --out "$out/fp8pv-rule-h${heads}-b${batch}.jsonl" 2>&1 | tail -n 2
      done; done ;;
    tune-gemm)
      python3 -m benchmarks.tune_fp8_gemm --out "$out/gemm_configs.json" 2>"$out/tune-gemm.err" | tee "$out/tune-gemm.log" \
        && export LATENTSPEED_FP8_GEMM_CONFIGS=$(realpath "$out")/gemm_configs.json ;;
    tune-moe)
      python3 -m benchmarks.tune_fp8_moe --out "$out/moe_configs.json" 2>"$out/tune-moe.err" | tee "$out/tune-moe.log" \
        && export LATENTSPEED_FP8_MOE_CONFIGS=$(realpath "$out")/moe_configs.json ;;
    tune-tp8)  # DeepSeek-V3's shapes under -tp 8 (fp8_gemm.TP8_SHAPES, fp8_moe's deepseek_v3_tp8) added to the tables
      start_tables
      tp8=$(python3 -c "from benchmarks.fp8_gemm import TP8_SHAPES; print(*(f'{n},{k}' for n, k in TP8_SHAPES))")
      python3 -m benchmarks.tune_fp8_gemm --shapes $tp8 --update "$out/gemm_configs.json" --out "$out/gemm_configs.json" \
        2>"$out/tune-tp8.err" | tee "$out/tune-tp8.log" \
        && python3 -m benchmarks.tune_fp8_moe --shapes deepseek_v3_tp8 --update "$out/moe_configs.json" \
        --out "$out/moe_configs.json" 2>>"$out/tune-tp8.err" | tee -a "$out/tune-tp8.log" ;;
    tune-small)  # the small sizes again with swapped products (SWAP_AB) among the candidates: GEMM M = 1-64 (the
      # issue's shapes), MoE 1-256 tokens (DeepSeek-V3's experts and the tiny model's), into the tables
      start_tables
      python3 -m benchmarks.tune_fp8_gemm --m 1 16 64 --update "$out/gemm_configs.json" --out "$out/gemm_configs.json" \
        2>"$out/tune-small.err" | tee "$out/tune-small.log" \
        && python3 -m benchmarks.tune_fp8_moe --shapes deepseek_v3 tiny --tokens 1 16 64 256 \
        --update "$out/moe_configs.json" --out "$out/moe_configs.json" 2>>"$out/tune-small.err" | tee -a "$out/tune-small.log" ;;
    untuned-ab)  # the Hopper default launches against the Triton-only ones, on the -tp 8 and unsharded shapes
      python3 -m benchmarks.fp8_untuned --out "$out/fp8_untuned.jsonl" 2>&1 | tee "$out/untuned-ab.log" | tail -n 60 ;;
    fp8-bench)
      python3 benchmarks/fp8_gemm.py --providers latentspeed latentspeed-sm90 latentspeed-sm90-ws vLLM-Triton \
        vLLM-CUTLASS vLLM-DeepGEMM cuBLAS-bf16 \
        --out "$out/fp8_gemm.json" 2>&1 | tee "$out/fp8-bench.log" | tail -n 40 ;;
    fp8-bench-graph)  # the same providers as CUDA-graph replays at decode sizes; SHAPES="N,K ..." picks shapes
      python3 benchmarks/fp8_gemm.py --cuda-graph --m 1 16 64 128 256 512 ${SHAPES:+--shapes $SHAPES} \
        --providers latentspeed vLLM-Triton vLLM-CUTLASS vLLM-DeepGEMM cuBLAS-bf16 \
        --out "$out/fp8_gemm_graph.json" 2>&1 | tee "$out/fp8-bench-graph.log" | grep -E '^\{|Error' | tail -n 40 ;;
    fp8-bench-sglang)
      python3 benchmarks/fp8_gemm.py --providers latentspeed SGLang-Triton SGLang-CUTLASS cuBLAS-bf16 \
        --out "$out/fp8_gemm_sglang.json" 2>&1 | tee "$out/fp8-bench-sglang.log" | tail -n 40 ;;
    moe-bench-sglang)  # the fused MoE against SGLang's Triton fused_experts, eager and as CUDA-graph replays
      python3 benchmarks/fp8_moe.py --out "$out/fp8_moe_sglang.json" 2>&1 | tee "$out/moe-bench-sglang.log" \
        | tail -n 40 \
        && python3 benchmarks/fp8_moe.py --cuda-graph --out "$out/fp8_moe_sglang_graph.json" 2>&1 \
        | tee -a "$out/moe-bench-sglang.log" | tail -n 40 ;;
    wait-checkpoints)
      until [ -f "${CHECKPOINTS:?}/.complete" ]; do sleep 5; done ;;
    wait-engine)  # steps before it need no engine: they run while the later calls stage one
      until ls /tmp/gpu-site-*/.ready >/dev/null 2>&1; do sleep 5; done ;;
    moe-bench)
      python3 benchmarks/fp8_moe.py --out "$out/fp8_moe.json" 2>&1 | tee "$out/moe-bench.log" | tail -n 40 \
        && python3 benchmarks/fp8_moe.py --cuda-graph --out "$out/fp8_moe_graph.json" 2>&1 | tee -a "$out/moe-bench.log" | tail -n 40 ;;
    moe-ws)  # the fused MoE's warp-specialized Hopper GEMMs: their GPU tests, then both on them against the table
      # and vLLM as CUDA-graph replays (fp8_moe.py --ws); no engine needed for the tests
      python3 -m pytest -q -p no:warnings -rf --tb=short tests/gpu/test_moe_sm90_ws.py 2>&1 | tail -n 30 \
        | tee "$out/moe-ws-tests.log"
      python3 benchmarks/fp8_moe.py --cuda-graph --ws --tokens 256 1024 4096 --out "$out/fp8_moe_ws.json" 2>&1 \
        | tee "$out/moe-ws.log" | grep -E '^\{|Error' | tail -n 40 ;;
    moe-gemms)  # the MoE's two expert GEMMs alone on one set of sorted rows: ours (ws, Triton) against DeepGEMM's
      # grouped contiguous GEMM, as CUDA-graph replays (vLLM bundle: DeepGEMM comes with it)
      python3 -m benchmarks.fp8_moe_gemms --out "$out/fp8_moe_gemms.json" 2>&1 | tee "$out/moe-gemms.log" \
        | grep -E '^\{|Error|unavailable' | tail -n 40 ;;
    producers-bench)  # RMSNorm / SiLU-and-mul + group quantization: latentspeed's fused kernels against vLLM's
      python3 -m benchmarks.fp8_producers --out "$out/fp8_producers.json" 2>&1 | tee "$out/producers-bench.log" | tail -n 40 ;;
    vllm-guard)  # LATENTSPEED_FP8_GUARD=raise under FLASHMLA with latentspeed_fp8: the logits processor stops the engine
      OUT=$out python3 tests/gpu/vllm_ct_e2e.py guard 2>&1 | tail -n 5 ;;
    e2e-bf16)
      python3 tests/gpu/vllm_e2e.py --group bf16 --throughput --workdir /tmp/e2e --out "$out/e2e-bf16.json" 2>&1 \
        | tee "$out/e2e-bf16.log" | grep -E '^\[e2e\]|Error|error|Traceback' | tail -n 60 ;;
    e2e-w8)  # block-FP8 weights: latentspeed_fp8 vs vLLM's fp8_per_block (both quantize the bf16 checkpoint)
      python3 tests/gpu/vllm_e2e.py --group w8 --throughput --reuse --workdir /tmp/e2e --out "$out/e2e-w8.json" 2>&1 \
        | tee "$out/e2e-w8.log" | grep -E '^\[e2e\]|Error|error|Traceback' | tail -n 60 ;;
    e2e-w8-ab)  # throughput alone, vLLM's fp8_per_block against latentspeed_fp8 under FLASHMLA, in the order A B B A
      # (passes pooled per engine): host drift between processes falls on both (results/vllm-moe-warmup-h100-*-s47.md)
      python3 tests/gpu/vllm_e2e.py --throughput-only FLASHMLA-w8 FLASHMLA-w8-latentspeed FLASHMLA-w8-latentspeed \
        FLASHMLA-w8 --workdir /tmp/e2e --out "$out/e2e-w8-ab.json" 2>&1 | tee "$out/e2e-w8-ab.log" \
        | grep -E '^\[e2e\]|Error|error|Traceback' | tail -n 60 ;;
    e2e-decode-ab)  # throughput alone, FLASHMLA against CUSTOM's default (our decode, vLLM's prefill), bf16, A B B A
      python3 tests/gpu/vllm_e2e.py --throughput-only FLASHMLA-bf16 latentspeed-decode-bf16 latentspeed-decode-bf16 \
        FLASHMLA-bf16 --workdir /tmp/e2e --out "$out/e2e-decode-ab.json" 2>&1 | tee "$out/e2e-decode-ab.log" \
        | grep -E '^\[e2e\]|Error|error|Traceback' | tail -n 60 ;;
    e2e-w8-fused)  # latentspeed_fp8 (RMSNorm and SiLU-and-mul fused, the default) against no fusion (agreement, throughput, matches)
      python3 tests/gpu/vllm_e2e.py --group w8-fused --throughput --reuse --workdir /tmp/e2e --out "$out/e2e-w8-fused.json" \
        2>&1 | tee "$out/e2e-w8-fused.log" | grep -E '^\[e2e\]|Error|error|Traceback' | tail -n 60 ;;
    e2e-w8-silu)  # latentspeed_fp8 (the default) against LATENTSPEED_FUSE_SILU_QUANT=0 (agreement, throughput, matches)
      python3 tests/gpu/vllm_e2e.py --group w8-silu --throughput --reuse --workdir /tmp/e2e --out "$out/e2e-w8-silu.json" \
        2>&1 | tee "$out/e2e-w8-silu.log" | grep -E '^\[e2e\]|Error|error|Traceback' | tail -n 60 ;;
    e2e-wide-floor)  # the bf16 group (FLASHMLA against TRITON_MLA: the floor) at DeepSeek-V3's widths; e2e-wide then judges by it
      python3 tests/gpu/vllm_e2e.py --group bf16 --widths deepseek-v3 --reuse --workdir /tmp/e2e-wide \
        --out "$out/e2e-wide-bf16.json" 2>&1 | tee "$out/e2e-wide-bf16.log" | grep -E '^\[e2e\]|Error|error|Traceback' \
        | tail -n 60
      [ -f "$out/e2e-wide-bf16.json" ] && export E2E_WIDE_FLOOR=$(realpath "$out/e2e-wide-bf16.json") ;;
    e2e-wide)  # the w8-fused and w8-silu groups on DeepSeek-V3's widths (examples/tiny_deepseek_v3.py --widths deepseek-v3)
      for group in w8-fused w8-silu; do
        python3 tests/gpu/vllm_e2e.py --group $group --widths deepseek-v3 --throughput --reuse --workdir /tmp/e2e-wide \
          ${E2E_WIDE_FLOOR:+--floor "$E2E_WIDE_FLOOR"} \
          --out "$out/e2e-wide-$group.json" 2>&1 | tee "$out/e2e-wide-$group.log" | grep -E '^\[e2e\]|Error|error|Traceback' \
          | tail -n 60
        [ "${PIPESTATUS[0]}" = 0 ] || { echo "e2e-wide group $group failed"; status=1; }
      done ;;
    e2e-fp8)
      python3 tests/gpu/vllm_e2e.py --group fp8 --throughput --reuse --workdir /tmp/e2e --out "$out/e2e-fp8.json" 2>&1 \
        | tee "$out/e2e-fp8.log" | grep -E '^\[e2e\]|Error|error|Traceback' | tail -n 60 ;;
    refmodel)  # trains into $REFMODEL; comes back as $out/refmodel.tar.NN (15 MiB pieces: cat them, untar)
      python3 -m benchmarks.reference_model.train --out "$refmodel" 2>&1 | tail -n 20 \
        && tar -C "$(dirname "$refmodel")" -cf - "$(basename "$refmodel")" | split -b 15m -d - "$out/refmodel.tar." \
        && cp "$refmodel/metrics.json" "$out/refmodel-metrics.json" ;;
    sglang-serve)  # python -m sglang.launch_server --attention-backend latentspeed, a streamed completion
      python3 tests/gpu/sglang_serve.py --model "$refmodel" --out "$out/sglang-serve.json" 2>&1 \
        | tee "$out/sglang-serve.log" | grep -E '^\[serve\]|Error|error|Traceback' | tail -n 60 ;;
    refmodel-eval-vllm|refmodel-eval-sglang)  # the table of engine_eval.py; quantized checkpoints from $CHECKPOINTS
      engine=${step#refmodel-eval-}
      ckpts=(); for d in "${CHECKPOINTS:-/nonexistent}"/*/; do [ -f "$d/config.json" ] && ckpts+=(--checkpoint "$(basename "$d")=$d"); done
      python3 -m benchmarks.reference_model.engine_eval --engine "$engine" --model "$refmodel" "${ckpts[@]}" ${EVAL_ARGS:-} \
        --out "$out/$step.json" 2>"$out/$step.log" | tee "$out/$step.md" ;;
    sglang-e2e-bf16|sglang-e2e-fp8|sglang-e2e-w8|sglang-e2e-w8-fused)  # w8-fused: sglang_plugin/fusion.py on
      group=${step#sglang-e2e-}
      python3 tests/gpu/sglang_e2e.py --group "$group" --throughput --reuse --workdir /tmp/e2e-sglang \
        --out "$out/$step.json" 2>&1 | tee "$out/$step.log" | grep -E '^\[e2e\]|Error|error|Traceback' | tail -n 60
      if [ "$group" = w8 ]; then  # SGLang's own fp8, which the group no longer pairs (sglang_e2e.py's PAIRS)
        python3 tests/gpu/sglang_e2e.py --throughput-only flashinfer-w8 --workdir /tmp/e2e-sglang \
          --out "$out/$step-sglang-fp8.json" 2>&1 | grep -E '^\[e2e\]|Error|error|Traceback' | tail -n 20
      fi ;;
    sglang-ct-e2e)  # FP8-block checkpoints: latentspeed_fp8 against SGLang's methods, side by side; then the guard
      ct=tests/gpu/sglang_ct_e2e.py; engines="sglang-ct sglang-fp8 ours sglang-ct-fp8kv ours-fp8kv"
      python3 $ct write && { for e in $engines; do OUT=$out python3 $ct engine $e > "$out/sgl-ct-$e.log" 2>&1 & done; wait; } \
        && for pair in "sglang-ct ours" "sglang-fp8 ours" "sglang-ct sglang-fp8" "sglang-ct sglang-ct-fp8kv" "ours ours-fp8kv"; do
          OUT=$out python3 $ct compare $pair; done && OUT=$out python3 $ct guard ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "step $step failed rc=$rc"; status=1; }
done
exit $status
