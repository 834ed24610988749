"""``adaserve bench serve`` and ``adaserve bench sweep`` (options: docs/bench.md)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from adaserve.bench.backends import backend_for
from adaserve.bench.capacity import annotate_sweep
from adaserve.bench.extras import strict_class
from adaserve.bench.options import (
    add_serve_arguments,
    add_sweep_arguments,
    spec_from_args,
    sweep_names,
)
from adaserve.bench.pooling import comparisons_of, pooled, repeat_lines
from adaserve.bench.replayed import replayed_line
from adaserve.bench.report import write_report
from adaserve.bench.tables import format_class_table
from adaserve.bench.workload_spec import WorkloadSpec, strict_share_mix
from adaserve.core.slo import DEFAULT_CLASSES
from adaserve.errors import AdaServeError

# the ``adaserve bench`` subcommands' entry points (``adaserve/cli.py``)
__all__ = ["add_serve_arguments", "add_sweep_arguments", "run_serve", "run_sweep"]


def _out_dir(args, kind: str) -> Path:
    if args.out:
        return Path(args.out)
    return Path("bench-results") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def _serve_once(backend, spec: WorkloadSpec, args, progress: bool):
    """All policies on the identical workload (one per seed of ``--seeds``); returns
    (result, records, timelines), the records and timelines of each policy's last run."""
    from dataclasses import replace

    seeds = getattr(args, "seeds", None) or [spec.seed]
    spec = replace(spec, seed=seeds[0])
    specs = [replace(spec, seed=s) for s in seeds]
    workloads = [backend.workload(sp) for sp in specs]
    if not all(workloads):
        raise AdaServeError("the workload is empty: raise --duration or --request-rate")
    results, records, timelines = {}, {}, {}
    slo_targets = {}
    pols = list(backend.policies)
    runs: dict[str, list] = {pol: [] for pol in pols}
    repeat = getattr(args, "repeat", 1)
    if not isinstance(repeat, int) or repeat < 1:
        raise AdaServeError("--repeat must be a positive integer")
    for rnd in range(repeat):  # each round starts one policy later: drift hits all alike
        for pol in pols[rnd % len(pols) :] + pols[: rnd % len(pols)]:
            for sp, items in zip(specs, workloads):
                summary, recs, tl, slos = backend.run(sp, items, pol, progress)
                runs[pol].append((summary, recs, sp.seed))
                records[pol] = recs
                if tl is not None:
                    timelines[pol] = tl.samples
                slo_targets = {
                    k: {"tpot_ms": v.tpot_ms, "ttft_ms": v.ttft_ms} for k, v in slos.items()
                }
    for pol in pols:
        results[pol] = runs[pol][0][0] if len(runs[pol]) == 1 else pooled(runs[pol])
    comparisons = comparisons_of(pols, runs)
    config = {
        **spec.to_dict(),
        **({"seeds": seeds} if len(seeds) > 1 else {}),
        **backend.config(),
        "num_requests": sum(len(items) for items in workloads),
        "slo_targets": slo_targets,
        "strict_class": strict_class(spec, getattr(backend, "classes", DEFAULT_CLASSES)),
        "convergence_window_s": args.convergence_window,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = {"config": config, "results": results}
    if comparisons is not None:
        out["comparisons"] = comparisons
    return out, records, timelines


def _provenance_lines(result: dict) -> str:
    """Where the targets came from, and each policy's stalls (passes over 3x the
    profile's prediction, by cause); '' when the run reports neither."""
    cfg = result.get("config") or {}
    lines = []
    t = cfg.get("targets")
    if t:
        lines.append(
            f"targets: unloaded TPOT {t['unloaded_tpot_ms']:.4g} ms from {t['targets_from']}; "
            f"profile {t['profile']} (measured {t.get('measured')}, {t.get('threads')} threads)"
        )
    elif cfg.get("unloaded_tpot_ms") is not None:
        lines.append(f"targets: unloaded TPOT {cfg['unloaded_tpot_ms']:.4g} ms")
    th = cfg.get("threads")
    if th:
        lines.append(f"threads: {th['threads']} ({th['source']}, {th['usable']} usable cores)")
    st = []
    for pol, sm in (result.get("results") or {}).items():
        o = sm.get("overall") or {}
        if "stalls" in o:
            why = ", ".join(f"{k} {v}" for k, v in sorted(o["stalls"].items()))
            st.append(f"{pol} {o.get('stalls_total', 0)}" + (f" ({why})" if why else ""))
    if st:
        lines.append("stalls (passes > 3x predicted): " + "; ".join(st))
    rp = [
        x
        for pol, sm in (result.get("results") or {}).items()
        if (x := replayed_line(pol, sm.get("overall") or {}))
    ]
    if rp:
        lines.append("TPOT replayed at the profile's prices, back to back (bench.replayed):")
        lines.extend("  " + x for x in rp)
    return "".join(x + "\n" for x in lines)


# ---------------------------------------------------------------------- commands
def run_serve(args, backend=None) -> int:
    """``bench serve``; ``backend`` (default: in-process or HTTP from ``args``) may be any
    object with ``policies``, ``workload(spec)``, ``run(spec, items, policy, progress)``
    and ``config()`` (the simulator passes its own)."""
    spec = spec_from_args(args)
    backend = backend or backend_for(args)
    result, records, timelines = _serve_once(backend, spec, args, not args.no_progress)
    out = _out_dir(args, "serve")
    write_report(out, result, "serve", timelines or None, records, plots=not args.no_plots)
    print(format_class_table(result))
    print(repeat_lines(result["results"], result.get("comparisons")), end="")
    print(_provenance_lines(result), end="")
    print(f"\nwrote {out}/result.json, summary.md and plots", file=sys.stderr)
    return 0


def run_sweep(args, backend=None) -> int:
    """``bench sweep`` (``backend`` as in ``run_serve``)."""
    from dataclasses import replace

    base = spec_from_args(args)
    names = sweep_names(args.sweep)
    backend = backend or backend_for(args)
    root = _out_dir(args, "sweep")
    progress = not args.no_progress
    for name in names:
        out = root if len(names) == 1 else root / name
        if name == "time-varying":
            spec = replace(base, class_peaks=True)
            result, records, timelines = _serve_once(backend, spec, args, progress)
            result["config"]["sweep"] = "time-varying"
            write_report(out, result, "serve", timelines or None, records, not args.no_plots)
            print(f"== time-varying ({out})\n" + format_class_table(result) + "\n")
            continue
        if name == "rate":
            values = args.rates
            specs = [replace(base, request_rate=v) for v in values]
        elif name == "strict-share":
            values = args.strict_shares
            specs = [replace(base, class_mix=strict_share_mix(base.class_mix, v)) for v in values]
        else:
            values = args.slo_scales
            specs = [replace(base, slo_scale=v) for v in values]
        points = []
        config = None
        for v, spec in zip(values, specs):
            if progress:
                print(f"[{name}] x = {v:g}", file=sys.stderr)
            result, _records, _tl = _serve_once(backend, spec, args, progress)
            point = {"x": v, "results": result["results"]}
            if "comparisons" in result:
                point["comparisons"] = result["comparisons"]
            points.append(point)
            per_run = repeat_lines(result["results"], result.get("comparisons"))
            if per_run:
                print(f"[{name}] x = {v:g}\n" + per_run, end="")
            config = config or result["config"]
        swept = {"rate": "request_rate", "strict-share": "class_mix", "slo-scale": "slo_scale"}
        config = {**(config or {}), swept[name]: "swept", "sweep": name, "values": list(values)}
        # the same code path for the engine, HTTP and the simulator (``simulate
        # --sweep``): capacity (rate sweeps) and the oracle's goodput share
        sweep_result = annotate_sweep({"config": config, "points": points})
        write_report(out, sweep_result, "sweep", plots=not args.no_plots)
        print(f"== {name} ({out})\n" + format_class_table(sweep_result) + "\n")
    print(f"wrote {root}", file=sys.stderr)
    return 0
