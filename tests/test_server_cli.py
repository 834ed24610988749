"""``python -m adaserve.server`` as a real process: start-up, graceful SIGTERM, exit code;
and the CLI's configuration errors."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_fixtures import model_pair, server_test_env, wait_for

from adaserve.server.cli import add_arguments, build_configs, run
from adaserve.server.config import ConfigError

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


def _args(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_then_cancels_and_exits_zero(tmp_path_factory, tmp_path):
    target, _ = model_pair(tmp_path_factory)
    cfg = tmp_path / "server.toml"
    cfg.write_text(
        # admission off: the request sent while the long stream runs must be served
        "[server]\nstep_delay_s = 0.05\nshutdown_grace_s = 3.0\nmodel_name = 'm'\n"
        "admission = false\n"
        "[engine]\nkv_cache_bytes = 8388608\n"
    )
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaserve.server", "--model", str(target), "--no-draft",
         "--policy", "ar", "--port", str(port), "--config", str(cfg)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def up():
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read())
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, timeout=120, every=0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        long = client.completions.create(
            model="m", prompt="a", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        first = next(iter(long))
        assert first.choices[0].text is not None
        short = {}

        def run_short():
            short["r"] = client.completions.create(
                model="m", prompt="b", max_tokens=15, extra_body={"ignore_eos": True}
            )

        t = threading.Thread(target=run_short)
        t.start()
        time.sleep(0.3)
        t_sig = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # while draining, a request on a new connection gets the documented 503 (the
        # listener stays open while requests are in flight), and /health says draining
        time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=10) as h:
            r = h.post("/v1/completions", json={"model": "m", "prompt": "c", "max_tokens": 1})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "server_shutdown"
            assert int(r.headers["retry-after"]) >= 1
            assert h.get("/health").json()["status"] == "draining"
            assert h.head("/health").status_code == 503
        # the in-flight stream is cut after the grace period with a clear error
        with pytest.raises(openai.APIError) as ei:
            for _ in long:
                pass
        assert "shutting down" in str(ei.value.message)
        assert time.monotonic() - t_sig < 3.0 + 5.0
        t.join(30)
        # the short request finished normally inside the grace period
        assert short["r"].choices[0].finish_reason == "length"
        assert short["r"].usage.completion_tokens == 15
        rc = proc.wait(timeout=30)
        out = proc.stdout.read()
        assert rc == 0, out
        assert "open local mode" in out and "shutting down" in out
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_config_errors_exit_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nportt = 3\n")
    assert run(_args("--config", str(bad))) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "portt" in err
    assert run(_args("--config", str(tmp_path / "missing.toml"))) == 2


def test_unloadable_model_exits_1(tmp_path, capsys):
    assert run(_args("--model", str(tmp_path / "nowhere"), "--no-draft")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("adaserve serve: cannot start the engine") and "\n" not in err


def test_flags_override_the_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "[server]\nport = 9000\n[engine]\npolicy = 'ar'\nmax_num_seqs = 8\n"
        "[classes.fast]\ntpot_ms = 20\n[classes.slow]\ntpot_ms = 200\nrank = 1\n"
    )
    ecfg, scfg = build_configs(
        _args("--config", str(cfg), "--port", "9100", "--policy", "priority")
    )
    assert (scfg.port, ecfg.policy, ecfg.max_num_seqs) == (9100, "priority", 8)
    assert [c.name for c in ecfg.classes] == ["fast", "slow"] and ecfg.default_class == "fast"
    cfg.write_text("[engine]\nwarp_speed = 9\n")
    with pytest.raises(ConfigError, match="warp_speed"):
        build_configs(_args("--config", str(cfg)))


def test_timeout_and_connection_cap_flags(tmp_path):
    _, scfg = build_configs(_args())
    assert (scfg.timeout_keep_alive_s, scfg.header_timeout_s, scfg.body_timeout_s) == (5, 10, 60)
    assert scfg.max_connections == 1000
    cfg = tmp_path / "c.toml"
    cfg.write_text("[server]\nheader_timeout_s = 3\nmax_connections = 50\n")
    _, scfg = build_configs(
        _args("--config", str(cfg), "--timeout-keep-alive", "2", "--body-timeout", "7.5")
    )
    assert (scfg.timeout_keep_alive_s, scfg.header_timeout_s, scfg.body_timeout_s) == (2, 3, 7.5)
    _, scfg = build_configs(_args("--header-timeout", "1", "--max-connections", "9"))
    assert (scfg.header_timeout_s, scfg.max_connections) == (1, 9)
    with pytest.raises(SystemExit):  # a bad flag value stops the parser
        _args("--body-timeout", "0")
    cfg.write_text("[server]\nbody_timeout_s = 0\n")
    with pytest.raises(ConfigError, match="body_timeout_s"):
        build_configs(_args("--config", str(cfg)))


def _toml(tmp_path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_gpu_memory_utilization_flag_and_its_validation(tmp_path):
    ecfg, _ = build_configs(_args("--gpu-memory-utilization", "0.75"))
    assert ecfg.gpu_memory_utilization == 0.75
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(SystemExit):  # a bad flag value stops the parser
            _args("--gpu-memory-utilization", bad)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        build_configs(
            _args("--config", str(_toml(tmp_path, "[engine]\ngpu_memory_utilization = 2\n")))
        )


def test_gpu_kv_budget_fills_the_allowed_share_of_the_card():
    """The KV pool, one layer's gathered share of it, the activation reserve and what is
    in use already add up to the allowed share of the card, not more."""
    from adaserve.util.resources import gpu_kv_budget

    GB = 10**9
    total, used, act, layers = 141 * GB, 18 * GB, 5 * GB, 32
    b = gpu_kv_budget(total, total - used, 0.9, layers, act)
    assert b + b / layers + act + used == pytest.approx(0.9 * total, abs=layers + 2)
    assert b > 100 * GB
    # another process holding memory leaves less
    assert gpu_kv_budget(total, total - used - 20 * GB, 0.9, layers, act) < b - 19 * GB
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        gpu_kv_budget(80 * GB, 10 * GB, 0.9, layers, act)  # a 70B model on one 80 GB card
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        gpu_kv_budget(total, total, 0.0, layers, act)
