"""The options of ``adaserve bench serve`` / ``bench sweep`` (shared by ``adaserve
simulate``) and the workload spec they describe (docs/bench.md)."""

from __future__ import annotations

import argparse
import math

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
)
from adaserve.errors import AdaServeError
from adaserve.util.cli_args import byte_size, int_at_least

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


def parse_policies(s: str) -> list[str]:
    out = [p.strip() for p in s.split(",") if p.strip()]
    if not out:
        raise AdaServeError("--policies is empty")
    # spec-tree:DxW:N contains no comma; keep order, drop duplicates
    return list(dict.fromkeys(out))


def sweep_names(s: str) -> list[str]:
    names = list(SWEEPS) if s.strip() == "all" else [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in SWEEPS]
    if bad or not names:
        raise AdaServeError(f"unknown sweep {', '.join(bad) or s!r}; known: {', '.join(SWEEPS)}")
    return names
