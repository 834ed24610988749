"""Prefix caching, measured: the session workloads with the cache on and off.

    .venv/bin/python benchmarks/bench_prefix_cache.py sim   [--seeds 1-3]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_prefix_cache.py cpu
    .venv/bin/python benchmarks/bench_prefix_cache.py peer  # needs `make bench-peer` once
    .venv/bin/python benchmarks/bench_prefix_cache.py eviction

``sim``: the simulator at GPU scale (A100-80GB, Llama-70B pair) on the multi-turn and
agent workloads (long shared prefixes), SLO capacity per policy with and without
caching, pooled over seeds. ``cpu``: the shipped pair on this CPU, in process: TTFT at
a low rate and SLO capacity of a rate sweep, cache on and off (the two sweeps
alternate, one rate at a time). ``peer``: ``adaserve serve`` against vLLM's CPU build
(prefix caching on, its default) over HTTP on the identical multi-turn workload.
``eviction``: LRU against the SLO-aware order in a pool too small for every prefix
(the simulator), strict-class TTFT attainment. Each writes ``result.json`` and prints
a table; ``docs/results/prefix-caching.md`` records the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GPU_MULTITURN = "multiturn:system=2000:user=50-300:ctx=8192:think=5"
GPU_AGENT = "agent:system=3000:turns=3-10:user=100-400:ctx=8192:think=1"
GPU_OUT = "64-256"
MIX = "interactive:0.5,chat:0.3,batch:0.2"
CPU_MIX = "interactive:0.5,chat:0.5"


def _run(argv: list[str], out: Path) -> dict:
    print("[prefix-cache] " + " ".join(argv), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True, cwd=ROOT)
    return json.loads((out / "result.json").read_text())


def _capacity(res: dict) -> dict[str, float | None]:
    return {p: c["capacity_rps"] for p, c in res["capacity"]["policies"].items()}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:g}"


def sim(args) -> dict:
    """SLO capacity at GPU scale, cache on and off, per workload and policy."""
    out: dict = {}
    for name, ds in (("multiturn", GPU_MULTITURN), ("agent", GPU_AGENT)):
        if name not in args.workloads.split(","):
            continue
        for cache in ("enable", "no-enable"):
            d = Path(args.out) / f"sim-{name}-{cache}"
            argv = [PY, "-m", "adaserve", "simulate", "--dataset", ds, "--output-len", GPU_OUT]
            argv += ["--class-mix", MIX, "--duration", str(args.duration), "--seeds", args.seeds]
            argv += ["--sweep", "rate", "--rates", args.sim_rates, "--policies", args.policies]
            argv += [f"--{cache}-prefix-caching", "--out", str(d), "--no-plots"]
            out[f"{name}/{cache}"] = _capacity(_run(argv, d))
    lines = ["| workload | policy | capacity, cache on (req/s) | cache off | on / off |"]
    lines.append("|---|---|---|---|---|")
    for name in args.workloads.split(","):
        on, off = out[f"{name}/enable"], out[f"{name}/no-enable"]
        for p in on:
            r = on[p] / off[p] if on[p] and off[p] else None
            lines.append(
                f"| {name} | {p} | {_fmt(on[p])} | {_fmt(off[p])} | "
                f"{'-' if r is None else f'{r:.2f}x'} |"
            )
    print("\n".join(lines))
    return {"capacity_rps": out, "table": lines}


def cpu(args) -> dict:
    """The shipped pair on this CPU: one rate at a time, cache on then off."""
    rows: dict = {"enable": {}, "no-enable": {}}
    for rate in args.cpu_rates.split(","):
        for cache in ("enable", "no-enable"):
            d = Path(args.out) / f"cpu-{cache}-{rate}"
            argv = [PY, "-m", "adaserve", "bench", "serve", "--dataset", "multiturn"]
            argv += ["--class-mix", CPU_MIX, "--request-rate", rate]
            argv += ["--duration", str(args.cpu_duration), "--seed", str(args.seed)]
            argv += ["--policies", "adaserve", f"--{cache}-prefix-caching", "--out", str(d)]
            argv += ["--no-plots", "--no-progress"]
            res = _run(argv, d)["results"]["adaserve"]
            o = res["overall"]
            strict = res["per_class"].get("interactive", {})
            rows[cache][rate] = {
                "attainment": o["attainment"],
                "strict_attainment": strict.get("attainment"),
                "ttft_p50_ms": o["ttft_ms"]["p50"],
                "ttft_p99_ms": o["ttft_ms"]["p99"],
                "tpot_p50_ms": o["tpot_ms"]["p50"],
                "goodput_tok_s": o["goodput_tok_s"],
            }

    def capacity(r: dict) -> float | None:
        ok = [
            float(x)
            for x, m in r.items()
            if m["attainment"] >= 0.9 and (m["strict_attainment"] or 0) >= 0.9
        ]
        return max(ok) if ok else None

    lines = ["| rate | cache | attainment | interactive | TTFT p50 | TTFT p99 | TPOT p50 |"]
    lines.append("|---|---|---|---|---|---|---|")
    for rate in args.cpu_rates.split(","):
        for cache in ("enable", "no-enable"):
            m = rows[cache][rate]
            lines.append(
                f"| {rate} | {'on' if cache == 'enable' else 'off'} | "
                f"{100 * m['attainment']:.1f}% | {100 * (m['strict_attainment'] or 0):.1f}% | "
                f"{m['ttft_p50_ms']:.0f} ms | {m['ttft_p99_ms']:.0f} ms | "
                f"{m['tpot_p50_ms']:.1f} ms |"
            )
    cap = {c: capacity(rows[c]) for c in rows}
    low = args.cpu_rates.split(",")[0]
    ratio = rows["no-enable"][low]["ttft_p50_ms"] / max(rows["enable"][low]["ttft_p50_ms"], 1e-9)
    lines += ["", f"TTFT p50 at {low} req/s: off / on = {ratio:.2f}x (goal >= 3x)"]
    lines.append(f"SLO capacity: on {_fmt(cap['enable'])}, off {_fmt(cap['no-enable'])} req/s")
    print("\n".join(lines))
    return {"rows": rows, "capacity_rps": cap, "ttft_p50_ratio": ratio, "table": lines}


def peer(args) -> dict:
    """adaserve against vLLM (prefix caching on in both) on the multi-turn workload."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import shutil

    from bench_peer import ASSETS, PEER_PY, _client, running_server

    from adaserve.bench.runner import measure_unloaded_tpot

    if not PEER_PY.exists():
        raise SystemExit(f"{PEER_PY} is missing: run `make bench-peer` once")
    res: dict = {}
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = Path(tmp) / "target", Path(tmp) / "draft"
        shutil.copytree(ASSETS / "target", target)
        shutil.copytree(ASSETS / "draft", draft)
        with running_server("adaserve-ar", out, target, draft) as url:
            unloaded = float(measure_unloaded_tpot(url, n=5))
        for name in ("vllm", "adaserve"):
            with running_server(name, out, target, draft) as url:
                mode = ["sweep", "--sweep", "rate", "--rates", args.cpu_rates]
                mode += ["--duration", str(args.cpu_duration), "--seed", str(args.seed)]
                mode += ["--dataset", "multiturn", "--class-mix", CPU_MIX]
                r = _client(url, name, mode, out / f"peer-{name}", unloaded, name != "vllm")
                res[name] = _capacity(r).get(name)
                res[f"{name}_points"] = {
                    str(p["x"]): p["results"][name]["overall"] for p in r["points"]
                }
    lines = [
        f"unloaded TPOT {unloaded:.2f} ms; SLO capacity: adaserve {_fmt(res['adaserve'])}, "
        f"vLLM {_fmt(res['vllm'])} req/s"
    ]
    for name in ("vllm", "adaserve"):
        for x, o in res[f"{name}_points"].items():
            lines.append(
                f"- {name} at {x} req/s: attainment {100 * o['attainment']:.1f}%, TTFT p50 "
                f"{o['ttft_ms']['p50']:.0f} ms, TPOT p50 {o['tpot_ms']['p50']:.1f} ms"
            )
    print("\n".join(lines))
    res["table"] = lines
    res["unloaded_tpot_ms"] = unloaded
    return res


def eviction(args) -> dict:
    """LRU against the SLO-aware order when the pool cannot hold every prefix."""
    out: dict = {}
    for order in ("lru", "slo"):
        d = Path(args.out) / f"evict-{order}"
        argv = [PY, "-m", "adaserve", "simulate", "--dataset", GPU_MULTITURN]
        argv += ["--output-len", GPU_OUT, "--class-mix", MIX, "--duration", str(args.duration)]
        argv += ["--seeds", args.seeds, "--sweep", "rate", "--rates", args.evict_rates]
        argv += ["--policies", "adaserve", "--kv-slots", str(args.evict_kv_slots)]
        argv += ["--prefix-cache-eviction", order, "--out", str(d), "--no-plots"]
        r = _run(argv, d)
        out[order] = {
            str(p["x"]): {
                "overall": p["results"]["adaserve"]["overall"]["attainment"],
                "interactive": p["results"]["adaserve"]["per_class"]["interactive"]["attainment"],
                "interactive_ttft_p50_ms": p["results"]["adaserve"]["per_class"]["interactive"][
                    "ttft_ms"
                ]["p50"],
            }
            for p in r["points"]
        }
        out[order]["capacity_rps"] = _capacity(r)["adaserve"]
    lines = ["| rate | order | attainment | interactive | interactive TTFT p50 |", "|---|---|---|---|---|"]  # fmt: skip
    for x in args.evict_rates.split(","):
        for order in ("lru", "slo"):
            m = out[order][str(float(x))] if str(float(x)) in out[order] else out[order][x]
            lines.append(
                f"| {x} | {order} | {100 * m['overall']:.1f}% | {100 * m['interactive']:.1f}% | "
                f"{m['interactive_ttft_p50_ms']:.0f} ms |"
            )
    print("\n".join(lines))
    out["table"] = lines
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["sim", "cpu", "peer", "eviction"])
    p.add_argument("--out", default="bench-results/prefix-cache")
    p.add_argument("--seeds", default="1-3")
    p.add_argument("--workloads", default="multiturn,agent", help="sim: which of multiturn,agent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=180.0, help="simulated seconds per point")
    p.add_argument("--sim-rates", default="0.2,0.3,0.5,1,1.5,2,3,4")
    p.add_argument("--policies", default="adaserve,ar-chunked,spec-chain:4,dyn-tree,smartspec")
    p.add_argument("--cpu-rates", default="1,2,3,4,6")
    p.add_argument("--cpu-duration", type=float, default=40.0)
    p.add_argument("--evict-rates", default="2,3,4")
    p.add_argument("--evict-kv-slots", type=int, default=60000)
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    res = {"sim": sim, "cpu": cpu, "peer": peer, "eviction": eviction}[args.what](args)
    (Path(args.out) / f"{args.what}.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
