"""The live view of the walkway: ``GET /dashboard`` on ``travelator serve`` (routes.py), fed by a
bounded stream of per-step records (feed.py, from ``walkway.py``); the same page replays
a benchmark's recorded steps (page.py)."""
