"""The engine and the simulator are twins: a real engine run, replayed through the
simulator's scheduler with the recorded outcomes and times, makes the same admission,
prefill-chunk, preemption and plan decisions at every step, and counts the same draft
work (``DraftWork``: the energy tally's and the price's input)."""

from __future__ import annotations

import pytest
from conftest import random_prompts, replay_engine, with_tokens

from adaserve import SLO, SamplingParams
from adaserve.config import EngineConfig
from adaserve.core.clock import TickClock
from adaserve.engine import build_engine
from adaserve.sim.replay import RecordedRequest, decisions

CLASSES = (
    SLO(tpot_ms=8.0, ttft_ms=60.0, cls="interactive"),
    SLO(tpot_ms=30.0, ttft_ms=400.0, cls="chat"),
    SLO(tpot_ms=200.0, ttft_ms=5000.0, max_queue_ms=80.0, cls="batch"),
)


def record_run(target: str, policy: str, profile: str):
    """A real engine run on a fake clock (1 ms a reading): a burst, then arrivals
    between steps, in a KV pool small enough to preempt."""
    cfg = EngineConfig(
        model=target,
        draft=target,
        policy=policy,
        profile=profile,
        max_num_seqs=6,
        max_prefill_tokens=24,
        kv_cache_bytes=12 * 16 * 1024,  # 12 blocks of 16 slots (1 KiB a slot)
    )
    eng = build_engine(cfg, clock=TickClock(0.001))
    steps = []
    eng.on_step = lambda e, tr: steps.append(tr)
    requests, live = [], {}
    prompts = random_prompts(18, seed=41, lo=5, hi=60)

    def add(i: int) -> None:
        slo = CLASSES[i % 3]
        sp = SamplingParams(temperature=0.0, max_tokens=8 + 3 * (i % 4), ignore_eos=True)
        r = eng.add_request(prompts[i], sp, slo)
        live[r.rid] = r
        requests.append(RecordedRequest(r.rid, r.arrival, len(r.prompt_ids), sp.max_tokens, slo))

    for i in range(8):
        add(i)
    i, k = 8, 0
    while eng.has_work() or i < len(prompts):
        eng.step()
        k += 1
        if i < len(prompts) and k % 3 == 0:
            add(i)
            i += 1
    return eng, with_tokens(requests, live), steps


@pytest.mark.parametrize("policy", ["adaserve", "spec-chain:3", "ar-chunked"])
def test_simulator_replays_the_engine_decision_for_decision(tiny_pair, cheap_profile, policy):
    target, _, _ = tiny_pair
    eng, requests, steps = record_run(str(target), policy, cheap_profile)
    # the run exercises what is compared: chunked prefill, preemption, several requests
    assert eng.counters.preemptions > 0
    assert any(len(s.prefill) > 1 or any(n < 24 for n in s.prefill.values()) for s in steps)
    assert max(len(s.decode) for s in steps) >= 3
    if policy != "ar-chunked":
        assert any(s.spec for s in steps) and any(sum(s.accepted.values()) for s in steps)
    got = replay_engine(eng, policy, requests, steps)
    assert len(got) == len(steps)
    for k, (a, b) in enumerate(zip(steps, got)):
        assert decisions(b) == decisions(a), f"step {k} differs"
        # one definition of the draft's work: what the engine's drafter ran is what the
        # simulator counts for the same trees (catch-up, passes, context, requests)
        assert b.draft == a.draft, f"step {k}: draft work {b.draft} != {a.draft}"
    assert eng.counters.preemptions == sum(len(s.preempted) for s in got)
    if policy != "ar-chunked":
        assert any(s.draft.kv_tokens and len(s.draft.steps) > 1 for s in steps)


def test_replay_detects_a_scheduler_that_differs(tiny_pair, cheap_profile):
    """The comparison can fail: replayed with a smaller KV pool, decisions diverge."""
    target, _, _ = tiny_pair
    eng, requests, steps = record_run(str(target), "ar-chunked", cheap_profile)
    got = replay_engine(eng, "ar-chunked", requests, steps, num_blocks=eng.allocator.num_blocks - 4)
    assert any(decisions(a) != decisions(b) for a, b in zip(steps, got))
