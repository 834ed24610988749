"""``adaserve bench serve`` and ``adaserve bench sweep`` (options: docs/bench.md)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

from adaserve.bench.capacity import annotate_sweep
from adaserve.bench.energy import device_energy
from adaserve.bench.metrics import shift_convergence, summarize
from adaserve.bench.report import write_report
from adaserve.bench.rounds import compare, mean_ci
from adaserve.bench.runner import (
    EngineFactory,
    class_ranks,
    class_slos,
    measure_unloaded_tpot,
    run_http,
    run_in_process,
)
from adaserve.bench.tables import comparison_lines, format_class_table, rounds_lines
from adaserve.bench.workload import build_workload
from adaserve.bench.workload_spec import (
    DEFAULT_CLASS_MIX,
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    WorkloadError,
    WorkloadSpec,
    format_class_mix,
    parse_class_mix,
    parse_length_overrides,
    parse_shift,
    strict_share_mix,
)
from adaserve.cli_args import byte_size, int_at_least
from adaserve.errors import AdaServeError
from adaserve.slo import DEFAULT_CLASSES

DEFAULT_POLICIES = "adaserve,ar,spec-chain:4,spec-tree,smartspec,dyn-tree"
SWEEPS = ("rate", "strict-share", "slo-scale", "time-varying")


def _rate(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError("must be positive (or inf)")
    return v


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _seeds(s: str) -> list[int]:
    """ "1-12", "1,3,5" or "1-4,9" -> distinct seeds in order."""
    out: list[int] = []
    try:
        for part in (x.strip() for x in s.split(",")):
            if not part:
                continue
            lo, _, hi = part.partition("-")  # "-3" leaves lo empty: not a seed
            a, b = int(lo), int(hi or lo)
            if b < a or b - a >= 10_000:
                raise ValueError
            out += [k for k in range(a, b + 1) if k not in out]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seeds like 1-12 or 1,3,5 (non-negative, ranges ascending), got {s!r}"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one seed, got {s!r}")
    return out


# ---------------------------------------------------------------------- arguments
def _add_common(p: argparse.ArgumentParser, default_duration: float) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--seed", type=int, default=0, help="the whole workload is a function of it")
    w.add_argument(
        "--seeds",
        type=_seeds,
        default=None,
        metavar="LIST",
        help="run every policy on the workload of each seed (e.g. 1-12 or 1,3,5) and report "
        "figures pooled over all of them plus each run's attainment; replaces --seed. One "
        "workload is a small sample: policy comparisons need several",
    )
    w.add_argument("--request-rate", type=_rate, default=2.0, help="requests/s (inf: all at once)")
    w.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)"
    )
    w.add_argument("--duration", type=float, default=default_duration, help="seconds of arrivals")
    w.add_argument("--num-prompts", type=int, default=None, help="cap on the number of requests")
    w.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the policies N times, each round starting one policy later; report "
        "figures pooled over all runs plus each run's attainment, each figure's mean and "
        "95%% interval across runs and whether the first policy is separated from each "
        "other (a machine whose speed drifts within minutes makes one sequential run per "
        "policy unreliable)",
    )
    w.add_argument(
        "--class-mix",
        default=format_class_mix(DEFAULT_CLASS_MIX),
        help="CLASS:SHARE,... (default %(default)s)",
    )
    w.add_argument("--slo-scale", type=float, default=1.0, help="multiplies every TPOT target")
    w.add_argument(
        "--input-len",
        action="append",
        metavar="[CLASS=]DIST",
        help="prompt length: N, LO-HI or lognormal:MEDIAN:SIGMA[:CAP] (repeatable)",
    )
    w.add_argument("--output-len", action="append", metavar="[CLASS=]DIST", help="output length")
    w.add_argument(
        "--dataset",
        default="stdlib",
        help="stdlib (held-out stdlib code), random, humaneval (the HumanEval problems), "
        "a ShareGPT .json/.jsonl file, or a session workload whose prompts share prefixes: "
        "multiturn[:system=N:turns=LO-HI:user=LO-HI:think=S:ctx=N] (chat histories) or "
        "agent[:...] (tool loops); see docs/bench.md",
    )
    w.add_argument(
        "--trace",
        help="arrival trace: azure-conv or azure-code (the Azure LLM inference trace 2023, "
        "shipped), or a file (Azure trace CSV, or one time per line)",
    )
    w.add_argument(
        "--trace-lengths", action="store_true", help="take token lengths from the trace too"
    )
    w.add_argument(
        "--shift",
        action="append",
        metavar="T:CHANGE",
        help="at T s: a class mix, draft-noise:X, kv-pressure:F or rate:R (repeatable)",
    )
    w.add_argument(
        "--class-peaks", action="store_true", help="each class peaks at a different time"
    )

    e = p.add_argument_group("in-process engine")
    e.add_argument(
        "--policies", default=DEFAULT_POLICIES, help="comma-separated (default %(default)s)"
    )
    e.add_argument("--model", help="target checkpoint directory (default: shipped pair)")
    g = e.add_mutually_exclusive_group()
    g.add_argument("--draft", help="draft checkpoint directory")
    g.add_argument("--no-draft", action="store_true")
    e.add_argument("--device", default="cpu")
    e.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on CPU, the checkpoint's half precision on CUDA",
    )
    e.add_argument("--kv-cache-bytes", type=byte_size, default=None, help="e.g. 512M, 2GiB")
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--profile", help="hardware profile JSON (default: cached / measured)")
    e.add_argument("--admission", action="store_true", help="enable admission control")
    e.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="automatic prefix caching (default on; the simulator names blocks by the "
        "workload's prompt ids)",
    )
    e.add_argument("--prefix-cache-eviction", choices=["lru", "slo"], default="lru")

    h = p.add_argument_group("HTTP")
    h.add_argument("--base-url", help="benchmark a running OpenAI-compatible server instead")
    h.add_argument("--model-name", help="the 'model' field to send (default: from /v1/models)")
    h.add_argument("--api-key", default=None)
    h.add_argument(
        "--unloaded-tpot-ms", type=float, help="unloaded TPOT for the class targets (else measured)"
    )
    h.add_argument(
        "--concurrency", type=int_at_least(1), default=None, help="max requests in flight"
    )
    h.add_argument("--no-priority", action="store_true", help="do not send vLLM 'priority'")
    h.add_argument("--tokenizer", help="checkpoint dir whose tokenizer.json sizes the prompts")
    h.add_argument("--label", default="server", help="result key of the HTTP run")

    o = p.add_argument_group("measurement and output")
    o.add_argument("--energy-device", default=None, help="cpu, a100, h100 (default: --device)")
    o.add_argument("--energy-pj-per-flop", type=float, default=None)
    o.add_argument("--energy-pj-per-byte", type=float, default=None)
    o.add_argument("--convergence-window", type=float, default=5.0, help="seconds (rolling)")
    o.add_argument("--out", default=None, help="output directory (default bench-results/...)")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--no-plots", action="store_true")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p, 30.0)


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p, 20.0)
    s = p.add_argument_group("sweep")
    s.add_argument(
        "--sweep",
        default="rate",
        help=f"comma-separated of {', '.join(SWEEPS)} or 'all' (default %(default)s)",
    )
    s.add_argument("--rates", type=_floats, default=[0.5, 1.0, 2.0, 4.0])
    s.add_argument("--strict-shares", type=_floats, default=[0.1, 0.3, 0.5, 0.7, 0.9])
    s.add_argument("--slo-scales", type=_floats, default=[0.6, 0.8, 1.0, 1.2, 1.4, 1.6])


# ---------------------------------------------------------------------- helpers
def spec_from_args(args) -> WorkloadSpec:
    try:
        return WorkloadSpec(
            seed=args.seed,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            duration_s=None
            if math.isinf(args.request_rate) and args.num_prompts
            else args.duration,
            num_prompts=args.num_prompts,
            class_mix=parse_class_mix(args.class_mix),
            slo_scale=args.slo_scale,
            input_len=parse_length_overrides(args.input_len, DEFAULT_INPUT_LEN),
            output_len=parse_length_overrides(args.output_len, DEFAULT_OUTPUT_LEN),
            dataset=args.dataset,
            trace=args.trace,
            trace_lengths=args.trace_lengths,
            shifts=tuple(sorted((parse_shift(s) for s in args.shift or []), key=lambda s: s.at_s)),
            class_peaks=args.class_peaks,
        )
    except WorkloadError:
        raise
    except ValueError as e:
        raise WorkloadError(str(e)) from None


def _policies(s: str) -> list[str]:
    out = [p.strip() for p in s.split(",") if p.strip()]
    if not out:
        raise AdaServeError("--policies is empty")
    # spec-tree:DxW:N contains no comma; keep order, drop duplicates
    return list(dict.fromkeys(out))


def _out_dir(args, kind: str) -> Path:
    if args.out:
        return Path(args.out)
    return Path("bench-results") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def _strict_class(spec: WorkloadSpec, classes) -> str:
    names = [c for c, _ in spec.class_mix]
    ranks = {c.name: c.rank for c in classes}
    return min(names, key=lambda c: (ranks.get(c, 99), names.index(c)))


def _classes_of(spec: WorkloadSpec, items) -> list[str]:
    names = {c for c, _ in spec.class_mix} | {it.cls for it in items}
    for s in spec.shifts:
        if s.kind == "mix":
            names |= {c for c, _ in s.value}
    return sorted(names)


def _energy_model(args):
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


def _extra(tl, records, spec, strict: str, energy, window: float) -> dict:
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


class _InProcess:
    """Builds the engine once; runs one policy on one workload."""

    def __init__(self, args):
        from adaserve.config import EngineConfig

        self.args = args
        self.cfg = EngineConfig(
            model=args.model,
            draft=args.draft,
            no_draft=args.no_draft,
            policy="adaserve",
            device=args.device,
            dtype=args.dtype,
            kv_cache_bytes=args.kv_cache_bytes,
            max_num_seqs=args.max_num_seqs,
            profile=args.profile,
            admission=args.admission,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_cache_eviction=args.prefix_cache_eviction,
        )
        self.classes = self.cfg.classes
        self.factory = EngineFactory(self.cfg)
        self.policies = _policies(args.policies)
        from adaserve.sched.registry import check_servable

        for p in self.policies:  # before the models load
            check_servable(p)
        self.engine = self.factory(self.policies[0])
        self.energy = _energy_model(args)

    def workload(self, spec: WorkloadSpec):
        eng = self.engine
        return build_workload(spec, tokenizer=eng.tokenizer, vocab_size=eng.target.cfg.vocab_size)

    def run(self, spec: WorkloadSpec, items, policy: str, progress: bool):
        slos = class_slos(_classes_of(spec, items), spec.slo_scale, engine=self.engine)
        records, tl = run_in_process(self.factory, policy, items, spec, progress, slos=slos)
        strict = _strict_class(spec, self.classes)
        eng = self.engine
        summary = summarize(
            records,
            tl.info["duration_s"],
            _extra(tl, records, spec, strict, self.energy, self.args.convergence_window),
            flops_per_token=(eng.flops_per_token_target, eng.flops_per_token_draft),
            class_extra=class_energy(tl, records, self.energy),
        )
        return summary, records, tl, slos

    def config(self) -> dict:
        eng = self.engine
        return {
            "mode": "in-process",
            "policies": self.policies,
            "model": str(eng.model_dir),
            "draft": str(eng.draft_dir) if eng.draft_dir else None,
            "device": self.cfg.device,
            "dtype": str(eng.dtype).removeprefix("torch."),
            "kv_pool_bytes": eng.allocator.num_blocks * self.cfg.block_size * eng.kv_bytes_per_slot,
            "max_num_seqs": self.cfg.max_num_seqs,
            "prefix_caching": self.cfg.enable_prefix_caching,
            "admission": self.cfg.admission,
            "unloaded_tpot_ms": eng.unloaded_tpot_ms(),
            # where the class targets and the profile come from, and the threads
            "targets": eng.hw.provenance() if eng.hw is not None else None,
            "threads": eng.thread_plan.as_dict(),
            "energy_model": self.energy.as_dict(),
        }


class _Http:
    """Runs workloads against a server; class targets from the unloaded TPOT."""

    def __init__(self, args):
        from adaserve import paths
        from adaserve.tokenizer import load_tokenizer

        self.args = args
        self.policies = [args.label]
        self.classes = DEFAULT_CLASSES
        tok_dir = args.tokenizer or args.model
        if tok_dir is None and paths.DEFAULT_TARGET.is_dir():
            tok_dir = paths.DEFAULT_TARGET
        self.tokenizer = load_tokenizer(tok_dir) if tok_dir else None
        self.vocab_size = None
        if self.tokenizer is None and tok_dir:
            self.vocab_size = _vocab_of(tok_dir)
        self.unloaded = args.unloaded_tpot_ms
        if self.unloaded is None:
            self.unloaded = measure_unloaded_tpot(args.base_url, api_key=args.api_key)
        self.energy = None

    def workload(self, spec: WorkloadSpec):
        return build_workload(spec, tokenizer=self.tokenizer, vocab_size=self.vocab_size)

    def run(self, spec: WorkloadSpec, items, policy: str, progress: bool):
        slos = class_slos(_classes_of(spec, items), spec.slo_scale, unloaded_tpot_ms=self.unloaded)
        t0 = time.perf_counter()
        records = run_http(
            self.args.base_url,
            items,
            spec,
            self.args.concurrency,
            slos=slos,
            model=self.args.model_name,
            send_priority=not self.args.no_priority,
            ranks=class_ranks(DEFAULT_CLASSES),
            progress=progress,
            api_key=self.args.api_key,
        )
        wall = time.perf_counter() - t0
        ends = [r.finish_s for r in records if r.finish_s is not None]
        duration = max(ends) if ends else wall
        strict = _strict_class(spec, DEFAULT_CLASSES)
        extra = {"wall_s": wall}
        if spec.shifts:
            conv = shift_convergence(
                records,
                [s.at_s for s in spec.shifts],
                strict,
                duration,
                window_s=self.args.convergence_window,
            )
            extra["shifts"] = [
                {"change": s.change, "strict_class": strict, **c} for s, c in zip(spec.shifts, conv)
            ]
        return summarize(records, duration, extra), records, None, slos

    def config(self) -> dict:
        return {
            "mode": "http",
            "base_url": self.args.base_url,
            "policies": self.policies,
            "priority_sent": not self.args.no_priority,
            "concurrency": self.args.concurrency,
            "unloaded_tpot_ms": self.unloaded,
        }


def _vocab_of(path) -> int | None:
    import json

    try:
        return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return None


def _backend(args):
    return _Http(args) if args.base_url else _InProcess(args)


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
        results[pol] = runs[pol][0][0] if len(runs[pol]) == 1 else _pooled(runs[pol])
    comparisons = _comparisons(pols, runs)
    config = {
        **spec.to_dict(),
        **({"seeds": seeds} if len(seeds) > 1 else {}),
        **backend.config(),
        "num_requests": sum(len(items) for items in workloads),
        "slo_targets": slo_targets,
        "strict_class": _strict_class(spec, getattr(backend, "classes", DEFAULT_CLASSES)),
        "convergence_window_s": args.convergence_window,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = {"config": config, "results": results}
    if comparisons is not None:
        out["comparisons"] = comparisons
    return out, records, timelines


# figures compared across runs (``overall.rounds``, ``comparisons``)
ROUND_FIGURES = ("attainment", "tpot_attainment", "goodput_tok_s")


def _run_keys(runs: list[tuple[dict, list, int]]) -> list[dict]:
    """{"round", "seed"} of each run (``_serve_once``'s order: round by round, each
    round every seed once): the round is 1 + the earlier runs on the same seed."""
    seen: dict[int, int] = {}
    keys = []
    for _, _, seed in runs:
        seen[seed] = seen.get(seed, 0) + 1
        keys.append({"round": seen[seed], "seed": seed})
    return keys


def _rounds(runs: list[tuple[dict, list, int]]) -> dict:
    """``overall.rounds`` of one policy's runs: the mean and 95% interval across runs
    (``rounds.mean_ci``: ``{"mean", "ci95", "n"}``) of each of ``ROUND_FIGURES`` and
    of each class's attainment and TPOT attainment, with the runs' round and seed."""
    sums = [s for s, _, _ in runs]
    classes = sorted({c for s in sums for c in s["per_class"]})
    out: dict = {"n": len(sums), "runs": _run_keys(runs)}
    for k in ROUND_FIGURES:
        out[k] = mean_ci([s["overall"].get(k) for s in sums])
    for k in ("attainment", "tpot_attainment"):
        out[f"per_class_{k}"] = {
            c: mean_ci([s["per_class"].get(c, {}).get(k) for s in sums]) for c in classes
        }
    return out


def _comparisons(pols: list[str], runs: dict[str, list]) -> dict | None:
    """``result["comparisons"]``: the first policy (the one under test) against each
    other one on each of ``ROUND_FIGURES`` (``rounds.compare``: whether the 95%
    intervals across runs are apart, and the paired difference first - other over the
    runs of the same round and seed); None with fewer than two policies."""
    if len(pols) < 2:
        return None
    ref = pols[0]
    keys = _run_keys(runs[ref])
    against = {}
    for pol in pols[1:]:
        if _run_keys(runs[pol]) != keys:  # _serve_once runs every policy alike
            raise AssertionError(f"runs of {ref} and {pol} do not line up")
        against[pol] = {
            k: compare(
                [s["overall"].get(k) for s, _, _ in runs[ref]],
                [s["overall"].get(k) for s, _, _ in runs[pol]],
            )
            for k in ROUND_FIGURES
        }
    return {"reference": ref, "n": len(keys), "against": against}


def _pooled(runs: list[tuple[dict, list, int]]) -> dict:
    """One policy's runs (summary, records, workload seed) as one summary over all their
    requests (throughputs over the summed durations), with each run's figures under
    ``overall.repeats`` and their mean and 95% interval across runs under
    ``overall.rounds`` (``_rounds``)."""
    pooled = [r for _, recs, _ in runs for r in recs]
    out = summarize(
        pooled,
        sum(s["overall"]["duration_s"] for s, _, _ in runs),
        class_extra=_pooled_energy(runs),
    )
    stalls: dict[str, int] = {}
    for sm, _, _ in runs:
        for cause, n in (sm["overall"].get("stalls") or {}).items():
            stalls[cause] = stalls.get(cause, 0) + n
    if any("stalls" in sm["overall"] for sm, _, _ in runs):
        out["overall"]["stalls"] = stalls
        out["overall"]["stalls_total"] = sum(stalls.values())
    power = _pooled_power([s["overall"] for s, _, _ in runs])
    if power is not None:
        out["overall"]["power"] = power
    out["overall"]["repeats"] = [
        {
            "seed": seed,
            "attainment": s["overall"]["attainment"],
            "tpot_attainment": s["overall"]["tpot_attainment"],
            "goodput_tok_s": s["overall"]["goodput_tok_s"],
            "pass_speed_p50": (s["overall"].get("pass_speed") or {}).get("p50"),
            "per_class_attainment": {c: m["attainment"] for c, m in s["per_class"].items()},
            "per_class_tpot_attainment": {
                c: m["tpot_attainment"] for c, m in s["per_class"].items()
            },
        }
        for s, _, seed in runs
    ]
    out["overall"]["rounds"] = _rounds(runs)
    return out


def _pooled_energy(runs: list[tuple[dict, list, int]]) -> dict[str, dict]:
    """``class_energy`` of pooled runs: each class's energy summed over the runs, per
    output token of all their requests."""
    j: dict[str, float] = {}
    toks: dict[str, int] = {}
    for s, recs, _ in runs:
        for c, m in s["per_class"].items():
            if m.get("energy_j") is not None:
                j[c] = j.get(c, 0.0) + m["energy_j"]
        for r in recs:
            toks[r.cls] = toks.get(r.cls, 0) + r.output_tokens
    out = {
        c: {"energy_j": v, "energy_per_token_j": v / toks[c] if toks.get(c) else None}
        for c, v in j.items()
    }
    if j:
        n = sum(toks.values())
        out["overall"] = {"energy_per_token_j": sum(j.values()) / n if n else None}
    return out


def _pooled_power(overalls: list[dict]) -> dict | None:
    """``power_summary`` of pooled runs: means weighted by each run's busy time
    (``model_time_s``; equal weights without it), the highest maximum."""
    ps = [(o.get("power"), o.get("model_time_s") or 1.0) for o in overalls]
    ps = [(p, w) for p, w in ps if p]
    if not ps:
        return None
    out: dict = {}
    for kind in ("measured", "predicted"):
        xs = [(p[kind], w) for p, w in ps if p.get(kind) and p[kind].get("mean_w") is not None]
        if not xs:
            out[kind] = None
            continue
        out[kind] = {
            "mean_w": sum(x["mean_w"] * w for x, w in xs) / sum(w for _, w in xs),
            "max_w": max(x["max_w"] for x, _ in xs),
        }
    return out


def _repeat_lines(results: dict, comparisons: dict | None = None) -> str:
    """Per-run attainment of each policy when runs were repeated, their mean and 95%
    interval across runs and the first policy against each other one (``comparisons``,
    ``_comparisons``); '' without repeats."""
    lines = []
    for pol, s in results.items():
        reps = s["overall"].get("repeats")
        if reps:
            att = " / ".join(f"{100 * r['attainment']:.1f}" for r in reps)
            tpot = " / ".join(
                "-" if r.get("tpot_attainment") is None else f"{100 * r['tpot_attainment']:.1f}"
                for r in reps
            )
            lines.append(f"  {pol}: attainment per run {att} % (TPOT only {tpot} %)")
            speed = [r.get("pass_speed_p50") for r in reps]
            if any(v is not None for v in speed):
                per = " / ".join("-" if v is None else f"{v:.2f}" for v in speed)
                lines.append(f"  {pol}: passes / profile per run (median) {per}")
    if not lines:
        return ""
    out = "runs (in-order; pooled figures above):\n" + "\n".join(lines) + "\n"
    across = rounds_lines(results)
    if across:
        out += "across runs (mean ± half the 95% interval):\n" + "\n".join(across) + "\n"
    pairs = comparison_lines(comparisons)
    if pairs:
        out += (
            f"{comparisons['reference']} against each policy (paired over the runs of the "
            "same round and seed; 95% intervals):\n" + "\n".join(pairs) + "\n"
        )
    return out


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
    return "".join(x + "\n" for x in lines)


# ---------------------------------------------------------------------- commands
def run_serve(args, backend=None) -> int:
    """``bench serve``; ``backend`` (default: in-process or HTTP from ``args``) may be any
    object with ``policies``, ``workload(spec)``, ``run(spec, items, policy, progress)``
    and ``config()`` (the simulator passes its own)."""
    spec = spec_from_args(args)
    backend = backend or _backend(args)
    result, records, timelines = _serve_once(backend, spec, args, not args.no_progress)
    out = _out_dir(args, "serve")
    write_report(out, result, "serve", timelines or None, records, plots=not args.no_plots)
    print(format_class_table(result))
    print(_repeat_lines(result["results"], result.get("comparisons")), end="")
    print(_provenance_lines(result), end="")
    print(f"\nwrote {out}/result.json, summary.md and plots", file=sys.stderr)
    return 0


def _sweep_names(s: str) -> list[str]:
    names = list(SWEEPS) if s.strip() == "all" else [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in SWEEPS]
    if bad or not names:
        raise AdaServeError(f"unknown sweep {', '.join(bad) or s!r}; known: {', '.join(SWEEPS)}")
    return names


def run_sweep(args, backend=None) -> int:
    """``bench sweep`` (``backend`` as in ``run_serve``)."""
    from dataclasses import replace

    base = spec_from_args(args)
    names = _sweep_names(args.sweep)
    backend = backend or _backend(args)
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
            per_run = _repeat_lines(result["results"], result.get("comparisons"))
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
