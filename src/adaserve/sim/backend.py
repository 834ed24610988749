"""``SimBackend``: the bench's backend interface (``policies``, ``workload``, ``run``,
``config``) over the simulator, so ``adaserve simulate`` runs every ``adaserve bench``
workload, metric and report (``bench/cli.py``'s ``run_serve`` / ``run_sweep``)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from adaserve.bench.extras import class_energy, classes_of, run_extra, strict_class
from adaserve.bench.options import parse_policies
from adaserve.errors import AdaServeError
from adaserve.sim.options import (
    acceptance_from_args,
    cluster_from_args,
    hardware_from_args,
    with_power_limits,
)
from adaserve.util.resources import default_kv_budget


class SimBackend:
    """The bench's backend interface (``workload``, ``run``, ``config``, ``policies``)
    over the simulator."""

    def __init__(self, args):
        from adaserve.core.slo import DEFAULT_CLASSES
        from adaserve.hardware.energy import device_energy
        from adaserve.hardware.power import PowerModel
        from adaserve.sim import presets
        from adaserve.sim.acceptance import AcceptanceModel
        from adaserve.sim.loop import SimConfig, Simulator
        from adaserve.sim.pricing import HostOverhead

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
            from adaserve.text.tokenizer import load_tokenizer

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
            admission_check=getattr(args, "admission_check", "auto"),
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
        self.policies = parse_policies(args.policies)
        if not self.cfg.has_draft:
            from adaserve.policies.registry import make_policy

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
        from adaserve.bench.metrics import summarize
        from adaserve.bench.slo_targets import class_slos
        from adaserve.policies.registry import make_policy

        slos = class_slos(
            classes_of(spec, items),
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
        strict = strict_class(spec, self.classes)
        extra = run_extra(tl, records, spec, strict, self.energy, self.args.convergence_window)
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
            class_extra=class_energy(tl, records, self.energy),
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
            "admission_check": self.cfg.admission_check,
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
    from adaserve.util import paths

    if args.model:
        return Path(args.model)
    if args.profile and paths.DEFAULT_TARGET.is_dir():
        return paths.DEFAULT_TARGET
    return None


def _read_json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}
