"""Load shedding (429 + Retry-After + reason) and draining (503)."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import openai
import pytest
from server_fixtures import (
    LiveServer,
    engine_config,
    model_pair,
    scrape,
    server_test_env,
    wait_for,
)

from adaserve.errors import AdmissionRejected
from adaserve.server import ServerConfig

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    s = LiveServer(
        engine_config(target, max_num_seqs=1),
        ServerConfig(max_waiting=1, step_delay_s=0.02, model_name="m"),
    )
    yield s
    s.stop()


def _body(**kw):
    body = {"model": "m", "prompt": "x = ", "max_tokens": 15, "ignore_eos": True}
    body.update(kw)
    return body


def test_queue_full_is_shed_with_429(srv):
    def post(_):
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            return h.post("/v1/completions", json=_body())

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        rs = list(ex.map(post, range(4)))
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
    for r in rs:
        if r.status_code == 429:
            e = r.json()["error"]
            assert e["code"] == "server_overloaded" and e["reason"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
    fams = scrape(srv.url)
    shed = {(lab["slo_class"], lab["reason"]): v for lab, v in fams["adaserve:shed_requests_total"]}
    assert shed[("chat", "queue_full")] == codes.count(429)
    rep = srv.http().get("/v1/slo/report").json()
    assert rep["classes"]["chat"]["shed"]["queue_full"] == codes.count(429)


def test_engine_admission_rejection_maps_to_429(srv, monkeypatch):
    engine = srv.state.loop.engine

    def refuse(*a, **k):
        raise AdmissionRejected("no capacity for this SLO", "slo_infeasible", 2.5)

    monkeypatch.setattr(engine, "add_request", refuse)
    with pytest.raises(openai.RateLimitError) as ei:
        srv.client().completions.create(model="m", prompt="x", max_tokens=1)
    e = ei.value
    assert e.body["reason"] == "slo_infeasible" and "no capacity" in e.body["message"]
    assert e.response.headers["retry-after"] == "3"
    monkeypatch.undo()
    srv.client().completions.create(model="m", prompt="x", max_tokens=1)


def test_the_official_client_retries_into_the_seat_it_was_told_of(srv, monkeypatch):
    """A refusal that held a seat tells the wait to the millisecond (``retry-after-ms``)
    and in whole seconds (``Retry-After``). The official OpenAI client retries by itself
    after the exact wait without sending the ``Retry-Token`` back; its marked retry with
    the same body claims the seat. A fresh request repeating the body claims nothing."""
    engine = srv.state.loop.engine
    real = engine.add_request
    seen: list[str | None] = []

    def add(*a, retry_token=None, **k):
        seen.append(retry_token)
        if len(seen) % 2:  # the first of each pair is refused, its seat held
            e = AdmissionRejected("no room", "capacity", 0.25)
            e.retry_token = f"seat-{len(seen)}"
            raise e
        return real(*a, retry_token=retry_token, **k)

    monkeypatch.setattr(engine, "add_request", add)
    with srv.http() as h:
        r = h.post("/v1/completions", json=_body(max_tokens=1))
        assert r.status_code == 429
        assert (r.headers["retry-after"], r.headers["retry-after-ms"]) == ("1", "250")
        assert r.headers["retry-token"] == "seat-1"
        assert h.post("/v1/completions", json=_body(max_tokens=1)).status_code == 200
    assert seen == [None, None]  # a fresh request with the same body: no seat claimed
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=1, timeout=60)
    body = _body(max_tokens=1)
    out = client.completions.create(
        model=body["model"], prompt=body["prompt"], max_tokens=1, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert seen == [None, None, None, "seat-3"]
    assert srv.state.retry_match.claimed == 1


def test_request_shed_from_the_queue_gets_429(srv):
    """A waiting request that the scheduler drops (here: by hand) is answered 429."""
    result = {}
    with (
        httpx.Client(base_url=srv.url, timeout=60) as h,
        h.stream("POST", "/v1/completions", json=_body(max_tokens=300, stream=True)) as r,
    ):
        assert r.status_code == 200

        def second():
            result["r"] = httpx.post(srv.url + "/v1/completions", json=_body(), timeout=60)

        t = threading.Thread(target=second)
        t.start()
        assert wait_for(lambda: srv.state.loop.snapshot.waiting == 1)

        def drop(engine):
            for req in list(engine.waiting):
                engine.abort(req, "max_queue_exceeded")

        srv.state.loop.call(drop).result(10)
        t.join(30)
    resp = result["r"]
    assert resp.status_code == 429 and resp.json()["error"]["reason"] == "max_queue_exceeded"


def test_draining_refuses_new_requests_and_finishes_old_ones(srv):
    """(Runs last: the server stays draining.)"""
    assert wait_for(lambda: srv.state.loop.snapshot.running == 0)
    out = {}

    def inflight():
        out["r"] = httpx.post(srv.url + "/v1/completions", json=_body(max_tokens=10), timeout=60)

    t = threading.Thread(target=inflight)
    t.start()
    assert wait_for(lambda: srv.state.loop.snapshot.running == 1)
    srv.state.begin_drain(30.0)
    with srv.http() as h:
        r = h.post("/v1/completions", json=_body())
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"
        assert int(r.headers["retry-after"]) >= 1
        assert h.get("/health").status_code == 503
    t.join(30)
    assert out["r"].status_code == 200
    assert out["r"].json()["choices"][0]["finish_reason"] == "length"
