"""``python -m travelator.distributed``: run a tensor-parallel worker rank from a
torchrun-style environment (see worker.py)."""

from travelator.distributed.worker import main

main()
