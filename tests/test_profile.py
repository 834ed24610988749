"""The hardware profile: interleaved measurement, monotone medians, spread in the
cache, the roofline check, re-measurement on drift, one unloaded TPOT. Every timing
here is injected (fake timers, a tick clock): nothing depends on the machine's speed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from adaserve.bench.runner import class_slos
from adaserve.config import EngineConfig
from adaserve.core.clock import TickClock
from adaserve.core.slo import DEFAULT_CLASSES
from adaserve.engine import profile, profiler
from adaserve.engine.engine import Engine, build_engine
from adaserve.errors import InvalidRequestError
from adaserve.hardware.drift import DriftConfig, DriftMonitor
from adaserve.hardware.model import UNLOADED_KV_TOKENS, HardwareModel, unloaded_tpot_ms
from adaserve.hardware.profile_stats import (
    SanityLimits,
    check_profile,
    imprecise,
    median_interval,
    summarize,
    time_points,
)
from adaserve.sampling import SamplingParams

KV = 4 << 20


def test_points_are_timed_round_robin_and_medians_made_monotone():
    """An inverted sequence (the 1-token point hit by load in most rounds) gives
    non-decreasing medians; the raw medians and the spread are kept."""
    calls = []
    # per point: warm-up, then 5 rounds; point 0 (1 token) is inflated in 3 of 5
    seqs = {
        0: [99, 388, 388, 3.9, 388, 4.1],
        1: [99, 5.0, 5.2, 5.1, 5.0, 5.3],
        2: [99, 4.0, 4.4, 4.2, 4.1, 4.3],  # below point 1, which is lowered to it
        3: [99, 43.8, 44.0, 43.9, 44.2, 43.7],
    }

    def timer(i):
        it = iter(seqs[i])

        def once():
            calls.append(i)
            return next(it)

        return once

    samples = time_points([timer(i) for i in range(4)], reps=5, extra_time=0.0)
    assert calls == [0, 1, 2, 3] + [0, 1, 2, 3] * 5  # warm-ups, then interleaved rounds
    st = summarize(samples)
    assert st.raw_median == (388, 5.1, 4.2, 43.9)
    assert st.median == (4.2, 4.2, 4.2, 43.9)  # suffix minimum: non-decreasing
    assert all(a <= b for a, b in zip(st.median, st.median[1:]))
    assert st.p10[0] == pytest.approx(3.9 + 0.4 * 0.2) and st.p90[0] == 388
    assert st.reps == 5
    with pytest.raises(ValueError):
        time_points([timer(0)], reps=0)


def test_imprecise_points_are_repeated_within_the_time_budget():
    """A point whose samples spread widely is timed again, interleaved with the other
    imprecise ones, until its median is known to 5%; a steady point is not; the
    repeats stop when they have taken the first rounds' time."""
    rng = np.random.default_rng(0)
    calls = []

    def timer(i, make):
        def once():
            calls.append(i)
            return make()

        return once

    steady = timer(0, lambda: 40.0 + rng.uniform(-0.5, 0.5))
    noisy = timer(1, lambda: 8.0 * (1.0 + (rng.random() < 0.4) * rng.uniform(0.2, 0.8)))
    noisy2 = timer(2, lambda: 9.0 * (1.0 + (rng.random() < 0.4) * rng.uniform(0.2, 0.8)))
    samples = time_points([steady, noisy, noisy2], reps=5)
    assert len(samples[0]) == 5 and not imprecise(samples[0])
    assert len(samples[1]) > 5 and len(samples[2]) > 5
    extra = calls[3 + 15 :]  # after the warm-ups and the five rounds
    assert 0 not in extra and extra[:4] == [1, 2, 1, 2]  # interleaved
    spent = sum(samples[1][5:]) + sum(samples[2][5:])
    first = sum(sum(xs[:5]) for xs in samples)
    assert spent <= first + max(samples[1] + samples[2])  # within the budget (one call over)
    # more precise with the repeats: the interval of the median narrowed
    lo5, hi5 = median_interval(samples[1][:5])
    lo, hi = median_interval(samples[1])
    assert hi - lo < hi5 - lo5
    st = summarize(samples)
    assert st.reps == 5 and st.reps_by_point == tuple(len(x) for x in samples)
    assert st.spread()["reps_by_point"] == list(st.reps_by_point)


def _fake_timer(scale: float = 1.0, spike: float = 0.0):
    """A timer factory for ``profile.measure``: ms linear in the pass size (and the
    context), every 3rd call of the 1-token point inflated by ``spike`` ms."""

    def factory(model, kv, n_tokens, ctx):
        count = [0]

        def once():
            count[0] += 1
            extra = spike if n_tokens == 1 and count[0] % 3 == 0 else 0.0
            return scale * (1.0 + 0.02 * n_tokens + 0.001 * ctx) + extra

        return once

    return factory


def test_profile_spread_cached_and_reloaded(tiny_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ADASERVE_CACHE", str(tmp_path))
    target, draft, _ = tiny_pair
    eng = Engine(EngineConfig(model=str(target), draft=str(draft), policy="ar", kv_cache_bytes=KV))
    hw = profile.load_or_profile(eng, auto=True, timer=_fake_timer(spike=50.0))
    err = capsys.readouterr().err
    path = profile.cached_profile_path(eng)
    assert "measuring the hardware profile: verify 1-256 tokens" in err
    assert f"caching it in {path}" in err
    # how long it took and where it went, once measured
    assert re.search(
        rf"measured the hardware profile in [0-9.]+ s; cached in {re.escape(str(path))}", err
    )
    raw = json.loads(path.read_text())
    spread = raw["verify"]["spread_by_kv"]["64"]
    assert spread["reps"] == 3 and len(spread["p90_ms"]) == len(profile.VERIFY_TOKENS)
    assert spread["p90_ms"][0] > spread["p10_ms"][0]  # the spike shows in the spread
    assert raw["draft_step"]["spread"]["reps"] == 3
    lat = raw["verify"]["latency_ms"]
    assert all(a <= b for a, b in zip(lat, lat[1:]))
    assert raw["sanity"] == {"impossible": [], "suspicious": []}
    # the next start uses the cache, says so, and measures nothing
    again = profile.load_or_profile(eng, auto=True, timer=None)
    assert "using the cached hardware profile" in capsys.readouterr().err
    assert again.verify_ms == hw.verify_ms


def test_unwritable_cache_folder_measures_for_this_run(tiny_pair, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")  # a file where the cache folder should be
    monkeypatch.setenv("ADASERVE_CACHE", str(tmp_path / "file" / "cache"))
    target, draft, _ = tiny_pair
    eng = Engine(EngineConfig(model=str(target), draft=str(draft), policy="ar", kv_cache_bytes=KV))
    hw = profile.load_or_profile(eng, auto=True, timer=_fake_timer())
    err = capsys.readouterr().err
    assert hw is not None and hw.verify_ms
    assert "cannot write the profile cache" in err and "; not cached" in err


def test_sanity_check_flags_impossible_and_inverted_profiles():
    limits = SanityLimits()
    # an 8B model at 4 bytes per parameter: 32 GB; no CPU reads that in 1 ms
    prof = {
        "target": {"params": 8_000_000_000},
        "bytes_per_param": 4,
        "verify": {
            "tokens": [1, 256],
            "spread_by_kv": {"64": {"raw_median_ms": [1.0, 900.0]}},
        },
    }
    found = check_profile(prof, limits)
    assert len(found["impossible"]) == 1 and "1 tokens" in found["impossible"][0]
    assert found["suspicious"] == []
    # the first start: 388 ms for one token, 120 ms for 256
    prof["verify"]["spread_by_kv"]["64"]["raw_median_ms"] = [388.0, 120.0]
    found = check_profile(prof, limits)
    assert found["impossible"] == [] and "inverted" in found["suspicious"][0]
    with pytest.raises(ValueError):
        SanityLimits(inversion_ratio=1.0)


def test_impossible_profile_is_remeasured_and_not_cached(tiny_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ADASERVE_CACHE", str(tmp_path))
    target, draft, _ = tiny_pair
    eng = Engine(EngineConfig(model=str(target), no_draft=True, policy="ar", kv_cache_bytes=KV))
    hw = profile.load_or_profile(eng, auto=True, timer=_fake_timer(scale=1e-9))
    err = capsys.readouterr().err
    assert "below the roofline floor" in err and "measuring the profile again with 6" in err
    assert "not caching an impossible profile" in err
    assert hw is not None and not profile.cached_profile_path(eng).exists()


def test_flagged_cached_profile_is_measured_again(tiny_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ADASERVE_CACHE", str(tmp_path))
    target, _, _ = tiny_pair
    eng = Engine(EngineConfig(model=str(target), no_draft=True, policy="ar", kv_cache_bytes=KV))
    path = profile.cached_profile_path(eng)
    path.parent.mkdir(parents=True, exist_ok=True)
    stale = {
        "verify": {"tokens": [1, 256], "latency_ms": [388.0, 520.0]},
        "draft_step_ms": 0.5,
        "sanity": {"impossible": [], "suspicious": ["verify: inverted"]},
    }
    path.write_text(json.dumps(stale))
    hw = profile.load_or_profile(eng, auto=True, timer=_fake_timer())
    assert "was flagged; measuring again" in capsys.readouterr().err
    assert hw.verify_ms[0] < 10 and json.loads(path.read_text())["sanity"]["suspicious"] == []


def test_drift_monitor_reports_and_never_asks_for_a_measurement():
    d = DriftMonitor(DriftConfig(window=4, low=0.5, high=2.0, min_interval_s=100.0))
    for t in range(3):
        assert not d.observe(10.0, 30.0, float(t))  # window not full yet
    assert d.median() is None
    assert d.observe(10.0, 30.0, 3.0) and d.drifted and d.median() == 3.0 and d.events == 1
    assert not d.observe(10.0, 30.0, 4.0)  # still drifted: reported once
    for t in range(4):  # back in bounds
        d.observe(10.0, 10.0, 5.0 + t)
    assert not d.drifted and d.as_dict()["median_ratio"] == pytest.approx(1.0)
    for t in range(4):  # out again within min_interval_s: counted, not reported
        assert not d.observe(10.0, 40.0, 10.0 + t)
    assert d.drifted and d.events == 2
    d.reset()
    assert not d.drifted and d.median() is None
    ok = DriftMonitor(DriftConfig(window=3))
    assert not any(ok.observe(10.0, m, 0.0) for m in (6.0, 15.0, 19.0, 12.0))  # in bounds
    for bad in (dict(window=0), dict(low=1.0), dict(high=0.9), dict(min_interval_s=-1)):
        with pytest.raises(ValueError):
            DriftConfig(**bad)
    with pytest.raises(InvalidRequestError):
        EngineConfig(drift_low=0.0)


def test_drift_is_reported_and_nothing_is_measured_in_the_loop(
    tiny_pair, cheap_profile, tmp_path, monkeypatch, capsys
):
    """Steps that take 1 s on a tick clock against a 10-ms profile: drift is reported
    (stderr, the monitor's state), every such pass is counted as a stall, and nothing
    is measured: no forward timer runs, no cache is written, the targets stay put."""
    monkeypatch.setenv("ADASERVE_CACHE", str(tmp_path))

    def no_timer(*a, **k):
        raise AssertionError("the serving loop measured a profile")

    monkeypatch.setattr(profiler, "_forward_timer", no_timer)
    target, draft, _ = tiny_pair
    cfg = EngineConfig(
        model=str(target),
        draft=str(draft),
        policy="ar",
        kv_cache_bytes=KV,
        drift_window=4,
        drift_min_interval_s=0.0,
    )
    eng = Engine(cfg, clock=TickClock(0.5))
    eng.set_hardware(HardwareModel.load(cheap_profile))
    before = eng.class_slo("interactive").tpot_ms
    eng.add_request([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.run_until_done()
    assert eng.drift.drifted and eng.drift.events == 1
    err = capsys.readouterr().err
    assert "outside [0.5, 2]" in err and "adaserve profile" in err
    assert not hasattr(eng, "reprofile_if_drifted")
    assert not (tmp_path / "profiles").exists()
    assert eng.class_slo("interactive").tpot_ms == before
    assert sum(eng.counters.stalls.values()) == eng.counters.iterations


def test_one_unloaded_tpot_for_server_bench_and_simulator(tiny_pair, cheap_profile, tmp_path):
    """The engine (server), the benchmark's resolution from a reported unloaded TPOT
    and the simulator's ``--profile`` give the same class targets."""
    from adaserve.sim.options import hardware_from_args

    raw = json.loads(Path(cheap_profile).read_text())
    hw = HardwareModel.from_dict(raw)
    want = float(hw.verify_latency(1, UNLOADED_KV_TOKENS) + hw.overhead_ms)
    assert unloaded_tpot_ms(hw) == unloaded_tpot_ms(raw) == hw.unloaded_tpot_ms() == want
    assert unloaded_tpot_ms({**raw, "unloaded_tpot_ms": 7.5}) == 7.5  # a rescaled profile's

    target, draft, _ = tiny_pair
    eng = build_engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            policy="spec-chain:2",
            kv_cache_bytes=KV,
            profile=cheap_profile,
        )
    )
    names = [c.name for c in DEFAULT_CLASSES]
    server = {n: eng.class_slo(n).tpot_ms for n in names}
    bench = class_slos(names, 1.0, unloaded_tpot_ms=eng.unloaded_tpot_ms())
    in_process = class_slos(names, 1.0, engine=eng)

    class Args:
        profile, preset = cheap_profile, None

    _, info, _ = hardware_from_args(Args)
    sim = class_slos(names, 1.0, unloaded_tpot_ms=info["unloaded_tpot_ms"])
    for n in names:
        assert server[n] == bench[n].tpot_ms == in_process[n].tpot_ms == sim[n].tpot_ms
    assert server["interactive"] == pytest.approx(1.2 * want)
