"""The simulator's models and settings from ``adaserve simulate``'s options: the
hardware model (a preset or a profile), the acceptance model, the simulated cluster
and the budgeted policies' power limits."""

from __future__ import annotations

import json
import math
from pathlib import Path

from adaserve.errors import AdaServeError


# ---------------------------------------------------------------------- models
def hardware_from_args(args):
    """(HardwareModel, info dict, Deployment | None) from ``--profile`` or ``--preset``."""
    from adaserve.hardware.model import HardwareModel, unloaded_tpot_ms
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
    from adaserve.sim.acceptance_params import AcceptanceParams
    from adaserve.util import paths

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
