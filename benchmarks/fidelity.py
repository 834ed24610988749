"""Simulator fidelity against the real engine, with the fit and the real runs interleaved.

The machine's speed drifts by 10-40% within minutes, so a host-overhead fit made once
and compared with real runs made later can be off by the drift alone. This script runs
R rounds; each round

1. runs the real engine in-process on the comparison workload (``adaserve bench serve``,
   every policy once),
2. simulates the same workload (``adaserve simulate --selection-time measured``, the
   pair's acceptance statistics) twice: with the host-overhead model and speed factor
   fitted just before the round's real runs and with those fitted just after them.
   Fits run on a *different* workload (seed 100, ``benchmarks/fit_host_overhead.py``);
   R + 1 fits bracket the R rounds.

Real and simulated results are pooled over the rounds and fits (requests attained /
requests per class; goodput averaged) and compared: per-class attainment within
``--points`` points and goodput within ``--goodput-rel``. Writes ``fidelity.json`` and
``fidelity.md``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fidelity.py --out /tmp/fid --rounds 3

Run nothing else on the machine meanwhile (two cores: another process skews both sides).

``--reuse DIR[,DIR...]`` runs nothing real: it re-simulates the rounds stored by earlier
runs of this script (their real results and fits; the engine must not have changed
since) with the current simulator and pools them all, which judges a change to the
simulator against many more real requests than one run has:

    .venv/bin/python benchmarks/fidelity.py --out /tmp/fid-re --reuse /tmp/fid1,/tmp/fid2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from adaserve.util import paths

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ("--selection-time", "measured")  # the policy's decision time, as the engine pays it


def _run(cmd: list[str], log: Path) -> None:
    """Run one step, its output appended to ``log``; a failure stops the script."""
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        t = time.perf_counter()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        f.write(f"# exit {rc} after {time.perf_counter() - t:.0f} s\n")
    if rc:
        sys.exit(f"fidelity: step failed (exit {rc}): {' '.join(cmd)}; see {log}")


def _results(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())["results"]


def _workload(a: dict) -> list[str]:
    """The comparison workload's bench options, from a run's arguments (``vars(args)``)."""
    return [
        "--kv-cache-bytes", a["kv_cache_bytes"],
        "--request-rate", str(a["request_rate"]),
        "--duration", str(a["duration"]),
        "--seed", str(a["seed"]),
        "--policies", a["policies"],
        "--no-plots", "--no-progress",
    ]  # fmt: skip


def _simulate(args, log, exe, common, fitted: Path, dest: Path, *extra: str) -> dict:
    """``adaserve simulate`` of the workload with a fitted profile; its results."""
    _run([*exe, "simulate", "--profile", str(fitted), "--stats", args.stats, *extra,
          *common, *args.sim_args.split(), "--out", str(dest)], log)  # fmt: skip
    return _results(dest)


def _draft_of(smp: dict):
    """The draft's passes of a timeline sample (``DraftWork``): as recorded, or, for
    samples recorded before the draft's work was, from the trees' shapes (one catch-up
    token per drafting request, no context)."""
    from adaserve.core.trace import DraftWork

    if "draft" in smp:
        d = smp["draft"]
        return DraftWork(
            d["catchup"],
            tuple(d["steps"]),
            d["kv_tokens"],
            d["request_steps"],
            requests=d.get("requests", len(smp["shapes"])),
        )
    shapes = smp["shapes"]
    if not shapes:
        return DraftWork()
    depth = max(d for d, _ in shapes)
    steps = tuple(sum(w for d, w in shapes if d - 1 > t) for t in range(depth - 1))
    return DraftWork(len(shapes), steps, 0, sum(d for d, _ in shapes), requests=len(shapes))


def _sample_ms(hw, host, smp: dict) -> float | None:
    """The fitted model's time (ms) of one real iteration from its timeline sample (the
    sample's work: tokens verified, context tokens, drafted tree shapes); None for
    samples without the work fields (runs made before they were recorded). The draft's
    catch-up is taken as one token per drafting request."""
    from adaserve.sim.pricing import HostOverhead, forward_ms

    if "shapes" not in smp:
        return None
    shapes = smp["shapes"]
    # logits rows: every tree node and root (decoders taken as the trees' requests)
    rows = smp["tree_nodes"] + max(len(shapes), smp["running"] - 1)
    ms = forward_ms(hw, smp["tokens"], smp["kv_tokens"], _draft_of(smp), rows=rows)
    if host is not None:
        ms += host.ms(
            HostOverhead.features(
                smp["running"],
                len(shapes),
                sum(d for d, _ in shapes),
                sum(w + (d - 1) * w * w for d, w in shapes),
                smp["tree_nodes"],
            )
        )
    return ms


def speed_trace(samples: list[dict], profile: Path, window: float) -> dict | None:
    """How fast the machine ran during a real run, relative to a fitted profile: per
    ``window`` seconds of the run (by iteration start), measured / predicted iteration
    time summed over its iterations (a window without iterations keeps the previous
    factor). The measured time includes the policy's decisions, so simulate it with
    ``--selection-time none``. {"t_s": [...], "factor": [...]}, or None when the
    timeline does not record the iterations' work."""
    from adaserve.hardware.model import HardwareModel
    from adaserve.sim.pricing import HostOverhead

    prof = json.loads(profile.read_text())
    hw = HardwareModel.load(profile)
    host = HostOverhead.parse(prof["host_overhead"]) if prof.get("host_overhead") else None
    sums: dict[int, list[float]] = {}
    for smp in samples:
        pred = _sample_ms(hw, host, smp)
        if pred is None:
            return None
        start = smp["t"] - smp["iter_ms"] / 1000.0
        acc = sums.setdefault(int(max(start, 0.0) // window), [0.0, 0.0])
        acc[0] += smp["iter_ms"]
        acc[1] += pred
    if not sums:
        return None
    t_s, factor, prev = [], [], None
    for k in range(max(sums) + 1):
        m, p = sums.get(k, (0.0, 0.0))
        f = m / p if p > 0 else prev
        if f is not None:
            t_s.append(k * window)
            factor.append(round(f, 4))
            prev = f
    return {"t_s": t_s, "factor": factor}


def write_traces(real_dir: Path, profile: Path, dest: Path, window: float) -> bool:
    """Per-policy speed traces of a stored real run (``--speed-trace`` format); False
    when its timelines do not record the iterations' work."""
    timelines = json.loads((real_dir / "timeline.json").read_text())
    traces = {}
    for pol, samples in timelines.items():
        tr = speed_trace(samples, profile, window)
        if tr is None:
            return False
        traces[pol] = tr
    dest.write_text(json.dumps({"policies": traces}) + "\n")
    return True


def pool(runs: list[dict]) -> dict:
    """Per policy: per-class (attained, requests) summed over runs, goodput averaged.
    runs: [{policy: {"overall": M, "per_class": {cls: M}}}]."""
    out: dict = {}
    for res in runs:
        for pol, r in res.items():
            p = out.setdefault(pol, {"classes": {}, "goodput": [], "overall": [0, 0]})
            for cls, m in r["per_class"].items():
                a = p["classes"].setdefault(cls, [0, 0])
                a[0] += m["attained"]
                a[1] += m["requests"]
            p["overall"][0] += r["overall"]["attained"]
            p["overall"][1] += r["overall"]["requests"]
            p["goodput"].append(r["overall"]["goodput_tok_s"])
    return out


def compare(real: dict, sim: dict, points: float, goodput_rel: float) -> dict:
    """Per policy: per-class attainment (%) real / simulated / gap, goodput gap, verdict."""
    out = {}
    for pol, r in real.items():
        s = sim[pol]
        classes = {}
        for cls, (a, n) in sorted(r["classes"].items()):
            sa, sn = s["classes"].get(cls, (0, 0))
            ra, sa_ = 100.0 * a / max(n, 1), 100.0 * sa / max(sn, 1)
            classes[cls] = {"real": ra, "sim": sa_, "gap": sa_ - ra, "requests": n}
        rg = sum(r["goodput"]) / len(r["goodput"])
        sg = sum(s["goodput"]) / len(s["goodput"])
        grel = (sg - rg) / rg if rg > 0 else float("inf")
        out[pol] = {
            "classes": classes,
            "overall": {
                "real": 100.0 * r["overall"][0] / max(r["overall"][1], 1),
                "sim": 100.0 * s["overall"][0] / max(s["overall"][1], 1),
            },
            "goodput": {"real": rg, "sim": sg, "rel": grel, "real_runs": r["goodput"]},
            "classes_ok": all(abs(c["gap"]) <= points for c in classes.values()),
            "goodput_ok": abs(grel) <= goodput_rel,
        }
    return out


def report(cmp: dict, speeds: list[float], args, header: bool = True) -> str:
    lines = []
    if header:
        lines = [
            "# Simulator fidelity (interleaved rounds)",
            "",
            f"{args.rounds} rounds; rate {args.request_rate} req/s, {args.duration} s, seed "
            f"{args.seed}, policies {args.policies}; fit on seed {args.fit_seed}; "
            f"acceptance statistics {args.stats}.",
            f"Speed factor of each fit (fit / profile; fit k comes before round k): "
            f"{', '.join(f'{s:.3f}' for s in speeds)}.",
            "",
        ]
    lines += [
        "| policy | class | real % | simulated % | gap |",
        "|---|---|---|---|---|",
    ]
    for pol, c in cmp.items():
        for cls, v in c["classes"].items():
            lines.append(
                f"| {pol} | {cls} ({v['requests']} req) | {v['real']:.1f} | {v['sim']:.1f} "
                f"| {v['gap']:+.1f} |"
            )
        o = c["overall"]
        lines.append(
            f"| {pol} | overall | {o['real']:.1f} | {o['sim']:.1f} | {o['sim'] - o['real']:+.1f} |"
        )
    lines += [
        "",
        "| policy | goodput real tok/s | simulated | gap | classes within | goodput within |",
        "|---|---|---|---|---|---|",
    ]
    for pol, c in cmp.items():
        g = c["goodput"]
        lines.append(
            f"| {pol} | {g['real']:.1f} | {g['sim']:.1f} | {100 * g['rel']:+.1f}% "
            f"| {'yes' if c['classes_ok'] else 'no'} | {'yes' if c['goodput_ok'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the runs and the report")
    ap.add_argument("--profile", help="CPU profile JSON (default: measured first)")
    ap.add_argument(
        "--stats",
        default=str(paths.DEFAULT_STATS),
        help="pair statistics for the simulator's acceptance model (default: the shipped "
        "pair's; benchmarks/pair_stats.py measures them over longer continuations)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="adaserve,spec-chain:4,ar")
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fit-seed", type=int, default=100)
    ap.add_argument("--fit-duration", type=float, default=15.0)
    ap.add_argument("--kv-cache-bytes", default="512M")
    ap.add_argument("--points", type=float, default=5.0, help="per-class attainment gap allowed")
    ap.add_argument("--goodput-rel", type=float, default=0.15, help="goodput gap allowed")
    ap.add_argument(
        "--reuse",
        help="DIR[,DIR...]: re-simulate the rounds these earlier runs stored (no real runs)",
    )
    ap.add_argument("--sim-args", default="", help="extra adaserve simulate options (one string)")
    ap.add_argument(
        "--window",
        type=float,
        default=4.0,
        help="seconds per factor of the speed traces measured from the real runs",
    )
    args = ap.parse_args()
    if args.rounds < 1 or args.duration <= 0 or args.fit_duration <= 0:
        ap.error("--rounds, --duration and --fit-duration must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exe = [sys.executable, "-m", "adaserve"]
    if args.reuse:
        return resimulate(args, out, log, exe)
    profile = Path(args.profile) if args.profile else out / "profile.json"
    if not args.profile:
        _run([*exe, "profile", "--out", str(profile), "--reps", "7"], log)
    common = _workload(vars(args))

    def fit(k: int) -> Path:
        fitted = out / f"fit{k}-profile.json"
        _run(
            [
                sys.executable, str(ROOT / "benchmarks" / "fit_host_overhead.py"),
                "--profile", str(profile), "--out", str(fitted),
                "--kv-cache-bytes", args.kv_cache_bytes, "--seed", str(args.fit_seed),
                "--duration", str(args.fit_duration),
                "--request-rate", str(args.request_rate),
            ],
            log,
        )  # fmt: skip
        speeds.append(json.loads(fitted.read_text())["speed_factor"])
        return fitted

    # fits bracket every round: round k's real runs lie between fit k and fit k+1, and
    # its workload is simulated with both (the machine can change speed within a round)
    real, sim, speeds, cond = [], [], [], []
    before = fit(1)
    for k in range(1, args.rounds + 1):
        _run([*exe, "bench", "serve", "--profile", str(profile), *common,
              "--out", str(out / f"round{k}-real")], log)  # fmt: skip
        after = fit(k + 1)
        real.append(_results(out / f"round{k}-real"))
        for side, fitted in (("before", before), ("after", after)):
            dest = out / f"round{k}-sim-{side}"
            sim.append(_simulate(args, log, exe, common, fitted, dest, *MEASURED))
            cond += conditioned(args, log, exe, common, out / f"round{k}-real", fitted, dest)
        print(
            f"round {k}: speed factor {speeds[-2]:.3f} before, {speeds[-1]:.3f} after", flush=True
        )
        before = after
    finish(args, out, real, sim, speeds, cond)


def conditioned(args, log, exe, common, real_dir: Path, fitted: Path, dest: Path) -> list:
    """Simulate a real round again with its measured speed trace (relative to
    ``fitted``): [(real result, simulated result)], empty when its timelines do not
    record the iterations' work."""
    trace = dest.parent / f"{dest.name}-trace.json"
    if not write_traces(real_dir, fitted, trace, args.window):
        return []
    cdest = dest.parent / f"{dest.name}-cond"
    extra = ("--selection-time", "none", "--speed-trace", str(trace))
    return [(_results(real_dir), _simulate(args, log, exe, common, fitted, cdest, *extra))]


def finish(
    args, out: Path, real: list, sim: list, speeds: list[float], cond: list | None = None
) -> None:
    """Judge and write the report; ``cond``: (real, simulated) results of the
    simulations conditioned on each real run's measured speed, when there are any."""
    cmp = compare(pool(real), pool(sim), args.points, args.goodput_rel)
    doc = {"args": vars(args), "speed_factors": speeds, "policies": cmp}
    md = report(cmp, speeds, args)
    if cond:
        ccmp = compare(
            pool([r for r, _ in cond]), pool([c for _, c in cond]), args.points, args.goodput_rel
        )
        doc["conditioned"] = ccmp
        md += (
            "\n## Conditioned on the measured speed\n\n"
            f"The same rounds simulated with each real run's speed trace ({len(cond)} "
            f"simulations; {args.window:g} s windows, measured / fitted iteration time): "
            "the machine's drift is then an input, and what is left is the simulator's "
            "own error.\n\n" + report(ccmp, [], args, header=False)
        )
    (out / "fidelity.json").write_text(json.dumps(doc, indent=1))
    (out / "fidelity.md").write_text(md)
    print(md)


def stored_rounds(run: Path) -> list[tuple[Path, list[Path]]]:
    """(real results, fitted profiles to simulate it with) of each round a run stored:
    bracketed runs fit before and after every round (``fit{k}-profile.json``), earlier
    ones only before it (``round{k}-profile.json``)."""
    rounds = []
    k = 1
    while (run / f"round{k}-real" / "result.json").is_file():
        fits = [run / f"fit{k}-profile.json", run / f"fit{k + 1}-profile.json"]
        if not all(f.is_file() for f in fits):
            fits = [run / f"round{k}-profile.json"]
        if not fits[0].is_file():
            sys.exit(f"fidelity: {run} has round {k} but no fit for it")
        rounds.append((run / f"round{k}-real", fits))
        k += 1
    if not rounds:
        sys.exit(f"fidelity: {run} holds no stored rounds")
    return rounds


def resimulate(args, out: Path, log: Path, exe: list[str]) -> None:
    """Pool the stored rounds of earlier runs, each re-simulated with its own workload
    options and fits (``--reuse``)."""
    real, sim, speeds, runs, cond = [], [], [], [], []
    rounds = 0
    for n, run in enumerate(Path(d) for d in args.reuse.split(",")):
        old = json.loads((run / "fidelity.json").read_text())["args"]
        common = _workload(old)
        runs.append(f"{run} ({old['policies']})")
        for k, (real_dir, fits) in enumerate(stored_rounds(run), 1):
            for j, fitted in enumerate(fits):
                real.append(_results(real_dir))  # once per simulation: rounds weigh alike
                speeds.append(json.loads(fitted.read_text())["speed_factor"])
                dest = out / f"run{n + 1}-round{k}-sim{j + 1}"
                sim.append(_simulate(args, log, exe, common, fitted, dest, *MEASURED))
                cond += conditioned(args, log, exe, common, real_dir, fitted, dest)
        rounds += k
        print(f"{run}: {k} rounds re-simulated", flush=True)
    args.rounds = rounds
    args.policies = "; ".join(runs)
    finish(args, out, real, sim, speeds, cond)


if __name__ == "__main__":
    main()
