"""The server's log lines: the periodic stats line (fake clock, fake snapshots, then a
live server with a short interval) and the start-up summary."""

from __future__ import annotations

import argparse
import logging
import re

import pytest
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env, wait_for

from adaserve.server import ServerConfig
from adaserve.server.cli import add_arguments, build_configs
from adaserve.server.config import ConfigError
from adaserve.server.engine_loop import EngineSnapshot
from adaserve.server.stats_log import StatsLogger

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _snap(prompt, gen, drafted=0, accepted=0, running=0, waiting=0, kv=0.0):
    return EngineSnapshot(
        running=running,
        waiting=waiting,
        kv_usage=kv,
        counters={
            "prompt_tokens": prompt,
            "generation_tokens": gen,
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": accepted,
        },
    )


def test_stats_line_is_the_interval_figures():
    clock = FakeClock()
    box = {"s": _snap(0, 0)}
    st = StatsLogger(["interactive", "batch"], lambda: box["s"], clock)
    clock.t += 10.0
    box["s"] = _snap(500, 120, drafted=80, accepted=60, running=3, waiting=2, kv=0.125)
    st.observe_finish("interactive", True, 40, 30)
    st.observe_finish("interactive", False, 10, 5)
    text, loud = st.line()
    assert loud
    assert "Avg prompt throughput: 50.0 tokens/s" in text
    assert "Avg generation throughput: 12.0 tokens/s" in text
    assert "Running: 3 reqs, Waiting: 2 reqs" in text
    assert "KV cache usage: 12.5%" in text
    assert "Draft acceptance: 75.0%" in text
    assert "interactive 50.0% of 2 (acceptance 70.0%)" in text  # 35 / 50
    assert "batch - (acceptance -)" in text
    # the next interval starts from here: counters are differences, tallies reset
    clock.t += 4.0
    box["s"] = _snap(500, 140, drafted=80, accepted=60, running=1)
    text, loud = st.line()
    assert loud and "Avg prompt throughput: 0.0 tokens/s" in text
    assert "Avg generation throughput: 5.0 tokens/s" in text
    assert "Draft acceptance: -" in text and "interactive - " in text
    # idle now and in the interval before: DEBUG, as vLLM
    clock.t += 10.0
    assert st.line()[1] is True  # the interval before had tokens
    clock.t += 10.0
    assert st.line()[1] is False


def test_stats_log_levels(caplog):
    clock = FakeClock()
    box = {"s": _snap(0, 0)}
    st = StatsLogger(["chat"], lambda: box["s"], clock)
    caplog.set_level(logging.DEBUG, logger="adaserve.server.stats")
    clock.t += 1.0
    st.log()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    box["s"] = _snap(10, 3)
    clock.t += 1.0
    st.log()
    assert caplog.records[-1].levelno == logging.INFO
    assert "Avg prompt throughput: 10.0 tokens/s" in caplog.records[-1].getMessage()


def test_log_stats_config_is_validated():
    for bad in (0, -1, float("inf"), True, "10"):
        with pytest.raises(ConfigError, match="log_stats_interval_s"):
            ServerConfig(log_stats_interval_s=bad)
    with pytest.raises(ConfigError, match="log_stats"):
        ServerConfig(log_stats="yes")


def build_configs_for(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return build_configs(p.parse_args(argv))


def test_cli_flags_set_the_interval_and_disable():
    _, cfg = build_configs_for(["--log-stats-interval", "2.5"])
    assert cfg.log_stats and cfg.log_stats_interval_s == 2.5
    _, cfg = build_configs_for(["--disable-log-stats"])
    assert not cfg.log_stats
    _, cfg = build_configs_for([])
    assert cfg.log_stats and cfg.log_stats_interval_s == 10.0


@pytest.mark.parametrize("enabled", [True, False])
def test_live_server_logs_summary_and_stats(tmp_path_factory, caplog, enabled):
    caplog.set_level(logging.INFO, logger="adaserve")
    target, draft = model_pair(tmp_path_factory)
    scfg = ServerConfig(log_stats=enabled, log_stats_interval_s=0.2)
    srv = LiveServer(engine_config(target, draft, auto_profile=False), scfg)
    try:
        c = srv.client()
        c.completions.create(model="target", prompt="x = 1", max_tokens=6, temperature=0)

        def stats_lines():
            return [
                r.getMessage()
                for r in caplog.records
                if r.name == "adaserve.server.stats" and r.levelno == logging.INFO
            ]

        if enabled:
            # the request has finished: the next interval's line counts it in its class
            # (100% or 0% of 1), and that line or an earlier one saw its tokens
            got = wait_for(lambda: [m for m in stats_lines() if "% of 1 (" in m], timeout=20)
            assert got, stats_lines()
            classes = [c.name for c in srv.state.loop.info.classes]
            assert re.search(r"SLO attainment: " + r".*, ".join(classes), got[0]), got[0]
            assert re.search(r"\b(100\.0|0\.0)% of 1 \(acceptance ", got[0]), got[0]
            upto = stats_lines()[: stats_lines().index(got[0]) + 1]
            gen = [
                float(x) for m in upto for x in re.findall(r"generation throughput: ([0-9.]+)", m)
            ]
            assert len(gen) == len(upto) and max(gen) > 0, upto
        else:
            wait_for(lambda: False, timeout=0.6)  # three intervals' worth
            assert stats_lines() == []
        info = srv.state.loop.info
        summary = [r.getMessage() for r in caplog.records if "engine ready:" in r.getMessage()]
        assert len(summary) == 1
        s = summary[0]
        assert f"draft {draft}" in s and f"({target})" in s
        assert "dtype float32" in s and "device cpu" in s
        pool = f"KV pool {info.kv_blocks} blocks x {info.block_size} tokens"
        assert pool in s and f"= {info.kv_blocks * info.block_size} tokens" in s
        assert info.kv_blocks > 0 and info.kv_bytes > 0
        assert f"policy {info.policy}" in s and f"max model len {info.max_model_len}" in s
        assert "classes " + ", ".join(c.name for c in info.classes) in s
        # the byte figure is the pool: blocks x block size x bytes per slot (target +
        # draft), within the configured budget
        per_slot = srv.state.loop.engine.kv_bytes_per_slot
        assert info.kv_bytes == info.kv_blocks * info.block_size * per_slot
        assert 0 < info.kv_bytes <= srv.state.loop.engine.cfg.kv_cache_bytes
    finally:
        srv.stop()
