"""What a ledger database does, whatever the engine: migrate, write a batch in one
transaction (idempotent by id), read, forget old rows. ``sqlite.SqliteStore`` and
``postgres.PostgresStore`` supply the connections; the SQL is shared (``?``
placeholders, rewritten to ``%s`` for psycopg)."""

from __future__ import annotations

from collections.abc import Sequence

from adaserve.ledger.rows import Refusal, UsageRow
from adaserve.ledger.schema import migrate

_ROW_COLS = (
    "id, tenant, key_id, class_asked, class, prompt_tokens, completion_tokens, charge, "
    "ttft_ms, tpot_ms, slo_met, finish_reason, arrival, finished, hour, replica, choices"
)
CHUNK = 500  # rows per statement (17 parameters each: within SQLite's 32766)
INSERT_ROWS = f"INSERT INTO requests ({_ROW_COLS}) VALUES "
ROW_MARKS = "(" + ", ".join("?" * 17) + ")"
RETURNING = " ON CONFLICT (id) DO NOTHING RETURNING id"
HOUR_MARKS = "(" + ", ".join("?" * 10) + ")"
UPSERT_HOURS = (
    "INSERT INTO usage_hourly (hour, tenant, class, requests, prompt_tokens, "
    "completion_tokens, charge, slo_met, degraded, aborted) VALUES {} "
    "ON CONFLICT (hour, tenant, class) DO UPDATE SET "
    "requests = usage_hourly.requests + excluded.requests, "
    "prompt_tokens = usage_hourly.prompt_tokens + excluded.prompt_tokens, "
    "completion_tokens = usage_hourly.completion_tokens + excluded.completion_tokens, "
    "charge = usage_hourly.charge + excluded.charge, "
    "slo_met = usage_hourly.slo_met + excluded.slo_met, "
    "degraded = usage_hourly.degraded + excluded.degraded, "
    "aborted = usage_hourly.aborted + excluded.aborted"
)
INSERT_REFUSALS = "INSERT INTO refusals (id, at, hour, tenant, class, reason, status) VALUES "


def row_params(r: UsageRow) -> tuple:
    return (
        r.id, r.tenant, r.key_id, r.class_asked, r.cls, r.prompt_tokens,
        r.completion_tokens, r.charge, r.ttft_ms, r.tpot_ms, int(r.slo_met),
        r.finish_reason, r.arrival, r.finished, r.hour, r.replica, r.choices,
    )  # fmt: skip


class Store:
    """Base of the two backends. Subclasses implement ``_cursor_tx`` (a context
    manager yielding a cursor inside one transaction, on the caller's thread's
    connection), ``close`` and ``describe``."""

    dialect = "sql"
    param = "?"

    def sql(self, text: str) -> str:
        return text if self.param == "?" else text.replace("?", self.param)

    def _cursor_tx(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def migrate(self) -> int:
        holder: dict = {}

        def run(sql: str, params: tuple) -> list:
            cur = holder["cur"]
            cur.execute(self.sql(sql), params)
            return cur.fetchall() if cur.description is not None else []

        class _Tx:
            def __enter__(s):
                s.cm = self._cursor_tx()
                holder["cur"] = s.cm.__enter__()

            def __exit__(s, *exc):
                return s.cm.__exit__(*exc)

        return migrate(run, _Tx)

    def write(self, items: Sequence[UsageRow | Refusal]) -> int:
        """Store a batch in one transaction; an id already stored is skipped (its
        roll-up is not counted again). Returns how many were new.

        A handful of statements per batch, whatever its size (a multi-row insert that
        returns the ids it inserted, then one upsert of the roll-up summed over them):
        few round trips to PostgreSQL, few GIL hand-offs for SQLite's calls."""
        rows = [it for it in items if isinstance(it, UsageRow)]
        refusals = [it for it in items if not isinstance(it, UsageRow)]
        new = 0
        with self._cursor_tx() as cur:
            inserted: set = set()
            for i in range(0, len(rows), CHUNK):
                part = rows[i : i + CHUNK]
                cur.execute(
                    self.sql(f"{INSERT_ROWS}{', '.join([ROW_MARKS] * len(part))}{RETURNING}"),
                    [v for r in part for v in row_params(r)],
                )
                inserted.update(x[0] for x in cur.fetchall())
            new += len(inserted)
            hours: dict[tuple, list] = {}
            for r in rows:
                if r.id not in inserted:
                    continue
                inserted.discard(r.id)  # a row twice in one batch counts once
                h = hours.setdefault((r.hour, r.tenant, r.cls), [0, 0, 0, 0.0, 0, 0, 0])
                for k, v in enumerate(
                    (1, r.prompt_tokens, r.completion_tokens, r.charge, int(r.slo_met),
                     int(r.degraded), int(r.aborted))
                ):  # fmt: skip
                    h[k] += v
            keys = sorted(hours)
            for i in range(0, len(keys), CHUNK):
                kpart = keys[i : i + CHUNK]
                cur.execute(
                    self.sql(UPSERT_HOURS.format(", ".join([HOUR_MARKS] * len(kpart)))),
                    [v for k in kpart for v in (*k, *hours[k])],
                )
            for i in range(0, len(refusals), CHUNK):
                rpart = refusals[i : i + CHUNK]
                cur.execute(
                    self.sql(INSERT_REFUSALS + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * len(rpart))
                             + " ON CONFLICT (id) DO NOTHING RETURNING id"),
                    [v for it in rpart
                     for v in (it.id, it.at, it.hour, it.tenant, it.cls, it.reason, it.status)],
                )  # fmt: skip
                new += len(cur.fetchall())
        return new

    def query(self, text: str, params: Sequence = ()) -> list[tuple]:
        """Rows of one read statement (``?`` placeholders)."""
        with self._cursor_tx() as cur:
            cur.execute(self.sql(text), tuple(params))
            return [tuple(r) for r in cur.fetchall()]

    def forget_before(self, ts: float) -> int:
        """Retention: delete request and refusal rows that finished before ``ts`` (the
        hourly roll-up stays: budgets and monthly totals read it). Returns how many
        request rows went."""
        with self._cursor_tx() as cur:
            cur.execute(self.sql("DELETE FROM requests WHERE finished < ?"), (ts,))
            n = cur.rowcount
            cur.execute(self.sql("DELETE FROM refusals WHERE at < ?"), (ts,))
        return max(n, 0)

    def close(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError
