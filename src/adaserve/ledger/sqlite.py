"""The embedded backend: one SQLite file in WAL mode.

``synchronous=FULL``: every commit is fsync'ed to the WAL before it returns, so a
committed row survives ``kill -9`` of the server and a power cut alike (``NORMAL`` in
WAL mode survives a killed process too, but may lose the last commits on a power cut;
the batched writer makes the extra fsync cheap: one per batch, not one per row). Each
thread has its own connection (readers never wait for the writer in WAL mode)."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

from adaserve.ledger.store import Store

BUSY_TIMEOUT_S = 30.0


class SqliteStore(Store):
    dialect = "sqlite"

    def __init__(self, path: str | Path, synchronous: str = "full"):
        self.path = Path(path)
        self.synchronous = {"full": "FULL", "normal": "NORMAL"}[synchronous]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._conn()  # opens (and creates) the file now: a bad path fails at start-up

    def _conn(self) -> sqlite3.Connection:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            c.execute("PRAGMA journal_mode=WAL")
            c.execute(f"PRAGMA synchronous={self.synchronous}")
            self._local.conn = c
            with self._lock:
                self._all.append(c)
        return c

    @contextlib.contextmanager
    def _cursor_tx(self):
        c = self._conn()
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
        cur = self._conn().execute(text, tuple(params))
        try:
            return cur.fetchall()
        finally:
            cur.close()

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            with contextlib.suppress(Exception):
                c.close()
        self._local = threading.local()

    def describe(self) -> str:
        return f"sqlite:{self.path}"
