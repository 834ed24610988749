"""Paced engine steps (``[server] step_pace_ms``): every step lasts A + B x tokens ms,
whatever the machine, so tests and demos that need a model-like pass time do not
depend on the machine's load."""

from __future__ import annotations

import time

import httpx
import pytest
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env

from adaserve.server import ServerConfig, parse_config
from adaserve.server.config import ConfigError, tomllib
from adaserve.server.engine_loop import EngineLoop

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.mark.parametrize(
    "bad", ["[50]", "[50, -1]", "[1, 2, 3]", '["a", 1]', "[true, 1]", "[inf, 1]", "50"]
)
def test_step_pace_is_validated(bad):
    with pytest.raises(ConfigError, match="step_pace_ms"):
        parse_config(tomllib.loads(f"[server]\nstep_pace_ms = {bad}\n"))


def test_step_pace_parsed():
    cfg = parse_config(tomllib.loads("[server]\nstep_pace_ms = [40, 0.5]\n"))
    assert cfg.step_pace_ms == (40.0, 0.5)
    assert ServerConfig().step_pace_ms is None


class _Trace:
    def __init__(self, tokens):
        self.tokens = tokens


class _Engine:
    last_trace = None


def test_pace_left_tops_up_to_the_modelled_time():
    loop = EngineLoop(None, step_pace_ms=(100.0, 2.0))
    loop.engine = _Engine()
    before = loop.engine.last_trace
    assert loop._pace_left(before, 0.0) == 0.0  # no pass ran
    loop.engine.last_trace = _Trace(tokens=50)  # modelled: 100 + 2 x 50 = 200 ms
    assert loop._pace_left(before, 0.0) == pytest.approx(0.2)
    assert loop._pace_left(before, 0.05) == pytest.approx(0.15)
    # a real step longer than its model is not slowed further
    assert loop._pace_left(before, 1.0) == 0.0


def test_paced_server_steps_last_their_modelled_time(tmp_path_factory):
    """Over real HTTP: 6 tokens in at least 6 passes of >= 150 ms each (a lower bound:
    sleeping never makes a step shorter, however fast or busy the machine)."""
    target, _ = model_pair(tmp_path_factory)
    srv = LiveServer(
        engine_config(target, max_model_len=64),
        ServerConfig(model_name="m", step_pace_ms=(150.0, 0.0)),
    )
    try:
        t0 = time.perf_counter()
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 6, "ignore_eos": True},
            timeout=60,
        )
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        assert took >= 0.15 * 5  # ar: one pass per token, the last one's pad after the answer
    finally:
        srv.stop()
