"""The shared backend: PostgreSQL through psycopg 3 and its connection pool (the
``postgres`` extra: ``pip install 'adaserve[postgres]'``). Every replica of a service
writes the one database; the schema is ``schema.py``'s, migrated under an advisory
lock so that replicas starting together migrate once."""

from __future__ import annotations

import contextlib
import threading

from adaserve.ledger.store import Store

# pg_advisory_lock key of the schema migrations ("adaserve" on a phone keypad)
MIGRATION_LOCK = 23272783
CONNECT_TIMEOUT_S = 3  # an unreachable server fails a batch fast: it goes to the spool
POOL_TIMEOUT_S = 5.0


def _import():
    try:
        import psycopg
        import psycopg_pool
    except ImportError as e:  # pragma: no cover - the extra is installed in tests
        raise RuntimeError(
            "a postgresql:// usage database needs psycopg 3 and its pool: "
            "pip install 'adaserve[postgres]'"
        ) from e
    return psycopg, psycopg_pool


def redact(url: str) -> str:
    """The URL without its password (for logs)."""
    head, at, tail = url.rpartition("@")
    if not at:
        return url
    scheme, sep, cred = head.partition("://")
    user = cred.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{tail}" if ":" in cred else url


class PostgresStore(Store):
    dialect = "postgresql"
    param = "%s"

    def __init__(self, url: str, max_size: int = 4):
        psycopg, psycopg_pool = _import()
        self.url = url
        self._psycopg = psycopg
        self._pinned = threading.local()
        try:  # fail at once, with the server's own reason, when it cannot be reached
            psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S).close()
        except psycopg.Error as e:
            raise RuntimeError(f"{redact(url)}: {' '.join(str(e).split())}") from None
        self.pool = psycopg_pool.ConnectionPool(
            url,
            min_size=1,
            max_size=max_size,
            timeout=POOL_TIMEOUT_S,
            kwargs={
                "connect_timeout": CONNECT_TIMEOUT_S,
                "autocommit": True,
                # a server that stops answering (a dropped network) is found out in
                # seconds, not at TCP's timeout: the batch then goes to the spool
                "keepalives": 1,
                "keepalives_idle": 5,
                "keepalives_interval": 2,
                "keepalives_count": 3,
            },
            open=False,
            name="adaserve-ledger",
        )
        try:
            self.pool.open(wait=True, timeout=POOL_TIMEOUT_S * 2)
        except psycopg_pool.PoolTimeout:
            self.pool.close()
            raise RuntimeError(f"{redact(url)}: no connection within the pool's timeout") from None

    @contextlib.contextmanager
    def _cursor_tx(self):
        conn = getattr(self._pinned, "conn", None)
        with contextlib.ExitStack() as st:
            if conn is None:
                conn = st.enter_context(self.pool.connection())
            with conn.transaction(), conn.cursor() as cur:
                yield cur

    def migrate(self) -> int:
        with self.pool.connection() as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
            self._pinned.conn = conn
            try:
                return super().migrate()
            finally:
                self._pinned.conn = None
                conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))

    def query(self, text: str, params=()) -> list[tuple]:
        with self.pool.connection() as conn, conn.cursor() as cur:
            cur.execute(self.sql(text), tuple(params))
            return [tuple(r) for r in cur.fetchall()]

    def close(self) -> None:
        self.pool.close()

    def describe(self) -> str:
        return redact(self.url)
