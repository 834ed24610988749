"""The ledger package on its own (torch-free), on SQLite and PostgreSQL: migrations
and the version table, idempotent writes (a row stored twice counts once, in the rows
and the hourly totals), the spool (order, a torn last line, a replay run twice),
retention, the daily report file, time parsing, the ``[usage]`` config and
``adaserve usage`` on the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from pg_fixtures import PgServer, why_no_postgres

from adaserve.ledger import Ledger, UsageConfig, UsageConfigError, UsageRow, open_store
from adaserve.ledger.query import (
    class_report,
    daily_class_report,
    list_requests,
    parse_time,
    usage_totals,
)
from adaserve.ledger.rows import Refusal, to_line
from adaserve.ledger.schema import LATEST, SchemaError
from adaserve.ledger.spool import Spool
from adaserve.ledger.writer import LedgerWriter
from adaserve.server import parse_config
from adaserve.server.config import ConfigError, tomllib


@pytest.fixture(scope="module")
def pg():
    why = why_no_postgres()
    if why is not None:
        pytest.skip(why)
    s = PgServer()
    yield s
    s.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "usage.db")
    return request.getfixturevalue("pg").new_database()


def row(i: int, tenant="t", cls="chat", asked=None, finished=None, reason="stop") -> UsageRow:
    now = time.time() if finished is None else finished
    return UsageRow(
        id=f"cmpl-{i}", tenant=tenant, key_id="abc", class_asked=asked or cls, cls=cls,
        prompt_tokens=3, completion_tokens=5, charge=0.25, ttft_ms=10.0 + i, tpot_ms=2.0,
        slo_met=i % 2 == 0, finish_reason=reason, arrival=now - 1, finished=now, replica="r",
    )  # fmt: skip


def test_migrations_run_once_and_refuse_a_newer_schema(db):
    s = open_store(UsageConfig(db=db))
    try:
        assert s.query("SELECT version FROM schema_version") == [(LATEST,)]
        assert s.migrate() == LATEST  # a second run: nothing to do
        assert s.query("SELECT COUNT(*) FROM schema_version") == [(1,)]
        s.write([row(1)])
        with s._cursor_tx() as cur:
            cur.execute(s.sql("UPDATE schema_version SET version = ?"), (LATEST + 1,))
    finally:
        s.close()
    with pytest.raises(SchemaError, match="newer than this"):
        open_store(UsageConfig(db=db))


def test_a_row_written_twice_is_stored_and_counted_once(db):
    s = open_store(UsageConfig(db=db))
    try:
        rows = [row(i) for i in range(5)] + [row(9, cls="batch", asked="chat", reason="abort")]
        ref = Refusal("r1", time.time(), "t", "chat", "tokens_per_day", 429)
        assert s.write([*rows, ref]) == 7
        assert s.write([*rows, ref]) == 0
        assert s.write(rows[:2] + [row(10)]) == 1
        assert s.write([row(11), row(11)]) == 1  # twice in one batch
        tot = {b["class"]: b for b in usage_totals(s)}
        assert tot["chat"]["requests"] == 7 and tot["chat"]["completion_tokens"] == 35
        assert tot["batch"]["degraded"] == 1 and tot["batch"]["aborted"] == 1
        got, more = list_requests(s, limit=100)
        assert len(got) == 8 and not more
        rep = class_report(s, None, None)["classes"]
        assert rep["chat"]["degraded_out"] == 1 and rep["batch"]["degraded_in"] == 1
        assert rep["chat"]["refusals"] == {"tokens_per_day": 1}
        daily = daily_class_report(s)
        assert sum(d["requests"] for d in daily) == 8
    finally:
        s.close()


@pytest.mark.parametrize("sync,level", [(None, 1), ("normal", 1), ("full", 2)])
def test_sqlite_runs_in_wal_mode_with_the_synchronous_asked(tmp_path, sync, level):
    kw = {} if sync is None else {"sqlite_synchronous": sync}
    s = open_store(UsageConfig(db=str(tmp_path / "u.db"), **kw))
    try:
        assert s.query("PRAGMA journal_mode") == [("wal",)]
        assert s.query("PRAGMA synchronous") == [(level,)]  # NORMAL = 1, FULL = 2
    finally:
        s.close()


def test_paging_is_complete_and_ordered(db):
    s = open_store(UsageConfig(db=db))
    try:
        t = time.time()
        s.write([row(i, finished=t + (i % 3)) for i in range(25)])
        seen, after = [], None
        while True:
            page, more = list_requests(s, after=after, limit=7)
            seen += page
            if not more:
                break
            after = page[-1]["id"]
        assert len(seen) == 25 and len({r["id"] for r in seen}) == 25
        keys = [(r["finished"], r["id"]) for r in seen]
        assert keys == sorted(keys)
    finally:
        s.close()


def test_retention_keeps_the_hourly_totals(db):
    s = open_store(UsageConfig(db=db))
    try:
        old = time.time() - 40 * 86400
        s.write([row(1, finished=old), row(2)])
        assert s.forget_before(time.time() - 30 * 86400) == 1
        assert [r["id"] for r in list_requests(s)[0]] == ["cmpl-2"]
        assert sum(b["requests"] for b in usage_totals(s)) == 2
    finally:
        s.close()


def test_keep_days_is_applied_by_the_ledger(tmp_path):
    cfg = UsageConfig(db=str(tmp_path / "u.db"), keep_days=30)
    s = open_store(cfg)
    s.write([row(1, finished=time.time() - 31 * 86400), row(2)])
    s.close()
    led = Ledger(cfg)  # its housekeeping applies retention at start-up, then hourly
    try:
        led.tidy()
        assert [r["id"] for r in list_requests(led.store)[0]] == ["cmpl-2"]
    finally:
        led.close()


def test_spool_order_torn_line_and_replay_twice(tmp_path, db):
    sp = Spool(tmp_path / "spool.jsonl")
    sp.append([row(1), row(2)])
    sp.append([Refusal("r1", time.time(), "t", "chat", "quota", 429), row(3)])
    with open(sp.path, "a") as f:  # a crash mid-append
        f.write(to_line(row(4))[:30])
    items = list(sp.items())
    assert [getattr(i, "id", None) for i in items] == ["cmpl-1", "cmpl-2", "r1", "cmpl-3"]
    s = open_store(UsageConfig(db=db))
    try:
        s.write(items[:2])  # as if a replay had committed part of it before a crash
        w = LedgerWriter(s, sp, retry_s=0.05)  # a spool left over: replays it
        w.flush(30)
        deadline = time.monotonic() + 30
        while w.stats.spooling and time.monotonic() < deadline:
            time.sleep(0.02)
        w.close()
        assert not sp.path.exists()
        assert w.stats.replayed == 2  # cmpl-3 and r1: the rest were stored already
        assert sorted(r["id"] for r in list_requests(s)[0]) == ["cmpl-1", "cmpl-2", "cmpl-3"]
        assert sum(b["requests"] for b in usage_totals(s)) == 3
    finally:
        s.close()


def test_servers_sharing_a_spool_path_get_slots_of_their_own(tmp_path):
    a = Spool(tmp_path / "spool.jsonl")
    b = Spool(tmp_path / "spool.jsonl")
    assert a.path == tmp_path / "spool.jsonl" and b.path == tmp_path / "spool.1.jsonl"
    b.append([row(1)])
    b.close()  # b's server is gone; what it spooled stays in its slot
    c = Spool(tmp_path / "spool.jsonl")
    assert c.path == b.path and [i.id for i in c.items()] == ["cmpl-1"]
    # a killed process's lock goes with it
    code = (
        "import sys, os, signal; sys.path.insert(0, 'src');"
        "from adaserve.ledger.spool import Spool;"
        f"s = Spool({str(tmp_path / 'other.jsonl')!r}); print(s.path, flush=True);"
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == str(tmp_path / "other.jsonl")
    assert Spool(tmp_path / "other.jsonl").path == tmp_path / "other.jsonl"
    a.close()
    c.close()


def test_daily_report_file(tmp_path):
    """Written once, by the ledger's housekeeping at start-up (then daily)."""
    cfg = UsageConfig(db=str(tmp_path / "u.db"), report_dir=str(tmp_path / "reports"))
    now = time.time()
    y = now - 86400
    s = open_store(cfg)
    s.write([row(1, finished=y), row(2, finished=y), row(3, finished=now)])
    s.close()
    led = Ledger(cfg)
    try:
        p = tmp_path / "reports" / time.strftime("slo-report-%Y-%m-%d.json", time.gmtime(y))
        deadline = time.monotonic() + 30
        while not p.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        rep = json.loads(p.read_text())
        assert rep["classes"]["chat"]["requests"] == 2
        assert led.write_daily_report(now) is None  # once
    finally:
        led.close()


def test_parse_time():
    assert parse_time("1700000000") == 1700000000
    assert parse_time("2026-12-06") == 1796515200
    assert parse_time("2026-12-06T01:00:00Z") == 1796515200 + 3600
    assert parse_time("2026-12-06T02:00:00+01:00") == 1796515200 + 3600
    assert abs(parse_time("-2h") - (time.time() - 7200)) < 5
    assert abs(parse_time("1d") - (time.time() - 86400)) < 5
    assert parse_time("0001-01-01") == 0  # before the epoch: the epoch
    for bad in ("", "soon", "-5", "nan", "inf", "2026-13-01", "1e300", "100000000001"):
        with pytest.raises(ValueError):
            parse_time(bad)


def test_usage_config():
    assert UsageConfig(db="none").enabled is False
    assert UsageConfig(db="NONE").enabled is False
    assert UsageConfig(db="sqlite:////x/u.db").target() == ("sqlite", "/x/u.db")
    assert UsageConfig(db="postgresql://u@h/d").target()[0] == "postgresql"
    assert UsageConfig(db="postgres://u@h/d").target()[0] == "postgresql"
    for bad in ({"db": "mysql://x"}, {"db": "sqlite://x"}, {"db": ""}, {"keep_days": 0},
                {"keep_days": True}, {"commit_timeout_s": -1}):  # fmt: skip
        with pytest.raises(UsageConfigError):
            UsageConfig(**bad)
    cfg = parse_config(tomllib.loads('[usage]\ndb = "none"\nkeep_days = 90\n'))
    assert cfg.usage.keep_days == 90 and not cfg.usage.enabled
    for text, what in (
        ("[usage]\ncolour = 1\n", "unknown key"),
        ("[usage]\nkeep_days = -1\n", "keep_days"),
        ('[tenants.a]\nkeys = ["sk-aaaa-bbbb"]\ntokens_per_day = 0\n', "tokens_per_day"),
        ('[tenants.a]\nkeys = ["sk-aaaa-bbbb"]\ncharge_per_month = "lots"\n', "charge_per_month"),
    ):
        with pytest.raises(ConfigError, match=what):
            parse_config(tomllib.loads(text))


def test_default_location_is_the_data_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("ADASERVE_DATA", str(tmp_path / "d"))
    assert UsageConfig().target() == ("sqlite", str(tmp_path / "d" / "usage.db"))
    monkeypatch.delenv("ADASERVE_DATA")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "x"))
    assert UsageConfig().target() == ("sqlite", str(tmp_path / "x" / "adaserve" / "usage.db"))


def _usage_cli(*argv):
    return subprocess.run(
        [sys.executable, "-m", "adaserve", "usage", *argv],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )  # fmt: skip


def test_adaserve_usage_command(tmp_path):
    dbp = str(tmp_path / "u.db")
    s = open_store(UsageConfig(db=dbp))
    s.write([row(i, tenant="a" if i < 3 else "b") for i in range(5)])
    s.close()
    r = _usage_cli("--db", dbp)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("start,tenant,class,requests") and len(lines) == 3
    r = _usage_cli("--db", dbp, "--format", "json", "--tenant", "a", "--since=-1d")
    data = json.loads(r.stdout)
    assert [(d["tenant"], d["requests"]) for d in data] == [("a", 3)]
    r = _usage_cli("--db", dbp, "--requests", "--format", "json")
    assert len(json.loads(r.stdout)) == 5
    r = _usage_cli("--db", dbp, "--report")
    assert json.loads(r.stdout)["classes"]["chat"]["requests"] == 5
    for argv, want in (
        (["--db", str(tmp_path / "none.db")], "no usage ledger at"),
        (["--db", dbp, "--since", "soon"], "bad time"),
        (["--db", "mysql://x"], "unknown scheme"),
    ):
        r = _usage_cli(*argv)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr


def test_a_budget_refresh_racing_a_commit_counts_the_row_once(tmp_path):
    """The budgets' refresh reads the database's totals and adds this server's rows not
    yet committed. A refresh that falls between a row's commit and its future being
    marked done counted it twice (seen under load: a two-replica cluster refused the
    third of four requests against requests_per_day = 4)."""
    from adaserve.ledger import Budget, BudgetBook

    cfg = UsageConfig(db=str(tmp_path / "u.db"), budget_refresh_s=3600.0)
    book = BudgetBook({"t": Budget(requests_per_day=4)})
    led = Ledger(cfg, book)
    committed, release = threading.Event(), threading.Event()
    write = led.store.write

    def slow_write(items):  # commits, then lingers before the writer marks the rows done
        n = write(items)
        committed.set()
        release.wait(10)
        return n

    led.store.write = slow_write
    try:
        assert book.admit("t")
        book.settle("t", True, 8, 0.25, True, lambda: led.record(row(1, tenant="t")))
        assert committed.wait(10)
        refresh = threading.Thread(target=book.load, args=(led.store, led.writer.commit_lock))
        refresh.start()
        refresh.join(0.3)
        release.set()
        refresh.join(10)
        assert book.spent("t")["requests_today"] == 1
        book.load(led.store, led.writer.commit_lock)
        assert book.spent("t")["requests_today"] == 1
    finally:
        release.set()
        led.close()
