"""A server in a child process: start it on a free port, wait until ``GET /health`` answers
200, stop it with SIGTERM. One helper for the benchmarks, the soak and the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_command(serve_args: list[str], port: int, host: str = "127.0.0.1") -> list[str]:
    """``travelator serve`` with these arguments, on ``host:port``, in this interpreter."""
    return [sys.executable, "-m", "travelator.cli", "serve", *serve_args,
            "--host", host, "--port", str(port)]


class ServerProcess:
    """``argv`` (a server that listens on ``port``) as a child process, its output in a log file
    (``log_path``, or a temporary file removed by ``close``)."""

    def __init__(self, argv: list[str], port: int, *, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 log_path: str | Path | None = None, cpus: frozenset[int] | None = None) -> None:
        self.argv = argv
        self.cpus = cpus  # the cores it may run on (from its first instruction), or all
        self.base_url = f"http://{host}:{port}"
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._cwd = cwd
        self._tmp = None if log_path else tempfile.TemporaryDirectory(prefix="travelator-server-")
        self.log_path = Path(log_path) if log_path else Path(self._tmp.name) / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> None:
        """Start it and wait until it is healthy; RuntimeError (with the log's tail) if it exits
        or is not healthy in time (it is stopped then)."""
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process (appending to its log) without waiting for it."""
        cpus = self.cpus
        # Pinned before exec, so every thread the server ever starts inherits the set.
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self._env, cwd=self._cwd, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=pin)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Wait until the launched process answers ``GET /health`` with 200."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before it "
                                   f"was ready:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not healthy within {timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then wait; the exit code, or None if it had to be killed."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def close(self) -> None:
        """Kill it if it still runs, and remove a temporary log."""
        self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()

