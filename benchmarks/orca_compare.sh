#!/usr/bin/env bash
# The Orca experiment of docs/benchmarks.md: static (request-level) batching against
# iteration-level scheduling on a random-weight ~250M Llama in bfloat16, Orca's synthetic
# workload (prompts 32-512 tokens, outputs 1-128 tokens), Poisson arrivals at a sweep of
# rates. About 10 minutes on a 2-core CPU. Extra arguments are passed on, e.g.
#   benchmarks/orca_compare.sh --output-dir /tmp/cmp --request-rates 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m travelator.bench.cli compare \
  --model dummy:llama-250m --dtype bfloat16 \
  --max-num-seqs 16 --max-model-len 1024 \
  --workload orca --num-requests 32 --workload-seed 0 --arrival-seed 0 \
  --request-rates 0.5 1 1.5 2 3 \
  --output-dir docs/benchmarks "$@"
