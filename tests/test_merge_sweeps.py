"""benchmarks/merge_sweeps.py: two sweeps of one workload with different policies
become one report whose capacity and oracle shares cover every policy."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "merge_sweeps", Path(__file__).parent.parent / "benchmarks" / "merge_sweeps.py"
)
merge_sweeps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(merge_sweeps)


def _summary(att, goodput):
    return {
        "overall": {"attainment": att, "goodput_tok_s": goodput, "requests": 10},
        "per_class": {
            "fast": {"attainment": att, "tpot_target_ms": 10.0, "requests": 6},
            "slow": {"attainment": 1.0, "tpot_target_ms": 50.0, "requests": 4},
        },
    }


def _sweep(per_policy: dict[str, list[float]]) -> dict:
    xs = [1.0, 2.0, 3.0]
    return {
        "config": {"sweep": "rate", "policies": list(per_policy), "values": xs},
        "points": [
            {
                "x": x,
                "results": {p: _summary(a[i], 100.0 * a[i] * x) for p, a in per_policy.items()},
            }
            for i, x in enumerate(xs)
        ],
    }


def test_merge_joins_policies_and_recomputes_capacity(tmp_path, capsys):
    a = _sweep({"adaserve": [1.0, 0.95, 0.5], "ar": [0.95, 0.6, 0.2]})
    b = _sweep({"oracle": [1.0, 1.0, 0.95], "ar": [0.95, 0.92, 0.2]})  # ar re-run
    paths = []
    for name, res in (("a", a), ("b", b)):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(res))
        paths.append(str(p))
    out = tmp_path / "merged"
    assert merge_sweeps.main([str(out), *paths, "--no-plots"]) == 0
    merged = json.loads((out / "result.json").read_text())
    assert merged["config"]["policies"] == ["adaserve", "ar", "oracle"]
    cap = merged["capacity"]["policies"]
    # the later file's ar wins: it qualifies at 2 req/s, so adaserve's ratio is 1.0x
    assert cap["ar"]["capacity_rps"] == 2.0 and cap["adaserve"]["capacity_rps"] == 2.0
    assert cap["oracle"]["capacity_rps"] == 3.0
    assert merged["goodput_reference"] == "oracle"
    share = merged["points"][2]["goodput_share"]["adaserve"]
    assert share == pytest.approx(0.5 / 0.95)
    assert "wrote" in capsys.readouterr().out


def test_merge_refuses_different_sweeps(tmp_path, capsys):
    a = _sweep({"adaserve": [1.0, 1.0, 1.0]})
    b = _sweep({"ar": [1.0, 1.0, 1.0]})
    b["points"] = b["points"][:2]
    for name, res in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
    rc = merge_sweeps.main(
        [str(tmp_path / "m"), str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    )
    assert rc == 2 and "different values" in capsys.readouterr().err
