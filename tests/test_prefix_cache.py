"""Automatic prefix caching: content-addressed KV blocks shared between requests.

The output is the model's whatever the cache holds (greedy token-identical with the
cache on and off, for every policy, under preemption and eviction); reference counts
return to zero; the planner and admission price only the uncached part; salts keep
tenants apart; the simulator finds the engine's hits."""

from __future__ import annotations

import random

import pytest
from conftest import VOCAB, random_prompts, replay_engine, with_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve import LLM, SLO, SamplingParams
from adaserve.config import EngineConfig
from adaserve.core.blocks import BlockAllocator, BlockTable, OutOfBlocks, block_digest
from adaserve.core.clock import TickClock
from adaserve.engine import build_engine
from adaserve.sim.replay import RecordedRequest, decisions

POLICIES = ["ar", "ar-chunked", "priority", "spec-chain:3", "spec-tree:3x2", "adaserve",
            "smartspec", "dyn-tree"]  # fmt: skip


def shared_prompts(seed: int, n: int, prefix_len: int = 70) -> list[list[int]]:
    """``n`` prompts: two system prompts of ``prefix_len`` tokens, each followed by a
    distinct question of 3-30 tokens (some repeated whole)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(prefix_len)] for _ in range(2)]
    out = []
    for i in range(n):
        q = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 30))]
        out.append(systems[i % 2] + q)
    return out + out[: n // 3]  # whole prompts asked again


def waves(llm: LLM, prompts, max_tokens: int = 10):
    """The prompts in three waves (later waves find the earlier ones' blocks)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    k = len(prompts) // 3
    outs = []
    for part in (prompts[:k], prompts[k : 2 * k], prompts[2 * k :]):
        outs += llm.generate(part, sp, use_tqdm=False)
    return outs


def _llm(tiny_pair, profile, policy, caching, **kw):
    target, draft, _ = tiny_pair
    return LLM(
        model=str(target),
        draft=str(draft),
        policy=policy,
        profile=profile,
        enable_prefix_caching=caching,
        **kw,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_output_is_the_same_with_the_cache_on_and_off(tiny_pair, profile_file, policy):
    prompts = shared_prompts(1, 12)
    off = waves(_llm(tiny_pair, profile_file, policy, False, kv_cache_bytes=16 << 20), prompts)
    on_llm = _llm(tiny_pair, profile_file, policy, True, kv_cache_bytes=16 << 20)
    on = waves(on_llm, prompts)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    stats = on_llm.engine.prefix_cache_stats()
    assert stats["cached_tokens"] > 0 and stats["enabled"]
    assert sum(o.num_cached_tokens for o in on) == stats["cached_tokens"]
    assert all(o.num_cached_tokens % 16 == 0 for o in on)
    assert all(o.num_cached_tokens == 0 for o in off)
    assert on_llm.engine.allocator.usage == 0.0  # nothing held once every request ended


@pytest.mark.parametrize("policy", ["ar", "spec-chain:3", "adaserve"])
def test_same_output_under_preemption_and_eviction_in_a_tiny_pool(tiny_pair, profile_file, policy):
    """A pool of a few blocks: requests preempt each other (readmitted, they map what
    is still cached of their own prompt and output) and cached blocks are evicted."""
    prompts = shared_prompts(2, 12, prefix_len=40)
    # tiny pair, float32: 640 B a slot (target and draft) -> 12 blocks of 16 slots
    kw = dict(kv_cache_bytes=12 * 16 * 640, max_num_seqs=6)
    off = waves(_llm(tiny_pair, profile_file, policy, False, **kw), prompts, max_tokens=24)
    llm = _llm(tiny_pair, profile_file, policy, True, **kw)
    on = waves(llm, prompts, max_tokens=24)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    eng = llm.engine
    assert eng.allocator.num_blocks == 12
    assert eng.counters.preemptions > 0
    s = eng.prefix_cache_stats()
    assert s["evictions"] > 0 and s["cached_tokens"] > 0


def test_the_draft_skips_a_cached_prefix_it_computed(tiny_pair, profile_file):
    """A prefix the draft already read (speculation ran on it) costs the draft nothing
    the second time: ``draft_cached`` starts at the cached blocks."""
    target, draft, _ = tiny_pair
    eng = build_engine(
        EngineConfig(
            model=str(target), draft=str(draft), policy="spec-chain:3", profile=profile_file
        )  # fmt: skip
    )
    p = shared_prompts(3, 2, prefix_len=64)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    a = eng.add_request(p, sp)
    eng.run_until_done()
    b = eng.add_request(p, sp)
    eng.scheduler.begin_step()
    eng.scheduler.admit()  # maps the cached blocks
    full = (len(p) - 1) // 16 * 16
    assert b.num_cached == b.cached_prompt == b.draft_cached == full >= 64
    eng.run_until_done()
    assert b.output_ids == a.output_ids


def test_planner_and_admission_see_only_the_uncached_part(tiny_pair, profile_file):
    target, draft, _ = tiny_pair
    eng = build_engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            policy="adaserve",
            profile=profile_file,
            admission=True,
        )  # fmt: skip
    )
    p = shared_prompts(4, 2, prefix_len=96)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sched = eng.scheduler
    eng.add_request(p, sp)
    eng.run_until_done()
    # the same prompt and one of its length that shares no block with it, judged alike
    # at the same moment (the predictions scale by the measured pass speed, which the
    # run moved), before either is queued
    warm, cold = eng.new_request(p, sp), eng.new_request(list(reversed(p)), sp)
    for r in (warm, cold):
        r.prefix_hint = sched.cached_prefix(r)  # as Scheduler.add does
    assert warm.prefix_hint == 96 and warm.to_prefill == len(p) - 96
    assert cold.prefix_hint == 0 and cold.to_prefill == len(p)
    cold_ttft = sched.admission.predicted_ttft_ms(cold, sched.now)
    warm_ttft = sched.admission.predicted_ttft_ms(warm, sched.now)
    assert sched.admission.prefill_ms(len(p) - 96) < sched.admission.prefill_ms(len(p))
    assert warm_ttft < cold_ttft
    eng.scheduler.add(warm)
    sched.begin_step()
    sched.admit()
    view = sched.view()
    assert [v.prefill_left for v in view.requests] == [len(p) - 96]
    assert sched.policy.plan(view).prefill == {warm.rid: len(p) - 96}


def test_salts_keep_prefixes_apart(tiny_pair):
    target, _, _ = tiny_pair
    llm = LLM(model=str(target), no_draft=True, policy="ar")
    p = shared_prompts(5, 2, prefix_len=64)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, sp)[0]
    other = llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-b"}, sp)[0]
    unsalted = llm.generate(p, sp)[0]
    same = llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, sp)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens == 64
    assert first.token_ids == other.token_ids == unsalted.token_ids == same.token_ids
    assert llm.reset_prefix_cache()
    again = llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, sp)[0]
    assert again.num_cached_tokens == 0


def test_prompt_logprobs_requests_compute_their_whole_prompt(tiny_pair):
    target, _, _ = tiny_pair
    llm = LLM(model=str(target), no_draft=True, policy="ar")
    p = shared_prompts(6, 2, prefix_len=48)[0]
    llm.generate(p, SamplingParams(temperature=0.0, max_tokens=2))
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[1] is not None


def test_simulator_finds_the_engines_hits(tiny_pair, cheap_profile):
    """The replay test with shared prefixes: every admission's cached tokens match."""
    target, _, _ = tiny_pair
    cfg = EngineConfig(model=str(target), draft=str(target), policy="adaserve",
                       profile=cheap_profile, max_num_seqs=4, max_prefill_tokens=32,
                       kv_cache_bytes=40 * 16 * 1024)  # fmt: skip
    eng = build_engine(cfg, clock=TickClock(0.001))
    steps, requests, live = [], [], {}
    eng.on_step = lambda e, tr: steps.append(tr)
    slo = SLO(tpot_ms=30.0, ttft_ms=400.0, cls="chat")
    prompts = shared_prompts(7, 12, prefix_len=48)
    for k, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0, max_tokens=6 + k % 5, ignore_eos=True)
        r = eng.add_request(p, sp, slo)
        live[r.rid] = r
        requests.append(RecordedRequest(r.rid, r.arrival, len(p), sp.max_tokens, slo))
        for _ in range(2):
            eng.step()
    eng.run_until_done()
    assert sum(len(s.cached) for s in steps) >= 5
    got = replay_engine(eng, "adaserve", with_tokens(requests, live), steps)
    assert [decisions(b) for b in got] == [decisions(a) for a in steps]
    # without the tokens the simulator finds no hit, and the comparison fails
    blind = replay_engine(eng, "adaserve", requests, steps)
    assert [decisions(b) for b in blind] != [decisions(a) for a in steps]


# ---------------------------------------------------------------------- the allocator
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 70), st.booleans()), max_size=40),
       st.sampled_from(["lru", "slo"]))  # fmt: skip
def test_reference_counts_return_to_zero(ops, eviction):
    """Random requests (a shared-prefix family, a length, aborted or not) mapping,
    growing, naming and releasing blocks: the counts always add up and nothing leaks."""
    bs, alloc = 4, BlockAllocator(24, 4, caching=True, eviction=eviction)
    live: list[tuple[BlockTable, list[bytes]]] = []

    def check():
        held = sum(1 for b in range(alloc.num_blocks) if alloc.refcount(b) > 0)
        assert held + len(alloc._free) + alloc.num_idle == alloc.num_blocks
        refs = {}
        for t, _ in live:
            for b in t.blocks:
                refs[b] = refs.get(b, 0) + 1
        assert all(alloc.refcount(b) == refs.get(b, 0) for b in range(alloc.num_blocks))

    for step, (family, n, abort) in enumerate(ops):
        alloc.now = float(step)
        toks = [family] * 8 + list(range(n))
        names, parent = [], b""
        for i in range(len(toks) // bs):
            parent = block_digest(parent, toks[i * bs : (i + 1) * bs], None)
            names.append(parent)
        t = BlockTable(alloc, rank=family % 3)
        hit = alloc.match(names[: (len(toks) - 1) // bs])
        t.map_cached(hit)
        try:
            t.ensure(len(toks))
        except OutOfBlocks:
            t.release()
            check()
            continue
        if abort:  # an abort frees before anything is named
            t.release()
        else:
            for i in range(t.named, len(toks) // bs):
                alloc.register(t.blocks[i], names[i])
                t.named += 1
            live.append((t, names))
        check()
        if len(live) > 2 or step % 3 == 0:
            while live:
                live.pop(0)[0].release()
                check()
    for t, _ in live:
        t.release()
    check()
    assert all(alloc.refcount(b) == 0 for b in range(alloc.num_blocks))
    assert alloc.num_free == alloc.num_blocks and alloc.usage == 0.0


def test_slo_eviction_keeps_the_strict_class_blocks_longer():
    alloc = BlockAllocator(4, 4, caching=True, eviction="slo", slo_bonus_s=100.0)
    strict, loose = BlockTable(alloc, rank=0), BlockTable(alloc, rank=2)
    strict.ensure(4)
    loose.ensure(4)
    alloc.register(strict.blocks[0], b"s" * 16)
    alloc.register(loose.blocks[0], b"l" * 16)
    alloc.now = 0.0
    strict.release()  # the strict block is the older one
    alloc.now = 10.0
    loose.release()
    fresh = BlockTable(alloc)
    fresh.ensure(12)  # two plain blocks, then one cached block must go
    assert alloc.match([b"s" * 16]) and not alloc.match([b"l" * 16])
    lru = BlockAllocator(4, 4, caching=True)
    a, b = BlockTable(lru, rank=0), BlockTable(lru, rank=2)
    a.ensure(4)
    b.ensure(4)
    lru.register(a.blocks[0], b"s" * 16)
    lru.register(b.blocks[0], b"l" * 16)
    a.release()
    lru.now = 10.0
    b.release()
    BlockTable(lru).ensure(12)
    assert not lru.match([b"s" * 16]) and lru.match([b"l" * 16])


def test_a_digest_names_its_whole_prefix_and_salt():
    a = block_digest(b"", [1, 2, 3, 4])
    assert a == block_digest(b"", [1, 2, 3, 4]) != block_digest(b"", [1, 2, 3, 5])
    assert block_digest(b"", [1, 2, 3, 4], "t1") != a != block_digest(b"", [1, 2, 3, 4], "t2")
    assert block_digest(a, [5, 6, 7, 8]) != block_digest(b"x" * 16, [5, 6, 7, 8])


def test_cache_off_names_nothing(tiny_pair):
    target, _, _ = tiny_pair
    llm = LLM(model=str(target), no_draft=True, policy="ar", enable_prefix_caching=False)
    p = random_prompts(1, seed=3, lo=60, hi=61)[0]
    llm.generate([p, p], SamplingParams(temperature=0.0, max_tokens=2))
    assert llm.engine.allocator.num_cached == 0
    assert llm.generate(p, SamplingParams(temperature=0.0, max_tokens=2))[0].num_cached_tokens == 0


# ---------------------------------------------------------------------- workloads, simulator
@pytest.mark.parametrize("kind", ["multiturn", "agent"])
def test_session_workloads_share_prefixes_and_are_seeded(kind):
    from adaserve.bench.workload import build_workload
    from adaserve.bench.workload_spec import WorkloadSpec

    spec = WorkloadSpec(dataset=f"{kind}:ctx=1200", request_rate=3.0, duration_s=60, seed=4)
    items = build_workload(spec, vocab_size=VOCAB)
    again = build_workload(spec, vocab_size=VOCAB)
    assert [i.prompt_ids for i in items] == [i.prompt_ids for i in again]
    assert 2.0 <= len(items) / 60 <= 4.0  # about the spec's rate
    system = {tuple(i.prompt_ids[:300]) for i in items}
    assert len(system) == 1  # one shared system prompt / tool preamble
    last: dict = {}
    for it in sorted(items, key=lambda i: (i.meta["session"], i.meta["turn"])):
        assert it.prompt_len + it.max_tokens <= 1200
        prev = last.get(it.meta["session"])
        if prev is not None:  # the history: the previous prompt, its reply, a new message
            assert it.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids
            assert it.prompt_len > len(prev.prompt_ids) + prev.max_tokens
        last[it.meta["session"]] = it
    other = build_workload(WorkloadSpec(dataset=kind, request_rate=3.0, duration_s=60, seed=5),
                           vocab_size=VOCAB)  # fmt: skip
    assert [i.prompt_ids for i in other] != [i.prompt_ids for i in items]


def test_bad_session_options_are_clear_errors():
    from adaserve.bench.sessions import parse_session
    from adaserve.bench.workload_spec import WorkloadError

    assert parse_session("agent:system=100:turns=2-3").turns == (2, 3)
    for bad in ("multiturn:system", "multiturn:bogus=1", "agent:turns=5-2", "chatty"):
        with pytest.raises(WorkloadError):
            parse_session(bad)


def test_simulator_prices_only_the_uncached_prefill():
    """At GPU scale, the same multi-turn workload: with the cache the simulator computes
    a fraction of the prompt tokens and the first tokens come sooner."""
    from adaserve.bench.runner import class_slos
    from adaserve.bench.workload import build_workload
    from adaserve.bench.workload_spec import WorkloadSpec
    from adaserve.policies.registry import make_policy
    from adaserve.sim import presets
    from adaserve.sim.acceptance import AcceptanceModel
    from adaserve.sim.acceptance_params import AcceptanceParams
    from adaserve.sim.loop import SimConfig, Simulator

    hw = presets.deployment("A100-80GB").hardware_model()
    spec = WorkloadSpec(dataset="multiturn:system=2000:user=50-300:ctx=8192", request_rate=3.0,
                        duration_s=40, class_mix=(("interactive", 0.5), ("chat", 0.5)))  # fmt: skip
    items = build_workload(spec, vocab_size=32000)
    classes = presets.gpu_classes()
    slos = class_slos(["chat", "interactive"], 1.0, unloaded_tpot_ms=hw.unloaded_tpot_ms(),
                      classes=classes)  # fmt: skip
    ttft = {}
    for on in (True, False):
        cfg = SimConfig(classes=classes, kv_slots=400_000, enable_prefix_caching=on)
        sim = Simulator(hw, AcceptanceModel(AcceptanceParams()), cfg)
        recs, tl = sim.run(make_policy("adaserve"), items, slos)
        assert all(r.completed for r in recs)
        ttft[on] = sorted((r.first_token_s - r.arrival_s) for r in recs)[len(recs) // 2]
        cached = sum(r.cached_tokens for r in recs)
        assert (cached > 0.5 * sum(r.prompt_tokens for r in recs)) if on else cached == 0
    assert ttft[True] * 2 < ttft[False]
