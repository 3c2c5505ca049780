#!/usr/bin/env bash
# The history of LLM batching in one command (docs/history.md): static (FasterTransformer),
# dynamic (Triton), Orca's iteration-level scheduling with whole prompts, chunked prefill
# (Sarathi-Serve) and disaggregated prefill/decode (DistServe), on the same random-weight
# ~50M Llama, kernels and workload.
#
#   1. bench compare: the four batching modes over a sweep of Poisson request rates (Orca's
#      experiment);
#   2. bench interference: steady decodes while 1,536-token prompts arrive, the four modes and
#      disaggregation (one prefill and one decode worker process, a core each).
#
# It runs for minutes (docs/history.md says how long). Writes the tables (*.txt), JSON and
# PNGs to $HISTORY_OUT (default docs/history); its last lines are the ratios. Quote its figures
# only from a quiet machine: it prints the load average before it starts.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}  # the environment travelator is installed in
"$PYTHON" -c "import travelator" 2>/dev/null || {
  echo "error: $PYTHON cannot import travelator; activate its environment or set PYTHON" >&2; exit 2; }
OUT=${HISTORY_OUT:-docs/history}
MODEL=${HISTORY_MODEL:-dummy:llama-50m}
mkdir -p "$OUT"
start=$(date +%s)
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
read -r load1 _ < /proc/loadavg
echo "machine: ${cpu:-unknown CPU}, $(nproc) cores; 1-minute load average before the run: $load1"
if awk "BEGIN {exit !($load1 > 0.5)}"; then
  echo "warning: the machine is not quiet (load $load1): the figures will be noisy" >&2
fi
ENGINE=(--model "$MODEL" --dtype bfloat16 --max-num-seqs 16 --max-model-len 2048
        --max-num-batched-tokens 256 --max-queue-delay-ms 100)

"$PYTHON" -m travelator.bench.cli compare "${ENGINE[@]}" \
  --batching static dynamic orca iteration \
  --workload orca --prompt-len-range 32 256 --output-len-range 1 128 \
  --num-requests 96 --workload-seed 0 --arrival-seed 0 \
  --request-rates 2 4 8 16 32 --output-dir "$OUT" --no-progress | tee "$OUT/compare.txt"

"$PYTHON" -m travelator.bench.cli interference "${ENGINE[@]}" \
  --batching static dynamic orca iteration \
  --num-decodes 8 --decode-prompt-len 32 --decode-output-len 384 \
  --num-long 6 --long-prompt-len 1536 --long-output-len 8 --first-long-at 0.5 --long-every 0.5 \
  --disaggregate 1:1 --repeats 2 --output-dir "$OUT" --no-progress | tee "$OUT/interference.txt"

echo "run time: $(( $(date +%s) - start )) s; 1-minute load average at the end: $(cut -d' ' -f1 /proc/loadavg)"
echo
echo "The ratios:"
grep "^Throughput ratio" "$OUT/compare.txt" | grep -e "vs static batching" -e "vs dynamic batching"
grep -e "^p99 time between tokens" -e "^disaggregated vs chunked" "$OUT/interference.txt"
