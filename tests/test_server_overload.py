"""Issue 22 finding 4: under overload every class is admitted against its own targets.

A real server (tiny pair, adaserve) is driven for 20 s at three times the capacity a
closed-loop probe measures. Every request must end as a complete stream or a 429 with
Retry-After; none may go without an answer (a token or the 429) past its class's TTFT
deadline; queues, KV pool and gauges must return to empty; admitted strict requests
must be served. That they attain their SLO (>= 90%) is asserted where the machine's
load cannot decide it, on an injected clock (``tests/test_overload_paced.py``).

Each engine step lasts a modelled time, 50 ms + 0.5 ms per token of its pass
(``step_pace_ms``; the real pass of the tiny pair is a few ms, the rest is slept): the
engine, not the HTTP layer or the shared machine's speed, is then what saturates, as
with a real model, and the passes take the same time on a busy machine as on an idle
one, so the machine's load cannot decide the test. Admission knows nothing of the
pacing: it works from the passes it measures.
"""

from __future__ import annotations

import asyncio

import pytest
from server_fixtures import LiveServer, engine_config, model_pair, scrape, server_test_env, wait_for

from adaserve.bench.overload import probe_capacity, run_overload, server_targets, summarize
from adaserve.server import parse_config
from adaserve.server.config import tomllib

CONFIG = """
[server]
model_name = "tiny"
step_pace_ms = [50, 0.5]

[classes.interactive]
tpot_ms = 90
ttft_ms = 2000
rank = 0

[classes.chat]
tpot_ms = 150
ttft_ms = 4000
rank = 1

[classes.batch]
tpot_ms = 400
ttft_ms = 8000
rank = 2

[engine]
default_class = "chat"
"""

MAX_TOKENS = 40

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, draft = model_pair(tmp_path_factory)
    cfg = engine_config(target, draft, policy="adaserve", max_num_seqs=8, drift_detect=False)
    s = LiveServer(cfg, parse_config(tomllib.loads(CONFIG)))
    yield s
    s.stop()


def test_three_times_capacity_every_request_answered_strict_on_target(srv):
    targets = server_targets(srv.url)
    probed = asyncio.run(
        probe_capacity(srv.url, "tiny", "interactive", 8, MAX_TOKENS, 3.0, targets["interactive"])
    )
    cap = probed.finished_rps
    assert cap > 0 and probed.within_slo_rps is not None and probed.within_slo_rps <= cap
    shed_before = _shed_total(srv.url)  # the capacity probe's own refusals
    outcomes = asyncio.run(
        run_overload(
            srv.url,
            model="tiny",
            rate=3.0 * cap,
            duration=20.0,
            mix={"interactive": 0.6, "chat": 0.2, "batch": 0.2},
            max_tokens=MAX_TOKENS,
            seed=0,
            retry_max_s=10.0,
        )
    )
    s = summarize(outcomes, targets)
    o = s["overall"]
    detail = (cap, s)
    assert o["requests"] >= 20, detail
    # every request: a complete stream or a 429 with Retry-After, nothing else
    assert o["other"] == 0, detail
    assert o["admitted_first_try"] + o["shed"] == o["requests"], detail
    assert o["shed"] > 0 and o["shed_without_retry_after"] == 0, detail
    # a refusal for room names the seat held for the client's retry (Retry-Token); the
    # clients that honour Retry-After come back with it, and every retry is answered too
    # (here most refusals are TTFT ones, for the prefill queue ahead: they hold no seat)
    room = [x for x in outcomes if x.status == 429 and x.reason in ("capacity", "kv")]
    assert all(x.retry_token for x in room), (_reasons(outcomes), detail)
    assert o["retries"] > 0, detail
    again = [x.retry for x in outcomes if x.retry is not None]
    assert all((r.status == 200 and r.done) or (r.status == 429 and r.retry_after) for r in again)
    # an answer by each class's TTFT deadline (and the summary's 0.5 s of slack): every
    # 429 (a queued request that can no longer make it is refused at its deadline); the
    # first tokens of nearly all admitted requests on the wall clock (a few can come late
    # on a busy machine: their TTFT attainment is asserted on an injected clock,
    # tests/test_overload_paced.py)
    for name, c in s["classes"].items():
        if c["shed_max_ms"] is not None and c["ttft_target_ms"]:
            assert c["shed_max_ms"] <= c["ttft_target_ms"] + 500.0, (name, detail)
    assert o["unanswered_by_deadline"] <= 0.1 * o["admitted_first_try"], detail
    strict = s["classes"]["interactive"]
    assert strict["admitted"] >= 3, detail
    # (the admitted strict requests' attainment is asserted on an injected clock, where
    # the machine's load cannot decide it: tests/test_overload_paced.py)
    # queues, KV and gauges back to empty
    assert wait_for(lambda: srv.state.loop.snapshot.running == 0, 30)
    snap = srv.state.loop.snapshot
    assert snap.waiting == 0 and snap.kv_usage == 0.0
    fams = scrape(srv.url)
    gauges = {k: v[0][1] for k, v in fams.items() if k.startswith("vllm:num_requests_")}
    assert gauges["vllm:num_requests_running"] == 0 and gauges["vllm:num_requests_waiting"] == 0
    refused_again = sum(1 for r in again if r.status == 429)
    shed = _shed_total(srv.url) - shed_before
    assert shed == o["shed"] + refused_again, (shed, shed_before, detail)


def _shed_total(url: str) -> float:
    """``adaserve:shed_requests_total`` summed over its reasons and classes."""
    return sum(v for _, v in scrape(url).get("adaserve:shed_requests_total", []))


def test_a_retry_token_brings_its_client_to_the_seat_held_for_it(srv):
    """The ``Retry-Token`` header of a retry reaches admission: the seat held under it
    is used (and counted as a client that came back)."""
    import httpx

    from adaserve.errors import AdmissionRejected

    def hold(engine):
        adm = engine.scheduler.admission
        seq = engine.new_request([5, 6, 7], None, None)
        e = AdmissionRejected("full", "capacity", 1.0)
        adm.refused(seq, e, engine.scheduler.clock.now())
        return e.retry_token

    token = srv.state.loop.call(hold).result(30)
    assert token
    body = {"model": "tiny", "prompt": "x = ", "max_tokens": 2, "slo_class": "chat"}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Retry-Token": token})
    assert r.status_code == 200, r.text
    held = srv.state.loop.call(lambda e: token in e.scheduler.admission.seats).result(30)
    assert not held
    assert srv.state.loop.call(lambda e: e.scheduler.admission.seats.returns[-1]).result(30)


def _reasons(outcomes) -> dict:
    out: dict = {}
    for x in outcomes:
        if x.status == 429:
            out[x.reason] = out.get(x.reason, 0) + 1
    return out
