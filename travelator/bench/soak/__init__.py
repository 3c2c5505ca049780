"""Soak and chaos test of a live server: a mixed workload, then the engine's own accounting.

    travelator bench soak --requests 2000          # starts `travelator serve` itself
    travelator bench soak --duration 600 --requests 100000
    travelator bench soak --url http://127.0.0.1:8000 --requests 500
    travelator bench soak --everything --requests 2000

The workload (workload.py) mixes completions and chat, streaming and not, n > 1 and prompt
batches, stop strings, logprobs, greedy and seeded sampling, very short and very long requests;
about ``--disconnect-rate`` of the clients go away at a random moment (before the first token,
mid stream, or while a non-streaming request waits); every ``--burst-every`` requests a burst of
requests above the waiting-queue bound is fired at once (503 expected for some); a few requests
are deliberately invalid (4xx expected).

Every answer is checked (checks.py: a valid completion with a finish reason for each choice, the
stop strings honoured, usage that adds up, a stream that ends in ``[DONE]`` with no error event).
Then the driver (driver.py) waits for the server to be idle and checks through ``/debug/engine``:
every KV block back in the pool, free + used = total (counted independently), the pool's
consistency check, no running or waiting request, no per-request state left behind; through
/metrics: no request finished with an engine error; and that /health is 200 and a last request
still succeeds. A server it started must also stop cleanly on SIGTERM (exit code 0).

``--everything`` runs the same chaos on a batch-invariant server with priority scheduling, prefix
caching and speculative decoding (two servers in turn, half the requests each: n-gram, then a
draft model), adds priorities, shared-prefix prompts and constrained requests (structured.py:
every finished constrained answer must satisfy its schema, regex or choice list), and after the
load sends every greedy one-choice request again alone, without speculation: the answers must
be the same (greedy.py).

Prints ONE line on stdout with the figures; failed checks are listed on stderr, and the exit
code is 1 if any check failed. Bounded by ``--requests`` and ``--duration`` and by a hard
``--time-limit``: it always stops by itself. Only 127.0.0.1 is ever contacted when it starts
the server itself.
"""
