"""The batched writer: one thread owns every write to the ledger database.

Callers (the engine thread, the event loop) only put an item on a queue and get a
``concurrent.futures.Future`` back; a response awaits its own row's future before its
final bytes. The thread takes whatever has queued up (up to ``MAX_BATCH``) and commits
it in one transaction, so under load one commit (one fsync) carries many rows and the
bound on a row's wait is one commit behind the batch in progress.

When a commit fails (the database is unreachable), the batch goes to the ``Spool``
(fsync'ed) and its futures resolve all the same: the row is durable, the response is
not held. From then on items go to the spool in order, and the database is tried
again every ``retry_s``; once a replay of the whole spool commits, the spool is
removed and writes go to the database again."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from adaserve.ledger.rows import Refusal, UsageRow
from adaserve.ledger.spool import Spool
from adaserve.ledger.store import Store

log = logging.getLogger("adaserve.ledger")

MAX_BATCH = 512
REPLAY_BATCH = 1000
COMMITTED = "committed"
SPOOLED = "spooled"
_STOP = object()


@dataclass
class WriterStats:
    committed: int = 0  # items stored in the database by a live commit
    spooled: int = 0  # items written to the spool
    replayed: int = 0  # spooled items stored by a replay (new ones only)
    failures: int = 0  # commits or replays that failed
    batches: int = 0
    spooling: bool = False
    commit_s: list = field(default_factory=list)  # the last commits' durations


class LedgerWriter:
    def __init__(self, store: Store, spool: Spool, retry_s: float = 1.0):
        self.store = store
        self.spool = spool
        self.retry_s = retry_s
        self.stats = WriterStats()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._spooling = len(spool) > 0  # left over from a run that could not replay it
        self.stats.spooling = self._spooling
        self._next_try = 0.0
        # callback(seconds from submit to committed or spooled), per item, writer thread
        self.on_done: Callable[[float], None] | None = None
        # held from a commit until its futures are done: a reader that holds it sees
        # every row either committed with its future done, or neither (``BudgetBook.load``
        # adds this server's rows whose futures are not done to the database's totals)
        self.commit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="adaserve-ledger", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def submit(self, item: UsageRow | Refusal | None) -> Future:
        """Queue ``item`` (None: a marker, done once everything before it is)."""
        fut: Future = Future()
        fut.submitted = time.perf_counter()  # type: ignore[attr-defined]
        self._q.put((item, fut))
        return fut

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted before this call is committed or spooled."""
        return self.submit(None).result(timeout) is not None

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the thread."""
        self._q.put(_STOP)
        self._thread.join(timeout)
        self.spool.close()

    @property
    def spool_pending(self) -> int:
        return len(self.spool) if self._spooling else 0

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        stop = False
        while not stop:
            try:
                first = self._q.get(timeout=self.retry_s if self._spooling else None)
            except queue.Empty:
                self._try_replay()
                continue
            batch = []
            if first is _STOP:
                stop = True
            else:
                batch.append(first)
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            if batch:
                self._write(batch)
        if self._spooling:
            self._try_replay(force=True)

    def _write(self, batch: list) -> None:
        with self.commit_lock:
            how = self._store(batch)
            if how is None:
                return
            for _, fut in batch:
                fut.set_result(how)
        if self.on_done is not None:
            now = time.perf_counter()
            for it, fut in batch:
                if isinstance(it, UsageRow):
                    self.on_done(now - fut.submitted)

    def _store(self, batch: list) -> str | None:
        """Commit (or spool) the batch's items: how they were stored, or None when
        neither worked (the futures then hold the error)."""
        items = [it for it, _ in batch if it is not None]
        how = COMMITTED
        if self._spooling:
            self._try_replay()
        try:
            if not items:
                pass
            elif self._spooling:
                self.spool.append(items)
                self.stats.spooled += len(items)
                how = SPOOLED
            else:
                t0 = time.perf_counter()
                try:
                    self.store.write(items)
                    self._took(time.perf_counter() - t0)
                    self.stats.committed += len(items)
                except Exception as e:
                    self._down(e)
                    self.spool.append(items)
                    self.stats.spooled += len(items)
                    how = SPOOLED
        except Exception as e:  # the spool itself failed (disk full): say so loudly
            log.error("usage ledger: %d record(s) neither committed nor spooled: %s", len(items), e)
            for _, fut in batch:
                fut.set_exception(e)
            return None
        return how

    def _took(self, s: float) -> None:
        st = self.stats
        st.batches += 1
        st.commit_s.append(s)
        if len(st.commit_s) > 4096:
            del st.commit_s[:2048]

    def _down(self, e: Exception) -> None:
        self.stats.failures += 1
        if not self._spooling:
            log.warning(
                "usage ledger: the database (%s) is unreachable (%s); spooling records to %s "
                "until it is back",
                self.store.describe(),
                _one_line(e),
                self.spool.path,
            )
        self._spooling = True
        self.stats.spooling = True
        self._next_try = time.monotonic() + self.retry_s

    def _try_replay(self, force: bool = False) -> None:
        if not self._spooling or (not force and time.monotonic() < self._next_try):
            return
        items = list(self.spool.items())
        try:
            new = 0
            for i in range(0, len(items), REPLAY_BATCH):
                new += self.store.write(items[i : i + REPLAY_BATCH])
        except Exception as e:
            self.stats.failures += 1
            self._next_try = time.monotonic() + self.retry_s
            log.debug("usage ledger: replay failed: %s", e)
            return
        self.spool.clear()
        self.stats.replayed += new
        self._spooling = False
        self.stats.spooling = False
        log.warning(
            "usage ledger: the database (%s) is back; replayed %d spooled record(s) "
            "(%d new, %d already stored)",
            self.store.describe(),
            len(items),
            new,
            len(items) - new,
        )


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__
