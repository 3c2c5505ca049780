"""Soak and chaos run against a live travelator server: ``travelator bench soak`` (the harness is
``travelator/bench/soak/``).

    python benchmarks/soak.py --requests 2000            # starts `travelator serve` itself
    python benchmarks/soak.py --url http://127.0.0.1:8000 --duration 600 --requests 100000

Prints one line of figures and exits non-zero if any check failed (see docs/reliability.md).
"""

import sys

from travelator.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["soak", *sys.argv[1:]]))
