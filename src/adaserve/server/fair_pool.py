"""Worker threads shared fairly among tenants: the tokenizer's jobs.

A plain thread pool runs jobs in the order they came, so one tenant with long prompts
to tokenise (each a few tens of ms) puts every other tenant's two-token prompt behind
its queue. ``FairPool`` keeps one queue per tenant and, whenever a thread frees, takes
the next job of the waiting tenant with the fewest jobs running (of those, the one
served longest ago; first come, first served within one tenant). Another tenant's job then waits
at most for the jobs already running, whatever the flood. It runs on the event loop: ``run`` is awaited there, and
the bookkeeping happens in its callbacks (no lock).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# the tenant a request's jobs are queued under (set by the server's guard once the key
# is known; jobs outside a request share the "" queue)
current_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("adaserve_tenant", default="")


class FairPool:
    """``threads`` worker threads; jobs queued per tenant, the tenant with the fewest
    running served first."""

    def __init__(self, threads: int, thread_name_prefix: str):
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=thread_name_prefix)
        self._queues: dict[str, deque] = {}  # tenant -> its waiting jobs
        self.running = 0
        self._running_of: dict[str, int] = {}  # tenant -> its jobs on a thread now
        self._served: dict[str, int] = {}  # tenant -> when its last job started (a count)
        self._starts = 0

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        """``fn(*args)`` on a worker thread, when the tenant's turn comes."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        key = current_tenant.get()
        self._queues.setdefault(key, deque()).append((functools.partial(fn, *args), fut))
        self._dispatch(loop)
        return await fut

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        while self.running < self.threads and self._queues:
            key = min(
                self._queues, key=lambda k: (self._running_of.get(k, 0), self._served.get(k, -1))
            )
            q = self._queues[key]
            job, fut = q.popleft()
            if not q:
                del self._queues[key]
                if len(self._served) > 4096:  # forget tenants with nothing queued or running
                    keep = self._queues.keys() | self._running_of.keys()
                    self._served = {k: v for k, v in self._served.items() if k in keep}
            if fut.done():  # the request went away (cancelled) while it waited
                continue
            self.running += 1
            self._running_of[key] = self._running_of.get(key, 0) + 1
            self._starts += 1
            self._served[key] = self._starts
            work = loop.run_in_executor(self._pool, job)
            work.add_done_callback(functools.partial(self._done, loop, key, fut))

    def _done(self, loop: asyncio.AbstractEventLoop, key: str, fut: asyncio.Future, work) -> None:
        self.running -= 1
        if (n := self._running_of[key] - 1) > 0:
            self._running_of[key] = n
        else:
            del self._running_of[key]
        if not fut.done():
            if work.cancelled():
                fut.cancel()
            elif (e := work.exception()) is not None:
                fut.set_exception(e)
            else:
                fut.set_result(work.result())
        self._dispatch(loop)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
