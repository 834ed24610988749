"""``adaserve demo`` (``make demo``): serve the shipped pair with ``adaserve`` and then
with a baseline policy, drive the same short mixed-SLO workload (same arrivals, prompts
and targets) against each over HTTP, print one per-class table of both."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adaserve.errors import AdaServeError

HEALTH_TIMEOUT_S = 900.0  # first start may measure the hardware profile


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_healthy(base_url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    """Poll ``/health`` until it answers 200; fail early if the server process exits."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AdaServeError(f"the server exited with status {proc.returncode} while starting")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AdaServeError(f"the server did not become healthy within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def demo_workload(duration_s: float, unloaded_tpot_ms: float, seed: int = 0):
    """A short mixed-SLO workload sized to the server's single-stream speed."""
    from adaserve.bench.workload_spec import LengthDist, WorkloadSpec

    out_len = 48
    rate = 2000.0 / max(unloaded_tpot_ms, 1.0) / out_len
    rate = min(6.0, max(0.5, 8.0 / max(duration_s, 1.0), rate))  # at least ~8 requests
    return WorkloadSpec(
        seed=seed,
        request_rate=rate,
        duration_s=duration_s,
        input_len=(
            ("interactive", LengthDist("uniform", 32, 96)),
            ("chat", LengthDist("uniform", 32, 128)),
            ("batch", LengthDist("uniform", 96, 256)),
        ),
        output_len=(
            ("interactive", LengthDist("uniform", 24, 64)),
            ("chat", LengthDist("uniform", 32, 64)),
            ("batch", LengthDist("uniform", 48, 96)),
        ),
    )


def run(args) -> int:
    from adaserve import paths
    from adaserve.bench.cli import _vocab_of
    from adaserve.bench.metrics import summarize
    from adaserve.bench.report import write_report
    from adaserve.bench.runner import class_slos, measure_unloaded_tpot, run_http
    from adaserve.bench.tables import format_class_table
    from adaserve.bench.workload import build_workload
    from adaserve.sched.registry import check_servable, make_policy
    from adaserve.tokenizer import load_tokenizer

    duration = float(getattr(args, "duration", 20.0) or 20.0)
    baseline = getattr(args, "baseline", None) or "ar-chunked"
    make_policy(baseline)  # a clear error for an unknown name, before any server starts
    check_servable(baseline)  # and for a simulator-only one
    policies = ["adaserve"] + ([baseline] if baseline != "adaserve" else [])
    host = "127.0.0.1"
    out = Path(getattr(args, "out", None) or tempfile.mkdtemp(prefix="adaserve-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    model, draft = getattr(args, "model", None), getattr(args, "draft", None)
    mdir = Path(model) if model else paths.DEFAULT_TARGET
    tok = load_tokenizer(mdir) if mdir.is_dir() else None
    results, records, config = {}, {}, None
    for policy in policies:
        port = int(getattr(args, "port", 0) or 0) or free_port(host)
        base_url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "adaserve", "serve", "--host", host, "--port", str(port)]
        cmd += ["--policy", policy]
        if model:  # not on the ``adaserve demo`` command line; for tests and experiments
            cmd += ["--model", str(model)] + (["--draft", str(draft)] if draft else [])
        log_path = out / f"server-{policy.replace(':', '_')}.log"
        print(f"starting the server: {' '.join(cmd[2:])} (log: {log_path})", file=sys.stderr)
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            try:
                wait_healthy(base_url, proc, HEALTH_TIMEOUT_S)
            except AdaServeError as e:
                raise AdaServeError(f"{e}\n--- server log tail ---\n{_tail(log_path)}") from None
            if config is None:  # one workload and one set of targets for every policy
                tpot = measure_unloaded_tpot(base_url)
                spec = demo_workload(duration, tpot)
                items = build_workload(spec, tokenizer=tok, vocab_size=_vocab_of(mdir))
                slos = class_slos(
                    sorted({i.cls for i in items}), spec.slo_scale, unloaded_tpot_ms=tpot
                )
                config = {
                    **spec.to_dict(),
                    "mode": "http",
                    "policies": policies,
                    "unloaded_tpot_ms": tpot,
                    "slo_targets": {
                        k: {"tpot_ms": v.tpot_ms, "ttft_ms": v.ttft_ms} for k, v in slos.items()
                    },
                    "strict_class": "interactive",
                }
                print(
                    f"unloaded TPOT {tpot:.1f} ms; sending {len(items)} requests over "
                    f"{duration:g} s ({spec.request_rate:.2f} req/s, mix "
                    "interactive/chat/batch 60/20/20) to each policy",
                    file=sys.stderr,
                )
            t0 = time.perf_counter()
            recs = run_http(base_url, items, spec, slos=slos)
            ends = [r.finish_s for r in recs if r.finish_s is not None]
            dur = max(ends) if ends else time.perf_counter() - t0
            results[policy], records[policy] = summarize(recs, dur), recs
        finally:
            stop_server(proc)
    result = {"config": config, "results": results}
    write_report(out, result, "serve", records=records)
    print(format_class_table(result))
    print(f"\nresults in {out}", file=sys.stderr)
    return 0
