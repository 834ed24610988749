"""The embedded backend: one SQLite file in WAL mode.

``synchronous=NORMAL`` (the default): a commit has written its WAL frames to the
operating system before it returns, so a committed row survives ``kill -9`` of the
server (the kernel holds the file's pages; the next open recovers the WAL), but a power
cut or a kernel crash may roll back the last commits (SQLite's documented trade-off for
WAL mode). ``FULL`` fsyncs the WAL at every commit (one per batch, not per row) and
survives a power cut too, at a few milliseconds per commit on this project's machines
(``docs/results/usage-ledger.md``). Each thread has its own connection (readers never
wait for the writer in WAL mode)."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

from adaserve.ledger.store import Store

BUSY_TIMEOUT_S = 30.0


class SqliteStore(Store):
    dialect = "sqlite"

    def __init__(self, path: str | Path, synchronous: str = "normal"):
        self.path = Path(path)
        self.synchronous = {"full": "FULL", "normal": "NORMAL"}[synchronous]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        # every thread's connection and the lock held while it is in use: ``close``
        # takes each lock, so it never closes a connection under a running statement
        self._all: list[tuple[sqlite3.Connection, threading.Lock]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._conn()  # opens (and creates) the file now: a bad path fails at start-up

    def _conn(self) -> tuple[sqlite3.Connection, threading.Lock]:
        pair = getattr(self._local, "pair", None)
        if pair is None:
            with self._lock:
                if self._closed:
                    raise sqlite3.ProgrammingError("the usage ledger is closed")
                c = sqlite3.connect(
                    self.path,
                    timeout=BUSY_TIMEOUT_S,
                    isolation_level=None,
                    check_same_thread=False,
                )
                c.execute("PRAGMA journal_mode=WAL")
                c.execute(f"PRAGMA synchronous={self.synchronous}")
                pair = (c, threading.Lock())
                self._local.pair = pair
                self._all.append(pair)
        return pair

    @contextlib.contextmanager
    def _cursor_tx(self):
        c, lock = self._conn()
        with lock:
            cur = c.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                yield cur
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            else:
                cur.execute("COMMIT")
            finally:
                cur.close()

    def query(self, text: str, params=()) -> list[tuple]:
        # reads take no write lock (a deferred transaction: WAL snapshot)
        c, lock = self._conn()
        with lock:
            cur = c.execute(text, tuple(params))
            try:
                return cur.fetchall()
            finally:
                cur.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs, self._all = self._all, []
        for c, lock in pairs:
            with lock, contextlib.suppress(Exception):
                c.close()

    def describe(self) -> str:
        return f"sqlite:{self.path}"
