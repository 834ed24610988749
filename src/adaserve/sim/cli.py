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
import inspect
import json
import math
import sys
from pathlib import Path

from adaserve.cli_args import int_at_least
from adaserve.errors import AdaServeError
from adaserve.resources import default_kv_budget


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's workload/output options plus the simulator's own."""
    from adaserve.bench import cli as bench_cli

    bench_cli.add_sweep_arguments(p)
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
        "their power_cap_w (sched/power.py; 0 = off)",
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


# ---------------------------------------------------------------------- models
def hardware_from_args(args):
    """(HardwareModel, info dict, Deployment | None) from ``--profile`` or ``--preset``."""
    from adaserve.sched.hardware import HardwareModel, unloaded_tpot_ms
    from adaserve.sim import presets

    if args.profile and args.preset:
        raise AdaServeError("give --profile or --preset, not both")
    if args.profile:
        try:
            raw = json.loads(Path(args.profile).read_text())
            hw = HardwareModel.from_dict(raw, source=str(args.profile))
            unloaded = unloaded_tpot_ms(raw)
        except (OSError, json.JSONDecodeError) as e:
            raise AdaServeError(f"cannot read profile {args.profile}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise AdaServeError(f"profile {args.profile} is malformed: {e}") from None
        has_draft = raw.get("draft", True) is not None and (
            "draft_step" in raw or "draft_step_ms" in raw
        )
        info = {
            "host_overhead": raw.get("host_overhead"),
            # the class targets' base, by the engine's definition (a profile rescaled to
            # another machine speed by benchmarks/fit_host_overhead.py records the
            # original's, which the engine resolved its targets with)
            "unloaded_tpot_ms": unloaded,
            "hardware": "profile",
            "profile": str(args.profile),
            "device": raw.get("device", "unknown"),
            "has_draft": has_draft,
            "params": (
                (raw.get("target") or {}).get("params"),
                (raw.get("draft") or {}).get("params"),
            ),
        }
        return hw, info, None
    name = args.preset or f"A100-80GB:{presets.DEFAULT_PAIR}"
    measured = None
    try:
        if presets.is_measured(name):
            base, measured = presets.measured_profile(name)
            dep = presets.deployment(base)
            hw = HardwareModel.from_dict(measured, source=f"measured:{base}")
        else:
            dep = presets.deployment(name)
            hw = dep.hardware_model()
    except ValueError as e:
        raise AdaServeError(str(e)) from None
    info = {
        "hardware": "roofline" if measured is None else "measured",
        "preset": dep.name + ("" if measured is None else presets.MEASURED_SUFFIX),
        "gpu": dep.gpu.name,
        "tp": dep.tp,
        "target": dep.target.name,
        "draft": dep.draft.name if dep.draft else None,
        "has_draft": dep.draft is not None,
        "kv_capacity_tokens": dep.kv_capacity_tokens(),
        "params": (dep.target.compute_params, dep.draft.compute_params if dep.draft else None),
    }
    if dep.target.name == "Llama-3.1-70B":
        info["roofline_vs_paper"] = presets.compare_with_paper(dep)
    if measured is not None:
        info["roofline_vs_measured"] = presets.compare_with_profile(dep, measured)
        info["device"] = measured.get("gpu") or measured.get("device")
    return hw, info, dep


def _acceptance_params(args, using_profile: bool):
    """AcceptanceParams from ``--stats`` / ``--accept`` / the shipped pair's stats."""
    from adaserve import paths
    from adaserve.sim.acceptance_params import AcceptanceParams

    try:
        if args.accept or args.topk_mass is not None:
            acc = [float(x) for x in (args.accept or "0.6").split(",") if x.strip()]
            p = AcceptanceParams.parametric(
                acc, args.topk_mass, 4, args.concentration, args.overconfidence
            )
            return p, None
        stats = args.stats
        if stats is None and using_profile and Path(paths.DEFAULT_STATS).is_file():
            stats = str(paths.DEFAULT_STATS)
        if stats:
            p = AcceptanceParams.from_stats(stats, args.concentration)
            if args.overconfidence != 1.0:
                from dataclasses import replace

                p = replace(p, overconfidence=args.overconfidence)
            return p, stats
        from adaserve.sim.presets import PRESET_TOP1_ACCEPTANCE

        top1 = 0.6 if using_profile else PRESET_TOP1_ACCEPTANCE
        p = AcceptanceParams.parametric(top1, None, 4, args.concentration, args.overconfidence)
        return p, None
    except ValueError as e:
        raise AdaServeError(f"acceptance model: {e}") from None


def acceptance_from_args(args, using_profile: bool):
    """AcceptanceParams from ``--stats`` / ``--accept`` / the shipped pair's stats, with
    ``--request-spread``; (params, stats path or None)."""
    from dataclasses import replace

    p, stats = _acceptance_params(args, using_profile)
    spread = getattr(args, "request_spread", 0.0) or 0.0
    if spread:
        try:
            p = replace(p, request_spread=float(spread))
        except ValueError as e:
            raise AdaServeError(f"--request-spread: {e}") from None
    if getattr(args, "flat_positions", False):
        p = replace(p, position_shift=())
    return p, stats


def _speed_traces(path) -> dict:
    """``--speed-trace``: {policy name or None (every policy): ((t_s, factor), ...)}."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise AdaServeError(f"--speed-trace: cannot read {path}: {e}") from None

    from adaserve.sim.loop import SimConfig

    def one(d, where: str) -> tuple[tuple[float, float], ...]:
        try:
            ts, fs = d["t_s"], d["factor"]
            pts = tuple((float(t), float(f)) for t, f in zip(ts, fs, strict=True))
        except (KeyError, TypeError, ValueError):
            raise AdaServeError(
                f"--speed-trace {path}: {where} needs equally long 't_s' and 'factor' lists"
            ) from None
        try:
            if not pts:
                raise ValueError("speed trace: no points")
            SimConfig(speed_trace=pts)  # its checks
        except ValueError as e:
            raise AdaServeError(f"--speed-trace {path}: {where}: {e}") from None
        return pts

    if isinstance(data, dict) and isinstance(data.get("policies"), dict):
        return {name: one(d, f"policy {name!r}") for name, d in data["policies"].items()}
    return {None: one(data, "the trace")}


def _default_kv_slots(hw, block_size: int = 16) -> int:
    """The engine's default pool: min(RAM/4, 4 GiB) over the per-slot KV bytes."""
    per_slot = hw.kv_bytes_target + hw.kv_bytes_draft
    if per_slot <= 0:
        return 1 << 20
    budget = default_kv_budget()
    return int(max(4, budget // (per_slot * block_size)) * block_size)


def _model_dir(args) -> Path | None:
    from adaserve import paths

    if args.model:
        return Path(args.model)
    if args.profile and paths.DEFAULT_TARGET.is_dir():
        return paths.DEFAULT_TARGET
    return None


class SimBackend:
    """The bench's backend interface (``workload``, ``run``, ``config``, ``policies``)
    over the simulator."""

    def __init__(self, args):
        from adaserve.bench import cli as bench_cli
        from adaserve.bench.energy import device_energy
        from adaserve.sched.power import PowerModel
        from adaserve.sim import presets
        from adaserve.sim.acceptance import AcceptanceModel
        from adaserve.sim.loop import SimConfig, Simulator
        from adaserve.sim.pricing import HostOverhead
        from adaserve.slo import DEFAULT_CLASSES

        if getattr(args, "base_url", None):
            raise AdaServeError("simulate does not take --base-url (use bench serve)")
        self.args = args
        self.hw, self.hw_info, self.dep = hardware_from_args(args)
        self.acc_params, self.stats_path = acceptance_from_args(args, self.dep is None)
        mode = args.slo_classes
        if mode == "auto":
            mode = "paper" if self.dep is not None else "engine"
        self.classes = presets.gpu_classes() if mode == "paper" else DEFAULT_CLASSES
        self.class_mode = mode
        mdir = _model_dir(args)
        self.tokenizer, self.vocab_size, max_len = None, None, args.max_model_len
        if mdir is not None and mdir.is_dir():
            from adaserve.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(mdir)
            cfgj = _read_json(mdir / "config.json")
            self.vocab_size = cfgj.get("vocab_size")
            max_len = max_len or cfgj.get("max_position_embeddings")
        if self.dep is not None:
            kv = self.dep.kv_capacity_tokens()
            ft, fd = self.dep.target.flops_per_token, self.dep.draft.flops_per_token
            wb = (float(self.dep.target.weight_bytes), float(self.dep.draft.weight_bytes))
        else:
            per_slot = self.hw.kv_bytes_target + self.hw.kv_bytes_draft
            kv = _default_kv_slots(self.hw)
            if args.kv_cache_bytes and per_slot > 0:
                kv = int(max(4, args.kv_cache_bytes // (per_slot * 16)) * 16)
            pt, pd = self.hw_info["params"]
            ft, fd = 2.0 * (pt or 0), 2.0 * (pd or 0)
            wb = (4.0 * (pt or 0), 4.0 * (pd or 0))
        self.kv_slots = args.kv_slots or kv
        host = args.host_overhead or self.hw_info.get("host_overhead")
        try:
            self.host = HostOverhead.parse(host) if host else None
        except (TypeError, ValueError) as e:
            raise AdaServeError(f"--host-overhead: {e}") from None
        self.cfg = SimConfig(
            host_overhead=self.host,
            max_num_seqs=args.max_num_seqs,
            kv_slots=self.kv_slots,
            max_model_len=max_len,
            selection_time=args.selection_time,
            has_draft=bool(self.hw_info["has_draft"]),
            admission=args.admission,
            retry_refused=bool(getattr(args, "retry_refused", False)),
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_cache_eviction=args.prefix_cache_eviction,
            classes=self.classes,
            seed=args.sim_seed,
            flops_per_token=(ft, fd),
            weight_bytes=wb,
        )
        self.speed_traces = _speed_traces(getattr(args, "speed_trace", None))
        unloaded = getattr(args, "unloaded_tpot_ms", None)
        if unloaded is None:
            unloaded = self.hw_info.get("unloaded_tpot_ms")
        if unloaded is not None and not (
            isinstance(unloaded, (int, float)) and unloaded > 0 and math.isfinite(unloaded)
        ):
            raise AdaServeError(
                "--unloaded-tpot-ms (or the profile's unloaded_tpot_ms) must be a positive number"
            )
        self.sim = Simulator(
            self.hw,
            AcceptanceModel(self.acc_params),
            self.cfg,
            seed_stats=self.stats_path,
            unloaded_tpot_ms=unloaded,
        )
        self.policies = bench_cli._policies(args.policies)
        if not self.cfg.has_draft:
            from adaserve.sched.registry import make_policy

            self.policies = [p for p in self.policies if not make_policy(p).uses_draft]
            if not self.policies:
                raise AdaServeError("the profile has no draft model: only 'ar'-type policies run")
        dev = args.energy_device
        if dev is None:
            dev = (
                ("a100" if "A100" in self.dep.gpu.name else "h100")
                if self.dep is not None
                else self.hw_info.get("device", "cpu")
            )
        self.energy = device_energy(dev, args.energy_pj_per_flop, args.energy_pj_per_byte)
        self._ft_fd = (ft, fd)
        kvb = self.hw.kv_bytes_target + self.hw.kv_bytes_draft
        if ft > 0 or fd > 0:  # the planners' power model: the report's energy model
            self.sim.power = PowerModel.of((ft, fd), wb, kvb, self.energy)
        self.policies = with_power_limits(
            self.policies,
            getattr(args, "power_cap_w", None),
            getattr(args, "energy_per_token_j", None),
        )
        self.replicas, self.routers = cluster_from_args(args)
        if self.replicas is not None:
            self.policies = [f"{p}@{r}" for p in self.policies for r in self.routers]
        self.stats_interval_s = getattr(args, "stats_interval_ms", 100.0) / 1000.0

    def workload(self, spec):
        from adaserve.bench.workload import build_workload

        return build_workload(spec, tokenizer=self.tokenizer, vocab_size=self.vocab_size)

    def run(self, spec, items, policy: str, progress: bool):
        from adaserve.bench import cli as bench_cli
        from adaserve.bench.metrics import summarize
        from adaserve.bench.runner import class_slos
        from adaserve.sched.registry import make_policy

        slos = class_slos(
            bench_cli._classes_of(spec, items),
            spec.slo_scale,
            unloaded_tpot_ms=self.sim.unloaded_tpot_ms(),
            classes=self.classes,
        )
        pressure = [(s.at_s, float(s.value)) for s in spec.shifts if s.kind == "kv-pressure"]
        for s in spec.shifts:
            if s.kind == "draft-noise":
                print(f"simulate: shift {s.describe()} is not simulated", file=sys.stderr)
        from dataclasses import replace

        trace = self.speed_traces.get(policy, self.speed_traces.get(None, ()))
        self.sim.cfg = replace(self.cfg, speed_trace=trace)
        if self.replicas is not None:
            from adaserve.cluster.routing import make_router
            from adaserve.sim.cluster import run_cluster

            pol, _, router = policy.rpartition("@")
            records, tl = run_cluster(
                self.sim,
                [make_policy(pol) for _ in range(self.replicas)],
                make_router(router, seed=spec.seed),
                items,
                slos,
                policy_name=policy,
                stats_interval_s=self.stats_interval_s,
                kv_pressure=pressure,
            )
        else:
            records, tl = self.sim.run(
                make_policy(policy),
                items,
                slos,
                policy_name=policy,
                kv_pressure=pressure,
                progress=progress,
            )
        strict = bench_cli._strict_class(spec, self.classes)
        extra = bench_cli._extra(
            tl, records, spec, strict, self.energy, self.args.convergence_window
        )
        keys = ("simulated", "sim_wall_s", "selection_time_s", "selection_share")
        for k in keys + ("replicas", "router", "requests_per_replica", "retries"):
            if k not in keys and k not in tl.info:
                continue
            extra[k] = tl.info.get(k)
        summary = summarize(
            records,
            tl.info["duration_s"],
            extra,
            flops_per_token=self._ft_fd,
            class_extra=bench_cli.class_energy(tl, records, self.energy),
        )
        return summary, records, tl, slos

    def config(self) -> dict:
        return {
            "mode": "simulated",
            "policies": self.policies,
            **{k: v for k, v in self.hw_info.items() if k != "params"},
            "hardware_source": self.hw.source,
            "acceptance": self.acc_params.as_dict(),
            "acceptance_stats": self.stats_path,
            "slo_classes": self.class_mode,
            "kv_slots": self.kv_slots,
            "max_num_seqs": self.cfg.max_num_seqs,
            "max_model_len": self.cfg.max_model_len,
            "admission": self.cfg.admission,
            "prefix_caching": self.cfg.enable_prefix_caching,
            "prefix_cache_eviction": self.cfg.prefix_cache_eviction,
            "selection_time": self.cfg.selection_time,
            "host_overhead_ms": list(self.host.as_tuple()) if self.host else None,
            "speed_trace": getattr(self.args, "speed_trace", None),
            "unloaded_tpot_ms": self.sim.unloaded_tpot_ms(),
            "energy_model": self.energy.as_dict(),
            **(
                {
                    "replicas": self.replicas,
                    "routers": self.routers,
                    "stats_interval_ms": self.stats_interval_s * 1000.0,
                }
                if self.replicas is not None
                else {}
            ),
        }


def cluster_from_args(args) -> tuple[int | None, list[str]]:
    """(replicas, routers) of ``--replicas`` / ``--router`` / ``--routers`` (None and
    [] without ``--replicas``); ``AdaServeError`` on bad values."""
    from adaserve.cluster.routing import make_router

    n = getattr(args, "replicas", None)
    one, many = getattr(args, "router", None), getattr(args, "routers", None)
    if n is None:
        if one or many:
            raise AdaServeError("--router / --routers need --replicas N")
        return None, []
    if n < 1:
        raise AdaServeError("--replicas must be at least 1")
    if one and many:
        raise AdaServeError("give --router or --routers, not both")
    names = [x.strip() for x in (many or one or "slo").split(",") if x.strip()]
    if not names:
        raise AdaServeError("--routers is empty")
    for r in names:
        try:
            make_router(r)
        except ValueError as e:
            raise AdaServeError(str(e)) from None
    iv = getattr(args, "stats_interval_ms", 100.0)
    if not (iv >= 0 and math.isfinite(iv)):
        raise AdaServeError("--stats-interval-ms must be >= 0")
    return n, list(dict.fromkeys(names))


BUDGETED = ("adaserve", "smartspec", "dyn-tree")


def with_power_limits(policies: list[str], cap_w, ept_j) -> list[str]:
    """``policies`` with ``:power_cap_w=X`` / ``:energy_per_token_j=Y`` appended to
    the budgeted ones (``--power-cap-w`` / ``--energy-per-token-j``; None = not given;
    a policy string that sets the key itself keeps its own)."""
    out = []
    for p in policies:
        head = p.partition(":")[0]
        if head in BUDGETED:
            for key, v in (("power_cap_w", cap_w), ("energy_per_token_j", ept_j)):
                if v is not None and f"{key}=" not in p:
                    if not (math.isfinite(v) and v >= 0):
                        raise AdaServeError(f"--{key.replace('_', '-')} must be >= 0")
                    p = f"{p}:{key}={float(v)!r}"
        out.append(p)
    return out


def _read_json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _with_backend(fn, args, backend) -> int:
    """Run a bench command (``run_serve`` / ``run_sweep``) on ``backend``."""
    from adaserve.bench import cli as bench_cli

    if "backend" in inspect.signature(fn).parameters:
        return fn(args, backend=backend)
    saved = bench_cli._backend
    bench_cli._backend = lambda _args: backend
    try:
        return fn(args)
    finally:
        bench_cli._backend = saved


def _print_presets() -> None:
    from adaserve.sim import presets

    for name in presets.preset_names(measured=False):
        dep = presets.deployment(name)
        hw = dep.hardware_model()
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
        return _with_backend(bench_cli.run_serve, args, backend)
    if args.out is None:
        args.out = str(_default_out("simulate-sweep"))
    return _with_backend(bench_cli.run_sweep, args, backend)


def _default_out(kind: str) -> Path:
    import time

    return Path("bench-results") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
