#!/usr/bin/env bash
# The Orca experiment of docs/benchmarks.md: static (request-level) batching against
# iteration-level scheduling on a random-weight ~250M Llama in bfloat16, Orca's synthetic
# workload with Orca's output range (1-128 tokens) and prompts shortened from Orca's 32-512
# to 32-128 tokens so that the sweep stays short (docs/benchmarks.md says how long it took),
# Poisson arrivals at a sweep of rates. Extra arguments are passed on, e.g.
#   benchmarks/orca_compare.sh --output-dir /tmp/cmp --request-rates 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m travelator.bench.cli compare \
  --model dummy:llama-250m --dtype bfloat16 \
  --max-num-seqs 8 --max-model-len 512 \
  --workload orca --prompt-len-range 32 128 --output-len-range 1 128 \
  --num-requests 24 --workload-seed 0 --arrival-seed 0 \
  --request-rates 0.5 1 1.5 2.5 4 8 \
  --output-dir docs/benchmarks "$@"
