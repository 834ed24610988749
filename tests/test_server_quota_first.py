"""Issue 32, finding 2, over real HTTP: a request takes its quota (a request per minute
and a concurrency slot) at its headers, before its body is read, parsed or tokenised,
so requests that fail later cost quota all the same; ``/tokenize`` and ``/detokenize``
count too; tokenising never runs on the event loop."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env, wait_for

from adaserve.server import parse_config
from adaserve.server.config import tomllib

CONFIG = """
[server]
model_name = "m"

[tenants.rpm]
keys = ["sk-rpm-secret"]
requests_per_minute = 10

[tenants.tok]
keys = ["sk-tok-secret"]
requests_per_minute = 4

[tenants.conc]
keys = ["sk-conc-secret"]
max_concurrent = 3

[tenants.other]
keys = ["sk-other-secret"]
"""

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    s = LiveServer(engine_config(target), parse_config(tomllib.loads(CONFIG)))
    yield s
    s.stop()


def _post(srv, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        srv.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def test_requests_that_fail_after_parsing_cost_their_quota(srv):
    """A 10-rpm tenant's oversized prompts (400 context_length_exceeded) use up its 10
    requests: the 11th is a 429 before its body is read."""
    big = {"model": "m", "prompt": "word " * 20_000, "max_tokens": 1}
    codes = [_post(srv, "sk-rpm-secret", "/v1/completions", big).status_code for _ in range(10)]
    assert codes == [400] * 10
    r = _post(srv, "sk-rpm-secret", "/v1/completions", big)
    assert r.status_code == 429 and r.json()["error"]["reason"] == "requests_per_minute"
    assert int(r.headers["retry-after"]) >= 1
    # a malformed body costs the same
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": "Bearer sk-rpm-secret", "Content-Type": "application/json"},
    )
    assert r.status_code == 429


def test_tokenize_and_detokenize_count_against_the_quota(srv):
    assert _post(srv, "sk-tok-secret", "/tokenize", {"model": "m", "prompt": "hi"}).is_success
    assert _post(srv, "sk-tok-secret", "/detokenize", {"model": "m", "tokens": [5]}).is_success
    assert _post(srv, "sk-tok-secret", "/tokenize", {"model": "m", "prompt": "x"}).is_success
    assert _post(srv, "sk-tok-secret", "/tokenize", {"bad": 1}).status_code == 400
    r = _post(srv, "sk-tok-secret", "/tokenize", {"model": "m", "prompt": "hi"})
    assert r.status_code == 429 and r.json()["error"]["reason"] == "requests_per_minute"


def _slow_upload(srv, key: str) -> socket.socket:
    """A request whose headers came and whose body has not: it holds its slot."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: 100000\r\n\r\n{"
    )
    return s


def test_concurrency_slot_taken_before_the_body(srv):
    """A max_concurrent = 3 tenant with three uploads under way gets 429 for a fourth at
    its headers; another tenant is served meanwhile; the slots come back when the
    uploads end."""
    held = [_slow_upload(srv, "sk-conc-secret") for _ in range(3)]
    try:
        assert wait_for(lambda: srv.state.quotas.inflight.get("conc") == 3, timeout=5)
        r = _post(srv, "sk-conc-secret", "/v1/completions", {"model": "m", "prompt": "hi"})
        assert r.status_code == 429 and r.json()["error"]["reason"] == "max_concurrent"
        ok = _post(
            srv,
            "sk-other-secret",
            "/v1/completions",
            {"model": "m", "prompt": "hi", "max_tokens": 2},
        )
        assert ok.status_code == 200
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: srv.state.quotas.inflight.get("conc") == 0, timeout=10)
    r = _post(
        srv, "sk-conc-secret", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}
    )
    assert r.status_code == 200
    assert wait_for(lambda: srv.state.quotas.inflight.get("conc") == 0, timeout=10)


def test_tokenising_runs_off_the_event_loop(srv, monkeypatch):
    tok = srv.state.loop.info.tokenizer
    seen: list[str] = []
    for name in ("encode", "encode_released", "decode"):
        real = getattr(tok, name)

        def spy(*a, _real=real, **kw):
            seen.append(threading.current_thread().name)
            return _real(*a, **kw)

        monkeypatch.setattr(tok, name, spy)
    body = {"model": "m", "prompt": "hello there", "max_tokens": 2, "echo": True}
    assert _post(srv, "sk-other-secret", "/v1/completions", body).status_code == 200
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _post(srv, "sk-other-secret", "/v1/chat/completions", chat).status_code == 200
    assert _post(srv, "sk-other-secret", "/tokenize", {"model": "m", "prompt": "a b"}).is_success
    assert _post(srv, "sk-other-secret", "/detokenize", {"model": "m", "tokens": [5, 6]}).is_success
    asked = [n for n in seen if not n.startswith("adaserve-engine")]  # the engine's own
    assert len(asked) >= 4 and all(n.startswith("adaserve-tokenize") for n in asked), seen


def test_a_tenant_that_ignores_retry_after_waits_it_out_at_the_door(srv):
    """A max_concurrent tenant refused once (429, Retry-After: 1) that sends again at
    once has that request held at the door for the rest of the wait before it is
    answered: a client looping on 429s gets about one answer per connection per
    Retry-After, not hundreds. A request held while a slot frees is served. Another
    tenant is never held."""
    door = srv.state.retry_hold
    held = [_slow_upload(srv, "sk-conc-secret") for _ in range(3)]
    try:
        assert wait_for(lambda: srv.state.quotas.inflight.get("conc") == 3, timeout=5)
        r = _post(srv, "sk-conc-secret", "/v1/completions", {"model": "m", "prompt": "hi"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        before = door.total_held
        # sent again at once: held for the rest of its second, then refused
        r = _post(srv, "sk-conc-secret", "/v1/completions", {"model": "m", "prompt": "hi"})
        assert r.status_code == 429 and r.json()["error"]["reason"] == "max_concurrent"
        assert door.total_held == before + 1
        # the other tenant is served meanwhile, and never held
        ok = {"model": "m", "prompt": "hi", "max_tokens": 2}
        assert _post(srv, "sk-other-secret", "/v1/completions", ok).status_code == 200
        assert "other" not in door.held
        # a request held at the door gets the slot that frees while it waits
        answer: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: answer.append(_post(srv, "sk-conc-secret", "/v1/completions", ok))
        )
        t.start()
        assert wait_for(lambda: door.held.get("conc") == 1, timeout=10)
        held.pop().close()
        t.join(30)
        assert answer and answer[0].status_code == 200
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: srv.state.quotas.inflight.get("conc") == 0, timeout=10)
