"""The engine's thread plan: the automatic choice, its overrides, pinning, and where
it is reported. Nothing here times anything."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from adaserve.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.errors import InvalidRequestError
from adaserve.util import threads


def test_auto_keeps_a_reserve_for_the_http_loop():
    assert threads.choose(env={}, cores=(0, 1)).threads == 1  # the 2-core machine
    p = threads.choose(env={}, cores=(0, 1))
    assert (p.usable, p.reserve, p.cores, p.source) == (2, 1, (1,), "auto")
    assert threads.choose(env={}, cores=(0,)).threads == 1  # nothing to reserve
    assert threads.choose(env={}, cores=(0,)).cores == ()  # all cores: nothing to pin
    assert threads.choose(env={}, cores=tuple(range(8))).threads == 7
    assert threads.choose(env={}, cores=tuple(range(16))).threads == 14
    assert threads.choose(env={}, cores=tuple(range(64))).threads == 60
    # the affinity mask, not the machine's count: a process limited to cores 4-7
    p = threads.choose(env={}, cores=(4, 5, 6, 7))
    assert p.threads == 3 and p.cores == (5, 6, 7)


def test_overrides_in_order_flag_env_omp():
    cores = (0, 1, 2, 3)
    env = {"ADASERVE_NUM_THREADS": "2", "OMP_NUM_THREADS": "3"}
    assert threads.choose(4, env, cores).threads == 4
    assert threads.choose(4, env, cores).source == "--threads"
    assert threads.choose(None, env, cores).threads == 2
    assert threads.choose(None, env, cores).source == "ADASERVE_NUM_THREADS"
    omp = threads.choose(None, {"OMP_NUM_THREADS": "3"}, cores)
    assert (omp.threads, omp.source, omp.cores) == (3, "OMP_NUM_THREADS", (1, 2, 3))
    # more threads than cores: allowed (the user asked), nothing pinned
    assert threads.choose(8, {}, cores).cores == () and threads.choose(8, {}, cores).reserve == 0
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="positive integer"):
            threads.choose(None, {"ADASERVE_NUM_THREADS": bad}, cores)
    with pytest.raises(ValueError):
        threads.choose(0, {}, cores)
    with pytest.raises(InvalidRequestError):
        EngineConfig(threads=0)
    with pytest.raises(InvalidRequestError):
        EngineConfig(threads=True)


def test_describe_names_the_choice():
    p = threads.choose(env={}, cores=(0, 1, 2, 3, 5))
    line = p.describe()
    assert "4 intra-op threads" in line and "auto" in line and "cores 1-3,5" in line
    assert "pins its engine thread" in line
    assert p.as_dict()["cores"] == [1, 2, 3, 5]


def test_engine_applies_its_plan(tiny_pair, monkeypatch):
    target, _, _ = tiny_pair
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("ADASERVE_NUM_THREADS", "3")
        eng = Engine(EngineConfig(model=str(target), no_draft=True, policy="ar"))
        assert torch.get_num_threads() == 3 and eng.thread_plan.source == "ADASERVE_NUM_THREADS"
        eng = Engine(EngineConfig(model=str(target), no_draft=True, policy="ar", threads=2))
        assert torch.get_num_threads() == 2 and eng.thread_plan.source == "--threads"
        monkeypatch.setenv("ADASERVE_NUM_THREADS", "zero")
        with pytest.raises(InvalidRequestError, match="ADASERVE_NUM_THREADS"):
            Engine(EngineConfig(model=str(target), no_draft=True, policy="ar"))
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_pinning_moves_only_the_calling_thread():
    cores = tuple(sorted(os.sched_getaffinity(0)))
    if len(cores) < 2:
        pytest.skip("one core: nothing to pin")
    plan = threads.choose(env={}, cores=cores)
    seen = {}

    def run():
        seen["pinned"] = threads.pin_current_thread(plan)
        seen["mask"] = tuple(sorted(os.sched_getaffinity(0)))
        # the pinned thread choosing again (as the serving loop's thread does when it
        # builds the engine) sees the process's cores: the reserve is not taken twice
        seen["again"] = threads.choose(env={})

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["pinned"] and seen["mask"] == plan.cores
    assert seen["again"] == threads.choose(env={}) and seen["again"].usable == len(cores)
    assert tuple(sorted(os.sched_getaffinity(0))) == cores  # this thread kept its mask
    assert not threads.pin_current_thread(threads.choose(env={}, cores=(0,)))
