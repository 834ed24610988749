"""One ledger row per HTTP request: its choices (engine requests) finish one by one on
the engine thread; the last one completes the row, which goes to the ledger's writer.
The response then waits for that row's commit (``RowAcc.wait``) before its final
bytes. A request whose choices all failed before producing anything (shed, shutdown,
an engine error: the client got an error, counted as a refusal) has no row; one the
client aborted has a row for what it produced."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from concurrent.futures import Future

from adaserve.ledger.rows import NORMAL_FINISH, UsageRow
from adaserve.server.engine_loop import DISCONNECTED

log = logging.getLogger("adaserve.server")


def key_id_of(authorization: str | None) -> str | None:
    """A short id of the API key a request presented (the first 12 hex digits of its
    SHA-256): which key was used, never the key."""
    if not authorization:
        return None
    _, _, key = authorization.strip(" \t").partition(" ")
    key = key.strip(" \t")
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:12] if key else None


def wall_of(perf_t: float) -> float:
    """A ``time.perf_counter`` stamp as UTC seconds since the epoch."""
    return time.time() - (time.perf_counter() - perf_t)


class RowAcc:
    """Collects a request's choices into its ``UsageRow`` (thread-safe: choices finish
    on the engine thread, rejected ones may be reported from the event loop)."""

    def __init__(self, rid: str, tenant: str, key_id: str | None, class_asked: str, replica: str):
        self.id = rid
        self.tenant = tenant
        self.key_id = key_id
        self.class_asked = class_asked
        self.replica = replica
        self.expected = 0  # set once every choice is submitted (``arm``)
        self.budget_admitted = False
        self._lock = threading.Lock()
        self._parts: dict[int, tuple | None] = {}
        self.future: Future | None = None  # the row's commit (None: no row)
        self.done = False  # every choice has ended

    def arm(self, n: int) -> None:
        with self._lock:
            self.expected = n

    def add(self, index: int, part: tuple | None):
        """A choice ended: ``part`` (see ``ServerState.on_finish``), or None for one that
        never reached the engine. Returns (last, row): whether this was the last choice
        (true for exactly one call), and then the row (None: the request has none)."""
        with self._lock:
            if self.done:
                return False, None
            self._parts[index] = part
            if not self.expected or len(self._parts) < self.expected:
                return False, None
            parts = [self._parts[i] for i in sorted(self._parts)]
            self.done = True
        return True, self._row(parts)

    def _row(self, parts: list) -> UsageRow | None:
        got = [p for p in parts if p is not None]
        # (cls, prompt, completion, charge, ttft, tpot, attained, reason, arrival, finished)
        if not got:
            return None
        if not any(p[2] > 0 or p[7] in NORMAL_FINISH or p[7] == DISCONNECTED for p in got):
            return None  # the client got an error for every choice: a refusal, not usage
        first = got[0]
        reasons = [p[7] for p in got]
        bad = [r for r in reasons if r not in NORMAL_FINISH]
        return UsageRow(
            id=self.id,
            tenant=self.tenant,
            key_id=self.key_id,
            class_asked=self.class_asked,
            cls=first[0],
            prompt_tokens=sum(p[1] for p in got),
            completion_tokens=sum(p[2] for p in got),
            charge=sum(p[3] for p in got),
            ttft_ms=first[4],
            tpot_ms=first[5],
            slo_met=all(p[6] for p in got) and len(got) == len(parts),
            finish_reason=bad[0] if bad else reasons[0],
            arrival=min(p[8] for p in got),
            finished=max(p[9] for p in got),
            replica=self.replica,
            choices=len(parts),
        )

    async def wait(self, timeout_s: float) -> None:
        """Until the row is committed (or spooled); a no-op when there is none. Logs
        (and gives up) after ``timeout_s``."""
        if self.future is None:
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.future), timeout_s)
        except asyncio.TimeoutError:
            log.error("usage ledger: row %s not committed within %g s", self.id, timeout_s)
        except Exception as e:
            log.error("usage ledger: row %s failed: %s", self.id, e)
