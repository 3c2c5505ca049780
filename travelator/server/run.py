"""Run an app from ``build_app`` under uvicorn with a graceful SIGTERM/SIGINT.

On the first SIGTERM (or Ctrl-C) uvicorn closes the listening socket and waits for open
connections; we also stop accepting requests (503 on kept-alive connections), give in-flight
requests ``settings.shutdown_grace_s`` seconds to finish and then abort them, so every stream
ends with a ``finish_reason`` (``"abort"`` for the cut ones) instead of a broken connection.
Then the lifespan stops the engine and the process exits 0. A second Ctrl-C exits at once.

Watchdog: if the engine's step loop dies (an exception escaped a step), or one step runs longer
than ``settings.step_timeout_s``, every waiting client gets an error at once, /health answers
503, the server shuts down and ``run_server`` returns 1, so a supervisor sees a failed process
instead of one that hangs.
"""

from __future__ import annotations

import logging
import signal
import threading

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


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
    failed = threading.Event()
    client = serving.client

    def on_engine_death(exc: BaseException) -> None:  # on the step thread (or the watchdog's)
        logger.error("the engine's step loop has stopped (%r): shutting the server down", exc)
        failed.set()
        server.should_exit = True

    client.death_listeners.append(on_engine_death)
    done = threading.Event()
    step_timeout = app.state.settings.step_timeout_s
    if step_timeout is not None:
        def watch_steps() -> None:
            while not done.wait(min(1.0, step_timeout / 4)):
                running_for = client.step_running_for()
                if running_for > step_timeout:
                    client.declare_dead(TimeoutError(
                        f"one step has run {running_for:.1f} s, more than step_timeout_s={step_timeout}"))
                    return

        threading.Thread(target=watch_steps, name="travelator-step-watchdog", daemon=True).start()
    # uvicorn re-raises the signal it caught once it has shut down; make that a no-op so a
    # graceful stop exits 0 rather than dying of the default SIGTERM action.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: None)
    try:
        server.run()
    finally:
        done.set()
    if failed.is_set() or client.error is not None:
        return 1
    return 0 if server.started else 1
