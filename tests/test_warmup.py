"""Start-up warm-up (``engine.warmup``): every numba specialisation a serving run uses
is compiled or loaded before the server says ready, and nothing is compiled after.

Two checks, neither on wall-clock time: numba's dispatchers hold no new
specialisation and ``jit.compiles`` does not move over a mixed workload after
``warm_up``; and the argument types of every call the workload makes into a kernel are
among those of the calls ``warm_up`` made (which holds whatever earlier tests or the
on-disk cache already compiled).
"""

from __future__ import annotations

import sys

import numba
import pytest
from conftest import random_prompts

from adaserve.config import EngineConfig
from adaserve.core.clock import TickClock
from adaserve.core.slo import SLO
from adaserve.engine import build_engine
from adaserve.engine.warmup import warm_up
from adaserve.policies import plan_kernel  # noqa: F401 - its kernels are in the registry
from adaserve.sampling import SamplingParams
from adaserve.util import jit

# the budgeted policies (numba planner) and the static ones, with variants whose
# planner arguments differ (no catch-up horizon, a power cap)
WORKLOAD_POLICIES = (
    "adaserve",
    "dyn-tree",
    "smartspec",
    "adaserve:catch_up_tokens=0",
    "adaserve:power_cap_w=40",
    "spec-tree",
    "spec-chain:3",
    "ar",
)


class CallTypes:
    """Patches every module-level binding of adaserve's numba functions with a wrapper
    that records the numba types of each call's arguments, by function."""

    def __init__(self, monkeypatch):
        self.seen: dict[str, set] = {}
        for f in jit.compiled_functions():
            mod = sys.modules.get("adaserve." + f.name.rsplit(".", 1)[0])
            attr = f.name.rsplit(".", 1)[1]
            if mod is not None and getattr(mod, attr, None) is f.dispatcher:
                monkeypatch.setattr(mod, attr, self._wrap(f.name, f.dispatcher))

    def _wrap(self, name, disp):
        def call(*args):
            self.seen.setdefault(name, set()).add(tuple(numba.typeof(a) for a in args))
            return disp(*args)

        return call

    def take(self) -> dict[str, set]:
        out, self.seen = self.seen, {}
        return out


def mixed_workload(engine, seed: int) -> None:
    """Several requests of different prompt lengths under each policy: greedy and
    sampled, seeded and not, with and without SLO targets, logprobs and penalties."""
    for k, pol in enumerate(WORKLOAD_POLICIES):
        engine.set_policy(pol)
        prompts = random_prompts(6, seed=seed + k, lo=2, hi=90)
        for i, p in enumerate(prompts):
            sp = SamplingParams(
                max_tokens=10 + i,
                temperature=0.0 if i % 2 == 0 else 0.9,
                top_p=1.0 if i % 3 else 0.8,
                seed=i if i % 4 == 1 else None,
                logprobs=1 if i == 0 else None,
                repetition_penalty=1.2 if i == 3 else 1.0,
                ignore_eos=True,
            )
            slo = engine.default_slo() if i % 2 else (SLO() if i == 2 else None)
            engine.add_request(p, sp, slo)
        engine.run_until_done()


@pytest.fixture(scope="module")
def engine(tiny_pair, profile_file):
    target, draft, _ = tiny_pair
    cfg = EngineConfig(
        model=str(target),
        draft=str(draft),
        policy="adaserve",
        profile=profile_file,
        kv_cache_bytes=32 << 20,
        drift_detect=False,
    )
    # a tick per clock reading: the budgeted policies' choices never follow machine speed
    return build_engine(cfg, TickClock(0.001))


def test_no_compile_or_new_specialisation_after_warm_up(engine, monkeypatch):
    calls = CallTypes(monkeypatch)
    policy = engine.policy
    rec = warm_up(engine, say=False)
    warm_types = calls.take()
    # it ran every pass family, left nothing behind and kept the policy (untaught)
    assert rec.families == ("prefill", "decode", "chain", "tree") and rec.skipped is None
    assert not engine.has_work() and engine.policy is policy and policy._plans == 0
    assert engine.counters.generation_tokens == 0 and engine.last_trace is None
    assert rec.specialisations["policies.plan_kernel.evaluate_depths"] >= 1
    before, compiles = jit.specialisations(), jit.compiles()
    assert rec.specialisations == before

    mixed_workload(engine, seed=40)

    assert engine.counters.drafted_tokens > 0  # trees were drafted and planned
    assert jit.specialisations() == before
    assert jit.compiles() == compiles
    run_types = calls.take()
    assert run_types["policies.plan_kernel.evaluate_depths"]  # the planner ran its kernel
    for name, types in run_types.items():
        assert types <= warm_types.get(name, set()), name


def test_compiles_counts_real_compiles_only():
    def probe(x):
        return x + 1

    probe.__module__ = "adaserve._warmup_probe"  # counted as one of adaserve's functions
    disp = numba.njit(probe)
    n = jit.compiles()
    disp(1)
    assert jit.compiles() == n + 1
    disp(2)  # the same specialisation
    assert jit.compiles() == n + 1
    disp(1.5)
    assert jit.compiles() == n + 2 and len(disp.signatures) == 2
    names = [f.name for f in jit.compiled_functions()]
    assert "policies.plan_kernel.evaluate_depths" in names
    assert set(jit.specialisations()) == set(names)


def test_warm_up_keeps_the_engines_seed_stream(tiny_pair):
    target, _, _ = tiny_pair

    def outputs(warm: bool) -> list[list[int]]:
        eng = build_engine(
            EngineConfig(
                model=str(target), no_draft=True, policy="ar", seed=5, kv_cache_bytes=8 << 20
            )
        )
        if warm:
            assert warm_up(eng, say=False).families == ("prefill", "decode")
        reqs = [
            eng.add_request(p, SamplingParams(temperature=1.0, max_tokens=8))
            for p in random_prompts(3, seed=9)
        ]
        eng.run_until_done()
        return [r.output_ids for r in reqs]

    assert outputs(True) == outputs(False)


def test_warm_up_says_one_line(engine, capsys):
    rec = warm_up(engine)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("adaserve: warmed up ")
    assert f"{rec.steps} engine steps" in err[0]


def test_server_is_warm_before_ready(tmp_path_factory, profile_file, monkeypatch):
    from server_fixtures import LiveServer, engine_config, model_pair

    import adaserve.engine.warmup as warmup

    done = []

    def recording(engine, say=True):
        rec = warm_up(engine, say)
        done.append((rec, jit.specialisations(), jit.compiles()))
        return rec

    monkeypatch.setattr(warmup, "warm_up", recording)
    target, draft = model_pair(tmp_path_factory)
    srv = LiveServer(
        engine_config(target, draft, policy="adaserve", profile=profile_file, drift_detect=False)
    )
    try:
        # start-up returned (the lifespan waits for the engine thread's ready): the
        # warm-up had already run, on that thread, before it said ready
        assert len(done) == 1 and done[0][0].steps > 0
        with srv.http() as h:
            assert h.get("/health").status_code == 200
        client = srv.client()
        for i, n in enumerate((4, 9)):
            client.completions.create(
                model=srv.state.model_name,
                prompt="def f(x):" * (i + 1),
                max_tokens=n,
                temperature=0.7 * i,
            )
        assert jit.specialisations() == done[0][1] and jit.compiles() == done[0][2]
    finally:
        srv.stop()
