"""The policy interface's parts (torch-free): the autoregressive baselines as real
subclasses, ``Policy.load_hints`` (what a router reads) and the clairvoyant
sub-interface."""

from __future__ import annotations

import numpy as np

from adaserve.core.policy import BatchView, ClairvoyantPolicy, LoadHints, Policy, ReqView
from adaserve.hardware.model import HardwareModel
from adaserve.policies.budgeted import AdaptiveConfig, BudgetedState, DepthEvaluation
from adaserve.policies.oracle import OraclePolicy
from adaserve.policies.registry import make_policy
from adaserve.policies.static import (
    AutoregressivePolicy,
    ChunkedAutoregressivePolicy,
    PriorityPolicy,
)

HW = HardwareModel.from_dict(
    {
        "verify": {"tokens": [1, 64, 256, 1024], "latency_ms": [10.0, 11.0, 14.0, 30.0]},
        "draft_step_ms": 0.2,
    }
)


def rv(rid, *, rank=0, waited=0.0, prefill=0, tpot=30.0) -> ReqView:
    return ReqView(
        rid=rid,
        cls="c",
        tpot_ms=tpot,
        ttft_ms=None,
        n_out=5 if not prefill else 0,
        decode_ms=100.0 if not prefill else 0.0,
        waited_ms=waited,
        prefill_left=prefill,
        context_len=100 + prefill,
        rank=rank,
    )


def test_the_autoregressive_baselines_are_subclasses_with_their_own_names():
    ar, chunked, prio = (make_policy(n) for n in ("ar", "ar-chunked", "priority"))
    assert type(ar) is AutoregressivePolicy and ar.name == "ar"
    assert type(chunked) is ChunkedAutoregressivePolicy and chunked.name == "ar-chunked"
    assert type(prio) is PriorityPolicy and prio.name == "priority"
    assert not any(p.uses_draft for p in (ar, chunked, prio))
    # ar prefills whole prompts; the chunked ones share a 256-token chunk
    reqs = [rv(1, rank=2, waited=50.0, prefill=300), rv(2, rank=0, waited=10.0, prefill=300)]
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**6)
    assert ar.plan(view).prefill == {1: 300, 2: 300}
    assert chunked.plan(view).prefill == {1: 256}  # view order
    assert prio.plan(view).prefill == {2: 256}  # strict class first
    # admission: FCFS, strict classes first for priority
    assert ar.admission_key(reqs[0]) < ar.admission_key(reqs[1])
    assert prio.admission_key(reqs[1]) < prio.admission_key(reqs[0])


def test_load_hints_default_to_nothing_calibrated():
    for name in ("ar", "ar-chunked", "priority", "spec-chain:4", "spec-tree"):
        assert make_policy(name).load_hints(None) == LoadHints()


def test_a_budgeted_policy_hints_its_acceptance_margin_chunk_and_planned_tokens():
    pol = make_policy("adaserve", prefill_chunk=128)
    assert pol.load_hints(None) == LoadHints(
        acc_by_rank=pol.acc_by_rank, margin=pol.margin, prefill_chunk=128
    )
    reqs = [rv(1), rv(2, rank=1)]
    plan = pol.plan(BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**6, hw=HW))
    assert isinstance(plan.state, BudgetedState)
    hints = pol.load_hints(plan)
    alloc = plan.state.choice.alloc.tolist()
    assert hints.verified == {1: 1.0 + alloc[0], 2: 1.0 + alloc[1]}
    assert hints.margin == AdaptiveConfig().slo_margin  # before margin_warmup passes


def test_the_depth_evaluation_is_typed():
    pol = make_policy("adaserve")
    from adaserve.policies.budgeted.columns import Columns

    reqs = [rv(1), rv(2)]
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**6, hw=HW)
    ev = pol._evaluate_depths(view, Columns.of(reqs), (0, 1, 2), 1, 0, 200.0, (0.6, 0.2))
    assert isinstance(ev, DepthEvaluation)
    assert ev.alloc.shape == (3, 2) and ev.need.shape == (3, 2) and ev.met_w.shape == (3,)
    assert ev.energy_j is None  # no power model in the view
    dyn = make_policy("dyn-tree")._evaluate_depths(
        view, Columns.of(reqs), (0, 1, 2), 1, 0, 200.0, (0.6, 0.2)
    )
    assert dyn.met_w is None and dyn.need is None  # no SLO phase
    masked = DepthEvaluation(
        alloc=ev.alloc, budget=ev.budget, t_iter=ev.t_iter, static=ev.static,
        rate=np.array([1.0, -1.0, 2.0]), met_w=np.array([2.0, 2.0, 2.0]),
    ).power_masked()  # fmt: skip
    assert masked.met_w.tolist() == [2.0, -1.0, 2.0]


def test_reveal_is_only_on_the_clairvoyant_interface():
    assert not hasattr(Policy, "reveal")
    assert issubclass(OraclePolicy, ClairvoyantPolicy) and OraclePolicy.clairvoyant
    assert not make_policy("adaserve").clairvoyant
    assert isinstance(make_policy("oracle"), ClairvoyantPolicy)
