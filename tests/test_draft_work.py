"""The draft's work, one definition: the passes the engine's drafter runs are the
passes ``DraftWork.of_trees`` counts (the simulator's drafter), the planner's
vectorised price is ``HardwareModel.drafting_ms``, and the profile measures the
draft's context cost the way it measures verification's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from adaserve.config import EngineConfig
from adaserve.core.blocks import BlockTable
from adaserve.core.slo import SLO
from adaserve.core.trace import DraftWork
from adaserve.core.tree import scratch_slots_needed
from adaserve.engine import profiler
from adaserve.engine.engine import Engine
from adaserve.hardware.drift import predicted_pass_ms
from adaserve.hardware.model import UNLOADED_KV_TOKENS, HardwareModel
from adaserve.policies.budgeted.evaluation import drafting_by_depth
from adaserve.sampling import SamplingParams
from adaserve.spec_decode.draft import expand

KV = 4 << 20

HW = HardwareModel(
    verify_tokens=(1.0, 64.0),
    verify_ms=(10.0, 20.0),
    draft_tokens=(1.0, 16.0, 256.0),
    draft_ms=(1.0, 2.0, 9.0),
    draft_host_ms=0.1,
    draft_kv_ms_per_token=0.003,
    logits_ms_per_row=0.01,
    draft_logits_ms_per_row=0.02,
)


def test_the_engine_s_drafter_runs_the_passes_the_simulator_counts(tiny_pair):
    """Requests of different contexts, part of each already in the draft's cache,
    drafting trees of different depths and widths: the (tokens, context) of every
    forward pass ``expand`` runs are those ``DraftWork.of_trees`` predicts."""
    target, draft, _ = tiny_pair
    eng = Engine(EngineConfig(model=str(target), draft=str(draft), policy="ar", kv_cache_bytes=KV))
    V = eng.target.cfg.vocab_size
    shapes = [(3, 2), (1, 1), (4, 1), (2, 3)]
    lengths, cached = [30, 12, 51, 7], [25, 0, 50, 7]
    reqs = []
    for i, (n, (d, w)) in enumerate(zip(lengths, shapes)):
        r = eng.new_request([(5 * i + j) % V for j in range(n)], SamplingParams(), SLO())
        r.table = BlockTable(eng.allocator)
        r.table.ensure(n + scratch_slots_needed(d, w))
        reqs.append(r)
    # fill the draft's cache for the tokens it has seen (one catch-up of depth 1)
    for r, c in zip(reqs, cached):
        r.draft_cached = 0
        if not c:
            continue
        saved = r.tokens
        r.tokens = saved[:c]
        expand(eng.draft, eng.kv_draft, [r], [(1, 1)], vocab_size=V)
        r.tokens, r.draft_cached = saved, c  # the step's commit would say so
    assert [r.draft_cached for r in reqs] == cached
    passes: list[tuple[int, int]] = []
    with torch.inference_mode():
        outs = expand(eng.draft, eng.kv_draft, reqs, shapes, vocab_size=V, passes=passes)
    ran = DraftWork(
        catchup=passes[0][0],
        steps=tuple(n for n, _ in passes[1:]),
        kv_tokens=sum(kv for _, kv in passes),
        request_steps=sum(d for d, _ in shapes),
        drafted=sum(o.tree.num_candidates for o in outs),
        requests=len(reqs),
    )
    counted = DraftWork.of_trees(
        [(n, c, d, w) for n, c, (d, w) in zip(lengths, cached, shapes)], ran.drafted
    )
    assert ran == counted
    assert counted.passes == 4 and counted.steps == (2 + 1 + 3, 2 + 1, 1)
    assert counted.catchup == 5 + 12 + 1 + 0
    for r in reqs:
        r.table.release()


@pytest.mark.parametrize("n, w, catchup, context", [(1, 1, 1, 40), (12, 2, 30, 3600)])
def test_the_planner_prices_drafting_as_the_model_does(n, w, catchup, context):
    """The planner's per-depth drafting cost (vectorised) is ``drafting_ms`` of the
    same passes, the draft's context term and host work included."""
    di = np.arange(0, 9)
    got = drafting_by_depth(HW, di, n, w, catchup, context)
    want = [HW.drafting_ms(int(d), n * w, catchup, n, context) for d in di]
    assert got == pytest.approx(want, rel=1e-12)
    # the context is what makes deep drafting of long requests expensive
    assert got[4] - drafting_by_depth(HW, di, n, w, catchup, 0.0)[4] == pytest.approx(
        4 * context * 0.003
    )


def test_a_pass_is_priced_from_its_draft_work():
    """The stall check's and the simulator's price of a pass: verification with its
    logits rows, overhead, and the draft's passes with their context, host work and
    logits rows."""
    work = DraftWork.of_trees([(100, 90, 3, 2), (50, 50, 1, 1)], drafted=7)
    assert work.passes == 3 and work.tokens == 10 + 2 + 2
    assert work.kv_tokens == (90 + 50) + (100) + (100 + 2)
    ms = predicted_pass_ms(HW, 12, 150, 0, work, rows=12)
    draft = HW.draft_passes_ms(10, (2, 2), 4, work.kv_tokens, 2)
    assert ms == pytest.approx(float(HW.verify_latency(12, 150)) + 0.01 * 12 + draft)
    # logits rows of the draft: one per tree at the catch-up, one per token fed after
    assert draft == pytest.approx(
        float(HW.draft_latency(10))
        + 2 * float(HW.draft_latency(2))
        + 0.4
        + 0.003 * 342
        + 0.02 * (2 + 4)
    )
    assert predicted_pass_ms(HW, 12, 150, 0, DraftWork()) == pytest.approx(
        float(HW.verify_latency(12, 150))
    )


def test_the_profile_measures_the_draft_s_context_cost(tiny_pair):
    """A timer whose passes cost a + b n + c (sequences x context): the profile
    recovers c for verification and for the draft, and the curves at no context."""
    target, draft, _ = tiny_pair
    eng = Engine(EngineConfig(model=str(target), draft=str(draft), policy="ar", kv_cache_bytes=KV))

    def timer(model, kv, n_tokens, ctx):
        c = 0.004 if model is eng.target else 0.001
        return lambda: 2.0 + 0.05 * n_tokens + c * min(8, n_tokens) * ctx

    prof = profiler.measure(eng.target, eng.draft, reps=2, timer=timer)
    assert prof["verify"]["kv_ms_per_token"] == pytest.approx(0.004)
    assert prof["draft_step"]["kv_ms_per_token"] == pytest.approx(0.001)
    at_zero = [2.0 + 0.05 * n for n in profiler.DRAFT_TOKENS]
    assert prof["draft_step"]["latency_ms"] == pytest.approx(at_zero)
    hw = HardwareModel.from_dict(prof)
    assert hw.draft_kv_ms_per_token == pytest.approx(0.001)


def test_the_host_s_work_per_request_is_measured_and_priced(tiny_pair, monkeypatch):
    """Steps whose host work grows by 0.4 ms per request in the pass (an injected
    clock): the profile's slope recovers it, the pass's price and the unloaded TPOT
    count it, and a slope above a whole one-token pass is flagged."""
    from adaserve.hardware.profile_stats import check_step

    target, draft, _ = tiny_pair
    eng = Engine(EngineConfig(model=str(target), draft=str(draft), policy="ar", kv_cache_bytes=KV))
    hw = HardwareModel(verify_tokens=(1.0, 64.0), verify_ms=(5.0, 12.0), draft_tokens=(1.0,),
                       draft_ms=(1.0,), kv_ms_per_token=0.001)  # fmt: skip
    now = [0.0]
    real_step = eng.step

    def step():
        running = [r for r in eng.scheduler.running if not r.finished]
        kv = sum(len(r.tokens) for r in running)
        real_step()
        now[0] += (float(hw.verify_latency(len(running), kv)) + 1.5 + 0.4 * len(running)) / 1e3

    monkeypatch.setattr(eng, "step", step)
    per = profiler.measure_request_overhead(eng, hw, one_ms=1.9, requests=8, clock=lambda: now[0])
    assert per == pytest.approx(0.4, abs=1e-6)
    priced = dataclasses.replace(HW, overhead_ms=1.5, overhead_ms_per_request=0.4)
    assert predicted_pass_ms(priced, 8, 0, 0, DraftWork(), requests=8) == pytest.approx(
        float(priced.verify_latency(8, 0)) + 1.5 + 3.2
    )
    unloaded = float(priced.verify_latency(1, UNLOADED_KV_TOKENS)) + 1.9
    assert priced.unloaded_tpot_ms() == pytest.approx(unloaded)
    ok = {"decode_step_ms": 6.0, "verify": {"tokens": [1], "kv_len": [64],
          "spread_by_kv": {"64": {"raw_median_ms": [5.0]}}}}  # fmt: skip
    assert check_step({**ok, "overhead_ms_per_request": 0.4}) == []
    assert "host work per request" in check_step({**ok, "overhead_ms_per_request": 6.0})[0]


def test_the_host_s_work_per_tree_is_measured_and_priced(tiny_pair, monkeypatch):
    """Speculating steps that take their profiled passes plus 0.7 ms per tree (an
    injected clock): the profile recovers the 0.7 ms, and the pass's price, the
    planner's and ``drafting_ms`` count it once per speculating request."""
    target, draft, _ = tiny_pair
    eng = Engine(EngineConfig(model=str(target), draft=str(draft), policy="ar", kv_cache_bytes=KV))
    hw = dataclasses.replace(HW, overhead_ms=0.5, overhead_ms_per_request=0.05)
    now = [0.0]
    real_step = eng.step

    def step():
        real_step()
        tr = eng.last_trace
        ms = 3.0
        if tr is not None:
            n = len(tr.prefill) + len(tr.decode)
            rows = len(tr.decode) + sum(tr.tree_nodes.values())
            ms = predicted_pass_ms(hw, tr.tokens, tr.kv_tokens, tr.prefill_pairs, tr.draft, n, rows)
            ms += 0.7 * len(tr.spec)
        now[0] += ms / 1e3

    monkeypatch.setattr(eng, "step", step)
    got = profiler.measure_tree_host(eng, hw, requests=4, clock=lambda: now[0])
    assert got == pytest.approx(0.7, abs=1e-6)
    priced = dataclasses.replace(HW, tree_host_ms=0.7)
    work = DraftWork.of_trees([(40, 40, 2, 1), (30, 30, 3, 1)])
    assert predicted_pass_ms(priced, 7, 70, 0, work) - predicted_pass_ms(
        HW, 7, 70, 0, work
    ) == pytest.approx(1.4)
    di = np.arange(0, 4)
    with_trees = drafting_by_depth(priced, di, 3, 1, 3, 90.0)
    assert with_trees - drafting_by_depth(HW, di, 3, 1, 3, 90.0) == pytest.approx(
        [0, 2.1, 2.1, 2.1]
    )
    assert priced.drafting_ms(2, 3, 3, 3, 90.0) - HW.drafting_ms(2, 3, 3, 3, 90.0) == pytest.approx(
        2.1
    )
