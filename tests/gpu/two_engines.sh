#!/usr/bin/env bash
# Both engines at once on a two-GPU host (device kind nvidia-h200-x2), each from its own bundle
# (/tmp/gpu-site-ENGINE), detached so that the steps outlive the call that starts them: later
# calls can carry data in (wait-checkpoints) and collect what is done.
#   bash tests/gpu/two_engines.sh start ENGINE GPU "STEPS" [LABEL]
#                                                            run_h200.sh STEPS with ENGINE's bundle on GPU
#                                                            (results in LABEL's folder, default ENGINE's: one
#                                                            engine can run two step lists, on two GPUs)
#   bash tests/gpu/two_engines.sh collect [SECONDS]          wait up to SECONDS (default 0) for every started
#                                                            engine, then pack logs and JSON into $OUT/results.tgz
# Results: /tmp/two-engines/LABEL (run.log, rc when finished) and the e2e work folders' JSON.
set -uo pipefail
root=/tmp/two-engines
case ${1:?start or collect} in
  start)
    engine=${2:?engine} gpu=${3:?gpu} steps=${4:?steps} label=${5:-$2}
    mkdir -p $root/$label
    OUT=$root/$label CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=/tmp/gpu-site-$engine \
      setsid nohup bash -c "bash tests/gpu/run_h200.sh $steps; echo \$? > $root/$label/rc" \
      >$root/$label/run.log 2>&1 </dev/null &
    echo "started $label ($engine) on GPU $gpu: $steps" ;;
  collect)
    deadline=$((SECONDS + ${2:-0}))
    running() { for d in $root/*/; do [ -f "$d/rc" ] || return 0; done; return 1; }
    while [ $SECONDS -lt $deadline ] && running; do sleep 5; done
    for d in $root/*/; do
      echo "== $(basename "$d"): rc $(cat "$d/rc" 2>/dev/null || echo running)"; tail -n 20 "$d/run.log"
    done
    tar -czf "${OUT:?}/results.tgz" -C /tmp two-engines $(cd /tmp && ls -d e2e/*.json e2e-sglang/*.json 2>/dev/null) ;;
esac
