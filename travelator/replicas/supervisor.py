"""The replica processes: N ``travelator serve`` children on loopback ports, each pinned to its
share of the cores, watched by one thread each. A replica that exits is reported down (its
in-flight requests fail at the front end, which sees their connections close), started again
on the same port and cores, and reported up once its ``/health`` answers 200.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from travelator.server.process import ServerProcess, free_port, serve_command

logger = logging.getLogger(__name__)

_POLL_S = 0.2
_RETRY_S = 2.0  # between restarts of a replica that failed to come up


@dataclass
class Replica:
    index: int
    cpus: frozenset[int]
    process: ServerProcess
    up: bool = False
    restarts: int = 0

    @property
    def base_url(self) -> str:
        return self.process.base_url


class ReplicaSet:
    def __init__(self, serve_args: list[str], shares: list[frozenset[int]], *,
                 on_change: Callable[[int, bool], None], start_timeout: float = 600.0) -> None:
        self._logs = tempfile.TemporaryDirectory(prefix="travelator-replicas-")
        self.replicas = [self._replica(i, serve_args, cpus) for i, cpus in enumerate(shares)]
        self._on_change = on_change
        self._start_timeout = start_timeout
        self._stop = threading.Event()
        self._watchers: list[threading.Thread] = []

    def _replica(self, index: int, serve_args: list[str], cpus: frozenset[int]) -> Replica:
        port = free_port()
        # One thread per core of its share: torch and OpenMP would otherwise start one per core
        # of the machine and oversubscribe the share.
        env = {"OMP_NUM_THREADS": str(len(cpus))}
        log = Path(self._logs.name) / f"replica-{index}.log"
        return Replica(index, cpus, ServerProcess(serve_command(serve_args, port), port, env=env,
                                                  log_path=log, cpus=cpus))

    def start(self) -> None:
        """Start every replica, wait until all are healthy, then watch them."""
        for replica in self.replicas:
            replica.process.launch()
        try:
            for replica in self.replicas:
                replica.process.wait_ready(self._start_timeout)
                self._set_up(replica, True)
        except RuntimeError:  # one did not start: stop the others rather than orphan them
            for replica in self.replicas:
                replica.process.stop()
            raise
        for replica in self.replicas:
            logger.warning("replica %d on cores %s: %s (log %s)", replica.index, sorted(replica.cpus),
                           replica.base_url, replica.process.log_path)
        for replica in self.replicas:
            watcher = threading.Thread(target=self._watch, args=(replica,), daemon=True,
                                       name=f"travelator-replica-{replica.index}")
            watcher.start()
            self._watchers.append(watcher)

    def _set_up(self, replica: Replica, up: bool) -> None:
        replica.up = up
        self._on_change(replica.index, up)

    def _watch(self, replica: Replica) -> None:
        while not self._stop.wait(_POLL_S):
            proc = replica.process.proc
            if proc is None or proc.poll() is None:
                continue
            self._set_up(replica, False)
            logger.error("replica %d exited with code %s: restarting it\n%s", replica.index,
                         proc.returncode, replica.process.log_tail(10))
            replica.restarts += 1
            try:
                replica.process.launch()
                replica.process.wait_ready(self._start_timeout)
            except RuntimeError as exc:
                logger.error("replica %d did not come back: %s", replica.index, exc)
                self._stop.wait(_RETRY_S)
                continue
            if not self._stop.is_set():
                self._set_up(replica, True)

    def close(self) -> None:
        """Stop watching, then stop every replica (SIGTERM: they finish or abort their requests)."""
        self._stop.set()
        for replica in self.replicas:  # first, so that a watcher waiting on a restart returns
            replica.process.stop()
        for watcher in self._watchers:
            watcher.join()
        for replica in self.replicas:  # again: a watcher may have relaunched one meanwhile
            replica.process.stop()
            replica.process.close()
        self._logs.cleanup()
