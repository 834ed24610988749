"""/v1/slo/report and /metrics agree with the per-request metrics of the same run."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from server_fixtures import LiveServer, engine_config, model_pair, scrape, server_test_env

from adaserve.server import ServerConfig

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, draft = model_pair(tmp_path_factory)
    # admission off: this test is about the report and the metrics agreeing, and
    # needs every request answered (test_server_overload covers shedding): with four
    # at once, the tiny pair's passes run several times its profile's, and interactive's
    # target (1.2x the profile's unloaded TPOT) would refuse some
    s = LiveServer(engine_config(target, draft), ServerConfig(model_name="m", admission=False))
    yield s
    s.stop()


def test_report_and_metrics_agree_with_response_metrics(srv):
    c = srv.client()
    jobs = [("interactive", 4), ("interactive", 6), ("interactive", 3), ("chat", 5)]
    jobs += [("chat", 2), ("chat", 7), ("batch", 4), ("batch", 8)]

    def run(job):
        cls, n = job
        return c.completions.create(
            model="m",
            prompt=f"def {cls}_{n}():",
            max_tokens=n,
            temperature=0,
            extra_body={"slo_class": cls, "ignore_eos": True},
        )

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        resps = list(ex.map(run, jobs))
    ms = [r.model_extra["metrics"] for r in resps]
    rep = srv.http().get("/v1/slo/report").json()
    assert rep["requests"] == len(jobs)
    for cls in ("interactive", "chat", "batch"):
        mine = [(m, r) for m, r in zip(ms, resps) if m["slo_class"] == cls]
        got = rep["classes"][cls]
        assert got["requests"] == len(mine)
        assert got["attained"] == sum(m["slo_attained"] for m, _ in mine)
        assert got["attainment"] == pytest.approx(got["attained"] / len(mine))
        for key in ("ttft_ms", "tpot_ms", "queue_ms", "e2e_ms"):
            vals = [m[key] for m, _ in mine if m[key] is not None]
            for p in (50, 95, 99):
                assert got[key][f"p{p}"] == pytest.approx(np.percentile(vals, p), rel=1e-9)
        out = sum(r.usage.completion_tokens for _, r in mine)
        assert got["output_tokens"] == out
        good = sum(r.usage.completion_tokens for m, r in mine if m["slo_attained"])
        assert got["goodput_tokens"] == good
        assert got["verification"]["tree_nodes"] == sum(m["tree_nodes"] for m, _ in mine)
        assert got["verification"]["accepted_tokens"] == sum(m["accepted_tokens"] for m, _ in mine)
        assert got["targets"]["tpot_ms"] == pytest.approx(mine[0][0]["tpot_target_ms"])
    shares = [rep["classes"][c]["verification"]["share"] for c in ("interactive", "chat", "batch")]
    assert sum(shares) == pytest.approx(1.0)
    usage = rep["tenants"]["anonymous"]["total"]
    assert usage["completion_tokens"] == sum(r.usage.completion_tokens for r in resps)
    assert usage["prompt_tokens"] == sum(r.usage.prompt_tokens for r in resps)
    charge = sum(m["charge"] for m in ms)
    assert usage["charge"] == pytest.approx(charge)

    fams = scrape(srv.url)

    def by_class(name):
        return {lab["slo_class"]: v for lab, v in fams[name]}

    assert fams["vllm:e2e_request_latency_seconds_count"][0][1] == len(jobs)
    ttft_sum = fams["vllm:time_to_first_token_seconds_sum"][0][1]
    assert ttft_sum == pytest.approx(sum(m["ttft_ms"] for m in ms) / 1000)
    attained = by_class("adaserve:slo_attained_requests_total")
    tokens = by_class("adaserve:output_tokens_total")
    nodes = by_class("adaserve:verification_tokens_total")
    ratio = by_class("adaserve:slo_attainment")
    for cls in ("interactive", "chat", "batch"):
        got = rep["classes"][cls]
        assert attained[cls] == got["attained"]
        assert tokens[cls] == got["output_tokens"]
        assert nodes[cls] == got["verification"]["tree_nodes"]
        assert ratio[cls] == pytest.approx(got["attainment"])
    (_, gen), = fams["vllm:generation_tokens_total"]  # fmt: skip
    assert gen == sum(r.usage.completion_tokens for r in resps)
    (_, prompt), = fams["vllm:prompt_tokens_total"]  # fmt: skip
    assert prompt == sum(r.usage.prompt_tokens for r in resps)
    (_, drafted), = fams["vllm:spec_decode_num_draft_tokens_total"]  # fmt: skip
    assert drafted == sum(m["tree_nodes"] for m in ms)
