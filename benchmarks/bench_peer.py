"""Peer comparison: adaserve against vLLM's CPU build, same checkpoint, same workload.

    make bench-peer                     # sets up .venv-peer, then runs this script
    .venv/bin/python benchmarks/bench_peer.py [--rates 2,4,6] [--duration 20] [--seed 0]

One server at a time on loopback (each gets the whole machine):

* ``vllm``            vLLM plain (FCFS);
* ``vllm-priority``   vLLM with ``--scheduling-policy priority``; our classes map to
                      vLLM priorities by rank (interactive 0, chat 1, batch 2; lower is
                      served first);
* ``vllm-draft-k3``   priority + speculative decoding with the shipped draft, K = 3;
* ``vllm-draft-k5``   the same with K = 5;
* ``vllm-ngram``      priority + n-gram (prompt lookup) speculation, K = 3;
* ``adaserve``        ``adaserve serve --policy adaserve``;
* ``adaserve-ar``     ``adaserve serve --policy ar`` (plain autoregressive).

Every server gets ``adaserve bench sweep --sweep rate --base-url`` with the identical
workload (same seed, arrivals and prompts) and identical SLO targets, derived from one
unloaded TPOT measured first against ``adaserve-ar`` (so the targets do not depend on
which server is measured). The client sends the SLO in our form (``slo``,
``slo_class``) and, to the priority-scheduling servers, as vLLM's ``priority``; a vLLM
server without priority scheduling rejects a non-zero ``priority``, so plain ``vllm``
gets none. vLLM's own benchmark client (``vllm.benchmarks.serve``, completions backend)
is also run once against ``adaserve serve`` to show that a peer's tool drives our
server unchanged. Output: ``<out>/summary.md`` (side by side), ``result.json``, plots,
per-server logs, and the environment's versions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from adaserve.bench.report import write_report
from adaserve.bench.runner import measure_unloaded_tpot

ROOT = Path(__file__).resolve().parents[1]
PEER_PY = ROOT / ".venv-peer" / "bin" / "python"
OUR_PY = Path(sys.executable)
ASSETS = ROOT / "src" / "adaserve" / "assets"
MODEL_NAME = "adaserve-default"

CONFIGS = (
    "vllm",
    "vllm-priority",
    "vllm-draft-k3",
    "vllm-draft-k5",
    "vllm-ngram",
    "adaserve",
    "adaserve-ar",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_cmd(name: str, port: int, target: Path, draft: Path) -> tuple[list[str], dict]:
    """(argv, extra environment) that starts server ``name`` on ``port``."""
    if name.startswith("adaserve"):
        policy = "ar" if name == "adaserve-ar" else "adaserve"
        argv = [str(OUR_PY), "-m", "adaserve", "serve", "--policy", policy, "--port", str(port)]
        argv += ["--served-model-name", MODEL_NAME, "--log-level", "warning"]
        return argv, {}
    argv = [str(PEER_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    argv += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    # float32, as our engine computes; 2048 context as the shipped config says
    argv += ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "64"]
    if name != "vllm":
        argv += ["--scheduling-policy", "priority"]
    if name.startswith("vllm-draft-k"):
        k = int(name.removeprefix("vllm-draft-k"))
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
        argv += ["--speculative-config", json.dumps(spec)]
    elif name == "vllm-ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
        argv += ["--speculative-config", json.dumps(spec)]
    env = {
        # the whole 2-core machine for the engine; KV pool in GiB
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 2) - 1}",
        "OMP_NUM_THREADS": str(os.cpu_count() or 2),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    return argv, env


@contextlib.contextmanager
def running_server(name: str, out: Path, target: Path, draft: Path, timeout_s: float = 900):
    """Start server ``name``, wait until /v1/models answers, yield its base URL, stop it."""
    port = _free_port()
    argv, extra = _server_cmd(name, port, target, draft)
    log = (out / f"{name}.server.log").open("w")
    env = {**os.environ, **extra}
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{name} did not come up in {timeout_s:.0f}s; see {log.name}")
            time.sleep(1.0)
        print(f"[peer] {name} up in {time.monotonic() - t0:.0f}s at {url}", file=sys.stderr)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _client(url: str, label: str, mode: list[str], out_dir: Path, unloaded: float, priority: bool):
    """Run ``adaserve bench <mode> --base-url url`` with the shared SLO targets; returns
    its result.json."""
    argv = [str(OUR_PY), "-m", "adaserve", "bench", *mode]
    argv += ["--base-url", url, "--label", label, "--unloaded-tpot-ms", f"{unloaded:.3f}"]
    argv += ["--out", str(out_dir), "--no-plots", "--no-progress"]
    if not priority:
        argv.append("--no-priority")
    subprocess.run(argv, check=True, cwd=ROOT)
    return json.loads((out_dir / "result.json").read_text())


def _bench(url: str, label: str, args, out: Path, unloaded: float, priority: bool) -> dict:
    """The rate sweep on the shared workload."""
    mode = ["sweep", "--sweep", "rate", "--rates", args.rates]
    mode += ["--duration", str(args.duration), "--seed", str(args.seed)]
    return _client(url, label, mode, out / label, unloaded, priority)


def _saturate(url: str, label: str, args, out: Path, unloaded: float, priority: bool) -> dict:
    """Capacity: ``--saturate-prompts`` requests all at once (rate inf), overall metrics."""
    mode = ["serve", "--request-rate", "inf", "--num-prompts", str(args.saturate_prompts)]
    mode += ["--seed", str(args.seed)]
    res = _client(url, label, mode, out / f"{label}-saturated", unloaded, priority)
    return res["results"][label]["overall"]


def _vllm_client(url: str, out: Path, args) -> dict | None:
    """vLLM's own ``bench serve`` (completions backend) against an adaserve server."""
    script = f"""
import argparse, json, sys
from vllm.benchmarks import serve
if __name__ == "__main__":
    p = argparse.ArgumentParser()
    serve.add_cli_args(p)
    a = p.parse_args([
        "--backend", "openai", "--base-url", {url!r}, "--endpoint", "/v1/completions",
        "--model", {MODEL_NAME!r}, "--tokenizer", {str(ASSETS / "target")!r},
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
        "--num-prompts", "{args.vllm_client_prompts}", "--request-rate", "{args.vllm_client_rate}",
        "--seed", "{args.seed}", "--ignore-eos", "--save-result",
        "--result-dir", {str(out)!r}, "--result-filename", "vllm_client_on_adaserve.json",
    ])
    serve.main(a)
"""
    log = out / "vllm_client_on_adaserve.log"
    with log.open("w") as f:
        rc = subprocess.run(
            [str(PEER_PY), "-c", script], stdout=f, stderr=subprocess.STDOUT
        ).returncode
    path = out / "vllm_client_on_adaserve.json"
    if rc != 0 or not path.is_file():
        print(f"[peer] vLLM's bench client failed (rc {rc}); see {log}", file=sys.stderr)
        return None
    return json.loads(path.read_text())


def _versions() -> dict:
    def pkg(py: Path, name: str) -> str | None:
        r = subprocess.run(
            [str(py), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
            capture_output=True,
            text=True,
        )
        return r.stdout.strip() or None

    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "adaserve": pkg(OUR_PY, "adaserve"),
        "torch (ours)": pkg(OUR_PY, "torch"),
        "vllm-cpu": pkg(PEER_PY, "vllm-cpu") or pkg(PEER_PY, "vllm"),
        "torch (vllm env)": pkg(PEER_PY, "torch"),
    }


def _merge(per_server: dict[str, dict]) -> dict:
    """One sweep result whose 'policies' are the servers."""
    points: dict[float, dict] = {}
    config = None
    for _name, res in per_server.items():
        config = config or dict(res["config"])
        for pt in res["points"]:
            points.setdefault(pt["x"], {}).update(pt["results"])
    config = {**(config or {}), "policies": list(per_server), "base_url": "(one server each)"}
    config["mode"] = "http (peer comparison)"
    return {"config": config, "points": [{"x": x, "results": r} for x, r in sorted(points.items())]}


def _goal_lines(merged: dict) -> list[str]:
    """The issue's goals, evaluated on what was measured."""
    lines = []
    vllm_names = [n for n in merged["config"]["policies"] if n.startswith("vllm")]

    def ov(res: dict, name: str, key: str) -> float:
        return float(((res.get(name) or {}).get("overall") or {}).get(key) or 0.0)

    for pt in merged["points"]:
        res = pt["results"]
        if not vllm_names or "adaserve" not in res:
            continue
        best = max(vllm_names, key=lambda n: ov(res, n, "goodput_tok_s"))
        att = ov(res, best, "attainment")
        ratio = ov(res, "adaserve", "goodput_tok_s") / max(ov(res, best, "goodput_tok_s"), 1e-9)
        strict = (res["adaserve"].get("per_class") or {}).get("interactive", {}).get("attainment")
        lines.append(
            f"- rate {pt['x']:g} req/s: best vLLM configuration by goodput = {best} "
            f"(attainment {100 * att:.1f}%, goodput {ov(res, best, 'goodput_tok_s'):.0f} tok/s); "
            f"adaserve goodput {ov(res, 'adaserve', 'goodput_tok_s'):.0f} tok/s = "
            f"**{ratio:.2f}x**, interactive attainment "
            + ("-" if strict is None else f"{100 * strict:.1f}%")
            + ("" if att < 0.9 else " (vLLM still >= 90% here: outside the goal's range)")
        )
    for pt in merged["points"]:
        res = pt["results"]
        if "adaserve-ar" in res and "vllm" in res:
            a, v = ov(res, "adaserve-ar", "throughput_tok_s"), ov(res, "vllm", "throughput_tok_s")
            lines.append(
                f"- rate {pt['x']:g}: output throughput adaserve-ar {a:.0f} vs vllm {v:.0f} "
                f"tok/s = **{a / max(v, 1e-9):.2f}x**"
            )
    return lines


def _capacity_only(args) -> int:
    """Plain vLLM and ``adaserve serve --policy ar`` at capacity, side by side."""
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    if not PEER_PY.exists():
        sys.exit(f"{PEER_PY} is missing: run `make bench-peer` (it creates .venv-peer)")
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = Path(tmp) / "target", Path(tmp) / "draft"
        shutil.copytree(ASSETS / "target", target)
        shutil.copytree(ASSETS / "draft", draft)
        for name in ("adaserve-ar", "vllm"):
            with running_server(name, out, target, draft) as url:
                res[name] = _saturate(url, name, args, out, 10.0, priority=False)
    a, v = res["adaserve-ar"], res["vllm"]
    lines = [
        f"# Capacity: {args.saturate_prompts} requests at once (seed {args.seed})",
        "",
        "| server | output tok/s | TTFT p50 ms | TPOT p50 ms | duration s |",
        "|---|---|---|---|---|",
    ]
    for name, r in res.items():
        lines.append(
            f"| {name} | {r['throughput_tok_s']:.0f} | {r['ttft_ms']['p50']:.0f} | "
            f"{r['tpot_ms']['p50']:.1f} | {r['duration_s']:.2f} |"
        )
    ratio = a["throughput_tok_s"] / max(v["throughput_tok_s"], 1e-9)
    lines += ["", f"adaserve-ar / vllm = **{ratio:.2f}x** (goal >= 0.8x)", ""]
    lines += ["## Versions", *(f"- {k}: {x}" for k, x in _versions().items())]
    (out / "capacity.md").write_text("\n".join(lines) + "\n")
    print((out / "capacity.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="2,4,6", help="request rates (req/s), comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    p.add_argument("--out", default="bench-results/peer")
    p.add_argument("--saturate-prompts", type=int, default=48, help="capacity run size")
    p.add_argument("--vllm-client-prompts", type=int, default=40)
    p.add_argument("--vllm-client-rate", type=float, default=2.0)
    p.add_argument("--no-vllm-client", action="store_true")
    p.add_argument(
        "--capacity-only",
        action="store_true",
        help="only the capacity runs of vllm and adaserve-ar (no rate sweep, no vLLM client)",
    )
    args = p.parse_args(argv)
    if args.capacity_only:
        return _capacity_only(args)
    names = [n for n in args.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        p.error(f"unknown configs {bad}; choose from {CONFIGS}")
    if any(n.startswith("vllm") for n in names) and not PEER_PY.exists():
        p.error(f"{PEER_PY} is missing: run `make bench-peer` (it creates .venv-peer)")
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp:
        # vLLM reads the same checkpoint directories; copy so its caches stay out of the repo
        target, draft = Path(tmp) / "target", Path(tmp) / "draft"
        shutil.copytree(ASSETS / "target", target)
        shutil.copytree(ASSETS / "draft", draft)

        with running_server("adaserve-ar", out, target, draft) as url:
            unloaded = float(measure_unloaded_tpot(url, n=5))
        print(f"[peer] unloaded TPOT (adaserve-ar) {unloaded:.2f} ms", file=sys.stderr)

        per_server: dict[str, dict] = {}
        failures: dict[str, str] = {}
        client = None
        saturated: dict[str, dict] = {}
        for name in names:
            try:
                with running_server(name, out, target, draft) as url:
                    per_server[name] = _bench(
                        url, name, args, out, unloaded, priority=name != "vllm"
                    )
                    if name in ("vllm", "adaserve-ar"):
                        saturated[name] = _saturate(
                            url, name, args, out, unloaded, priority=name != "vllm"
                        )
                    if name == "adaserve" and not args.no_vllm_client and PEER_PY.exists():
                        client = _vllm_client(url, out, args)
            except (RuntimeError, subprocess.CalledProcessError) as e:
                failures[name] = str(e)
                print(f"[peer] {name} failed: {e}", file=sys.stderr)

    merged = _merge(per_server)
    merged["config"]["unloaded_tpot_ms"] = unloaded
    merged["config"]["versions"] = _versions()
    merged["failures"] = failures
    merged["saturated"] = saturated
    if client:
        merged["vllm_client_on_adaserve"] = {
            k: client.get(k)
            for k in (
                "completed",
                "request_throughput",
                "output_throughput",
                "mean_ttft_ms",
                "median_ttft_ms",
                "p99_ttft_ms",
                "mean_tpot_ms",
                "median_tpot_ms",
                "p99_tpot_ms",
            )
        }
    write_report(out, merged, "sweep", plots=True)
    lines = ["", "## Goals (issue 9)", *_goal_lines(merged)]
    if "vllm" in saturated and "adaserve-ar" in saturated:
        a = saturated["adaserve-ar"]["throughput_tok_s"]
        v = saturated["vllm"]["throughput_tok_s"]
        lines.append(
            f"- capacity ({args.saturate_prompts} requests at once): adaserve-ar {a:.0f} vs "
            f"vllm {v:.0f} output tok/s = **{a / max(v, 1e-9):.2f}x** (goal >= 0.8x)"
        )
    if client:
        c = merged["vllm_client_on_adaserve"]
        lines += [
            "",
            "## vLLM's own bench client against `adaserve serve`",
            f"{c['completed']} requests completed; {c['output_throughput']:.1f} output tok/s; "
            f"TTFT median {c['median_ttft_ms']:.1f} ms (p99 {c['p99_ttft_ms']:.1f}); "
            f"TPOT median {c['median_tpot_ms']:.2f} ms (p99 {c['p99_tpot_ms']:.2f}).",
        ]
    if failures:
        lines += ["", "## Failed configurations", *(f"- {k}: {v}" for k, v in failures.items())]
    lines += ["", "## Versions", *(f"- {k}: {v}" for k, v in merged["config"]["versions"].items())]
    with (out / "summary.md").open("a") as f:
        f.write("\n".join(lines) + "\n")
    print((out / "summary.md").read_text())
    return 0 if per_server else 1


if __name__ == "__main__":
    sys.exit(main())
