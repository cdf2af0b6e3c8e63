#!/usr/bin/env bash
# The recorded run on one H200: the GPU tests, then every benchmark with the Qwen2.5-1.5B shape and dummy
# weights (about 7 minutes). Each result JSON goes to $OUT (default bench/results/), beside run_all.log.
#
#   bash bench/run_all.sh                       # every step, in this order:
#   bash bench/run_all.sh latency serving       # tests latency throughput trace startup serving profile
#   bash bench/run_all.sh latency-eager kernels # not in the default run: the device returns 8 files at most
#   bash bench/run_all.sh kernels-fp8 fp8       # FP8 weights (issue 33): the linears' paths; latency, throughput
#   bash bench/run_all.sh serving-json          # serving under a JSON schema at concurrency 1 and 64 (issue 34)
#
# It fetches nothing. Python packages the machine lacks travel as wheels in .whl/ (carried) and are
# installed from there. On a copied tree set BENCH_COMMIT=<hash>: results name it (the copy's .git may be stale).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run_all.log") 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
MODEL=(--model qwen2.5-1.5b --load-format dummy --out "$OUT")
FAILED=()

step() {  # name, time limit in seconds, command...: a step that fails or overruns does not stop the others
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S)): $*"
  timeout -k 10 "$limit" "$@"
  rc=$?
  echo "=== $name: rc=$rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || FAILED+=("$name")
  return "$rc"
}

for name in ${*:-tests latency throughput trace startup serving profile}; do
  case $name in
    tests) step tests 240 python3 -m bench.gpu_tests --out "$OUT" ;;
    latency) step latency 110 python3 -m bench.latency "${MODEL[@]}" --baseline hf --max-tokens 129 ;;
    throughput) step throughput 200 python3 -m bench.throughput "${MODEL[@]}" --baseline hf --hf-batch 16 --hf-num-seqs 16 ;;
    startup) step startup 180 python3 -m bench.startup --cold "${MODEL[@]}" ;;
    serving) step serving 90 python3 -m bench.serving "${MODEL[@]}" ;;
    serving-json) step serving-json 90 python3 -m bench.serving "${MODEL[@]}" --concurrency 1 64 --json-schema ;;
    profile) step profile 120 python3 -m bench.profile "${MODEL[@]}" ;;
    kernels) step kernels 150 python3 -m bench.kernels --out "$OUT" ;;
    kernels-fp8) step kernels-fp8 300 python3 -m bench.kernels --rows 1 4 16 64 128 256 --attention 1:32:32768 \
                   --fp8 channel --out "$OUT" ;;
    fp8) step latency-fp8 110 python3 -m bench.latency "${MODEL[@]}" --quantization fp8 --max-tokens 129 \
         --prompt-lens 32 1024
         step throughput-fp8 200 python3 -m bench.throughput "${MODEL[@]}" --quantization fp8
         step latency-fp8-qwen3 110 python3 -m bench.latency --model qwen3-1.7b --load-format dummy --out "$OUT/qwen3" \
           --quantization fp8 --max-tokens 129 --prompt-lens 32 1024 ;;
    latency-eager) step latency-eager 50 python3 -m bench.latency "${MODEL[@]}" --enforce-eager --prompt-lens 32 --max-tokens 65 --repeats 1 ;;
    # Batch-1 decode traced (the engine merges its processes' traces as it stops); only summary.txt kept.
    trace) rm -rf /tmp/bench-trace
           step trace 40 python3 -m bench.latency "${MODEL[@]}" --prompt-lens 32 --max-tokens 129 --repeats 1 \
             --trace-dir /tmp/bench-trace --out /tmp/bench-trace-results \
           && cp /tmp/bench-trace/summary.txt "$OUT/trace_summary.txt" ;;
    *) echo "unknown step '$name': use tests latency throughput trace startup serving profile latency-eager kernels" \
         "kernels-fp8 fp8 serving-json"
       exit 2 ;;
  esac
done

[ ${#FAILED[@]} -eq 0 ] || { echo "FAILED: ${FAILED[*]}"; exit 1; }
echo "all steps passed; results in $OUT"
