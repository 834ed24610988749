"""/metrics against the Grafana dashboard (docs/grafana/adaserve.json), on the shipped
pair: every metric name the dashboard's expressions use is served, and the vLLM series
added for it hold what the requests that ran did."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from server_fixtures import KV_BYTES, LiveServer, scrape, server_test_env

from adaserve.config import EngineConfig
from adaserve.server import ServerConfig
from adaserve.server.metrics import build_1_2_5_buckets, finished_reason

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "adaserve.json"
NAME = re.compile(r"\b(?:vllm|adaserve):[A-Za-z_][A-Za-z0-9_]*")
MODEL = "adaserve"

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


def dashboard_names() -> set[str]:
    """Every ``vllm:`` / ``adaserve:`` name in the dashboard's PromQL (``expr``) and
    variable queries (``definition``)."""
    names: set[str] = set()

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k in ("expr", "definition") and isinstance(v, str):
                    names.update(NAME.findall(v))
                else:
                    walk(v)
        elif isinstance(o, list):
            for x in o:
                walk(x)

    walk(json.loads(DASHBOARD.read_text()))
    return names


@pytest.fixture(scope="module")
def shipped():
    # the shipped pair (model=None), served as "adaserve"; a fixed-shape policy, so no
    # hardware profile is measured
    ecfg = EngineConfig(
        policy="spec-chain:2", auto_profile=False, kv_cache_bytes=KV_BYTES, max_model_len=256
    )
    s = LiveServer(ecfg, ServerConfig(log_stats=False))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ran(shipped):
    """A few requests: two run to max_tokens, one stops at a stop string, one streams."""
    c = shipped.client()
    usages = []
    for prompt, kw in (
        ("def add(a, b):", dict(max_tokens=12)),
        ("The quick brown fox", dict(max_tokens=7, extra_body={"ignore_eos": True})),
        ("import os\n", dict(max_tokens=20)),
    ):
        r = c.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)
        usages.append((r.usage.prompt_tokens, r.usage.completion_tokens, kw["max_tokens"]))
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    u = [ch.usage for ch in stream if ch.usage is not None][-1]
    usages.append((u.prompt_tokens, u.completion_tokens, 5))
    return usages, scrape(shipped.url)


def _one(fams, name, **labels):
    vals = [v for lab, v in fams[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(vals) == 1, (name, labels, fams.get(name))
    return vals[0]


def test_dashboard_uses_vllm_and_adaserve_names():
    names = dashboard_names()
    assert len(names) > 30
    for must in (
        "vllm:request_success_total",
        "vllm:request_prompt_tokens_bucket",
        "vllm:request_generation_tokens_bucket",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_sum",
        "vllm:iteration_tokens_total_bucket",
        "vllm:num_preemptions_total",
        "adaserve:slo_attainment",
    ):
        assert must in names, must


def test_metrics_serve_every_name_the_dashboard_uses(ran):
    _, fams = ran
    missing = sorted(n for n in dashboard_names() if n not in fams)
    assert not missing, missing
    for n in dashboard_names():  # with this model's label, as the dashboard filters
        assert any(lab.get("model_name") == MODEL for lab, _ in fams[n]), n


def test_new_vllm_series_hold_what_ran(ran, shipped):
    usages, fams = ran
    n = len(usages)
    prompt = sum(p for p, _, _ in usages)
    gen = sum(g for _, g, _ in usages)
    # one finish per request, under vLLM's reason names
    by_reason = {lab["finished_reason"]: v for lab, v in fams["vllm:request_success_total"]}
    assert set(by_reason) == {"stop", "length", "abort"}
    assert sum(by_reason.values()) == n and by_reason["abort"] == 0
    assert by_reason["length"] >= 1  # ignore_eos ran to max_tokens
    # per-request token histograms: the usage the clients got
    assert _one(fams, "vllm:request_prompt_tokens_count") == n
    assert _one(fams, "vllm:request_prompt_tokens_sum") == prompt
    assert _one(fams, "vllm:request_generation_tokens_sum") == gen
    assert _one(fams, "vllm:request_params_max_tokens_sum") == sum(m for *_, m in usages)
    # per HTTP request: n (1 each) and the most tokens a choice generated
    assert _one(fams, "vllm:request_params_n_count") == n
    assert _one(fams, "vllm:request_params_n_sum") == n
    assert _one(fams, "vllm:request_max_num_generation_tokens_sum") == gen
    # vLLM's exposition: no _created twins, process_* series
    assert not [k for k in fams if k.endswith("_created")]
    assert _one(fams, "process_resident_memory_bytes") > 0
    les = [float(lab["le"]) for lab, _ in fams["vllm:request_prompt_tokens_bucket"]]
    assert les[:-1] == [float(b) for b in build_1_2_5_buckets(256)]  # up to max_model_len
    # per-step tokens: every prompt and generated token went through some step
    steps = _one(fams, "vllm:iteration_tokens_total_count")
    total = _one(fams, "vllm:iteration_tokens_total_sum")
    assert total == _one(fams, "vllm:prompt_tokens_total") + _one(
        fams, "vllm:generation_tokens_total"
    )
    assert total >= prompt + gen - n  # (the last token of each request is not fed back)
    # (a step that admits nothing processes no token and is not observed)
    assert 0 < steps <= _one(fams, "adaserve:engine_iterations_total")
    # phases: prefill + decode = inference, and queue + inference = e2e (per request)
    pre = _one(fams, "vllm:request_prefill_time_seconds_sum")
    dec = _one(fams, "vllm:request_decode_time_seconds_sum")
    inf = _one(fams, "vllm:request_inference_time_seconds_sum")
    que = _one(fams, "vllm:request_queue_time_seconds_sum")
    e2e = _one(fams, "vllm:e2e_request_latency_seconds_sum")
    assert pre > 0 and dec > 0
    assert pre + dec == pytest.approx(inf, rel=1e-6, abs=1e-6)
    assert que + inf == pytest.approx(e2e, rel=1e-6, abs=1e-6)
    assert _one(fams, "vllm:request_decode_time_seconds_count") == n
    # preemptions: the engine's own counter, under vLLM's name
    assert (
        _one(fams, "vllm:num_preemptions_total")
        == shipped.state.loop.snapshot.counters["preemptions"]
    )
    assert "adaserve:preemptions_total" not in fams
    info = fams["vllm:cache_config_info"][0][0]
    assert int(info["num_gpu_blocks"]) > 0 and int(info["block_size"]) > 0
    # per class: the default class got them all; its targets are published
    cls = shipped.state.loop.info.default_class
    assert _one(fams, "adaserve:time_to_first_token_seconds_count", slo_class=cls) == n
    ttft_target = _one(fams, "adaserve:slo_ttft_target_seconds", slo_class=cls)
    assert ttft_target * 1000 == pytest.approx(shipped.state.loop.class_slos[cls].ttft_ms)


def test_finished_reason_mapping():
    assert [finished_reason(r) for r in ("stop", "length")] == ["stop", "length"]
    for r in ("client_disconnected", "server_shutdown", "engine_error", "abort", None):
        assert finished_reason(r) == "abort"
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(1) == (1,)
