"""A live server for tests: uvicorn in a thread on 127.0.0.1."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch
import uvicorn


@contextlib.contextmanager
def serve_in_thread(app, *, port: int = 0, name: str = "test-uvicorn",
                    log_level: str = "critical") -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL.

    Torch runs on one thread meanwhile: the test machine is small and shared, and one
    thread beats two fighting the load generator for the cores. The server must stop
    within 30 s of the block's end.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=srv.run, name=name, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(30)
        torch.set_num_threads(threads)
    assert not thread.is_alive()
