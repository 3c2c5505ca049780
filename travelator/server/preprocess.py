"""Request preprocessing off the event loop: parsing a body, rendering a chat template,
tokenizing a prompt and validating it run on a few worker threads, so that a huge prompt
(seconds of tokenizing) holds up no other request's stream.

The tokenizer drops the GIL while it encodes, so the loop runs on meanwhile; a template is
rendered in Python, and the loop then gets the GIL back at the interpreter's switch interval
(5 ms). The workers are few: past them, preprocessing waits its turn (first come, first
served), and a burst of huge prompts cannot take every core from the engine's step thread.

Requests reach the engine in the order their preprocessing ends: a short prompt sent just
after a huge one may be queued first. Preprocessing changes no engine state: a request whose
client leaves meanwhile is dropped when it ends, and nothing is left to abort.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

WORKERS = 2


class Preprocessor:
    def __init__(self, workers: int = WORKERS) -> None:
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="preprocess")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on a worker; what it raises (an APIError: a 400) is raised here."""
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Drop what has not started; what runs ends on its own."""
        self._threads.shutdown(wait=False, cancel_futures=True)
