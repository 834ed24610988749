"""Power as a constraint of the plan (hardware/power.py, AdaptiveConfig.power_cap_w and
energy_per_token_j) and energy per accepted token per class in the reports."""

from __future__ import annotations

import json
import math

import pytest

from adaserve.bench.runner import class_slos
from adaserve.bench.workload import build_workload
from adaserve.bench.workload_spec import WorkloadSpec
from adaserve.errors import InvalidRequestError
from adaserve.hardware.power import PowerModel
from adaserve.policies.budgeted import AdaptiveConfig, BudgetedState
from adaserve.policies.registry import make_policy
from adaserve.policies.typical_tree import gain_curve
from adaserve.sim import presets
from adaserve.sim.acceptance import AcceptanceModel
from adaserve.sim.acceptance_params import AcceptanceParams
from adaserve.sim.loop import SimConfig, Simulator
from adaserve.sim.options import with_power_limits

PRESET = "A100-80GB:llama-70b"


def _power_model() -> PowerModel:
    """The preset's power model, as ``adaserve simulate`` builds it."""
    from adaserve.hardware.energy import device_energy

    dep = presets.deployment(PRESET)
    hw = dep.hardware_model()
    ft, fd = dep.target.flops_per_token, dep.draft.flops_per_token
    wb = (float(dep.target.weight_bytes), float(dep.draft.weight_bytes))
    return PowerModel.of(
        (ft, fd), wb, hw.kv_bytes_target + hw.kv_bytes_draft, device_energy("a100")
    )


class _Recording:
    """A policy that records every (view, plan) of the policy it wraps."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __getattr__(self, k):
        return getattr(self.inner, k)

    def plan(self, view):
        p = self.inner.plan(view)
        self.seen.append((view, p))
        return p


def _planned(policy: str) -> tuple[list, PowerModel]:
    """(view, plan) of every iteration of ``policy`` over a short loaded run on the
    reference preset, and the power model the planner saw."""
    pm = _power_model()
    hw = presets.deployment(PRESET).hardware_model()
    classes = presets.gpu_classes()
    acc = AcceptanceParams.parametric(presets.PRESET_TOP1_ACCEPTANCE)
    sim = Simulator(
        hw, AcceptanceModel(acc), SimConfig(classes=classes, kv_slots=300_000), power=pm
    )
    items = build_workload(WorkloadSpec(seed=1, request_rate=4.0, duration_s=6.0, dataset="random"))
    slos = class_slos(
        sorted({it.cls for it in items}), 1.0, unloaded_tpot_ms=sim.unloaded_tpot_ms(),
        classes=classes,
    )  # fmt: skip
    pol = _Recording(make_policy(policy))
    recs, _ = sim.run(pol, items, slos, policy_name=policy)
    assert all(r.completed for r in recs)
    # a pass without decoders (prefill only) is not planned with a profile: unpriced
    seen = [(v, p) for v, p in pol.seen if p.t_iter_ms is not None]
    assert all(not v.decoding for v, p in pol.seen if p.t_iter_ms is None)
    assert len(seen) > 0.9 * len(pol.seen)
    return seen, pm


def _recomputed(pm: PowerModel, view, plan) -> tuple[float, float, int]:
    """(J, W, depth) of a plan, recomputed from its budget, shapes and predicted time:
    the deepest drafted shape's draft passes over the catch-up and candidates."""
    depth = max((d for d, _ in plan.shapes.values()), default=0)
    kv = float(sum(r.context_len for r in view.requests))
    j = pm.pass_energy_j(plan.budget, kv, depth, plan.budget if depth else 0, plan.t_iter_ms)
    return j, pm.pass_power_w(j, plan.t_iter_ms), depth


def _speculating(seen):
    return [(v, p) for v, p in seen if p.shapes]


def test_power_cap_bounds_every_planned_pass():
    """Uncapped, some speculating pass's predicted power exceeds 300 W; with
    ``power_cap_w=300`` none does (recomputed from the plan), the planner still
    speculates, and only plans that are depth 0 already go over (noted ``power_cap``)."""
    cap = 300.0
    free, pm = _planned("adaserve")
    over = [_recomputed(pm, v, p)[1] for v, p in _speculating(free)]
    assert max(over) > cap * 1.05
    capped, _ = _planned(f"adaserve:power_cap_w={cap}")
    spec = _speculating(capped)
    assert len(spec) > 0.2 * len(capped)
    for v, p in capped:
        j, w, depth = _recomputed(pm, v, p)
        assert p.energy_j is not None and j <= p.energy_j * (1 + 1e-9)
        if w > cap * (1 + 1e-9):
            assert depth == 0 and not p.shapes and p.fallback == "power_cap"
        elif p.shapes:
            assert p.fallback is None
    # the cap costs speculation: less verified work per pass than uncapped
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean([_recomputed(pm, v, p)[1] for v, p in spec]) < mean(over)


def test_energy_budget_per_token_bounds_every_planned_pass():
    """With ``energy_per_token_j`` every speculating pass's predicted energy per
    expected accepted token (roots + the typical tree's expected gains of its
    allocation) stays within it; uncapped some pass exceeds it."""

    def per_token(pol_seen, pm):
        out = []
        for v, p in _speculating(pol_seen):
            st = p.state
            assert isinstance(st, BudgetedState)
            g = gain_curve(st.choice.depth, st.choice.width, v.acc_by_rank or (0.6, 0.15))
            gains = sum(float(g[min(int(k), len(g) - 1)]) for k in st.choice.alloc)
            out.append(p.energy_j / (len(st.choice.alloc) + gains))
        return out

    free, pm = _planned("adaserve")
    budget = 0.5
    assert max(per_token(free, pm)) > budget
    capped, _ = _planned(f"adaserve:energy_per_token_j={budget}")
    got = per_token(capped, pm)
    assert got  # still speculates
    # the planner's acceptance is its rounded calibration: allow that much slack
    assert max(got) <= budget * 1.05
    for v, p in capped:  # recomputed energy never above the planner's
        assert _recomputed(pm, v, p)[0] <= p.energy_j * (1 + 1e-9)


@pytest.mark.parametrize("bad", [{"power_cap_w": -1.0}, {"energy_per_token_j": math.nan}])
def test_power_constraints_are_validated(bad):
    with pytest.raises(ValueError):
        AdaptiveConfig(**bad)
    key, v = next(iter(bad.items()))
    with pytest.raises(InvalidRequestError):
        make_policy(f"adaserve:{key}={v}")
    assert make_policy("adaserve:power_cap_w=250").cfg.power_cap_w == 250.0
    assert AdaptiveConfig().power_cap_w == 0 and AdaptiveConfig().energy_per_token_j == 0


def test_power_model_is_validated_and_prices_like_the_energy_model():
    with pytest.raises(ValueError):
        PowerModel(1.0, pj_per_flop=-1.0, pj_per_byte=1.0)
    with pytest.raises(ValueError):
        PowerModel(1.0)  # no energy at all
    pm = PowerModel(2.0, 1.0, 100.0, 10.0, 3.0, pj_per_flop=1.0, pj_per_byte=2.0, static_w=5.0)
    # 2 x 10 + 1 x 12 FLOPs; 100 + 2 x 10 + 4 x 3 bytes; 5 W for 0.1 s
    j = pm.pass_energy_j(10, 4, 2, 12, t_ms=100.0)
    assert j == pytest.approx((32 * 1.0 + 132 * 2.0) * 1e-12 + 0.5)
    assert pm.pass_power_w(j, 100.0) == pytest.approx(j * 10)
    e0, et = pm.depth_coefficients([0, 2], tok0=4, kv_tokens=3.0)
    for d, i in ((0, 0), (2, 1)):
        assert e0[i] + et[i] * 6 == pytest.approx(pm.planned_energy_j(d, 3, 1, 6, 3.0, 0.0))


def test_cap_without_a_power_model_is_off_with_a_warning():
    from adaserve.core.policy import BatchView, ReqView
    from adaserve.hardware.model import HardwareModel

    hw = HardwareModel((1.0, 64.0), (10.0, 20.0), (1.0,), (1.0,))
    r = ReqView(1, "chat", 50.0, None, 5, 40.0, 50.0, 0, 100)
    pol = make_policy("adaserve:power_cap_w=1")
    with pytest.warns(RuntimeWarning, match="no PowerModel"):
        plan = pol.plan(BatchView(0.0, [r], 10_000, hw=hw))
    assert plan.energy_j is None and plan.fallback is None
    view = BatchView(0.0, [r], 10_000, hw=hw, power=_power_model())
    assert pol.plan(view).fallback == "power_cap"  # 1 W: even depth 0 is over


def test_with_power_limits_sets_budgeted_policies_only():
    got = with_power_limits(["adaserve", "ar", "dyn-tree:power_cap_w=5"], 300.0, None)
    assert got == ["adaserve:power_cap_w=300.0", "ar", "dyn-tree:power_cap_w=5"]
    assert with_power_limits(["smartspec"], None, 0.2) == ["smartspec:energy_per_token_j=0.2"]


def test_simulate_reports_energy_per_token_per_class_and_power(tmp_path, capsys):
    """``adaserve simulate --power-cap-w``: J per accepted token per class and overall,
    and mean/max predicted and measured power, with the predicted max under the cap
    (bar depth-0 passes)."""
    from adaserve.cli import main

    out = tmp_path / "p"
    args = ["simulate", "--preset", PRESET, "--duration", "4", "--request-rate", "3"]
    args += ["--dataset", "random", "--no-progress", "--no-plots", "--out", str(out)]
    args += ["--policies", "adaserve,ar", "--power-cap-w", "400"]
    assert main(args) == 0
    res = json.loads((out / "result.json").read_text())
    assert set(res["results"]) == {"adaserve:power_cap_w=400.0", "ar"}
    for r in res["results"].values():
        for m in r["per_class"].values():
            assert m["energy_per_token_j"] > 0
        o = r["overall"]
        assert o["energy_per_token_j"] > 0
        assert o["power"]["measured"]["max_w"] >= o["power"]["measured"]["mean_w"] > 0
    p = res["results"]["adaserve:power_cap_w=400.0"]["overall"]["power"]["predicted"]
    assert p["mean_w"] > 0 and p["planned_iterations"] > 0
    assert "J/token" in capsys.readouterr().out
