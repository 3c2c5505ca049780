"""Disaggregated prefill and decode (DistServe): prefill workers and decode workers in
separate processes, each with its own engine and KV pool; a front end routes requests and
the KV of each prompt moves from the prefill worker to a decode worker over gloo.

- ``placement.py``: which workers get a request; holding it back when no decode pool has room.
- ``messages.py``: what the front end and the workers tell each other.
- ``worker.py``: the worker processes.
- ``kv_transport.py``: a prefill worker's KV to a decode worker, gloo point-to-point.
- ``frontend.py``: ``DisaggregatedFrontEnd``, the server's ``EngineClient`` over the workers;
  ``front_report.py``: what it reports of them (snapshot, self-check, per-worker metrics).
- Across hosts, under torchrun: ``hosts.py`` (which rank runs which worker; the other ranks'
  side), ``remote.py`` (the front end's side), ``link.py`` (one authenticated TCP connection
  per worker) and ``wire.py`` (the messages as msgpack, no pickles). Placed by Ray
  (``--distributed-executor-backend ray``): ``ray_workers.py``, every worker an actor of one
  placement group, connected as torchrun's remote workers are.
"""
