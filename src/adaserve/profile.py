"""``adaserve profile``: measure the pair's latencies with the engine's own forward code."""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from adaserve.kv.cache import KVCache
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.llama import LlamaModel
from adaserve.sched.hardware import SCHEMA, HardwareModel
from adaserve.sched.profile_stats import (
    PointStats,
    SanityLimits,
    check_profile,
    summarize,
    time_points,
)

VERIFY_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DRAFT_TOKENS = (1, 4, 16, 64, 256)
KV_LENS = (64, 512)
# Part of the cache key: bump when the forward code's speed changes (e.g. the paged
# attention kernel), so that cached profiles measured with the old code are not reused.
FORWARD_VERSION = 3


def fingerprint(path: str | Path | None) -> str:
    """Stable identity of a checkpoint: hash of its config and weight file sizes."""
    if path is None:
        return "none"
    p = Path(path)
    h = hashlib.sha1()
    cfg = p / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def profile_key(target: str | Path, draft: str | Path | None, device: str, dtype: str) -> str:
    machine = f"{platform.machine()}-{torch.get_num_threads()}t"
    fp = f"{fingerprint(target)}-{fingerprint(draft)}"
    return f"{fp}-{device}-{dtype}-{machine}-f{FORWARD_VERSION}"


def _forward_timer(model: LlamaModel, kv: KVCache, n_tokens: int, ctx: int):
    """A function timing (ms) one paged forward: ``n_tokens`` new tokens split over up
    to 8 sequences (tree-shaped: each attends ``ctx`` cached tokens + causal new tokens)."""
    device = model.embed_tokens.weight.device
    n_seq = min(8, n_tokens)
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
            model.logits(h[-n_seq:]).argmax(-1).tolist()  # include the host sync
            return (time.perf_counter() - t0) * 1000

    return once


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
    stats = summarize(time_points([timer(model, kv, n, ctx) for n in sizes], reps))
    if progress:
        for _ in sizes:
            progress()
    return stats


def measure(
    target: LlamaModel,
    draft: LlamaModel | None,
    reps: int = 5,
    verify_tokens=VERIFY_TOKENS,
    draft_tokens=DRAFT_TOKENS,
    kv_lens=KV_LENS,
    progress=None,
    timer=None,
) -> dict:
    """Measure verification and draft-step latencies; returns a profile dict with each
    curve's spread (raw medians, p10, p90) and the roofline check's findings under
    ``"sanity"``. ``timer`` replaces the forward timer (tests inject fake timings)."""
    dtype = target.embed_tokens.weight.dtype
    device = target.embed_tokens.weight.device
    slots = 8 * (max(kv_lens) + max(verify_tokens) + max(draft_tokens)) + 64
    kv_t = KVCache(target.cfg, slots, device, dtype)
    stats = {}
    for ctx in kv_lens:
        stats[ctx] = _time_forwards(target, kv_t, verify_tokens, ctx, reps, progress, timer)
    lat = {ctx: list(st.median) for ctx, st in stats.items()}
    k0, k1 = kv_lens[0], kv_lens[-1]
    # extra cost per attended KV token, averaged over pass sizes (>= 0)
    n_seqs = [min(8, n) for n in verify_tokens]
    per_kv = 0.0
    if k1 > k0:
        per_kv = statistics.mean(
            (b - a) / (s * (k1 - k0)) for a, b, s in zip(lat[k0], lat[k1], n_seqs)
        )
    per_kv = max(0.0, per_kv)
    esize = torch.tensor([], dtype=dtype).element_size()
    out = {
        "schema": SCHEMA,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "machine": f"{platform.machine()} {platform.processor()} threads={torch.get_num_threads()}",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "target": {"params": target.cfg.num_parameters()},
        "draft": None,
        "bytes_per_param": esize,
        "verify": {
            "tokens": list(verify_tokens),
            # at zero KV: the KV share measured at kv_lens[0] is taken out
            "latency_ms": [max(1e-3, v - per_kv * s * k0) for v, s in zip(lat[k0], n_seqs)],
            "kv_len": [k0, k1],
            "kv_ms_per_token": per_kv,
            "latency_ms_by_kv_per_seq": {str(k): lat[k] for k in kv_lens},
            # the measurement behind each curve: medians before the monotone
            # correction, the 10th / 90th percentiles, repeats per point
            "spread_by_kv": {str(k): stats[k].spread() for k in kv_lens},
        },
        "overhead_ms": 0.3,  # replaced by a measured value in profile_engine
        "kv_bytes_per_token": {"target": target.cfg.kv_bytes_per_token(esize), "draft": 0},
    }
    if draft is not None:
        kv_d = KVCache(draft.cfg, slots, device, dtype)
        dst = _time_forwards(draft, kv_d, draft_tokens, kv_lens[0], reps, progress, timer)
        dl = list(dst.median)
        out["draft"] = {"params": draft.cfg.num_parameters()}
        out["draft_step"] = {"tokens": list(draft_tokens), "latency_ms": dl, "spread": dst.spread()}
        out["draft_step_ms"] = dl[0]
        out["kv_bytes_per_token"]["draft"] = draft.cfg.kv_bytes_per_token(esize)
    else:
        out["draft_step_ms"] = 1e-3
    out["sanity"] = check_profile(out, SanityLimits.for_device(str(device)))
    return out


def measure_step_overhead(engine, new_tokens: int = 24) -> float:
    """Host time per engine iteration beyond the target forward: a single request
    decodes ``new_tokens`` tokens without speculation; the median step time minus the
    profiled one-token verification is the overhead (scheduling, metadata, sampling)."""
    from adaserve.sampling import SamplingParams
    from adaserve.sched.static import AutoregressivePolicy
    from adaserve.slo import SLO

    saved = engine.policy
    engine.set_policy(AutoregressivePolicy("ar"))
    try:
        prompt = [i % engine.target.cfg.vocab_size for i in range(1, 33)]
        r = engine.add_request(
            prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True), SLO()
        )
        times = []
        while not r.finished:
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        engine.set_policy(saved)
    return statistics.median(times[2:]) if len(times) > 3 else statistics.median(times)


def measure_draft_host(engine, requests: int = 8, depth: int = 4, width: int = 2) -> float:
    """Host ms per speculating request per draft step: a real tree expansion of
    ``requests`` requests minus the profiled forward passes it ran."""
    from adaserve.core.blocks import BlockTable
    from adaserve.core.tree import scratch_slots_needed
    from adaserve.sampling import SamplingParams
    from adaserve.slo import SLO
    from adaserve.spec_decode.draft import expand

    if engine.draft is None:
        return 0.0
    V = engine.target.cfg.vocab_size
    reqs = [  # not queued: as if prefilled, with blocks of their own
        engine.new_request([(7 * i + j) % V for j in range(24)], SamplingParams(), SLO())
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


def profile_engine(engine, reps: int = 5, timer=None) -> dict:
    """Profile the engine's loaded pair and annotate it with paths and fingerprints."""
    prof = measure(engine.target, engine.draft, reps=reps, timer=timer)
    step = measure_step_overhead(engine)
    one = float(HardwareModel.from_dict(prof).verify_latency(1, 40))
    prof["overhead_ms"] = round(max(0.0, step - one), 3)
    prof["decode_step_ms"] = round(step, 3)
    if engine.draft is not None:
        n, d, w = 8, 4, 2
        total = measure_draft_host(engine, n, d, w)
        hw = HardwareModel.from_dict(prof)
        forwards = float(hw.draft_latency(n * 24) + (d - 1) * hw.draft_latency(n * w))
        prof["draft_host_ms"] = round(max(0.0, (total - forwards) / (n * d)), 4)
    prof["target"].update(path=str(engine.model_dir), fingerprint=fingerprint(engine.model_dir))
    if prof["draft"] is not None:
        prof["draft"].update(path=str(engine.draft_dir), fingerprint=fingerprint(engine.draft_dir))
    return prof


def cached_profile_path(engine) -> Path:
    from adaserve.paths import cache_root

    dtype = str(engine.dtype).removeprefix("torch.")
    key = profile_key(engine.model_dir, engine.draft_dir, engine.cfg.device, dtype)
    return cache_root() / "profiles" / f"{key}.json"


def _say(msg: str) -> None:
    """One line on stderr: what the profiler measures, where it caches, what it found."""
    print(f"adaserve: {msg}", file=sys.stderr, flush=True)


def _what(engine, reps: int) -> str:
    pair = str(engine.model_dir) + (f" + draft {engine.draft_dir}" if engine.draft_dir else "")
    return (
        f"verify {VERIFY_TOKENS[0]}-{VERIFY_TOKENS[-1]} tokens at KV {'/'.join(map(str, KV_LENS))}"
        f"{', draft steps' if engine.draft is not None else ''}, {reps} interleaved repeats, "
        f"on {engine.cfg.device} ({pair})"
    )


def _flags(prof: dict) -> list[str]:
    s = prof.get("sanity") or {}
    return list(s.get("impossible", [])) + list(s.get("suspicious", []))


def measure_checked(engine, reps: int = 3, timer=None) -> dict:
    """``profile_engine``, measured once more with twice the repeats when the first
    result fails the sanity check (``profile_stats.check_profile``); the one with
    fewer findings is returned, its findings said on stderr."""
    prof = profile_engine(engine, reps=reps, timer=timer)
    if _flags(prof):
        for f in _flags(prof):
            _say(f"profile check: {f}")
        _say(f"measuring the profile again with {2 * reps} repeats")
        again = profile_engine(engine, reps=2 * reps, timer=timer)
        if len(_flags(again)) <= len(_flags(prof)):
            prof = again
        for f in _flags(prof):
            _say(f"profile check (kept): {f}")
    return prof


def _save(prof: dict, path: Path) -> bool:
    """Write ``prof`` to the cache unless it is impossible (then it serves this run
    only and is measured again on the next start)."""
    if (prof.get("sanity") or {}).get("impossible"):
        _say(f"not caching an impossible profile (faster than the roofline allows): {path}")
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(prof, indent=1))
    except OSError as e:
        _say(f"cannot write the profile cache ({e}); the profile serves this run only")
        return False
    return True


def load_or_profile(engine, auto: bool, timer=None) -> HardwareModel | None:
    """The engine's hardware model: explicit file, cached profile, or (auto) measure
    now. A cached profile the sanity check flagged is measured again (when auto)."""
    if engine.cfg.profile:
        _say(f"using the hardware profile {engine.cfg.profile}")
        return HardwareModel.load(engine.cfg.profile)
    path = cached_profile_path(engine)
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
            hw = HardwareModel.from_dict(raw, source=str(path))
        except (OSError, ValueError, KeyError, TypeError):
            _say(f"the cached hardware profile {path} is unreadable; measuring again")
        else:
            if not (auto and _flags(raw)):
                _say(f"using the cached hardware profile {path} (measured {raw.get('created')})")
                return hw
            _say(f"the cached hardware profile {path} was flagged; measuring again")
    if not auto:
        return None
    reps = 3
    _say(
        f"measuring the hardware profile: {_what(engine, reps)}; caching it in {path} "
        "(once per machine, model pair, device and dtype)"
    )
    t0 = time.perf_counter()
    prof = measure_checked(engine, reps=reps, timer=timer)
    saved = _save(prof, path)
    took = time.perf_counter() - t0
    _say(
        f"measured the hardware profile in {took:.1f} s"
        + (f"; cached in {path} (later starts load it)" if saved else "; not cached")
    )
    return HardwareModel.from_dict(prof, source=str(path))


def log_drift(engine) -> None:
    """Say on stderr that the machine has drifted from the profile."""
    d = engine.drift
    _say(
        f"measured iteration times are {d.median():.2f}x the profile's over the last "
        f"{d.cfg.window} steps (outside [{d.cfg.low:g}, {d.cfg.high:g}]): the profile is "
        "measured again at the next idle moment"
    )


def remeasure(engine, reps: int = 3, timer=None) -> HardwareModel:
    """A fresh profile of the engine's pair after drift: the forward passes measured
    again (no request is stepped, so the engine's statistics stay as they are), the
    host overheads of the old profile scaled by the new / old one-token pass. Written
    to the cache (not over an explicitly named profile file)."""
    old = engine.hw
    path = cached_profile_path(engine)
    _say(f"re-measuring the hardware profile after drift: {_what(engine, reps)}; cache {path}")
    prof = measure(engine.target, engine.draft, reps=reps, timer=timer)
    new = HardwareModel.from_dict(prof)
    scale = float(new.verify_latency(1)) / max(float(old.verify_latency(1)), 1e-9)
    prof["overhead_ms"] = round(old.overhead_ms * scale, 4)
    if engine.draft is not None:
        prof["draft_host_ms"] = round(old.draft_host_ms * scale, 5)
    prof["remeasured_after_drift"] = {"scale": round(scale, 4)}
    for f in _flags(prof):
        _say(f"profile check: {f}")
    saved = False if engine.cfg.profile else _save(prof, path)
    hw = HardwareModel.from_dict(prof, source=str(path) if saved else "remeasured")
    _say(
        f"re-measured: one-token verify {float(new.verify_latency(1)):.3g} ms "
        f"({scale:.2f}x the old profile), unloaded TPOT {hw.unloaded_tpot_ms():.3g} ms"
        + (f"; cached in {path}" if saved else "; not cached")
    )
    return hw
