"""Small fidelity check of the simulator against the real engine, on one pair.

The pair is a tiny 4-layer random target whose first layer (the later layers damped)
is the draft, so that it agrees with the target often enough for speculation to
matter. The acceptance model is calibrated from the pair's teacher-forced statistics
(``adaserve.train.stats.pair_stats``, as for the shipped pair); both the engine and the
simulator then serve the same prompts with the same policies, and the test compares
what does not depend on wall-clock time: tokens per verification step (the product of
the acceptance model, the tree shapes and the calibrator) and the step counts.
Attainment and goodput against the engine are compared in docs/simulator.md
("Fidelity"): on a shared CPU the real engine's own run-to-run spread is too large for
a unit test.
"""

from __future__ import annotations

import json

import pytest
import torch

from adaserve.bench.runner import class_slos
from adaserve.bench.workload_spec import WorkItem
from adaserve.hardware.model import HardwareModel
from adaserve.policies.registry import make_policy
from adaserve.sim.acceptance import AcceptanceModel
from adaserve.sim.acceptance_params import AcceptanceParams
from adaserve.sim.loop import SimConfig, Simulator

V = 320
PROFILE = {"verify": {"tokens": [1, 64, 256], "latency_ms": [2.0, 3.0, 8.0]}, "draft_step_ms": 0.5}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two spinning OpenMP threads
    make tiny forwards 20x slower whenever another process is busy."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def fid_pair(tmp_path_factory, one_thread):
    import transformers

    from adaserve.models.loader import load_model
    from adaserve.train.stats import pair_stats

    root = tmp_path_factory.mktemp("fid")
    base = dict(
        vocab_size=V,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        eos_token_id=V - 1,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    t = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)).eval()
    with torch.no_grad():  # damp layers 1..3 so that layer 0 alone is a decent draft
        for layer in t.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    t.save_pretrained(root / "target")
    sd = t.state_dict()
    d = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**base, "num_hidden_layers": 1})
    ).eval()
    d.load_state_dict(
        {k: v for k, v in sd.items() if not k.startswith("model.layers.") or ".layers.0." in k}
    )
    d.save_pretrained(root / "draft")
    tm, dm = load_model(root / "target"), load_model(root / "draft")
    g = torch.Generator().manual_seed(0)
    stats = pair_stats(tm, dm, torch.randint(1, V - 1, (16, 32), generator=g), new_tokens=40)
    (root / "profile.json").write_text(json.dumps(PROFILE))
    return root, stats


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, V - 1, (32,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("policy", ["spec-chain:4", "spec-tree:3x2"])
def test_tokens_per_step_match_the_engine(fid_pair, policy):
    from adaserve import LLM, SamplingParams

    root, stats = fid_pair
    assert stats["greedy_agreement"] > 0.4  # the pair really speculates
    prompts, n_out = _prompts(16), 40
    llm = LLM(
        model=str(root / "target"),
        draft=str(root / "draft"),
        policy=policy,
        profile=str(root / "profile.json"),
        kv_cache_bytes=64 << 20,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    real_steps = sum(o.metrics["steps"] for o in outs)
    real_acc = sum(o.metrics["accepted_tokens"] for o in outs)

    hw = HardwareModel.from_dict(PROFILE)
    sim = Simulator(hw, AcceptanceModel(AcceptanceParams.from_stats_dict(stats)), SimConfig(seed=1))
    items = [WorkItem(i, 0.0, "chat", None, p, len(p), n_out) for i, p in enumerate(prompts)]
    slos = class_slos(["chat"], 1.0, unloaded_tpot_ms=hw.unloaded_tpot_ms())
    recs, _ = sim.run(make_policy(policy), items, slos)
    sim_steps = sum(r.steps for r in recs)
    sim_acc = sum(r.accepted for r in recs)
    assert all(r.output_tokens == n_out for r in recs)
    # accepted tokens per verification step (engine vs simulator)
    real_rate, sim_rate = real_acc / real_steps, sim_acc / sim_steps
    assert sim_rate == pytest.approx(real_rate, rel=0.15), (real_rate, sim_rate)
    assert sim_steps == pytest.approx(real_steps, rel=0.15)


def _fidelity_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "fidelity.py"
    spec = importlib.util.spec_from_file_location("fidelity_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _result(att: dict[str, tuple[int, int]], goodput: float) -> dict:
    per = {c: {"attained": a, "requests": n} for c, (a, n) in att.items()}
    a, n = sum(x for x, _ in att.values()), sum(y for _, y in att.values())
    return {"overall": {"attained": a, "requests": n, "goodput_tok_s": goodput}, "per_class": per}


def test_fidelity_benchmark_pools_rounds_by_request_and_judges_each_class():
    """benchmarks/fidelity.py: rounds pool as attained / requests per class (not a mean
    of percentages), goodput as the mean, and a single class off by more than the
    allowed points fails the comparison even when the overall figure agrees."""
    fid = _fidelity_script()
    real = fid.pool(
        [
            {"p": _result({"strict": (3, 4), "batch": (10, 10)}, 100.0)},
            {"p": _result({"strict": (1, 6), "batch": (10, 10)}, 80.0)},
        ]
    )
    assert real["p"]["classes"]["strict"] == [4, 10]
    assert real["p"]["overall"] == [24, 30]
    sim = fid.pool([{"p": _result({"strict": (5, 10), "batch": (19, 20)}, 99.0)}])
    cmp = fid.compare(real, sim, points=5.0, goodput_rel=0.15)["p"]
    assert cmp["classes"]["strict"]["gap"] == pytest.approx(10.0)  # 50% vs 40%
    assert cmp["classes"]["batch"]["gap"] == pytest.approx(-5.0)
    assert cmp["goodput"]["rel"] == pytest.approx(0.1)
    assert not cmp["classes_ok"] and cmp["goodput_ok"]
    assert cmp["overall"]["real"] == pytest.approx(80.0)
    assert cmp["overall"]["sim"] == pytest.approx(80.0)


def test_fidelity_reuse_finds_the_stored_rounds_and_their_fits(tmp_path):
    """``--reuse``: a bracketed run simulates round k with fits k and k + 1, an earlier
    run with its one fit per round; a directory without rounds is a clear exit."""
    fid = _fidelity_script()
    brk, old, empty = tmp_path / "brk", tmp_path / "old", tmp_path / "empty"
    for k in (1, 2):
        for run in (brk, old):
            (run / f"round{k}-real").mkdir(parents=True)
            (run / f"round{k}-real" / "result.json").write_text("{}")
        (old / f"round{k}-profile.json").write_text("{}")
    for k in (1, 2, 3):
        (brk / f"fit{k}-profile.json").write_text("{}")
    got = fid.stored_rounds(brk)
    assert [(r.name, [f.name for f in fits]) for r, fits in got] == [
        ("round1-real", ["fit1-profile.json", "fit2-profile.json"]),
        ("round2-real", ["fit2-profile.json", "fit3-profile.json"]),
    ]
    got = fid.stored_rounds(old)
    assert [[f.name for f in fits] for _, fits in got] == [
        ["round1-profile.json"],
        ["round2-profile.json"],
    ]
    empty.mkdir()
    with pytest.raises(SystemExit, match="no stored rounds"):
        fid.stored_rounds(empty)


def test_speed_trace_of_a_real_run_is_measured_over_fitted_time_per_window(tmp_path):
    """benchmarks/fidelity.py prices every real iteration with the fitted profile from
    the work its timeline sample records and divides measured by predicted time per
    window (by iteration start); an empty window keeps the previous factor, and a
    timeline without the work fields gives no trace."""
    import json

    from adaserve.core.trace import DraftWork
    from adaserve.hardware.model import HardwareModel
    from adaserve.sim.pricing import HostOverhead, forward_ms

    fid = _fidelity_script()
    prof = {
        "verify": {"tokens": [1, 64, 256], "latency_ms": [10.0, 14.0, 30.0]},
        "draft_step_ms": 1.0,
        "host_overhead": {"per_request": 0.5, "per_spec_step": 0.25},
    }
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(prof))
    hw = HardwareModel.load(path)
    host = HostOverhead.parse(prof["host_overhead"])

    def sample(start: float, speed: float, shapes: list) -> dict:
        tokens = 3 + sum(1 + d for d, _ in shapes)
        steps = [sum(w for d, w in shapes if d - 1 > t) for t in range(3)]
        steps = steps[: max((d for d, _ in shapes), default=1) - 1]
        draft = DraftWork(len(shapes), tuple(steps), 0, sum(d for d, _ in shapes), 0, len(shapes))
        pred = forward_ms(hw, tokens, 500, draft if shapes else DraftWork())
        pred += host.ms(HostOverhead.features(3, len(shapes), sum(d for d, _ in shapes), 0, 0))
        ms = speed * pred
        return {"t": start + ms / 1000, "iter_ms": ms, "tokens": tokens, "kv_tokens": 500,
                "shapes": shapes, "running": 3, "tree_nodes": 0}  # fmt: skip

    samples = [sample(0.5, 1.5, []), sample(1.0, 1.5, [[3, 1], [2, 1]]),
               sample(4.2, 0.8, [[4, 1]]), sample(12.5, 1.2, [])]  # fmt: skip
    trace = fid.speed_trace(samples, path, window=4.0)
    assert trace["t_s"] == [0.0, 4.0, 8.0, 12.0]
    assert trace["factor"] == pytest.approx([1.5, 0.8, 0.8, 1.2], abs=1e-4)
    del samples[1]["shapes"]
    assert fid.speed_trace(samples, path, window=4.0) is None
