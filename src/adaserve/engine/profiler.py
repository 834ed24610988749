"""The measurements behind a hardware profile, with the engine's own forward code:
verification, drafting and prefill passes over a grid of sizes, the engine's host
overhead per step, the draft's host work and a grammar mask's cost
(``adaserve.engine.profile`` caches, checks and adopts what they measure)."""

from __future__ import annotations

import platform
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from adaserve.core.slo import SLO
from adaserve.hardware.model import SCHEMA
from adaserve.hardware.profile_stats import (
    PointStats,
    SanityLimits,
    check_profile,
    summarize,
    time_points,
)
from adaserve.kv.cache import KVCache
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.llama import LlamaModel
from adaserve.sampling import SamplingParams

if TYPE_CHECKING:
    from adaserve.core.trace import StepTrace

VERIFY_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DRAFT_TOKENS = (1, 4, 16, 64, 256)
KV_LENS = (64, 512)
# one sequence's prefill chunk of N new tokens over C cached ones: the attention of every
# new token over the cached context (N x C pairs), which a prefix-cache hit leaves to pay
PREFILL_CHUNKS = (64, 256)
PREFILL_CTX = (0, 1024)


def _forward_timer(model: LlamaModel, kv: KVCache, n_tokens: int, ctx: int):
    """A function timing (ms) one paged forward: ``n_tokens`` new tokens split over up
    to 8 sequences (tree-shaped: each attends ``ctx`` cached tokens + causal new
    tokens). Tests replace it with fake timings."""
    return _paged_timer(model, kv, n_tokens, ctx, 8)


def _paged_timer(model: LlamaModel, kv: KVCache, n_tokens: int, ctx: int, max_seqs: int):
    """``_forward_timer`` over up to ``max_seqs`` sequences."""
    device = model.embed_tokens.weight.device
    n_seq = min(max_seqs, n_tokens)
    per = [n_tokens // n_seq + (1 if i < n_tokens % n_seq else 0) for i in range(n_seq)]
    seqs, base = [], 0
    for q in per:
        seqs.append(
            SeqSpec(
                list(range(base, base + ctx)),
                list(range(base + ctx, base + ctx + q)),
                list(range(ctx, ctx + q)),
            )
        )
        base += ctx + q
    if base > kv.num_slots:
        raise ValueError("profile cache too small")
    ids = torch.randint(0, model.cfg.vocab_size, (n_tokens,), device=device)

    def once() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            meta = AttnMetadata.build(seqs, device, model.cfg.sliding_window)
            h = model(ids, meta, kv.layers)
            # one logits row and the host sync: the rows a pass computes are priced
            # per row (``measure_logits``)
            model.logits(h[-1:]).argmax(-1).tolist()
            return (time.perf_counter() - t0) * 1000

    return once


def measure_logits(model: LlamaModel, reps: int = 9, rows: tuple[int, int] = (8, 256)) -> float:
    """ms per logits row of ``model``'s LM head (with the argmax and host sync a pass
    does): the slope between ``rows`` rows, timed alternately, medians of ``reps``."""
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    hs = [torch.randn(n, model.cfg.hidden_size, device=device, dtype=dtype) for n in rows]
    times: list[list[float]] = [[], []]
    with torch.inference_mode():
        for k in range(reps + 1):
            for i, h in enumerate(hs):
                t0 = time.perf_counter()
                model.logits(h).argmax(-1).tolist()
                if k:  # the first round warms up
                    times[i].append((time.perf_counter() - t0) * 1000)
    lo, hi = (statistics.median(t) for t in times)
    return max(0.0, (hi - lo) / (rows[1] - rows[0]))


def _prefill_timer(model: LlamaModel, kv: KVCache, n_tokens: int, ctx: int):
    """A function timing (ms) one paged forward of a single sequence: a prefill chunk
    of ``n_tokens`` new tokens attending ``ctx`` cached ones."""
    device = model.embed_tokens.weight.device
    if ctx + n_tokens > kv.num_slots:
        raise ValueError("profile cache too small")
    seq = SeqSpec(
        list(range(ctx)), list(range(ctx, ctx + n_tokens)), list(range(ctx, ctx + n_tokens))
    )
    ids = torch.randint(0, model.cfg.vocab_size, (n_tokens,), device=device)

    def once() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            meta = AttnMetadata.build([seq], device, model.cfg.sliding_window)
            h = model(ids, meta, kv.layers)
            model.logits(h[-1:]).argmax(-1).tolist()
            return (time.perf_counter() - t0) * 1000

    return once


def fit_prefill_pairs(points: dict[tuple[int, int], float], per_kv: float) -> float:
    """ms per (new token x cached token) pair of a prefill chunk over a cached prefix,
    from ``points`` {(new, cached): ms}: what a chunk over ``cached`` tokens costs beyond
    the same chunk over none and the per-sequence KV term, per pair (median over the
    measured shapes, >= 0)."""
    fits = []
    for (n, ctx), ms in points.items():
        base = points.get((n, 0))
        if ctx > 0 and n > 0 and base is not None:
            fits.append((ms - base - per_kv * ctx) / (n * ctx))
    return max(0.0, statistics.median(fits)) if fits else 0.0


def _time_forwards(
    model: LlamaModel, kv: KVCache, sizes, ctx: int, reps: int, progress=None, timer=None
) -> PointStats:
    """Per pass size: the monotone median ms and the spread (``PointStats``). The sizes
    are timed round-robin after one warm-up each (``profile_stats.time_points``), so a
    burst of noise on a shared machine spreads over every size instead of landing on
    one; the medians are then made non-decreasing in the size (a suffix minimum: a
    larger pass never costs less), which removes the remaining spikes. ``timer``
    (default ``_forward_timer``) makes the timing function of one size."""
    timer = timer or _forward_timer
    return summarize(
        time_points([_ticking(timer(model, kv, n, ctx), progress) for n in sizes], reps)
    )


def _ticking(fn, progress):
    """``fn`` (a timing function), calling ``progress()`` after each call when given."""
    if progress is None:
        return fn

    def once() -> float:
        ms = fn()
        progress()
        return ms

    return once


def profile_calls(reps: int, has_draft: bool) -> int:
    """Timed forward passes of one ``measure`` (warm-ups included) before any repeat of
    an imprecise point (``profile_stats.time_points``): a progress bar's least total."""
    points = len(KV_LENS) * len(VERIFY_TOKENS) + len(PREFILL_CHUNKS) * len(PREFILL_CTX)
    points += len(KV_LENS) * len(DRAFT_TOKENS) if has_draft else 0
    return points * (reps + 1)


def measure(
    target: LlamaModel,
    draft: LlamaModel | None,
    reps: int = 5,
    verify_tokens=VERIFY_TOKENS,
    draft_tokens=DRAFT_TOKENS,
    kv_lens=KV_LENS,
    progress=None,
    timer=None,
    prefill_timer=None,
) -> dict:
    """Measure verification and draft-step latencies and the cost of a prefill chunk
    over a cached prefix; returns a profile dict with each curve's spread (raw
    medians, p10, p90) and the roofline check's findings under ``"sanity"``.
    ``timer`` / ``prefill_timer`` replace the forward timers (tests inject fake
    timings; ``timer`` alone stands for both)."""
    dtype = target.embed_tokens.weight.dtype
    device = target.embed_tokens.weight.device
    slots = 8 * (max(kv_lens) + max(verify_tokens) + max(draft_tokens)) + 64
    kv_t = KVCache(target.cfg, slots, device, dtype)
    stats = {}
    for ctx in kv_lens:
        stats[ctx] = _time_forwards(target, kv_t, verify_tokens, ctx, reps, progress, timer)
    lat = {ctx: list(st.median) for ctx, st in stats.items()}
    k0 = kv_lens[0]
    per_kv = _per_kv_token(lat, verify_tokens, kv_lens)
    shapes = [(n, c) for n in PREFILL_CHUNKS for c in PREFILL_CTX]
    ptimer = prefill_timer or timer or _prefill_timer
    pst = summarize(
        time_points([_ticking(ptimer(target, kv_t, n, c), progress) for n, c in shapes], reps)
    )
    prefill_points = dict(zip(shapes, (float(v) for v in pst.raw_median)))
    per_pair = fit_prefill_pairs(prefill_points, per_kv)
    esize = torch.tensor([], dtype=dtype).element_size()
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "machine": f"{platform.machine()} {platform.processor()} threads={torch.get_num_threads()}",
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "target": {"params": target.cfg.num_parameters()},
        "draft": None,
        "bytes_per_param": esize,
        "verify": {
            "tokens": list(verify_tokens),
            # at zero KV: the KV share measured at kv_lens[0] is taken out
            "latency_ms": _at_zero_kv(lat[k0], verify_tokens, per_kv, k0),
            "kv_len": [k0, kv_lens[-1]],
            "kv_ms_per_token": per_kv,
            "latency_ms_by_kv_per_seq": {str(k): lat[k] for k in kv_lens},
            # the measurement behind each curve: medians before the monotone
            # correction, the 10th / 90th percentiles, repeats per point
            "spread_by_kv": {str(k): stats[k].spread() for k in kv_lens},
            # a prefill chunk's new tokens attending a cached prefix: ms per pair
            "prefill_ms_per_pair": per_pair,
            "prefill_by_ctx": {f"{n}x{c}": round(ms, 4) for (n, c), ms in prefill_points.items()},
        },
        "overhead_ms": 0.3,  # replaced by a measured value in profile_engine
        # the LM head per row beyond the curves' one (injected timers: none measured)
        "logits_ms_per_row": {
            "target": round(measure_logits(target), 5) if timer is None else 0.0,
            "draft": round(measure_logits(draft), 5) if timer is None and draft else 0.0,
        },
        "kv_bytes_per_token": {"target": target.cfg.kv_bytes_per_token(esize), "draft": 0},
    }
    if draft is not None:
        # a draft pass attends every drafting request's context, as a verification
        # does: measured at the same two context lengths
        kv_d = KVCache(draft.cfg, slots, device, dtype)
        dstats = {
            ctx: _time_forwards(draft, kv_d, draft_tokens, ctx, reps, progress, timer)
            for ctx in kv_lens
        }
        dlat = {ctx: list(st.median) for ctx, st in dstats.items()}
        draft_kv = _per_kv_token(dlat, draft_tokens, kv_lens)
        dl = _at_zero_kv(dlat[k0], draft_tokens, draft_kv, k0)
        out["draft"] = {"params": draft.cfg.num_parameters()}
        out["draft_step"] = {
            "tokens": list(draft_tokens),
            "latency_ms": dl,
            "kv_len": [k0, kv_lens[-1]],
            "kv_ms_per_token": draft_kv,
            "latency_ms_by_kv_per_seq": {str(k): dlat[k] for k in kv_lens},
            "spread": dstats[k0].spread(),
            "spread_by_kv": {str(k): dstats[k].spread() for k in kv_lens},
        }
        out["draft_step_ms"] = dl[0]
        out["kv_bytes_per_token"]["draft"] = draft.cfg.kv_bytes_per_token(esize)
    else:
        out["draft_step_ms"] = 1e-3
    out["sanity"] = check_profile(out, SanityLimits.for_device(str(device)))
    return out


def _per_kv_token(lat: dict[int, list[float]], sizes, kv_lens) -> float:
    """Extra ms per attended context token (>= 0): the difference between the passes at
    the longest and the shortest context, per sequence and context token, averaged
    over the pass sizes (a pass of n tokens spreads them over ``min(8, n)`` sequences,
    ``_forward_timer``)."""
    k0, k1 = kv_lens[0], kv_lens[-1]
    if k1 <= k0:
        return 0.0
    n_seqs = [min(8, n) for n in sizes]
    return max(
        0.0,
        statistics.mean((b - a) / (s * (k1 - k0)) for a, b, s in zip(lat[k0], lat[k1], n_seqs)),
    )


def _at_zero_kv(lat: list[float], sizes, per_kv: float, ctx: int) -> list[float]:
    """Latencies measured at context ``ctx`` less their context share (the curve at no
    context, which the per-token term then prices)."""
    return [max(1e-3, v - per_kv * min(8, n) * ctx) for v, n in zip(lat, sizes)]


def _timed_steps(
    engine, policy, requests: int, max_tokens: int, stride: int, clock=time.perf_counter
) -> list[tuple[float, bool, int, StepTrace | None]]:
    """Serve ``requests`` greedy 32-token prompts (request i's tokens ``stride * i + j``)
    together under ``policy`` until they finish, then restore the engine's policy. Per
    step: (ms by ``clock``, whether every request was decoding before it, their context
    tokens before it, its trace)."""
    V = engine.target.cfg.vocab_size
    saved = engine.policy
    engine.set_policy(policy)
    steps = []
    try:
        reqs = [
            engine.add_request(
                [(stride * i + j) % V for j in range(1, 33)],
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                SLO(),
            )
            for i in range(requests)
        ]
        while not all(r.finished for r in reqs):
            decoding = all(r.first_token_at is not None and not r.finished for r in reqs)
            kv = sum(len(r.tokens) for r in reqs)
            t0 = clock()
            engine.step()
            steps.append(((clock() - t0) * 1000, decoding, kv, engine.last_trace))
    finally:
        engine.set_policy(saved)
    return steps


def forward_now_ms(model: LlamaModel, requests: int, ctx: int, reps: int = 9) -> float:
    """Median ms of a forward of ``requests`` one-token decodes, each over ``ctx`` cached
    tokens, timed now: the host overheads are measured against this, not against the
    curve timed seconds earlier, as the machine's speed drifts by 20-40% over that on a
    shared host (two profiles in a row put a one-token pass at 11.5 and 8.7 ms)."""
    kv = KVCache(
        model.cfg,
        requests * (ctx + 1) + 64,
        model.embed_tokens.weight.device,
        model.embed_tokens.weight.dtype,
    )
    return statistics.median(
        time_points([_paged_timer(model, kv, requests, ctx, requests)], reps)[0]
    )


def measure_step_overhead(engine, new_tokens: int = 24) -> list[float]:
    """Measured ms of each plain decode step of a single request (``new_tokens``
    steps without speculation, the first two dropped as warm-up): the engine's whole
    iteration, forward pass, scheduling, metadata and sampling included. The host
    overhead is their median less the profiled one-token verification."""
    from adaserve.policies.static import AutoregressivePolicy

    times = [ms for ms, *_ in _timed_steps(engine, AutoregressivePolicy(), 1, new_tokens, 0)]
    return times[2:] if len(times) > 3 else times


# requests decoding together when the host's work per request is measured
HOST_REQUESTS = 16
# speculating steps left out of the per-tree measurement: on the shipped pair the first
# three ran 1.3-1.5x the later ones (first calls of their shapes)
TREE_WARMUP = 4


def measure_request_overhead(
    engine,
    hw,
    one_ms: float,
    requests: int = HOST_REQUESTS,
    clock=time.perf_counter,
    shift_ms: float = 0.0,
) -> float:
    """Host ms per request of an iteration: plain decode steps of ``requests``
    requests decoding together (the first two dropped as warm-up), each less the
    profile's verification of their tokens and context (``hw``) plus ``shift_ms`` (what
    that forward takes now beyond the curve's price, ``forward_now_ms``), against
    ``one_ms``, the same overhead of a single request's step; the slope between the two
    (>= 0). ``clock``: seconds (tests inject one)."""
    from adaserve.policies.static import AutoregressivePolicy

    steps = _timed_steps(engine, AutoregressivePolicy(), requests, 16, 3, clock)
    over = [
        ms - float(hw.verify_latency(requests, kv)) - shift_ms
        for ms, decoding, kv, _ in steps
        if decoding
    ]
    if len(over) < 3:
        return 0.0
    return max(0.0, (statistics.median(over[2:]) - one_ms) / (requests - 1))


def measure_tree_host(
    engine, hw, requests: int = HOST_REQUESTS // 2, clock=time.perf_counter
) -> float:
    """Host ms per speculating request of a step beyond its profiled passes (its tree's
    verification: the batch built, the nodes sampled, the accepted nodes' KV moved):
    steps of ``requests`` requests all drafting 4-token chains together (the first
    ``TREE_WARMUP`` dropped as warm-up), each less ``hw``'s price of the same pass
    without this term (``drift.predicted_pass_ms`` of its ``StepTrace``), per
    speculating request (>= 0). ``clock``: seconds (tests inject one)."""
    import dataclasses

    from adaserve.hardware.drift import predicted_pass_ms
    from adaserve.policies.registry import make_policy

    if engine.draft is None:
        return 0.0
    hw = dataclasses.replace(hw, tree_host_ms=0.0)
    per = []
    for ms, _, _, tr in _timed_steps(engine, make_policy("spec-chain:4"), requests, 40, 5, clock):
        if tr is None or tr.prefill or len(tr.spec) < requests:  # the full batch only
            continue
        rows = len(tr.decode) + sum(tr.tree_nodes.values())
        pred = predicted_pass_ms(hw, tr.tokens, tr.kv_tokens, 0, tr.draft, len(tr.decode), rows)
        per.append((ms - pred) / len(tr.spec))
    # the first speculating steps run cold (first calls of their shapes): left out
    if len(per) < 2 + TREE_WARMUP:
        return 0.0
    return max(0.0, statistics.median(per[TREE_WARMUP:]))


def measure_draft_host(engine, requests: int = 8, depth: int = 4, width: int = 2) -> float:
    """Host ms per speculating request per draft step: a real tree expansion of
    ``requests`` requests minus the profiled forward passes it ran."""
    from adaserve.core.blocks import BlockTable
    from adaserve.core.tree import scratch_slots_needed
    from adaserve.spec_decode.draft import expand

    if engine.draft is None:
        return 0.0
    V = engine.target.cfg.vocab_size
    reqs = [  # not queued: as if prefilled, with blocks of their own
        engine.new_request(
            [(7 * i + j) % V for j in range(24)], SamplingParams(temperature=0.0), SLO()
        )
        for i in range(requests)
    ]
    for r in reqs:
        r.table = BlockTable(engine.allocator)
        r.table.ensure(len(r.tokens) + scratch_slots_needed(depth, width))
    times = []
    for _ in range(4):
        for r in reqs:
            r.draft_cached = 0
        t0 = time.perf_counter()
        expand(engine.draft, engine.kv_draft, reqs, [(depth, width)] * requests, vocab_size=V)
        times.append((time.perf_counter() - t0) * 1000)
    for r in reqs:
        r.table.release()
    return statistics.median(times[1:])


# the schema whose masks the profile times (objects, strings, numbers, an enum array)
MASK_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "id": {"type": "integer"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
    },
    "required": ["name", "id", "score", "tags"],
}


def measure_mask(engine, n: int = 300) -> float | None:
    """Median host ms of one tree node's grammar mask (the engine's backend, a JSON
    schema, walked by random allowed tokens); None without a tokenizer."""
    import random

    import numpy as np

    from adaserve.structured.params import StructuredOutputsParams

    so = engine.structured
    if so is None or engine.tokenizer is None:
        return None
    spec = StructuredOutputsParams(json=MASK_SCHEMA)
    saved = (so.mask_s, so.masks)
    try:
        st = so.state_for(spec)
        rng = random.Random(0)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            m = st.masks([[]])
            times.append((time.perf_counter() - t0) * 1000)
            ok = np.flatnonzero(np.unpackbits(m[0].view(np.uint8), bitorder="little"))
            ok = ok[ok < so.vocab_size]
            if not len(ok) or not st.commit(int(rng.choice(list(ok)))):
                st = so.state_for(spec)
    except Exception:  # a backend that cannot load here: the profile goes without
        return None
    finally:
        so.mask_s, so.masks = saved
    return statistics.median(times)
