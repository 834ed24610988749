"""``make demo``'s job end to end: real servers on loopback (adaserve, then the
baseline), one workload and one set of targets, a per-class table of both."""

from __future__ import annotations

import argparse
import json

import pytest
from server_fixtures import server_test_env

from adaserve.bench.demo import run
from adaserve.errors import InvalidRequestError

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


def test_demo_serves_adaserve_beside_a_baseline(tiny_pair, tmp_path, capsys, monkeypatch):
    target, _, _ = tiny_pair
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocesses
    args = argparse.Namespace(
        duration=3.0, port=0, baseline="ar", model=str(target), draft=str(target), out=tmp_path
    )
    assert run(args) == 0
    table = capsys.readouterr().out
    assert "policy ar" in table and table.count("interactive") >= 2
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["config"]["policies"] == ["adaserve", "ar"]
    res = result["results"]
    n = {p: res[p]["overall"]["requests"] for p in ("adaserve", "ar")}
    assert n["adaserve"] == n["ar"] >= 8  # the same workload for both
    assert all(res[p]["overall"]["completed"] == n[p] for p in n)
    assert res["ar"]["overall"]["drafted_tokens"] == 0
    for p in ("adaserve", "ar"):  # each served by its own server, with its policy
        assert f"(policy {p};" in (tmp_path / f"server-{p}.log").read_text()
    assert {"interactive", "chat", "batch"} <= set(res["adaserve"]["per_class"])


def test_demo_refuses_an_unknown_baseline_before_starting(tmp_path):
    args = argparse.Namespace(duration=3.0, port=0, baseline="nope", out=tmp_path)
    with pytest.raises(InvalidRequestError, match="unknown or malformed policy"):
        run(args)
