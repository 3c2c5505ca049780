"""Data-parallel replicas behind one OpenAI endpoint (``travelator serve --data-parallel-size N``):
N complete ``travelator serve`` processes, each pinned to its own cores, and a front end that
sends each request to one of them.

- ``cores.py``: which cores each replica gets (one L3 or NUMA domain each where they match).
- ``routing.py``: which replica gets a request (where its prefix went before, else the least
  loaded one), and why.
- ``supervisor.py``: the replica processes; a dead one is restarted.
- ``proxy.py``: forwarding a request to a replica and relaying its answer.
- ``response_homes.py``: which replica stored each response, for its follow-ups, GET and DELETE.
- ``frontend.py``: the front end's FastAPI app over the proxy (health, loads, metrics).
- ``metrics.py``: routing decisions and replica states for ``/metrics``.
- ``launch.py``: the ``serve`` command's entry for ``--data-parallel-size``.
"""
