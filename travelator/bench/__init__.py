"""Benchmarks: workloads, arrival processes, metrics, the offline runner, the HTTP load
generator, the static-vs-iteration comparison and the transformers baseline.
Command line: ``travelator bench throughput | serve | compare`` (see cli.py and
docs/benchmarks.md)."""
