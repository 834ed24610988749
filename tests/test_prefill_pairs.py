"""A prefill chunk over a cached prefix still attends that prefix (issue 35 item 3): the
profile measures what that costs per (new token x cached token) pair, and the hardware
model, the planner, admission, the stall/drift prediction and the simulator all price
it. Fake timers and hand-built views: nothing here depends on the machine's speed."""

from __future__ import annotations

import pytest
import torch

from adaserve.core.policy import BatchView, ReqView, prefill_pairs
from adaserve.engine import profile
from adaserve.hardware.model import HardwareModel
from adaserve.policies.budgeted import AdaptiveConfig, AdaServePolicy, DynTreePolicy

PAIR = 2e-4  # ms per pair
CURVE = {"tokens": [1, 64, 256, 1024], "latency_ms": [10.0, 14.0, 30.0, 90.0]}


def _hw(pair: float) -> HardwareModel:
    return HardwareModel.from_dict(
        {
            "verify": {**CURVE, "kv_ms_per_token": 0.001, "prefill_ms_per_pair": pair},
            "draft_step_ms": 0.5,
        }  # fmt: skip
    )


def test_the_profile_measures_the_pair_cost(tiny_pair):
    from adaserve.models.loader import load_model

    target, _, _ = tiny_pair
    model = load_model(target, torch.device("cpu"), torch.float32, False)

    def forward(model, kv, n, ctx):  # tree-shaped passes: no pair term
        return lambda: 1.0 + 0.02 * n + 0.001 * ctx

    def prefill(model, kv, n, ctx):  # one sequence's chunk over ctx cached tokens
        return lambda: 1.0 + 0.02 * n + PAIR * n * ctx

    prof = profile.measure(model, None, reps=3, timer=forward, prefill_timer=prefill)
    got = prof["verify"]["prefill_ms_per_pair"]
    assert got == pytest.approx(PAIR, rel=0.05)
    assert set(prof["verify"]["prefill_by_ctx"]) == {"64x0", "64x1024", "256x0", "256x1024"}
    # a chunk that costs nothing more over a cached prefix fits no pair cost
    flat = profile.measure(model, None, reps=3, timer=forward, prefill_timer=forward)
    assert flat["verify"]["prefill_ms_per_pair"] < PAIR / 20
    assert profile.fit_prefill_pairs({(64, 0): 5.0, (64, 100): 4.0}, 0.0) == 0.0


def test_the_hardware_model_prices_pairs():
    hw, none = _hw(PAIR), _hw(0.0)
    assert hw.verify_latency(64, 500, 64 * 1000) == pytest.approx(
        none.verify_latency(64, 500) + PAIR * 64_000
    )
    assert hw.iteration_ms(64, 500, prefill_pairs=10_000) == pytest.approx(
        none.iteration_ms(64, 500) + PAIR * 10_000
    )
    # an old profile without the field prices none
    old = HardwareModel.from_dict({"verify": CURVE, "draft_step_ms": 0.5})
    assert old.verify_latency(64, 0, 10**6) == old.verify_latency(64, 0)


def _req(rid, prefill_left, context_len, n_out=0) -> ReqView:
    return ReqView(
        rid=rid, cls="chat", tpot_ms=60.0, ttft_ms=5000.0, n_out=n_out,
        decode_ms=n_out * 40.0, waited_ms=0.0, prefill_left=prefill_left,
        context_len=context_len, rank=1,
    )  # fmt: skip


@pytest.mark.parametrize("cls", [AdaServePolicy, DynTreePolicy])
def test_the_planner_prices_a_chunk_over_its_cached_prefix(cls):
    """Two decoders and a prompt whose first 1,500 tokens are cached (200 to compute):
    the plan's predicted pass time grows by the chunk's pairs x the pair cost."""
    reqs = [_req(0, 0, 300, n_out=5), _req(1, 0, 280, n_out=7), _req(2, 200, 1700)]
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**6)
    assert prefill_pairs(view, {2: 200}) == 200 * 1500
    plans = {}
    for pair in (0.0, PAIR):
        pol = cls(AdaptiveConfig(compose=False))
        view.hw = _hw(pair)
        plans[pair] = pol.plan(view)
    assert plans[PAIR].prefill == plans[0.0].prefill == {2: 200}
    extra = plans[PAIR].t_iter_ms - plans[0.0].t_iter_ms
    assert extra == pytest.approx(PAIR * 200 * 1500, rel=0.2)


def test_the_simulator_charges_the_pairs():
    """A multi-turn workload with prefix caching on: every simulated pass lasts what
    the hardware model prices for its tokens, its context and its prefill pairs, and
    the passes that prefill a turn over its cached history have pairs."""
    from adaserve.bench.runner import class_slos
    from adaserve.bench.workload import build_workload
    from adaserve.bench.workload_spec import WorkloadSpec
    from adaserve.policies.registry import make_policy
    from adaserve.sim.acceptance import AcceptanceModel
    from adaserve.sim.acceptance_params import AcceptanceParams
    from adaserve.sim.loop import SimConfig, Simulator

    spec = WorkloadSpec(dataset="multiturn:system=300:user=20-60:ctx=1500:think=1",
                        request_rate=2.0, duration_s=20, class_mix=(("chat", 1.0),))  # fmt: skip
    items = build_workload(spec, vocab_size=32000)
    hw = _hw(1e-3)
    slos = class_slos(["chat"], 1.0, unloaded_tpot_ms=hw.unloaded_tpot_ms())
    sim = Simulator(hw, AcceptanceModel(AcceptanceParams()), SimConfig())
    recs, tl = sim.run(make_policy("ar-chunked"), items, slos)
    assert all(r.completed for r in recs)
    assert sum(s["prefill_pairs"] > 0 for s in tl.samples) >= 10
    for s in tl.samples:
        want = hw.verify_latency(s["tokens"], s["kv_tokens"], s["prefill_pairs"]) + hw.overhead_ms
        assert s["iter_ms"] == pytest.approx(float(want), rel=1e-6)
