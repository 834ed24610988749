"""Two engine replicas of the shipped pair on a local Ray cluster behind one front door
(``adaserve serve --replicas 2``): the official ``openai`` client, requests reaching
both replicas, one tenant's quota held across them, ``/metrics`` and
``/v1/slo/report`` and the dashboard over both, and a replica killed during a burst.

One Ray cluster for the module (starting it and two engines is most of the time)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'adaserve[ray]')")

import ray  # noqa: E402
from pg_fixtures import PgServer, why_no_postgres  # noqa: E402
from server_fixtures import (  # noqa: E402
    check_dashboard_auth,
    class_rows,
    scrape,
    shown,
    sign_in,
    wait_for,
)

from adaserve.cluster.front_door import FrontDoor  # noqa: E402
from adaserve.cluster.ray_router import route_request, stats_of  # noqa: E402
from adaserve.cluster.routing import make_router, with_routed  # noqa: E402
from adaserve.cluster.serve_app import Cluster  # noqa: E402
from adaserve.config import EngineConfig  # noqa: E402
from adaserve.server import parse_config  # noqa: E402
from adaserve.server.app import engine_config_for_server  # noqa: E402
from adaserve.server.config import tomllib  # noqa: E402
from adaserve.server.dashboard import COOKIE  # noqa: E402
from adaserve.server.http_runtime import make_server  # noqa: E402

CONFIG = """
[server]
shutdown_grace_s = 5
# admission off: on a busy machine it may shed a burst's request, and these tests count
# every answer (test_server_overload covers shedding)
admission = false

[tenants.ops]
keys = ["sk-ops"]
admin = true

[tenants.user]
keys = ["sk-user"]

[tenants.limited]
keys = ["sk-limited"]
requests_per_minute = 4

[tenants.daily]
keys = ["sk-daily"]
requests_per_day = 4

[usage]
budget_refresh_s = 0.2
"""


class LiveCluster:
    """``Cluster`` + the front door served by uvicorn in a thread on a free port."""

    def __init__(self, replicas: int = 2, router: str = "slo", usage_db: str | None = None):
        # every replica writes the one usage ledger (PostgreSQL when it can run here)
        text = CONFIG + (f"db = {json.dumps(usage_db)}\n" if usage_db else "")
        cfg = parse_config(tomllib.loads(text))
        ecfg = engine_config_for_server(
            EngineConfig(auto_profile=False, drift_detect=False, kv_cache_bytes=16 << 20),
            cfg,
        )
        self.cluster = Cluster(ecfg, cfg, replicas, router=router, stats_period_s=0.2)
        handle = self.cluster.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        cfg = dataclasses.replace(cfg, host="127.0.0.1", port=self.port)
        self.front = FrontDoor(handle, self.cluster.ledger, cfg, "adaserve")
        self.server = make_server(self.front, cfg, "warning")
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        assert wait_for(lambda: self.server.started, 30)
        assert wait_for(lambda: len(self.live()) == replicas, 60), "replicas did not report"

    url = property(lambda self: f"http://127.0.0.1:{self.port}")

    def client(self, key: str = "sk-user") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def async_client(self, key: str = "sk-user") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def snapshots(self) -> dict:
        return ray.get(self.cluster.ledger.snapshots.remote(), timeout=30)

    def live(self) -> dict:
        return {r: s for r, s in self.snapshots().items() if s["live"]}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from adaserve.util import jit

    mp = pytest.MonkeyPatch()
    # the replicas inherit the environment: the numba kernels this process compiled
    # (or loaded) are theirs too, but no hardware profile from earlier runs
    warm = jit.cache_folder()
    if warm is not None:
        mp.setenv("NUMBA_CACHE_DIR", str(warm))
    mp.setenv("ADASERVE_CACHE", str(tmp_path_factory.mktemp("adaserve_cache")))
    pg = None
    if why_no_postgres() is None:
        pg = PgServer()
        db = pg.new_database()
    else:
        db = str(tmp_path_factory.mktemp("ledger") / "usage.db")
    s = LiveCluster(usage_db=db)
    s.usage_db = db
    yield s
    s.stop()
    mp.undo()
    if pg is not None:
        pg.close()


def _complete(client, **kw):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("prompt", "def fib(n):")
    raw = client.completions.with_raw_response.create(model="adaserve", **kw)
    return raw.headers.get("x-adaserve-replica"), raw.parse()


async def _burst(svc, n: int, key: str = "sk-user", **kw) -> list:
    """``n`` concurrent strict-class completions, prompts of ~200 tokens (enough that
    each one weighs in the router's prediction): [(replica, result or error)]."""
    kw.setdefault("max_tokens", 4)
    async with svc.async_client(key) as c:

        async def one(i):
            try:
                raw = await c.completions.with_raw_response.create(
                    model="adaserve",
                    prompt=f"request {i}: " + "lorem ipsum " * 65,
                    extra_body={"slo_class": "interactive"},
                    **kw,
                )
                return raw.headers.get("x-adaserve-replica"), raw.parse()
            except openai.APIStatusError as e:
                return e.response.headers.get("x-adaserve-replica"), e

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_openai_client_completions_chat_and_streaming(svc):
    c = svc.client()
    rid, out = _complete(c)
    assert rid in svc.live()
    assert out.choices[0].text and out.usage.completion_tokens == 4
    # (ignore_eos: the tiny random model samples its end-of-text now and then)
    chat = c.chat.completions.create(
        model="adaserve",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens == 4
    chunks = list(
        c.chat.completions.create(
            model="adaserve",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 6
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    streamed = list(c.completions.create(model="adaserve", prompt="x", max_tokens=5, stream=True))
    assert sum(1 for ch in streamed if ch.choices and ch.choices[0].text) >= 1
    # errors are the single server's: OpenAI-shaped, with its codes
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        svc.client("sk-wrong").completions.create(model="adaserve", prompt="x", max_tokens=1)


def test_requests_reach_both_replicas(svc):
    res = asyncio.run(_burst(svc, 8))
    assert all(not isinstance(r, Exception) for _, r in res), res
    assert {rid for rid, _ in res} == set(svc.live()), res


def test_one_tenants_quota_holds_across_replicas(svc):
    res = asyncio.run(_burst(svc, 8, key="sk-limited"))
    # the burst reached both replicas (each alone would admit up to 4 of its share)...
    assert {rid for rid, _ in res} == set(svc.live()), res
    ok = [rid for rid, r in res if not isinstance(r, Exception)]
    refused = [r for _, r in res if isinstance(r, Exception)]
    # ...and 4 were admitted in all: requests_per_minute = 4 for the service
    assert len(ok) == 4, res
    assert all(e.status_code == 429 and e.body["code"] == "rate_limit_exceeded" for e in refused)
    assert all(int(e.response.headers["retry-after"]) >= 1 for e in refused)


def test_every_replica_writes_the_one_usage_ledger(svc):
    """Both replicas' rows in the one database (PostgreSQL where it can run), read back
    through the front door, each with the counts its client saw."""
    res = asyncio.run(_burst(svc, 8))
    assert all(not isinstance(r, Exception) for _, r in res), res
    with httpx.Client(base_url=svc.url, timeout=60) as h:
        r = h.get(
            "/v1/usage/requests",
            params={"tenant": "user", "limit": 1000},
            headers={"Authorization": "Bearer sk-ops"},
        )
    assert r.status_code == 200, r.text
    rows = {x["id"]: x for x in r.json()["data"]}
    for replica, resp in res:
        row = rows[resp.id]
        assert row["completion_tokens"] == resp.usage.completion_tokens
        assert row["replica"] == replica  # the Serve replica that served it
    assert len({rows[resp.id]["replica"] for _, resp in res}) == 2


def test_a_daily_budget_holds_across_replicas(svc):
    """requests_per_day = 4 for the service, not per replica: each replica reads the
    others' rows back (budget_refresh_s = 0.2)."""
    c = svc.client("sk-daily")
    served = [_complete(c, max_tokens=1)[0] for _ in range(4)]
    time.sleep(2.0)  # ten refresh periods: every replica has read the four rows
    refused = 0
    for _ in range(6):
        try:
            _complete(c, max_tokens=1)
        except openai.RateLimitError as e:
            assert e.body["reason"] == "requests_per_day"
            refused += 1
    assert refused == 6, served


def _total(metrics: dict, name: str) -> float:
    return sum(v for _, v in metrics.get(name, []))


def _settled(svc) -> dict:
    """/metrics once the replicas' latest counts have arrived (the same generated-token
    total over several push periods)."""
    last, same = None, 0
    t0 = time.monotonic()
    while same < 4 and time.monotonic() - t0 < 30:
        m = scrape(svc.url)
        v = _total(m, "vllm:generation_tokens_total")
        same = same + 1 if v == last else 0
        last = v
        time.sleep(0.2)
    return m


def test_metrics_and_report_aggregate_both_replicas(svc):
    before = _settled(svc)
    rep0 = httpx.get(svc.url + "/v1/slo/report", headers={"Authorization": "Bearer sk-ops"})
    res = asyncio.run(_burst(svc, 6, max_tokens=3))
    assert {rid for rid, _ in res} == set(svc.live())
    made = sum(r.usage.completion_tokens for _, r in res)

    def grown():
        m = scrape(svc.url)
        d = _total(m, "vllm:generation_tokens_total") - _total(
            before, "vllm:generation_tokens_total"
        )
        return m if d >= made else None

    assert wait_for(grown, 20, every=0.1), "the new tokens never showed in /metrics"
    m = _settled(svc)
    # counters summed, exactly; gauges per replica
    d = _total(m, "vllm:generation_tokens_total") - _total(before, "vllm:generation_tokens_total")
    assert d == made
    waiting = {lab["replica"] for lab, _ in m["vllm:num_requests_waiting"]}
    assert waiting == set(svc.live())
    assert {lab["replica"] for lab, _ in m["vllm:kv_cache_usage_perc"]} == waiting
    # without a key: no per-tenant (billing) series; the admin key shows them
    assert "adaserve:tenant_output_tokens_total" not in m
    admin = scrape(svc.url, "sk-ops")
    assert {lab["tenant"] for lab, _ in admin["adaserve:tenant_output_tokens_total"]} >= {"user"}
    mine = scrape(svc.url, "sk-limited")
    assert {lab["tenant"] for lab, _ in mine.get("adaserve:tenant_output_tokens_total", [])} <= {
        "limited"
    }
    rep = httpx.get(svc.url + "/v1/slo/report", headers={"Authorization": "Bearer sk-ops"}).json()
    assert rep["requests"] - rep0.json()["requests"] >= len(res)
    assert rep["engine"]["live_replicas"] == 2
    assert set(rep["engine"]["replicas"]) >= set(svc.live())
    assert rep["tenants"]["user"]["total"]["completion_tokens"] >= made


def test_dashboard_merges_both_replicas(svc):
    """The front door's /dashboard: the single server's auth (page and data 401 / 403 /
    200, session cookies), its data the replicas' merged, matching /v1/slo/report."""
    token = check_dashboard_auth(svc.url, "sk-ops", "sk-user")
    res = asyncio.run(_burst(svc, 4, max_tokens=3))
    assert all(not isinstance(r, Exception) for _, r in res), res
    admin = {"Authorization": "Bearer sk-ops"}

    def consistent():
        """(report, data) with nothing pushed between them that changed the report."""
        with httpx.Client(base_url=svc.url, timeout=30) as h:
            rep = h.get("/v1/slo/report", headers=admin).json()
            data = h.get("/v1/dashboard/data", headers={"Cookie": f"{COOKIE}={token}"})
            again = h.get("/v1/slo/report", headers=admin).json()
        idle = rep["engine"]["running"] == rep["engine"]["waiting"] == 0
        return idle and rep == again and (rep, data)

    got = wait_for(consistent, 30, every=0.2)
    assert got, "the report never settled"
    rep, r = got
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    data = r.json()
    assert [c["name"] for c in data["classes"]] == list(rep["classes"])
    for c in data["classes"]:
        want = rep["classes"][c["name"]]
        for k in ("requests", "attained", "attainment", "targets", "ttft_ms", "tpot_ms"):
            assert c[k] == want[k], (c["name"], k)
        assert c["verification"] == want["verification"]
        roll = c["rolling"]
        assert 0 <= roll["attained"] <= roll["requests"] <= want["requests"]
    assert sum(c["requests"] for c in data["classes"]) == rep["requests"]
    # the burst just finished: inside the rolling window
    inter = next(c for c in data["classes"] if c["name"] == "interactive")
    assert inter["rolling"]["requests"] >= len(res)
    eng = rep["engine"]
    keys = ("running", "waiting", "kv_usage", "iterations", "unloaded_tpot_ms", "threads")
    assert {k: data["engine"][k] for k in keys} == {k: eng[k] for k in keys}
    stalls: dict = {}
    reps = svc.snapshots().values()
    # one deployment, one thread plan and profile: the service's is every replica's
    assert all(s["report"]["engine"]["profile"] == eng["profile"] for s in reps)
    assert all(s["report"]["engine"]["threads"] == eng["threads"] for s in reps)
    for s in reps:
        for cause, n in (s["report"]["engine"].get("stalls") or {}).items():
            stalls[cause] = stalls.get(cause, 0) + n
    assert data["engine"]["stalls"] == eng["stalls"] == stalls
    assert data["engine"]["profile"] == eng["profile"]
    assert eng["threads"]["threads"] >= 1
    assert data["fallback_iterations"] == eng["fallback_iterations"]
    # acceptance by position: every replica's counts summed (all accepted draft tokens)
    assert (
        sum(p["accepted"] for p in data["acceptance_by_position"]) == (eng["spec_accepted_tokens"])
    )
    snaps = svc.snapshots()
    assert data["spec_drafts"] == sum(
        s["report"]["dashboard"]["spec_drafts"] for s in snaps.values()
    )
    assert set(data["tenants"]) >= {"ops", "user", "limited"}
    for name, u in rep["tenants"].items():
        assert data["tenants"][name]["requests"] == u["total"]["requests"]
    # per replica: gauges, and its own timeline on the front door's time axis
    assert set(data["replicas"]) == set(eng["replicas"])
    for rid, rr in data["replicas"].items():
        e = eng["replicas"][rid]
        assert (rr["live"], rr["running"], rr["iterations"]) == (
            e["live"],
            e["running"],
            e["iterations"],
        )
        t = rr["timeline"]["t"]
        assert t and t == sorted(t) and t[-1] <= data["as_of_s"] + 1.0, (rid, t[-3:])
    assert data["timeline_replica"] in svc.live()
    assert data["timeline"] == data["replicas"][data["timeline_replica"]]["timeline"]
    with httpx.Client(base_url=svc.url, timeout=30) as h:
        page = h.get("/dashboard", headers={"Cookie": f"{COOKIE}={token}"})
        assert page.status_code == 200 and '<form id="login"' in page.text
        out = h.delete("/v1/dashboard/session", headers={"Cookie": f"{COOKIE}={token}"})
        assert out.status_code == 204
        gone = h.get("/v1/dashboard/data", headers={"Cookie": f"{COOKIE}={token}"})
        assert gone.status_code == 401


def test_dashboard_in_the_browser(svc, browser):
    """The front door's page in headless Chromium: turned away without the admin key,
    then the merged class table, a row per replica, a chart per replica, sign-out."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    # traffic on both replicas of its own (each replica's charts need iterations)
    res = asyncio.run(_burst(svc, 8))
    assert {rid for rid, _ in res} == set(svc.live()), res
    d = browser
    d.get(svc.url + "/dashboard")
    assert wait_for(lambda: shown(d, "login"), 30)
    sign_in(d, "sk-user")
    assert wait_for(lambda: "admin" in d.find_element(By.ID, "login-msg").text, 30)
    sign_in(d, "sk-ops")
    rep = httpx.get(svc.url + "/v1/slo/report", headers={"Authorization": "Bearer sk-ops"}).json()
    want = {c: n["requests"] for c, n in rep["classes"].items()}

    def table_shown():
        rows = class_rows(d)
        return {c: int(r["requests"][1]) for c, r in rows.items()} == want and rows

    assert wait_for(table_shown, 30), (class_rows(d), want)
    replicas = d.execute_script(
        "return [...document.querySelectorAll('#replicas tr[data-replica]')]"
        ".map(tr => tr.dataset.replica)"
    )
    assert set(replicas) == set(svc.live())
    pick = Select(d.find_element(By.ID, "replica"))
    assert {o.get_attribute("value") for o in pick.options} == set(replicas)
    first = pick.first_selected_option.get_attribute("value")
    other = next(r for r in replicas if r != first)
    pick.select_by_value(other)
    canvases = "return document.querySelectorAll('.charts canvas').length"
    assert wait_for(lambda: d.execute_script(canvases) >= 6, 10)
    # the choice holds across polls
    as_of = float(d.find_element(By.TAG_NAME, "body").get_attribute("data-as-of"))
    assert wait_for(
        lambda: float(d.find_element(By.TAG_NAME, "body").get_attribute("data-as-of")) > as_of, 30
    )
    assert (
        Select(d.find_element(By.ID, "replica")).first_selected_option.get_attribute("value")
        == other
    )
    assert d.execute_script("return sessionStorage.length") == 0
    d.find_element(By.ID, "signout").click()
    # the page reloads: between documents there is no #login to find yet
    assert wait_for(lambda: shown(d, "login"), 30)
    assert not class_rows(d) and d.get_cookies() == []


async def _mixed_burst(svc, n: int, started: asyncio.Queue, broken: list | None = None) -> list:
    """``n`` concurrent long strict-class requests, half streamed (each puts its replica
    on ``started`` when its stream begins): each a result, or the error (``broken``
    gets the response ids of the streams that began and then failed)."""
    async with svc.async_client() as c:

        async def one(i):
            body = dict(
                model="adaserve",
                prompt=f"burst {i}",
                max_tokens=96,
                extra_body={"slo_class": "interactive"},
            )
            rid = None
            try:
                if i % 2:
                    text = ""
                    stream = await c.completions.create(stream=True, **body)
                    started.put_nowait(stream.response.headers.get("x-adaserve-replica"))
                    async for ch in stream:
                        rid = ch.id or rid
                        if ch.choices:
                            text += ch.choices[0].text or ""
                    return ("stream", text)
                out = await c.completions.create(**body)
                return ("whole", out.choices[0].text)
            except openai.APIError as e:  # an HTTP error, or an SSE error event
                if rid is not None and broken is not None:
                    broken.append(rid)
                return ("error", e)

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 120)


def test_killed_replica_every_request_answered_and_service_recovers(svc):
    live = svc.live()
    assert len(live) == 2
    pids = {rid: s["report"]["engine"]["pid"] for rid, s in live.items()}
    victim = None
    broken: list = []

    async def run():
        nonlocal victim
        started: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(_mixed_burst(svc, 8, started, broken))
        victim = await asyncio.wait_for(started.get(), 60)  # a stream in flight there
        os.kill(pids[victim], signal.SIGKILL)
        return await task

    res = asyncio.run(run())
    (survivor,) = set(pids) - {victim}
    assert len(res) == 8
    errors = [str(v) for kind, v in res if kind == "error"]
    # the stream in flight on the killed replica (at least) ended with a clear error
    assert errors and all("replica" in m and "failed" in m for m in errors), errors
    assert all(isinstance(v, str) and v for kind, v in res if kind != "error")
    # the service goes on: new requests are answered (by the survivor, or the new one)
    for _ in range(3):
        rid, out = _complete(svc.client())
        assert out.usage.completion_tokens == 4

    def idle():  # KV on the survivor returns to empty
        s = svc.snapshots().get(survivor)
        e = s["report"]["engine"] if s else {}
        return s and s["live"] and e["running"] == 0 and e["waiting"] == 0 and e["kv_usage"] == 0

    assert wait_for(idle, 30, every=0.1), svc.snapshots()[survivor]["report"]["engine"]

    def counted():  # what the victim had streamed, once it is taken for dead
        rep = httpx.get(svc.url + "/v1/slo/report", headers={"Authorization": "Bearer sk-ops"})
        n = rep.json()["engine"]["interrupted"]
        return n["requests"] >= 1 and n

    n = wait_for(counted, 30, every=0.2)
    assert n and n["requests"] <= len(errors) and n["completion_tokens"] >= n["requests"], n
    # ...and the usage ledger has one row for each broken stream (the front door's,
    # billing what it had relayed, unless its replica had committed its own first)
    from adaserve.ledger import UsageConfig, open_store

    def rows():
        store = open_store(UsageConfig(db=svc.usage_db))
        try:
            marks = ", ".join("?" * len(broken))
            return store.query(
                f"SELECT id, finish_reason, completion_tokens FROM requests WHERE id IN ({marks})",
                broken,
            )
        finally:
            store.close()

    assert broken
    got = wait_for(lambda: len(rows()) == len(broken) and rows(), 30, every=0.2)
    assert got and sorted(r[0] for r in got) == sorted(broken), (got, broken)
    failed = [r for r in got if r[1] == "replica_failed"]
    assert failed and all(r[2] <= 96 for r in got)
    if len(failed) == n["requests"]:
        assert sum(r[2] for r in failed) == n["completion_tokens"], (failed, n)
    # every request answered replica_failed is counted where it ended (issue 36 item 8):
    # the report (per class) and /metrics (vLLM's abort, our replica_failed)
    rep = httpx.get(svc.url + "/v1/slo/report", headers={"Authorization": "Bearer sk-ops"})
    by_class = rep.json()["engine"]["replica_failed"]
    assert sum(by_class.values()) == len(errors), (by_class, errors)
    for cls, k in by_class.items():
        assert rep.json()["classes"][cls]["finish_reasons"]["replica_failed"] >= k
    m = scrape(svc.url, "sk-ops")
    ours = [
        v
        for lab, v in m["adaserve:requests_finished_total"]
        if lab["finish_reason"] == "replica_failed"
    ]
    assert sum(ours) == len(errors), m["adaserve:requests_finished_total"]
    aborts = [v for lab, v in m["vllm:request_success_total"] if lab["finished_reason"] == "abort"]
    assert sum(aborts) >= len(errors)
    # Ray Serve replaces the dead replica
    assert wait_for(lambda: len(set(svc.live()) - {victim}) == 2, 180, every=0.5)


def test_graceful_shutdown_drains_every_replica(svc):
    """(Last: it drains the module's service.)"""
    svc.front.front.begin_drain(30.0)
    r = httpx.post(
        svc.url + "/v1/completions",
        json={"model": "adaserve", "prompt": "x", "max_tokens": 1},
        headers={"Authorization": "Bearer sk-user"},
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"

    def drained():
        live = svc.live()
        return live and all(s["report"]["engine"]["draining"] for s in live.values())

    assert wait_for(drained, 20, every=0.1), "a replica never began draining"


# ---------------------------------------------------------------------- the Ray router


def _stats(rid: str, at_s: float = 0.0) -> dict:
    """A replica's report as ``record_routing_stats`` sends it (an idle replica)."""
    cls = [
        {"name": "interactive", "rank": 0, "tpot_ms": 14.0, "ttft_ms": 2000.0},
        {"name": "chat", "rank": 1, "tpot_ms": 21.0, "ttft_ms": 4000.0},
    ]
    return {
        "replica_id": rid,
        "classes": [
            {**c, "predicted_tpot_ms": 5.0, "running": 0, "waiting": 0, "prefill_tokens": 0}
            for c in cls
        ],
        "budget_tokens": 16,
        "spare_budget_tokens": 100,
        "running": 0,
        "waiting": 0,
        "waiting_prefill_tokens": 0,
        "kv_free_fraction": 1.0,
        "pass_ms": 10.0,
        "at_s": at_s,
        "ms_per_token": 0.25,
        "unknown_future_field": 1,  # a newer replica's extra field is ignored
    }


def test_router_adapter_spreads_a_burst_between_reports():
    """Between two reports the adapter adds what it has sent (``with_routed``), so a
    burst alternates between two idle replicas (strict and relaxed alike with the
    default router), while ``balance=slack:relaxed=pack`` packs relaxed requests onto one."""
    for spec, cls, spread in (
        ("slo", "interactive", True),
        ("slo", "chat", True),
        ("slo:balance=slack:relaxed=pack", "chat", False),
    ):
        policy = make_router(spec)
        stats = [stats_of(r, _stats(r), 0.0) for r in ("r0", "r1")]
        chosen = []
        for _ in range(6):
            route = {"generation": True, "slo_class": cls, "prompt_tokens": 8, "max_tokens": 8}
            req = route_request(route, stats, "chat")
            best = policy.rank(req, stats)[0]
            chosen.append(best)
            i = [s.replica_id for s in stats].index(best)
            stats[i] = with_routed(stats[i], req)
        assert (len(set(chosen)) == 2) == spread, (spec, cls, chosen)
    assert stats[0].waiting + stats[1].waiting == 6
    assert sum(c.prefill_tokens for s in stats for c in s.classes) == 48


def test_route_request_takes_rank_and_targets_from_reports():
    stats = [stats_of("r0", _stats("r0"), 0.0)]
    req = route_request({"slo_class": None, "prompt_tokens": 3}, stats, "chat")
    assert (req.slo_class, req.rank, req.tpot_ms, req.ttft_ms) == ("chat", 1, 21.0, 4000.0)
    req = route_request({"slo_class": "interactive", "tpot_ms": 30.0}, stats, "chat")
    assert (req.rank, req.tpot_ms, req.ttft_ms) == (0, 30.0, 2000.0)
    idle = stats_of("new", None, 5.0)  # no report yet: an idle replica
    assert idle.running == 0 and idle.classes == () and idle.at_s == 5.0
