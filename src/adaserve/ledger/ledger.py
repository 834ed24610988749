"""The ledger a server runs: the store, its batched writer and spool, the budgets, and
the housekeeping thread (retention, daily report files)."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path

from adaserve.ledger.budgets import BudgetBook
from adaserve.ledger.config import UsageConfig
from adaserve.ledger.query import class_report
from adaserve.ledger.rows import Refusal, UsageRow
from adaserve.ledger.spool import Spool
from adaserve.ledger.store import Store
from adaserve.ledger.writer import LedgerWriter

log = logging.getLogger("adaserve.ledger")

HOUSEKEEPING_S = 3600.0


def open_store(cfg: UsageConfig) -> Store:
    """The configured database, migrated to this build's schema."""
    kind, where = cfg.target()
    if kind == "postgresql":
        from adaserve.ledger.postgres import PostgresStore

        store: Store = PostgresStore(where)
    else:
        from adaserve.ledger.sqlite import SqliteStore

        store = SqliteStore(where, cfg.sqlite_synchronous)
    try:
        store.migrate()
    except Exception:
        store.close()
        raise
    return store


def default_replica() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Ledger:
    def __init__(self, cfg: UsageConfig, budgets: BudgetBook | None = None):
        self.cfg = cfg
        self.store = open_store(cfg)
        self.replica = cfg.replica or default_replica()
        self.budgets = budgets or BudgetBook({})
        try:
            self.budgets.load(self.store)
        except Exception:
            self.store.close()
            raise
        self.writer = LedgerWriter(self.store, Spool(cfg.spool_path()))
        self._stop = threading.Event()
        self._house = threading.Thread(
            target=self._housekeeping, name="adaserve-ledger-house", daemon=True
        )
        self._house.start()

    def describe(self) -> str:
        return self.store.describe()

    def record(self, row: UsageRow) -> Future:
        return self.writer.submit(row)

    def refuse(self, tenant: str, cls: str, reason: str, status: int) -> Future:
        return self.writer.submit(
            Refusal(uuid.uuid4().hex, time.time(), tenant, cls or "", reason, status)
        )

    def close(self) -> None:
        self._stop.set()
        self._house.join(60)  # not mid-statement when the store closes
        self.writer.close()
        self.store.close()

    # ------------------------------------------------------------------ housekeeping
    def _housekeeping(self) -> None:
        """Retention and report files hourly; the budgets every ``budget_refresh_s``
        (not while records are spooled: the database lacks them then)."""
        next_tidy = 0.0
        while True:
            now = time.monotonic()
            if now >= next_tidy:
                next_tidy = now + HOUSEKEEPING_S
                try:
                    self.tidy()
                except Exception as e:  # the database may be down: try again next time
                    log.warning("usage ledger housekeeping failed: %s", e)
            elif self.budgets and not self.writer.stats.spooling:
                try:
                    self.budgets.load(self.store, self.writer.commit_lock)
                except Exception as e:
                    log.debug("usage ledger: budgets not refreshed: %s", e)
            if self._stop.wait(self.cfg.budget_refresh_s):
                return

    def tidy(self, now: float | None = None) -> None:
        """Retention (``keep_days``) and yesterday's report file (``report_dir``)."""
        now = time.time() if now is None else now
        if self.cfg.keep_days is not None:
            n = self.store.forget_before(now - self.cfg.keep_days * 86400)
            if n:
                log.info("usage ledger: %d request row(s) older than %g days deleted", n,
                         self.cfg.keep_days)  # fmt: skip
        if self.cfg.report_dir is not None:
            self.write_daily_report(now)

    def write_daily_report(self, now: float) -> Path | None:
        """Yesterday's (UTC) per-class report as JSON, once."""
        day0 = (int(now // 86400) - 1) * 86400
        name = time.strftime("slo-report-%Y-%m-%d.json", time.gmtime(day0))
        if self.cfg.report_dir is None:
            return None
        d = Path(self.cfg.report_dir)
        p = d / name
        if p.exists():
            return None
        d.mkdir(parents=True, exist_ok=True)
        rep = class_report(self.store, day0, day0 + 86400)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(rep, indent=1, sort_keys=True))
        os.replace(tmp, p)
        return p
