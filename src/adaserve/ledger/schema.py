"""The ledger's schema: one text for SQLite and PostgreSQL, a version table and forward
migrations (a small runner; each migration runs once, in order, in one transaction).

Times are UTC seconds since the epoch (``DOUBLE PRECISION``); ``hour`` is the row's
finish time in whole hours since the epoch, the key of the hourly roll-up that usage
totals and budgets read (a month of rows is then a few thousand roll-up rows).

Tables:
  requests       one row per finished request (the response ``id`` is the key: a row
                 replayed from the spool twice is stored once)
  usage_hourly   totals per (hour, tenant, class), kept in step with ``requests`` in
                 the same transaction, and only for rows actually inserted
  refusals       one row per refused request (429, 403): tenant, class, reason
"""

from __future__ import annotations

from collections.abc import Callable

# (version, statements); append only: a shipped migration is never edited
MIGRATIONS: list[tuple[int, tuple[str, ...]]] = [
    (
        1,
        (
            """CREATE TABLE requests (
                id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                key_id TEXT,
                class_asked TEXT NOT NULL,
                class TEXT NOT NULL,
                prompt_tokens BIGINT NOT NULL,
                completion_tokens BIGINT NOT NULL,
                charge DOUBLE PRECISION NOT NULL,
                ttft_ms DOUBLE PRECISION,
                tpot_ms DOUBLE PRECISION,
                slo_met SMALLINT NOT NULL,
                finish_reason TEXT NOT NULL,
                arrival DOUBLE PRECISION NOT NULL,
                finished DOUBLE PRECISION NOT NULL,
                hour BIGINT NOT NULL,
                replica TEXT NOT NULL,
                choices INTEGER NOT NULL
            )""",
            "CREATE INDEX requests_finished ON requests (finished)",
            "CREATE INDEX requests_tenant_finished ON requests (tenant, finished)",
            "CREATE INDEX requests_class_hour ON requests (class, hour)",
            """CREATE TABLE usage_hourly (
                hour BIGINT NOT NULL,
                tenant TEXT NOT NULL,
                class TEXT NOT NULL,
                requests BIGINT NOT NULL,
                prompt_tokens BIGINT NOT NULL,
                completion_tokens BIGINT NOT NULL,
                charge DOUBLE PRECISION NOT NULL,
                slo_met BIGINT NOT NULL,
                degraded BIGINT NOT NULL,
                aborted BIGINT NOT NULL,
                PRIMARY KEY (hour, tenant, class)
            )""",
            """CREATE TABLE refusals (
                id TEXT PRIMARY KEY,
                at DOUBLE PRECISION NOT NULL,
                hour BIGINT NOT NULL,
                tenant TEXT NOT NULL,
                class TEXT NOT NULL,
                reason TEXT NOT NULL,
                status INTEGER NOT NULL
            )""",
            "CREATE INDEX refusals_hour ON refusals (hour)",
        ),
    ),
]

LATEST = MIGRATIONS[-1][0]

VERSION_TABLE = "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"


class SchemaError(RuntimeError):
    """The database's schema is newer than this build knows (a downgrade)."""


def pending(current: int) -> list[tuple[int, tuple[str, ...]]]:
    """The migrations after ``current``; ``SchemaError`` if ``current`` is newer than
    this build's latest."""
    if current > LATEST:
        raise SchemaError(
            f"the usage database is at schema version {current}, newer than this "
            f"adaserve's {LATEST}: upgrade adaserve (no downgrades)"
        )
    return [(v, stmts) for v, stmts in MIGRATIONS if v > current]


def migrate(run: Callable[[str, tuple], list], transaction) -> int:
    """Bring a database to ``LATEST``. ``run(sql, params)`` executes one statement
    (returning its rows); ``transaction()`` is a context manager around one
    transaction. Returns the version it started at."""
    with transaction():
        run(VERSION_TABLE, ())
        rows = run("SELECT version FROM schema_version", ())
        if not rows:
            run("INSERT INTO schema_version (version) VALUES (0)", ())
        start = int(rows[0][0]) if rows else 0
    for v, stmts in pending(start):
        with transaction():
            # re-read under the transaction: another process may have migrated first
            now = int(run("SELECT version FROM schema_version", ())[0][0])
            if now >= v:
                continue
            for s in stmts:
                run(s, ())
            run("UPDATE schema_version SET version = ?", (v,))
    return start
