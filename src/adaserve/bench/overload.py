"""``adaserve bench overload``: drive a live server past its capacity and check what
admission control promises.

First a closed-loop probe measures the server's capacity at the run's output length
(``--concurrency`` streams back to back: finished requests per second). Then Poisson
arrivals at ``--factor`` times that rate, in the classes of ``--class-mix``, stream for
``--duration`` seconds. Every request must end one of two ways: a complete stream, or
429 with Retry-After. The report gives, per class: requests, admitted, shed (and how
long the 429 took), the attainment of the admitted requests against the server's own
targets (``/v1/slo/report``), and the requests that got no answer by their TTFT
deadline (neither a token nor a 429).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from adaserve.bench.http_runner import off_server_cores
from adaserve.errors import RETRY_TOKEN, told_wait_s

DEFAULT_MIX = "interactive=0.6,chat=0.2,batch=0.2"
# a 429 answered within this many ms of arrival counts as immediate
IMMEDIATE_MS = 250.0
# how long a probe stream waits after a failure that gave no Retry-After (s)
FAILED_WAIT_S = 0.1


@dataclass
class Outcome:
    """One request as the client saw it (seconds from the run's start)."""

    cls: str
    sent: float
    status: int | None = None
    answered: float | None = None  # response headers (first token for a stream) or 429
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    done: bool = False  # the stream ended with [DONE] and a finish reason
    retry_after: str | None = None  # seconds: retry-after-ms / 1000, else Retry-After
    retry_token: str | None = None  # the seat held for this client's retry
    reason: str | None = None
    error: str | None = None
    times: list[float] = field(default_factory=list)
    retry: Outcome | None = None  # the one retry after Retry-After (``--retry``)


async def _one(
    client: httpx.AsyncClient, cls: str, body: dict, t0: float, token: str | None = None
) -> Outcome:
    o = Outcome(cls=cls, sent=time.perf_counter() - t0)
    headers = {RETRY_TOKEN: token} if token else None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            o.status = r.status_code
            o.answered = time.perf_counter() - t0
            if r.status_code != 200:
                wait = told_wait_s(r.headers)
                o.retry_after = None if wait is None else str(wait)
                o.retry_token = r.headers.get(RETRY_TOKEN)
                try:
                    err = json.loads(await r.aread())["error"]
                    o.reason, o.error = err.get("reason") or err.get("code"), err.get("message")
                except (ValueError, KeyError, TypeError):
                    o.error = "unparsable error body"
                return o
            finish = None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    o.done = finish is not None
                    break
                obj = json.loads(data)
                if "error" in obj:
                    o.error = str(obj["error"])
                    break
                now = time.perf_counter() - t0
                for ch in obj.get("choices") or []:
                    if ch.get("text"):
                        o.first = o.first if o.first is not None else now
                        o.times.append(now)
                    finish = ch.get("finish_reason") or finish
                if obj.get("usage"):
                    o.tokens = obj["usage"]["completion_tokens"]
            o.last = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - every failure is part of the report
        o.error = f"{type(e).__name__}: {e}"
    return o


def _seconds(value: str | None, default: float) -> float:
    """A Retry-After header's delay in seconds (``default`` when absent or not a
    number of seconds)."""
    try:
        return max(0.0, float(value)) if value is not None else default
    except ValueError:
        return default


def _body(model: str | None, cls: str, prompt: str, max_tokens: int) -> dict:
    b = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "slo_class": cls,
    }
    if model:
        b["model"] = model
    return b


@dataclass(frozen=True)
class Capacity:
    """What the capacity probe measured: streams finished per second, and of them those
    within the class's TTFT and TPOT targets (None: no targets given)."""

    finished_rps: float
    within_slo_rps: float | None = None


async def probe_capacity(
    base_url: str,
    model: str | None,
    cls: str,
    concurrency: int,
    max_tokens: int,
    seconds: float,
    target: dict | None = None,
) -> Capacity:
    """Requests per second the server finishes with ``concurrency`` streams kept busy,
    and those within ``target`` ({tpot_ms, ttft_ms}: the class's SLO). A stream refused
    with 429 waits its Retry-After (at most the probe's time left) and comes back with
    the seat it was given, as a client should: one that came straight back would flood
    the engine with arrivals it must judge and refuse, and measure the flood."""
    t0 = time.perf_counter()
    done = met = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:

        async def worker(i: int):
            nonlocal done, met
            token = None
            while (left := seconds - (time.perf_counter() - t0)) > 0:
                body = _body(model, cls, f"x{i} = ", max_tokens)
                o = await _one(c, cls, body, t0, token)
                left = seconds - (time.perf_counter() - t0)  # the answer took its time
                token = o.retry_token if o.status == 429 else None
                if o.done:
                    done += 1
                    met += target is not None and all(_met(o, target))
                elif o.status == 429:
                    await asyncio.sleep(max(0.0, min(_seconds(o.retry_after, FAILED_WAIT_S), left)))
                else:  # an error: not a reason to hammer the server
                    await asyncio.sleep(max(0.0, min(FAILED_WAIT_S, left)))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    span = time.perf_counter() - t0
    return Capacity(done / span, met / span if target is not None else None)


def _tpot_ms(o: Outcome) -> float | None:
    """A finished stream's mean ms per output token after the first (None: fewer than
    two tokens)."""
    if o.tokens > 1 and o.first is not None and o.last is not None:
        return (o.last - o.first) * 1000 / (o.tokens - 1)
    return None


def _met(o: Outcome, tgt: dict) -> tuple[bool, bool]:
    """Whether a finished stream met its class's TTFT and TPOT targets (``tgt``:
    {tpot_ms, ttft_ms}; a target not given is met)."""
    ttft, tpot = tgt.get("ttft_ms"), tgt.get("tpot_ms")
    t_ok = ttft is None or (o.first is not None and (o.first - o.sent) * 1000 <= ttft)
    own = _tpot_ms(o)
    return t_ok, tpot is None or own is None or own <= tpot


async def run_overload(
    base_url: str,
    *,
    model: str | None,
    rate: float,
    duration: float,
    mix: dict[str, float],
    max_tokens: int,
    seed: int = 0,
    prompt_words: int = 8,
    retry_max_s: float | None = None,
) -> list[Outcome]:
    """Poisson arrivals at ``rate`` req/s for ``duration`` s; every outcome. With
    ``retry_max_s``, a client refused with a Retry-After of at most that many seconds
    waits it out and tries once more, with the ``Retry-Token`` it was given
    (``Outcome.retry``)."""
    rng = random.Random(seed)
    names, weights = list(mix), list(mix.values())
    t, arrivals = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        arrivals.append((t, rng.choices(names, weights)[0]))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as c:
        t0 = time.perf_counter()
        tasks = []
        for i, (at, cls) in enumerate(arrivals):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = " ".join(f"w{(i * 7 + k) % 97}" for k in range(prompt_words))
            body = _body(model, cls, prompt, max_tokens)
            tasks.append(asyncio.create_task(_client(c, cls, body, t0, retry_max_s)))
        return list(await asyncio.gather(*tasks))


async def _client(c, cls: str, body: dict, t0: float, retry_max_s: float | None) -> Outcome:
    """One client: its request, and its one retry when told to come back soon enough."""
    o = await _one(c, cls, body, t0)
    if retry_max_s is not None and o.status == 429 and o.retry_after:
        wait = _seconds(o.retry_after, retry_max_s + 1.0)
        if wait <= retry_max_s:
            await asyncio.sleep(wait)
            o.retry = await _one(c, cls, body, t0, o.retry_token)
    return o


def _attempts(outcomes: list[Outcome]) -> list[Outcome]:
    """Every request sent: each client's first and its retry, if any."""
    return [a for o in outcomes for a in (o, o.retry) if a is not None]


def summarize(
    outcomes: list[Outcome],
    targets: dict[str, dict],
    slack_s: float = 0.5,
    duration_s: float | None = None,
) -> dict:
    """Per class and overall: counts, shed latency, unanswered-by-deadline (of the
    clients' first requests), attainment of the admitted (TPOT and TTFT against
    ``targets``: class -> {tpot_ms, ttft_ms}), and goodput: the tokens of the requests
    that met both, per second of ``duration_s`` (the arrivals' span; None: first send to
    last token). A retry that was served counts as an admitted request of its own (its
    TTFT from its own send): the server served it."""
    if duration_s is None:
        ends = [o.last for o in _attempts(outcomes) if o.last is not None]
        starts = [o.sent for o in outcomes]
        duration_s = max(ends) - min(starts) if ends and starts else 0.0

    def block(os: list[Outcome], tgt: dict) -> dict:
        ttft = tgt.get("ttft_ms")
        tpot = tgt.get("tpot_ms")
        served = [o for o in _attempts(os) if o.status == 200 and o.done and o.error is None]
        ok = [o for o in os if o.status == 200 and o.done and o.error is None]
        shed = [o for o in os if o.status == 429]
        other = [o for o in os if o not in ok and o not in shed]
        bad_shed = [o for o in shed if _seconds(o.retry_after, 0.0) <= 0]
        shed_ms = [(o.answered - o.sent) * 1000 for o in shed if o.answered is not None]
        late = 0  # no answer (token or 429) by the TTFT deadline
        attained = good = missed_ttft = missed_tpot = 0
        tpots: list[float] = []
        for o in os:
            answer = o.first if o.status == 200 else o.answered
            if ttft is not None and (answer is None or answer - o.sent > ttft / 1000 + slack_s):
                late += 1
        for o in served:
            t_ok, p_ok = _met(o, tgt)
            if (own := _tpot_ms(o)) is not None:
                tpots.append(own)
            attained += t_ok and p_ok
            good += o.tokens if t_ok and p_ok else 0
            missed_ttft += not t_ok
            missed_tpot += not p_ok
        return {
            "requests": len(os),
            "admitted": len(served),
            "admitted_first_try": len(ok),
            "shed": len(shed),
            "other": len(other),
            "other_examples": [asdict(o) | {"times": None} for o in other[:3]],
            "shed_without_retry_after": len(bad_shed),
            "shed_reasons": _count(o.reason for o in shed),
            "shed_p50_ms": statistics.median(shed_ms) if shed_ms else None,
            "shed_max_ms": max(shed_ms) if shed_ms else None,
            "shed_immediate": sum(1 for x in shed_ms if x <= IMMEDIATE_MS),
            "unanswered_by_deadline": late,
            "admitted_attained": attained,
            "admitted_attainment": attained / len(served) if served else None,
            "goodput_tok_s": good / duration_s if duration_s else None,
            "admitted_missed_ttft": missed_ttft,
            "admitted_missed_tpot": missed_tpot,
            "admitted_tpot_ms": _quantiles(tpots),
            "tpot_target_ms": tpot,
            "ttft_target_ms": ttft,
            "retries": sum(o.retry is not None for o in os),
            "retries_admitted": sum(
                o.retry is not None and o.retry.status == 200 and o.retry.done for o in os
            ),
            "retries_with_token": sum(o.retry is not None and bool(o.retry_token) for o in os),
        }

    out: dict[str, Any] = {"classes": {}}
    for cls in sorted({o.cls for o in outcomes}):
        out["classes"][cls] = block([o for o in outcomes if o.cls == cls], targets.get(cls, {}))
    tot = out["classes"].values()
    out["overall"] = {
        k: sum(b[k] for b in tot)
        for k in (
            "requests",
            "admitted",
            "admitted_first_try",
            "shed",
            "other",
            "shed_without_retry_after",
            "shed_immediate",
            "unanswered_by_deadline",
            "admitted_attained",
            "retries",
            "retries_admitted",
            "retries_with_token",
        )
    }
    out["overall"]["goodput_tok_s"] = sum(b["goodput_tok_s"] or 0.0 for b in tot)
    return out


def _quantiles(xs: list[float]) -> dict[str, float] | None:
    """p10 / p50 / p90 of ``xs`` (None when empty)."""
    if not xs:
        return None
    xs = sorted(xs)
    return {f"p{q}": xs[min(len(xs) - 1, int(q / 100 * len(xs)))] for q in (10, 50, 90)}


def _count(xs) -> dict[str, int]:
    d: dict[str, int] = {}
    for x in xs:
        d[str(x)] = d.get(str(x), 0) + 1
    return d


def server_targets(base_url: str, api_key: str | None = None) -> dict[str, dict]:
    """Each class's TPOT and TTFT targets (ms) as the server resolves them."""
    h = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rep = httpx.get(base_url + "/v1/slo/report", headers=h, timeout=30).json()
    return {name: dict(c.get("targets") or {}) for name, c in rep["classes"].items()}


def _mix(s: str) -> dict[str, float]:
    try:
        d = {k: float(v) for k, v in (p.split("=") for p in s.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected class=weight,...: {s!r}") from None
    if not d or any(v < 0 for v in d.values()) or sum(d.values()) <= 0:
        raise argparse.ArgumentTypeError(f"weights must be >= 0 and not all 0: {s!r}")
    return d


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: none)")
    p.add_argument("--factor", type=float, default=3.0, help="offered load / capacity")
    p.add_argument("--rate", type=float, help="offered req/s (default: factor x probed)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--class-mix", type=_mix, default=_mix(DEFAULT_MIX))
    p.add_argument("--concurrency", type=int, default=8, help="streams in the capacity probe")
    p.add_argument("--probe-seconds", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--retry",
        type=float,
        metavar="MAX_S",
        help="a refused client honours a Retry-After of at most MAX_S seconds and tries "
        "once more, with the Retry-Token it was given (how often it gets in is reported)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _probe_and_run(args) -> tuple[dict[str, dict], Capacity | None, float, list]:
    """The server's class targets, the probed capacity (None with ``--rate``), the
    offered rate and every outcome of the run."""
    targets = server_targets(args.base_url)
    rate = args.rate
    cap = None
    if rate is None:
        strict = min(targets, key=lambda c: targets[c].get("tpot_ms") or 1e9)
        cap = asyncio.run(
            probe_capacity(
                args.base_url, args.model, strict, args.concurrency, args.max_tokens,
                args.probe_seconds, targets[strict],
            )
        )  # fmt: skip
        rate = args.factor * cap.finished_rps
    outcomes = asyncio.run(
        run_overload(
            args.base_url, model=args.model, rate=rate, duration=args.duration,
            mix=args.class_mix, max_tokens=args.max_tokens, seed=args.seed,
            retry_max_s=args.retry,
        )
    )  # fmt: skip
    return targets, cap, rate, outcomes


def run(args) -> int:
    if args.duration <= 0 or args.max_tokens < 1 or args.factor <= 0:
        print("error: --duration, --max-tokens and --factor must be positive", file=sys.stderr)
        return 2
    try:
        with off_server_cores(args.base_url) as note:
            if note:
                print(f"adaserve bench: {note}", file=sys.stderr)
            targets, cap, rate, outcomes = _probe_and_run(args)
    except httpx.HTTPError as e:
        print(f"error: cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 1
    s = summarize(outcomes, targets, duration_s=args.duration)
    s["capacity_rps"] = cap.finished_rps if cap is not None else None
    s["capacity_within_slo_rps"] = cap.within_slo_rps if cap is not None else None
    s["rate_rps"] = rate
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    if cap is not None:
        print(
            f"capacity {cap.finished_rps:.2f} req/s ({cap.within_slo_rps or 0.0:.2f} within "
            f"the strict class's SLO), offered {rate:.2f} req/s for {args.duration:g} s"
        )
    else:
        print(f"offered {rate:.2f} req/s for {args.duration:g} s")
    print("class        reqs  admitted  shed  immediate  no-answer  admitted SLO ok %")
    for name, b in s["classes"].items():
        att = b["admitted_attainment"]
        print(
            f"{name:11s} {b['requests']:5d} {b['admitted']:9d} {b['shed']:5d} "
            f"{b['shed_immediate']:10d} {b['unanswered_by_deadline'] + b['other']:10d} "
            f"{'-' if att is None else f'{100 * att:.1f}':>18s}"
        )
    o = s["overall"]
    if args.retry is not None:
        print(
            f"retries after Retry-After: {o['retries_admitted']} of {o['retries']} admitted "
            "(served retries count as admitted requests above)"
        )
    return 0
