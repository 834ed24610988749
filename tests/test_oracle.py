"""The clairvoyant ``oracle`` policy: an upper bound on tree selection (simulator only)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from adaserve.bench.metrics import summarize
from adaserve.bench.runner import class_slos
from adaserve.bench.workload import build_workload
from adaserve.bench.workload_spec import WorkItem, WorkloadSpec
from adaserve.config import EngineConfig
from adaserve.core.policy import BatchView, ReqView
from adaserve.core.tree import CandidateTree
from adaserve.errors import AdaServeError, InvalidRequestError
from adaserve.hardware.model import HardwareModel
from adaserve.policies.oracle import OraclePolicy
from adaserve.policies.registry import POLICY_NAMES, check_servable, make_policy
from adaserve.sim import presets
from adaserve.sim.acceptance import AcceptanceModel
from adaserve.sim.acceptance_params import AcceptanceParams
from adaserve.sim.loop import SimConfig, Simulator

OTHERS = ("adaserve", "dyn-tree", "spec-chain:4", "ar")


def _preset_sim() -> tuple[Simulator, tuple]:
    """The reference preset (A100-80GB, Llama-70B pair), GPU classes, 0.7 acceptance."""
    hw = presets.deployment("A100-80GB:llama-70b").hardware_model()
    classes = presets.gpu_classes()
    acc = AcceptanceParams.parametric(presets.PRESET_TOP1_ACCEPTANCE)
    return Simulator(
        hw, AcceptanceModel(acc), SimConfig(classes=classes, kv_slots=300_000)
    ), classes


def _run(sim, classes, policy, items):
    """(records, timeline) of ``policy`` on ``items`` against the classes' SLOs."""
    slos = class_slos(
        sorted({it.cls for it in items}), 1.0, unloaded_tpot_ms=sim.unloaded_tpot_ms(),
        classes=classes,
    )  # fmt: skip
    return sim.run(make_policy(policy), items, slos, policy_name=policy)


# ---------------------------------------------------------------------- the bound
@pytest.mark.parametrize("seed", [0, 1])
def test_oracle_goodput_bounds_every_other_policy(seed):
    """On a loaded three-class workload (where the other policies miss SLOs) the
    oracle's goodput, its attained tokens and its accepted tokens per second are at
    least every other policy's, and it verifies only what it accepts."""
    sim, classes = _preset_sim()
    spec = WorkloadSpec(seed=seed, request_rate=10.0, duration_s=15.0, dataset="random")
    items = build_workload(spec)
    assert len({it.cls for it in items}) == 3
    got = {}
    for p in ("oracle", *OTHERS):
        recs, tl = _run(sim, classes, p, items)
        assert all(r.completed for r in recs), p
        m = summarize(recs, tl.info["duration_s"])["overall"]
        good_tok = sum(r.output_tokens for r in recs if r.attained)
        acc_rate = m["accepted_tokens"] / m["duration_s"]
        got[p] = (m["goodput_tok_s"], good_tok, acc_rate, m["attainment"])
        if p == "oracle":
            # verified >= accepted in every pass, so equal sums mean equal passes
            assert all(r.verified == r.accepted for r in recs)
            assert all(r.drafted > r.verified for r in recs if r.steps > 1)
    assert min(got[p][3] for p in OTHERS) < 0.9  # a load where selection matters
    for p in OTHERS:
        assert got["oracle"][0] >= got[p][0], (p, got)
        assert got["oracle"][1] >= got[p][1], (p, got)
        assert got["oracle"][2] >= got[p][2], (p, got)
    # a bound worth its name here: strictly above the best real policy
    assert got["oracle"][0] > max(got[p][0] for p in OTHERS)


# ---------------------------------------------------------------------- exactness
FLAT = {  # verification costs the same whatever its size: timings cannot diverge
    "verify": {"tokens": [1, 1 << 16], "latency_ms": [20.0, 20.0]},
    "draft_step_ms": 2.0,
}


def test_oracle_verifies_only_the_path_and_accepts_what_the_full_tree_would():
    """Against ``spec-tree:4x4`` (the same 4x4 trees, every node verified, the same FCFS
    256-token prefill) on a machine where verification size costs nothing, every pass
    sees the same trees: the oracle accepts exactly as many tokens in every pass (the
    same token times), while verifying only those."""
    hw = HardwareModel.from_dict(FLAT)
    acc = AcceptanceParams.parametric(0.7)
    items = [WorkItem(i, 0.05 * i, "chat", None, None, 60 + 7 * i, 40) for i in range(12)]
    runs = {}
    for p in ("oracle:4x4", "spec-tree:4x4"):
        sim = Simulator(hw, AcceptanceModel(acc), SimConfig(seed=5))
        slos = class_slos(["chat"], 1.0, unloaded_tpot_ms=sim.unloaded_tpot_ms())
        runs[p], _ = sim.run(make_policy(p), items, slos, policy_name=p)
    oracle, full = runs["oracle:4x4"], runs["spec-tree:4x4"]
    assert [r.accepted for r in oracle] == [r.accepted for r in full]
    assert [r.steps for r in oracle] == [r.steps for r in full]
    assert [r.token_times_s for r in oracle] == [r.token_times_s for r in full]
    assert sum(r.accepted for r in oracle) > 2 * len(items)  # speculation paid off
    for o, f in zip(oracle, full):
        assert o.verified == o.accepted and o.drafted == f.drafted
        assert f.verified == 52 * f.steps > f.accepted  # 4 + 3 * 16 nodes per pass


def test_select_returns_exactly_the_revealed_nodes_and_needs_them():
    """select verifies exactly what ``reveal`` gave, once; without it, a clear error."""
    pol = OraclePolicy(2, 2)
    tree = CandidateTree(
        tokens=np.arange(7), parents=np.array([0, 0, 0, 1, 1, 2, 2]),
        depth=np.array([0, 1, 1, 2, 2, 2, 2]), q=np.full(7, 0.5),
        rank=np.array([0, 0, 1, 0, 1, 0, 1]), f=np.full(7, 0.5),
    )  # fmt: skip
    r = ReqView(7, "chat", 50.0, None, 3, 10.0, 20.0, 0, 30)
    view = BatchView(now_ms=0.0, requests=[r], free_kv_slots=1 << 20)
    plan = pol.plan(view)
    assert plan.shapes == {7: (2, 2)} and plan.prefill == {}
    with pytest.raises(AdaServeError, match="simulator only"):
        pol.select(view, plan, {7: tree})
    pol.reveal({7: np.array([0, 2, 6])})
    assert pol.select(view, plan, {7: tree})[7].tolist() == [0, 2, 6]
    with pytest.raises(AdaServeError, match="revealed"):  # a revelation serves one pass
        pol.select(view, plan, {7: tree})


def test_prefill_is_fcfs_chunks_and_one_replaceable_decision():
    """Default: 256 prefill tokens per pass, FCFS (view order); a ``prefill`` function
    (the hook for a composed variant) replaces it and sees the pass's tree shapes."""
    reqs = [
        ReqView(1, "batch", 150.0, None, 0, 0.0, 9.0, 200, 200),
        ReqView(2, "chat", 50.0, None, 0, 0.0, 5.0, 300, 300),
        ReqView(3, "chat", 50.0, None, 4, 80.0, 90.0, 0, 64),
    ]
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=1 << 20)
    plan = make_policy("oracle").plan(view)
    assert plan.prefill == {1: 200, 2: 56} and plan.shapes == {3: (4, 4)}
    seen = []

    def compose(v, shapes):
        seen.append(dict(shapes))
        return {2: 128}

    pol = OraclePolicy(3, 2, prefill=compose, name="oracle:3x2:test")
    assert pol.plan(view).prefill == {2: 128} and seen == [{3: (3, 2)}]
    assert pol.name == "oracle:3x2:test"


# ---------------------------------------------------------------------- names
def test_registry_names_and_malformed_forms():
    """oracle, oracle:DxW are names; other forms are the registry's usual error."""
    assert "oracle[:DxW][:compose]" in POLICY_NAMES
    for name, shape in (
        ("oracle", (4, 4)),
        ("oracle:4x4", (4, 4)),
        ("oracle:3x2", (3, 2)),
        ("oracle:compose", (4, 4)),
        ("oracle:3x2:compose", (3, 2)),
    ):
        p = make_policy(name)
        assert isinstance(p, OraclePolicy) and (p.depth, p.width) == shape
        assert p.clairvoyant and p.uses_draft and p.name == name
        assert (p.prefill_fn is not None) == name.endswith("compose")
    for bad in ("oracle:4", "oracle:0x4", "oracle:4x4x4", "oracle:ax2", "oracle:4x4:fcfs"):
        with pytest.raises(InvalidRequestError, match="unknown or malformed"):
            make_policy(bad)
    assert not any(make_policy(p).clairvoyant for p in OTHERS)


# ---------------------------------------------------------------------- refusals
def test_the_engine_side_refuses_the_oracle():
    """Every path that gives the engine a policy refuses a clairvoyant one, before any
    model loads: the config (LLM, generate, serve), ``check_servable`` (the engine's
    ``set_policy``, bench), and a replay has no target paths either."""
    for name in ("oracle", "oracle:3x2"):
        with pytest.raises(InvalidRequestError, match="simulator only"):
            EngineConfig(policy=name)
        with pytest.raises(InvalidRequestError, match="simulator only"):
            check_servable(name)
    with pytest.raises(InvalidRequestError, match="simulator only"):
        check_servable(OraclePolicy())
    check_servable("adaserve")
    check_servable(make_policy("dyn-tree"))
    from adaserve.sim.replay import replay

    with pytest.raises(ValueError, match="clairvoyant"):
        replay(SimConfig(), OraclePolicy(), None, 64, 1024, 20.0, [], [])


def test_serve_and_cli_exit_2_with_a_clear_message(capsys):
    """``serve --policy``, ``generate --policy`` and ``bench serve --policies`` with an
    oracle exit 2 with 'simulator only', before any model loads."""
    from adaserve.cli import main
    from adaserve.server.cli import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--policy", "oracle"])) == 2
    assert "simulator only" in capsys.readouterr().err
    assert main(["generate", "--policy", "oracle:4x4", "--prompt", "1", "--token-ids"]) == 2
    assert "simulator only" in capsys.readouterr().err
    assert main(["bench", "serve", "--policies", "ar,oracle", "--num-prompts", "2"]) == 2
    assert "simulator only" in capsys.readouterr().err


def test_simulate_runs_the_oracle_beside_other_policies(tmp_path, capsys):
    """``adaserve simulate --policies dyn-tree,oracle,oracle:3x2`` reports all three."""
    from adaserve.cli import main

    out = tmp_path / "o"
    args = ["simulate", "--preset", "A100-80GB:llama-70b", "--duration", "4"]
    args += ["--request-rate", "4", "--dataset", "random", "--no-progress", "--no-plots"]
    args += ["--policies", "dyn-tree,oracle,oracle:3x2", "--out", str(out)]
    assert main(args) == 0
    res = json.loads((out / "result.json").read_text())
    assert set(res["results"]) == {"dyn-tree", "oracle", "oracle:3x2"}
    m = res["results"]["oracle"]["overall"]
    assert m["verified_tokens"] == m["accepted_tokens"] > 0
    capsys.readouterr()
