"""``adaserve simulate``: the benchmark's workloads, metrics and report on a simulator.

Takes every ``adaserve bench`` workload and output option (shared argument code) plus
the hardware and acceptance models::

    adaserve simulate --preset A100-80GB:llama-70b --request-rate 4 --duration 300
    adaserve simulate --profile cpu_profile.json --stats pair_stats.json --policies adaserve,ar
    adaserve simulate --preset H100 --sweep all --rates 2,4,6,8

Without ``--sweep`` it is ``bench serve``; with it, ``bench sweep``. See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from adaserve.bench.options import add_sweep_arguments
from adaserve.core.config import ADMISSION_CHECKS
from adaserve.util.cli_args import int_at_least


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's workload/output options plus the simulator's own."""
    add_sweep_arguments(p)
    p.set_defaults(sweep=None, duration=30.0)
    s = p.add_argument_group("simulator")
    s.add_argument(
        "--preset",
        default=None,
        help="roofline deployment GPU[:PAIR] (GPU: A100-80GB, H100, H200; PAIR: llama-70b, "
        "qwen-32b); default A100-80GB:llama-70b unless --profile is given",
    )
    s.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    s.add_argument(
        "--stats",
        default=None,
        help="pair statistics JSON for the acceptance model (default with --profile: the "
        "shipped pair's, when present)",
    )
    s.add_argument(
        "--accept",
        default=None,
        help="parametric top-1 acceptance, one value or one per depth (e.g. 0.7,0.75,0.8)",
    )
    s.add_argument(
        "--topk-mass", type=float, default=None, help="parametric P(target token in draft top-4)"
    )
    s.add_argument(
        "--concentration",
        type=float,
        default=2.0,
        help="Beta concentration of the draft's per-node confidence (default %(default)s)",
    )
    s.add_argument(
        "--overconfidence",
        type=float,
        default=1.0,
        help="draft q = confidence sharpened by this exponent (1 = calibrated draft)",
    )
    s.add_argument(
        "--request-spread",
        type=float,
        default=0.0,
        help="persistent per-request difficulty: standard deviation of each request's "
        "share of easy positions, as a fraction of the largest possible (0-1; default 0, "
        "every request alike; 0.8-0.9 matches the shipped pair's spread on the engine)",
    )
    s.add_argument(
        "--flat-positions",
        action="store_true",
        help="ignore the stats' agreement_by_position: acceptance the same at every output "
        "position (default: it follows the measured agreement along the output)",
    )
    s.add_argument(
        "--speed-trace",
        metavar="FILE",
        help='replay a measured machine speed: JSON {"t_s": [...], "factor": [...]} (from '
        't_s on, iteration times are multiplied by factor) or {"policies": {NAME: '
        "{...}}} per policy (benchmarks/fidelity.py writes them from real runs)",
    )
    s.add_argument(
        "--selection-time",
        choices=["none", "measured"],
        default="none",
        help="add the policy's measured decision time to each iteration (default none)",
    )
    s.add_argument(
        "--admission-check",
        choices=ADMISSION_CHECKS,
        default="auto",
        help="with --admission: how a request's TPOT is judged, by the policy's planner, "
        "by the measured class paces, or auto (the default: the planner, and the paces too "
        "where the pass cost is steep, as on a CPU)",
    )
    s.add_argument(
        "--retry-refused",
        action="store_true",
        help="with --admission: a refused client tries once more after its Retry-After "
        "(the run reports how many retries were admitted)",
    )
    s.add_argument(
        "--slo-classes",
        choices=["auto", "paper", "engine"],
        default="auto",
        help="paper: strict 1.2x unloaded, chat 50 ms, batch 150 ms; engine: the engine's "
        "multiples of the unloaded TPOT; auto: paper for presets, engine for profiles",
    )
    s.add_argument(
        "--host-overhead",
        default=None,
        metavar="A[,B,C,D,E,F]",
        help="engine host ms per iteration: A + B/request + C/speculating request + "
        "D/(speculating request x depth) + E/drafted + F/verified candidate (default: the "
        "profile's 'host_overhead', else 0)",
    )
    s.add_argument("--kv-slots", type=int_at_least(1), default=None, help="KV pool in token slots")
    s.add_argument(
        "--max-model-len", type=int_at_least(2), default=None, help="context limit (tokens)"
    )
    s.add_argument("--sim-seed", type=int, default=0, help="seed of the acceptance sampling")
    s.add_argument(
        "--power-cap-w",
        type=float,
        default=None,
        help="power cap (W, the whole deployment) of the budgeted policies' plans: sets "
        "their power_cap_w (hardware/power.py; 0 = off)",
    )
    s.add_argument(
        "--energy-per-token-j",
        type=float,
        default=None,
        help="energy budget (J) per expected accepted token of a planned pass: sets the "
        "budgeted policies' energy_per_token_j (0 = off)",
    )
    c = p.add_argument_group("cluster (simulated replicas behind a router, sim/cluster.py)")
    c.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="simulate N replicas sharing the arrival stream (default: one engine, no router)",
    )
    c.add_argument(
        "--router",
        default=None,
        help="the router with --replicas: slo (SLO headroom, then class-aware balancing; "
        "options slo:balance=class|slack:margin=M), p2c (power of two choices) "
        "or rr (round robin); default slo",
    )
    c.add_argument(
        "--routers",
        default=None,
        metavar="R1,R2,...",
        help="compare routers side by side with --replicas (each policy runs under each; "
        "rows are POLICY@ROUTER)",
    )
    c.add_argument(
        "--stats-interval-ms",
        type=float,
        default=100.0,
        help="how often replicas report their stats to the router (simulated ms; 0 = at "
        "every arrival)",
    )


def _print_presets() -> None:
    from adaserve.sim import presets

    for name in presets.preset_names(measured=False):
        dep = presets.deployment(name)
        hw = dep.hardware_model()
        assert dep.draft is not None  # every preset is a pair
        print(
            f"{name:24s} {dep.tp}x{dep.gpu.name:10s} {dep.target.name} + {dep.draft.name}: "
            f"unloaded TPOT {hw.unloaded_tpot_ms():.1f} ms, verify 128/512/1024 tokens "
            f"{float(dep.verify_ms(128)):.0f}/{float(dep.verify_ms(512)):.0f}/"
            f"{float(dep.verify_ms(1024)):.0f} ms, draft step {float(dep.draft_step_ms(1)):.1f} ms, "
            f"KV {dep.kv_capacity_tokens()} tokens"
        )
    dep = presets.deployment("A100-80GB:llama-70b")
    print("\nA100-80GB:llama-70b against the reference experiment's profile:")
    for r in presets.compare_with_paper(dep):
        print(
            f"  {str(r['tokens']):>10}: paper {r['paper_ms']:6.1f} ms, "
            f"roofline {r['roofline_ms']:6.1f} ms ({100 * r['error']:+.0f}%)"
        )
    for m in presets.MEASURED:
        name = m + presets.MEASURED_SUFFIX
        base, prof = presets.measured_profile(name)
        print(
            f"\n{name}: the engine measured on {prof.get('gpu') or prof['device']} "
            f"({prof['dtype']}), against the roofline of {base}:"
        )
        for r in presets.compare_with_profile(presets.deployment(base), prof):
            print(
                f"  {str(r['tokens']):>10}: measured {r['measured_ms']:6.1f} ms, "
                f"roofline {r['roofline_ms']:6.1f} ms ({100 * r['error']:+.0f}%)"
            )


def run(args) -> int:
    """Entry point of ``adaserve simulate``."""
    from adaserve.bench import cli as bench_cli
    from adaserve.sim.backend import SimBackend

    if args.list_presets:
        _print_presets()
        return 0
    backend = SimBackend(args)
    if backend.hw_info.get("roofline_vs_paper"):
        rows = backend.hw_info["roofline_vs_paper"]
        txt = ", ".join(
            f"{r['tokens']}: {r['roofline_ms']:.0f} vs {r['paper_ms']:.0f} ms" for r in rows
        )
        print(f"roofline {backend.hw_info['preset']} (vs reference profile) {txt}", file=sys.stderr)
    if backend.hw_info.get("roofline_vs_measured"):
        rows = backend.hw_info["roofline_vs_measured"]
        txt = ", ".join(
            f"{r['tokens']}: {r['measured_ms']:.1f} vs roofline {r['roofline_ms']:.1f} ms"
            for r in rows
        )
        print(f"measured {backend.hw_info['preset']} {txt}", file=sys.stderr)
    if args.sweep is None:
        if args.out is None:
            args.out = str(_default_out("simulate"))
        return bench_cli.run_serve(args, backend=backend)
    if args.out is None:
        args.out = str(_default_out("simulate-sweep"))
    return bench_cli.run_sweep(args, backend=backend)


def _default_out(kind: str) -> Path:
    import time

    return Path("bench-results") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
