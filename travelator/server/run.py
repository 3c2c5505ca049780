"""Run an app from ``build_app`` under uvicorn with a graceful SIGTERM/SIGINT.

On the first SIGTERM (or Ctrl-C) uvicorn closes the listening socket and waits for open
connections; we also stop accepting requests (503 on kept-alive connections), give in-flight
requests ``settings.shutdown_grace_s`` seconds to finish and then abort them, so every stream
ends with a ``finish_reason`` (``"abort"`` for the cut ones) instead of a broken connection.
Then the lifespan stops the engine and the process exits 0. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import signal

import uvicorn
from fastapi import FastAPI


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *,
               log_level: str = "info", access_log: bool = False) -> int:
    serving = app.state.serving
    grace = app.state.settings.shutdown_grace_s

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # runs in the signal handler, main thread
            if not self.should_exit and serving.loop is not None:
                serving.loop.call_soon_threadsafe(serving.begin_shutdown)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on",
        timeout_graceful_shutdown=grace + 5.0,  # a backstop: aborted streams end within a step
    )
    server = _Server(config)
    # uvicorn re-raises the signal it caught once it has shut down; make that a no-op so a
    # graceful stop exits 0 rather than dying of the default SIGTERM action.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: None)
    server.run()
    return 0 if server.started else 1
