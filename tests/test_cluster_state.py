"""The state replicas of one service share, without Ray: the ledger's quotas across
replicas (and a dead replica's slots given back), the replica-side quota book's batched
settlements, the merged ``/metrics`` and report, and what the front door tells the
router of a request."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.datastructures import Headers

from adaserve.cluster.front_door import route_of
from adaserve.cluster.ledger import Ledger
from adaserve.cluster.merge import merge_dashboard, merge_metrics, merge_report
from adaserve.cluster.shared_quotas import SharedQuotaBook
from adaserve.server.config import Tenant
from adaserve.server.engine_loop import EngineSnapshot, Final
from adaserve.server.errors import ApiError
from adaserve.server.metrics import ServerMetrics
from adaserve.server.report import Record


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _ledger(*tenants, clock=None):
    return Ledger(tuple(tenants), stale_s=5.0, clock=clock or Clock())


def test_requests_per_minute_hold_across_replicas():
    led = _ledger(Tenant("t", requests_per_minute=3))
    got = [led.enter(r, "t")[0] for r in ("a", "b", "a", "b")]
    assert got == ["ok", "ok", "ok", "error"]
    err = led.enter("a", "t")
    assert err[1][0] == 429 and err[1][-1] == "requests_per_minute" and err[2] > 0


def test_concurrency_slot_held_across_replicas_until_its_release_arrives():
    led = _ledger(Tenant("t", max_concurrent=1))
    assert led.enter("a", "t")[0] == "ok"
    assert led.enter("b", "t")[0] == "error"
    # a release only ends a slot of the replica that sends it
    assert led.enter("b", "t", [("release", "t")])[0] == "error"
    led.push("a", {}, [], [("release", "t")])  # a's batch, with its next report
    assert led.enter("b", "t")[0] == "ok"


def test_tokens_reserved_then_unused_part_settled():
    led = _ledger(Tenant("t", tokens_per_minute=100))
    assert led.admit("a", "t", 10, [80], False) == ("ok", [80])
    assert led.admit("b", "t", 10, [70], False)[0] == "error"  # 90 of 100 reserved
    led.settle("a", [("settle", "t", 80, 5), ("release", "t")])  # it made 5: 85 left
    assert led.admit("b", "t", 10, [70], False)[0] == "ok"


def test_dead_replica_gives_back_its_slots_and_gauges():
    clock = Clock()
    led = _ledger(Tenant("t", max_concurrent=1), clock=clock)
    led.push("a", {"engine": {}}, [], [])
    assert led.enter("a", "t")[0] == "ok"
    clock.t = 3.0
    led.push("b", {"engine": {}}, [], [])
    assert led.enter("b", "t")[0] == "error"
    clock.t = 6.0  # a has been silent for 6 s > stale_s: taken for dead
    assert led.live_replicas() == ["b"]
    assert led.enter("b", "t")[0] == "ok"
    snaps = led.snapshots()
    assert not snaps["a"]["live"] and snaps["b"]["live"]


def test_dead_replica_gives_back_the_output_its_requests_did_not_produce():
    clock = Clock()
    led = _ledger(Tenant("t", tokens_per_minute=1000), clock=clock)
    tokens = lambda: led.quotas.tokens_available("t")  # noqa: E731
    led.push("a", {"engine": {}}, [], [])
    assert led.admit("a", "t", 10, [300, 300], False) == ("ok", [300, 300])
    assert led.admit("a", "t", 10, [200], False)[0] == "ok"
    assert tokens() == pytest.approx(180)  # 1000 - 820, the clock stands still
    # the third request ends on a (its 200 reserved, 50 made); the two choices of the
    # first are in flight and had made 40 tokens by a's last push
    led.push("a", {"engine": {}, "inflight_tokens": {"t": 40}}, [], [("settle", "t", 200, 50)])
    assert tokens() == pytest.approx(330)
    clock.t = 6.0  # a has been silent for 6 s: taken for dead (and 100 tokens refilled)
    led.push("b", {"engine": {}}, [], [])
    assert led.live_replicas() == ["b"]
    # what a's requests in flight did not produce (600 - 40) is the tenant's again
    assert tokens() == pytest.approx(430 + 560)
    # a settlement a sends late (it was not dead after all) is not given back twice
    led.push("a", {"engine": {}}, [], [("settle", "t", 300, 25), ("settle", "t", 300, 15)])
    assert tokens() == pytest.approx(990)
    # b's reservations are untouched by all this
    assert led.admit("b", "t", 0, [100], False)[0] == "ok"
    assert tokens() == pytest.approx(890)


def test_drain_is_handed_to_replicas_at_their_push():
    led = _ledger()
    assert led.push("a", {}, [], [])["drain_grace_s"] is None
    led.drain(7.5)
    assert led.push("a", {}, [], [])["drain_grace_s"] == 7.5


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.fn(*args))
        return fut


class _Handle:
    """A real ``Ledger`` called as an actor handle is (``handle.method.remote``)."""

    def __init__(self, ledger):
        self.admit = _Method(ledger.admit)
        self.enter = _Method(ledger.enter)


def test_shared_book_batches_settlements_and_refuses_rpm_locally():
    led = _ledger(Tenant("t", requests_per_minute=2, max_concurrent=5))
    book = SharedQuotaBook(_Handle(led), "a")
    t = led.tenants["t"]

    calls = []
    book.ledger.enter.fn = lambda *a: calls.append(a) or led.enter(*a)

    async def run():
        await book.begin(t)
        assert await book.reserve(t, 1, [3]) == [3]
        book.release(t)
        book.settle("t", 3, 1)
        assert len(book._pending) == 2  # queued, not sent one by one
        await book.begin(t)
        assert book._pending == []  # carried by that call
        assert await book.reserve(t, 1, [3]) == [3]
        assert led.quotas.inflight["t"] == 1
        with pytest.raises(ApiError) as e:
            await book.begin(t)
        assert e.value.status == 429 and len(calls) == 3
        with pytest.raises(ApiError):  # refused here, without asking the ledger
            await book.begin(t)
        assert len(calls) == 3

    asyncio.run(run())


def _replica_metrics(tokens: int, waiting: int, tenant: str) -> str:
    snap = EngineSnapshot(
        running=1, waiting=waiting, kv_usage=0.25, counters={"generation_tokens": tokens}
    )
    m = ServerMetrics("m", ["chat"], lambda: snap, lambda: {"chat": 1.0})
    final = Final("length", "x", [1] * tokens, 3, {"ttft_ms": 5.0}, (), 0.0, 1.0)
    m.observe_finish("chat", tenant, final, 0.5)
    return generate_latest(m.registry).decode() + generate_latest(m.tenant_registry).decode()


def _samples(text: bytes) -> dict:
    out: dict = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_metrics_counters_summed_gauges_per_live_replica():
    texts = {
        "a": (_replica_metrics(5, 2, "x"), True),
        "b": (_replica_metrics(7, 3, "y"), True),
        "dead": (_replica_metrics(11, 9, "x"), False),
    }
    s = _samples(merge_metrics(texts))
    assert s["vllm:generation_tokens_total"] == [({"model_name": "m"}, 23.0)]
    assert sorted((lab["replica"], v) for lab, v in s["vllm:num_requests_waiting"]) == [
        ("a", 2.0),
        ("b", 3.0),
    ]
    ttft_count = s["vllm:time_to_first_token_seconds_count"]
    assert ttft_count == [({"model_name": "m"}, 3.0)]
    by_tenant = {lab["tenant"]: v for lab, v in s["adaserve:tenant_output_tokens_total"]}
    assert by_tenant == {"x": 16.0, "y": 7.0}
    only = _samples(merge_metrics(texts, only_tenant="y"))
    assert {lab["tenant"] for lab, _ in only["adaserve:tenant_output_tokens_total"]} == {"y"}
    assert only["vllm:generation_tokens_total"][0][1] == 23.0  # not per tenant: kept


def _rec(cls, tenant, attained, n):
    return Record(cls, tenant, "length", 5.0, 2.0, 9.0, 1.0, attained, n, 0, 0, 0.0, 1.0)


def _rep(engine_running, usage_tokens):
    """One replica's pushed report (``EngineReplica._report``'s shape)."""
    return {
        "class_names": ["chat"],
        "class_targets": {"chat": {"tpot_ms": 20.0, "ttft_ms": 4000}},
        "prices": {"chat": 1.0},
        "flops_per_token": 1.0,
        "shed": {("chat", "queue_full"): 1},
        "rate_limited": {},
        "usage": {
            "x": {
                "classes": {"chat": {"requests": 1, "completion_tokens": usage_tokens}},
                "total": {"requests": 1, "completion_tokens": usage_tokens},
            }
        },
        "engine": {"running": engine_running, "waiting": 0, "kv_usage": 0.5},
    }


def test_report_over_replicas():
    snaps = {
        "a": {"live": True, "report": _rep(2, 4), "records": [_rec("chat", "x", True, 4)]},
        "b": {"live": False, "report": _rep(5, 6), "records": [_rec("chat", "x", False, 6)]},
    }
    out = merge_report(snaps, None, "m")
    assert out["requests"] == 2
    chat = out["classes"]["chat"]
    assert (
        chat["attained"] == 1 and chat["output_tokens"] == 10 and chat["shed"] == {"queue_full": 2}
    )
    assert out["tenants"]["x"]["total"]["completion_tokens"] == 10
    assert out["engine"]["running"] == 2 and out["engine"]["live_replicas"] == 1
    assert set(out["engine"]["replicas"]) == {"a", "b"}
    assert merge_report(snaps, "nobody", "m")["tenants"] == {}


def test_dashboard_over_replicas():
    """The dashboard's merged data: the classes the merged report's, the rolling
    attainment over each replica's window on its own clock, counters summed, and each
    replica's timeline on the front door's time axis."""

    def rec(attained, finished_at):
        return Record(
            "chat", "x", "length", 5.0, 2.0, 9.0, 1.0, attained, 4, 3, 2, 0.0, finished_at
        )

    def samp(t, running, tree):
        return {"t": t, "running": running, "waiting": 0, "kv_usage": 0.1, "depth": 2,
                "budget": 8, "tokens": 5, "tree_by_class": {"chat": tree}}  # fmt: skip

    def snap(live, age, clock, started, recs, samples, pos, drafts, fallbacks):
        rep = _rep(1, 4)
        rep["engine"].update(policy="adaserve", iterations=len(samples),
                             fallback_iterations=fallbacks)  # fmt: skip
        rep["dashboard"] = {"clock": clock, "started_at": started,
                            "accepted_per_pos": pos, "spec_drafts": drafts}  # fmt: skip
        return {"live": live, "age_s": age, "report": rep, "records": recs, "samples": samples}

    snaps = {
        # replica a's clock reads 1000 now; it started at 990: its samples at t (since
        # its start) are at 50 - 10 + t on the front door's axis (50 s since its start)
        "a": snap(True, 0.0, 1000.0, 990.0, [rec(True, 900.0), rec(False, 950.0)],
                  [samp(1.0, 2, 4.0), samp(9.0, 3, 2.0)], {0: 5, 1: 2}, 6, {"kv": 1}),
        # b's last push was 30 s ago at its clock 70: now is 100 on it
        "b": snap(False, 30.0, 70.0, 0.0, [rec(True, 20.0), rec(True, 45.0)],
                  [samp(60.0, 1, 6.0)], {0: 1}, 2, {"kv": 2, "timeout": 1}),
    }  # fmt: skip
    out = merge_dashboard(snaps, "m", ["x", "idle"], as_of_s=50.0)
    rep = merge_report({k: {**v} for k, v in snaps.items()}, None, "m")
    (chat,) = out["classes"]
    assert chat["name"] == "chat" and chat["requests"] == rep["classes"]["chat"]["requests"] == 4
    assert chat["attainment"] == rep["classes"]["chat"]["attainment"] == 0.75
    # the last 60 s: a's record at 950 (now 1000) and b's at 45 (now 100)
    assert chat["rolling"] == {"requests": 2, "attained": 1, "attainment": 0.5}
    assert out["acceptance_by_position"] == [
        {"position": 0, "accepted": 6, "rate": 6 / 8},
        {"position": 1, "accepted": 2, "rate": 2 / 8},
    ]
    assert out["fallback_iterations"] == {"kv": 3, "timeout": 1}
    assert out["engine"]["running"] == 1  # the live replica's
    assert set(out["tenants"]) == {"x", "idle"} and out["tenants"]["idle"]["requests"] == 0
    assert set(out["replicas"]) == {"a", "b"} and not out["replicas"]["b"]["live"]
    assert out["timeline_replica"] == "a" and out["timeline"] == out["replicas"]["a"]["timeline"]
    assert out["replicas"]["a"]["timeline"]["t"] == [41.0, 49.0]
    assert out["replicas"]["a"]["timeline"]["running"] == [2, 3]
    # b: now 100 on its clock = 50 here; its sample at 60 since its start (0) is at 10
    assert out["replicas"]["b"]["timeline"]["t"] == [10.0]
    # the per-iteration means: all replicas' samples, newest last
    assert chat["recent"]["tree_per_req"] == 4.0
    assert json.loads(json.dumps(out)) == out


def test_route_of_reads_class_targets_and_sizes():
    h = Headers({"x-slo-tpot-ms": "25"})
    r = route_of(
        "/v1/chat/completions",
        h,
        b'{"messages": [{"role": "user", "content": "' + b"a" * 40 + b'"}], '
        b'"slo_class": "interactive", "max_completion_tokens": 7}',
    )
    assert r == {
        "generation": True,
        "slo_class": "interactive",
        "tpot_ms": 25.0,
        "prompt_tokens": 10,
        "max_tokens": 7,
    }
    r = route_of("/v1/completions", Headers({}), b'{"prompt": [1, 2, 3], "slo": {"ttft_ms": 9}}')
    assert r["prompt_tokens"] == 3 and r["ttft_ms"] == 9.0 and r["slo_class"] is None
    assert route_of("/v1/completions", Headers({}), b"not json") == {"generation": True}
    assert route_of("/v1/models", Headers({}), b"") == {"generation": False}


def test_replicas_without_ray_is_one_clear_line(monkeypatch, capsys):
    from adaserve.cluster import serve_app
    from adaserve.server import cli

    monkeypatch.setattr(serve_app, "ray_available", lambda: False)
    main = functools.partial(cli.main, replicas=serve_app.run_replicas)
    assert main(["--replicas", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'adaserve[ray]'" in err
    assert main(["--replicas", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert main(["--ray-address", "ray://x:10001"]) == 2
    assert "needs --replicas" in capsys.readouterr().err


def test_asgi_relay_whole_response_in_one_item_stream_as_it_comes():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from adaserve.cluster.asgi import call_app, request_data

    seen_disconnect = asyncio.Event()

    async def whole(request):
        return JSONResponse({"echo": (await request.body()).decode()})

    async def stream(request):
        async def gen():
            for i in range(3):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.01)  # chunks made apart arrive apart

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def forever(request):
        async def gen():
            try:
                while True:
                    yield "x"
                    await asyncio.sleep(0.01)
            finally:
                seen_disconnect.set()

        return StreamingResponse(gen())

    app = Starlette(
        routes=[
            Route(p, f, methods=["POST"])
            for p, f in (("/whole", whole), ("/stream", stream), ("/forever", forever))
        ]
    )

    def req(path, body=b""):
        scope = {"method": "POST", "path": path, "headers": [], "client": ("1.2.3.4", 5)}
        return request_data(scope, body)

    async def run():
        items = [m async for m in call_app(app, req("/whole", b"hi"), {"x-r": "r0"})]
        assert len(items) == 1 and items[0][0] == "many"
        (start, body) = items[0][1]
        assert start[1] == 200 and (b"x-r", b"r0") in start[2]
        assert json.loads(body[1]) == {"echo": "hi"} and body[2] is False
        items = [m async for m in call_app(app, req("/stream"))]
        flat = [x for m in items for x in (m[1] if m[0] == "many" else [m])]
        chunks = [x[1] for x in flat if x[0] == "body" and x[1]]
        assert chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
        assert len(items) >= 3  # not held back until the end
        gen = call_app(app, req("/forever"))
        async for m in gen:
            if m[0] == "body":
                break
        await gen.aclose()  # the consumer left: the app sees a disconnect
        await asyncio.wait_for(seen_disconnect.wait(), 5)

    asyncio.run(run())


def test_admission_sections_of_replicas_merge_into_one():
    from adaserve.cluster.merge import merge_admission

    a = {
        "interactive": {
            "refused": {"capacity": 2},
            "promised_n": 30,
            "predicted_attainment": 0.9,
            "realised_attainment": 1.0,
        }
    }
    b = {
        "interactive": {
            "refused": {"capacity": 1, "kv": 4},
            "promised_n": 10,
            "predicted_attainment": 0.5,
            "realised_attainment": 0.6,
        },
        "batch": {"refused": {"fair_share": 3}},
    }
    got = merge_admission([a, b, {}])
    assert got["interactive"] == {
        "refused": {"capacity": 3, "kv": 4},
        "promised_n": 40,
        "predicted_attainment": 0.8,
        "realised_attainment": 0.9,
    }
    assert got["batch"] == {"refused": {"fair_share": 3}}
