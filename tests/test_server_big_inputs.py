"""Issue 22 finding 2: one tenant's huge prompts cost the others nothing. Request quotas
are checked before a body is read, a body bigger than any prompt that fits the context
is refused at its headers (413), a text that cannot fit is refused without being
tokenised (400), and long texts are tokenised with the GIL released."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env

from adaserve.server import parse_config
from adaserve.server.config import tomllib
from adaserve.text.tokenizer import load_tokenizer

CONFIG = """
[server]
model_name = "tiny"

[tenants.limited]
keys = ["sk-limited-secret"]
requests_per_minute = 1

[tenants.other]
keys = ["sk-other-secret"]
"""

# as in the attack (7.9 MB prompts), and one under the body limit the shipped-size
# context gives (1 MiB) that still cannot fit the context
HUGE = "def f(x):\n    return x  # " + "x" * (7_900_000 - 28)
BIG = "def f(x):\n    return x  # " + "x" * 600_000

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    s = LiveServer(engine_config(target), parse_config(tomllib.loads(CONFIG)))
    yield s
    s.stop()


@pytest.fixture
def encode_calls(srv, monkeypatch):
    """Every call of the served tokenizer's encoders, by text length."""
    tok = srv.state.loop.info.tokenizer
    calls: list[int] = []
    for name in ("encode", "encode_released"):
        real = getattr(tok, name)

        def spy(text, *args, _real=real):
            calls.append(len(text))
            return _real(text, *args)

        monkeypatch.setattr(tok, name, spy)
    return calls


def test_tenant_over_its_request_quota_gets_429_before_its_prompt_is_read(srv, encode_calls):
    c = srv.client("sk-limited-secret")
    c.completions.create(model="tiny", prompt="x = ", max_tokens=1)  # the one per minute
    for make in (
        lambda: c.completions.create(model="tiny", prompt=HUGE, max_tokens=1),
        lambda: c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": HUGE}], max_tokens=1
        ),
    ):
        with pytest.raises(openai.RateLimitError) as ei:
            make()
        assert ei.value.body["code"] == "rate_limit_exceeded"
        assert int(ei.value.response.headers["retry-after"]) >= 1
    assert max(encode_calls) < 100  # only the small prompt was ever tokenised


def test_body_bigger_than_any_fitting_prompt_is_refused_at_its_headers(srv, encode_calls):
    assert srv.state.body_limit == 1 << 20  # 8 contexts of 512 x the longest token: 1 MiB
    with httpx.Client(base_url=srv.url, timeout=60) as h:
        r = h.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": HUGE, "max_tokens": 1},
            headers={"Authorization": "Bearer sk-other-secret"},
        )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "derived from the model's context" in r.json()["error"]["message"]
    assert encode_calls == []


def test_text_that_cannot_fit_the_context_is_refused_without_tokenising(srv, encode_calls):
    c = srv.client("sk-other-secret")
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model="tiny", prompt=BIG, max_tokens=1)
    e = ei.value.body
    assert e["code"] == "context_length_exceeded" and e["param"] == "prompt"
    assert "bytes" in e["message"] and "context" in e["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": BIG}], max_tokens=1
        )
    assert ei.value.body["code"] == "context_length_exceeded"
    assert encode_calls == []
    # a prompt a little over the context (not refused by its size) is still tokenised
    # and refused on its token count
    limit = srv.state.loop.info.max_model_len
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model="tiny", prompt="ab " * (2 * limit), max_tokens=1)
    assert ei.value.body["code"] == "context_length_exceeded"
    assert encode_calls


def test_flood_of_huge_prompts_leaves_other_tenants_served(srv):
    """Four huge and four big prompts at once (refused) and a small request of another
    tenant beside them: every huge one is answered 413, every big one 400, the small
    one 200."""
    out: list[int] = []

    def huge(text):
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "tiny", "prompt": text, "max_tokens": 1},
            headers={"Authorization": "Bearer sk-other-secret"},
            timeout=120,
        )
        out.append(r.status_code)

    ts = [threading.Thread(target=huge, args=(t,)) for t in (HUGE, BIG) * 4]
    for t in ts:
        t.start()
    r = srv.client("sk-other-secret").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert r.usage.completion_tokens == 2
    for t in ts:
        t.join(120)
    assert sorted(out) == [400] * 4 + [413] * 4


def test_size_bound_is_a_lower_bound_on_tokens(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    tok = load_tokenizer(target)
    m = tok.max_token_bytes
    assert m >= 1

    @settings(max_examples=200, deadline=None)
    @given(st.text(min_size=1, max_size=400))
    def check(text):
        assert len(tok.encode(text)) >= len(text.encode("utf-8")) // m

    check()
    for text in ("    " * 300, "def f(x):\n    return x\n" * 50, "é" * 500):
        assert len(tok.encode(text)) >= len(text.encode()) // m
        assert tok.encode_released(text) == tok.encode(text)


def test_long_texts_are_tokenised_with_the_gil_released(tmp_path_factory):
    """Side by side on one text: while ``encode`` runs in a thread the main thread
    barely runs (the tokenizer holds the GIL); while ``encode_released`` runs it does."""
    target, _ = model_pair(tmp_path_factory)
    tok = load_tokenizer(target)
    text = "def foo(x):\n    return x + 1  # some words\n" * 6_000

    def ticks(fn) -> tuple[int, float]:
        t = threading.Thread(target=fn, args=(text,))
        n, t0 = 0, time.perf_counter()
        t.start()
        while t.is_alive():
            n += 1
            time.sleep(0.0005)
        return n, time.perf_counter() - t0

    held, released = [], []
    for _ in range(2):
        held.append(ticks(tok.encode))
        released.append(ticks(tok.encode_released))
    # ticks per second of tokenising: the released form lets the main thread run
    rate = lambda xs: sum(n for n, _ in xs) / sum(s for _, s in xs)  # noqa: E731
    assert rate(released) > 5 * rate(held), (held, released)
