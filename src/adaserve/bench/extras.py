"""The figures a run's summary adds to its records' metrics: energy (per class and
overall), power, convergence after each workload shift and the run's counters."""

from __future__ import annotations

import numpy as np

from adaserve.bench.metrics import shift_convergence
from adaserve.bench.workload_spec import WorkloadSpec
from adaserve.hardware.energy import device_energy


def strict_class(spec: WorkloadSpec, classes) -> str:
    names = [c for c, _ in spec.class_mix]
    ranks = {c.name: c.rank for c in classes}
    return min(names, key=lambda c: (ranks.get(c, 99), names.index(c)))


def classes_of(spec: WorkloadSpec, items) -> list[str]:
    names = {c for c, _ in spec.class_mix} | {it.cls for it in items}
    for s in spec.shifts:
        if s.kind == "mix":
            names |= {c for c, _ in s.value}
    return sorted(names)


def energy_model(args):
    return device_energy(
        args.energy_device or args.device, args.energy_pj_per_flop, args.energy_pj_per_byte
    )


def class_energy(tl, records, energy) -> dict[str, dict]:
    """CLASS (and ``"overall"``) -> {"energy_j", "energy_per_token_j"}: the energy of
    the iterations' work attributed to each class (``RunRecorder``: each iteration's
    FLOPs and bytes split across its requests by the tokens the target verified for
    them) on ``energy`` (a ``DeviceEnergy``), per output token (every committed token is
    one the target accepted; all the class's requests, finished or not, since their
    work was spent)."""
    by = tl.info.get("energy_by_class") or {}
    toks: dict[str, int] = {}
    for r in records:
        toks[r.cls] = toks.get(r.cls, 0) + r.output_tokens
    out: dict[str, dict] = {}
    for cls in sorted(set(by) | set(toks)):
        w = by.get(cls)
        j = energy.joules(w["flops"], w["bytes_moved"]) if w else 0.0
        n = toks.get(cls, 0)
        out[cls] = {"energy_j": j, "energy_per_token_j": j / n if n else None}
    tally = tl.info.get("energy_tally")
    if tally is not None:
        j, n = energy.joules(tally["flops"], tally["bytes_moved"]), sum(toks.values())
        out["overall"] = {"energy_per_token_j": j / n if n else None}
    return out


def power_summary(tl, energy) -> dict | None:
    """The run's power (W): ``measured`` -- each iteration's work on ``energy`` over
    its duration (simulated or wall) -- and ``predicted`` -- each plan's predicted
    energy over its predicted time (plans that predict none left out); ``mean_w`` is
    energy over busy time, ``max_w`` the highest iteration. None without steps."""
    s = tl.info.get("power_steps")
    if s is None or not len(s["flops"]):
        return None
    j = (s["flops"] * energy.pj_per_flop + s["bytes"] * energy.pj_per_byte) * 1e-12
    d = s["duration_s"]
    ok = d > 0
    out = {
        "measured": {
            "mean_w": float(j[ok].sum() / d[ok].sum()) if ok.any() else None,
            "max_w": float((j[ok] / d[ok]).max()) if ok.any() else None,
        },
        "predicted": None,
    }
    pj, pt = s["pred_j"], s["pred_ms"] / 1000.0
    q = np.isfinite(pj) & np.isfinite(pt) & (pt > 0)
    if q.any():
        out["predicted"] = {
            "mean_w": float(pj[q].sum() / pt[q].sum()),
            "max_w": float((pj[q] / pt[q]).max()),
            "planned_iterations": int(q.sum()),
        }
    return out


def run_extra(tl, records, spec, strict: str, energy, window: float) -> dict:
    info = tl.info
    out_tok = sum(r.output_tokens for r in records if r.completed)
    tally = info["energy_tally"]
    j = energy.joules(tally["flops"], tally["bytes_moved"])
    shifts = []
    if spec.shifts:
        conv = shift_convergence(
            records,
            [s.at_s for s in spec.shifts],
            strict,
            info["duration_s"],
            window_s=window,
        )
        for s, c in zip(spec.shifts, conv):
            shifts.append({"change": s.change, "strict_class": strict, **c})
    keys = (
        "iterations",
        "fallback_iterations",
        "fallback_iterations_total",
        "shed_by_reason",
        "admission",
        "degraded_total",
        "preemptions",
        "spec_drafts",
        "accepted_per_pos",
        "model_time_s",
        "step_time_s",
        "peak_kv_usage",
        "peak_kv_bytes",
        "wall_s",
        "stalls",
        "stalls_total",
        "pass_speed",
        "replayed_tpot",
        "speed_trace",
    )
    extra = {k: info[k] for k in keys if k in info}
    extra["energy"] = {
        **energy.as_dict(),
        "flops": tally["flops"],
        "bytes_moved": tally["bytes_moved"],
        "energy_j": j,
        "energy_per_token_mj": j / out_tok * 1000.0 if out_tok else None,
    }
    extra["power"] = power_summary(tl, energy)
    extra["shifts"] = shifts
    return extra
